//! trybuild UI tests of `#[idempotent]`: every misuse fails with our message at the right
//! span. Regenerate expectations with `TRYBUILD=overwrite`. The cases that must compile
//! (`ui/*/pass`) are test binaries of this crate (`ui_pass_*` in its Cargo.toml), built with
//! the suite and run as trybuild would run them.

/// The flags trybuild gives rustc (trybuild 1.0.122: `--cfg trybuild --verbose -A dead_code`,
/// plus `--diagnostic-width=140` when it checks the cases).
///
/// trybuild checks its project's dependencies with the first set and then the cases with the
/// second. Cargo hashes the flags into every unit, so on a cold `target/` every dependency was
/// checked twice (72 s, then 46 s more, on CI's 2 cores). Cargo takes
/// `CARGO_ENCODED_RUSTFLAGS` over the `--config` flags trybuild passes, so giving both of its
/// cargo runs the second set checks the dependencies once. Diagnostics are unchanged: the cases
/// get exactly the flags they had, and rustc's width for output that is not a terminal is 140
/// anyway.
const TRYBUILD_RUSTFLAGS: &[&str] = &[
    "--cfg",
    "trybuild",
    "--verbose",
    "-A",
    "dead_code",
    "--diagnostic-width=140",
];

/// Set in the child process that runs the cases (see [`ui`]).
const IN_CHILD: &str = "IDEMPOTENT_UI_CHILD";

/// What the child prints once every case has passed.
const CHILD_RAN: &str = "idempotent-ui: every case checked";

/// Every misuse fails to compile with the expected message.
///
/// The cases run in a child process of this test binary, with `CARGO_ENCODED_RUSTFLAGS` set
/// for trybuild's cargo (see [`TRYBUILD_RUSTFLAGS`]): a test cannot set an environment
/// variable in its own process while other tests' threads run.
#[test]
fn ui() {
    if std::env::var_os(IN_CHILD).is_some() {
        let t = trybuild::TestCases::new();
        t.compile_fail("ui/axum/fail/*.rs");
        t.compile_fail("ui/actix/fail/*.rs");
        t.compile_fail("ui/function/fail/*.rs");
        // The cases run when `t` is dropped, and panic there if one fails.
        drop(t);
        println!("{CHILD_RAN}");
        return;
    }
    let mut flags = TRYBUILD_RUSTFLAGS.to_vec();
    // What trybuild itself keeps of RUSTFLAGS (coverage runs, e.g. cargo-llvm-cov).
    if std::env::var("RUSTFLAGS").is_ok_and(|f| f.contains("-C instrument-coverage")) {
        flags.extend(["-C", "instrument-coverage"]);
    }
    // trybuild's own filter (`cargo test --test ui -- trybuild=name.rs`) goes to the child.
    let filters = std::env::args().filter(|a| a.starts_with("trybuild="));
    let output = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args(["ui", "--exact", "--nocapture", "--test-threads=1"])
        .args(filters)
        .env(IN_CHILD, "1")
        .env("CARGO_ENCODED_RUSTFLAGS", flags.join("\x1f"))
        .output()
        .expect("the UI cases run in a child process");
    // Shown by the harness when this test fails (or with --nocapture).
    print!("{}", String::from_utf8_lossy(&output.stdout));
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success(),
        "the UI cases failed ({}); their output is above",
        output.status
    );
    // A child that selected no test (this one renamed, say) would exit 0 having run nothing.
    assert!(
        String::from_utf8_lossy(&output.stdout).contains(CHILD_RAN),
        "the child process did not run the UI cases; its output is above"
    );
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
        cases, 18,
        "pass cases found; update this count when adding one"
    );
}
