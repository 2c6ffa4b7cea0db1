//! Switches the example's PostgreSQL tests on when `DATABASE_URL` is set at build time; without it they
//! are compiled as `#[ignore]`d, so every run reports them as ignored (skipped), never as passed.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(pg)");
    println!("cargo::rerun-if-env-changed=DATABASE_URL");
    if std::env::var("DATABASE_URL").is_ok_and(|u| u.starts_with("postgres")) {
        println!("cargo::rustc-cfg=pg");
    }
}
