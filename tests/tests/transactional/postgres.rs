//! PostgreSQL specifics: statement counts on the single path, batches that carry any text and
//! bytes, an SQL_ASCII server, savepoints inside the handler, missing functions refused before
//! the handler, and a duplicate whose claim falls back with a clean connection.

use super::*;

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

/// Issue 53: a transactional record enters the replay cache only after its commit
/// ([`cached_only_after_commit`](super::cached_only_after_commit)).
#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_transactional_records_are_cached_only_after_their_commit() {
    let (db, store) = pg_db(pg_pool(4).await).await;
    super::cached_only_after_commit(db, store).await;
}
