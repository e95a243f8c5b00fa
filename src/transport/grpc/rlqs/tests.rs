use super::*;
use crate::clock::ManualClock;
use crate::metrics::Metrics;
use crate::testing::{default_options, limiter, memory_backend, rules_from};

#[tokio::test]
async fn a_bucket_id_is_kept_once_and_counted_once() {
    let clock = ManualClock::new(0);
    let rules = rules_from(
        "ids.yaml",
        "domain: d\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    );
    let limiter = limiter(
        rules,
        memory_backend(&clock),
        default_options(),
        Metrics::new(),
    );
    let book = Arc::new(QuotaBook::new(Arc::new(clock)));
    let (_control, shutdown) = crate::transport::grpc::shutdown_channel();
    let service = QuotaService::new(Arc::new(limiter), book, &Metrics::new(), shutdown);
    let seat = service.seats.admit(None).unwrap();
    let members = service.quotas.open(None);
    let shared = Arc::new(StreamShared {
        outbox: members.outbox().clone(),
        ids: Mutex::new(Vec::new()),
    });
    let mut stream = QuotaStream::new(service, shared.clone(), seat, members);
    let value = "v".repeat(1000);
    let entries = [("tenant", value.as_str())];
    let (key, bucket) = stream.bucket(&entries).unwrap();
    let (again, _) = stream.bucket(&entries).unwrap();
    // The map's key and the id the answers carry are one allocation:
    // held by the map, the id list and the two handles here.
    assert!(Arc::ptr_eq(&key, &again));
    assert!(Arc::ptr_eq(&key, &lock(&shared.ids)[bucket as usize]));
    assert_eq!(Arc::strong_count(&key), 4);
    assert_eq!(stream.stored_bytes, stored_bytes(&entries));
    assert_eq!(stored_bytes(&entries), 256 + 32 + "tenant".len() + 1000);
}
