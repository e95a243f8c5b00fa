//! A real `redis-server` per test on a free port, backends and services on
//! it, and what tests read from Redis directly (keys, command statistics).

use std::collections::HashSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use throttlegate::backends::redis::{ClockSource, DECIDE_LUA, RedisBackend, RedisSettings};
use throttlegate::backends::{Backend, KeyedCheck};

use super::service::{TestService, default_options, start_with_config};

/// The binary to run; CI installs it with `apt-get install redis-server`.
fn server_binary() -> String {
    std::env::var("THROTTLEGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

/// A redis-server child process listening on 127.0.0.1 and on a unix
/// socket in its own temporary directory; killed and waited for on drop.
pub struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    extra_args: Vec<String>,
    /// Listens with TLS only (a self-signed certificate in `dir`).
    tls: bool,
}

impl RedisServer {
    /// Starts a server and waits until it answers PING.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts a server with extra command-line arguments, such as
    /// `--requirepass secret`.
    pub fn start_with(extra_args: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let mut server = RedisServer {
            port: 0,
            dir,
            child: None,
            extra_args: extra_args.iter().map(|it| (*it).to_owned()).collect(),
            tls: false,
        };
        server.run_on_a_free_port();
        server
    }

    /// Starts a server that speaks TLS only, with a fresh self-signed
    /// certificate (made with the `openssl` command).
    pub fn start_tls() -> RedisServer {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let status = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .args(["-subj", "/CN=127.0.0.1"])
            .arg("-keyout")
            .arg(dir.path().join("key.pem"))
            .arg("-out")
            .arg(dir.path().join("cert.pem"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|err| panic!("cannot run openssl ({err}): apt-get install openssl"));
        assert!(status.success(), "openssl could not make a certificate");
        let cert = dir.path().join("cert.pem").display().to_string();
        let key = dir.path().join("key.pem").display().to_string();
        let mut server = RedisServer {
            port: 0,
            dir,
            child: None,
            extra_args: vec![
                "--tls-cert-file".to_owned(),
                cert.clone(),
                "--tls-key-file".to_owned(),
                key,
                "--tls-ca-cert-file".to_owned(),
                cert,
                "--tls-auth-clients".to_owned(),
                "no".to_owned(),
            ],
            tls: true,
        };
        server.run_on_a_free_port();
        server
    }

    /// Starts a server that speaks TLS only, with the given certificate,
    /// key and CA files (PEM); `auth_clients`: clients must present a
    /// certificate the CA signed (`--tls-auth-clients yes`).
    pub fn start_tls_with(cert: &Path, key: &Path, ca: &Path, auth_clients: bool) -> RedisServer {
        RedisServer::start_tls_and(cert, key, ca, auth_clients, &[])
    }

    /// [`RedisServer::start_tls_with`] with extra command-line arguments.
    pub fn start_tls_and(
        cert: &Path,
        key: &Path,
        ca: &Path,
        auth_clients: bool,
        extra_args: &[&str],
    ) -> RedisServer {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let path = |it: &Path| it.display().to_string();
        let mut args = vec![
            "--tls-cert-file".to_owned(),
            path(cert),
            "--tls-key-file".to_owned(),
            path(key),
            "--tls-ca-cert-file".to_owned(),
            path(ca),
            "--tls-auth-clients".to_owned(),
            if auth_clients { "yes" } else { "no" }.to_owned(),
        ];
        args.extend(extra_args.iter().map(|it| (*it).to_owned()));
        let mut server = RedisServer {
            port: 0,
            dir,
            child: None,
            extra_args: args,
            tls: true,
        };
        server.run_on_a_free_port();
        server
    }

    /// A `rediss://` URL to its TLS port, verifying its certificate.
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.port)
    }

    /// Where tests reach it themselves: the unix socket for a TLS server
    /// (which may require client certificates; with its password when it
    /// has one), else [`RedisServer::url`].
    fn inspection_url(&self) -> String {
        if self.tls {
            let socket = self.socket_path().display().to_string();
            match self.password() {
                Some(password) => format!("redis+unix://{socket}?pass={password}"),
                None => format!("redis+unix://{socket}"),
            }
        } else {
            self.url()
        }
    }

    fn run_on_a_free_port(&mut self) {
        // A port picked this way can be taken by another test before the
        // server binds it: try a few.
        for _ in 0..5 {
            self.port = free_port();
            if self.spawn() {
                return;
            }
        }
        panic!("redis-server could not bind a free port after 5 attempts");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL to reach it, with the password when started with one.
    pub fn url(&self) -> String {
        if self.tls {
            // The certificate is self-signed: skip verification.
            return format!("rediss://127.0.0.1:{}/#insecure", self.port);
        }
        match self.password() {
            Some(password) => format!("redis://:{password}@127.0.0.1:{}/", self.port),
            None => format!("redis://127.0.0.1:{}/", self.port),
        }
    }

    fn password(&self) -> Option<&str> {
        let idx = self
            .extra_args
            .iter()
            .position(|it| it == "--requirepass")?;
        self.extra_args.get(idx + 1).map(String::as_str)
    }

    /// Stops the process (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused process run again (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("server running").id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    pub fn socket_path(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// A plain connection for inspecting keys (not through the backend).
    pub async fn connection(&self) -> ::redis::aio::MultiplexedConnection {
        ::redis::Client::open(self.inspection_url())
            .expect("valid url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test redis")
    }

    /// A connection whose calls may take up to `timeout` (`None`: as long
    /// as they take), where redis-rs gives up after 500 ms by default.
    pub async fn patient_connection(
        &self,
        timeout: Option<Duration>,
    ) -> ::redis::aio::MultiplexedConnection {
        let config = ::redis::AsyncConnectionConfig::new().set_response_timeout(timeout);
        ::redis::Client::open(self.url())
            .expect("valid url")
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .expect("connect to the test redis")
    }

    /// Redis busy for `seconds` (`DEBUG SLEEP` on a connection of its own;
    /// start the server with `--enable-debug-command local`); returns once
    /// Redis is seen asleep, with the task that ends with the sleep.
    pub async fn put_to_sleep(
        &self,
        seconds: f64,
    ) -> tokio::task::JoinHandle<::redis::RedisResult<()>> {
        let mut sleeper = self.patient_connection(None).await;
        let mut watcher = self.connection().await;
        let sleep = tokio::spawn(async move {
            ::redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg(seconds)
                .query_async::<()>(&mut sleeper)
                .await
        });
        // Asleep once a PING from another connection goes unanswered.
        for _ in 0..100 {
            let ping = ::redis::cmd("PING");
            let reply = ping.query_async::<String>(&mut watcher);
            if tokio::time::timeout(Duration::from_millis(50), reply)
                .await
                .is_err()
            {
                return sleep;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("redis never fell asleep");
    }

    /// The keys matching `pattern` (`KEYS`).
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut conn = self.connection().await;
        ::redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut conn)
            .await
            .expect("KEYS")
    }

    /// The keys matching `pattern`, each with its PTTL.
    pub async fn keys_with_ttl(&self, pattern: &str) -> Vec<(String, i64)> {
        let mut conn = self.connection().await;
        let mut out = Vec::new();
        for key in self.keys(pattern).await {
            let ttl: i64 = ::redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("PTTL");
            out.push((key, ttl));
        }
        out
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.spawn() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on port {}:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs the binary; false when it exited at once (port taken).
    fn spawn(&mut self) -> bool {
        let bin = server_binary();
        let log = self.dir.path().join("redis.log");
        let mut command = Command::new(&bin);
        if self.tls {
            command.args(["--port", "0", "--tls-port", &self.port.to_string()]);
        } else {
            command.args(["--port", &self.port.to_string()]);
        }
        let child = command
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(&log)
            .arg("--unixsocket")
            .arg(self.socket_path())
            .args(&self.extra_args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(err) => panic!(
                "cannot run {bin:?} ({err}): install Redis (apt-get install redis-server) \
                 or point THROTTLEGATE_REDIS_SERVER at a redis-server binary"
            ),
        };
        self.child = Some(child);
        let client = ::redis::Client::open(self.inspection_url()).expect("valid url");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                eprintln!("redis-server exited with {status}:\n{}", self.log());
                self.child = None;
                return false;
            }
            if let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(200))
                && ::redis::cmd("PING").query::<String>(&mut conn).is_ok()
            {
                return true;
            }
            if Instant::now() > deadline {
                panic!(
                    "redis-server on port {} did not answer within 10 s:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|it| it.local_addr())
        .map(|it| it.port())
        .expect("find a free port")
}

/// Settings for a backend on `server`: pool of 4, 5 s timeout. Tests of
/// timeouts set their own; the others must not fail because two shared CI
/// cores were busy for half a second.
pub fn settings(server: &RedisServer, clock: ClockSource) -> RedisSettings {
    RedisSettings {
        url: server.url(),
        sentinel: None,
        pool_size: 4,
        timeout_ms: 5_000,
        key_prefix: "tg".to_owned(),
        clock,
        expiry_grace_ms: 0,
        batch: None,
        tls: Default::default(),
    }
}

/// The id Redis gave the connection `conn` (`CLIENT ID`).
pub async fn client_id(conn: &mut ::redis::aio::MultiplexedConnection) -> u64 {
    ::redis::cmd("CLIENT")
        .arg("ID")
        .query_async(conn)
        .await
        .expect("client id")
}

/// Ids of the clients connected to Redis, except `skip`.
pub async fn client_ids(
    conn: &mut ::redis::aio::MultiplexedConnection,
    skip: &[u64],
) -> HashSet<u64> {
    let list: String = ::redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(conn)
        .await
        .expect("client list");
    list.lines()
        .filter_map(|line| {
            line.split_whitespace()
                .next()?
                .strip_prefix("id=")?
                .parse::<u64>()
                .ok()
        })
        .filter(|id| !skip.contains(id))
        .collect()
}

/// Makes the user `tg` (password `secret`), who may do everything but
/// `denied` (`-fcall`, `-function`, `-role`); the URL that logs in as it.
pub async fn user_without(server: &RedisServer, denied: &str) -> String {
    let mut admin = server.connection().await;
    let () = ::redis::cmd("ACL")
        .arg("SETUSER")
        .arg("tg")
        .arg("on")
        .arg(">secret")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg(denied)
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    format!("redis://tg:secret@127.0.0.1:{}/", server.port())
}

/// Loads the decision script on `conn` as the backend would; its SHA1.
pub async fn load_decide_script(conn: &mut ::redis::aio::MultiplexedConnection) -> String {
    ::redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(DECIDE_LUA)
        .query_async(conn)
        .await
        .expect("load the decision script")
}

/// Loads the decision library on `conn` as the backend would (FUNCTION LOAD).
pub async fn load_library(conn: &mut ::redis::aio::MultiplexedConnection) {
    let () = ::redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(&throttlegate::backends::redis::script::library().source)
        .query_async(conn)
        .await
        .expect("FUNCTION LOAD");
}

/// FUNCTION FLUSH: every library is gone from the server behind `conn`.
pub async fn function_flush(conn: &mut ::redis::aio::MultiplexedConnection) {
    let () = ::redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(conn)
        .await
        .expect("FUNCTION FLUSH");
}

pub async fn backend(server: &RedisServer, clock: ClockSource) -> RedisBackend {
    backend_with(server, clock, |_| {}).await
}

/// A backend on `server` with [`settings`] as `edit` leaves them.
pub async fn backend_with(
    server: &RedisServer,
    clock: ClockSource,
    edit: impl FnOnce(&mut RedisSettings),
) -> RedisBackend {
    let mut settings = settings(server, clock);
    edit(&mut settings);
    RedisBackend::connect(settings)
        .await
        .expect("connect the redis backend")
}

/// A backend on `server` with batching on (64 requests, 512 keys a call)
/// over one connection, Redis's clock and a timeout of `timeout_ms`: one
/// call in flight, so what comes during a `DEBUG SLEEP` waits for a batch.
pub async fn batched_on_one_connection(server: &RedisServer, timeout_ms: u64) -> Arc<RedisBackend> {
    let backend = backend_with(server, ClockSource::Redis, |it| {
        it.pool_size = 1;
        it.timeout_ms = timeout_ms;
        it.batch = Some(throttlegate::backends::redis::BatchSettings {
            max_requests: 64,
            max_keys: 512,
        });
    })
    .await;
    Arc::new(backend)
}

/// A gRPC server deciding `yaml` on a backend on `server` that asks Redis
/// for the time.
pub async fn service(server: &RedisServer, yaml: &str) -> TestService {
    let backend: Arc<dyn Backend> = Arc::new(backend(server, ClockSource::Redis).await);
    start_with_config(yaml, backend, default_options()).await
}

/// Whether the server holds the library named `name` (`FUNCTION LIST`).
pub async fn library_loaded(server: &RedisServer, name: &str) -> bool {
    let mut conn = server.connection().await;
    let listed: ::redis::Value = ::redis::cmd("FUNCTION")
        .arg("LIST")
        .arg("LIBRARYNAME")
        .arg(name)
        .query_async(&mut conn)
        .await
        .expect("FUNCTION LIST");
    // One entry per library whose name contains `name`; ours are unique.
    matches!(listed, ::redis::Value::Array(items) if !items.is_empty())
}

/// Zeroes the command statistics (`CONFIG RESETSTAT`).
pub async fn reset_stats(conn: &mut ::redis::aio::MultiplexedConnection) {
    let () = ::redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
        .expect("CONFIG RESETSTAT");
}

/// `INFO commandstats`.
pub async fn command_stats(conn: &mut ::redis::aio::MultiplexedConnection) -> String {
    ::redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats")
}

/// The figure `field` (`calls`, `usec_per_call`...) of `command` in
/// `stats`, as [`command_stats`] gives them.
pub fn command_stat(stats: &str, command: &str, field: &str) -> Option<f64> {
    let prefix = format!("cmdstat_{command}:");
    let field = format!("{field}=");
    stats
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))?
        .split(',')
        .find_map(|it| it.strip_prefix(&field))?
        .parse()
        .ok()
}

/// 64 tasks send `requests` requests of `checks` through `backends`
/// (round robin); returns how many were allowed.
pub async fn hammer<B: Backend + 'static>(
    backends: Vec<Arc<B>>,
    checks: Vec<KeyedCheck>,
    requests: usize,
) -> usize {
    let checks = Arc::new(checks);
    let mut tasks = Vec::new();
    for task in 0..64 {
        let backend = backends[task % backends.len()].clone();
        let checks = checks.clone();
        tasks.push(tokio::spawn(async move {
            let mut allowed = 0;
            for _ in 0..requests / 64 {
                if backend.decide(&checks).await.expect("decide").allowed {
                    allowed += 1;
                }
            }
            allowed
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("task");
    }
    total
}

/// A sorted set's members as (member, score), the score read as `T`, in
/// rank order.
pub async fn members<T: ::redis::FromRedisValue>(
    conn: &mut ::redis::aio::MultiplexedConnection,
    key: &str,
) -> Vec<(String, T)> {
    ::redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(conn)
        .await
        .unwrap()
}
