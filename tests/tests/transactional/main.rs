//! Transactional mode (`docs/semantics.md#transactional-mode`) on real databases, through the
//! engine: commit iff the response is stored, both commit paths, concurrent duplicates, a
//! stale owner, a session frozen inside its transaction, a killed connection, a store on
//! another database.
//!
//! This file holds the shared harness (requests, options and policies, a test database with
//! its business table, one request run through a transaction); the cases live in topic
//! modules: `commit` (commit iff stored, on each database), `duplicates`, `owners` (stale,
//! frozen and killed owners), `stalls` (owners on a silent connection, through a proxy), and
//! each database's specifics in `sqlite`, `postgres` and `mysql`.
#![allow(clippy::unwrap_used)] // tests unwrap freely

mod commit;
mod duplicates;
mod mysql;
mod owners;
mod postgres;
mod sqlite;
mod stalls;

use idempotent_core::sqlx::{self, AssertSqlSafe};
use idempotent_core::{engine::*, store::*, tx::*, *};
use idempotent_tests::conformance::{fp, unique_key};
use idempotent_tests::fixtures::*;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const PG_ONLY: &str = "set DATABASE_URL=postgres://… to run the PostgreSQL tests";

fn request(key: &RecordKey, label: &str) -> ExecuteRequest {
    ExecuteRequest {
        scope: key.scope.clone(),
        key: Ok(key.key.clone()),
        fingerprint: fp(label),
    }
}

fn options(commit: CommitPath) -> TxOptions {
    TxOptions {
        commit,
        wait: Duration::from_millis(50),
        max_waiters: 4,
        read_first: true,
    }
}

fn policy(lease: Duration) -> Policy {
    Policy {
        lease,
        route: "tx-test",
        ..Policy::default()
    }
}

/// What a test database offers: the engine over its store, a business table, and a count of
/// that table's rows read outside any transaction.
struct Db<DB: TxDatabase> {
    engine: Engine,
    business: String,
    count: Box<dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = i64> + Send>> + Send + Sync>,
    _db: std::marker::PhantomData<fn() -> DB>,
}

impl<DB: TxDatabase> Db<DB> {
    async fn rows(&self) -> i64 {
        (self.count)().await
    }
}

/// Claims for a transactional execution that must run (a fresh key, or one that is free).
async fn claimed<DB: TxDatabase>(
    engine: &Engine,
    req: ExecuteRequest,
    policy: &Policy,
    options: &TxOptions,
) -> TxExecution<DB> {
    match engine.begin_transactional::<DB>(req, policy, options).await {
        TxBegin::Run(execution) => execution,
        other => panic!("expected to run: {other:?}"),
    }
}

/// Inserts one business row through the handler's transaction.
async fn insert<DB: TxDatabase>(tx: &mut Transaction<DB>, table: &str)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let sql = format!(
        "INSERT INTO {table} (id) VALUES ('{}')",
        uuid::Uuid::new_v4().simple()
    );
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut **tx)
        .await
        .unwrap();
}

/// One request: claim, and if it runs, one INSERT then an answer of `status`.
async fn one<DB: TxDatabase>(
    db: &Db<DB>,
    key: &RecordKey,
    commit: CommitPath,
    status: u16,
    runs: &AtomicUsize,
) -> Result<TxFinished, Begin>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let begin = db
        .engine
        .begin_transactional::<DB>(
            request(key, "a"),
            &policy(Duration::from_secs(10)),
            &options(commit),
        )
        .await;
    let mut execution = match begin {
        TxBegin::Run(execution) => execution,
        TxBegin::Respond(b) => return Err(b),
        other => panic!("{other:?}"),
    };
    let mut tx = execution.transaction().unwrap();
    assert!(execution.transaction().is_none(), "handed out once");
    runs.fetch_add(1, Ordering::SeqCst);
    insert(&mut tx, &db.business).await;
    drop(tx);
    Ok(execution
        .finish(StoredResponse::new(status, format!("{status}")).into())
        .await)
}

/// An engine without the sweeper every engine starts with its first request (the statement
/// counts of `postgres.rs` and `mysql.rs` would count its deletes).
fn unswept(store: impl Store) -> Engine {
    Engine::builder(store).no_sweeper().build().unwrap()
}

async fn sqlite_db(dir: &tempfile::TempDir) -> (Db<sqlx::Sqlite>, SqliteStore) {
    let url = format!(
        "sqlite://{}",
        dir.path()
            .join(format!("{}.db", unique_table("tx")))
            .display()
    );
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let pool = store.pool().clone();
    let create = "CREATE TABLE business (id TEXT PRIMARY KEY)".to_owned();
    let db = business_db(unswept(store.clone()), pool, "business".into(), create).await;
    (db, store)
}

async fn pg_db(pool: sqlx::PgPool) -> (Db<sqlx::Postgres>, PostgresStore) {
    let table = unique_table("txr");
    let store = pg_store(pool.clone(), &table).await;
    let business = format!("idempotent_test.{}", unique_table("biz"));
    let create = format!("CREATE TABLE {business} (id text PRIMARY KEY)");
    let db = business_db(unswept(store.clone()), pool, business, create).await;
    (db, store)
}

/// A [`Db`] over `engine` whose business table `business` is created by `create` on `pool`,
/// its rows counted through `pool`.
async fn business_db<DB>(
    engine: Engine,
    pool: sqlx::Pool<DB>,
    business: String,
    create: String,
) -> Db<DB>
where
    DB: TxDatabase,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    sqlx::raw_sql(AssertSqlSafe(create))
        .execute(&pool)
        .await
        .unwrap();
    let count_sql: Arc<str> = format!("SELECT count(*) FROM {business}").into();
    Db {
        engine,
        business,
        count: Box::new(move || {
            let (pool, sql) = (pool.clone(), Arc::clone(&count_sql));
            Box::pin(async move {
                sqlx::query_scalar(AssertSqlSafe(sql.to_string()))
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            })
        }),
        _db: std::marker::PhantomData,
    }
}

// MySQL / MariaDB (`MYSQL_URL`).

async fn mysql_db(pool: sqlx::MySqlPool) -> (Db<sqlx::MySql>, MySqlStore) {
    let table = unique_table("txr");
    let store = mysql_store(pool.clone(), &table).await;
    let business = unique_table("biz");
    let create = format!("CREATE TABLE {business} (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB");
    let db = business_db(unswept(store.clone()), pool, business, create).await;
    (db, store)
}

/// Drops what [`mysql_db`] made (after a test that passed).
async fn mysql_cleanup(db: &Db<sqlx::MySql>, store: &MySqlStore) {
    mysql_drop(store.pool(), store.table()).await;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}",
        db.business
    )))
    .execute(store.pool())
    .await;
}

/// Issue 53: a transactional record enters the replay cache only after its commit: not while
/// its handler runs, not when it rolls back; once committed, a retry replays it from the cache
/// (shown by deleting the record from the store first: the retry still replays it).
async fn cached_only_after_commit<DB: TxDatabase>(db: Db<DB>, store: impl Store + Clone)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    // A long max age: no entry may go while the rounds compare byte counts.
    let cache = ReplayCache::new().max_age(Duration::from_secs(600));
    let engine = Engine::builder(store.clone())
        .no_sweeper()
        .replay_cache(cache)
        .build()
        .unwrap();
    let db = Db { engine, ..db };
    let cached = || db.engine.replay_cache_bytes(None).unwrap();
    for commit in [CommitPath::Single, CommitPath::Two] {
        let runs = AtomicUsize::new(0);
        // Rolled back (a status the policy does not store): nothing kept.
        let before = cached();
        let out = one(&db, &unique_key("cache-rb"), commit, 503, &runs).await;
        assert!(matches!(out, Ok(TxFinished::RolledBack)), "{out:?}");
        assert_eq!(cached(), before);
        if commit == CommitPath::Two {
            // A complete that fails (the claim was deleted under it, so the fence refuses it
            // and the transaction rolls back): nothing kept.
            let lost = unique_key("cache-lost");
            let p = policy(Duration::from_secs(10));
            let mut doomed =
                claimed::<DB>(&db.engine, request(&lost, "a"), &p, &options(commit)).await;
            // Deleted before the handler writes (SQLite's one write lock would hold the delete
            // up while the handler's transaction has written).
            assert!(matches!(
                store.delete(&lost, true).await.unwrap(),
                idempotent_core::store::Deleted::Deleted(_)
            ));
            let mut tx = doomed.transaction().unwrap();
            insert(&mut tx, &db.business).await;
            drop(tx);
            let out = doomed.finish(StoredResponse::new(201, "lost").into()).await;
            assert!(matches!(out, TxFinished::Failed(_)), "{out:?}");
            assert_eq!(cached(), before, "kept after a failed complete");
        }
        // Running, written, not committed: nothing kept.
        let key = unique_key("cache");
        let p = policy(Duration::from_secs(10));
        let mut execution =
            claimed::<DB>(&db.engine, request(&key, "a"), &p, &options(commit)).await;
        let mut tx = execution.transaction().unwrap();
        insert(&mut tx, &db.business).await;
        drop(tx);
        assert_eq!(cached(), before, "{commit:?}: kept before its commit");
        let out = execution
            .finish(StoredResponse::new(201, "kept").into())
            .await;
        assert!(matches!(out, TxFinished::Committed), "{out:?}");
        assert!(cached() > before, "{commit:?}: not kept after its commit");
        // Gone from the store, replayed from the cache.
        assert!(matches!(
            store.delete(&key, false).await.unwrap(),
            idempotent_core::store::Deleted::Deleted(_)
        ));
        let replay = db
            .engine
            .begin_transactional::<DB>(request(&key, "a"), &p, &options(commit))
            .await;
        match replay {
            TxBegin::Respond(Begin::Replay(StoredOutcome::Response(r))) => {
                assert_eq!(r.body, b"kept");
            }
            other => panic!("{commit:?}: {other:?}"),
        }
        // Another instance that reads the committed record from the store keeps it too.
        let other = Engine::builder(store.clone())
            .no_sweeper()
            .replay_cache(cache)
            .build()
            .unwrap();
        let read = unique_key("cache-read");
        let out = one(&db, &read, commit, 201, &runs).await;
        assert!(matches!(out, Ok(TxFinished::Committed)), "{out:?}");
        for round in ["from the store", "from the cache"] {
            let replay = other
                .begin_transactional::<DB>(request(&read, "a"), &p, &options(commit))
                .await;
            assert!(
                matches!(replay, TxBegin::Respond(Begin::Replay(_))),
                "{commit:?}, {round}: {replay:?}"
            );
            if round == "from the store" {
                assert!(
                    other.replay_cache_bytes(None).unwrap() > 0,
                    "{commit:?}: not kept"
                );
                assert!(matches!(
                    store.delete(&read, false).await.unwrap(),
                    idempotent_core::store::Deleted::Deleted(_)
                ));
            }
        }
    }
}
