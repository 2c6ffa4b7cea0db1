//! Switches the PostgreSQL test on when `DATABASE_URL` is set at build time; without it it is
//! compiled as `#[ignore]`d, so every run reports it as ignored (skipped), never as passed.
/// Likewise `MYSQL_URL` (MySQL or MariaDB) for the MySQL test and `REDIS_CLUSTER_URL` for the
/// Redis test.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(pg)");
    println!("cargo::rustc-check-cfg=cfg(mysql_db)");
    println!("cargo::rustc-check-cfg=cfg(redis_cluster)");
    println!("cargo::rerun-if-env-changed=DATABASE_URL");
    println!("cargo::rerun-if-env-changed=MYSQL_URL");
    println!("cargo::rerun-if-env-changed=REDIS_CLUSTER_URL");
    if std::env::var("DATABASE_URL").is_ok_and(|u| u.starts_with("postgres")) {
        println!("cargo::rustc-cfg=pg");
    }
    if std::env::var("MYSQL_URL").is_ok_and(|u| u.starts_with("mysql") || u.starts_with("mariadb"))
    {
        println!("cargo::rustc-cfg=mysql_db");
    }
    if std::env::var("REDIS_CLUSTER_URL").is_ok_and(|u| u.starts_with("redis")) {
        println!("cargo::rustc-cfg=redis_cluster");
    }
}
