//! The attribute's arguments, parsed with `syn::meta::parser` into typed values that keep
//! their spans. Errors are collected, not returned at the first one.

use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::{LitStr, Token};

/// What an argument takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A bare flag: `unscoped`.
    Flag,
    /// `name = "literal"`.
    Value,
}

/// Every argument the attribute knows: its name, what it takes, and the example the errors
/// show. The parser, the "expected one of" list and the hints all read this one table.
const ARGS: [(&str, Kind, &str); 14] = [
    ("scope", Kind::Value, "scope = \"account_id\""),
    ("unscoped", Kind::Flag, "unscoped"),
    ("ttl", Kind::Value, "ttl = \"24h\""),
    ("lease", Kind::Value, "lease = \"30s\""),
    ("key", Kind::Value, "key = \"optional\""),
    ("store_server_errors", Kind::Flag, "store_server_errors"),
    ("max_response", Kind::Value, "max_response = \"1MiB\""),
    ("commit", Kind::Value, "commit = \"two\""),
    ("wait", Kind::Value, "wait = \"5s\""),
    ("crate", Kind::Value, "crate = \"my_idempotent_axum\""),
    ("key_from", Kind::Value, "key_from = \"msg.id\""),
    ("store_errors", Kind::Flag, "store_errors"),
    ("name", Kind::Value, "name = \"book_payment\""),
    ("extract_on_replay", Kind::Flag, "extract_on_replay"),
];

/// Every argument, for error messages: `` `scope`, `unscoped`, … ``.
fn valid() -> String {
    ARGS.iter()
        .map(|(name, _, _)| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Longest ttl or lease: 365 days (the runtime configuration has the same bound).
pub(crate) const MAX_DURATION_MS: u64 = 365 * 86_400_000;
/// Shortest ttl or lease: 100 ms (the runtime configuration has the same bound).
pub(crate) const MIN_DURATION_MS: u64 = 100;
/// Longest function name, in bytes (`idempotent_core::call::Call::MAX_NAME_LEN`).
pub(crate) const MAX_NAME_LEN: usize = 64;

/// Whether requests must carry a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyReq {
    Required,
    Optional,
}

/// `commit = "single" | "two"`: where a transactional handler's claim commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Commit {
    /// In the handler's own transaction: one commit.
    Single,
    /// Committed first, before the handler's transaction opens.
    Two,
}

/// `scope = "param"` or `"param.field.field"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScopePath {
    pub(crate) param: String,
    pub(crate) fields: Vec<String>,
}

/// The parsed arguments; each keeps the span of its value for later errors.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) scope: Option<(ScopePath, Span)>,
    pub(crate) unscoped: Option<Span>,
    pub(crate) ttl: Option<(u64, Span)>,
    pub(crate) lease: Option<(u64, Span)>,
    pub(crate) key: Option<(KeyReq, Span)>,
    pub(crate) store_server_errors: Option<Span>,
    pub(crate) max_response: Option<(u64, Span)>,
    pub(crate) commit: Option<(Commit, Span)>,
    pub(crate) wait: Option<(u64, Span)>,
    pub(crate) krate: Option<(syn::Path, Span)>,
    /// Function mode: where the key comes from (`param` or `param.field`).
    pub(crate) key_from: Option<(ScopePath, Span)>,
    /// Function mode: errors that opt in (`StoredError`) are stored.
    pub(crate) store_errors: Option<Span>,
    /// Function mode: the stable name that identifies the function's records.
    pub(crate) name: Option<(String, Span)>,
    /// A handler's last extractor runs on replays from the replay cache too.
    pub(crate) extract_on_replay: Option<Span>,
    /// A `name` was written but refused (its error is reported; "missing" would be noise).
    pub(crate) name_refused: bool,
}

/// Sets `slot` once; a second time is a "duplicate argument" error (serde's `Attr::set`).
fn set<T>(slot: &mut Option<T>, value: T, name: &str, span: Span, errors: &mut Vec<syn::Error>) {
    if slot.is_some() {
        errors.push(syn::Error::new(
            span,
            format!("duplicate argument `{name}`"),
        ));
    } else {
        *slot = Some(value);
    }
}

/// Parses the attribute's arguments; all problems found are returned together, next to
/// whatever did parse (so later checks, such as the scope's, still run).
pub(crate) fn parse(tokens: TokenStream) -> (Args, Vec<syn::Error>) {
    let mut args = Args::default();
    let mut errors = Vec::new();
    let parser = syn::meta::parser(|meta| {
        let name = meta
            .path
            .get_ident()
            .map(ToString::to_string)
            .unwrap_or_else(|| {
                quote::ToTokens::to_token_stream(&meta.path)
                    .to_string()
                    .replace(' ', "")
            });
        let span = syn::spanned::Spanned::span(&meta.path);
        let has_value = meta.input.peek(Token![=]);
        let Some(&(_, kind, example)) = ARGS.iter().find(|(n, _, _)| *n == name) else {
            if has_value {
                let _: syn::Expr = meta.value()?.parse()?;
            }
            errors.push(syn::Error::new(
                span,
                format!("unknown argument `{name}`; expected one of {}", valid()),
            ));
            return Ok(());
        };
        match (kind, has_value) {
            (Kind::Flag, true) => {
                let _: syn::Expr = meta.value()?.parse()?;
                errors.push(syn::Error::new(
                    span,
                    format!("`{name}` takes no value; write just `{example}`"),
                ));
                return Ok(());
            }
            (Kind::Flag, false) => {
                let slot = match name.as_str() {
                    "unscoped" => &mut args.unscoped,
                    "store_errors" => &mut args.store_errors,
                    "extract_on_replay" => &mut args.extract_on_replay,
                    _ => &mut args.store_server_errors,
                };
                set(slot, span, &name, span, &mut errors);
                return Ok(());
            }
            (Kind::Value, false) => {
                errors.push(syn::Error::new(
                    span,
                    format!("`{name}` needs a value: `{example}`"),
                ));
                return Ok(());
            }
            (Kind::Value, true) => {}
        }
        let expr: syn::Expr = meta.value()?.parse()?;
        let lit = match &expr {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => s.clone(),
            other => {
                errors.push(syn::Error::new_spanned(
                    other,
                    format!("`{name}` takes a string literal, as in `{example}`"),
                ));
                return Ok(());
            }
        };
        let lspan = lit.span();
        match name.as_str() {
            "scope" => match scope_path(&lit, "scope") {
                Ok(p) => set(&mut args.scope, (p, lspan), &name, span, &mut errors),
                Err(e) => errors.push(e),
            },
            "key_from" => match scope_path(&lit, "key_from") {
                Ok(p) => set(&mut args.key_from, (p, lspan), &name, span, &mut errors),
                Err(e) => errors.push(e),
            },
            "ttl" => match duration(&lit) {
                Ok(ms) => set(&mut args.ttl, (ms, lspan), &name, span, &mut errors),
                Err(e) => errors.push(e),
            },
            "lease" => match duration(&lit) {
                Ok(ms) => set(&mut args.lease, (ms, lspan), &name, span, &mut errors),
                Err(e) => errors.push(e),
            },
            "key" => match lit.value().as_str() {
                "required" => set(&mut args.key, (KeyReq::Required, lspan), &name, span, &mut errors),
                "optional" => set(&mut args.key, (KeyReq::Optional, lspan), &name, span, &mut errors),
                other => errors.push(syn::Error::new(
                    lspan,
                    format!("`key = \"{other}\"` is not a key requirement; expected `\"required\"` or `\"optional\"`"),
                )),
            },
            "commit" => match lit.value().as_str() {
                "single" => set(&mut args.commit, (Commit::Single, lspan), &name, span, &mut errors),
                "two" => set(&mut args.commit, (Commit::Two, lspan), &name, span, &mut errors),
                other => errors.push(syn::Error::new(
                    lspan,
                    format!("`commit = \"{other}\"` is not a commit path; expected `\"single\"` or `\"two\"`"),
                )),
            },
            "wait" => match duration(&lit) {
                Ok(ms) => set(&mut args.wait, (ms, lspan), &name, span, &mut errors),
                Err(e) => errors.push(e),
            },
            "name" => match function_name(&lit.value()) {
                Ok(n) => set(&mut args.name, (n, lspan), &name, span, &mut errors),
                Err(m) => {
                    args.name_refused = true;
                    errors.push(syn::Error::new(lspan, m));
                }
            },
            "max_response" => match size(&lit) {
                Ok(n) => set(&mut args.max_response, (n, lspan), &name, span, &mut errors),
                Err(e) => errors.push(e),
            },
            _ => match lit.parse::<syn::Path>() {
                Ok(p) => set(&mut args.krate, (p, lspan), &name, span, &mut errors),
                Err(_) => errors.push(syn::Error::new(lspan, format!("`crate` must be a path, as in `{example}`"))),
            },
        }
        Ok(())
    });
    if let Err(e) = parser.parse2(tokens) {
        errors.push(e);
    }
    if let (Some((_, uspan)), Some(_)) = (&args.scope, &args.unscoped) {
        errors.push(syn::Error::new(
            *uspan,
            "`scope` and `unscoped` are mutually exclusive: a route either names its caller or shares one namespace",
        ));
    }
    if args.scope.is_none() && args.unscoped.is_none() && errors.is_empty() {
        errors.push(syn::Error::new(
            Span::call_site(),
            "#[idempotent] needs the caller's identity: `scope = \"param\"` naming the parameter that identifies the caller, or `unscoped` if every caller shares one namespace",
        ));
    }
    // Checked here only when both are written: a default lease belongs to the runtime
    // configuration, which resolves the route against it (and refuses it there).
    if let (Some((ttl, tspan)), Some((lease, _))) = (args.ttl, args.lease)
        && ttl < lease
    {
        errors.push(syn::Error::new(
            tspan,
            format!(
                "`ttl` ({}) is shorter than `lease` ({}); a finished response must outlive the lease that protects its first attempt",
                fmt_ms(ttl),
                fmt_ms(lease)
            ),
        ));
    }
    if let (Some((wait, wspan)), Some((lease, _))) = (args.wait, args.lease)
        && wait > lease
    {
        errors.push(syn::Error::new(
            wspan,
            format!(
                "`wait` ({}) is longer than `lease` ({}); a duplicate waits at most as long as the lease of the attempt it waits for",
                fmt_ms(wait),
                fmt_ms(lease)
            ),
        ));
    }
    (args, errors)
}

fn scope_path(lit: &LitStr, what: &str) -> Result<ScopePath, syn::Error> {
    let value = lit.value();
    let mut parts = value.split('.');
    let ident_ok = |s: &str| syn::parse_str::<syn::Ident>(s).is_ok();
    let param = parts.next().unwrap_or_default().to_owned();
    let fields: Vec<String> = parts.map(str::to_owned).collect();
    if !ident_ok(&param)
        || fields
            .iter()
            .any(|f| !ident_ok(f) && f.parse::<u32>().is_err())
    {
        return Err(syn::Error::new(
            lit.span(),
            format!("`{what} = \"{value}\"` is not a parameter name or `param.field` path"),
        ));
    }
    Ok(ScopePath { param, fields })
}

/// A function's name, by the rule of `idempotent_core::call::Call::new`: 1 to 64 ASCII
/// letters, digits, `_`, `-` or `.` (so it reads the same in every store, log and metric
/// label, and no `:` blurs it with the scope it prefixes).
pub(crate) fn function_name(s: &str) -> Result<String, String> {
    const RULE: &str = "a function name is 1 to 64 ASCII letters, digits, `_`, `-` or `.`";
    if s.is_empty() {
        return Err(format!(
            "`name` is empty; {RULE}, as in `name = \"book_payment\"`"
        ));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        let what = if c == ' ' {
            "a space".to_owned()
        } else {
            format!("`{}`", c.escape_debug())
        };
        return Err(format!(
            "`name = \"{}\"` holds {what}; {RULE}",
            s.escape_debug()
        ));
    }
    if s.len() > MAX_NAME_LEN {
        return Err(format!("`name` is {} characters long; {RULE}", s.len()));
    }
    Ok(s.to_owned())
}

/// The same grammar as `idempotent_core::parse_duration`: `<n>ms|s|m|h|d`, from 100 ms to 365
/// days (the bounds of the runtime configuration).
pub(crate) fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let malformed = || {
        format!(
            "`{s}` is not a duration; write a whole number and a unit: `500ms`, `30s`, `15m`, `24h` or `7d`"
        )
    };
    let end = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(malformed)?;
    let (digits, unit) = s.split_at(end);
    let per: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(malformed()),
    };
    if digits.is_empty() {
        return Err(malformed());
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("the duration `{s}` is too large"))?;
    let ms = n
        .checked_mul(per)
        .ok_or_else(|| format!("the duration `{s}` is too large"))?;
    if ms == 0 {
        return Err(format!(
            "the duration `{s}` is zero; it must be at least 1ms"
        ));
    }
    if ms < MIN_DURATION_MS {
        return Err(format!(
            "the duration `{s}` is shorter than the minimum of `100ms`"
        ));
    }
    if ms > MAX_DURATION_MS {
        return Err(format!(
            "the duration `{s}` is longer than the maximum of `365d`"
        ));
    }
    Ok(ms)
}

fn duration(lit: &LitStr) -> Result<u64, syn::Error> {
    parse_duration_ms(&lit.value()).map_err(|m| syn::Error::new(lit.span(), m))
}

/// `<n>` (bytes), `<n>KiB`, `<n>MiB` or `<n>GiB`, not zero.
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let malformed = || {
        format!(
            "`{s}` is not a size; write a whole number of bytes, or one with `KiB`, `MiB` or `GiB`, as in `1MiB`"
        )
    };
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(end);
    let per: u64 = match unit {
        "" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(malformed()),
    };
    let n: u64 = digits.parse().map_err(|_| malformed())?;
    let bytes = n
        .checked_mul(per)
        .ok_or_else(|| format!("the size `{s}` is too large"))?;
    if bytes == 0 {
        return Err(format!("the size `{s}` is zero"));
    }
    Ok(bytes)
}

fn size(lit: &LitStr) -> Result<u64, syn::Error> {
    parse_size(&lit.value()).map_err(|m| syn::Error::new(lit.span(), m))
}

fn fmt_ms(ms: u64) -> String {
    for (unit, per) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= per && ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn errs(t: TokenStream) -> Vec<String> {
        parse(t).1.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn parses_everything() {
        let a = parse(quote!(
            scope = "acct.id",
            ttl = "7d",
            lease = "10s",
            key = "optional",
            store_server_errors,
            max_response = "64KiB",
            crate = "my::path"
        ))
        .0;
        assert_eq!(
            a.scope.unwrap().0,
            ScopePath {
                param: "acct".into(),
                fields: vec!["id".into()]
            }
        );
        assert_eq!(a.ttl.unwrap().0, 7 * 86_400_000);
        assert_eq!(a.lease.unwrap().0, 10_000);
        assert_eq!(a.key.unwrap().0, KeyReq::Optional);
        assert!(a.store_server_errors.is_some());
        assert_eq!(a.max_response.unwrap().0, 65_536);
        assert!(parse(quote!(unscoped)).1.is_empty());
    }

    #[test]
    fn collects_errors() {
        let e = errs(quote!(
            scope = "a",
            ttl = "0s",
            lease = "5x",
            colour = "red",
            scope = "b"
        ));
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(e.iter().any(|m| m.contains("is zero")));
        assert!(e.iter().any(|m| m.contains("`5x` is not a duration")));
        assert!(
            e.iter()
                .any(|m| m.starts_with("unknown argument `colour`; expected one of `scope`"))
        );
        assert!(e.iter().any(|m| m == "duplicate argument `scope`"));
        assert_eq!(
            errs(quote!(ttl = 24))[0],
            "`ttl` takes a string literal, as in `ttl = \"24h\"`"
        );
        assert_eq!(
            errs(quote!(scope = "a", ttl))[0],
            "`ttl` needs a value: `ttl = \"24h\"`"
        );
        assert!(errs(quote!(scope = "a", unscoped))[0].contains("mutually exclusive"));
        assert!(errs(quote!(ttl = "1h"))[0].contains("needs the caller's identity"));
        // No assumed default lease: a lone short ttl is checked against the configuration
        // at run time, not here.
        assert!(errs(quote!(unscoped, ttl = "10s")).is_empty());
        assert!(
            errs(quote!(unscoped, ttl = "1m", lease = "2m"))[0]
                .contains("shorter than `lease` (2m)")
        );
        assert!(
            errs(quote!(unscoped, wait = "3s", lease = "2s"))[0]
                .contains("`wait` (3s) is longer than `lease` (2s)")
        );
        assert!(
            errs(quote!(unscoped, wait = "2s", lease = "2s")).is_empty(),
            "a wait as long as the lease is accepted"
        );
        assert!(errs(quote!(unscoped = "yes"))[0].contains("takes no value"));
        assert!(errs(quote!(scope = "a-b"))[0].contains("not a parameter name"));
        assert!(
            errs(quote!(unscoped, key = "maybe"))[0]
                .contains("expected `\"required\"` or `\"optional\"`")
        );
    }

    #[test]
    fn function_names() {
        let a = parse(quote!(
            name = "billing.book-payment_v2",
            key_from = "m.id",
            unscoped
        ))
        .0;
        assert_eq!(a.name.unwrap().0, "billing.book-payment_v2");
        assert_eq!(
            errs(quote!(name = "", unscoped))[0],
            "`name` is empty; a function name is 1 to 64 ASCII letters, digits, `_`, `-` or `.`, as in `name = \"book_payment\"`"
        );
        assert_eq!(
            errs(quote!(name = "payments::book", unscoped))[0],
            "`name = \"payments::book\"` holds `:`; a function name is 1 to 64 ASCII letters, digits, `_`, `-` or `.`"
        );
        assert!(errs(quote!(name = "book payment", unscoped))[0].contains("holds a space"));
        assert!(errs(quote!(name = "a\nb", unscoped))[0].contains("holds `\\n`"));
        assert!(errs(quote!(name = "réserver", unscoped))[0].contains("holds `é`"));
        let long = "x".repeat(MAX_NAME_LEN + 1);
        assert!(errs(quote!(name = #long, unscoped))[0].contains("is 65 characters long"));
        let longest = "x".repeat(MAX_NAME_LEN);
        assert!(errs(quote!(name = #longest, unscoped)).is_empty());
        assert_eq!(
            errs(quote!(name = "a", name = "b", unscoped))[0],
            "duplicate argument `name`"
        );
        assert!(errs(quote!(name = book, unscoped))[0].contains("takes a string literal"));
    }

    /// The attribute parses durations as core's `parse_duration` does, plus its range: one
    /// table of cases for both (core's `duration.rs` reads it too).
    #[test]
    fn durations_agree_with_core() {
        let cases: &[(&str, Result<u64, &str>, &str)] = include!("../../tests/duration_cases.rs");
        for &(input, parsed, range) in cases {
            let got = parse_duration_ms(input);
            match (parsed, range) {
                (Ok(ms), "") => assert_eq!(got, Ok(ms), "{input:?}"),
                (Ok(_), "short") => assert_eq!(
                    got,
                    Err(format!(
                        "the duration `{input}` is shorter than the minimum of `100ms`"
                    )),
                    "{input:?}"
                ),
                (Ok(_), "long") => assert_eq!(
                    got,
                    Err(format!(
                        "the duration `{input}` is longer than the maximum of `365d`"
                    )),
                    "{input:?}"
                ),
                (Err(why), "") => assert!(
                    got.as_ref().is_err_and(|m| m.contains(why)),
                    "{input:?}: {got:?}, expected an error containing {why:?}"
                ),
                (_, other) => panic!("{input:?}: unknown range {other:?} in the table"),
            }
        }
    }

    #[test]
    fn grammars() {
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("100ms"), Ok(100));
        assert!(
            parse_duration_ms("99ms")
                .unwrap_err()
                .contains("minimum of `100ms`")
        );
        assert!(parse_duration_ms("1.5h").is_err());
        assert!(parse_duration_ms("99999999999999999999d").is_err());
        assert_eq!(parse_duration_ms("365d"), Ok(MAX_DURATION_MS));
        assert!(
            parse_duration_ms("366d")
                .unwrap_err()
                .contains("maximum of `365d`")
        );
        assert!(
            parse_size("1B").is_err(),
            "units agree with the docs: bytes are bare"
        );
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("0").is_err());
        assert!(parse_size("1MB").is_err());
    }
}
