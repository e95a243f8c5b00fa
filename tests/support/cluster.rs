//! A real Redis Cluster per test: `redis-server --cluster-enabled yes`
//! nodes on free ports, joined by `redis-cli --cluster create`, and what
//! tests do to it (kill and restart a node, move a slot with its keys,
//! read command statistics). Every node is stopped on drop.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ::redis::aio::MultiplexedConnection;

use super::redis::RedisServer;

/// The nodes of one cluster; `nodes[..primaries]` start as primaries.
pub struct Cluster {
    nodes: Vec<RedisServer>,
    /// Whether `nodes[i]` runs (not killed).
    running: Vec<bool>,
    primaries: usize,
}

impl Cluster {
    /// `primaries` primaries sharing the 16384 slots, each with `replicas`
    /// replicas; returns once every node reports `cluster_state:ok`.
    pub async fn start(primaries: usize, replicas: usize) -> Cluster {
        Cluster::start_with(primaries, replicas, None).await
    }

    /// [`Cluster::start`] with every node requiring `password` (replicas
    /// authenticate to their primaries with it).
    pub async fn start_with(primaries: usize, replicas: usize, password: Option<&str>) -> Cluster {
        Cluster::start_on(primaries, replicas, password, None).await
    }

    /// A cluster of primaries only that speaks TLS only, on its client
    /// ports and its bus, with `cert`/`key` signed by `ca`; clients need no
    /// certificate.
    pub async fn start_tls(primaries: usize, cert: &Path, key: &Path, ca: &Path) -> Cluster {
        Cluster::start_on(primaries, 0, None, Some((cert, key, ca))).await
    }

    async fn start_on(
        primaries: usize,
        replicas: usize,
        password: Option<&str>,
        tls: Option<(&Path, &Path, &Path)>,
    ) -> Cluster {
        let auth: Vec<&str> = match password {
            Some(password) => vec!["--requirepass", password, "--masterauth", password],
            None => Vec::new(),
        };
        let nodes: Vec<RedisServer> = (0..primaries * (1 + replicas))
            .map(|_| {
                let bus = free_port().to_string();
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-port",
                    &bus,
                    // Replicas sync at once (Redis 7 waits 5 s by default),
                    // so they can be promoted as soon as the test starts.
                    "--repl-diskless-sync-delay",
                    "0",
                    // Tests stall a node with DEBUG SLEEP.
                    "--enable-debug-command",
                    "local",
                ];
                args.extend(&auth);
                match tls {
                    Some((cert, key, ca)) => {
                        args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"]);
                        RedisServer::start_tls_and(cert, key, ca, false, &args)
                    }
                    None => RedisServer::start_with(&args),
                }
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|it| format!("127.0.0.1:{}", it.port()))
            .collect();
        let mut cli = Command::new("redis-cli");
        if let Some((_, _, ca)) = tls {
            cli.arg("--tls").arg("--cacert").arg(ca);
        }
        if let Some(password) = password {
            cli.args(["--no-auth-warning", "-a", password]);
        }
        let output = cli
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap_or_else(|err| {
                panic!("cannot run redis-cli ({err}): apt-get install redis-tools")
            });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let running = vec![true; nodes.len()];
        let cluster = Cluster {
            nodes,
            running,
            primaries,
        };
        cluster.wait_ok(Duration::from_secs(30)).await;
        cluster.wait_replicas_synced(Duration::from_secs(30)).await;
        cluster
    }

    /// Waits until every replica's link to its primary is up: a replica
    /// that never synced is never promoted.
    async fn wait_replicas_synced(&self, within: Duration) {
        let deadline = Instant::now() + within;
        for node in &self.nodes[self.primaries..] {
            let mut conn = node.connection().await;
            loop {
                let info: String = ::redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut conn)
                    .await
                    .expect("INFO replication");
                if info.contains("master_link_status:up") {
                    break;
                }
                assert!(Instant::now() < deadline, "replica not synced:\n{info}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// `127.0.0.1:port` of every node, the seeds a backend is given.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|it| format!("127.0.0.1:{}", it.port()))
            .collect()
    }

    pub fn node(&self, idx: usize) -> &RedisServer {
        &self.nodes[idx]
    }

    fn running_nodes(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes
            .iter()
            .zip(&self.running)
            .filter_map(|(node, running)| running.then_some(node))
    }

    /// SIGKILL `nodes[idx]`, as a crash would.
    pub fn kill(&mut self, idx: usize) {
        self.nodes[idx].kill();
        self.running[idx] = false;
    }

    /// Starts `nodes[idx]` again on its port with its cluster config, so it
    /// rejoins (as a replica if its slots were failed over).
    pub fn restart(&mut self, idx: usize) {
        self.nodes[idx].restart();
        self.running[idx] = true;
    }

    /// How many primaries the cluster was created with.
    pub fn primaries(&self) -> usize {
        self.primaries
    }

    /// Waits until every running node reports `cluster_state:ok` and
    /// agrees on who serves every slot.
    pub async fn wait_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if self.all_ok().await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster not ok within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn all_ok(&self) -> bool {
        let mut slot_owners = Vec::new();
        for node in self.running_nodes() {
            let Some(mut conn) = try_connection(node).await else {
                return false;
            };
            let info: String = match ::redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut conn)
                .await
            {
                Ok(info) => info,
                Err(_) => return false,
            };
            if !info.contains("cluster_state:ok") {
                return false;
            }
            let slots: ::redis::Value = match ::redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut conn)
                .await
            {
                Ok(it) => it,
                Err(_) => return false,
            };
            slot_owners.push(format!("{slots:?}"));
        }
        slot_owners.windows(2).all(|it| it[0] == it[1])
    }

    /// The index of the node serving `slot` as primary, as `nodes[0]` sees it.
    pub async fn owner_of(&self, slot: u16) -> usize {
        let mut conn = self.any_connection().await;
        let port = owner_port(&mut conn, slot).await;
        self.nodes
            .iter()
            .position(|it| it.port() == port)
            .expect("the owner is one of ours")
    }

    /// A connection to the first running node.
    pub async fn any_connection(&self) -> MultiplexedConnection {
        for node in self.running_nodes() {
            if let Some(conn) = try_connection(node).await {
                return conn;
            }
        }
        panic!("no node of the cluster answers");
    }

    /// The indices of the nodes that are primaries now (ROLE).
    pub async fn current_primaries(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (idx, node) in self.nodes.iter().enumerate() {
            if !self.running[idx] {
                continue;
            }
            let mut conn = node.connection().await;
            let role: Vec<::redis::Value> = ::redis::cmd("ROLE")
                .query_async(&mut conn)
                .await
                .expect("ROLE");
            if matches!(role.first(), Some(::redis::Value::BulkString(it)) if it == b"master") {
                out.push(idx);
            }
        }
        out
    }

    /// `cmdstat_<name>` calls summed over every running primary.
    pub async fn calls_on_primaries(&self, name: &str) -> u64 {
        let mut total = 0;
        for idx in self.current_primaries().await {
            let mut conn = self.nodes[idx].connection().await;
            let info: String = ::redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await
                .expect("INFO commandstats");
            total += calls_in(&info, name);
        }
        total
    }

    /// CONFIG RESETSTAT on every running node.
    pub async fn reset_stats(&self) {
        for node in self.running_nodes() {
            let mut conn = node.connection().await;
            let () = ::redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async(&mut conn)
                .await
                .expect("CONFIG RESETSTAT");
        }
    }

    /// Moves `slot` with its keys to `nodes[to]` the way `redis-cli
    /// --cluster reshard` does: IMPORTING, MIGRATING, MIGRATE in batches
    /// (pausing `between_batches` so live traffic meets the slot half
    /// moved), then SETSLOT NODE on every primary.
    pub async fn move_slot(&self, slot: u16, to: usize, between_batches: Duration) {
        let from = self.owner_of(slot).await;
        assert_ne!(from, to, "slot {slot} is already on node {to}");
        let mut source = self.nodes[from].connection().await;
        let mut target = self.nodes[to].connection().await;
        let source_id = my_id(&mut source).await;
        let target_id = my_id(&mut target).await;
        setslot(&mut target, slot, "IMPORTING", &source_id).await;
        setslot(&mut source, slot, "MIGRATING", &target_id).await;
        loop {
            let keys: Vec<String> = ::redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(1)
                .query_async(&mut source)
                .await
                .expect("GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let () = ::redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(self.nodes[to].port())
                .arg("")
                .arg(0)
                .arg(5_000)
                .arg("KEYS")
                .arg(&keys)
                .query_async(&mut source)
                .await
                .expect("MIGRATE");
            tokio::time::sleep(between_batches).await;
        }
        for idx in self.current_primaries().await {
            let mut conn = self.nodes[idx].connection().await;
            setslot(&mut conn, slot, "NODE", &target_id).await;
        }
    }

    /// How many clients `nodes[idx]` serves, leaving out replication
    /// links and the connection asking.
    pub async fn clients_of(&self, idx: usize) -> usize {
        let mut conn = self.nodes[idx].connection().await;
        let own: u64 = ::redis::cmd("CLIENT")
            .arg("ID")
            .query_async(&mut conn)
            .await
            .expect("CLIENT ID");
        let list: String = ::redis::cmd("CLIENT")
            .arg("LIST")
            .arg("TYPE")
            .arg("normal")
            .query_async(&mut conn)
            .await
            .expect("CLIENT LIST");
        let own = format!("id={own} ");
        list.lines().filter(|line| !line.starts_with(&own)).count()
    }

    /// FUNCTION FLUSH on `nodes[idx]`: the library is gone from that node.
    pub async fn function_flush(&self, idx: usize) {
        let mut conn = self.nodes[idx].connection().await;
        super::redis::function_flush(&mut conn).await;
    }

    /// The keys of every running primary matching `pattern`.
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut out = Vec::new();
        for idx in self.current_primaries().await {
            out.extend(self.nodes[idx].keys(pattern).await);
        }
        out.sort();
        out
    }
}

async fn try_connection(node: &RedisServer) -> Option<MultiplexedConnection> {
    let client = ::redis::Client::open(node.url()).ok()?;
    let connect = client.get_multiplexed_async_connection();
    tokio::time::timeout(Duration::from_secs(1), connect)
        .await
        .ok()?
        .ok()
}

async fn my_id(conn: &mut MultiplexedConnection) -> String {
    ::redis::cmd("CLUSTER")
        .arg("MYID")
        .query_async(conn)
        .await
        .expect("CLUSTER MYID")
}

async fn setslot(conn: &mut MultiplexedConnection, slot: u16, state: &str, node: &str) {
    let () = ::redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg(state)
        .arg(node)
        .query_async(conn)
        .await
        .unwrap_or_else(|err| panic!("CLUSTER SETSLOT {slot} {state}: {err}"));
}

/// The port of the primary serving `slot`, from CLUSTER SHARDS' older
/// sibling CLUSTER SLOTS: `[[start, end, [host, port, id], ...], ...]`.
async fn owner_port(conn: &mut MultiplexedConnection, slot: u16) -> u16 {
    let ranges: Vec<(u16, u16, (String, u16))> = {
        let raw: Vec<Vec<::redis::Value>> = ::redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(conn)
            .await
            .expect("CLUSTER SLOTS");
        raw.into_iter()
            .map(|range| {
                let start: u16 = ::redis::from_redis_value(range[0].clone()).expect("start");
                let end: u16 = ::redis::from_redis_value(range[1].clone()).expect("end");
                let node: Vec<::redis::Value> =
                    ::redis::from_redis_value(range[2].clone()).expect("node");
                let host: String = ::redis::from_redis_value(node[0].clone()).expect("host");
                let port: u16 = ::redis::from_redis_value(node[1].clone()).expect("port");
                (start, end, (host, port))
            })
            .collect()
    };
    ranges
        .into_iter()
        .find(|(start, end, _)| (*start..=*end).contains(&slot))
        .map(|(_, _, (_, port))| port)
        .unwrap_or_else(|| panic!("no node serves slot {slot}"))
}

/// `calls=` of `cmdstat_<name>` in INFO commandstats, 0 when absent.
pub fn calls_in(info: &str, name: &str) -> u64 {
    let prefix = format!("cmdstat_{name}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|it| it.parse().ok())
        .unwrap_or(0)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|it| it.local_addr())
        .map(|it| it.port())
        .expect("find a free port")
}
