//! Issue 53: the local replay cache over HTTP, on both frameworks. A retry of a request this
//! instance completed is answered from process memory: no store call and no body extractor
//! (its body was parsed once, by the first attempt); the fingerprint still decides (422 for
//! another body under the key), another scope never hits, the bytes stay within their bounds,
//! and a record deleted from the store (as `idempotent-admin delete` does) is replayed from the
//! cache at most `max_age` longer.

use crate::{Fw, Server, key, parsed, problem, serve};
use idempotent_core::engine::ReplayCache;
use idempotent_core::http::Config;
use idempotent_core::store::RecordKey;
use idempotent_core::{Engine, IdempotencyKey, MemoryStore, Scope, Store};
use idempotent_tests::faults::FaultyStore;
use std::sync::Arc;
use std::time::Duration;

/// An amount no other test sends, so its parse count is this test's.
fn fresh_amount() -> i64 {
    1_000_000 + i64::from(rand_u16()) * 1_000 + i64::from(rand_u16() % 1_000)
}

fn rand_u16() -> u16 {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    u16::from_be_bytes([bytes[0], bytes[1]])
}

async fn charge(s: &Server, account: &str, key: &str, amount: i64) -> reqwest::Response {
    s.post(
        "/v1/charges",
        account,
        Some(key),
        &format!(r#"{{"amount": {amount}}}"#),
    )
    .send()
    .await
    .unwrap()
}

/// Status, the replay marker and the body bytes.
async fn read(res: reqwest::Response) -> (u16, Option<String>, bytes::Bytes) {
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, replayed, res.bytes().await.unwrap())
}

pub(crate) async fn replay_cache_answers_before_the_store_and_the_body_extractor(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let engine = Engine::builder_from_arc(store.clone())
        .replay_cache(ReplayCache::new().max_age(Duration::from_secs(600)))
        .build()
        .unwrap();
    let s = serve(fw, Config::new(engine)).await;
    let (k, amount) = (key(), fresh_amount());
    let first = read(charge(&s, "acct_c1", &k, amount).await).await;
    assert_eq!((first.0, first.1.as_deref()), (201, Some("false")));
    assert_eq!((s.runs(), store.claims(), parsed(amount)), (1, 1, 1));
    // Retries: the same bytes, replayed, with no claim and no parse.
    for _ in 0..3 {
        let again = read(charge(&s, "acct_c1", &k, amount).await).await;
        assert_eq!((again.0, again.1.as_deref()), (201, Some("true")));
        assert_eq!(again.2, first.2);
    }
    assert_eq!((s.runs(), store.claims(), parsed(amount)), (1, 1, 1));
    // Another body under the key: 422 from the cache, nothing parsed, the store not asked.
    let other = amount + 1;
    problem(
        charge(&s, "acct_c1", &k, other).await,
        422,
        "idempotency-key-mismatch",
    )
    .await;
    assert_eq!((s.runs(), store.claims(), parsed(other)), (1, 1, 0));
    // Another scope with the same key is another record: never a hit.
    let theirs = read(charge(&s, "acct_c2", &k, amount).await).await;
    assert_eq!((theirs.0, theirs.1.as_deref()), (201, Some("false")));
    assert_ne!(theirs.2, first.2);
    assert_eq!((s.runs(), store.claims(), parsed(amount)), (2, 2, 2));
    // The scope's extractor still runs first: no bearer, no replay.
    let res = s
        .client
        .post(format!("{}/v1/charges", s.base))
        .header("content-type", "application/json")
        .header("idempotency-key", &k)
        .body(format!(r#"{{"amount": {amount}}}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 401);
    // A route with `extract_on_replay`: its body is parsed on every replay, still no claim.
    let (k, amount) = (key(), fresh_amount());
    let claims = store.claims();
    for _ in 0..3 {
        let res = s
            .post(
                "/v1/checked-charges",
                "acct_c1",
                Some(&k),
                &format!(r#"{{"amount": {amount}}}"#),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), 201);
    }
    assert_eq!((store.claims() - claims, parsed(amount)), (1, 3));
    // Without a cache every retry is a claim (so the counts above can fail).
    let plain = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, Config::new(Engine::from_arc(plain.clone()))).await;
    let (k, amount) = (key(), fresh_amount());
    for _ in 0..3 {
        charge(&s, "acct_c1", &k, amount).await;
    }
    assert_eq!((s.runs(), plain.claims(), parsed(amount)), (1, 3, 3));
}

/// Many distinct keys (one scope, then many): the cache's bytes stay within its budgets, and
/// one scope's load leaves room for the others.
pub(crate) async fn replay_cache_bounds_hold_under_distinct_keys(fw: Fw) {
    let engine = Engine::builder(MemoryStore::new())
        .replay_cache(
            ReplayCache::new()
                .max_bytes(64 << 10)
                .max_bytes_per_scope(16 << 10),
        )
        .build()
        .unwrap();
    let s = serve(fw, Config::new(engine.clone())).await;
    let greedy = Scope::new("acct_greedy").unwrap();
    for _ in 0..200 {
        let res = charge(&s, "acct_greedy", &key(), fresh_amount()).await;
        assert_eq!(res.status().as_u16(), 201);
    }
    let held = engine.replay_cache_bytes(Some(&greedy)).unwrap();
    assert!(held > 0 && held <= 16 << 10, "{held}");
    // Another scope's record is kept beside it, and replays from the cache.
    let (k, amount) = (key(), fresh_amount());
    charge(&s, "acct_modest", &k, amount).await;
    let modest = Scope::new("acct_modest").unwrap();
    assert!(engine.replay_cache_bytes(Some(&modest)).unwrap() > 0);
    let again = read(charge(&s, "acct_modest", &k, amount).await).await;
    assert_eq!(
        (again.0, again.1.as_deref(), parsed(amount)),
        (201, Some("true"), 1)
    );
    // Many scopes: the total stays within its budget.
    for i in 0..60 {
        for _ in 0..4 {
            charge(&s, &format!("acct_many_{i}"), &key(), fresh_amount()).await;
        }
    }
    let total = engine.replay_cache_bytes(None).unwrap();
    assert!(total > 0 && total <= 64 << 10, "{total}");
}

/// Two instances on one store, each with a cache: A keeps entries at most 3 s, B 600 s. Both
/// answer the first attempt's bytes (B after reading the store once, then from its cache). The
/// record deleted in the store (`Store::delete`, what `idempotent-admin delete` runs): B, within
/// its `max_age`, replays it from its cache; A, once its `max_age` has passed, runs it again.
async fn two_instances_and_a_deleted_record(fw: Fw, store: impl Fn() -> Arc<dyn Store>) {
    let cached = |store, max_age| {
        Engine::builder_from_arc(store)
            .replay_cache(ReplayCache::new().max_age(max_age))
            .build()
            .unwrap()
    };
    let (short, long) = (Duration::from_secs(3), Duration::from_secs(600));
    let store_a = store();
    let a = serve(fw, Config::new(cached(store_a.clone(), short))).await;
    let b = serve(fw, Config::new(cached(store(), long))).await;
    let (k, amount) = (key(), fresh_amount());
    let first = read(charge(&a, "acct_two", &k, amount).await).await;
    assert_eq!(first.0, 201);
    for s in [&b, &a, &b] {
        let again = read(charge(s, "acct_two", &k, amount).await).await;
        assert_eq!((again.1.as_deref(), &again.2), (Some("true"), &first.2));
    }
    // Parsed twice: A's first attempt, and B's first look, which missed and read the store.
    assert_eq!((a.runs(), b.runs(), parsed(amount)), (1, 0, 2));
    let kept_at = std::time::Instant::now();
    let record = RecordKey::new(
        Scope::new("acct_two").unwrap(),
        IdempotencyKey::parse(k.as_bytes()).unwrap(),
    );
    assert!(matches!(
        store_a.delete(&record, false).await.unwrap(),
        idempotent_core::store::Deleted::Deleted(_)
    ));
    // B: within its 600 s, from its cache.
    let from_b = read(charge(&b, "acct_two", &k, amount).await).await;
    assert_eq!((from_b.1.as_deref(), &from_b.2), (Some("true"), &first.2));
    // A: after its 3 s, runs it again, as the store says.
    tokio::time::sleep(short.saturating_sub(kept_at.elapsed()) + Duration::from_millis(50)).await;
    let after = read(charge(&a, "acct_two", &k, amount).await).await;
    assert_eq!((after.0, after.1.as_deref()), (201, Some("false")));
    assert_eq!((a.runs(), b.runs()), (2, 0));
}

pub(crate) async fn replay_cache_two_instances_and_a_deleted_record(fw: Fw) {
    let shared: Arc<dyn Store> = Arc::new(MemoryStore::new());
    two_instances_and_a_deleted_record(fw, || shared.clone()).await;
}

pub(crate) async fn replay_cache_on_postgres_two_instances_and_a_deleted_record(fw: Fw) {
    let pool = idempotent_tests::fixtures::pg_pool(8).await;
    let table = idempotent_tests::fixtures::unique_table("cache");
    let store = || {
        idempotent_core::PostgresStore::builder(pool.clone())
            .table(&table)
            .build()
            .unwrap()
    };
    store().migrate().await.unwrap();
    two_instances_and_a_deleted_record(fw, || Arc::new(store()) as Arc<dyn Store>).await;
}
