//! The repository's files agree with the binary: the docs (links, paths,
//! flags, runnable blocks), the Envoy example and the deployment manifests.

#[path = "../support/mod.rs"]
mod support;

mod docs;
mod envoy_example;
mod manifests;
