//! Bucket ids as a stream keeps them: each once (the key of the stream's
//! bucket and the id its answers carry are one allocation), within
//! [`MAX_BUCKET_ID_BYTES`] each and [`MAX_BUCKET_BYTES_PER_STREAM`] per
//! stream as [`stored_bytes`] counts them.

use std::sync::Arc;

use tonic::Status;

use crate::proto::envoy::service::rate_limit_quota::v3 as rlqs;
use crate::quota::MAX_BUCKET_ENTRIES;

/// Bytes of one bucket id's keys and values at most.
pub const MAX_BUCKET_ID_BYTES: usize = 4096;
/// Bytes one stream may hold for the bucket ids it reported, counted as
/// [`stored_bytes`] does.
pub const MAX_BUCKET_BYTES_PER_STREAM: usize = 2 * 1024 * 1024;
/// Counted per bucket on top of its keys and values: its place in the
/// stream's map, slot list and outbox, its member and the id's header.
pub const BUCKET_OVERHEAD_BYTES: usize = 256;
/// Counted per entry of a bucket id on top of its bytes.
pub const ENTRY_OVERHEAD_BYTES: usize = 32;

/// A bucket id as a stream keeps it, once: its entries sorted by key.
pub(super) type StoredId = Arc<[(Box<str>, Box<str>)]>;

/// What a bucket id counts against [`MAX_BUCKET_BYTES_PER_STREAM`]: its
/// keys' and values' bytes, [`ENTRY_OVERHEAD_BYTES`] per entry and
/// [`BUCKET_OVERHEAD_BYTES`].
pub fn stored_bytes(entries: &[(&str, &str)]) -> usize {
    BUCKET_OVERHEAD_BYTES
        + entries
            .iter()
            .map(|(key, value)| key.len() + value.len() + ENTRY_OVERHEAD_BYTES)
            .sum::<usize>()
}

/// `id` as the wire's bucket id, for an answer.
pub(super) fn bucket_id(id: &StoredId) -> rlqs::BucketId {
    rlqs::BucketId {
        bucket: id
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect(),
    }
}

/// A bucket id's entries within bounds, none empty.
pub(super) fn validate_bucket(id: &rlqs::BucketId) -> Result<(), Status> {
    if id.bucket.is_empty() {
        return Err(Status::invalid_argument("a bucket_id without entries"));
    }
    if id.bucket.len() > MAX_BUCKET_ENTRIES {
        return Err(Status::invalid_argument(format!(
            "a bucket_id with {} entries (at most {MAX_BUCKET_ENTRIES})",
            id.bucket.len()
        )));
    }
    if id
        .bucket
        .iter()
        .any(|(key, value)| key.is_empty() || value.is_empty())
    {
        return Err(Status::invalid_argument(
            "a bucket_id with an empty key or value",
        ));
    }
    let bytes: usize = id.bucket.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_BUCKET_ID_BYTES {
        return Err(Status::resource_exhausted(format!(
            "a bucket_id of {bytes} bytes (at most {MAX_BUCKET_ID_BYTES})"
        )));
    }
    Ok(())
}
