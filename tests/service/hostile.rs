//! Hostile clients against the built binary: unfinished streams, silent and slow peers, descriptor exhaustion.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support;
use crate::support::process::{Serve, ServiceProcess};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitResponse;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const CONFIG: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 1000000}\n";

/// Linux reports CPU times in /proc in USER_HZ ticks, 100 a second.
const TICKS_PER_SECOND: u64 = 100;

// === the server process ===

/// Starts `serve` with `extra` flags, under `prlimit --nofile=soft:hard`
/// if `nofile` is given, and waits until it answers a decision.
async fn start(extra: &[&str], nofile: Option<(u64, u64)>) -> ServiceProcess {
    let mut serve = Serve::yaml(CONFIG)
        .args(&["--watch-config", "off"])
        .args(extra)
        .rust_log("info");
    if let Some((soft, hard)) = nofile {
        serve = serve.nofile(soft, hard);
    }
    let mut server = serve.spawn();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut client = server.client().await;
        if client.should_rate_limit(alice()).await.is_ok() {
            return server;
        }
        assert!(Instant::now() < deadline, "not serving:\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn alice() -> throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest {
    support::service::one_entry_request("api", "user", "alice")
}

/// Reads (and discards) until the server closes the connection; how long
/// that took from `since`. Panics if it is still open after `within`.
async fn closed_after(stream: &mut TcpStream, since: Instant, within: Duration) -> Duration {
    let mut buf = [0u8; 4096];
    let res = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(res.is_ok(), "still open after {within:?}");
    since.elapsed()
}

// === HTTP/2 frames, written by hand so a client can break the rules ===

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const REFUSED_STREAM: u32 = 0x7;

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap();
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The HPACK block of a ShouldRateLimit call: indexed `:method POST` and
/// `:scheme http`, the rest literal without indexing and without Huffman
/// coding, so every block is the same bytes.
fn request_header_block() -> Vec<u8> {
    fn string(out: &mut Vec<u8>, text: &[u8]) {
        out.push(u8::try_from(text.len()).unwrap());
        out.extend_from_slice(text);
    }
    let mut block = vec![0x83, 0x86];
    block.push(0x04); // :path, static index 4
    string(
        &mut block,
        b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    block.push(0x01); // :authority, static index 1
    string(&mut block, b"localhost");
    block.extend_from_slice(&[0x0f, 0x10]); // content-type, static index 31
    string(&mut block, b"application/grpc");
    block.push(0x00); // a new name
    string(&mut block, b"te");
    string(&mut block, b"trailers");
    block
}

struct Frame {
    kind: u8,
    flags: u8,
    stream_id: u32,
    payload: Vec<u8>,
}

async fn read_frame(reader: &mut (impl AsyncReadExt + Unpin)) -> Option<Frame> {
    let mut head = [0u8; 9];
    reader.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).await.ok()?;
    Some(Frame {
        kind: head[3],
        flags: head[4],
        stream_id: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        payload,
    })
}

/// Sends the preface and empty SETTINGS, reads the server's SETTINGS,
/// acknowledges them, and returns SETTINGS_MAX_CONCURRENT_STREAMS if
/// advertised.
async fn h2_handshake(stream: &mut TcpStream) -> Option<u32> {
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    stream.write_all(&hello).await.unwrap();
    loop {
        let frame_in = tokio::time::timeout(Duration::from_secs(10), read_frame(stream))
            .await
            .expect("server SETTINGS within 10 s")
            .expect("server SETTINGS");
        if frame_in.kind == SETTINGS && frame_in.flags & ACK == 0 {
            stream
                .write_all(&frame(SETTINGS, ACK, 0, &[]))
                .await
                .unwrap();
            return frame_in.payload.chunks_exact(6).find_map(|setting| {
                (u16::from_be_bytes([setting[0], setting[1]]) == SETTINGS_MAX_CONCURRENT_STREAMS)
                    .then(|| u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]))
            });
        }
    }
}

/// A connection that never sends a byte: how long until the server closes
/// it (at most `within`).
async fn silent_peer_closed_after(addr: SocketAddr, within: Duration) -> Duration {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    closed_after(&mut stream, Instant::now(), within).await
}

/// A gRPC connection past its handshake with the headers of one call sent
/// on stream 1, and its body never.
async fn unfinished_call(grpc: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(grpc).await.unwrap();
    h2_handshake(&mut stream).await;
    let block = request_header_block();
    stream
        .write_all(&frame(HEADERS, END_HEADERS, 1, &block))
        .await
        .unwrap();
    stream
}

/// How long after `sent` the server answered stream 1 (its response
/// headers or a reset); `None` if not within `within`.
async fn answered_after(
    stream: &mut TcpStream,
    sent: Instant,
    within: Duration,
) -> Option<Duration> {
    tokio::time::timeout(within, async {
        loop {
            let frame_in = read_frame(stream)
                .await
                .expect("connection closed while its request was open");
            if frame_in.stream_id == 1 && matches!(frame_in.kind, HEADERS | RST_STREAM) {
                return sent.elapsed();
            }
        }
    })
    .await
    .ok()
}

/// What the server answered to a flood of streams.
#[derive(Debug, Default)]
struct FloodReplies {
    refused: Vec<u32>,
    other_resets: Vec<(u32, u32)>,
    goaway: Option<(u32, u32)>,
    closed: bool,
}

// === tests ===

/// 20,000 streams opened on one connection with headers sent and bodies
/// never finished: the server advertises its limit, refuses the streams
/// past it, keeps its memory, and keeps answering another client quickly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_streams_past_the_advertised_limit_are_refused_and_others_served() {
    const LIMIT: u32 = 100;
    const STREAMS: u32 = 20_000;
    let mut server = start(
        &[
            "--grpc-max-concurrent-streams",
            &LIMIT.to_string(),
            // Neither may end the hanging streams during the test.
            "--grpc-request-timeout-ms",
            "120000",
            "--grpc-keepalive-interval-ms",
            "120000",
        ],
        None,
    )
    .await;
    let rss_before = server.rss_kib();

    let mut hostile = TcpStream::connect(server.grpc).await.unwrap();
    let advertised = h2_handshake(&mut hostile).await;
    assert_eq!(advertised, Some(LIMIT), "SETTINGS_MAX_CONCURRENT_STREAMS");
    let (mut reader, mut writer) = hostile.into_split();
    let replies = tokio::spawn(async move {
        let mut replies = FloodReplies::default();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let next = tokio::time::timeout_at(deadline, read_frame(&mut reader)).await;
            let Ok(Some(frame_in)) = next else {
                replies.closed = matches!(next, Ok(None));
                return replies;
            };
            match frame_in.kind {
                RST_STREAM => {
                    let code = u32::from_be_bytes(frame_in.payload[..4].try_into().unwrap());
                    if code == REFUSED_STREAM {
                        replies.refused.push(frame_in.stream_id);
                    } else {
                        replies.other_resets.push((frame_in.stream_id, code));
                    }
                }
                GOAWAY => {
                    let last = u32::from_be_bytes(frame_in.payload[..4].try_into().unwrap());
                    let code = u32::from_be_bytes(frame_in.payload[4..8].try_into().unwrap());
                    replies.goaway = Some((last & 0x7fff_ffff, code));
                }
                _ => {}
            }
            let answered = replies.refused.len() + replies.other_resets.len();
            if replies.goaway.is_some() || answered as u32 >= STREAMS - LIMIT {
                return replies;
            }
        }
    });
    let block = request_header_block();
    let flood = tokio::spawn(async move {
        for chunk in 0..STREAMS / 1000 {
            let mut batch = Vec::new();
            for n in chunk * 1000..(chunk + 1) * 1000 {
                // Headers complete, no END_STREAM: the request stays open.
                batch.extend(frame(HEADERS, END_HEADERS, 2 * n + 1, &block));
            }
            if writer.write_all(&batch).await.is_err() {
                break;
            }
        }
        writer
    });

    // Meanwhile another client is answered, on its own connection.
    let mut client = server.client().await;
    let mut latencies = Vec::new();
    for _ in 0..1000 {
        let started = Instant::now();
        let res = client.should_rate_limit(alice()).await.expect("rpc");
        latencies.push(started.elapsed());
        assert_eq!(res.into_inner().overall_code, Code::Ok as i32);
    }
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    let p99 = latencies[latencies.len() * 99 / 100];

    let writer = flood.await.unwrap();
    let replies = replies.await.unwrap();
    let rss_during = server.rss_kib();
    drop(writer);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = server.rss_kib();
    eprintln!(
        "refused {} streams, other resets {:?}, goaway {:?}, closed {}; \
         second client p50 {p50:?} p99 {p99:?} max {:?}; \
         rss before {rss_before} KiB, during {rss_during} KiB, after {rss_after} KiB",
        replies.refused.len(),
        replies.other_resets.len(),
        replies.goaway,
        replies.closed,
        latencies.last().unwrap(),
    );

    // The first LIMIT streams (ids 1..2*LIMIT-1) are open; every refusal
    // is of a later one, and refusals happened.
    assert!(!replies.refused.is_empty(), "{replies:?}");
    assert!(
        replies.refused.iter().all(|id| *id > 2 * LIMIT - 1),
        "a stream within the limit was refused: {:?}",
        replies.refused.iter().min()
    );
    assert!(
        replies.other_resets.is_empty(),
        "{:?}",
        replies.other_resets
    );
    // Each stream past the limit is refused, until the server has refused
    // enough to call the peer abusive and sends GOAWAY.
    let past_limit = STREAMS - LIMIT;
    match replies.goaway {
        Some((last_stream_id, _code)) => assert!(
            // The streams within the limit were all taken.
            last_stream_id >= 2 * LIMIT - 1 && replies.refused.len() >= 1000,
            "{replies:?}"
        ),
        None => assert_eq!(replies.refused.len() as u32, past_limit),
    }
    // Unbounded, 20,000 open streams took 170 MB; a generous bound for a
    // loaded machine (a debug build).
    assert!(
        rss_during < rss_before + 64 * 1024,
        "rss grew from {rss_before} KiB to {rss_during} KiB"
    );
    assert!(
        p99 < Duration::from_secs(1),
        "second client p99 {p99:?} (p50 {p50:?})"
    );
    // The server is still fine after the hostile connection is gone.
    let mut client = server.client().await;
    client.should_rate_limit(alice()).await.expect("rpc after");
}

/// Each kind of stalled peer is closed once its timeout passes, and not
/// before; a gRPC connection past its first request is not cut, but its
/// unfinished request is ended by the request timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_slow_peers_are_closed_within_the_configured_timeouts() {
    let server = start(
        &[
            "--grpc-handshake-timeout-ms",
            "1000",
            "--http-header-timeout-ms",
            "1000",
            "--http-body-timeout-ms",
            "1000",
            "--http-idle-timeout-ms",
            "1500",
            "--grpc-request-timeout-ms",
            "3000",
        ],
        None,
    )
    .await;
    let grpc = server.grpc;
    let http = server.http;
    // Well past every timeout, still far from any chance of a hang.
    let within = Duration::from_secs(10);

    let grpc_silent = tokio::spawn(silent_peer_closed_after(grpc, within));
    let grpc_preface_only = tokio::spawn(async move {
        let mut stream = TcpStream::connect(grpc).await.unwrap();
        let started = Instant::now();
        h2_handshake(&mut stream).await;
        closed_after(&mut stream, started, within).await
    });
    let grpc_partial_headers = tokio::spawn(async move {
        let mut stream = TcpStream::connect(grpc).await.unwrap();
        let started = Instant::now();
        h2_handshake(&mut stream).await;
        // No END_HEADERS: the header block is never complete.
        let block = request_header_block();
        stream
            .write_all(&frame(HEADERS, 0, 1, &block[..10]))
            .await
            .unwrap();
        closed_after(&mut stream, started, within).await
    });
    let grpc_unfinished_request = tokio::spawn(async move {
        let mut stream = unfinished_call(grpc).await;
        let sent = Instant::now();
        // The request arrived, so the handshake timeout no longer applies;
        // its body never comes, so the request timeout ends the stream.
        let answer = answered_after(&mut stream, sent, within)
            .await
            .expect("no answer to the unfinished request");
        // Still open after the request ended.
        stream
            .write_all(&frame(SETTINGS, 0, 0, &[]))
            .await
            .expect("connection still open");
        answer
    });
    let http_silent = tokio::spawn(silent_peer_closed_after(http, within));
    let http_slowloris = tokio::spawn(async move {
        let mut stream = TcpStream::connect(http).await.unwrap();
        let started = Instant::now();
        stream
            .write_all(b"GET /healthcheck HTTP/1.1\r\nHost: test\r\n")
            .await
            .unwrap();
        // One header byte every 100 ms, never the blank line.
        let trickle = async {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if stream.write_all(b"X").await.is_err() {
                    return;
                }
                // A closed peer is seen by reading.
                let mut buf = [0u8; 64];
                let read = tokio::time::timeout(Duration::from_millis(1), stream.read(&mut buf));
                if let Ok(Ok(0) | Err(_)) = read.await {
                    return;
                }
            }
        };
        tokio::time::timeout(within, trickle)
            .await
            .expect("slowloris connection still open");
        started.elapsed()
    });
    let http_idle = tokio::spawn(async move {
        let mut stream = TcpStream::connect(http).await.unwrap();
        stream
            .write_all(b"GET /healthcheck HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        // Read the whole answer (`OK\n`, 3 bytes of body) before idling.
        let mut response = Vec::new();
        let mut buf = [0u8; 1024];
        while !response.ends_with(b"\r\n\r\nOK\n") {
            let n = tokio::time::timeout(within, stream.read(&mut buf))
                .await
                .expect("healthcheck answer")
                .unwrap();
            assert!(n > 0, "closed before answering");
            response.extend_from_slice(&buf[..n]);
        }
        // Within the idle timeout the connection serves another request,
        // and the idle timeout starts again after it.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        stream
            .write_all(b"GET /healthcheck HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        response.clear();
        while !response.ends_with(b"\r\n\r\nOK\n") {
            let n = tokio::time::timeout(within, stream.read(&mut buf))
                .await
                .expect("second healthcheck answer")
                .unwrap();
            assert!(
                n > 0,
                "keep-alive connection closed before its idle timeout"
            );
            response.extend_from_slice(&buf[..n]);
        }
        closed_after(&mut stream, Instant::now(), within).await
    });
    let http_unfinished_body = tokio::spawn(async move {
        let mut stream = TcpStream::connect(http).await.unwrap();
        stream
            .write_all(
                b"POST /json HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{\"domain\":",
            )
            .await
            .unwrap();
        let started = Instant::now();
        closed_after(&mut stream, started, within).await
    });

    let grpc_silent = grpc_silent.await.unwrap();
    let grpc_preface_only = grpc_preface_only.await.unwrap();
    let grpc_partial_headers = grpc_partial_headers.await.unwrap();
    let grpc_unfinished_request = grpc_unfinished_request.await.unwrap();
    let http_silent = http_silent.await.unwrap();
    let http_slowloris = http_slowloris.await.unwrap();
    let http_idle = http_idle.await.unwrap();
    let http_unfinished_body = http_unfinished_body.await.unwrap();
    eprintln!(
        "closed after: grpc silent {grpc_silent:?}, preface only {grpc_preface_only:?}, \
         partial headers {grpc_partial_headers:?}, unfinished request answered after \
         {grpc_unfinished_request:?}; http silent {http_silent:?}, \
         slowloris {http_slowloris:?}, idle {http_idle:?}, unfinished body {http_unfinished_body:?}"
    );
    // Not before the timeout (less a little for timer granularity)...
    let at_least = |it: Duration, timeout_ms: u64, what: &str| {
        assert!(
            it >= Duration::from_millis(timeout_ms - 100),
            "{what} closed after {it:?}, before its {timeout_ms} ms timeout"
        );
    };
    at_least(grpc_silent, 1000, "silent grpc connection");
    at_least(grpc_preface_only, 1000, "grpc connection without a request");
    at_least(
        grpc_partial_headers,
        1000,
        "grpc connection with partial headers",
    );
    at_least(http_silent, 1000, "silent http connection");
    at_least(http_slowloris, 1000, "slowloris connection");
    at_least(http_idle, 1500, "idle keep-alive connection");
    at_least(http_unfinished_body, 1000, "unfinished body");
    // ...and (closed_after checked it) well within `within` after it.
}

/// Under a low descriptor limit, idle HTTP connections take every
/// descriptor: the existing gRPC client is still answered, the accept
/// loops back off without burning CPU, the condition is logged and
/// counted, and a new gRPC client is admitted once descriptors free up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_exhaustion_backs_off_is_logged_and_counted_and_recovers() {
    // The binary raises the soft limit (128) to the hard one (256).
    let mut server = start(
        &[
            // Caps far above the descriptors, so that they run out.
            "--http-max-connections",
            "100000",
            "--grpc-max-connections",
            "100000",
            "--http-header-timeout-ms",
            "120000",
        ],
        Some((128, 256)),
    )
    .await;
    let log = server.log();
    assert!(
        log.contains("file descriptor limit")
            && log.contains("soft=256")
            && log.contains("previous_soft=128"),
        "{log}"
    );

    let mut existing = server.client().await;
    existing.should_rate_limit(alice()).await.expect("rpc");

    // More idle connections than the server has descriptors: the kernel
    // completes them all; the server accepts until it runs out.
    let exhausted_since = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(TcpStream::connect(server.http).await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while !server.log().contains("out of file descriptors") {
        assert!(
            Instant::now() < deadline,
            "never ran out:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A new gRPC client now waits: its connection cannot be accepted.
    let grpc = server.grpc;
    let newcomer = tokio::spawn(async move {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .unwrap()
            .connect_lazy();
        let mut client = RateLimitServiceClient::new(channel);
        let res =
            tokio::time::timeout(Duration::from_secs(60), client.should_rate_limit(alice())).await;
        (Instant::now(), res)
    });

    // While exhausted: the existing client is answered and the process
    // mostly sleeps.
    let ticks_before = server.cpu_ticks();
    let window = Instant::now();
    let mut answered = 0;
    while window.elapsed() < Duration::from_secs(3) {
        let res = tokio::time::timeout(Duration::from_secs(5), existing.should_rate_limit(alice()))
            .await
            .expect("existing client answered within 5 s")
            .expect("rpc while exhausted");
        assert_eq!(res.into_inner().overall_code, Code::Ok as i32);
        answered += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu = server.cpu_ticks() - ticks_before;
    let wall = window.elapsed();
    assert!(
        !newcomer.is_finished(),
        "a new client was served while out of descriptors"
    );

    let released = Instant::now();
    drop(idle);
    let (served_at, res) = newcomer.await.unwrap();
    let res = res.expect("new client answered within 60 s of descriptors freeing up");
    assert_eq!(res.expect("rpc").into_inner().overall_code, Code::Ok as i32);
    let admitted_after = served_at.saturating_duration_since(released);

    let descriptors_http = server
        .metric("throttlegate_accept_errors_total{listener=\"http\",kind=\"descriptors\"}")
        .await;
    let descriptors_grpc = server
        .metric("throttlegate_accept_errors_total{listener=\"grpc\",kind=\"descriptors\"}")
        .await;
    let log = server.log();
    let lines = log.matches("out of file descriptors").count();
    eprintln!(
        "{answered} answers while exhausted; cpu {cpu} ticks in {wall:?}; newcomer served \
         {admitted_after:?} after release; accept errors http {descriptors_http}, grpc \
         {descriptors_grpc}; {lines} log lines"
    );
    // A spinning accept loop takes a whole core: 100 ticks a second.
    let allowed = wall.as_secs_f64() * TICKS_PER_SECOND as f64 / 4.0;
    assert!(
        (cpu as f64) < allowed,
        "{cpu} ticks of CPU in {wall:?} while out of descriptors (at most {allowed})"
    );
    assert!(descriptors_http >= 1.0 && descriptors_grpc >= 1.0);
    // At most one line a second per listener, with a count of the others,
    // rather than one line per failed accept.
    let seconds = exhausted_since.elapsed().as_secs() + 2;
    assert!(
        (lines as u64) <= 2 * seconds,
        "{lines} log lines in {seconds} s"
    );
    assert!(
        descriptors_http + descriptors_grpc > lines as f64,
        "{lines} log lines for {descriptors_http} + {descriptors_grpc} failures"
    );
}

/// What held before the limits must keep holding: thousands of concurrent
/// calls on one connection all finish (the client queues past the
/// advertised limit), and a rapid-reset flood gets GOAWAY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_finishing_streams_are_served_and_rapid_reset_gets_goaway() {
    let mut server = start(&[], None).await;
    let client = server.client().await;
    let calls: Vec<_> = (0..5000)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move { client.should_rate_limit(alice()).await })
        })
        .collect();
    for call in calls {
        let res = call.await.unwrap().expect("rpc");
        assert_eq!(res.into_inner().overall_code, Code::Ok as i32);
    }

    let mut stream = TcpStream::connect(server.grpc).await.unwrap();
    h2_handshake(&mut stream).await;
    let block = request_header_block();
    let mut flood = Vec::new();
    for n in 0..2000u32 {
        flood.extend(frame(HEADERS, END_HEADERS, 2 * n + 1, &block));
        // CANCEL
        flood.extend(frame(RST_STREAM, 0, 2 * n + 1, &0x8u32.to_be_bytes()));
    }
    let (mut reader, mut writer) = stream.into_split();
    tokio::spawn(async move {
        let _ = writer.write_all(&flood).await;
        // Keep the write half open until the test ends.
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let goaway = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(frame_in) = read_frame(&mut reader).await {
            if frame_in.kind == GOAWAY {
                return true;
            }
        }
        false
    })
    .await
    .expect("an answer to the flood within 10 s");
    assert!(goaway, "the connection closed without GOAWAY");
}

/// A gRPC peer that stops answering PINGs is closed by keepalive; one that
/// answers them but keeps a stream open forever gets GOAWAY at the maximum
/// connection age and is closed after the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_and_connection_age_end_dead_and_old_connections() {
    const PING: u8 = 0x6;
    let server = start(
        &[
            "--grpc-keepalive-interval-ms",
            "500",
            "--grpc-keepalive-timeout-ms",
            "500",
            "--grpc-max-connection-age-ms",
            "4000",
            "--grpc-max-connection-age-grace-ms",
            "500",
            "--grpc-request-timeout-ms",
            "60000",
        ],
        None,
    )
    .await;
    let grpc = server.grpc;
    // A connection with one request whose body never comes, so only
    // keepalive or the connection age can end it.
    let open = move || unfinished_call(grpc);

    let silent = tokio::spawn(async move {
        let mut stream = open().await;
        let started = Instant::now();
        let mut pinged = false;
        let mut goaway = false;
        tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(frame_in) = read_frame(&mut stream).await {
                pinged |= frame_in.kind == PING && frame_in.flags & ACK == 0;
                goaway |= frame_in.kind == GOAWAY;
            }
        })
        .await
        .expect("a peer that never answers PING still open after 10 s");
        (started.elapsed(), pinged, goaway)
    });
    let answering = tokio::spawn(async move {
        let mut stream = open().await;
        let started = Instant::now();
        let mut goaway_after = None;
        tokio::time::timeout(Duration::from_secs(15), async {
            while let Some(frame_in) = read_frame(&mut stream).await {
                if frame_in.kind == PING && frame_in.flags & ACK == 0 {
                    let ack = frame(PING, ACK, 0, &frame_in.payload);
                    if stream.write_all(&ack).await.is_err() {
                        break;
                    }
                }
                if frame_in.kind == GOAWAY && goaway_after.is_none() {
                    goaway_after = Some(started.elapsed());
                }
            }
        })
        .await
        .expect("an old connection still open after 15 s");
        (started.elapsed(), goaway_after)
    });

    let (silent_closed, pinged, silent_goaway) = silent.await.unwrap();
    let (old_closed, goaway_after) = answering.await.unwrap();
    eprintln!(
        "no PING answers: closed after {silent_closed:?}; answering PINGs: GOAWAY after \
         {goaway_after:?}, closed after {old_closed:?}"
    );
    assert!(pinged, "the server never sent a PING");
    assert!(
        silent_closed < Duration::from_millis(3900),
        "the silent peer was closed by the connection age, not keepalive (goaway {silent_goaway})"
    );
    let goaway_after = goaway_after.expect("no GOAWAY at the maximum connection age");
    assert!(
        goaway_after >= Duration::from_millis(3900),
        "GOAWAY after {goaway_after:?}, before the maximum age"
    );
    assert!(old_closed >= goaway_after + Duration::from_millis(400));
}

/// A client's own `grpc-timeout`, shorter than the server's request
/// timeout, ends its unfinished call at the client's deadline: answered
/// (a status, or a reset) within a few seconds, where the server's own
/// timeout is a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_deadline_shorter_than_the_servers_ends_an_unfinished_call() {
    let server = start(&["--grpc-request-timeout-ms", "60000"], None).await;
    let mut stream = TcpStream::connect(server.grpc).await.unwrap();
    h2_handshake(&mut stream).await;
    let mut block = request_header_block();
    block.push(0x00); // a new name
    block.push(12);
    block.extend_from_slice(b"grpc-timeout");
    block.push(4);
    block.extend_from_slice(b"300m");
    let sent = Instant::now();
    stream
        .write_all(&frame(HEADERS, END_HEADERS, 1, &block))
        .await
        .unwrap();
    let answered = answered_after(&mut stream, sent, Duration::from_secs(20))
        .await
        .expect("no answer to the unfinished call within 20 s");
    assert!(
        answered >= Duration::from_millis(250) && answered < Duration::from_secs(10),
        "answered after {answered:?}, the client's deadline being 300 ms"
    );
}

// === the first request's deadline ===

const DATA: u8 = 0x0;
const END_STREAM: u8 = 0x1;
const PING_FRAME: u8 = 0x6;
const NO_ERROR: u32 = 0x0;

/// What a raw client saw of a connection that sent no request by the
/// handshake deadline.
#[derive(Debug, Default)]
struct Farewell {
    /// The GOAWAY frames, in order: (when, last stream id, error code).
    goaways: Vec<(Duration, u32, u32)>,
    /// The answer to a call sent right after the first GOAWAY, if any.
    answer: Option<RateLimitResponse>,
    /// Streams the server reset: (stream, code).
    resets: Vec<(u32, u32)>,
    /// When the server closed the connection.
    closed: Duration,
}

/// A client that completes the HTTP/2 handshake, sends nothing more, and
/// reads until the server closes: acknowledging PINGs if `acks`, and
/// sending a ShouldRateLimit call on stream 1 as soon as the first GOAWAY
/// arrives if `calls`.
async fn wait_for_farewell(grpc: SocketAddr, acks: bool, calls: bool) -> Farewell {
    let mut stream = TcpStream::connect(grpc).await.unwrap();
    let opened = Instant::now();
    h2_handshake(&mut stream).await;
    let mut seen = Farewell::default();
    let mut message = Vec::new();
    let read_all = async {
        while let Some(frame_in) = read_frame(&mut stream).await {
            match frame_in.kind {
                GOAWAY => {
                    let word = |at: usize| {
                        u32::from_be_bytes(frame_in.payload[at..at + 4].try_into().unwrap())
                    };
                    seen.goaways
                        .push((opened.elapsed(), word(0) & 0x7fff_ffff, word(4)));
                    if calls && seen.goaways.len() == 1 {
                        let body = prost::Message::encode_to_vec(&alice());
                        let mut call = frame(HEADERS, END_HEADERS, 1, &request_header_block());
                        let mut data = vec![0];
                        data.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
                        data.extend_from_slice(&body);
                        call.extend(frame(DATA, END_STREAM, 1, &data));
                        stream.write_all(&call).await.unwrap();
                    }
                }
                PING_FRAME if acks && frame_in.flags & ACK == 0 => {
                    let ack = frame(PING_FRAME, ACK, 0, &frame_in.payload);
                    if stream.write_all(&ack).await.is_err() {
                        break;
                    }
                }
                DATA if frame_in.stream_id == 1 => message.extend_from_slice(&frame_in.payload),
                RST_STREAM => {
                    let code = u32::from_be_bytes(frame_in.payload[..4].try_into().unwrap());
                    seen.resets.push((frame_in.stream_id, code));
                }
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read_all)
        .await
        .expect("a connection without a request still open after 10 s");
    seen.closed = opened.elapsed();
    if message.len() > 5 {
        seen.answer = Some(prost::Message::decode(&message[5..]).expect("a RateLimitResponse"));
    }
    seen
}

/// A connection that completed its HTTP/2 handshake and sends no request
/// by the handshake deadline gets GOAWAY (NO_ERROR) before it is closed,
/// never a bare close: a client that acknowledges the GOAWAY's PING gets
/// the final GOAWAY (no stream processed) and the connection closes at
/// once; one that ignores it is closed after the grace; a call that
/// crosses the first GOAWAY is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_a_request_by_the_deadline_gets_goaway_before_the_close() {
    const TIMEOUT_MS: u64 = 1000;
    let server = start(
        &["--grpc-handshake-timeout-ms", &TIMEOUT_MS.to_string()],
        None,
    )
    .await;
    let grpc = server.grpc;
    let ignoring = tokio::spawn(wait_for_farewell(grpc, false, false));
    let acking = tokio::spawn(wait_for_farewell(grpc, true, false));
    let calling = tokio::spawn(wait_for_farewell(grpc, true, true));
    let ignoring = ignoring.await.unwrap();
    let acking = acking.await.unwrap();
    let calling = calling.await.unwrap();
    eprintln!("ignoring: {ignoring:?}\nacking: {acking:?}\ncalling: {calling:?}");
    let deadline = Duration::from_millis(TIMEOUT_MS - 100);
    for (what, seen) in [
        ("ignoring", &ignoring),
        ("acking", &acking),
        ("calling", &calling),
    ] {
        let &(at, last, code) = seen
            .goaways
            .first()
            .unwrap_or_else(|| panic!("{what}: closed after {:?} without GOAWAY", seen.closed));
        assert!(at >= deadline, "{what}: GOAWAY after {at:?}");
        assert_eq!(code, NO_ERROR, "{what}");
        // The first GOAWAY refuses nothing yet: streams in flight are taken.
        assert_eq!(last, 0x7fff_ffff, "{what}");
        assert!(seen.resets.is_empty(), "{what}: {:?}", seen.resets);
    }
    // Ignored, the GOAWAY is followed by the close about a second later.
    assert_eq!(ignoring.goaways.len(), 1, "{ignoring:?}");
    assert!(
        ignoring.closed >= ignoring.goaways[0].0 + Duration::from_millis(800),
        "{ignoring:?}"
    );
    // Acknowledged, the final GOAWAY says no stream was processed, and the
    // connection closes without waiting for the grace.
    let &(_, last, code) = acking.goaways.last().unwrap();
    assert_eq!(
        (acking.goaways.len(), last, code),
        (2, 0, NO_ERROR),
        "{acking:?}"
    );
    assert!(
        acking.closed < acking.goaways[0].0 + Duration::from_millis(500),
        "{acking:?}"
    );
    // A call sent after the first GOAWAY is served, and the final GOAWAY
    // names its stream as processed.
    let answer = calling.answer.as_ref().expect("the crossing call answered");
    assert_eq!(answer.overall_code, Code::Ok as i32, "{answer:?}");
    let &(_, last, code) = calling.goaways.last().unwrap();
    assert_eq!(
        (calling.goaways.len(), last, code),
        (2, 1, NO_ERROR),
        "{calling:?}"
    );
}

/// tonic clients that open their channel at once and make their first
/// call around the handshake deadline (before it, as the GOAWAY goes out,
/// during the grace, after the close) are answered or told to retry: the
/// GOAWAY makes them reconnect instead of losing a call on a closed
/// connection. Within a few hundred milliseconds of the deadline a call
/// may fail the client's own way, which a retrying client (grpcio) retries
/// and tonic reports: queued as its connection closed and never sent
/// (hyper cancels it), or on a stream the final GOAWAY leaves out. A call
/// sent and then lost (a broken pipe, a reset: what a bare close causes)
/// fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_whose_first_call_meets_the_handshake_deadline_are_answered() {
    const TIMEOUT_MS: u64 = 1000;
    let server = start(
        &["--grpc-handshake-timeout-ms", &TIMEOUT_MS.to_string()],
        None,
    )
    .await;
    let grpc = server.grpc;
    // From 300 ms before the deadline to 2.5 s after it, 20 ms apart, and
    // every 2 ms right at it.
    let mut delays: Vec<u64> = (TIMEOUT_MS - 300..TIMEOUT_MS + 2500).step_by(20).collect();
    delays.extend((TIMEOUT_MS - 20..TIMEOUT_MS + 20).step_by(2));
    let calls: Vec<_> = delays
        .into_iter()
        .map(|delay| {
            tokio::spawn(async move {
                let opened = tokio::time::Instant::now();
                let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
                    .unwrap()
                    .connect()
                    .await
                    .expect("connect");
                let mut client = RateLimitServiceClient::new(channel);
                tokio::time::sleep_until(opened + Duration::from_millis(delay)).await;
                // tonic's client can keep a call it never sent waiting for
                // ever once the connection it was queued on is gone (seen
                // once near the deadline, with no connection left open to
                // the server): bounded, such a call counts as unprocessed.
                let call = client.should_rate_limit(alice());
                match tokio::time::timeout(Duration::from_secs(15), call).await {
                    Ok(res) => (delay, res),
                    Err(_) => (
                        delay,
                        Err(tonic::Status::deadline_exceeded("client gave up")),
                    ),
                }
            })
        })
        .collect();
    let total = calls.len();
    let mut unsent = Vec::new();
    let mut failed = Vec::new();
    for call in calls {
        let (delay, res) = call.await.unwrap();
        match res {
            Ok(answer) => assert_eq!(answer.into_inner().overall_code, Code::Ok as i32),
            Err(status)
                if (unprocessed(&status) || status.code() == tonic::Code::DeadlineExceeded)
                    && delay.abs_diff(TIMEOUT_MS) < 300 =>
            {
                unsent.push((delay, status.code()));
            }
            Err(status) => failed.push((delay, status)),
        }
    }
    eprintln!("{total} calls; unprocessed, to retry (ms after opening): {unsent:?}");
    assert!(
        failed.is_empty(),
        "{} of {total} failed: {failed:?}",
        failed.len()
    );
}

/// Whether tonic failed `status` for a call the server never saw or told
/// the client it did not process: hyper cancels a request still queued
/// when its connection closes, and h2 fails a stream above the last one a
/// GOAWAY names, or one the server refused.
fn unprocessed(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if let Some(err) = err.downcast_ref::<hyper::Error>()
            && err.is_canceled()
        {
            return true;
        }
        if let Some(err) = err.downcast_ref::<h2::Error>() {
            return (err.is_go_away()
                && err.is_remote()
                && err.reason() == Some(h2::Reason::NO_ERROR))
                || err.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        source = err.source();
    }
    false
}
