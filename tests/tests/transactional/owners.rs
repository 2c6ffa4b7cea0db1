//! Owners that lose their hold: a stale two-commit owner whose complete the fence refuses (its
//! writes roll back), a session frozen inside its transaction (ended by the server on the
//! single path, kept by the heartbeat on the two-commit path), and a connection killed
//! mid-transaction (nothing half-written, the retry runs once).

use super::*;

/// Two commits, stale owner: the first execution's lease runs out while its handler is slow
/// (forced here by moving `locked_until` into the past, as a lost heartbeat would), a retry
/// takes over and commits; the first one's complete is refused by the fence and its writes
/// roll back. One row, the taker-over's.
async fn stale_owner_rolls_back<DB: TxDatabase>(db: &Db<DB>, expire: impl Future<Output = ()>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let before = db.rows().await;
    let key = unique_key("stale");
    let p = policy(Duration::from_secs(10));
    let mut first = claimed::<DB>(
        &db.engine,
        request(&key, "a"),
        &p,
        &options(CommitPath::Two),
    )
    .await;
    let mut tx = first.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    // A duplicate now: 409 (the claim committed alone).
    assert!(matches!(
        db.engine
            .begin_transactional::<DB>(request(&key, "a"), &p, &options(CommitPath::Two))
            .await,
        TxBegin::Respond(Begin::InProgress { .. })
    ));
    expire.await;
    let runs = AtomicUsize::new(0);
    let second = one(db, &key, CommitPath::Two, 201, &runs).await.unwrap();
    assert!(matches!(second, TxFinished::Committed), "{second:?}");
    let out = first.finish(StoredResponse::new(201, "first").into()).await;
    assert!(
        matches!(out, TxFinished::Failed(StoreError::StaleLease)),
        "{out:?}"
    );
    assert_eq!(db.rows().await, before + 1, "only the taker-over's row");
    match db.engine.store().get(&key).await.unwrap().unwrap().state {
        RecordState::Done {
            outcome: StoredOutcome::Response(r),
            ..
        } => assert_eq!(r.body, b"201"),
        other => panic!("{other:?}"),
    }
}

// SQLite has no stale-owner interleaving to test: the handler's transaction holds the
// database's write lock from BEGIN IMMEDIATE to its end, so a take-over (a write) waits for it.

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_two_commits_stale_owner_rolls_back() {
    let (db, store) = pg_db(pg_pool(4).await).await;
    let pool = store.pool().clone();
    let sql = format!(
        "UPDATE {} SET locked_until = now() - interval '1 second' WHERE NOT done",
        store.table()
    );
    stale_owner_rolls_back(&db, async move {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    })
    .await;
}

/// Single commit: a session frozen inside its transaction (no statement for longer than the
/// lease) is ended by the server (PostgreSQL: `idle_in_transaction_session_timeout`; MySQL:
/// the session's `wait_timeout`, in whole seconds; both set to the lease by the transaction's
/// BEGIN), which releases the key: a retry runs once, and the frozen execution's commit fails
/// with nothing of it written.
///
/// Two commits: no idle limit on the handler. Its claim committed alone and the heartbeat
/// keeps it past the lease while the handler waits on something else (2.5 leases without a
/// statement): retries get 409 meanwhile, and the handler's transaction still commits.
async fn frozen_transaction_gives_the_key_back<DB: TxDatabase>(
    db: &Db<DB>,
    lease: Duration,
    frozen_for: Duration,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let before = db.rows().await;
    let key = unique_key("frozen");
    let p = policy(lease);
    let single = options(CommitPath::Single);
    let mut frozen = claimed::<DB>(&db.engine, request(&key, "a"), &p, &single).await;
    let mut tx = frozen.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    // While it holds the key: 409.
    assert!(matches!(
        db.engine
            .begin_transactional::<DB>(request(&key, "a"), &p, &single)
            .await,
        TxBegin::Respond(Begin::InProgress { .. })
    ));
    tokio::time::sleep(frozen_for).await;
    let runs = AtomicUsize::new(0);
    let mut retry = claimed::<DB>(&db.engine, request(&key, "a"), &p, &single).await;
    runs.fetch_add(1, Ordering::SeqCst);
    let mut tx2 = retry.transaction().unwrap();
    insert(&mut tx2, &db.business).await;
    drop(tx2);
    assert!(matches!(
        retry.finish(StoredResponse::new(201, "retry").into()).await,
        TxFinished::Committed
    ));
    drop(tx);
    let out = frozen
        .finish(StoredResponse::new(201, "frozen").into())
        .await;
    assert!(matches!(out, TxFinished::Failed(_)), "{out:?}");
    assert_eq!(db.rows().await, before + 1);

    let key = unique_key("idle2");
    let p = policy(Duration::from_secs(1));
    let two = options(CommitPath::Two);
    let mut slow = claimed::<DB>(&db.engine, request(&key, "a"), &p, &two).await;
    let mut tx = slow.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    slow.run(tokio::time::sleep(Duration::from_millis(2_500)))
        .await
        .unwrap();
    let busy = db
        .engine
        .begin_transactional::<DB>(request(&key, "a"), &p, &two)
        .await;
    assert!(
        matches!(busy, TxBegin::Respond(Begin::InProgress { .. })),
        "{busy:?}"
    );
    insert(&mut tx, &db.business).await;
    drop(tx);
    let out = slow.finish(StoredResponse::new(201, "slow").into()).await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    assert_eq!(db.rows().await, before + 3);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_frozen_transaction_gives_the_key_back() {
    let (db, _) = pg_db(pg_pool(4).await).await;
    frozen_transaction_gives_the_key_back(
        &db,
        Duration::from_millis(300),
        Duration::from_millis(1_000),
    )
    .await;
}

/// The handler's connection is killed mid-transaction (PostgreSQL's `pg_terminate_backend`,
/// MySQL's `KILL`): the finish fails (503 for the client), nothing is half-written, and the
/// retry runs once. `id_sql` reads the session's id as a BIGINT; `kill` ends that session
/// from another connection.
async fn killed_connection_mid_transaction<DB: TxDatabase, F, Fut>(
    db: &Db<DB>,
    id_sql: &'static str,
    kill: F,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    F: Fn(i64) -> Fut,
    Fut: Future<Output = ()>,
{
    for commit in [CommitPath::Single, CommitPath::Two] {
        let before = db.rows().await;
        let key = unique_key("killed");
        let p = policy(Duration::from_millis(500));
        let mut execution =
            claimed::<DB>(&db.engine, request(&key, "a"), &p, &options(commit)).await;
        let mut tx = execution.transaction().unwrap();
        insert(&mut tx, &db.business).await;
        let id: i64 = sqlx::query_scalar(id_sql)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        kill(id).await;
        drop(tx);
        let out = execution.finish(StoredResponse::new(201, "x").into()).await;
        assert!(matches!(out, TxFinished::Failed(_)), "{commit:?}: {out:?}");
        assert_eq!(db.rows().await, before, "nothing half-written");
        // The retry: at once on the single path; after the lease on the two-commit path,
        // whose claim committed alone.
        let runs = AtomicUsize::new(0);
        let mut settled = false;
        for _ in 0..40 {
            match one(db, &key, commit, 201, &runs).await {
                Ok(TxFinished::Committed) => {
                    settled = true;
                    break;
                }
                Err(Begin::InProgress { .. }) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(settled);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(db.rows().await, before + 1);
    }
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_killed_connection_mid_transaction() {
    let pool = pg_pool(4).await;
    let (db, _) = pg_db(pool.clone()).await;
    killed_connection_mid_transaction(&db, "SELECT pg_backend_pid()::int8", |pid| {
        let pool = pool.clone();
        async move {
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1::int4)")
                .bind(pid)
                .fetch_one(&pool)
                .await
                .unwrap();
            assert!(killed);
        }
    })
    .await;
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_two_commits_stale_owner_rolls_back() {
    let (db, store) = mysql_db(mysql_pool(4).await).await;
    let pool = store.pool().clone();
    let sql = format!(
        "UPDATE {} SET locked_until = locked_until - 3600000 WHERE NOT done",
        store.table()
    );
    stale_owner_rolls_back(&db, async move {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    })
    .await;
    mysql_cleanup(&db, &store).await;
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_frozen_transaction_gives_the_key_back() {
    let (db, store) = mysql_db(mysql_pool(4).await).await;
    // `wait_timeout` counts whole seconds: a lease of 1 s, frozen for 2.5.
    frozen_transaction_gives_the_key_back(
        &db,
        Duration::from_secs(1),
        Duration::from_millis(2_500),
    )
    .await;
    mysql_cleanup(&db, &store).await;
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_killed_connection_mid_transaction() {
    let pool = mysql_pool(4).await;
    let (db, store) = mysql_db(pool.clone()).await;
    killed_connection_mid_transaction(&db, "SELECT CAST(CONNECTION_ID() AS SIGNED)", |id| {
        let pool = pool.clone();
        async move {
            sqlx::raw_sql(AssertSqlSafe(format!("KILL {id}")))
                .execute(&pool)
                .await
                .unwrap();
        }
    })
    .await;
    mysql_cleanup(&db, &store).await;
}
