//! MySQL (MariaDB) specifics: round trips on the single path, statements after a rolled-back
//! transaction that never commit alone, a handler that commits itself, and sessions left clean
//! (the key's named lock released, the idle limit put back) however a transaction ends.

use super::*;

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

/// Issue 53: a transactional record enters the replay cache only after its commit
/// ([`cached_only_after_commit`](super::cached_only_after_commit)).
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_transactional_records_are_cached_only_after_their_commit() {
    let (db, store) = mysql_db(mysql_pool(4).await).await;
    super::cached_only_after_commit(db, store).await;
}
