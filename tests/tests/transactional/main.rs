//! Transactional mode (DESIGN.md §4) on real databases, through the engine: commit iff the
//! response is stored, both commit paths, concurrent duplicates, a stale owner, a session
//! frozen inside its transaction, a killed connection, a store on another database.
#![allow(clippy::unwrap_used)] // tests unwrap freely

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
    let db = business_db(Engine::new(store.clone()), pool, "business".into(), create).await;
    (db, store)
}

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

async fn pg_db(pool: sqlx::PgPool) -> (Db<sqlx::Postgres>, PostgresStore) {
    let table = unique_table("txr");
    let store = pg_store(pool.clone(), &table).await;
    let business = format!("idempotent_test.{}", unique_table("biz"));
    let create = format!("CREATE TABLE {business} (id text PRIMARY KEY)");
    let db = business_db(Engine::new(store.clone()), pool, business, create).await;
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

/// Single commit, one statement count: a first execution is read (miss), claim, complete (the
/// handler's INSERT and BEGIN/COMMIT are not the store's); a replay is the read alone.
#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_single_commit_statements() {
    let (db, store) = pg_db(pg_pool(4).await).await;
    let runs = AtomicUsize::new(0);
    let key = unique_key("stmts");
    let before = store.statements_sent();
    let out = one(&db, &key, CommitPath::Single, 201, &runs)
        .await
        .unwrap();
    assert!(matches!(out, TxFinished::Committed));
    assert_eq!(store.statements_sent() - before, 3, "read, claim, complete");
    let before = store.statements_sent();
    assert!(matches!(
        one(&db, &key, CommitPath::Single, 201, &runs).await,
        Err(Begin::Replay(_))
    ));
    assert_eq!(store.statements_sent() - before, 1, "a replay is one read");

    // Without the read first: a first execution is claim + complete; a replay is the claim
    // statement alone (inside a transaction that writes nothing).
    let key = unique_key("stmts-nr");
    let opts = TxOptions {
        read_first: false,
        ..options(CommitPath::Single)
    };
    let p = policy(Duration::from_secs(10));
    let before = store.statements_sent();
    let mut execution = claimed::<sqlx::Postgres>(&db.engine, request(&key, "a"), &p, &opts).await;
    let mut tx = execution.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    assert!(matches!(
        execution.finish(StoredResponse::new(201, "x").into()).await,
        TxFinished::Committed
    ));
    assert_eq!(store.statements_sent() - before, 2, "claim, complete");
    let before = store.statements_sent();
    let replay = db
        .engine
        .begin_transactional::<sqlx::Postgres>(request(&key, "a"), &p, &opts)
        .await;
    assert!(
        matches!(replay, TxBegin::Respond(Begin::Replay(_))),
        "{replay:?}"
    );
    assert_eq!(store.statements_sent() - before, 1, "the claim alone");
}

/// On PostgreSQL the claim goes with BEGIN, and the complete with COMMIT, as simple queries
/// with the values written into their text. Any text and any bytes survive that exactly:
/// quotes, backslashes, an `E'…'` and a `;` in the scope and the key, every byte value in the
/// body and a header, on both commit paths, and a replay gives them back as stored.
#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_batches_carry_any_text_and_bytes() {
    let (db, store) = pg_db(pg_pool(1).await).await;
    let body: Vec<u8> = (0..=255_u8).chain((0..=255_u8).rev()).collect();
    for (i, commit) in [CommitPath::Single, CommitPath::Two]
        .into_iter()
        .enumerate()
    {
        let scope = Scope::new(format!(
            "acct 'O''Brien' \\ \\' E'x' ; DROP TABLE nothing; -- ünï {i} \u{1F600}"
        ))
        .unwrap();
        let raw = format!("k'\\';--E'{}", uuid::Uuid::new_v4().simple());
        let key = RecordKey::new(scope, IdempotencyKey::parse(raw.as_bytes()).unwrap());
        let response = StoredResponse::new(201, body.clone())
            .with_header("x-quote", "it's \\ \"q\"")
            .with_header("x-empty", "");
        let p = policy(Duration::from_secs(10));
        let mut execution =
            claimed::<sqlx::Postgres>(&db.engine, request(&key, "a"), &p, &options(commit)).await;
        let mut tx = execution.transaction().unwrap();
        insert(&mut tx, &db.business).await;
        drop(tx);
        let out = execution.finish(response.clone().into()).await;
        assert!(matches!(out, TxFinished::Committed), "{commit:?}: {out:?}");
        let record = store
            .get(&key)
            .await
            .unwrap()
            .expect("the record is stored");
        assert_eq!(record.fingerprint, fp("a"));
        match db
            .engine
            .begin_transactional::<sqlx::Postgres>(request(&key, "a"), &p, &options(commit))
            .await
        {
            TxBegin::Respond(Begin::Replay(StoredOutcome::Response(r))) => {
                assert_eq!(r, response, "{commit:?}");
            }
            other => panic!("{commit:?}: expected the replay: {other:?}"),
        }
        assert_eq!(db.rows().await, i64::try_from(i).unwrap() + 1);
    }
}

/// A server whose encoding is SQL_ASCII (what `initdb` gives under the C locale) cannot take
/// a Unicode escape above U+007F: non-ASCII text goes in the batches as its bytes instead,
/// so a caller named in any script still runs once and replays, on both commit paths. The
/// test makes that database on the server of `DATABASE_URL` if it is not there.
#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_sql_ascii_server_takes_non_ascii_scopes() {
    let admin = pg_pool(1).await;
    let made = sqlx::raw_sql(
        "CREATE DATABASE idempotent_sql_ascii ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    .execute(&admin)
    .await;
    if let Err(e) = made {
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .unwrap_or_default();
        assert_eq!(code, "42P04", "could not make the SQL_ASCII database: {e}");
    }
    let url = database_url();
    let (server, _) = url
        .rsplit_once('/')
        .expect("a database name in DATABASE_URL");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .test_before_acquire(false)
        .connect(&format!("{server}/idempotent_sql_ascii"))
        .await
        .unwrap();
    let encoding: String = sqlx::query_scalar("SHOW server_encoding")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(encoding, "SQL_ASCII");
    let (db, _) = pg_db(pool).await;
    for commit in [CommitPath::Single, CommitPath::Two] {
        let scope = Scope::new(format!("élève 'ü' \\ {commit:?} \u{1F600}")).unwrap();
        let key = RecordKey::new(
            scope,
            IdempotencyKey::parse(unique_key("a").key.as_str().as_bytes()).unwrap(),
        );
        let runs = AtomicUsize::new(0);
        assert!(
            matches!(
                one(&db, &key, commit, 201, &runs).await,
                Ok(TxFinished::Committed)
            ),
            "{commit:?}"
        );
        assert!(
            matches!(
                one(&db, &key, commit, 201, &runs).await,
                Err(Begin::Replay(_))
            ),
            "{commit:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{commit:?}");
    }
}

/// The transaction a handler gets counts as one level for sqlx, whichever way it began
/// (on PostgreSQL a BEGIN sent with the claim), so the handler's own `begin()` is a
/// SAVEPOINT: a failed statement inside one rolls back to it and the handler goes on, and
/// its `commit()` releases the savepoint without committing the handler's transaction.
#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_savepoints_inside_the_handler() {
    let (db, _) = pg_db(pg_pool(2).await).await;
    let p = policy(Duration::from_secs(10));
    let key = unique_key("savepoint");
    let mut execution = claimed::<sqlx::Postgres>(
        &db.engine,
        request(&key, "a"),
        &p,
        &options(CommitPath::Single),
    )
    .await;
    let mut tx = execution.transaction().unwrap();
    {
        let mut savepoint = sqlx::Connection::begin(&mut *tx).await.unwrap();
        let failed = sqlx::raw_sql("SELECT 1 / 0").execute(&mut *savepoint).await;
        assert!(failed.is_err());
        savepoint.rollback().await.unwrap();
    }
    insert(&mut tx, &db.business).await;
    {
        let mut savepoint = sqlx::Connection::begin(&mut *tx).await.unwrap();
        let sql = format!("INSERT INTO {} (id) VALUES ('in-savepoint')", db.business);
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *savepoint)
            .await
            .unwrap();
        savepoint.commit().await.unwrap();
    }
    drop(tx);
    assert_eq!(
        db.rows().await,
        0,
        "a savepoint's commit committed the handler's transaction"
    );
    let out = execution.finish(StoredResponse::new(201, "x").into()).await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    assert_eq!(db.rows().await, 2);
}

/// A store whose functions (migration 3) are missing refuses transactional executions with
/// 503 before any handler runs, on both commit paths, and names `migrate()`; once they are
/// back, executions run.
#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_missing_functions_refuse_before_the_handler() {
    let pool = pg_pool(2).await;
    let (db, store) = pg_db(pool.clone()).await;
    let t = store.table().to_owned();
    // Their definitions, to put back afterwards.
    let defs: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_functiondef(p.oid) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE n.nspname || '.' || p.proname IN ($1 || '_claim_first', $1 || '_complete')",
    )
    .bind(&t)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(defs.len(), 2);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP FUNCTION {t}_claim_first; DROP FUNCTION {t}_complete"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let p = policy(Duration::from_secs(10));
    for commit in [CommitPath::Single, CommitPath::Two] {
        let key = unique_key("nofn");
        match db
            .engine
            .begin_transactional::<sqlx::Postgres>(request(&key, "a"), &p, &options(commit))
            .await
        {
            TxBegin::Respond(Begin::StoreUnavailable(e)) => {
                assert!(e.to_string().contains("migrate"), "{e}");
            }
            other => panic!("{commit:?}: expected 503 before the handler: {other:?}"),
        }
        assert!(
            store.get(&key).await.unwrap().is_none(),
            "{commit:?}: claimed"
        );
    }
    for def in defs {
        sqlx::raw_sql(AssertSqlSafe(def))
            .execute(&pool)
            .await
            .unwrap();
    }
    let runs = AtomicUsize::new(0);
    for commit in [CommitPath::Single, CommitPath::Two] {
        let key = unique_key("fn-back");
        assert!(matches!(
            one(&db, &key, commit, 201, &runs).await,
            Ok(TxFinished::Committed)
        ));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A duplicate while the first runs reads no record (the first's claim is not committed) but
/// learns from the read that the key is held, and takes the ordinary path: 409 while the
/// first runs, the replay once it committed. The claim that goes with BEGIN, tried directly
/// on the held key, fails on purpose and gives its connection back rolled back. The
/// duplicates' pool has one connection, which must come back clean (not inside a
/// transaction, aborted or not) after each step.
#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_duplicate_while_the_first_runs_falls_back_cleanly() {
    let (db, store) = pg_db(pg_pool(2).await).await;
    let (schema, table) = store.table().split_once('.').unwrap();
    let other_pool = pg_pool(1).await;
    let other = Engine::new(
        PostgresStore::builder(other_pool.clone())
            .schema(schema)
            .table(table)
            .build()
            .unwrap(),
    );
    let clean = || async {
        // Outside a transaction block, a simple query's transaction starts with it (its
        // statement timestamp); inside one it started earlier.
        let row = sqlx::raw_sql("SELECT now() = statement_timestamp()")
            .fetch_one(&other_pool)
            .await
            .expect("the connection is not in an aborted transaction");
        let fresh: bool = sqlx::Row::get(&row, 0);
        assert!(fresh, "the connection came back inside a transaction");
    };
    let p = policy(Duration::from_secs(10));
    let opts = options(CommitPath::Single);
    let key = unique_key("held");
    let mut first = claimed::<sqlx::Postgres>(&db.engine, request(&key, "a"), &p, &opts).await;
    for _ in 0..3 {
        let begin = other
            .begin_transactional::<sqlx::Postgres>(request(&key, "a"), &p, &opts)
            .await;
        assert!(
            matches!(begin, TxBegin::Respond(Begin::InProgress { .. })),
            "{begin:?}"
        );
        clean().await;
    }
    // The claim that goes with BEGIN, on the held key: it does not claim, and the
    // connection it gives back is outside any transaction.
    let other_store = other.transactional_store::<sqlx::Postgres>().unwrap();
    let conn = other_pool.acquire().await.unwrap();
    let req = request(&key, "a");
    let claim = ClaimRequest {
        key: &key,
        fingerprint: &req.fingerprint,
        lease: p.lease,
        ttl: p.ttl,
        max_stored: 0,
    };
    match <sqlx::Postgres as TxDatabase>::claim_first(&other_store, conn, p.lease, claim).await {
        Ok(FirstClaim::Fallback(conn)) => drop(conn),
        Ok(FirstClaim::Claimed(..)) => panic!("claimed a key another transaction holds"),
        Err(e) => panic!("{e}"),
    }
    clean().await;
    let mut tx = first.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    let out = first.finish(StoredResponse::new(201, "first").into()).await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    let begin = other
        .begin_transactional::<sqlx::Postgres>(request(&key, "a"), &p, &opts)
        .await;
    assert!(
        matches!(begin, TxBegin::Respond(Begin::Replay(_))),
        "{begin:?}"
    );
    clean().await;
    // A fresh key on that connection runs and commits.
    let fresh = unique_key("after");
    let mut execution = claimed::<sqlx::Postgres>(&other, request(&fresh, "a"), &p, &opts).await;
    let mut tx = execution.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    let out = execution.finish(StoredResponse::new(201, "x").into()).await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    clean().await;
    assert_eq!(db.rows().await, 2);
}

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
    use idempotent_tests::stall::StallingProxy;
    let lease = Duration::from_secs(1);
    let p = policy(lease);
    let two = options(CommitPath::Two);
    // The retrying instance: its own pool of two connections.
    let (db, store) = pg_db(pg_pool(2).await).await;
    let before = db.rows().await;
    // The owner: the same table, through the proxy.
    let proxy = StallingProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let url = database_url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    assert_ne!(url, database_url(), "DATABASE_URL must name 127.0.0.1:5432");
    let owner_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .test_before_acquire(false)
        .connect(&url)
        .await
        .unwrap();
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

// MySQL / MariaDB (`MYSQL_URL`).

async fn mysql_db(pool: sqlx::MySqlPool) -> (Db<sqlx::MySql>, MySqlStore) {
    let table = unique_table("txr");
    let store = mysql_store(pool.clone(), &table).await;
    let business = unique_table("biz");
    let create = format!("CREATE TABLE {business} (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB");
    let db = business_db(Engine::new(store.clone()), pool, business, create).await;
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

/// Single commit on MySQL, counted at the store: a first execution is five round trips (the
/// read that misses, BEGIN, the named lock with the insert, the complete, COMMIT with the
/// lock's release; the handler's INSERT is not the store's), a replay one read. Without the
/// read first, the claim inside the transaction reads all the same: five again.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_single_commit_round_trips() {
    let (db, store) = mysql_db(mysql_pool(4).await).await;
    let runs = AtomicUsize::new(0);
    let key = unique_key("stmts");
    let before = store.statements_sent();
    let out = one(&db, &key, CommitPath::Single, 201, &runs)
        .await
        .unwrap();
    assert!(matches!(out, TxFinished::Committed));
    assert_eq!(
        store.statements_sent() - before,
        5,
        "read, BEGIN, lock + insert, complete, COMMIT"
    );
    let before = store.statements_sent();
    assert!(matches!(
        one(&db, &key, CommitPath::Single, 201, &runs).await,
        Err(Begin::Replay(_))
    ));
    assert_eq!(store.statements_sent() - before, 1, "a replay is one read");
    let key = unique_key("stmts-nr");
    let opts = TxOptions {
        read_first: false,
        ..options(CommitPath::Single)
    };
    let p = policy(Duration::from_secs(10));
    let before = store.statements_sent();
    let mut execution = claimed::<sqlx::MySql>(&db.engine, request(&key, "a"), &p, &opts).await;
    let mut tx = execution.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    assert!(matches!(
        execution.finish(StoredResponse::new(201, "x").into()).await,
        TxFinished::Committed
    ));
    assert_eq!(
        store.statements_sent() - before,
        5,
        "BEGIN, read, lock + insert, complete, COMMIT"
    );
    mysql_cleanup(&db, &store).await;
}

/// InnoDB ends a deadlock's victim by rolling back its whole transaction; a handler that goes
/// on writing after that error (here the same end is forced with a `ROLLBACK` of its own)
/// must not commit those writes, on their own or with the record. The transaction runs with
/// the session's autocommit off, so they open a new transaction instead; in single commit
/// the claim rolled back too, so the fenced complete is refused; in two commits the
/// transaction's marker row went with the rollback, so nothing completes. Nothing commits, on
/// either path, the key is free (single commit: the claim rolled back; two commits:
/// released), and the retry runs once.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_statements_after_a_rolled_back_transaction_never_commit_alone() {
    let (db, store) = mysql_db(mysql_pool(2).await).await;
    for commit in [CommitPath::Single, CommitPath::Two] {
        let before = db.rows().await;
        let key = unique_key("victim");
        let p = policy(Duration::from_secs(10));
        let opts = options(commit);
        let mut execution = claimed::<sqlx::MySql>(&db.engine, request(&key, "a"), &p, &opts).await;
        let mut tx = execution.transaction().unwrap();
        insert(&mut tx, &db.business).await;
        sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await.unwrap();
        insert(&mut tx, &db.business).await;
        drop(tx);
        let out = execution.finish(StoredResponse::new(201, "x").into()).await;
        assert!(matches!(out, TxFinished::Failed(_)), "{commit:?}: {out:?}");
        assert_eq!(
            db.rows().await,
            before,
            "{commit:?}: a write after the rollback committed"
        );
        assert!(store.get(&key).await.unwrap().is_none(), "{commit:?}");
        let settings: (i64, i64) = sqlx::query_as(
            "SELECT @@SESSION.autocommit, @@SESSION.wait_timeout = @@GLOBAL.wait_timeout",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(
            settings,
            (1, 1),
            "{commit:?}: the session's settings were not put back"
        );
        let runs = AtomicUsize::new(0);
        let out = one(&db, &key, commit, 201, &runs).await.unwrap();
        assert!(matches!(out, TxFinished::Committed), "{commit:?}: {out:?}");
        assert_eq!(db.rows().await, before + 1);
    }
    mysql_cleanup(&db, &store).await;
}

/// A handler that ends its transaction itself (its own `COMMIT`, or DDL, which MySQL commits
/// implicitly) gets what it asked for, as on PostgreSQL: what it wrote before is committed,
/// and the rest commits with the stored response. The key is never run twice: its retry
/// replays (a rollback by the server is told apart by the marker row, which a commit keeps).
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_a_handler_that_commits_itself_is_stored_once() {
    let (db, store) = mysql_db(mysql_pool(2).await).await;
    for (commit, ends) in [
        (CommitPath::Single, "COMMIT"),
        (CommitPath::Two, "COMMIT"),
        (
            CommitPath::Single,
            "CREATE TABLE IF NOT EXISTS idempotent_ddl_probe (id INT)",
        ),
        (
            CommitPath::Two,
            "CREATE TABLE IF NOT EXISTS idempotent_ddl_probe (id INT)",
        ),
    ] {
        let before = db.rows().await;
        let key = unique_key("commits");
        let p = policy(Duration::from_secs(10));
        let opts = options(commit);
        let mut execution = claimed::<sqlx::MySql>(&db.engine, request(&key, "a"), &p, &opts).await;
        let mut tx = execution.transaction().unwrap();
        insert(&mut tx, &db.business).await;
        sqlx::raw_sql(AssertSqlSafe(ends.to_owned()))
            .execute(&mut *tx)
            .await
            .unwrap();
        insert(&mut tx, &db.business).await;
        drop(tx);
        let out = execution.finish(StoredResponse::new(201, "x").into()).await;
        assert!(
            matches!(out, TxFinished::Committed),
            "{commit:?} {ends}: {out:?}"
        );
        assert_eq!(db.rows().await, before + 2, "{commit:?} {ends}");
        let runs = AtomicUsize::new(0);
        match one(&db, &key, commit, 201, &runs).await {
            Err(Begin::Replay(_)) => {}
            other => panic!("{commit:?} {ends}: ran again: {other:?}"),
        }
        assert_eq!(db.rows().await, before + 2);
    }
    let _ = sqlx::raw_sql("DROP TABLE IF EXISTS idempotent_ddl_probe")
        .execute(&mysql_pool(1).await)
        .await;
    mysql_cleanup(&db, &store).await;
}

/// The named lock a single-commit claim takes (`tx/mysql.rs`): `idempotent:` and 40 hex
/// digits of SHA-256 over the length-prefixed table, scope and key. Checked to be held while
/// an execution runs, so a change of the name fails this test instead of making it vacuous.
fn mysql_lock_name(table: &str, key: &RecordKey) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [table, key.scope.as_str(), key.key.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let hex: String = h.finalize()[..20]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("idempotent:{hex}")
}

/// Every way a single-commit transaction ends gives its session back clean: the key's named
/// lock released (no other session sees it used) and the idle limit its BEGIN lowered put
/// back. On a pool of one connection, so every execution reuses the session the one before
/// it ended on: a leaked lock would answer 409 to every later claim of its key on any other
/// instance, for as long as the pooled connection lives.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_transactions_leave_their_sessions_clean() {
    let (db, store) = mysql_db(mysql_pool(1).await).await;
    let watcher = mysql_pool(1).await;
    let other_pool = mysql_pool(2).await;
    let other = Engine::new(
        MySqlStore::builder(other_pool.clone())
            .table(store.table())
            .build()
            .unwrap(),
    );
    let used = |key: &RecordKey| {
        let name = mysql_lock_name(store.table(), key);
        let watcher = watcher.clone();
        async move {
            let holder: Option<i64> = sqlx::query_scalar("SELECT IS_USED_LOCK(?)")
                .bind(name)
                .fetch_one(&watcher)
                .await
                .unwrap();
            holder.is_some()
        }
    };
    let clean = || async {
        let restored: bool =
            sqlx::query_scalar("SELECT @@SESSION.wait_timeout = @@GLOBAL.wait_timeout")
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert!(restored, "the session's wait_timeout was not put back");
    };
    let p = policy(Duration::from_secs(10));
    let opts = options(CommitPath::Single);
    let no_read = TxOptions {
        read_first: false,
        ..opts
    };
    let runs = AtomicUsize::new(0);

    // Committed: held while it runs, free after.
    let key = unique_key("commit");
    let mut execution = claimed::<sqlx::MySql>(&db.engine, request(&key, "a"), &p, &opts).await;
    assert!(used(&key).await, "the claim holds the key's named lock");
    let mut tx = execution.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    let out = execution.finish(StoredResponse::new(201, "x").into()).await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    assert!(!used(&key).await);
    clean().await;

    // The claim that goes with BEGIN, on a key whose record committed after the read that
    // found none (here: no read at all): it takes the lock, meets the row, rolls back and
    // gives a clean connection back.
    let req = request(&key, "a");
    let claim = ClaimRequest {
        key: &key,
        fingerprint: &req.fingerprint,
        lease: p.lease,
        ttl: p.ttl,
        max_stored: 0,
    };
    let conn = store.pool().acquire().await.unwrap();
    match <sqlx::MySql as TxDatabase>::claim_first(&store, conn, p.lease, claim).await {
        Ok(FirstClaim::Fallback(conn)) => drop(conn),
        Ok(FirstClaim::Claimed(..)) => panic!("claimed a key that has a record"),
        Err(e) => panic!("{e}"),
    }
    assert!(!used(&key).await);
    clean().await;

    // Replayed and refused inside the transaction (no read first): the claim inside it reads
    // the record and rolls back.
    for (label, want_replay) in [("a", true), ("b", false)] {
        match db
            .engine
            .begin_transactional::<sqlx::MySql>(request(&key, label), &p, &no_read)
            .await
        {
            TxBegin::Respond(Begin::Replay(_)) if want_replay => {}
            TxBegin::Respond(Begin::Mismatch { .. }) if !want_replay => {}
            other => panic!("{label}: {other:?}"),
        }
        assert!(!used(&key).await, "{label}");
        clean().await;
    }

    // Released (5xx): rolled back, free.
    let key = unique_key("release");
    let out = one(&db, &key, CommitPath::Single, 500, &runs)
        .await
        .unwrap();
    assert!(matches!(out, TxFinished::RolledBack), "{out:?}");
    assert!(!used(&key).await);
    clean().await;

    // A panic: aborted, free.
    let mut execution = claimed::<sqlx::MySql>(&db.engine, request(&key, "a"), &p, &opts).await;
    assert!(used(&key).await);
    assert!(execution.run(async { panic!("boom") }).await.is_err());
    execution.abort().await;
    assert!(!used(&key).await);
    clean().await;

    // The handler keeps its transaction: nothing commits, and the connection is closed
    // rather than pooled with the lock (a new session serves the next request).
    let mut execution = claimed::<sqlx::MySql>(&db.engine, request(&key, "a"), &p, &opts).await;
    let kept = execution.transaction().unwrap();
    let out = execution.finish(StoredResponse::new(201, "x").into()).await;
    assert!(matches!(out, TxFinished::Escaped), "{out:?}");
    drop(kept);
    // The pool closes it in the background; the server frees the lock when it sees that.
    let mut freed = false;
    for _ in 0..100 {
        if !used(&key).await {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "the closed session's lock was never freed");
    clean().await;

    // Held by another instance's open transaction: 409 here without taking the lock; once
    // that one commits, the replay, and the key free.
    let mut first = claimed::<sqlx::MySql>(&other, request(&key, "a"), &p, &opts).await;
    for options in [opts, no_read] {
        let begin = db
            .engine
            .begin_transactional::<sqlx::MySql>(request(&key, "a"), &p, &options)
            .await;
        assert!(
            matches!(begin, TxBegin::Respond(Begin::InProgress { .. })),
            "{begin:?}"
        );
        clean().await;
    }
    let mut tx = first.transaction().unwrap();
    insert(&mut tx, &db.business).await;
    drop(tx);
    let out = first.finish(StoredResponse::new(201, "first").into()).await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
    assert!(!used(&key).await);
    assert!(matches!(
        db.engine
            .begin_transactional::<sqlx::MySql>(request(&key, "a"), &p, &no_read)
            .await,
        TxBegin::Respond(Begin::Replay(_))
    ));
    assert!(!used(&key).await);
    clean().await;
    assert_eq!(db.rows().await, 2);
    mysql_cleanup(&db, &store).await;
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
    use idempotent_tests::stall::StallingProxy;
    let (_db, store) = pg_db(pg_pool(2).await).await;
    let proxy = StallingProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let url = database_url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    assert_ne!(url, database_url(), "DATABASE_URL must name 127.0.0.1:5432");
    let owner_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .test_before_acquire(false)
        .connect(&url)
        .await
        .unwrap();
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
    use idempotent_tests::stall::StallingProxy;
    let (db, store) = mysql_db(mysql_pool(2).await).await;
    let proxy = StallingProxy::start("127.0.0.1:3306".parse().unwrap()).await;
    let url = mysql_url().replace("127.0.0.1:3306", &proxy.addr().to_string());
    assert_ne!(url, mysql_url(), "MYSQL_URL must name 127.0.0.1:3306");
    let owner_pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .test_before_acquire(false)
        .connect(&url)
        .await
        .unwrap();
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
