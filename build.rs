//! Compiles our trimmed Envoy rate-limit, rate-limit-quota and xDS protos (no system `protoc` needed).

use prost_types::FileDescriptorSet;
use prost_types::field_descriptor_proto::Type;

/// The descriptor entry message whose `key` and `value` are generated as bytes.
const ENTRY_PACKAGE: &str = "envoy.extensions.common.ratelimit.v3";
const ENTRY_MESSAGE: [&str; 2] = ["RateLimitDescriptor", "Entry"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/envoy/service/ratelimit/v3/rls.proto",
        "proto/envoy/extensions/common/ratelimit/v3/ratelimit.proto",
        "proto/envoy/type/v3/ratelimit_unit.proto",
        "proto/envoy/config/core/v3/base.proto",
        "proto/envoy/service/rate_limit_quota/v3/rlqs.proto",
        "proto/envoy/type/v3/ratelimit_strategy.proto",
        "proto/envoy/type/v3/token_bucket.proto",
    ];
    let descriptors = protox::compile(protos, ["proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // Reflection serves the protos as Envoy publishes them (`string`), so
    // grpcurl and other clients see the real contract; only the services
    // the server offers (the xDS protos below are a client's).
    std::fs::write(
        out_dir.join("rls_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    // The rules over xDS: the aggregated discovery stream and the
    // RateLimitConfig resource it carries.
    let xds = [
        "proto/envoy/service/discovery/v3/ads.proto",
        "proto/ratelimit/config/ratelimit/v3/rls_conf.proto",
    ];
    let descriptors = protox::compile(protos.into_iter().chain(xds), ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Buffers sized for rate-limit messages (src/proto.rs).
        .codec_path("crate::proto::codec::SmallBuffers")
        .compile_fds(entry_fields_as_bytes(descriptors)?)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}

/// The set used for code generation: descriptor entry keys and values typed
/// `bytes`. `string` and `bytes` share one wire encoding, but prost refuses
/// to decode a `string` that is not UTF-8, and Envoy copies header bytes
/// (any byte but NUL, CR, LF) into these fields unchecked.
fn entry_fields_as_bytes(
    mut descriptors: FileDescriptorSet,
) -> Result<FileDescriptorSet, Box<dyn std::error::Error>> {
    let [outer, inner] = ENTRY_MESSAGE;
    let entry = descriptors
        .file
        .iter_mut()
        .filter(|file| file.package() == ENTRY_PACKAGE)
        .flat_map(|file| file.message_type.iter_mut())
        .filter(|message| message.name() == outer)
        .flat_map(|message| message.nested_type.iter_mut())
        .find(|message| message.name() == inner)
        .ok_or_else(|| format!("{ENTRY_PACKAGE}.{outer}.{inner} not found in proto/"))?;
    for name in ["key", "value"] {
        let field = entry
            .field
            .iter_mut()
            .find(|field| field.name() == name)
            .ok_or_else(|| format!("{ENTRY_PACKAGE}.{outer}.{inner} has no field {name}"))?;
        if field.r#type() != Type::String {
            return Err(format!("{outer}.{inner}.{name} is not a string field").into());
        }
        field.set_type(Type::Bytes);
    }
    Ok(descriptors)
}
