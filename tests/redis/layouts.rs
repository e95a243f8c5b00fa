//! Stored layouts: what each version of the decision script reads and
//! writes at a counter key, and versions sharing one Redis during an
//! upgrade. The older versions run from their own script text
//! (`tests/fixtures/layouts/`), beside this version's backend, on the
//! same keys and the same Redis clock.

use crate::support;
use crate::support::keys::check_on;
use crate::support::redis::{RedisServer, backend, members};
use redis::aio::MultiplexedConnection;
use throttlegate::algorithms::Algorithm::{self, SlidingWindowLog};
use throttlegate::backends::redis::script::{
    self, BATCH_FIELDS, HeaderArgs, REQUEST_FIELDS, ReplyIntegers,
};
use throttlegate::backends::redis::script::{ScriptLimit, argv};
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, KeyedCheck, keys};

/// The decision script before stored layouts were checked: a sliding log
/// holds one member `"<end>,<cost>"` per request (layout 1), and a log
/// whose newest member is of layout 0 is converted by counting its
/// members as units.
const LAYOUT1_SCRIPT: &str = include_str!("../fixtures/layouts/decide-layout1.lua");

/// The decision script before the running totals: one member
/// `"<µs>:<seq>"` per unit of cost (layout 0), counted with ZCARD.
const LAYOUT0_SCRIPT: &str = include_str!("../fixtures/layouts/decide-layout0.lua");

const WINDOW_S: u64 = 60;

/// The key prefix of `support::redis::backend`.
const PREFIX: &str = "tg";

fn log_check(user: &str, limit: u64, cost: u64) -> KeyedCheck {
    check_on(SlidingWindowLog, WINDOW_S, &[("user", user)], limit, cost)
}

fn redis_key(check: &KeyedCheck) -> String {
    keys::encode(PREFIX, &check.key)
}

/// One request of `cost` on `key`'s log of `limit` per minute, decided by
/// the layout-1 script at the Redis clock; whether it was allowed. Its
/// arguments are written out as that version sends them.
async fn layout1_decides(
    conn: &mut MultiplexedConnection,
    key: &str,
    limit: u64,
    cost: u64,
) -> bool {
    let window_us = WINDOW_S * 1_000_000;
    let reply: Vec<u8> = redis::Script::new(LAYOUT1_SCRIPT)
        .key(key)
        .arg("")
        .arg(0)
        .arg(0)
        .arg(format!(
            "sliding_window_log:{limit}:{window_us}:{limit}:0:1:{cost}:enforce"
        ))
        .invoke_async(conn)
        .await
        .expect("the layout-1 script decides");
    let allowed = i64::from_be_bytes(reply[..8].try_into().unwrap());
    allowed == 1
}

/// The same with the layout-0 script: eight arguments per limit, and the
/// reply `{allowed, now, has_room, consumed, remaining, reset}`.
async fn layout0_decides(
    conn: &mut MultiplexedConnection,
    key: &str,
    limit: u64,
    cost: u64,
) -> bool {
    let window_us = WINDOW_S * 1_000_000;
    let reply: Vec<i64> = redis::Script::new(LAYOUT0_SCRIPT)
        .key(key)
        .arg("")
        .arg(0)
        .arg("sliding_window_log")
        .arg(limit)
        .arg(window_us)
        .arg(limit)
        .arg(0)
        .arg(1)
        .arg(cost)
        .arg("enforce")
        .invoke_async(conn)
        .await
        .expect("the layout-0 script decides");
    reply[0] == 1
}

/// This version's backend deciding one request; whether it was allowed and
/// the units it reports left.
async fn this_version_decides(backend: &RedisBackend, check: &KeyedCheck) -> (bool, u64) {
    let verdict = backend
        .decide(std::slice::from_ref(check))
        .await
        .expect("this version decides");
    (verdict.allowed, verdict.outcomes[0].remaining)
}

/// Which version decides each request of a rolling upgrade's traffic.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Version {
    Layout0,
    Layout1,
    This,
}

/// Runs `turns` requests on one log of `limit`, request `i` decided by
/// `versions[i % len]` with cost `costs[i % len]`; checks that each
/// decision of this version reports exactly the units left after every
/// request admitted so far (by any version), and returns the units
/// admitted in all.
async fn share_one_log(
    server: &RedisServer,
    user: &str,
    limit: u64,
    versions: &[Version],
    costs: &[u64],
    turns: usize,
) -> u64 {
    let backend = backend(server, ClockSource::Redis).await;
    let mut conn = server.connection().await;
    let key = redis_key(&log_check(user, limit, 1));
    let mut admitted = 0;
    for turn in 0..turns {
        let cost = costs[turn % costs.len()];
        let version = versions[turn % versions.len()];
        let allowed = match version {
            Version::Layout0 => layout0_decides(&mut conn, &key, limit, cost).await,
            Version::Layout1 => layout1_decides(&mut conn, &key, limit, cost).await,
            Version::This => {
                let (allowed, remaining) =
                    this_version_decides(&backend, &log_check(user, limit, cost)).await;
                let taken = admitted + if allowed { cost } else { 0 };
                assert_eq!(
                    remaining,
                    limit.saturating_sub(taken),
                    "turn {turn} of {versions:?}: this version misread the log"
                );
                allowed
            }
        };
        if allowed {
            admitted += cost;
        }
    }
    admitted
}

/// A rolling upgrade from the version before stored layouts were checked:
/// both write layout 1, so however their requests interleave on one log,
/// and whatever the costs, the log admits its limit and never more.
#[tokio::test]
async fn the_previous_version_and_this_one_sharing_a_log_admit_its_limit() {
    use Version::{Layout1, This};
    let server = RedisServer::start();
    let limit = 100;
    let orders: [&[Version]; 4] = [
        &[Layout1, This],
        &[This, Layout1],
        &[This, This, Layout1],
        &[Layout1, Layout1, Layout1, This],
    ];
    for (idx, versions) in orders.into_iter().enumerate() {
        for costs in [&[1][..], &[3, 1, 2, 5]] {
            let user = format!("{idx}-{}", costs.len());
            let admitted = share_one_log(&server, &user, limit, versions, costs, 160).await;
            assert!(
                admitted <= limit && admitted + 4 >= limit,
                "{versions:?} costs {costs:?}: {admitted} admitted of {limit}"
            );
        }
    }
}

/// The double count of the finding: a version of layout 0 (one member per
/// unit, counted with ZCARD) alternating with a later one on one log. The
/// later one converted the log by counting its members as units and left
/// one member holding them all, which the older one counted as one unit:
/// 200 admitted of 100. This version converts each member with its own
/// units and time, so with requests of one unit the older one counts the
/// log right too, and the two admit the limit exactly.
#[tokio::test]
async fn a_layout_0_version_and_this_one_alternating_on_one_log_admit_its_limit() {
    use Version::{Layout0, This};
    let server = RedisServer::start();
    let limit = 40;
    for (idx, versions) in [
        &[Layout0, This][..],
        &[This, Layout0],
        &[Layout0, Layout0, This],
    ]
    .into_iter()
    .enumerate()
    {
        let admitted = share_one_log(&server, &idx.to_string(), limit, versions, &[1], 100).await;
        assert_eq!(admitted, limit, "{versions:?}");
    }
}

/// Requests of several units: the layout-0 version counts this version's
/// members one unit each and may admit more (it cannot be changed; the
/// upgrade procedure in docs/redis.md keeps it off the keys of later
/// versions), but this version never misreads what it wrote: every answer
/// of this version above counts every unit admitted by both.
#[tokio::test]
async fn this_version_reads_a_log_both_layouts_wrote_exactly() {
    use Version::{Layout0, This};
    let server = RedisServer::start();
    let limit = 1_000;
    share_one_log(
        &server,
        "costs",
        limit,
        &[Layout0, This, This],
        &[7, 1, 3],
        120,
    )
    .await;
}

/// The Redis clock in µs.
async fn redis_now(conn: &mut MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000 + micros
}

/// What the key holds, whatever its type, to compare before and after.
async fn dump(conn: &mut MultiplexedConnection, key: &str) -> Vec<u8> {
    redis::cmd("DUMP").arg(key).query_async(conn).await.unwrap()
}

const ALGORITHMS: [Algorithm; 5] = [
    SlidingWindowLog,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
    Algorithm::SlidingWindowCounter,
    Algorithm::FixedWindow,
];

/// Writes at `key` a state of `algorithm`'s type that no version writes:
/// a log member of neither layout, integers that are not, or one field
/// too many.
async fn write_foreign_state(conn: &mut MultiplexedConnection, algorithm: Algorithm, key: &str) {
    let () = match algorithm {
        SlidingWindowLog => {
            let now = redis_now(conn).await;
            redis::cmd("ZADD")
                .arg(key)
                .arg(now)
                .arg("7;7")
                .query_async(conn)
                .await
        }
        Algorithm::FixedWindow => {
            redis::cmd("SET")
                .arg(key)
                .arg("1.5e6:2")
                .query_async(conn)
                .await
        }
        _ => {
            redis::cmd("SET")
                .arg(key)
                .arg("1:2:3:4")
                .query_async(conn)
                .await
        }
    }
    .unwrap();
}

/// For every algorithm, a state in no layout this version knows is
/// refused (the request fails, naming the key and what it holds), never
/// read as something else, and left as it is; other counters are decided
/// as before.
#[tokio::test]
async fn a_state_of_no_known_layout_is_refused_and_left_alone() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis).await;
    let mut conn = server.connection().await;
    for algorithm in ALGORITHMS {
        let odd = check_on(algorithm, WINDOW_S, &[("user", "odd")], 10, 1);
        let key = redis_key(&odd);
        write_foreign_state(&mut conn, algorithm, &key).await;
        let before = dump(&mut conn, &key).await;
        let err = backend
            .decide(std::slice::from_ref(&odd))
            .await
            .unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("stored layout refused") && message.contains(&key),
            "{algorithm:?}: {message}"
        );
        assert_eq!(
            dump(&mut conn, &key).await,
            before,
            "{algorithm:?}: key changed"
        );
        let fine = check_on(algorithm, WINDOW_S, &[("user", "fine")], 10, 1);
        let verdict = backend.decide(&[fine]).await.expect("another counter");
        assert!(verdict.allowed, "{algorithm:?}");
    }
}

/// In a batch, the request whose key holds such a state fails alone, with
/// the limit that holds it, and the others are decided.
#[tokio::test]
async fn in_a_batch_a_refused_layout_fails_its_request_alone() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    support::redis::load_library(&mut conn).await;
    let fine = check_on(Algorithm::FixedWindow, WINDOW_S, &[("user", "fine")], 10, 1);
    let odd = check_on(Algorithm::FixedWindow, WINDOW_S, &[("user", "odd")], 10, 1);
    write_foreign_state(&mut conn, Algorithm::FixedWindow, &redis_key(&odd)).await;
    let header = HeaderArgs {
        now_us: None,
        grace_ms: 0,
        receipts: false,
    };
    let requests: [&[&KeyedCheck]; 2] = [&[&fine, &odd], &[&fine]];
    let keys: Vec<String> = requests
        .iter()
        .flat_map(|it| it.iter().map(|check| redis_key(check)))
        .collect();
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(&script::library().decide_batch)
        .arg(keys.len())
        .arg(&keys)
        .arg((BATCH_FIELDS[0].value)(&requests.len()));
    for request in requests {
        let limits: Vec<ScriptLimit> = request
            .iter()
            .map(|it| ScriptLimit::of(&it.check))
            .collect();
        cmd.arg((REQUEST_FIELDS[0].value)(&request.len()))
            .arg(argv(&header, &limits));
    }
    let reply: ReplyIntegers = cmd
        .query_async(&mut conn)
        .await
        .expect("the batch is decided");
    let answers = script::parse_batch_reply(&reply.0, &[2, 1]).expect("a batch reply");
    let refused = answers[0].as_ref().unwrap_err().to_string();
    assert!(refused.contains("stored state of limit 2"), "{refused}");
    let verdict = answers[1].as_ref().expect("the other request is decided");
    assert!(verdict.allowed);
    assert_eq!(
        verdict.outcomes[0].remaining, 9,
        "the refused request took nothing"
    );
}

/// A log of layout 0 is read whole to be converted: one holding up to
/// 1,024 members in its window is converted exactly; a longer one is
/// counted (never read) and its units held as one member at the newest
/// score, so the request is decided rather than refused.
#[tokio::test]
async fn a_layout_0_log_is_converted_up_to_1024_members_and_collapsed_past_them() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis).await;
    let mut conn = server.connection().await;
    for (user, units) in [("some", 1_024u64), ("many", 1_025)] {
        let check = log_check(user, 2_000, 1);
        let key = redis_key(&check);
        let now = redis_now(&mut conn).await;
        let mut fill = redis::cmd("ZADD");
        fill.arg(&key);
        for unit in 0..units {
            let at = now - 1_000_000 + unit;
            fill.arg(at).arg(format!("{at}:1"));
        }
        let () = fill.query_async(&mut conn).await.unwrap();
        let verdict = backend
            .decide(std::slice::from_ref(&check))
            .await
            .expect("converted and decided");
        assert!(verdict.allowed);
        assert_eq!(verdict.outcomes[0].remaining, 2_000 - units - 1);
        let stored: Vec<(String, u64)> = members(&mut conn, &key).await;
        if units <= 1_024 {
            assert_eq!(stored.len() as u64, units + 1);
            assert_eq!(stored[0], ("1,1".to_owned(), now - 1_000_000));
        } else {
            assert_eq!(stored.len(), 2);
            assert_eq!(
                stored[0],
                (format!("{units},{units}"), now - 1_000_000 + units - 1)
            );
        }
    }
}

/// Batched requests on one key share the server's µs and so one member
/// `"<end>,<cost>"`, which a version of layout 0 counts as one unit: beside
/// such a version, even costs of one are not exact under batching (the
/// upgrade procedure keeps the two apart).
#[tokio::test]
async fn a_layout_0_version_counts_a_batchs_shared_member_as_one_unit() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    support::redis::load_library(&mut conn).await;
    let check = log_check("batched", 2, 1);
    let key = redis_key(&check);
    let header = HeaderArgs {
        now_us: None,
        grace_ms: 0,
        receipts: false,
    };
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(&script::library().decide_batch)
        .arg(2)
        .arg(&key)
        .arg(&key)
        .arg((BATCH_FIELDS[0].value)(&2));
    for _ in 0..2 {
        cmd.arg((REQUEST_FIELDS[0].value)(&1))
            .arg(argv(&header, &[ScriptLimit::of(&check.check)]));
    }
    let reply: ReplyIntegers = cmd.query_async(&mut conn).await.expect("a batch");
    let answers = script::parse_batch_reply(&reply.0, &[1, 1]).expect("a batch reply");
    assert!(answers.iter().all(|it| it.as_ref().unwrap().allowed));
    let stored: Vec<(String, u64)> = members(&mut conn, &key).await;
    assert_eq!(stored.len(), 1, "one member holds both: {stored:?}");
    assert_eq!(stored[0].0, "2,2");
    // The layout-0 version counts one unit of its limit of 2, and admits a
    // third.
    assert!(layout0_decides(&mut conn, &key, 2, 1).await);
}
