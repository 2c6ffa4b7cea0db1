//! Owners stalled on a silent connection, through `StallingProxy`: a COMMIT that never reaches
//! PostgreSQL never blocks its key's retries, and a BEGIN on a silent pooled connection keeps
//! the two-commit lease (PostgreSQL and MySQL).

use super::*;

/// An owner stalled right before its COMMIT, on the two-commit path: the complete and COMMIT
/// (one batch on PostgreSQL, so no session can stall holding the record's row between them)
/// never reach PostgreSQL and the connection stays open. Retries on another instance are each
/// answered within a second, never queued behind the owner: 409 while the owner's lease runs
/// (renewed, through its other connection, until it gives up on its COMMIT: a COMMIT that got
/// through late would have stored its response, so no retry may run the handler meanwhile),
/// then the take-over runs the handler once. More retries than the retrying instance has
/// connections, so a pool drained by waiting take-overs would show. The owner itself gives up
/// on its COMMIT (503) and its engine drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_owner_stalled_before_commit_never_blocks_its_key() {
    let lease = Duration::from_secs(1);
    let p = policy(lease);
    let two = options(CommitPath::Two);
    // The retrying instance: its own pool of two connections.
    let (db, store) = pg_db(pg_pool(2).await).await;
    let before = db.rows().await;
    // The owner: the same table, through the proxy.
    let (proxy, owner_pool) =
        pool_through_proxy::<sqlx::Postgres>(&database_url(), "127.0.0.1:5432", 2).await;
    let (schema, table) = store.table().split_once('.').unwrap();
    let owner_store = PostgresStore::builder(owner_pool)
        .schema(schema)
        .table(table)
        .build()
        .unwrap();
    let owner = Engine::new(owner_store);

    let key = unique_key("stalled");
    let mut first = claimed::<sqlx::Postgres>(&owner, request(&key, "a"), &p, &two).await;
    let mut tx = first.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    proxy.arm();
    let stalled_finish =
        tokio::spawn(async move { first.finish(StoredResponse::new(201, "first").into()).await });
    let armed = tokio::time::Instant::now();
    while proxy.stalled() == 0 {
        assert!(
            armed.elapsed() < Duration::from_secs(10),
            "the owner's COMMIT never passed the proxy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Retries, four at a time (the pool has two connections), each bounded by a second.
    let runs = AtomicUsize::new(0);
    let (mut busy, mut ran) = (0, false);
    let started = tokio::time::Instant::now();
    while !ran {
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "no retry took over within 25 s ({busy} answered 409)"
        );
        let attempts = (0..4).map(|_| async {
            tokio::time::timeout(
                Duration::from_secs(1),
                db.engine
                    .begin_transactional::<sqlx::Postgres>(request(&key, "a"), &p, &two),
            )
            .await
            .expect("a retry was not answered within a second")
        });
        for begin in futures_util::future::join_all(attempts).await {
            match begin {
                TxBegin::Respond(Begin::InProgress { retry_after }) => {
                    assert!(retry_after > Duration::ZERO);
                    busy += 1;
                }
                TxBegin::Run(mut execution) => {
                    assert!(!ran, "two retries took over at once");
                    assert!(
                        stalled_finish.is_finished(),
                        "a retry took over {} ms after the owner's COMMIT stalled, while the owner still waited for it",
                        started.elapsed().as_millis()
                    );
                    ran = true;
                    runs.fetch_add(1, Ordering::SeqCst);
                    let mut tx = execution.transaction().unwrap();
                    insert(&mut tx, &db.business).await;
                    drop(tx);
                    let out = execution
                        .finish(StoredResponse::new(201, "retry").into())
                        .await;
                    assert!(matches!(out, TxFinished::Committed), "{out:?}");
                }
                other => panic!("unexpected answer to a retry: {other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(busy > 0, "no retry met the stalled owner");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The stalled owner's write rolled back with its session; the retry's committed.
    assert_eq!(db.rows().await, before + 1);
    // And the retry's response is the one replayed.
    match db
        .engine
        .begin_transactional::<sqlx::Postgres>(request(&key, "a"), &p, &two)
        .await
    {
        TxBegin::Respond(Begin::Replay(StoredOutcome::Response(r))) => {
            assert_eq!(r.body, b"retry"[..]);
        }
        other => panic!("expected the retry's replay: {other:?}"),
    }
    // The pool is intact: a fresh key runs at once.
    let fresh = unique_key("after-stall");
    assert!(matches!(
        one(&db, &fresh, CommitPath::Two, 201, &runs).await,
        Ok(TxFinished::Committed)
    ));

    // The owner gave up on its COMMIT (bounded), and its engine drains.
    let out = stalled_finish.await.unwrap();
    assert!(matches!(out, TxFinished::Failed(_)), "{out:?}");
    let drained = owner.drain(Duration::from_secs(5)).await;
    assert_eq!(drained.still_running, 0);
    drop(proxy);
}

/// Issue 49 (1): on the two-commit path, the claim commits and then BEGIN goes on a pooled
/// connection that has gone silent. BEGIN must neither let the lease run out before the
/// handler starts nor hold the request for ever: it runs under the execution (whose heartbeat
/// keeps the lease) and is tried again on another connection after an eighth of the lease.
/// The other instance, retrying every quarter lease, gets 409 for the whole run, then the
/// replay. Before the fix BEGIN waited on the silent connection with no heartbeat, and the
/// retry took the record over one lease after the claim.
async fn silent_begin_keeps_the_lease<DB: TxDatabase>(
    owner: Engine,
    retrier: Engine,
    proxy: &idempotent_tests::stall::StallingProxy,
    begin_bytes: &[u8],
) {
    let lease = Duration::from_secs(2);
    let p = policy(lease);
    let two = options(CommitPath::Two);
    let key = unique_key("silent-begin");
    proxy.arm_on(begin_bytes);
    let first = {
        let (key, p) = (key.clone(), p);
        tokio::spawn(async move {
            let mut execution = claimed::<DB>(&owner, request(&key, "a"), &p, &two).await;
            let tx = execution.transaction().unwrap();
            execution
                .run(async move {
                    tokio::time::sleep(lease * 3).await;
                    drop(tx);
                })
                .await
                .unwrap();
            execution
                .finish(StoredResponse::new(201, "first").into())
                .await
        })
    };
    let started = std::time::Instant::now();
    loop {
        tokio::time::sleep(lease / 4).await;
        let at = started.elapsed();
        match retrier
            .begin_transactional::<DB>(request(&key, "a"), &p, &two)
            .await
        {
            TxBegin::Respond(Begin::InProgress { .. }) => {
                assert!(at < Duration::from_secs(60), "in progress after {at:?}");
            }
            TxBegin::Respond(Begin::Replay(StoredOutcome::Response(r))) => {
                assert_eq!(r.body, b"first");
                break;
            }
            TxBegin::Run(execution) => {
                execution.abort().await;
                panic!(
                    "the retry took the record over at {at:?}: the lease lapsed before the handler began"
                );
            }
            other => panic!("at {at:?}: {other:?}"),
        }
    }
    assert!(matches!(first.await.unwrap(), TxFinished::Committed));
    assert_eq!(
        proxy.stalled(),
        1,
        "BEGIN was not stalled: the test proves nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_a_silent_begin_keeps_the_two_commit_lease() {
    let (_db, store) = pg_db(pg_pool(2).await).await;
    let (proxy, owner_pool) =
        pool_through_proxy::<sqlx::Postgres>(&database_url(), "127.0.0.1:5432", 2).await;
    let (schema, table) = store.table().split_once('.').unwrap();
    let owner = PostgresStore::builder(owner_pool)
        .schema(schema)
        .table(table)
        .build()
        .unwrap();
    silent_begin_keeps_the_lease::<sqlx::Postgres>(
        Engine::new(owner),
        Engine::new(store.clone()),
        &proxy,
        b"BEGIN ISOLATION LEVEL READ COMMITTED\0",
    )
    .await;
    pg_drop(store.pool(), table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_a_silent_begin_keeps_the_two_commit_lease() {
    let (db, store) = mysql_db(mysql_pool(2).await).await;
    let (proxy, owner_pool) =
        pool_through_proxy::<sqlx::MySql>(&mysql_url(), "127.0.0.1:3306", 2).await;
    let owner = MySqlStore::builder(owner_pool)
        .table(store.table())
        .build()
        .unwrap();
    silent_begin_keeps_the_lease::<sqlx::MySql>(
        Engine::new(owner),
        Engine::new(store.clone()),
        &proxy,
        b"SET @idempotent_autocommit",
    )
    .await;
    mysql_cleanup(&db, &store).await;
}
