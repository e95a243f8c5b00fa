//! Rate-limit quota budgets kept in Redis: instances on one Redis share
//! one budget, exactly, while their members report concurrently.

mod support;

use std::sync::Arc;
use std::time::Duration;

use throttlegate::clock::SystemClock;
use throttlegate::quota::redis::RedisPools;
use throttlegate::quota::share::{Budget, Pool, REPORT_INTERVAL_US};
use throttlegate::quota::{Grant, Outbox, QuotaBook, Resolution, Usage, descriptor, resolve};

use support::redis::RedisServer;
use support::service::rules_from;

const LIMIT: u64 = 300;
const MINUTE: u64 = 60_000_000;
const RULES: &str = "
domain: quota
descriptors:
  - key: name
    value: shared
    rate_limit: {unit: minute, requests_per_unit: 300}
";

fn shared_pool() -> (throttlegate::quota::PoolKey, Budget) {
    let rules = rules_from(RULES);
    let bucket = [("name".to_owned(), "shared".to_owned())];
    let entries = descriptor(bucket.iter().map(|(k, v)| (k, v)));
    match resolve(&rules, "quota", &entries) {
        Resolution::Shared { pool, budget, .. } => (pool, budget),
        other => panic!("{other:?}"),
    }
}

/// `per_minute` requests asked over one report interval.
fn asked(per_minute: u64) -> Usage {
    Usage {
        allowed: per_minute * REPORT_INTERVAL_US / MINUTE,
        denied: 0,
        elapsed_us: REPORT_INTERVAL_US,
    }
}

/// The shares the proxies hold, summed, as stored in Redis now.
fn stored_commitment(url: &str, pool: &throttlegate::quota::PoolKey) -> u64 {
    let mut connection = redis::Client::open(url).unwrap().get_connection().unwrap();
    let fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(format!("throttlegate:rlqs:{}", pool.as_str()))
        .query(&mut connection)
        .unwrap();
    let budget = Budget {
        per_window: LIMIT,
        window_us: MINUTE,
    };
    Pool::from_fields(fields.iter().map(|(k, v)| (k.as_str(), v.as_str())), budget)
        .expect("a well-formed pool")
        .committed()
}

/// Requests per minute a grant admits over a minute from full.
fn per_minute(grant: Grant) -> u64 {
    match grant {
        Grant::DenyAll => 0,
        Grant::AllowAll => u64::MAX,
        Grant::Tokens(bucket) => {
            u64::from(bucket.max_tokens)
                + u64::from(bucket.tokens_per_fill) * MINUTE / bucket.fill_interval_us
        }
    }
}

/// Three proxies on each of two books reporting, concurrently, demands
/// that keep moving, then settle; the latest grant each proxy was sent (answers and
/// pushes alike go through its outbox, as on a stream), per minute.
async fn run(books: [Arc<QuotaBook>; 2], rounds: usize, settle: usize) -> Vec<u64> {
    let (pool, budget) = shared_pool();
    let mut tasks = Vec::new();
    for (idx, book) in books.iter().cycle().take(6).enumerate() {
        let book = book.clone();
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let outbox = Outbox::new();
            let member = book.member_id();
            for round in 0..rounds + settle {
                // Demands jumping between far under and far over a fair
                // share, so shares keep moving; then all over it alike.
                let demand = if round < rounds {
                    [10, 400, 30, 250][(idx + round) % 4]
                } else {
                    250
                };
                let reported = book
                    .report(member, 0, &outbox, &pool, budget, Some(asked(demand)))
                    .await
                    .expect("a share");
                outbox.put(0, reported.grant, Some(reported.order), book.now());
                if round % 8 == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            outbox
        }));
    }
    // Read only once every task is done: a task still running can push
    // to the others.
    let mut outboxes = Vec::new();
    for task in tasks {
        outboxes.push(task.await.unwrap());
    }
    let mut shares = Vec::new();
    for outbox in outboxes {
        let grants = outbox.take().await;
        shares.push(per_minute(grants[&0]));
    }
    shares
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_on_one_redis_share_one_budget_exactly() {
    let redis = RedisServer::start();
    let book = || {
        Arc::new(QuotaBook::with_redis(
            Arc::new(SystemClock),
            RedisPools::new(&redis.url()).unwrap(),
        ))
    };
    let books = [book(), book()];
    let (pool, _) = shared_pool();
    // A watcher reads the stored shares all along: every state written is
    // within the budget.
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let watching = watching.clone();
        let url = redis.url();
        let pool = pool.clone();
        tokio::task::spawn_blocking(move || {
            let mut most = 0;
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(stored_commitment(&url, &pool));
            }
            most
        })
    };
    let shares = run(books, 60, 10).await;
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    let most_stored = watcher.await.unwrap();
    let held: u64 = shares.iter().sum();
    let stored = stored_commitment(&redis.url(), &pool);
    println!(
        "six proxies on two instances: latest shares {shares:?} (sum {held}); \
         most ever stored {most_stored}, now {stored}; limit {LIMIT}"
    );
    assert!(most_stored <= LIMIT, "{most_stored} stored over {LIMIT}");
    assert!(stored <= LIMIT);
    assert!(held <= LIMIT, "{shares:?}");
    // Everyone gets a share, and the budget is used.
    assert!(shares.iter().all(|it| *it > 0), "{shares:?}");
    assert!(held >= LIMIT * 8 / 10, "{shares:?}");
}

/// While demands keep moving, the grants the proxies hold at the end (each
/// its latest, answers and pushes alike) add up to at most the budget:
/// no instance decided on a state another had already changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_changes_never_hand_out_more_than_the_budget() {
    let redis = RedisServer::start();
    let book = || {
        Arc::new(QuotaBook::with_redis(
            Arc::new(SystemClock),
            RedisPools::new(&redis.url()).unwrap(),
        ))
    };
    let mut sums = Vec::new();
    for _ in 0..10 {
        let (pool, _) = shared_pool();
        let shares = run([book(), book()], 40, 0).await;
        sums.push(shares.iter().sum::<u64>());
        // The next run starts from an empty pool.
        let mut connection = redis::Client::open(redis.url())
            .unwrap()
            .get_connection()
            .unwrap();
        let _: () = redis::cmd("DEL")
            .arg(format!("throttlegate:rlqs:{}", pool.as_str()))
            .query(&mut connection)
            .unwrap();
    }
    println!("grants held at the end of ten runs of moving demand: {sums:?} (limit {LIMIT})");
    assert!(sums.iter().all(|it| *it <= LIMIT), "{sums:?}");
}

#[tokio::test]
async fn without_redis_each_instance_hands_out_the_whole_budget() {
    // What the Redis test rules out: two books of their own.
    let book = || Arc::new(QuotaBook::new(Arc::new(SystemClock)));
    let shares = run([book(), book()], 20, 10).await;
    let held: u64 = shares.iter().sum();
    println!("six proxies on two instances without Redis: {shares:?} (sum {held})");
    assert!(held > LIMIT, "{shares:?}");
}
