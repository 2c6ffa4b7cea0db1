//! trybuild UI tests of `#[idempotent]`: every misuse fails with our message at the right
//! span; the pass cases compile. Regenerate expectations with `TRYBUILD=overwrite`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/axum/fail/*.rs");
    t.pass("ui/axum/pass/*.rs");
    t.compile_fail("ui/actix/fail/*.rs");
    t.pass("ui/actix/pass/*.rs");
    t.compile_fail("ui/function/fail/*.rs");
    t.pass("ui/function/pass/*.rs");
}
