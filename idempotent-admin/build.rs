//! Switches the PostgreSQL test on when `DATABASE_URL` is set at build time; without it it is
//! compiled as `#[ignore]`d, so every run reports it as ignored (skipped), never as passed.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(pg)");
    println!("cargo::rerun-if-env-changed=DATABASE_URL");
    if std::env::var("DATABASE_URL").is_ok_and(|u| u.starts_with("postgres")) {
        println!("cargo::rustc-cfg=pg");
    }
}
