//! The function's shape (async, no receiver, not const), the parameters the attribute gives a
//! meaning (transaction, idempotency context, runner), its declared output, and the names its
//! parameters bind.

use proc_macro2::Span;
use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, Pat, ReturnType, Type};

/// Checks what `#[idempotent]` needs of the function; all problems together.
pub(crate) fn check(f: &ItemFn) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    let sig = &f.sig;
    if let Some(c) = &sig.constness {
        errors.push(syn::Error::new(
            c.span(),
            "#[idempotent] cannot be used on a `const fn`; handlers are `async fn`",
        ));
    }
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span(),
            format!(
                "#[idempotent] needs an `async fn`; make `{}` async",
                sig.ident
            ),
        ));
    }
    if let Some(FnArg::Receiver(r)) = sig.inputs.first() {
        errors.push(syn::Error::new(
            r.span(),
            "#[idempotent] handlers cannot take `self`; write a free `async fn` and reach shared state through an extractor such as `State`",
        ));
    }
    errors
}

/// The handler's transaction parameter (transactional mode): the one whose type is a path
/// ending in `Transaction<DB>`. Its index among the inputs, or the errors that make it
/// ambiguous or wrong (two of them; sqlx's own `Transaction<'c, DB>`).
pub(crate) fn transaction(f: &ItemFn) -> Result<Option<usize>, syn::Error> {
    let mut found = None;
    for (i, arg) in f.sig.inputs.iter().enumerate() {
        let FnArg::Typed(t) = arg else { continue };
        let syn::Type::Path(path) = &*t.ty else {
            continue;
        };
        let Some(last) = path.path.segments.last() else {
            continue;
        };
        if last.ident != "Transaction" {
            continue;
        }
        let takes_lifetime = matches!(&last.arguments, syn::PathArguments::AngleBracketed(a)
            if a.args.iter().any(|g| matches!(g, syn::GenericArgument::Lifetime(_))));
        if takes_lifetime {
            return Err(syn::Error::new(
                t.ty.span(),
                "take the adapter's `Transaction<DB>` (e.g. `idempotent_axum::Transaction<Postgres>`), not sqlx's `Transaction<'_, DB>`: the library opens, commits and rolls it back with the stored response",
            ));
        }
        if found.is_some() {
            return Err(syn::Error::new(
                t.ty.span(),
                "a handler takes at most one `Transaction`: the stored response commits with exactly one",
            ));
        }
        found = Some(i);
    }
    Ok(found)
}

/// The handler's idempotency context parameter: the one whose type is a path ending in
/// `Idempotent` (or a reference to one). Its index among the inputs, or an error for two.
pub(crate) fn context(f: &ItemFn) -> Result<Option<usize>, syn::Error> {
    let mut found = None;
    for (i, arg) in f.sig.inputs.iter().enumerate() {
        let FnArg::Typed(t) = arg else { continue };
        let (ty, reference) = match &*t.ty {
            syn::Type::Reference(r) => (&*r.elem, Some(r)),
            other => (other, None),
        };
        let syn::Type::Path(path) = ty else { continue };
        if path.qself.is_some()
            || path
                .path
                .segments
                .last()
                .is_none_or(|s| s.ident != "Idempotent")
        {
            continue;
        }
        if let Some(r) = reference
            && (r.mutability.is_some() || r.lifetime.is_some())
        {
            return Err(syn::Error::new_spanned(
                &t.ty,
                "take the idempotency context as `idem: Idempotent` or `idem: &Idempotent` (no `mut`, no lifetime)",
            ));
        }
        if found.is_some() {
            return Err(syn::Error::new_spanned(
                &t.ty,
                "a handler takes at most one `Idempotent` context",
            ));
        }
        found = Some(i);
    }
    Ok(found)
}

/// Function mode's runner: the parameter whose type is a reference to a path ending in
/// `Calls` (`calls: &Calls`).
pub(crate) fn runner(f: &ItemFn) -> Option<usize> {
    f.sig.inputs.iter().position(|arg| {
        let FnArg::Typed(t) = arg else { return false };
        let syn::Type::Reference(r) = &*t.ty else {
            return false;
        };
        matches!(&*r.elem, syn::Type::Path(p)
            if p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "Calls"))
    })
}

/// `T` and `E` of a declared `-> Result<T, E>` (any path ending in `Result` with two types):
/// function mode's output.
pub(crate) fn result_types(output: &ReturnType) -> Option<(Type, Type)> {
    let ReturnType::Type(_, ty) = output else {
        return None;
    };
    let Type::Path(path) = &**ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Result" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    let mut types = args.args.iter().filter_map(|a| match a {
        syn::GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    });
    let (ok, err) = (types.next()?, types.next()?);
    types.next().is_none().then_some((ok, err))
}

/// Whether `attr` is the attribute's own parameter attribute, `#[idempotent(…)]`.
pub(crate) fn is_ours(attr: &syn::Attribute) -> bool {
    attr.path().is_ident("idempotent")
}

/// The indices of the parameters marked `#[idempotent(skip)]` (function mode: no input of the
/// operation, so not fingerprinted), and an error for every other argument written there.
pub(crate) fn skipped(f: &ItemFn) -> (Vec<usize>, Vec<syn::Error>) {
    let mut skipped = Vec::new();
    let mut errors = Vec::new();
    for (i, arg) in f.sig.inputs.iter().enumerate() {
        let FnArg::Typed(t) = arg else { continue };
        for attr in t.attrs.iter().filter(|a| is_ours(a)) {
            if !matches!(attr.meta, syn::Meta::List(_)) {
                errors.push(syn::Error::new_spanned(
                    attr,
                    "write `#[idempotent(skip)]` on a parameter to leave it out of the fingerprint",
                ));
                continue;
            }
            let parsed = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("skip") {
                    skipped.push(i);
                    Ok(())
                } else {
                    let name = meta.path.get_ident().map_or_else(
                        || quote::ToTokens::to_token_stream(&meta.path).to_string(),
                        ToString::to_string,
                    );
                    Err(meta.error(format!(
                        "unknown parameter argument `{name}`; a parameter takes `#[idempotent(skip)]`, which leaves it out of the fingerprint"
                    )))
                }
            });
            if let Err(e) = parsed {
                errors.push(e);
            }
        }
    }
    (skipped, errors)
}

/// The function without the attribute's own parameter attributes, which the compiler would
/// not know.
pub(crate) fn strip_ours(mut f: ItemFn) -> ItemFn {
    for arg in &mut f.sig.inputs {
        if let FnArg::Typed(t) = arg {
            t.attrs.retain(|a| !is_ours(a));
        }
    }
    f
}

/// The names bound by the function's parameter patterns, in order, walking tuple-struct,
/// struct, tuple, reference and typed patterns (`Path(account_id): Path<String>` binds
/// `account_id`).
pub(crate) fn bindings(f: &ItemFn) -> Vec<(String, Span)> {
    let mut out = Vec::new();
    for arg in &f.sig.inputs {
        if let FnArg::Typed(t) = arg {
            walk(&t.pat, &mut out);
        }
    }
    out.into_iter()
        .map(|ident| (ident.to_string(), ident.span()))
        .collect()
}

/// The identifiers one parameter pattern binds, in order (see [`bindings`]).
pub(crate) fn pattern_bindings(pat: &Pat) -> Vec<syn::Ident> {
    let mut out = Vec::new();
    walk(pat, &mut out);
    out
}

fn walk(pat: &Pat, out: &mut Vec<syn::Ident>) {
    match pat {
        Pat::Ident(i) => {
            out.push(i.ident.clone());
            if let Some((_, sub)) = &i.subpat {
                walk(sub, out);
            }
        }
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| walk(p, out)),
        Pat::Tuple(t) => t.elems.iter().for_each(|p| walk(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| walk(&f.pat, out)),
        Pat::Reference(r) => walk(&r.pat, out),
        Pat::Type(t) => walk(&t.pat, out),
        Pat::Paren(p) => walk(&p.pat, out),
        Pat::Slice(s) => s.elems.iter().for_each(|p| walk(p, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(src: &str) -> Vec<String> {
        let f: ItemFn = syn::parse_str(src).unwrap();
        bindings(&f).into_iter().map(|(n, _)| n).collect()
    }

    #[test]
    fn walks_patterns() {
        assert_eq!(
            names(
                "async fn h(State(app): State<App>, AccountId(account_id): AccountId, Json(req): Json<R>) {}"
            ),
            ["app", "account_id", "req"]
        );
        assert_eq!(
            names(
                "async fn h(Path((org, user)): Path<(u64, u64)>, Auth { user: who, .. }: Auth, &x: &u8, _: W) {}"
            ),
            ["org", "user", "who", "x"]
        );
        assert_eq!(names("async fn h(mut plain: String) {}"), ["plain"]);
    }

    #[test]
    fn shape_errors() {
        let f: ItemFn = syn::parse_str("const fn h() {}").unwrap();
        let e: Vec<String> = check(&f).iter().map(ToString::to_string).collect();
        assert_eq!(e.len(), 2);
        assert!(e[0].contains("`const fn`") && e[1].contains("make `h` async"));
    }
}
