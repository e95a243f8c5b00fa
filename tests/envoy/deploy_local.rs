//! The deploy example under real Envoy, run the way a person runs it
//! without Docker: `deploy/local/run.sh` starts Envoy (ENVOY_BIN) on
//! deploy/envoy/envoy.yaml with local addresses, Redis, two throttlegate
//! replicas on deploy/config with deploy/throttlegate.env's shutdown timing,
//! and a Python upstream. The tests talk to Envoy's listener from loopback
//! addresses of their choosing (127.0.0.0/8), so each client address has
//! its own per-address budget, and read Envoy's own counters on its admin
//! port.
//!
//! Without ENVOY_BIN these tests fail under CI=true and are skipped
//! otherwise, with a message saying how to install Envoy.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::support::envoy::envoy_bin;
use crate::support::process::{BIN, free_addr, http_get};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One deploy example at a time: each runs Envoy, Redis, two replicas and
/// Python, and the machine running the tests may have two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A client address, 127.1.x.y, that no other request of this test binary
/// comes from.
fn client() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    assert!(n < 0xffff, "out of client addresses");
    Ipv4Addr::from(0x7f01_0000 | n)
}

/// One HTTP response: status and headers in order (names in lower case).
#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(it, _)| it == name)
            .map(|(_, value)| value.as_str())
    }
}

/// `GET path` to `to` over a new connection from `from`, with `headers`.
async fn get(
    to: SocketAddr,
    from: Ipv4Addr,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    let socket = tokio::net::TcpSocket::new_v4().map_err(|it| it.to_string())?;
    socket
        .bind(SocketAddr::new(from.into(), 0))
        .map_err(|it| format!("bind {from}: {it}"))?;
    let mut stream = tokio::time::timeout(Duration::from_secs(5), socket.connect(to))
        .await
        .map_err(|_| "connect: timed out".to_owned())?
        .map_err(|it| format!("connect: {it}"))?;
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|it| format!("write: {it}"))?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .map_err(|_| "read: timed out".to_owned())?
        .map_err(|it| format!("read: {it}"))?;
    let text = String::from_utf8_lossy(&raw);
    let head = text
        .split("\r\n\r\n")
        .next()
        .ok_or_else(|| format!("no response head: {text:?}"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("no status line: {text:?}"))?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    Ok(Response { status, headers })
}

/// `deploy/local/run.sh` running on free ports, stopped (SIGTERM to the
/// script, which stops everything it started) on drop.
struct Deploy {
    child: Child,
    run_dir: tempfile::TempDir,
    listen: SocketAddr,
    admin: SocketAddr,
    output: Arc<Mutex<String>>,
}

impl Deploy {
    fn start(envoy: &Path) -> Deploy {
        let run_dir = tempfile::tempdir().expect("a temporary directory");
        let listen = free_addr();
        let admin = free_addr();
        let mut command = Command::new("bash");
        command
            .arg(root().join("deploy/local/run.sh"))
            .env("ENVOY_BIN", envoy)
            .env("THROTTLEGATE_BIN", BIN)
            .env("RUN_DIR", run_dir.path())
            .env("LISTEN_PORT", listen.port().to_string())
            .env("ADMIN_PORT", admin.port().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for name in [
            "UPSTREAM_PORT",
            "REDIS_PORT",
            "GRPC_PORT_A",
            "HTTP_PORT_A",
            "GRPC_PORT_B",
            "HTTP_PORT_B",
        ] {
            command.env(name, free_addr().port().to_string());
        }
        // Only the script and deploy/throttlegate.env configure the replicas.
        for (key, _) in std::env::vars() {
            if key.starts_with("THROTTLEGATE_") && key != "THROTTLEGATE_BIN" || key == "RUST_LOG" {
                command.env_remove(key);
            }
        }
        let mut child = command.spawn().expect("run deploy/local/run.sh");
        let output = Arc::new(Mutex::new(String::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        let sink = output.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == "ready" {
                    let _ = ready_tx.send(());
                }
                let mut output = sink.lock().unwrap();
                output.push_str(&line);
                output.push('\n');
            }
        });
        let mut stderr = child.stderr.take().unwrap();
        let sink = output.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let mut deploy = Deploy {
            child,
            run_dir,
            listen,
            admin,
            output,
        };
        if ready_rx.recv_timeout(Duration::from_secs(90)).is_err() {
            panic!(
                "run.sh did not print `ready` within 90 s; its output:\n{}\n{}",
                deploy.output(),
                deploy.logs()
            );
        }
        assert!(deploy.child.try_wait().unwrap().is_none(), "run.sh exited");
        deploy
    }

    fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// Every log the script wrote, for failure messages.
    fn logs(&self) -> String {
        let mut text = String::new();
        for name in ["envoy", "throttlegate-a", "throttlegate-b", "redis"] {
            let path = self.run_dir.path().join(format!("{name}.log"));
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            text.push_str(&format!("--- {name}.log (last lines)\n"));
            for line in tail.into_iter().rev() {
                text.push_str(line);
                text.push('\n');
            }
        }
        text
    }

    /// The process id a replica (`throttlegate-a`, `throttlegate-b`) runs as now.
    fn replica_pid(&self, name: &str) -> u32 {
        let path = self.run_dir.path().join(format!("{name}.pid"));
        std::fs::read_to_string(&path)
            .unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
            .trim()
            .parse()
            .expect("a process id")
    }

    fn replica_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.run_dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Envoy's counters and gauges (admin `/stats`), by name.
    async fn stats(&self) -> BTreeMap<String, u64> {
        envoy_stats(self.admin).await
    }

    async fn stat(&self, name: &str) -> u64 {
        self.stats().await.get(name).copied().unwrap_or(0)
    }

    async fn get(&self, from: Ipv4Addr, path: &str, headers: &[(&str, &str)]) -> Response {
        get(self.listen, from, path, headers)
            .await
            .unwrap_or_else(|err| panic!("GET {path} from {from}: {err}"))
    }

    /// SIGTERM to a replica; waits until that process has exited (its
    /// shutdown delay and drain) and returns its old process id.
    async fn stop_replica(&self, name: &str) -> u32 {
        let pid = self.replica_pid(name);
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid}");
        let deadline = Instant::now() + Duration::from_secs(40);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                Instant::now() < deadline,
                "{name} ({pid}) still running 40 s after SIGTERM\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        pid
    }

    /// Waits until the script has started `name` again (a process id other
    /// than `old`) and Envoy sees both replicas healthy.
    async fn wait_restarted(&self, name: &str, old: u32) {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let healthy = self.stat("cluster.throttlegate.membership_healthy").await;
            if self.replica_pid(name) != old && healthy == 2 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{name} not restarted and healthy in Envoy within 40 s (healthy: {healthy})\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Envoy's counters and gauges, read on its admin address.
async fn envoy_stats(admin: SocketAddr) -> BTreeMap<String, u64> {
    let response = http_get(admin, "/stats").await;
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
    body.lines()
        .filter_map(|line| line.split_once(": "))
        .filter_map(|(name, value)| Some((name.to_owned(), value.trim().parse().ok()?)))
        .collect()
}

impl Drop for Deploy {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What steady traffic saw.
#[derive(Debug, Default)]
struct Tally {
    sent: u64,
    statuses: BTreeMap<u16, u64>,
    failures: Vec<String>,
}

/// Requests to `/` from a few workers, each rotating over 40 client
/// addresses (so some are allowed and some denied), about 150 a second in
/// all, until stopped.
struct Traffic {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Tally>>,
}

impl Traffic {
    fn start(listen: SocketAddr) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..3)
            .map(|_| {
                let stop = stop.clone();
                let addresses: Vec<Ipv4Addr> = (0..40).map(|_| client()).collect();
                tokio::spawn(async move {
                    let mut tally = Tally::default();
                    let mut at = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let from = addresses[at % addresses.len()];
                        at += 1;
                        tally.sent += 1;
                        match get(listen, from, "/", &[]).await {
                            Ok(response) => {
                                *tally.statuses.entry(response.status).or_default() += 1
                            }
                            Err(err) => tally.failures.push(err),
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    tally
                })
            })
            .collect();
        Traffic { stop, workers }
    }

    async fn finish(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut total = Tally::default();
        for worker in self.workers {
            let tally = worker.await.expect("a traffic worker");
            total.sent += tally.sent;
            total.failures.extend(tally.failures);
            for (status, count) in tally.statuses {
                *total.statuses.entry(status).or_default() += count;
            }
        }
        total
    }
}

/// Two seconds of traffic, not counted by the test: what a test asserts
/// starts once Envoy has its connections to both replicas.
async fn warm_up(deploy: &Deploy) {
    let warm = Traffic::start(deploy.listen);
    tokio::time::sleep(Duration::from_secs(2)).await;
    warm.finish().await;
}

/// A thread that notices when this machine could not run it on time: it
/// sleeps 1 ms at a time and records every wake-up at least
/// [`STALL`] late, as the span the machine stalled.
struct StallWatch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Instant, Instant)>>,
}

/// A wake-up this late means the machine kept a runnable thread waiting
/// for a quarter of Envoy's 20 ms rate-limit timeout (the deploy
/// example's): a call that has to cross Envoy, a replica and Redis, each
/// waiting for a core like this thread, may miss it. On a machine that
/// runs the test alone no wake-up is this late, and every failed call
/// fails the test.
const STALL: Duration = Duration::from_millis(5);

impl StallWatch {
    fn start() -> StallWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut stalls = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let asleep = Instant::now();
                std::thread::sleep(Duration::from_millis(1));
                let woke = Instant::now();
                if woke - asleep >= STALL + Duration::from_millis(1) {
                    stalls.push((asleep, woke));
                }
            }
            stalls
        });
        StallWatch { stop, thread }
    }

    fn finish(self) -> Vec<(Instant, Instant)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the stall watch")
    }
}

/// Envoy's failed rate-limit calls over time: a reading of
/// `ratelimit.error` every 200 ms, until stopped.
struct ErrorTimeline {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<(Instant, u64)>>,
}

impl ErrorTimeline {
    fn start(admin: SocketAddr) -> ErrorTimeline {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut readings = Vec::new();
            loop {
                let stats = envoy_stats(admin).await;
                let errors = stats.get("cluster.upstream.ratelimit.error");
                readings.push((Instant::now(), errors.copied().unwrap_or(0)));
                if flag.load(Ordering::Relaxed) {
                    return readings;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        ErrorTimeline { stop, task }
    }

    async fn finish(self) -> Vec<(Instant, u64)> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the error timeline")
    }
}

/// Steady traffic through a scenario, with what is needed to tell a call
/// the scenario failed from one the machine failed.
struct Watched {
    since: Instant,
    before: BTreeMap<String, u64>,
    traffic: Traffic,
    stalls: StallWatch,
    errors: ErrorTimeline,
}

impl Watched {
    async fn start(deploy: &Deploy) -> Watched {
        Watched {
            since: Instant::now(),
            before: deploy.stats().await,
            traffic: Traffic::start(deploy.listen),
            stalls: StallWatch::start(),
            errors: ErrorTimeline::start(deploy.admin),
        }
    }
}

/// How a scenario under traffic ended.
enum Verdict {
    /// Every request was decided.
    Decided,
    /// Some rate-limit calls failed, every one of them within a second of
    /// a span in which this machine kept a thread waiting [`STALL`] or
    /// more, and none because a replica was gone (a connection refused or
    /// reset, no healthy replica): each was answered too late for Envoy's
    /// 20 ms (a timeout at Envoy) or through the failure mode at its
    /// deadline. The machine missed the timeout, not the scenario: run it
    /// again.
    MachineStalled(String),
}

/// Every request of the traffic was answered without a 5xx, and Envoy
/// counted a decision for each: no rate-limit call failed and none was let
/// through because it failed. The one exception, [`Verdict::MachineStalled`],
/// is returned for the caller to run the scenario again; anything else
/// fails the test.
async fn every_request_decided(deploy: &Deploy, watched: Watched) -> Verdict {
    let tally = watched.traffic.finish().await;
    let stalls = watched.stalls.finish();
    let before = &watched.before;
    let mut timeline = vec![(
        watched.since,
        before
            .get("cluster.upstream.ratelimit.error")
            .copied()
            .unwrap_or(0),
    )];
    timeline.extend(watched.errors.finish().await);
    let stats = deploy.stats().await;
    let stat =
        |name: &str| stats.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    let envoy_view: BTreeMap<&String, &u64> = stats
        .iter()
        .filter(|(name, value)| {
            **value > 0 && (name.starts_with("cluster.throttlegate.") || name.contains("ratelimit"))
        })
        .collect();
    let context = format!("{tally:?}\nEnvoy: {envoy_view:?}\n{}", deploy.logs());
    assert!(tally.failures.is_empty(), "requests failed: {context}");
    assert!(
        tally.statuses.keys().all(|status| *status < 500),
        "5xx answers: {context}"
    );
    let errors = stat("cluster.upstream.ratelimit.error");
    let allowed = stat("cluster.upstream.ratelimit.failure_mode_allowed");
    let decided =
        stat("cluster.upstream.ratelimit.ok") + stat("cluster.upstream.ratelimit.over_limit");
    assert!(
        tally.statuses.contains_key(&200) && tally.statuses.contains_key(&429),
        "traffic both allowed and denied: {context}"
    );
    if errors == 0 && allowed == 0 {
        assert_eq!(decided, tally.sent, "decisions vs requests: {context}");
        return Verdict::Decided;
    }
    // Every reading that saw failures rise close to a stall of the machine.
    let timeouts = stat("cluster.throttlegate.upstream_rq_timeout");
    let margin = Duration::from_secs(1);
    let unexplained: Vec<String> = timeline
        .windows(2)
        .filter(|pair| pair[1].1 > pair[0].1)
        .filter(|pair| {
            let (from, to) = (pair[0].0 - margin, pair[1].0 + margin);
            !stalls
                .iter()
                .any(|(asleep, woke)| *asleep <= to && *woke >= from)
        })
        .map(|pair| {
            format!(
                "{} failed calls with no stall within a second",
                pair[1].1 - pair[0].1
            )
        })
        .collect();
    // What a replica going away mid-call, or Envoy sending to one that is
    // gone, leaves in Envoy's counters: none of it is the machine's.
    let gone: BTreeMap<&str, u64> = [
        "upstream_cx_connect_fail",
        "upstream_cx_destroy_remote_with_active_rq",
        "upstream_cx_none_healthy",
        "upstream_rq_pending_failure_eject",
        "upstream_rq_rx_reset",
    ]
    .into_iter()
    .map(|name| (name, stat(&format!("cluster.throttlegate.{name}"))))
    .filter(|(_, count)| *count > 0)
    .collect();
    let worst = stalls.iter().map(|(asleep, woke)| *woke - *asleep).max();
    let summary = format!(
        "{errors} rate-limit calls failed ({timeouts} timed out at Envoy, {allowed} let \
         through, replicas gone: {gone:?}); {} stalls of the machine of {STALL:?} or more \
         (longest {worst:?})",
        stalls.len()
    );
    assert!(
        gone.is_empty() && errors == allowed && unexplained.is_empty(),
        "{summary}; not explained by a stall: {unexplained:?}\n{context}"
    );
    Verdict::MachineStalled(summary)
}

/// Runs `scenario` until it ends with every request decided; a run in
/// which the machine stalled past Envoy's timeout is run again, at most
/// twice.
async fn until_decided<F, Fut>(envoy: &Path, mut scenario: F)
where
    F: FnMut(Deploy) -> Fut,
    Fut: std::future::Future<Output = Verdict>,
{
    let mut stalled = Vec::new();
    for _ in 0..3 {
        match scenario(Deploy::start(envoy)).await {
            Verdict::Decided => return,
            Verdict::MachineStalled(summary) => {
                eprintln!("run again: {summary}");
                stalled.push(summary);
            }
        }
    }
    panic!("the machine stalled past Envoy's timeout in every run: {stalled:?}");
}

/// The `text` blocks of the README's "Try it with Envoy" section, in order.
fn readme_text_blocks() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let start = readme
        .find("## Try it with Envoy")
        .expect("a \"Try it with Envoy\" section");
    let section = &readme[start..];
    let section = &section[..section[3..]
        .find("\n## ")
        .map_or(section.len(), |it| it + 3)];
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in section.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```text") => current = Some(Vec::new()),
            (Some(_), "```") => blocks.push(current.take().unwrap()),
            (Some(block), text) => block.push(text.to_owned()),
            (None, _) => {}
        }
    }
    blocks
}

#[tokio::test]
async fn the_readme_demo_gives_five_200_then_429_with_the_headers_shown() {
    let Some(envoy) = envoy_bin("the_readme_demo_gives_five_200_then_429_with_the_headers_shown")
    else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let deploy = Deploy::start(&envoy);
    let blocks = readme_text_blocks();
    let codes_shown = blocks
        .iter()
        .find(|block| block.first().is_some_and(|it| it.parse::<u16>().is_ok()))
        .expect("the README's block of status codes");
    let head_shown = blocks
        .iter()
        .find(|block| {
            block
                .first()
                .is_some_and(|it| it.starts_with("HTTP/1.1 429"))
        })
        .expect("the README's block of a 429's headers");

    // The README's curl loop, then its `curl -si`, from one client.
    let from = client();
    let mut codes = Vec::new();
    for _ in 0..codes_shown.len() {
        codes.push(deploy.get(from, "/", &[]).await.status.to_string());
    }
    assert_eq!(
        codes.iter().filter(|it| *it == "200").count(),
        5,
        "{codes:?}"
    );
    assert_eq!(&codes, codes_shown, "status codes vs the README");
    let response = deploy.get(from, "/", &[]).await;
    assert_eq!(response.status, 429);
    assert_eq!(head_shown[0], "HTTP/1.1 429 Too Many Requests");

    // Every header shown is returned, in the same order, with the same
    // value: only the date and the seconds until the window resets vary.
    let shown: Vec<(String, String)> = head_shown[1..]
        .iter()
        .map(|line| {
            let (name, value) = line.split_once(':').expect("`name: value`");
            (name.trim().to_ascii_lowercase(), value.trim().to_owned())
        })
        .collect();
    let names = |headers: &[(String, String)]| -> Vec<String> {
        headers.iter().map(|(name, _)| name.clone()).collect()
    };
    // `connection: close` answers this client's own `Connection: close`
    // (curl sends none).
    let returned: Vec<(String, String)> = response
        .headers
        .iter()
        .filter(|(name, _)| name != "connection")
        .cloned()
        .collect();
    assert_eq!(
        names(&shown),
        names(&returned),
        "headers shown in the README vs returned"
    );
    for ((name, shown), (_, got)) in shown.iter().zip(&returned) {
        match name.as_str() {
            "date" => {}
            "x-ratelimit-reset" | "ratelimit-reset" | "retry-after" => {
                let seconds: u64 = got.parse().expect("whole seconds");
                assert!((1..=60).contains(&seconds), "{name}: {got}");
                let shown: u64 = shown.parse().expect("whole seconds in the README");
                assert!((1..=60).contains(&shown), "{name}: {shown} in the README");
            }
            _ => assert_eq!(shown, got, "{name}"),
        }
    }
    for name in [
        "x-envoy-ratelimited",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit-limit",
        "ratelimit-remaining",
        "ratelimit-reset",
        "retry-after",
    ] {
        assert!(response.header(name).is_some(), "{name}: {response:?}");
    }

    // Another client has its own five.
    assert_eq!(deploy.get(client(), "/", &[]).await.status, 200);
}

#[tokio::test]
async fn no_spelling_of_an_expensive_path_escapes_its_limit() {
    let Some(envoy) = envoy_bin("no_spelling_of_an_expensive_path_escapes_its_limit") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let deploy = Deploy::start(&envoy);
    // Each request from a new client address: only the shared /expensive
    // budget (2 a minute) can deny them. The upstream has no such file (404).
    for _ in 0..2 {
        let response = deploy.get(client(), "/expensive", &[]).await;
        assert_eq!(response.status, 404, "{response:?}");
    }
    for path in [
        "/expensive",
        "//expensive",
        "/%65xpensive",
        "/EXPENSIVE",
        "/Expensive/report",
        "/expensive/../expensive",
        "/elsewhere/../expensive",
        "/%2Fexpensive",
        "/a/..%2Fexpensive",
        "/expensive?page=2",
    ] {
        let response = deploy.get(client(), path, &[]).await;
        assert_eq!(response.status, 429, "{path}: {response:?}");
        let limit = response.header("x-ratelimit-limit").unwrap_or("");
        assert!(
            limit.starts_with("2, "),
            "{path}: denied by the /expensive limit, not {limit}"
        );
    }
    // Not under /expensive: only the per-address limit applies.
    for path in ["/", "/expensivefoo", "/other/expensive"] {
        let response = deploy.get(client(), path, &[]).await;
        assert_ne!(response.status, 429, "{path}: {response:?}");
    }
    assert_eq!(deploy.stat("cluster.upstream.ratelimit.error").await, 0);
}

#[tokio::test]
async fn batch_calls_cost_their_x_cost_header() {
    let Some(envoy) = envoy_bin("batch_calls_cost_their_x_cost_header") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let deploy = Deploy::start(&envoy);
    // 20 units a minute per client: 10 + 10 pass, then even 1 is denied.
    let from = client();
    for cost in ["10", "10"] {
        let response = deploy.get(from, "/batch", &[("x-cost", cost)]).await;
        assert_eq!(response.status, 404, "cost {cost}: {response:?}");
    }
    let response = deploy.get(from, "/batch/item", &[("x-cost", "1")]).await;
    assert_eq!(response.status, 429, "{response:?}");
    // Another client's units are its own, and other paths are not charged.
    let other = client();
    let response = deploy.get(other, "/BATCH", &[("x-cost", "10")]).await;
    assert_eq!(response.status, 404, "{response:?}");
    assert_eq!(deploy.get(from, "/", &[]).await.status, 200);
    // Without a usable cost Envoy would skip the call: such requests never
    // reach the upstream.
    for cost in [
        None,
        Some("0"),
        Some("11"),
        Some("abc"),
        Some("-5"),
        Some(""),
    ] {
        let headers: Vec<(&str, &str)> = cost.map(|it| ("x-cost", it)).into_iter().collect();
        let response = deploy.get(client(), "/batch", &headers).await;
        assert_eq!(response.status, 400, "x-cost {cost:?}: {response:?}");
    }
    assert_eq!(deploy.stat("cluster.upstream.ratelimit.error").await, 0);
    assert_eq!(
        deploy
            .stat("cluster.upstream.ratelimit.failure_mode_allowed")
            .await,
        0
    );
}

#[tokio::test]
async fn sigterm_to_one_of_two_replicas_under_traffic_leaves_nothing_unchecked() {
    let Some(envoy) =
        envoy_bin("sigterm_to_one_of_two_replicas_under_traffic_leaves_nothing_unchecked")
    else {
        return;
    };
    let _serial = SERIAL.lock().await;
    until_decided(&envoy, |deploy| async move {
        warm_up(&deploy).await;
        let watched = Watched::start(&deploy).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let stopped = deploy.stop_replica("throttlegate-a").await;
        // The stopped replica's port is closed now; traffic goes on.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let log = deploy.replica_log("throttlegate-a");
        assert!(log.contains("SIGTERM"), "{log}");
        assert!(
            deploy
                .stat("cluster.throttlegate.health_check.failure")
                .await
                >= 1,
            "Envoy never saw {stopped} fail a health check"
        );
        every_request_decided(&deploy, watched).await
    })
    .await;
}

#[tokio::test]
async fn a_rolling_restart_of_both_replicas_leaves_nothing_unchecked() {
    let Some(envoy) = envoy_bin("a_rolling_restart_of_both_replicas_leaves_nothing_unchecked")
    else {
        return;
    };
    let _serial = SERIAL.lock().await;
    until_decided(&envoy, |deploy| async move {
        warm_up(&deploy).await;
        let watched = Watched::start(&deploy).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        for name in ["throttlegate-a", "throttlegate-b"] {
            let old = deploy.stop_replica(name).await;
            deploy.wait_restarted(name, old).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            deploy
                .stat("cluster.throttlegate.health_check.failure")
                .await
                >= 2,
            "Envoy saw both replicas stop"
        );
        every_request_decided(&deploy, watched).await
    })
    .await;
}
