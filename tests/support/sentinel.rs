//! A master, a replica and three sentinels watching them, each a real
//! `redis-server` on a free port; all stopped on drop.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use throttlegate::backends::redis::{ClockSource, RedisBackend, RedisSettings, SentinelSettings};

use super::redis::RedisServer;

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "tgmaster";

/// How long the sentinels wait before they call a silent master down.
pub const DOWN_AFTER_MS: u64 = 1_000;

/// A master, its replica and three sentinels (quorum 2).
pub struct SentinelSetup {
    pub master: RedisServer,
    pub replica: RedisServer,
    sentinels: Vec<SentinelProcess>,
    passwords: Passwords,
}

/// `requirepass` of the Redis nodes and of the sentinels.
#[derive(Clone, Default)]
pub struct Passwords {
    pub redis: Option<String>,
    pub sentinel: Option<String>,
}

/// One `redis-server <conf> --sentinel`; killed and waited for on drop.
struct SentinelProcess {
    port: u16,
    password: Option<String>,
    dir: tempfile::TempDir,
    child: Child,
}

impl SentinelSetup {
    /// Starts everything and waits until every sentinel sees the replica
    /// and the two other sentinels, so that a failover can be agreed on.
    pub async fn start() -> SentinelSetup {
        SentinelSetup::start_with(Passwords::default()).await
    }

    /// [`SentinelSetup::start`] with passwords: the replica authenticates
    /// to the master, the sentinels to the nodes and to each other.
    pub async fn start_with(passwords: Passwords) -> SentinelSetup {
        let mut auth = Vec::new();
        if let Some(password) = &passwords.redis {
            auth = vec!["--requirepass", password, "--masterauth", password];
        }
        let master = RedisServer::start_with(&auth);
        let port = master.port().to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &port];
        replica_args.extend(&auth);
        let replica = RedisServer::start_with(&replica_args);
        let sentinels = (0..3)
            .map(|_| SentinelProcess::start(master.port(), &passwords))
            .collect();
        let setup = SentinelSetup {
            master,
            replica,
            sentinels,
            passwords,
        };
        setup.wait_until_ready().await;
        setup
    }

    /// `host:port` of every sentinel, as `--redis-sentinel-nodes` takes them.
    pub fn nodes(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|it| format!("127.0.0.1:{}", it.port))
            .collect()
    }

    /// The settings of a backend finding the master through the sentinels:
    /// pool of 4, `timeout_ms` on every call.
    pub fn settings(&self, timeout_ms: u64) -> RedisSettings {
        let url = match &self.passwords.redis {
            Some(password) => format!("redis://:{password}@sentinel-master/"),
            None => "redis://sentinel-master/".to_owned(),
        };
        RedisSettings {
            url,
            sentinel: Some(SentinelSettings {
                nodes: self.nodes(),
                master: MASTER_NAME.to_owned(),
                password: self.passwords.sentinel.clone(),
            }),
            pool_size: 4,
            timeout_ms,
            key_prefix: "tg".to_owned(),
            clock: ClockSource::Redis,
            expiry_grace_ms: 0,
            batch: None,
            tls: Default::default(),
        }
    }

    pub async fn backend(&self, timeout_ms: u64) -> RedisBackend {
        RedisBackend::connect(self.settings(timeout_ms))
            .await
            .expect("connect through sentinel")
    }

    /// The master's port according to the first sentinel that answers.
    pub async fn master_port(&self) -> Option<u16> {
        for sentinel in &self.sentinels {
            if let Some(port) = sentinel.master_port().await {
                return Some(port);
            }
        }
        None
    }

    /// Waits until every write the master acknowledged reached the replica.
    pub async fn wait_for_replication(&self) {
        let mut conn = self
            .master
            .patient_connection(Some(Duration::from_secs(10)))
            .await;
        let acked: i64 = ::redis::cmd("WAIT")
            .arg(1)
            .arg(5_000)
            .query_async(&mut conn)
            .await
            .expect("WAIT");
        assert_eq!(acked, 1, "the replica did not acknowledge within 5 s");
    }

    /// Waits until the first sentinel names a master on `port` and that
    /// node says it is master.
    pub async fn wait_for_master(&self, port: u16, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if self.master_port().await == Some(port)
                && role(port, self.passwords.redis.as_deref()).await.as_deref() == Some("master")
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no failover to port {port} within {within:?}:\n{}",
                self.sentinels[0].log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_until_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for sentinel in &self.sentinels {
            while !sentinel.sees_everyone().await {
                assert!(
                    Instant::now() < deadline,
                    "sentinel on {} did not see the replica and the other sentinels:\n{}",
                    sentinel.port,
                    sentinel.log()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The ROLE a node on `port` reports, if it answers.
async fn role(port: u16, password: Option<&str>) -> Option<String> {
    let client = ::redis::Client::open(url(port, password)).ok()?;
    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
    let role: Vec<::redis::Value> = ::redis::cmd("ROLE").query_async(&mut conn).await.ok()?;
    ::redis::FromRedisValue::from_redis_value(role.into_iter().next()?).ok()
}

impl SentinelProcess {
    fn start(master_port: u16, passwords: &Passwords) -> SentinelProcess {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("create a temporary directory");
            let port = free_port();
            if let Some(child) = spawn(&dir, port, master_port, passwords) {
                return SentinelProcess {
                    port,
                    password: passwords.sentinel.clone(),
                    dir,
                    child,
                };
            }
        }
        panic!("redis sentinel could not bind a free port after 5 attempts");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }

    async fn connection(&self) -> Option<::redis::aio::MultiplexedConnection> {
        let client = ::redis::Client::open(url(self.port, self.password.as_deref())).ok()?;
        client.get_multiplexed_async_connection().await.ok()
    }

    async fn master_port(&self) -> Option<u16> {
        let mut conn = self.connection().await?;
        let addr: Option<(String, u16)> = ::redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(MASTER_NAME)
            .query_async(&mut conn)
            .await
            .ok()?;
        addr.map(|(_, port)| port)
    }

    /// Whether it knows the replica and both other sentinels.
    async fn sees_everyone(&self) -> bool {
        let Some(mut conn) = self.connection().await else {
            return false;
        };
        let Ok(fields) = ::redis::cmd("SENTINEL")
            .arg("master")
            .arg(MASTER_NAME)
            .query_async::<Vec<String>>(&mut conn)
            .await
        else {
            return false;
        };
        let field = |name: &str| {
            let at = fields.iter().position(|it| it == name)?;
            fields.get(at + 1)?.parse::<u32>().ok()
        };
        field("num-slaves") == Some(1) && field("num-other-sentinels") == Some(2)
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes the config (sentinel rewrites it, so each has its own directory)
/// and runs the sentinel; `None` when it exited at once (port taken).
fn spawn(
    dir: &tempfile::TempDir,
    port: u16,
    master_port: u16,
    passwords: &Passwords,
) -> Option<Child> {
    let conf = dir.path().join("sentinel.conf");
    let log = dir.path().join("sentinel.log");
    let mut text = format!(
        "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {log}\n\
         sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
         sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
         sentinel failover-timeout {MASTER_NAME} 10000\n\
         sentinel parallel-syncs {MASTER_NAME} 1\n",
        dir = dir.path().display(),
        log = log.display(),
    );
    if let Some(password) = &passwords.redis {
        text.push_str(&format!("sentinel auth-pass {MASTER_NAME} {password}\n"));
    }
    if let Some(password) = &passwords.sentinel {
        text.push_str(&format!("requirepass {password}\n"));
    }
    std::fs::write(&conf, text).expect("write sentinel.conf");
    let bin = std::env::var("THROTTLEGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
    let mut child = Command::new(&bin)
        .arg(&conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|err| {
            panic!("cannot run {bin:?} ({err}): install Redis (apt-get install redis-server)")
        });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            eprintln!("redis sentinel exited with {status}:\n{log}");
            return None;
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some(child);
        }
        assert!(
            Instant::now() < deadline,
            "redis sentinel on port {port} did not listen within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn url(port: u16, password: Option<&str>) -> String {
    match password {
        Some(password) => format!("redis://:{password}@127.0.0.1:{port}/"),
        None => format!("redis://127.0.0.1:{port}/"),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|it| it.local_addr())
        .map(|it| it.port())
        .expect("find a free port")
}
