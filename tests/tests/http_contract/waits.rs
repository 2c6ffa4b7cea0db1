//! Duplicates that wait for the first attempt's answer (a route's `wait`) instead of a 409, on
//! every store and across instances: they replay the first's stored answer, one of them runs
//! the handler when the first released the key, they answer 409 at their deadline or past the
//! bounds on waiters, they stop waiting when their client leaves, and (PostgreSQL, Redis) they
//! still get the answer after the store's listener connection was killed.
//!
//! The PostgreSQL and Redis stores here look again unwoken only every 30 s
//! (`change_poll`), far past the 5 s waits: a waiter there answers within its wait only if a
//! notification woke it, so these tests fail when notifications do not arrive.

use crate::{App, Fw, Server, config, key, problem, serve};
use futures_util::future::join_all;
use idempotent_core::http::{Config, ConfigBuilder};
use idempotent_core::{Engine, MemoryStore, Store};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How rarely the notifying stores look again unwoken, in these tests.
const UNWOKEN: Duration = Duration::from_secs(30);

/// The waited routes' work (both frameworks): sleeps `delay_ms`; the server's first run given
/// a `first_status` answers it (a 5xx releases the key); the body names the run
/// and carries a nonce, so no two runs answer the same bytes.
pub(crate) async fn work(app: &App, account: &str, v: &Value) -> (u16, Value) {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(v["delay_ms"].as_u64().unwrap_or(0))).await;
    // Once per server: the first run given a `first_status` answers it.
    let status = match v["first_status"].as_u64() {
        Some(status) if !app.panicked_once.swap(true, Ordering::SeqCst) => {
            u16::try_from(status).unwrap()
        }
        _ => 201,
    };
    let body = json!({"run": n, "account": account, "nonce": uuid::Uuid::new_v4().to_string()});
    (status, body)
}

/// One answer, read whole.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: Option<String>,
    body: bytes::Bytes,
}

async fn answer(res: reqwest::Response) -> Answer {
    Answer {
        status: res.status().as_u16(),
        replayed: res
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap().to_owned()),
        body: res.bytes().await.unwrap(),
    }
}

async fn send(s: &Server, path: &str, key: &str, body: &str) -> Answer {
    answer(
        s.post(path, "acct_w", Some(key), body)
            .send()
            .await
            .unwrap(),
    )
    .await
}

/// Waits (bounded) until the server's handler has started `n` runs.
async fn until_runs(s: &Server, n: usize) {
    for _ in 0..500 {
        if s.runs() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the handler never started run {n}");
}

/// Waits (bounded) until `n` requests wait in `engine`.
async fn until_waiting(engine: &Engine, n: usize) {
    for _ in 0..500 {
        if engine.waiting() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{n} requests never waited (now {})", engine.waiting());
}

/// 16 concurrent duplicates of one slow request: one execution, 16 byte-identical answers,
/// 15 of them replayed.
async fn sixteen_duplicates(s: &Server) {
    let key = key();
    let before = s.runs();
    let answers = join_all((0..16).map(|_| send(s, "/wait", &key, r#"{"delay_ms": 500}"#))).await;
    assert_eq!(s.runs() - before, 1, "{answers:?}");
    assert!(answers.iter().all(|a| a.status == 201), "{answers:?}");
    assert!(
        answers.iter().all(|a| a.body == answers[0].body),
        "{answers:?}"
    );
    let replayed = answers
        .iter()
        .filter(|a| a.replayed.as_deref() == Some("true"))
        .count();
    assert_eq!(replayed, 15, "{answers:?}");
}

/// The first attempt answers 503 (the key is released): exactly one waiter runs the handler,
/// the others replay its answer.
async fn first_attempt_released(s: &Server) {
    let key = key();
    let body = r#"{"delay_ms": 400, "first_status": 503}"#;
    let before = s.runs();
    let first = {
        let req = s.post("/wait", "acct_w", Some(&key), body);
        tokio::spawn(async move { answer(req.send().await.unwrap()).await })
    };
    until_runs(s, before + 1).await;
    let waiters = join_all((0..8).map(|_| send(s, "/wait", &key, body))).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(s.runs() - before, 2, "{waiters:?}");
    let ran: Vec<&Answer> = waiters
        .iter()
        .filter(|a| a.replayed.as_deref() == Some("false"))
        .collect();
    assert_eq!(ran.len(), 1, "exactly one waiter runs: {waiters:?}");
    assert!(
        waiters
            .iter()
            .all(|a| a.status == 201 && a.body == ran[0].body),
        "{waiters:?}"
    );
}

/// The duplicate sent to instance B receives instance A's answer; B never runs the handler.
async fn across_instances(a: &Server, b: &Server) {
    let key = key();
    let body = r#"{"delay_ms": 600}"#;
    let first = {
        let req = a.post("/wait", "acct_w", Some(&key), body);
        tokio::spawn(async move { answer(req.send().await.unwrap()).await })
    };
    until_runs(a, 1).await;
    let duplicates = join_all((0..4).map(|_| send(b, "/wait", &key, body))).await;
    let first = first.await.unwrap();
    assert_eq!((first.status, a.runs(), b.runs()), (201, 1, 0));
    for d in &duplicates {
        assert_eq!(
            (d.status, d.replayed.as_deref(), &d.body),
            (201, Some("true"), &first.body),
            "{d:?}"
        );
    }
}

/// Two instances over one deployment: their stores, made afresh.
async fn on_deployment(fw: Fw, instance: impl AsyncFn() -> Arc<dyn Store>) {
    let s = serve(fw, config(instance().await)).await;
    sixteen_duplicates(&s).await;
    first_attempt_released(&s).await;
    let (a, b) = (
        serve(fw, config(instance().await)).await,
        serve(fw, config(instance().await)).await,
    );
    across_instances(&a, &b).await;
}

pub(crate) async fn waits_on_memory(fw: Fw) {
    let store = MemoryStore::new();
    on_deployment(fw, async || Arc::new(store.clone()) as Arc<dyn Store>).await;
}

pub(crate) async fn waits_on_sqlite(fw: Fw) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("waits.db").display());
    let first = idempotent_core::SqliteStore::connect(&url).await.unwrap();
    first.migrate().await.unwrap();
    // Each instance its own pool and store on the file: another process, as far as
    // notifications go (it finds the answer by polling).
    on_deployment(fw, async || {
        Arc::new(idempotent_core::SqliteStore::connect(&url).await.unwrap()) as Arc<dyn Store>
    })
    .await;
}

pub(crate) async fn waits_on_postgres(fw: Fw) {
    let pool = idempotent_tests::fixtures::pg_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("waits");
    let store = || {
        idempotent_core::PostgresStore::builder(pool.clone())
            .table(&table)
            .change_poll(UNWOKEN)
            .build()
            .unwrap()
    };
    store().migrate().await.unwrap();
    on_deployment(fw, async || Arc::new(store()) as Arc<dyn Store>).await;
    // The listener's connection killed while requests wait: they still get the answer.
    let (a, b) = (
        serve(fw, config(store())).await,
        serve(fw, config(store())).await,
    );
    let kill = async {
        let channel = pg_channel(&format!("public.{table}"));
        let killed: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = $1",
        )
        .bind(format!("LISTEN \"{channel}\""))
        .fetch_all(&pool)
        .await
        .unwrap();
        assert!(!killed.is_empty(), "no listener to kill");
    };
    listener_killed(&a, &b, kill).await;
    idempotent_tests::fixtures::pg_drop(&pool, &table).await;
}

/// The PostgreSQL store's notification channel for `table` (as `pg_listen` names it).
fn pg_channel(table: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(table.as_bytes());
    let hex: String = digest[..10].iter().map(|b| format!("{b:02x}")).collect();
    format!("idempotent_{hex}")
}

pub(crate) async fn waits_on_mysql(fw: Fw) {
    let pool = idempotent_tests::fixtures::mysql_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("waits");
    idempotent_tests::fixtures::mysql_store(pool.clone(), &table).await;
    // Each instance its own store value: no notification reaches another (MySQL has none), so
    // it finds the answer by polling.
    on_deployment(fw, async || {
        let store = idempotent_core::MySqlStore::builder(pool.clone())
            .table(&table)
            .build()
            .unwrap();
        Arc::new(store) as Arc<dyn Store>
    })
    .await;
    idempotent_tests::fixtures::mysql_drop(&pool, &table).await;
}

async fn waits_on_redis(fw: Fw, url: String) {
    let prefix = format!("{}:", idempotent_tests::fixtures::unique_table("w"));
    let store = || async {
        idempotent_core::RedisStore::builder()
            .prefix(&prefix)
            .change_poll(UNWOKEN)
            .connect(&url)
            .await
            .unwrap()
    };
    on_deployment(fw, async || Arc::new(store().await) as Arc<dyn Store>).await;
    // The subscriber's connection killed (on every node) while requests wait: they still get
    // the answer.
    let (a, b) = (
        serve(fw, config(store().await)).await,
        serve(fw, config(store().await)).await,
    );
    // Another test's run (the other framework's, on the same server) may have just killed
    // this store's subscriber too, which is then reconnecting: looked for again, bounded.
    let kill = async {
        for _ in 0..100 {
            if kill_subscribers(&url).await > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no subscriber to kill");
    };
    listener_killed(&a, &b, kill).await;
    for node in idempotent_tests::fixtures::redis_primaries(&url).await {
        let mut conn = idempotent_tests::fixtures::redis_node(&node).await;
        for k in idempotent_tests::fixtures::redis_keys(&node, &prefix).await {
            let _: () = redis::cmd("DEL")
                .arg(k)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
}

/// Kills every subscribed connection on the nodes `url` names; how many.
async fn kill_subscribers(url: &str) -> i64 {
    let mut killed = 0;
    // The subscriber connects to a node the URL names (a cluster's seeds).
    let nodes: Vec<String> = match url.strip_prefix("redis+cluster://") {
        Some(seeds) => seeds.split(',').map(|n| format!("redis://{n}")).collect(),
        None => vec![url.to_owned()],
    };
    for node in nodes {
        let mut conn = idempotent_tests::fixtures::redis_node(&node).await;
        // Every connection subscribed to a channel (`sub=1` in CLIENT LIST), by id.
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut conn)
            .await
            .unwrap();
        for line in list.lines() {
            let field = |name: &str| {
                line.split(' ')
                    .find_map(|f| f.strip_prefix(name))
                    .unwrap_or("")
                    .to_owned()
            };
            if field("sub=") != "0" && !field("sub=").is_empty() {
                let n: i64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("ID")
                    .arg(field("id="))
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                killed += n;
            }
        }
    }
    killed
}

pub(crate) async fn waits_on_redis_standalone(fw: Fw) {
    waits_on_redis(fw, std::env::var("REDIS_URL").unwrap()).await;
}

pub(crate) async fn waits_on_redis_cluster(fw: Fw) {
    waits_on_redis(fw, std::env::var("REDIS_CLUSTER_URL").unwrap()).await;
}

/// Requests wait on instance `b` for a slow first attempt on instance `a`; `kill` cuts the
/// store's listener connection; the first then answers, and every waiter replays it within its
/// wait. The store looks again unwoken only every 30 s, and `a`'s own in-process notification
/// never reaches `b`'s engine: only `b`'s reconnected listener can have woken them.
async fn listener_killed(a: &Server, b: &Server, kill: impl Future<Output = ()>) {
    let key = key();
    let body = r#"{"delay_ms": 1500}"#;
    let first = {
        let req = a.post("/wait", "acct_w", Some(&key), body);
        tokio::spawn(async move { answer(req.send().await.unwrap()).await })
    };
    until_runs(a, 1).await;
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let req = b.post("/wait", "acct_w", Some(&key), body);
            tokio::spawn(async move { answer(req.send().await.unwrap()).await })
        })
        .collect();
    until_waiting(&b.engine, 3).await;
    // The listener starts with the first waiter; give it a moment to be connected and
    // listening before it is cut.
    tokio::time::sleep(Duration::from_millis(300)).await;
    kill.await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    for waiter in waiters {
        let waiter = waiter.await.unwrap();
        assert_eq!(
            (waiter.status, waiter.replayed.as_deref(), &waiter.body),
            (201, Some("true"), &first.body),
            "{waiter:?}"
        );
    }
    assert_eq!((a.runs(), b.runs()), (1, 0));
}

/// A configuration whose engine lets at most `per_key` requests wait on one record, and whose
/// routes without a `wait` of their own wait `wait`.
fn bounded(per_key: usize, wait: Duration) -> Config {
    let engine = Engine::builder(MemoryStore::new())
        .max_waiting_per_key(per_key)
        .build()
        .unwrap();
    ConfigBuilder::<Config>::new(engine)
        .wait(wait)
        .build()
        .unwrap()
}

/// Waits end at their deadline (409), past the bound on waiters (409 at once, while the first
/// still runs), and when their client leaves; routes without a `wait` take the
/// configuration's.
pub(crate) async fn waits_end_at_deadlines_bounds_and_departures(fw: Fw) {
    let s = serve(fw, bounded(2, Duration::from_millis(300))).await;
    let key = key();
    let slow = r#"{"delay_ms": 1500}"#;
    let first = {
        let req = s.post("/wait/default", "acct_w", Some(&key), slow);
        tokio::spawn(async move { answer(req.send().await.unwrap()).await })
    };
    until_runs(&s, 1).await;
    // The configuration's 300 ms wait, then 409 while the first still runs.
    let busy = s
        .post("/wait/default", "acct_w", Some(&key), slow)
        .send()
        .await
        .unwrap();
    assert!(
        !first.is_finished(),
        "the first finished before the deadline passed"
    );
    problem(busy, 409, "idempotency-key-in-progress").await;

    // On `/wait` (5 s): two wait, the third is refused at once.
    let key = key_of("bounded");
    let first = {
        let req = s.post("/wait", "acct_w", Some(&key), slow);
        tokio::spawn(async move { answer(req.send().await.unwrap()).await })
    };
    until_runs(&s, 2).await;
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let req = s.post("/wait", "acct_w", Some(&key), slow);
            tokio::spawn(async move { answer(req.send().await.unwrap()).await })
        })
        .collect();
    until_waiting(&s.engine, 2).await;
    let refused = s
        .post("/wait", "acct_w", Some(&key), slow)
        .send()
        .await
        .unwrap();
    assert!(!first.is_finished(), "the refusal was not at once");
    problem(refused, 409, "idempotency-key-in-progress").await;
    assert_eq!(s.engine.waiting(), 2, "the refused request took a place");
    let first = first.await.unwrap();
    for waiter in waiters {
        let waiter = waiter.await.unwrap();
        assert_eq!((waiter.status, &waiter.body), (201, &first.body));
    }

    // A client that leaves mid-wait: its wait ends at once, its place given back.
    let key = key_of("departs");
    let first = {
        let req = s.post("/wait", "acct_w", Some(&key), slow);
        tokio::spawn(async move { answer(req.send().await.unwrap()).await })
    };
    until_runs(&s, 3).await;
    // The connection reset (RST), as a client that gives up and closes its socket does; a
    // half-close (FIN) is no departure (the client may still read the answer), and actix-web
    // keeps serving a request whose client only half-closed.
    let request = format!(
        "POST /wait HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acct_w\r\ncontent-type: application/json\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n\r\n{slow}",
        slow.len()
    );
    let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut conn, request.as_bytes())
        .await
        .unwrap();
    until_waiting(&s.engine, 1).await;
    // A zero linger makes the close a reset at once.
    #[allow(deprecated)]
    conn.set_linger(Some(Duration::ZERO)).unwrap();
    drop(conn);
    for _ in 0..200 {
        if s.engine.waiting() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !first.is_finished(),
        "the first finished before the departure was seen"
    );
    assert_eq!(s.engine.waiting(), 0, "the departed client still waits");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(s.runs(), 3);
}

fn key_of(what: &str) -> String {
    format!("{what}-{}", uuid::Uuid::new_v4())
}
