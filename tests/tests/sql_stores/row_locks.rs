//! Row locks held by another transaction: a take-over and a heartbeat never wait on them
//! (PostgreSQL and MySQL), and MySQL's sweeper skips the rows a transaction holds.

use super::*;

/// A take-over never waits on the record's row lock (held here by another transaction, as an
/// owner between its complete and its COMMIT holds it): plain mode and single commit answer
/// in progress at once (PostgreSQL: `FOR UPDATE NOWAIT` in the take-over; MySQL: the same in
/// a short transaction, where an `UPDATE` would wait `innodb_lock_wait_timeout`, 50 s); once
/// the lock goes, the take-over runs. `lock_sql` locks the row of (scope, key).
async fn take_over_never_waits_on_a_row_lock<DB>(
    store: DB::Store,
    pool: &sqlx::Pool<DB>,
    lock_sql: String,
) where
    DB: TxDatabase,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let key = unique_key("locked");
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("rt"),
        lease: Duration::from_millis(200),
        ttl: Duration::from_secs(3600),
        max_stored: 0,
    };
    assert!(matches!(
        store.claim(req).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    tokio::time::sleep(Duration::from_millis(400)).await; // the lease ends
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(lock_sql))
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .execute(&mut *holder)
        .await
        .unwrap();
    let second = Duration::from_secs(1);
    let plain = tokio::time::timeout(second, store.claim(req))
        .await
        .expect("plain mode's take-over waited on the row lock");
    assert!(
        matches!(plain, Ok(ClaimOutcome::InProgress { retry_after }) if retry_after > Duration::ZERO),
        "{plain:?}"
    );
    let engine = Engine::new(store.clone());
    let policy = Policy {
        lease: Duration::from_millis(200),
        ..Policy::default()
    };
    let single = TxOptions {
        commit: CommitPath::Single,
        wait: Duration::from_millis(50),
        max_waiters: 4,
        read_first: true,
    };
    let begin = tokio::time::timeout(
        second,
        engine.begin_transactional::<DB>(request(&key), &policy, &single),
    )
    .await
    .expect("single commit's take-over waited on the row lock");
    assert!(
        matches!(begin, TxBegin::Respond(Begin::InProgress { .. })),
        "{begin:?}"
    );
    holder.rollback().await.unwrap();
    assert!(matches!(
        store.claim(req).await.unwrap(),
        ClaimOutcome::Claimed(lease) if lease.took_over
    ));
}

/// A heartbeat never waits on the record's row lock either (held here by another
/// transaction, as the owner's own complete holds it on the two-commit path until its COMMIT):
/// it is answered unavailable at once, so it holds no pooled connection and cannot extend a
/// lease after its owner gave up; once the lock goes, it extends. `lock_sql` locks the row of
/// (scope, key).
async fn extend_never_waits_on_a_row_lock<DB>(
    store: DB::Store,
    pool: &sqlx::Pool<DB>,
    lock_sql: String,
    lock_not_granted: fn(&StoreError) -> bool,
) where
    DB: TxDatabase,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let key = unique_key("locked-extend");
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
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(lock_sql.clone()))
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .execute(&mut *holder)
        .await
        .unwrap();
    let extended = tokio::time::timeout(
        Duration::from_secs(2),
        store.extend(&key, claimed.token, lease),
    )
    .await
    .expect("the heartbeat waited on the row lock");
    assert!(
        extended.as_ref().is_err_and(lock_not_granted),
        "{extended:?}"
    );
    holder.rollback().await.unwrap();
    let until = store.extend(&key, claimed.token, lease).await.unwrap();
    assert!(until > SystemTime::now() + lease / 2, "{until:?}");
    // The heartbeat left no lock behind: another transaction takes the row without waiting.
    let mut after = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("{lock_sql} NOWAIT")))
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .execute(&mut *after)
        .await
        .expect("the heartbeat left the row locked");
    after.rollback().await.unwrap();
    // Still fenced: a token that does not hold the record extends nothing.
    assert!(matches!(
        store.extend(&key, LeaseToken::generate(), lease).await,
        Err(StoreError::StaleLease)
    ));
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_extend_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = pg_pool(4).await;
    let store = pg_store(pool.clone(), &table).await;
    let sql =
        format!("SELECT 1 FROM idempotent_test.{table} WHERE scope = $1 AND key = $2 FOR UPDATE");
    extend_never_waits_on_a_row_lock::<sqlx::Postgres>(store, &pool, sql, |e| {
        sqlstate(e).as_deref() == Some("55P03")
    })
    .await;
    pg_drop(&pool, &table).await;
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_take_over_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = pg_pool(4).await;
    let store = pg_store(pool.clone(), &table).await;
    let sql =
        format!("SELECT 1 FROM idempotent_test.{table} WHERE scope = $1 AND key = $2 FOR UPDATE");
    take_over_never_waits_on_a_row_lock::<sqlx::Postgres>(store, &pool, sql).await;
    pg_drop(&pool, &table).await;
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_take_over_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = mysql_pool(4).await;
    let store = mysql_store(pool.clone(), &table).await;
    let sql = format!("SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE");
    take_over_never_waits_on_a_row_lock::<sqlx::MySql>(store, &pool, sql).await;
    mysql_drop(&pool, &table).await;
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_extend_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = mysql_pool(4).await;
    let store = mysql_store(pool.clone(), &table).await;
    let sql = format!("SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE");
    extend_never_waits_on_a_row_lock::<sqlx::MySql>(store, &pool, sql, |e| {
        mysql_error_number(e).is_some_and(|n| n == 1205 || n == 3572)
    })
    .await;
    mysql_drop(&pool, &table).await;
}

/// The MySQL error number of a store error that came from the server.
fn mysql_error_number(error: &StoreError) -> Option<u16> {
    let StoreError::Unavailable(source) = error else {
        return None;
    };
    let db = source.downcast_ref::<sqlx::Error>()?.as_database_error()?;
    Some(
        db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()?
            .number(),
    )
}

/// The sweeper never waits on a row another transaction holds (a single-commit take-over of
/// an expired record holds it until it commits): it deletes the other expired rows at once
/// and leaves that one to a later batch; meanwhile the rows it deleted are free at once.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_sweeper_skips_rows_a_transaction_holds() {
    let table = unique_table("sweep");
    let pool = mysql_pool(4).await;
    let store = mysql_store(pool.clone(), &table).await;
    let (k1, k2) = (unique_key("free"), unique_key("held"));
    for key in [&k1, &k2] {
        let req = ClaimRequest {
            key,
            fingerprint: &fp("s"),
            lease: Duration::from_millis(100),
            ttl: Duration::from_millis(100),
            max_stored: 0,
        };
        let ClaimOutcome::Claimed(lease) = store.claim(req).await.unwrap() else {
            panic!("not claimed")
        };
        store
            .complete(
                key,
                lease.token,
                &StoredResponse::new(201, "x").into(),
                req.ttl,
            )
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(400)).await; // both expired
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE"
    )))
    .bind(k2.scope.as_str())
    .bind(k2.key.as_str())
    .execute(&mut *holder)
    .await
    .unwrap();
    let purged = tokio::time::timeout(Duration::from_secs(5), store.purge_expired(100))
        .await
        .expect("the sweeper waited on a held row")
        .unwrap();
    assert_eq!(purged, 1, "the free expired row only");
    // A new request on the deleted key claims at once (the sweeper's locks are gone).
    let req = ClaimRequest {
        key: &k1,
        fingerprint: &fp("s"),
        lease: Duration::from_secs(10),
        ttl: Duration::from_secs(60),
        max_stored: 0,
    };
    let claimed = tokio::time::timeout(Duration::from_secs(5), store.claim(req))
        .await
        .expect("a claim waited on the sweeper")
        .unwrap();
    assert!(matches!(claimed, ClaimOutcome::Claimed(_)), "{claimed:?}");
    holder.rollback().await.unwrap();
    assert_eq!(
        store.purge_expired(100).await.unwrap(),
        1,
        "the other, once free"
    );
    mysql_drop(&pool, &table).await;
}
