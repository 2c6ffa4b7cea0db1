//! Golden expansions: the whole pipeline (arguments → signature → validation → expansion) run
//! on representative handlers and functions, valid and not, compared token for token with
//! `golden.txt`. The generated code is a contract with the adapters' `__private` modules and
//! the errors are a contract with the UI tests, so a change here is a change to review: after
//! changing the expansion on purpose, regenerate the file with
//! `IDEMPOTENT_GOLDEN=overwrite cargo test -p idempotent-macros golden` and read the diff.

use crate::expand::expand;
use crate::validate::Entry;
use proc_macro2::{Delimiter, TokenStream, TokenTree};

/// Every case: its name, the attribute written, its arguments and the item.
fn cases() -> Vec<(&'static str, Entry, &'static str, &'static str)> {
    vec![
        (
            "axum_scoped_result",
            Entry::Axum,
            r#"scope = "account_id", ttl = "1h""#,
            r#"pub async fn h(Path(account_id): Path<String>) -> Result<String, E> {
    Ok(account_id)
}"#,
        ),
        (
            // Seven extractors, clippy's limit: the context makes eight, so the handler carries
            // `allow(clippy::too_many_arguments)`.
            "axum_seven_extractors",
            Entry::Axum,
            r#"scope = "a""#,
            r#"async fn h(a: A, b: B, c: C, d: D, e: E, f: F, g: G) -> String {
    a.0
}"#,
        ),
        (
            // Six (seven with the context) and eight (the user's own signature is over the
            // limit): no `allow`; seven whose own attributes set the lint: theirs stands alone.
            "axum_six_extractors",
            Entry::Axum,
            r#"scope = "a""#,
            r#"async fn h(a: A, b: B, c: C, d: D, e: E, f: F) -> String {
    a.0
}"#,
        ),
        (
            // The last extractor deferred past the replay cache's look (`Later`), except with
            // `extract_on_replay`, or when it binds the scope.
            "axum_body_deferred_and_not",
            Entry::Axum,
            r#"scope = "a""#,
            r#"async fn h(a: A, mut body: Json<B>) -> String {
    body.0
}"#,
        ),
        (
            "axum_extract_on_replay",
            Entry::Axum,
            r#"scope = "a", extract_on_replay"#,
            r#"async fn h(a: A, Json(b): Json<B>) -> String {
    b
}"#,
        ),
        (
            "axum_scope_in_the_body_is_not_deferred",
            Entry::Axum,
            r#"scope = "b.account""#,
            r#"async fn h(a: A, Json(b): Json<B>) -> String {
    b.name
}"#,
        ),
        (
            "actix_only_known_body_extractors_deferred",
            Entry::Actix,
            r#"scope = "a""#,
            r#"async fn h(a: A, sig: Signed<B>) -> String {
    sig.0
}"#,
        ),
        (
            "function_refuses_extract_on_replay",
            Entry::Core,
            r#"name = "n", key_from = "m", unscoped, extract_on_replay"#,
            r#"async fn f(calls: &Calls, m: &str) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            "axum_eight_extractors",
            Entry::Axum,
            r#"scope = "a""#,
            r#"async fn h(a: A, b: B, c: C, d: D, e: E, f: F, g: G, i: I) -> String {
    a.0
}"#,
        ),
        (
            "axum_seven_extractors_own_lint_level",
            Entry::Axum,
            r#"scope = "a""#,
            r#"#[expect(clippy::too_many_arguments)]
async fn h(a: A, b: B, c: C, d: D, e: E, f: F, g: G) -> String {
    a.0
}"#,
        ),
        (
            "axum_every_argument_generics_impl_trait",
            Entry::Axum,
            r#"scope = "acct.0.id", ttl = "7d", lease = "10s", key = "optional", store_server_errors, max_response = "64KiB", crate = "my::axum""#,
            r#"/// Docs.
#[allow(dead_code)]
pub(crate) async fn h<T: Clone>(
    State(s): State<T>,
    acct: Acct,
) -> Result<impl IntoResponse + Send, MyError>
where
    T: Send,
{
    #![allow(unused)]
    let x = 1;
    Ok(x)
}"#,
        ),
        (
            "axum_plain_route_that_waits",
            Entry::Axum,
            r#"scope = "a", lease = "10s", wait = "2s""#,
            r#"async fn h(a: A, Json(b): Json<B>) -> Json<B> {
    Json(b)
}"#,
        ),
        (
            "axum_transactional_two_commits_with_context",
            Entry::Axum,
            r#"scope = "a", commit = "two", wait = "5s""#,
            r#"async fn h(
    a: A,
    tx: Transaction<Postgres>,
    idem: &Idempotent,
    Json(b): Json<B>,
) -> impl IntoResponse {
    b
}"#,
        ),
        (
            "axum_transactional_single_commit_context_by_value",
            Entry::Axum,
            r#"unscoped, commit = "single""#,
            r#"async fn h(mut tx: Transaction<Sqlite>, idem: Idempotent) {}"#,
        ),
        (
            "axum_transactional_defaults",
            Entry::Axum,
            r#"unscoped"#,
            r#"async fn h(tx: idempotent_axum::Transaction<Sqlite>) -> (StatusCode, String) {
    (StatusCode::OK, String::new())
}"#,
        ),
        (
            "actix_scoped",
            Entry::Actix,
            r#"scope = "account", ttl = "1h", lease = "30s""#,
            r#"async fn h(Account(account): Account, mut body: web::Bytes) -> HttpResponse {
    body
}"#,
        ),
        (
            "actix_transactional_with_context",
            Entry::Actix,
            r#"scope = "a", commit = "two", wait = "5s", key = "optional""#,
            r#"pub async fn h(
    a: A,
    tx: Transaction<Postgres>,
    idem: &Idempotent,
    Json(b): Json<B>,
) -> Result<impl Responder, Error> {
    Ok(b)
}"#,
        ),
        (
            "actix_no_parameters",
            Entry::Actix,
            r#"unscoped, crate = "my_actix""#,
            r#"async fn h() -> HttpResponse {
    HttpResponse::Ok().finish()
}"#,
        ),
        (
            // Lint levels stay on the bindings; `#[cfg]`-gated parameters make one copy of the
            // function per combination; the transaction and the context keep theirs too.
            "actix_parameter_attributes",
            Entry::Actix,
            r#"unscoped"#,
            r#"async fn h(
    #[allow(unused_variables)] q: Q,
    #[cfg(feature = "a")] a: A,
    #[cfg(feature = "b")]
    #[cfg(unix)]
    #[allow(unused_variables)]
    b: B,
    #[allow(unused_mut)] mut tx: Transaction<Sqlite>,
    #[allow(unused_variables)] idem: Idempotent,
) -> HttpResponse {
    q
}"#,
        ),
        (
            "axum_parameter_attributes",
            Entry::Axum,
            r#"unscoped"#,
            r#"async fn h(
    #[cfg(feature = "a")] a: A,
    #[allow(unused_mut)] mut tx: Transaction<Sqlite>,
    #[allow(unused_variables)] idem: &Idempotent,
) {
}"#,
        ),
        (
            // Fifteen extractors fit beside the context; sixteen do not.
            "axum_fifteen_extractors",
            Entry::Axum,
            r#"unscoped"#,
            r#"async fn h(a: A, b: B, c: C, d: D, e: E, f: F, g: G, i: I, j: J, k: K, l: L, m: M, n: N, o: O, p: P) {}"#,
        ),
        (
            "axum_sixteen_extractors",
            Entry::Axum,
            r#"unscoped"#,
            r#"async fn h(a: A, b: B, c: C, d: D, e: E, f: F, g: G, i: I, j: J, k: K, l: L, m: M, n: N, o: O, p: P, q: Q) {}"#,
        ),
        (
            // The transaction and the context take no part in counting extractors.
            "axum_fifteen_extractors_and_a_transaction",
            Entry::Axum,
            r#"unscoped"#,
            r#"async fn h(a: A, b: B, c: C, d: D, e: E, f: F, g: G, i: I, j: J, k: K, l: L, m: M, n: N, o: O, tx: Transaction<Sqlite>, idem: Idempotent, p: P) {}"#,
        ),
        (
            "actix_five_gated_parameters",
            Entry::Actix,
            r#"unscoped"#,
            r#"async fn h(#[cfg(a)] a: A, #[cfg(b)] b: B, #[cfg(c)] c: C, #[cfg(d)] d: D, #[cfg(e)] e: E) {}"#,
        ),
        (
            "axum_gated_transaction_context_and_skip",
            Entry::Axum,
            r#"unscoped"#,
            r#"async fn h(#[cfg(a)] tx: Transaction<Sqlite>, #[cfg(b)] idem: Idempotent, #[idempotent(skip)] x: X) {}"#,
        ),
        (
            "core_function_everything",
            Entry::Core,
            r#"name = "billing.book", key_from = "msg.id", scope = "msg.tenant", ttl = "7d", lease = "30s", wait = "5s", store_errors"#,
            r#"/// Books.
pub async fn book(
    calls: &Calls,
    msg: &Msg,
    tx: Transaction<Postgres>,
    idem: &Idempotent,
) -> Result<u8, E> {
    #![allow(unused)]
    Ok(1)
}"#,
        ),
        (
            "core_function_minimal",
            Entry::Core,
            r#"name = "b", key_from = "id", unscoped"#,
            r#"async fn b(id: u64, calls: &Calls) -> std::result::Result<String, io::Error> {
    Ok(String::new())
}"#,
        ),
        (
            "axum_function_mode_renamed_crate",
            Entry::Axum,
            r#"name = "n", key_from = "m.0", scope = "m.1", crate = "my_axum""#,
            r#"async fn f(c: &idempotent_axum::call::Calls, m: (u64, String)) -> Result<(), E> {
    Ok(())
}"#,
        ),
        (
            "actix_function_mode_storing_transactional",
            Entry::Actix,
            r#"name = "n", key_from = "m", unscoped, store_errors"#,
            r#"async fn f(
    calls: &Calls,
    m: &str,
    idem: Idempotent,
    tx: Transaction<Sqlite>,
) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            // Every input is fingerprinted: the key's parameter, the others in order, the
            // bindings of a destructured one, a gated one where it exists; not the runner, the
            // transaction, the context, the scope or what is marked `skip`.
            "core_function_every_input",
            Entry::Core,
            r#"name = "book", key_from = "id", scope = "tenant""#,
            r#"async fn book(
    calls: &Calls,
    id: &str,
    tenant: &TenantId,
    Note { text, .. }: Note,
    #[cfg(feature = "audit")] audit: Audit,
    #[idempotent(skip)] pool: &PgPool,
    #[allow(unused_mut)] mut tx: Transaction<Postgres>,
    amount: i64,
) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            "core_function_parameter_attribute_errors",
            Entry::Core,
            r#"name = "n", key_from = "m", unscoped"#,
            r#"async fn f(calls: &Calls, m: u64, #[idempotent(skipp)] a: A, #[idempotent] b: B) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            "core_function_storing",
            Entry::Core,
            r#"name = "n", key_from = "m", unscoped, store_errors"#,
            r#"async fn f(calls: &Calls, m: &str) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            "axum_many_errors",
            Entry::Axum,
            r#"scope = "nobody", ttl = "soon", retries = 3, name = "x", store_errors, commit = "two", wait = "1s""#,
            r#"fn handler(Json(body): Json<u8>) {}"#,
        ),
        (
            "axum_shape_errors",
            Entry::Axum,
            r#"unscoped"#,
            r#"const fn handler(self, a: Transaction<'c, Postgres>, b: &mut Idempotent) {}"#,
        ),
        (
            "axum_two_transactions_two_contexts",
            Entry::Axum,
            r#"unscoped, ttl = "1m", lease = "2m""#,
            r#"async fn handler(
    a: Transaction<Postgres>,
    b: Transaction<Postgres>,
    c: Idempotent,
    d: &Idempotent,
) {
}"#,
        ),
        (
            "axum_not_a_function_drops_argument_errors",
            Entry::Axum,
            r#"colour = "red""#,
            r#"struct S;"#,
        ),
        (
            "axum_unparsable_item",
            Entry::Axum,
            r#"unscoped"#,
            r#"fn {}"#,
        ),
        (
            "axum_scope_and_unscoped",
            Entry::Axum,
            r#"scope = "a", unscoped, key = "maybe", max_response = "0""#,
            r#"async fn h(a: A) {}"#,
        ),
        (
            "axum_neither_scope_nor_unscoped",
            Entry::Axum,
            r#"ttl = "1h""#,
            r#"async fn h() {}"#,
        ),
        (
            "axum_scope_on_no_parameters",
            Entry::Axum,
            r#"scope = "a.b", unscoped = "yes", ttl"#,
            r#"async fn h() {}"#,
        ),
        (
            "core_function_many_errors",
            Entry::Core,
            r#"scope = "nope", key = "optional", max_response = "1KiB", store_server_errors, commit = "two""#,
            r#"fn f(x: u8) -> u8 {
    x
}"#,
        ),
        (
            "core_function_signature_errors",
            Entry::Core,
            r#"name = "a:b", key_from = "m.id", scope = "t""#,
            r#"async fn f(
    m: &M,
    a: Idempotent,
    b: Idempotent,
    tx: Transaction<'_, Postgres>,
) -> Result<u8> {
    Ok(1)
}"#,
        ),
        (
            "core_function_suggests_a_raw_name",
            Entry::Core,
            r#"key_from = "m", unscoped"#,
            r#"async fn r#type(calls: &Calls, m: u64) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            "core_function_suggests_a_default_name",
            Entry::Core,
            r#"key_from = "m", unscoped"#,
            r#"async fn réserver(calls: &Calls, m: u64) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            "core_function_runner_without_a_plain_binding",
            Entry::Core,
            r#"name = "n", key_from = "m", unscoped"#,
            r#"async fn f(_: &Calls, m: u64) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
        (
            "core_function_not_a_function",
            Entry::Core,
            r#"name = "n", ttl = "1x""#,
            r#"struct S;"#,
        ),
        (
            "axum_function_mode_errors",
            Entry::Axum,
            r#"name = "n", key_from = "msg.id", scope = "tenant""#,
            r#"fn f(calls: &Calls) -> Result<u8, E> {
    Ok(1)
}"#,
        ),
    ]
}

fn render() -> Vec<(&'static str, String)> {
    cases()
        .into_iter()
        .map(|(name, entry, args, item)| {
            let parse = |src: &str| src.parse::<TokenStream>().expect("a case parses as tokens");
            let out = expand(parse(args), parse(item), entry);
            let mut spans = String::new();
            located(out.clone(), &mut spans);
            (name, format!("{out}\n{}", spans.trim_end()))
        })
        .collect()
}

/// Every token whose span points into the case's source, as `token@line:column`, in order
/// (`args` and `item` are parsed separately, so both start at line 1): where each error and
/// each piece of generated code is reported. Tokens the macro makes (`call_site`,
/// `mixed_site`) have no location and are left out.
fn located(tokens: TokenStream, out: &mut String) {
    for tt in tokens {
        let at = |span: proc_macro2::Span| {
            let (start, end) = (span.start(), span.end());
            (end != start).then(|| format!("{}:{}", start.line, start.column))
        };
        match tt {
            TokenTree::Group(g) => {
                let (open, close) = match g.delimiter() {
                    Delimiter::Parenthesis => ("(", ")"),
                    Delimiter::Brace => ("{", "}"),
                    Delimiter::Bracket => ("[", "]"),
                    Delimiter::None => ("«", "»"),
                };
                if let Some(at) = at(g.span_open()) {
                    out.push_str(&format!("{open}@{at} "));
                }
                located(g.stream(), out);
                if let Some(at) = at(g.span_close()) {
                    out.push_str(&format!("{close}@{at} "));
                }
            }
            other => {
                if let Some(at) = at(other.span()) {
                    out.push_str(&format!("{other}@{at} "));
                }
            }
        }
    }
}

fn file(rendered: &[(&str, String)]) -> String {
    rendered
        .iter()
        .map(|(name, out)| format!("== {name}\n{out}\n"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn expansions_match_the_golden_file() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/golden.txt");
    let rendered = render();
    if std::env::var_os("IDEMPOTENT_GOLDEN").is_some_and(|v| v == "overwrite") {
        std::fs::write(path, file(&rendered)).expect("write golden.txt");
        return;
    }
    let golden = std::fs::read_to_string(path).expect("read golden.txt");
    // A header line `== name`, the expansion on one line, its spans on the next.
    let mut lines = golden.lines().filter(|l| !l.is_empty());
    let mut expected: Vec<(&str, String)> = Vec::new();
    while let Some(header) = lines.next() {
        let name = header.strip_prefix("== ").expect("a `== name` line");
        let tokens = lines.next().unwrap_or_default();
        let spans = lines.next().unwrap_or_default();
        expected.push((name, format!("{tokens}\n{spans}")));
    }
    assert_eq!(
        expected.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        rendered.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        "the cases and golden.txt list different expansions"
    );
    let changed: Vec<String> = expected
        .iter()
        .zip(&rendered)
        .filter(|((_, want), (_, got))| want != got)
        .map(|((name, want), (_, got))| format!("`{name}`\nwant: {want}\n got: {got}"))
        .collect();
    assert!(
        changed.is_empty(),
        "expansions changed:\n{}",
        changed.join("\n\n")
    );
}
