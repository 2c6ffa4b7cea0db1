//! SQLite's one write lock: the write queue takes it in arrival order and never waits on the
//! pool, replays never wait for it, a long two-commit handler leaves other leases alone, a hung
//! handler is rolled back after its lease, and a long single-commit handler is stopped after
//! `max_transaction`.

use super::*;

/// A store with the write queue (`queue_transactions`), on a file or `sqlite::memory:`.
async fn sqlite_queued(url: &str) -> Db<sqlx::Sqlite> {
    let pool = SqliteStore::connect(url).await.unwrap().pool().clone();
    let store = SqliteStore::builder(pool.clone())
        .queue_transactions(Duration::from_secs(5))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let create = "CREATE TABLE business (id TEXT PRIMARY KEY)".to_owned();
    business_db(Engine::new(store), pool, "business".into(), create).await
}

/// SQLite, a store with the write queue: a process's transactional executions take the
/// write lock in the order they asked for it. A holds the lock; B asks for it, then C, D and
/// E 350, 375 and 400 ms later; A ends 40 ms after that. Without the queue each waits in
/// SQLite's busy handler, which sleeps 1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50 and then
/// 100 ms between tries: by then B tries every 100 ms, while C, D and E try within 25 ms of
/// A's end, so one of them takes the lock before B (checked: this fails on a store without
/// the queue). B kept behind later arrivals that way is the tail of a loaded SQLite server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_transactions_take_the_write_lock_in_arrival_order() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("queued.db");
    let db = Arc::new(sqlite_queued(&format!("sqlite://{}", file.display())).await);
    let before = db.rows().await;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (a, end) = holding(&db, "fifo-a").await;
    let mut tasks = vec![a, single(&db, "fifo-b", Some(&order))];
    tokio::time::sleep(Duration::from_millis(350)).await;
    for name in ["fifo-c", "fifo-d", "fifo-e"] {
        tasks.push(single(&db, name, Some(&order)));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tokio::time::sleep(Duration::from_millis(15)).await;
    end.send(()).unwrap();
    for task in tasks {
        let out = task.await.unwrap();
        assert!(matches!(out, TxFinished::Committed), "{out:?}");
    }
    assert_eq!(
        *order.lock().unwrap(),
        ["fifo-b", "fifo-c", "fifo-d", "fifo-e"]
    );
    assert_eq!(db.rows().await, before + 5);
}

/// Spawns a single-commit execution of a new key named after `name` that writes one row and
/// then holds its transaction (on SQLite, the write lock) until the sender is used or
/// dropped; returns once it holds it.
async fn holding(
    db: &Arc<Db<sqlx::Sqlite>>,
    name: &'static str,
) -> (
    tokio::task::JoinHandle<TxFinished>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (began_tx, began) = tokio::sync::oneshot::channel();
    let (end_tx, end) = tokio::sync::oneshot::channel::<()>();
    let db = Arc::clone(db);
    let task = tokio::spawn(async move {
        let p = policy(Duration::from_secs(10));
        let opts = options(CommitPath::Single);
        let mut execution =
            claimed::<sqlx::Sqlite>(&db.engine, request(&unique_key(name), "a"), &p, &opts).await;
        let mut tx = execution.transaction().unwrap();
        insert(&mut tx, &db.business).await;
        began_tx.send(()).unwrap();
        let _ = end.await;
        drop(tx);
        execution
            .finish(StoredResponse::new(201, name).into())
            .await
    });
    began.await.unwrap();
    (task, end_tx)
}

/// Spawns a single-commit execution of a new key named after `name`: once its transaction
/// has begun (on SQLite, holding the write lock) it pushes `name` onto `order`, then writes
/// one row and commits.
fn single(
    db: &Arc<Db<sqlx::Sqlite>>,
    name: &'static str,
    order: Option<&Arc<std::sync::Mutex<Vec<&'static str>>>>,
) -> tokio::task::JoinHandle<TxFinished> {
    let (db, order) = (Arc::clone(db), order.map(Arc::clone));
    tokio::spawn(async move {
        let p = policy(Duration::from_secs(10));
        let opts = options(CommitPath::Single);
        let mut execution =
            claimed::<sqlx::Sqlite>(&db.engine, request(&unique_key(name), "a"), &p, &opts).await;
        if let Some(order) = order {
            order.lock().unwrap().push(name);
        }
        let mut tx = execution.transaction().unwrap();
        insert(&mut tx, &db.business).await;
        drop(tx);
        execution
            .finish(StoredResponse::new(201, name).into())
            .await
    })
}

/// SQLite, a store with the write queue: waiting for a turn never holds up the turn's
/// holder. On a pool of one connection (an in-memory database), A runs; B's read waits for
/// the connection, then C (a transaction with no record, which brings no connection of its
/// own) asks for a transaction; A ends. Had C taken its turn before a connection, it would
/// hold the turn while B held the only connection waiting for it, and both would wait until
/// B gave up on its turn (the queue's wait here, 5 s). The three finish well within 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_write_queue_and_pool_do_not_wait_on_each_other() {
    let db = Arc::new(sqlite_queued("sqlite::memory:").await);
    let (a, end) = holding(&db, "q-a").await;
    let b = single(&db, "q-b", None);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let c = {
        let db = Arc::clone(&db);
        tokio::spawn(async move {
            let p = policy(Duration::from_secs(10));
            let mut execution = match db.engine.begin_unprotected::<sqlx::Sqlite>(&p).await {
                TxBegin::Run(execution) => execution,
                other => panic!("expected to run: {other:?}"),
            };
            let mut tx = execution.transaction().unwrap();
            insert(&mut tx, &db.business).await;
            drop(tx);
            execution.finish(StoredResponse::new(201, "c").into()).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    end.send(()).unwrap();
    let all = async {
        for task in [a, b, c] {
            let out = task.await.unwrap();
            assert!(matches!(out, TxFinished::Committed), "{out:?}");
        }
    };
    tokio::time::timeout(Duration::from_secs(3), all)
        .await
        .expect("the queue and the pool waited on each other");
    assert_eq!(db.rows().await, 3);
}

#[tokio::test]
async fn sqlite_replays_never_wait_for_the_write_lock() {
    let dir = tempfile::tempdir().unwrap();
    let (db, store) = sqlite_db(&dir).await;
    let runs = AtomicUsize::new(0);
    let key = unique_key("lock");
    let out = one(&db, &key, CommitPath::Single, 201, &runs)
        .await
        .unwrap();
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    let writer = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    for read_first in [true, false] {
        let opts = TxOptions {
            read_first,
            ..options(CommitPath::Single)
        };
        let replay = tokio::time::timeout(
            Duration::from_secs(2),
            db.engine.begin_transactional::<sqlx::Sqlite>(
                request(&key, "a"),
                &policy(Duration::from_secs(10)),
                &opts,
            ),
        )
        .await
        .expect("a replay waited for the write lock (the busy timeout is 5 s)");
        assert!(
            matches!(replay, TxBegin::Respond(Begin::Replay(_))),
            "{replay:?}"
        );
    }
    writer.rollback().await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Issue 49 (2): on SQLite a long two-commit handler must not hold the file's one write lock
/// while it works, or every other execution's lease renewal waits on it, fails, and a retry
/// takes a live owner's key over. A plain-mode owner (lease 1 s) runs five leases beside a
/// two-commit handler (its route's lease 10 s) that works four and a half seconds before it
/// writes; a retrier asks for the owner's key every quarter lease and must get 409 until the
/// owner stores, then the replay.
/// Before the fix the two-commit transaction began `BEGIN IMMEDIATE`, took the lock at once,
/// and the retrier took the owner's key over while it still ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_long_two_commit_handler_leaves_other_leases_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (db, store) = sqlite_db(&dir).await;
    let lease = Duration::from_secs(1);
    let p = policy(lease);
    let owner_key = unique_key("owner");
    let Begin::Claimed(mut owner) = db.engine.begin(request(&owner_key, "a"), &p).await else {
        panic!("the owner claims")
    };
    let owner = tokio::spawn(async move {
        owner.run(tokio::time::sleep(lease * 5)).await.unwrap();
        owner.finish(StoredResponse::new(201, "owner").into()).await
    });
    let long = {
        let engine = db.engine.clone();
        let business = db.business.clone();
        let key = unique_key("long");
        let long_lease = policy(Duration::from_secs(10));
        tokio::spawn(async move {
            let two = options(CommitPath::Two);
            let mut execution =
                claimed::<sqlx::Sqlite>(&engine, request(&key, "a"), &long_lease, &two).await;
            let mut tx = execution.transaction().unwrap();
            execution
                .run(async {
                    // Work first (a call to another service), then write.
                    tokio::time::sleep(lease * 9 / 2).await;
                    insert(&mut tx, &business).await;
                    drop(tx);
                })
                .await
                .unwrap();
            execution
                .finish(StoredResponse::new(201, "long").into())
                .await
        })
    };
    // The owner's lease as the database has it, read every 50 ms while the owner runs
    // (reads never wait for the write lock): it must never have run out.
    let watcher = {
        let (store, key) = (store.clone(), owner_key.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                match store.get(&key).await.unwrap().map(|r| r.state) {
                    Some(RecordState::InProgress { locked_until, .. }) => {
                        let now = std::time::SystemTime::now();
                        assert!(
                            locked_until > now,
                            "the owner's lease ran out while it ran, {:?} ago",
                            now.duration_since(locked_until).unwrap_or_default()
                        );
                    }
                    _ => return,
                }
            }
        })
    };
    let retrier = Engine::new(store.clone());
    let started = std::time::Instant::now();
    loop {
        tokio::time::sleep(lease / 4).await;
        let at = started.elapsed();
        match retrier.begin(request(&owner_key, "a"), &p).await {
            Begin::InProgress { .. } => assert!(at < Duration::from_secs(30), "{at:?}"),
            Begin::Replay(StoredOutcome::Response(r)) => {
                assert_eq!(r.body, b"owner");
                break;
            }
            Begin::Claimed(execution) => {
                execution.release().await;
                panic!("the retry took a live owner's key over at {at:?}");
            }
            other => panic!("at {at:?}: {other:?}"),
        }
    }
    assert!(matches!(owner.await.unwrap(), Recorded::Stored));
    assert!(matches!(long.await.unwrap(), TxFinished::Committed));
    watcher.await.unwrap();
}

/// Issue 49 (2): SQLite has no idle limit, so a transactional handler that hangs holding the
/// write lock is stopped at the end of its lease and rolled back (its claim with it, on the
/// single-commit path), so the file's other writers go on and a retry runs it again. Before
/// the fix it held the lock for as long as it hung: every write on the file waited its busy
/// timeout and failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_hung_transactional_handler_is_rolled_back_after_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let (db, store) = sqlite_db(&dir).await;
    let lease = Duration::from_secs(1);
    let p = policy(lease);
    for commit in [CommitPath::Single, CommitPath::Two] {
        let key = unique_key("hung");
        let before = db.rows().await;
        let mut execution =
            claimed::<sqlx::Sqlite>(&db.engine, request(&key, "a"), &p, &options(commit)).await;
        let mut tx = execution.transaction().unwrap();
        let business = db.business.clone();
        let started = std::time::Instant::now();
        let ran = tokio::time::timeout(
            lease * 4,
            execution.run(async move {
                insert(&mut tx, &business).await;
                std::future::pending::<()>().await;
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("{commit:?}: the hung handler was never stopped"));
        let took = started.elapsed();
        assert!(
            matches!(ran, Err(Halted::OverLease(b)) if b == lease),
            "{ran:?}"
        );
        assert!(
            took >= lease && took < lease * 3,
            "{commit:?}: stopped after {took:?}"
        );
        execution.abort().await;
        assert_eq!(
            db.rows().await,
            before,
            "{commit:?}: its write was not rolled back"
        );
        // The file is free: a claim on another key goes through at once.
        let other = unique_key("other");
        let writer = std::time::Instant::now();
        let Begin::Claimed(e) = db.engine.begin(request(&other, "a"), &p).await else {
            panic!("{commit:?}: another key could not be claimed")
        };
        e.release().await;
        assert!(
            writer.elapsed() < Duration::from_secs(1),
            "{commit:?}: {:?}",
            writer.elapsed()
        );
        // And the key is free: a retry runs again.
        let retry =
            claimed::<sqlx::Sqlite>(&db.engine, request(&key, "a"), &p, &options(commit)).await;
        retry.abort().await;
    }
    drop(store);
}

/// Review of issue 49 (2): a single-commit handler on SQLite holds the file's write lock from
/// its claim, so it may run at most the store's `max_transaction` (here 300 ms), however long
/// its own route's lease (10 s): a plain-mode owner with a 2 s lease on another key keeps its
/// lease throughout, and the handler that would have written then worked 9 s is stopped and
/// rolled back (503). Before, only that route's lease bounded it: the lock was held 9 s and
/// the owner's renewals all failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_long_single_commit_handler_is_stopped_before_others_lose_their_leases() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("long.db").display());
    let pool = SqliteStore::connect(&url).await.unwrap().pool().clone();
    let store = SqliteStore::builder(pool.clone())
        .max_transaction(Duration::from_millis(300))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let create = "CREATE TABLE business (id TEXT PRIMARY KEY)".to_owned();
    let db = business_db(Engine::new(store.clone()), pool, "business".into(), create).await;
    let lease = Duration::from_secs(2);
    let owner_key = unique_key("owner");
    let Begin::Claimed(mut owner) = db
        .engine
        .begin(request(&owner_key, "a"), &policy(lease))
        .await
    else {
        panic!("the owner claims")
    };
    let owner = tokio::spawn(async move {
        owner.run(tokio::time::sleep(lease * 3)).await.unwrap();
        owner.finish(StoredResponse::new(201, "owner").into()).await
    });
    let watcher = {
        let (store, key) = (store.clone(), owner_key.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                match store.get(&key).await.unwrap().map(|r| r.state) {
                    Some(RecordState::InProgress { locked_until, .. }) => {
                        let now = std::time::SystemTime::now();
                        assert!(
                            locked_until > now,
                            "the owner's lease ran out while it ran, {:?} ago",
                            now.duration_since(locked_until).unwrap_or_default()
                        );
                    }
                    _ => return,
                }
            }
        })
    };
    let mut long = claimed::<sqlx::Sqlite>(
        &db.engine,
        request(&unique_key("long"), "a"),
        &policy(Duration::from_secs(10)),
        &options(CommitPath::Single),
    )
    .await;
    let mut tx = long.transaction().unwrap();
    let business = db.business.clone();
    let started = std::time::Instant::now();
    let ran = long
        .run(async move {
            insert(&mut tx, &business).await;
            tokio::time::sleep(Duration::from_secs(9)).await;
        })
        .await;
    assert!(
        matches!(ran, Err(Halted::OverLease(b)) if b == Duration::from_millis(300)),
        "{ran:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    long.abort().await;
    assert!(matches!(owner.await.unwrap(), Recorded::Stored));
    watcher.await.unwrap();
    assert_eq!(
        db.rows().await,
        0,
        "the stopped handler's write was rolled back"
    );
}

/// Issue 53: a transactional record enters the replay cache only after its commit
/// ([`cached_only_after_commit`](super::cached_only_after_commit)).
#[tokio::test]
async fn sqlite_transactional_records_are_cached_only_after_their_commit() {
    let dir = tempfile::tempdir().unwrap();
    let (db, store) = sqlite_db(&dir).await;
    super::cached_only_after_commit(db, store).await;
}
