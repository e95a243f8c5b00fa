//! `throttlegate check`: one ShouldRateLimit call to a running service,
//! its answer printed as JSON. Invariant: the exit code says the answer
//! (0 OK, 3 OVER_LIMIT, 1 no answer), so scripts need not parse it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use crate::transport::grpc::client;

/// The flags of `check`.
#[derive(Debug, Args)]
pub(super) struct CheckArgs {
    /// The service's gRPC address: `host:port`, or `http://host:port`, or
    /// `https://host:port` (TLS).
    #[arg(long, default_value = "localhost:8081")]
    addr: String,
    /// The request's domain.
    #[arg(long)]
    domain: String,
    /// One descriptor, `key=value[,key=value...]`, entries outermost first;
    /// repeat for more descriptors. Inside a key or value write a comma as
    /// `\,`, an equals sign as `\=`, a backslash as `\\` (a value may
    /// also hold `=` unescaped: an entry splits at its first).
    #[arg(long = "descriptor", value_name = "KEY=VALUE[,...]", required = true, value_parser = parse_descriptor)]
    descriptors: Vec<DescriptorArg>,
    /// Units the request costs (its `hits_addend`).
    #[arg(long, default_value_t = 1)]
    hits: u32,
    /// TLS (implied by an `https://` address or any of the flags below).
    #[arg(long)]
    tls: bool,
    /// Trust the CA certificates in this PEM file [default: the public web
    /// roots].
    #[arg(long, value_name = "FILE")]
    ca_cert: Option<PathBuf>,
    /// Mutual TLS: this client certificate chain (PEM); needs --key.
    #[arg(long, value_name = "FILE", requires = "key")]
    cert: Option<PathBuf>,
    /// The private key of --cert (PEM).
    #[arg(long, value_name = "FILE", requires = "cert")]
    key: Option<PathBuf>,
    /// The name the server's certificate must be valid for [default: the
    /// address's host].
    #[arg(long, value_name = "NAME")]
    server_name: Option<String>,
    /// Bound on connecting and answering together.
    #[arg(long, default_value_t = 5_000)]
    timeout_ms: u64,
}

/// One `--descriptor`'s entries.
#[derive(Debug, Clone)]
struct DescriptorArg(Vec<(String, String)>);

fn parse_descriptor(text: &str) -> Result<DescriptorArg, String> {
    client::parse_descriptor(text).map(DescriptorArg)
}

/// `check`: the answer on stdout; see `Command::Check` for exit codes.
pub(super) fn check(args: CheckArgs) -> ExitCode {
    let tls_flags =
        args.tls || args.ca_cert.is_some() || args.cert.is_some() || args.server_name.is_some();
    let call = client::Call {
        addr: args.addr,
        tls: tls_flags.then_some(client::ClientTls {
            ca: args.ca_cert,
            cert: args.cert,
            key: args.key,
            server_name: args.server_name,
        }),
        domain: args.domain,
        descriptors: args.descriptors.into_iter().map(|it| it.0).collect(),
        hits: args.hits,
        timeout: Duration::from_millis(args.timeout_ms),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(it) => it,
        Err(err) => {
            eprintln!("error: cannot start a runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(client::check(&call)) {
        Ok(answer) => {
            println!("{}", answer.json);
            if answer.over_limit {
                ExitCode::from(3)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
