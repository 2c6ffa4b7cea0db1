//! Commit iff stored, on both commit paths and each database (SQLite, PostgreSQL, MySQL): a
//! stored response commits the handler's writes with the record, a releasing one rolls them
//! back, a panic or an escaped transaction rolls back and frees the key; a store on another
//! database is refused; unprotected transactions count towards the drain.

use super::*;

/// Commit iff stored, on one path: a stored response commits the row with the record and
/// replays; a releasing one (5xx, 409) rolls the row back and frees the key; a 4xx the
/// handler chose to store commits its row.
async fn commit_iff_stored<DB: TxDatabase>(db: &Db<DB>, commit: CommitPath)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let runs = AtomicUsize::new(0);
    let before = db.rows().await;
    // Released: nothing of it commits, and the retry runs again.
    let key = unique_key("tx");
    for status in [500, 503, 409, 429] {
        let out = one(db, &key, commit, status, &runs).await.unwrap();
        assert!(matches!(out, TxFinished::RolledBack), "{status}: {out:?}");
        assert_eq!(db.rows().await, before, "{status} rolled back");
        assert!(
            db.engine.store().get(&key).await.unwrap().is_none(),
            "{status} released the key"
        );
    }
    // Stored: the row and the record commit together; retries replay and run nothing.
    let out = one(db, &key, commit, 201, &runs).await.unwrap();
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    assert_eq!(db.rows().await, before + 1);
    for _ in 0..3 {
        match one(db, &key, commit, 201, &runs).await {
            Err(Begin::Replay(StoredOutcome::Response(r))) => assert_eq!(r.status, 201),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 5, "4 released runs + 1 stored");
    assert_eq!(db.rows().await, before + 1);
    // A 4xx is stored: the handler's writes commit with it (its choice).
    let key = unique_key("tx4");
    let out = one(db, &key, commit, 404, &runs).await.unwrap();
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    assert_eq!(db.rows().await, before + 2);
    // A different request with the same key: 422, nothing runs.
    let mismatch = db
        .engine
        .begin_transactional::<DB>(
            request(&key, "other"),
            &policy(Duration::from_secs(10)),
            &options(commit),
        )
        .await;
    assert!(
        matches!(
            mismatch,
            TxBegin::Respond(Begin::Mismatch { in_progress: false })
        ),
        "{mismatch:?}"
    );
}

/// A panic and an escaped transaction roll back and free the key.
async fn panics_and_escapes_roll_back<DB: TxDatabase>(db: &Db<DB>, commit: CommitPath)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let before = db.rows().await;
    let key = unique_key("panic");
    let p = policy(Duration::from_secs(10));
    let mut execution = claimed::<DB>(&db.engine, request(&key, "a"), &p, &options(commit)).await;
    let mut tx = execution.transaction().unwrap();
    let business = db.business.clone();
    let caught = execution
        .run(async move {
            insert(&mut tx, &business).await;
            panic!("handler panicked");
        })
        .await;
    assert!(caught.is_err());
    execution.abort().await;
    assert_eq!(db.rows().await, before);
    assert!(db.engine.store().get(&key).await.unwrap().is_none());
    // The handler keeps its transaction past its return: nothing can commit.
    let mut execution = claimed::<DB>(&db.engine, request(&key, "a"), &p, &options(commit)).await;
    let mut kept = execution.transaction().unwrap();
    insert(&mut kept, &db.business).await;
    // Kept by a task that outlives the handler (on SQLite it holds the write lock, which the
    // release of a two-commit claim waits for).
    let keeper = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(kept);
    });
    let out = execution.finish(StoredResponse::new(201, "x").into()).await;
    assert!(matches!(out, TxFinished::Escaped), "{out:?}");
    keeper.await.unwrap();
    assert_eq!(db.rows().await, before);
    assert!(db.engine.store().get(&key).await.unwrap().is_none());
    assert_eq!(db.engine.running(), 0);
}

#[tokio::test]
async fn sqlite_commit_iff_stored_on_both_paths() {
    let dir = tempfile::tempdir().unwrap();
    let (db, _) = sqlite_db(&dir).await;
    for commit in [CommitPath::Single, CommitPath::Two] {
        commit_iff_stored(&db, commit).await;
        panics_and_escapes_roll_back(&db, commit).await;
    }
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_commit_iff_stored_on_both_paths() {
    let _ = PG_ONLY;
    let (db, _) = pg_db(pg_pool(4).await).await;
    for commit in [CommitPath::Single, CommitPath::Two] {
        commit_iff_stored(&db, commit).await;
        panics_and_escapes_roll_back(&db, commit).await;
    }
}

/// A store on another database (or the memory store) is refused: the route never runs
/// non-atomically.
#[tokio::test]
async fn a_store_on_another_database_is_refused() {
    let engine = Engine::new(MemoryStore::new());
    let key = unique_key("wrong");
    let begin = engine
        .begin_transactional::<sqlx::Sqlite>(
            request(&key, "a"),
            &Policy::default(),
            &options(CommitPath::Single),
        )
        .await;
    assert!(
        matches!(begin, TxBegin::WrongStore { wanted: "SQLite" }),
        "{begin:?}"
    );
    assert!(matches!(
        engine
            .begin_unprotected::<sqlx::Postgres>(&Policy::default())
            .await,
        TxBegin::WrongStore {
            wanted: "PostgreSQL"
        }
    ));
    let sqlite = SqliteStore::connect("sqlite::memory:").await.unwrap();
    let engine = Engine::new(sqlite);
    assert!(matches!(
        engine
            .begin_transactional::<sqlx::Postgres>(
                request(&key, "a"),
                &Policy::default(),
                &options(CommitPath::Single)
            )
            .await,
        TxBegin::WrongStore {
            wanted: "PostgreSQL"
        }
    ));
    assert!(engine.transactional_store::<sqlx::Sqlite>().is_some());
}

/// Requests a transactional route runs without a record (a safe method, no key where it is
/// optional) still count towards the drain until their transaction ends.
#[tokio::test]
async fn unprotected_transactions_count_towards_the_drain() {
    let dir = tempfile::tempdir().unwrap();
    let (db, _) = sqlite_db(&dir).await;
    let TxBegin::Run(mut execution) = db
        .engine
        .begin_unprotected::<sqlx::Sqlite>(&policy(Duration::from_secs(10)))
        .await
    else {
        panic!("begin")
    };
    assert!(!execution.is_protected());
    assert_eq!(db.engine.running(), 1);
    let mut tx = execution.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    let engine = db.engine.clone();
    let drain = tokio::spawn(async move { engine.drain(Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !drain.is_finished(),
        "the drain waits for the open transaction"
    );
    let out = execution
        .finish(StoredResponse::new(200, "ok").into())
        .await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    assert_eq!(drain.await.unwrap().still_running, 0);
    assert_eq!(db.rows().await, 1);
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_commit_iff_stored_on_both_paths() {
    let (db, store) = mysql_db(mysql_pool(4).await).await;
    for commit in [CommitPath::Single, CommitPath::Two] {
        commit_iff_stored(&db, commit).await;
        panics_and_escapes_roll_back(&db, commit).await;
    }
    mysql_cleanup(&db, &store).await;
}
