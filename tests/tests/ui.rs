//! trybuild UI tests of `#[idempotent]`: every misuse fails with our message at the right
//! span. Regenerate expectations with `TRYBUILD=overwrite`. The cases that must compile
//! (`ui/*/pass`) are test binaries of this crate (`ui_pass_*` in its Cargo.toml), built with
//! the suite and run as trybuild would run them.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/axum/fail/*.rs");
    t.compile_fail("ui/actix/fail/*.rs");
    t.compile_fail("ui/function/fail/*.rs");
}
