//! Duplicates: 64 concurrent duplicates of one key run once (409 or the replay for the others),
//! and many keys × 8 duplicates across two pools (two instances) run each key once.

use super::*;

/// 64 concurrent duplicates of one key (single commit): exactly one runs; the others get 409
/// (the key is held by an open transaction) or, once it committed, the replay. With a long
/// `wait`, every duplicate gets the replay.
async fn concurrent_duplicates_run_once<DB: TxDatabase>(db: Arc<Db<DB>>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    for wait in [Duration::from_millis(50), Duration::from_secs(10)] {
        let runs = Arc::new(AtomicUsize::new(0));
        let key = unique_key("dup");
        let before = db.rows().await;
        let mut tasks = Vec::new();
        for _ in 0..64 {
            let (db, runs, key) = (Arc::clone(&db), Arc::clone(&runs), key.clone());
            tasks.push(tokio::spawn(async move {
                let opts = TxOptions {
                    wait,
                    max_waiters: 64,
                    ..options(CommitPath::Single)
                };
                let begin = db
                    .engine
                    .begin_transactional::<DB>(
                        request(&key, "a"),
                        &policy(Duration::from_secs(10)),
                        &opts,
                    )
                    .await;
                match begin {
                    TxBegin::Run(mut execution) => {
                        runs.fetch_add(1, Ordering::SeqCst);
                        let mut tx = execution.transaction().unwrap();
                        insert(&mut tx, &db.business).await;
                        // Hold the key long enough that the others meet it.
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        drop(tx);
                        let out = execution.finish(StoredResponse::new(201, "x").into()).await;
                        assert!(matches!(out, TxFinished::Committed), "{out:?}");
                        "ran"
                    }
                    TxBegin::Respond(Begin::InProgress { .. }) => "409",
                    TxBegin::Respond(Begin::Replay(_)) => "replay",
                    other => panic!("{other:?}"),
                }
            }));
        }
        let mut answers = std::collections::HashMap::new();
        for t in tasks {
            *answers.entry(t.await.unwrap()).or_insert(0) += 1;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{answers:?}");
        assert_eq!(db.rows().await, before + 1);
        assert_eq!(answers["ran"], 1);
        if wait > Duration::from_secs(1) {
            assert_eq!(answers.get("replay"), Some(&63), "{answers:?}");
        } else {
            assert!(answers.contains_key("409"), "{answers:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_concurrent_duplicates_run_once() {
    let (db, _) = pg_db(pg_pool(80).await).await;
    concurrent_duplicates_run_once(Arc::new(db)).await;
}

/// 1,000 keys × 8 duplicates across two pools (two "instances"), single commit: 1,000 rows,
/// every key run once. On SQLite (two pools on one file) with 200 keys.
async fn many_keys<DB: TxDatabase>(a: Arc<Db<DB>>, b: Arc<Db<DB>>, keys: usize)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let before = a.rows().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(48));
    let mut tasks = Vec::new();
    for k in 0..keys {
        let key = unique_key(&format!("many{k}"));
        for d in 0..8 {
            let db = if d % 2 == 0 {
                Arc::clone(&a)
            } else {
                Arc::clone(&b)
            };
            let (key, runs, sem) = (key.clone(), Arc::clone(&runs), Arc::clone(&sem));
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire().await.unwrap();
                // Retry 409s as a client would, until the replay.
                for _ in 0..200 {
                    match one(&db, &key, CommitPath::Single, 201, &runs).await {
                        Ok(TxFinished::Committed) | Err(Begin::Replay(_)) => return,
                        Err(Begin::InProgress { .. }) => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        other => panic!("{other:?}"),
                    }
                }
                panic!("never settled");
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(runs.load(Ordering::SeqCst), keys);
    assert_eq!(a.rows().await - before, i64::try_from(keys).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_thousand_keys_by_eight_across_two_pools() {
    let (a, store) = pg_db(pg_pool(24).await).await;
    // A second instance: its own pool and engine on the same tables.
    let other = PostgresStore::builder(pg_pool(24).await)
        .schema("idempotent_test")
        .table(store.table().trim_start_matches("idempotent_test."))
        .build()
        .unwrap();
    let b = Db {
        engine: Engine::new(other),
        business: a.business.clone(),
        count: Box::new(|| Box::pin(async { 0 })),
        _db: std::marker::PhantomData,
    };
    many_keys(Arc::new(a), Arc::new(b), 1_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keys_by_eight_across_two_pools() {
    let dir = tempfile::tempdir().unwrap();
    let (a, store) = sqlite_db(&dir).await;
    // The same file through a second pool.
    let file = store
        .pool()
        .connect_options()
        .get_filename()
        .to_string_lossy()
        .into_owned();
    let other = SqliteStore::connect(&format!("sqlite://{file}"))
        .await
        .unwrap();
    let b = Db {
        engine: Engine::new(other),
        business: a.business.clone(),
        count: Box::new(|| Box::pin(async { 0 })),
        _db: std::marker::PhantomData,
    };
    many_keys(Arc::new(a), Arc::new(b), 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_concurrent_duplicates_run_once() {
    let (db, store) = mysql_db(mysql_pool(70).await).await;
    let db = Arc::new(db);
    concurrent_duplicates_run_once(Arc::clone(&db)).await;
    mysql_cleanup(&db, &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_thousand_keys_by_eight_across_two_pools() {
    let (a, store) = mysql_db(mysql_pool(24).await).await;
    let other = MySqlStore::builder(mysql_pool(24).await)
        .table(store.table())
        .build()
        .unwrap();
    let b = Db {
        engine: Engine::new(other),
        business: a.business.clone(),
        count: Box::new(|| Box::pin(async { 0 })),
        _db: std::marker::PhantomData,
    };
    let a = Arc::new(a);
    many_keys(Arc::clone(&a), Arc::new(b), 1_000).await;
    mysql_cleanup(&a, &store).await;
}
