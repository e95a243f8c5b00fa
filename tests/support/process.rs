//! The built binary as a child process: `serve` on free loopback ports, its
//! log collected as it is written, signalled like an orchestrator would and
//! killed on drop.

use std::io::BufRead;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

pub const BIN: &str = env!("CARGO_BIN_EXE_throttlegate");

/// How long the binary may take to bind its gRPC port.
const START_UP: Duration = Duration::from_secs(20);

/// The binary without the variables it reads from the environment (ours
/// and envoyproxy/ratelimit's), so that only what a test passes applies.
pub fn command() -> Command {
    let mut command = Command::new(BIN);
    clear_env(&mut command);
    command
}

fn clear_env(command: &mut Command) {
    use throttlegate::compat::{
        TRACING_VARIABLES, TRANSLATED, TRANSLATED_XDS, UNSUPPORTED, UNSUPPORTED_PREFIXES,
    };
    for (key, _) in std::env::vars() {
        let envoyproxy = TRANSLATED.contains(&key.as_str())
            || TRANSLATED_XDS.contains(&key.as_str())
            || TRACING_VARIABLES.contains(&key.as_str())
            || UNSUPPORTED.contains(&key.as_str())
            || UNSUPPORTED_PREFIXES.iter().any(|it| key.starts_with(it));
        if key.starts_with("THROTTLEGATE_") || key == "RUST_LOG" || envoyproxy {
            command.env_remove(key);
        }
    }
}

/// A port that was free a moment ago and that no earlier call in this
/// process returned: the kernel may hand out a port again as soon as its
/// probe socket closes, so two calls in a row (a service's gRPC and HTTP
/// ports) could otherwise name the same one.
pub fn free_addr() -> SocketAddr {
    static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|it| it.into_inner());
    loop {
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|it| it.local_addr())
            .expect("find a free port");
        if !handed_out.contains(&addr.port()) {
            handed_out.push(addr.port());
            return addr;
        }
    }
}

/// How to start `serve`: its config, flags besides the two ports, the log
/// filter, and a descriptor limit to run it under.
pub struct Serve {
    /// `None`: no `--config` (the rules come over xDS, or none).
    config: Option<PathBuf>,
    dir: Option<tempfile::TempDir>,
    args: Vec<String>,
    rust_log: Option<String>,
    nofile: Option<(u64, u64)>,
    env: Vec<(String, String)>,
}

impl Serve {
    /// `serve --config <path>`.
    pub fn config(path: impl AsRef<Path>) -> Serve {
        Serve {
            config: Some(path.as_ref().to_path_buf()),
            dir: None,
            args: Vec::new(),
            rust_log: None,
            nofile: None,
            env: Vec::new(),
        }
    }

    /// `serve` of `yaml`, written to a directory that lives as long as the
    /// process.
    pub fn yaml(yaml: &str) -> Serve {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let config = dir.path().join("config.yaml");
        std::fs::write(&config, yaml).expect("write config");
        Serve {
            dir: Some(dir),
            ..Serve::config(config)
        }
    }

    /// `serve` without `--config`, with `args` (an xDS server, say).
    pub fn without_config(args: &[&str]) -> Serve {
        Serve {
            config: None,
            dir: None,
            args: args.iter().map(|it| (*it).to_owned()).collect(),
            rust_log: None,
            nofile: None,
            env: Vec::new(),
        }
    }

    pub fn args(mut self, args: &[&str]) -> Serve {
        self.args.extend(args.iter().map(|it| (*it).to_owned()));
        self
    }

    /// An environment variable for the process (every variable the binary
    /// reads is cleared otherwise).
    pub fn env(mut self, name: &str, value: &str) -> Serve {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }

    /// `RUST_LOG` for the process (the binary's default otherwise).
    pub fn rust_log(mut self, filter: &str) -> Serve {
        self.rust_log = Some(filter.to_owned());
        self
    }

    /// Runs it under `prlimit --nofile=soft:hard` (from util-linux).
    pub fn nofile(mut self, soft: u64, hard: u64) -> Serve {
        self.nofile = Some((soft, hard));
        self
    }

    /// Starts the process; it binds its ports after loading the config, so
    /// [`ServiceProcess::connect`] waits for it.
    pub fn spawn(self) -> ServiceProcess {
        let grpc = free_addr();
        let http = free_addr();
        let mut command = match self.nofile {
            Some((soft, hard)) => {
                let mut it = Command::new("prlimit");
                it.arg(format!("--nofile={soft}:{hard}")).arg("--").arg(BIN);
                it
            }
            None => Command::new(BIN),
        };
        clear_env(&mut command);
        if let Some(filter) = &self.rust_log {
            command.env("RUST_LOG", filter);
        }
        command.envs(self.env.iter().map(|(name, value)| (name, value)));
        command.arg("serve");
        if let Some(config) = &self.config {
            command.arg("--config").arg(config);
        }
        command
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--http-addr", &http.to_string()])
            .args(&self.args);
        ServiceProcess::start(command, grpc, http, self.dir)
    }
}

impl ServiceProcess {
    /// Runs `command` with its stderr collected; `grpc` and `http` are
    /// where it listens, `dir` what it reads that must live as long.
    fn start(
        mut command: Command,
        grpc: SocketAddr,
        http: SocketAddr,
        dir: Option<tempfile::TempDir>,
    ) -> ServiceProcess {
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the binary (and prlimit, from util-linux, when asked for)");
        let (log, reader) = collect(&mut child);
        ServiceProcess {
            child,
            grpc,
            http,
            log,
            reader: Some(reader),
            _dir: dir,
        }
    }
}

/// Collects the child's stderr on a thread, so that logging never blocks
/// it; the thread ends when the process closes the pipe.
fn collect(child: &mut Child) -> (Arc<Mutex<String>>, JoinHandle<()>) {
    let log = Arc::new(Mutex::new(String::new()));
    let pipe = child.stderr.take().expect("piped stderr");
    let sink = log.clone();
    let reader = std::thread::spawn(move || {
        let mut pipe = std::io::BufReader::new(pipe);
        let mut line = Vec::new();
        while matches!(pipe.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&line));
            line.clear();
        }
    });
    (log, reader)
}

/// A running `serve`; killed and waited for when dropped.
pub struct ServiceProcess {
    child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    log: Arc<Mutex<String>>,
    reader: Option<JoinHandle<()>>,
    _dir: Option<tempfile::TempDir>,
}

impl ServiceProcess {
    /// `serve --config <config>` with `extra` flags.
    pub fn spawn(config: impl AsRef<Path>, extra: &[&str]) -> ServiceProcess {
        Serve::config(config).args(extra).spawn()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// A channel to the gRPC port, once it accepts connections.
    pub async fn connect(&mut self) -> Channel {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", self.grpc))
            .expect("valid uri")
            .connect_timeout(Duration::from_secs(5));
        let deadline = Instant::now() + START_UP;
        loop {
            if let Some(exit) = self.child.try_wait().expect("try_wait") {
                panic!("the server exited early: {exit}\n{}", self.log());
            }
            match endpoint.connect().await {
                Ok(channel) => return channel,
                Err(err) => assert!(
                    Instant::now() < deadline,
                    "cannot connect to {}: {err}\n{}",
                    self.grpc,
                    self.log()
                ),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A client on a fresh channel, once the gRPC port accepts connections.
    pub async fn client(&mut self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::new(self.connect().await)
    }

    /// Sends `SIG<name>` (`TERM`, `INT`, `HUP`...).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name}");
    }

    /// Waits until the log holds `text`, for at most `within`.
    pub async fn wait_for_log(&self, text: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log().contains(text) {
            assert!(
                Instant::now() < deadline,
                "nothing logged with {text:?} within {within:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the exit, for at most `within`: the status and the whole
    /// log.
    pub async fn exit(&mut self, within: Duration) -> (ExitStatus, String) {
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "still running after {within:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // The pipe closes with the process: every line is there.
        if let Some(reader) = self.reader.take() {
            reader.join().expect("log reader");
        }
        (status, self.log())
    }

    /// Stops the process with SIGTERM, as an orchestrator does; the whole
    /// log.
    pub async fn stop(mut self) -> String {
        self.signal("TERM");
        let (_, log) = self.exit(Duration::from_secs(15)).await;
        log
    }

    /// Resident memory, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc/<pid>/status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS line")
    }

    /// User plus system CPU time used so far, in ticks (USER_HZ).
    pub fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .expect("read /proc/<pid>/stat");
        // The command name, in parentheses, may hold spaces: count fields
        // after its closing parenthesis (utime and stime are fields 14, 15).
        let after = &stat[stat.rfind(')').expect("comm") + 2..];
        let fields: Vec<&str> = after.split(' ').collect();
        let utime: u64 = fields[11].parse().expect("utime");
        let stime: u64 = fields[12].parse().expect("stime");
        utime + stime
    }

    /// The value of the metric series `series` (name and labels, exactly
    /// as exposed) from `/metrics`.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = http_get(self.http, "/metrics").await;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }

    /// [`ServiceProcess::metric`], 0 while the series is not exposed (a
    /// counter never incremented).
    pub async fn metric_or_zero(&self, series: &str) -> f64 {
        let text = http_get(self.http, "/metrics").await;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET path` over HTTP/1.1 on a fresh connection; the whole response,
/// which must be UTF-8 text.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to http");
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .expect("http response within 10 s")
        .expect("read http response");
    String::from_utf8(response).expect("utf-8 response")
}

/// An HTTP response: status, headers (names lower-cased, in order) and
/// body as received (a chunked body is not decoded).
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// An HTTP/1.1 request, sent on a fresh connection that closes after the
/// response, from `source` (any 127.0.0.0/8 address) when given. Header
/// values are bytes, so they need not be UTF-8. [`http_get`] is the
/// shorter form for a text answer from the service's own HTTP port.
#[derive(Clone)]
pub struct HttpRequest<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: Vec<(&'a str, Vec<u8>)>,
    pub source: Option<std::net::IpAddr>,
}

impl<'a> HttpRequest<'a> {
    pub fn get(path: &'a str) -> HttpRequest<'a> {
        HttpRequest {
            method: "GET",
            path,
            headers: Vec::new(),
            source: None,
        }
    }

    pub fn header(mut self, name: &'a str, value: impl AsRef<[u8]>) -> HttpRequest<'a> {
        self.headers.push((name, value.as_ref().to_vec()));
        self
    }

    pub fn from(mut self, source: std::net::IpAddr) -> HttpRequest<'a> {
        self.source = Some(source);
        self
    }

    /// Sends it to `addr`; panics when no complete response comes within
    /// 10 s.
    pub async fn send(&self, addr: SocketAddr) -> HttpResponse {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        if let Some(source) = self.source {
            socket
                .bind(SocketAddr::new(source, 0))
                .unwrap_or_else(|err| panic!("bind {source}: {err}"));
        }
        let mut stream = socket
            .connect(addr)
            .await
            .unwrap_or_else(|err| panic!("connect to {addr}: {err}"));
        let mut request =
            format!("{} {} HTTP/1.1\r\nHost: test\r\n", self.method, self.path).into_bytes();
        for (name, value) in &self.headers {
            request.extend_from_slice(name.as_bytes());
            request.extend_from_slice(b": ");
            request.extend_from_slice(value);
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"Connection: close\r\n\r\n");
        stream.write_all(&request).await.expect("send the request");
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
            .await
            .unwrap_or_else(|_| panic!("no response from {addr} within 10 s"))
            .unwrap_or_else(|err| panic!("read the response from {addr}: {err}"));
        parse_response(&raw).unwrap_or_else(|| {
            panic!(
                "not an HTTP response from {addr}: {:?}",
                String::from_utf8_lossy(&raw)
            )
        })
    }
}

fn parse_response(raw: &[u8]) -> Option<HttpResponse> {
    let split = raw.windows(4).position(|it| it == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|line| {
            let (name, value) = line.split_once(':')?;
            Some((name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        })
        .collect();
    Some(HttpResponse {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    })
}

/// The binary with no flags and only `vars` in its environment, as a
/// deployment configured by environment variables alone starts it; `grpc`
/// and `http` are where `vars` make it listen.
pub fn spawn_with_env(vars: &[(&str, &str)], grpc: SocketAddr, http: SocketAddr) -> ServiceProcess {
    let mut command = Command::new(BIN);
    command.env_clear().envs(vars.iter().copied());
    ServiceProcess::start(command, grpc, http, None)
}
