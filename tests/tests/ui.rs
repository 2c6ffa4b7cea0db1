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

/// Every case under `ui/*/pass` is a test binary of this crate: one added there without its
/// `[[test]]` entry in Cargo.toml would never be built.
#[test]
fn every_pass_case_is_built() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let mut cases = 0;
    for attribute in ["axum", "actix", "function"] {
        let dir = root.join("ui").join(attribute).join("pass");
        for entry in std::fs::read_dir(&dir).expect("a pass folder") {
            let name = entry.expect("an entry").file_name();
            let name = name.to_string_lossy();
            if !name.ends_with(".rs") {
                continue;
            }
            let path = format!("path = \"ui/{attribute}/pass/{name}\"");
            assert!(
                manifest.contains(&path),
                "ui/{attribute}/pass/{name} has no [[test]] entry in tests/Cargo.toml"
            );
            cases += 1;
        }
    }
    assert_eq!(
        cases, 16,
        "pass cases found; update this count when adding one"
    );
}
