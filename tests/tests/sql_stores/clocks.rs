//! The database clock: leases are stamped and compared in the database's time, not this
//! process's (PostgreSQL and MySQL sessions whose clock runs an hour ahead).

use super::*;

fn epoch_ms(t: SystemTime) -> i64 {
    i64::try_from(t.duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// Two instances `a` and `b` on a database whose clock runs an hour ahead of this process's
/// (`db_now`, read from it): `a`'s claim stamps its lease end and expiry in database time,
/// and `b` compares in database time too (busy for at most the lease). Returns the key `a`
/// holds, its lease and its token.
async fn leases_in_database_time(
    a: &dyn Store,
    b: &dyn Store,
    db_now: i64,
) -> (RecordKey, Duration, LeaseToken) {
    let local_now = epoch_ms(SystemTime::now());
    assert!(
        (db_now - local_now - 3_600_000).abs() < 60_000,
        "the skew is in place: db {db_now} vs local {local_now}"
    );
    let key = unique_key("clock");
    let lease = Duration::from_millis(1500);
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("c"),
        lease,
        ttl: Duration::from_secs(60),
        max_stored: 0,
    };
    let ClaimOutcome::Claimed(l) = a.claim(req).await.unwrap() else {
        panic!("not claimed")
    };
    let until = epoch_ms(l.locked_until);
    assert!(
        (until - (db_now + 1500)).abs() < 1000,
        "lease end {until} is stamped in database time ({db_now} + 1500), not local time ({local_now} + 1500)"
    );
    let record = b.get(&key).await.unwrap().expect("record");
    assert!((epoch_ms(record.expires_at) - (db_now + 61_500)).abs() < 1000);
    match b.claim(req).await.unwrap() {
        ClaimOutcome::InProgress { retry_after } => assert!(retry_after <= lease),
        other => panic!("{other:?}"),
    }
    (key, lease, l.token)
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_leases_follow_the_database_clock() {
    // Skew the database clock for real, as the store sees it: a schema whose
    // `statement_timestamp()` and `now()` run an hour ahead, first on the search path of the
    // store's connections (PostgreSQL resolves unqualified functions through the search path
    // when `pg_catalog` is listed after it). If leases were stamped or compared with this
    // process's clock, they would be an hour off.
    let skew = unique_table("skew");
    let admin = pg_pool(1).await;
    for fun in ["statement_timestamp", "now", "clock_timestamp"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {skew};
             CREATE FUNCTION {skew}.{fun}() RETURNS timestamptz LANGUAGE sql STABLE
                 AS $$ SELECT pg_catalog.{fun}() + interval '1 hour' $$;"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
    let skewed = || async {
        let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false)
            .connect_with(options.options([("search_path", format!("{skew},pg_catalog,public"))]))
            .await
            .unwrap()
    };
    // Two instances (pools) on the skewed database.
    let table = unique_table("clock");
    let a = pg_store(skewed().await, &table).await;
    let b = pg_store(skewed().await, &table).await;
    let db_now: i64 =
        sqlx::query_scalar("SELECT (extract(epoch FROM statement_timestamp()) * 1000)::int8")
            .fetch_one(a.pool())
            .await
            .unwrap();
    let (key, lease, _) = leases_in_database_time(&a, &b, db_now).await;
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("c"),
        lease,
        ttl: Duration::from_secs(60),
        max_stored: 0,
    };
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    assert!(matches!(
        b.claim(req).await.unwrap(),
        ClaimOutcome::Claimed(Lease {
            took_over: true,
            ..
        })
    ));
    pg_drop(a.pool(), &table).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {skew} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

/// Leases are stamped and compared in the database's time: two instances whose sessions run
/// an hour ahead (the session's `timestamp`, which `UTC_TIMESTAMP()` follows; it also stops
/// that clock, so no expiry is waited for here) stamp the lease an hour ahead of this
/// process and see each other's claim in progress.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_leases_follow_the_database_clock() {
    let skewed = || async {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql("SET SESSION timestamp = UNIX_TIMESTAMP(NOW(6)) + 3600")
                        .execute(conn)
                        .await
                        .map(|_| ())
                })
            })
            .connect(&mysql_url())
            .await
            .unwrap()
    };
    let table = unique_table("clock");
    let a = mysql_store(skewed().await, &table).await;
    let b = idempotent_core::MySqlStore::builder(skewed().await)
        .table(&table)
        .build()
        .unwrap();
    let db_now: i64 = sqlx::query_scalar(
        "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000",
    )
    .fetch_one(a.pool())
    .await
    .unwrap();
    let (key, lease, token) = leases_in_database_time(&a, &b, db_now).await;
    // A heartbeat from the other instance's clock: the new end, in database time too.
    let until = b.extend(&key, token, lease).await.unwrap();
    assert!((epoch_ms(until) - (db_now + 1500)).abs() < 1000);
    mysql_drop(a.pool(), &table).await;
}
