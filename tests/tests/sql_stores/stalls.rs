//! Connections gone silent, through `StallingProxy`: a MySQL heartbeat frozen holding the row
//! lock is ended by the server; a pool gone silent keeps its leases (PostgreSQL and MySQL).

use super::*;

/// A session frozen inside a heartbeat's transaction while it holds the record's row lock
/// (its COMMIT never reaches the server: a stopped process, a lost network) is ended by the
/// server within the store's 10 s idle limit, and the lock goes with it. With the server's
/// default idle limit (8 hours) the row would stay locked: the owner's complete would wait
/// `innodb_lock_wait_timeout` (50 s) and fail, again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_a_heartbeat_frozen_holding_the_row_lock_is_ended_by_the_server() {
    let table = unique_table("frozen");
    let pool = mysql_pool(2).await;
    let store = mysql_store(pool.clone(), &table).await;
    let (proxy, frozen_pool) =
        pool_through_proxy::<sqlx::MySql>(&mysql_url(), "127.0.0.1:3306", 1).await;
    let frozen = MySqlStore::builder(frozen_pool)
        .table(&table)
        .build()
        .unwrap();
    let key = unique_key("frozen");
    let lease = Duration::from_secs(60);
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("rt"),
        lease,
        ttl: Duration::from_secs(3600),
        max_stored: 0,
    };
    let ClaimOutcome::Claimed(claimed) = store.claim(req).await.unwrap() else {
        panic!("not claimed")
    };
    proxy.arm_on(b"COMMIT; SET SESSION wait_timeout");
    let stuck = {
        let key = key.clone();
        tokio::spawn(async move { frozen.extend(&key, claimed.token, lease).await })
    };
    let armed = std::time::Instant::now();
    while proxy.stalled() == 0 {
        assert!(
            armed.elapsed() < Duration::from_secs(10),
            "the heartbeat's COMMIT never passed the proxy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = std::time::Instant::now();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .execute(&mut *tx)
    .await
    .expect("the frozen session kept the row locked until innodb_lock_wait_timeout");
    let waited = started.elapsed();
    tx.rollback().await.unwrap();
    assert!(
        waited > Duration::from_secs(2),
        "the row was not locked by the frozen heartbeat (waited {waited:?})"
    );
    assert!(
        waited < Duration::from_secs(20),
        "the frozen session held the row for {waited:?}"
    );
    stuck.abort();
    drop(proxy);
    mysql_drop(&pool, &table).await;
}

/// Issue 49 (1): one instance's pool goes silent after its claims (a proxy freezes every
/// connection open then, its twelve warm connections; new ones pass), while three handlers run
/// three leases each. Their heartbeats must keep every lease (each renewal bounded, the
/// silent connection closed, the second attempt on a connection opened for it), so the other
/// instance, retrying every quarter lease, gets 409 for the whole run and then the stored
/// responses: never a take-over, never a second run. Three at once, with idle frozen
/// connections left in the pool, because a fresh connection must go to each renewal that
/// asks, not to one of them (review: a flag the store kept let only the first have it).
/// Before the fix the renewal waited on the frozen connection and the retry took the record
/// over one lease after the claim.
async fn frozen_pool_keeps_its_lease(
    frozen: Arc<dyn Store>,
    direct: Arc<dyn Store>,
    proxy: &idempotent_tests::stall::StallingProxy,
) {
    let lease = Duration::from_secs(2);
    let policy = Policy {
        lease,
        ..Policy::default()
    };
    let a = Engine::builder_from_arc(frozen)
        .lease(lease)
        .build()
        .unwrap();
    let b = Engine::builder_from_arc(direct)
        .lease(lease)
        .build()
        .unwrap();
    let keys: Vec<RecordKey> = (0..3)
        .map(|i| unique_key(&format!("frozen-pool-{i}")))
        .collect();
    let mut executions = Vec::new();
    for key in &keys {
        let Begin::Claimed(execution) = a.begin(request(key), &policy).await else {
            panic!("the first request claims")
        };
        executions.push(execution);
    }
    proxy.freeze_open();
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(keys.len() as u32));
    let first: Vec<_> = executions
        .into_iter()
        .enumerate()
        .map(|(i, mut execution)| {
            tokio::spawn(async move {
                let response = execution
                    .run(async {
                        tokio::time::sleep(lease * 3).await;
                        StoredResponse::new(201, format!("first {i}"))
                    })
                    .await
                    .unwrap();
                execution.finish(response.into()).await
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let mut replayed = vec![false; keys.len()];
    while replayed.iter().any(|r| !r) {
        tokio::time::sleep(lease / 4).await;
        let at = started.elapsed();
        for (i, key) in keys.iter().enumerate() {
            if replayed[i] {
                continue;
            }
            match b.begin(request(key), &policy).await {
                Begin::InProgress { .. } => {
                    assert!(
                        at < Duration::from_secs(60),
                        "still in progress after {at:?}"
                    );
                }
                Begin::Replay(StoredOutcome::Response(r)) => {
                    assert_eq!(r.body, format!("first {i}").into_bytes());
                    assert!(at >= lease * 3, "replayed before the handler ended: {at:?}");
                    replayed[i] = true;
                }
                Begin::Claimed(execution) => {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    execution.release().await;
                    panic!(
                        "the retry took record {i} over at {at:?}: the lease lapsed under a live handler"
                    );
                }
                other => panic!("at {at:?}: {other:?}"),
            }
        }
    }
    for first in first {
        assert!(matches!(first.await.unwrap(), Recorded::Stored));
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert!(
        proxy.stalled() >= 3,
        "fewer connections were frozen than renewals ran: the test proves little"
    );
}

/// `pool` with all its connections open and idle (twelve at once, each held a moment): more
/// than three executions' renewals can use up in two rounds, so a second attempt that goes
/// back to the pool finds a frozen one.
async fn warm<DB: sqlx::Database>(pool: sqlx::Pool<DB>) -> sqlx::Pool<DB> {
    let held: Vec<_> = futures_util::future::join_all((0..12).map(|_| pool.acquire()))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool.num_idle(), 12, "the pool is warm");
    pool
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_a_pool_gone_silent_keeps_its_lease() {
    let table = unique_table("silent");
    let pool = pg_pool(4).await;
    let direct = pg_store(pool.clone(), &table).await;
    let (proxy, frozen_pool) =
        pool_through_proxy::<sqlx::Postgres>(&database_url(), "127.0.0.1:5432", 12).await;
    let frozen = PostgresStore::builder(warm(frozen_pool).await)
        .schema("idempotent_test")
        .table(&table)
        .build()
        .unwrap();
    frozen_pool_keeps_its_lease(Arc::new(frozen), Arc::new(direct), &proxy).await;
    pg_drop(&pool, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_a_pool_gone_silent_keeps_its_lease() {
    let table = unique_table("silent");
    let pool = mysql_pool(4).await;
    let direct = mysql_store(pool.clone(), &table).await;
    let (proxy, frozen_pool) =
        pool_through_proxy::<sqlx::MySql>(&mysql_url(), "127.0.0.1:3306", 12).await;
    let frozen = MySqlStore::builder(warm(frozen_pool).await)
        .table(&table)
        .build()
        .unwrap();
    frozen_pool_keeps_its_lease(Arc::new(frozen), Arc::new(direct), &proxy).await;
    mysql_drop(&pool, &table).await;
}
