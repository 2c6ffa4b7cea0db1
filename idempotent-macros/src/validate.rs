//! The arguments checked against the function they are written on, per mode: a typed plan
//! (`HandlerPlan`, `FunctionPlan`) holding only what code generation needs, or every error
//! found, together. A plan is only made from valid input, so expansion cannot fail.

use crate::args::{Args, Commit, KeyReq, ScopePath};
use crate::signature;
use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::{FnArg, ItemFn, Pat, Type};

/// The most parameters of an Actix handler that `#[cfg]` may gate: the function is expanded
/// once per combination of them (2⁴ = 16 copies, of which the compiler keeps one).
pub(crate) const MAX_GATED_ACTIX_PARAMETERS: usize = 4;

/// The attribute that was written: which crate re-exports it, and so where the generated
/// code finds its runtime unless `crate = "…"` says otherwise.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Entry {
    /// `idempotent_axum::idempotent`: handlers, or functions with `key_from`.
    Axum,
    /// `idempotent_actix::idempotent`: handlers, or functions with `key_from`.
    Actix,
    /// `idempotent_core::idempotent`: functions only.
    Core,
}

impl Entry {
    fn default_crate(self) -> TokenStream {
        match self {
            Entry::Axum => quote!(::idempotent_axum),
            Entry::Actix => quote!(::idempotent_actix),
            Entry::Core => quote!(::idempotent_core),
        }
    }

    /// The framework whose handlers this attribute makes; none for core's.
    fn framework(self) -> Option<Framework> {
        match self {
            Entry::Axum => Some(Framework::Axum),
            Entry::Actix => Some(Framework::Actix),
            Entry::Core => None,
        }
    }
}

/// Which adapter a handler's generated code calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framework {
    Axum,
    Actix,
}

/// What the attribute makes of the function (boxed: a plan holds the whole function).
pub(crate) enum Plan {
    Handler(Box<HandlerPlan>),
    Function(Box<FunctionPlan>),
}

/// A handler: claim → execute → store → replay around its body.
pub(crate) struct HandlerPlan {
    pub(crate) func: ItemFn,
    pub(crate) framework: Framework,
    /// `::idempotent_axum`, `::idempotent_actix`, or the `crate = "…"` path.
    pub(crate) root: TokenStream,
    /// `scope = "…"`, spanned at its literal; `None` for `unscoped`.
    pub(crate) scope: Option<(ScopePath, Span)>,
    pub(crate) ttl_ms: Option<u64>,
    pub(crate) lease_ms: Option<u64>,
    /// `wait = "…"`: how long a duplicate waits for the running attempt's answer.
    pub(crate) wait_ms: Option<u64>,
    pub(crate) key: KeyReq,
    pub(crate) store_server_errors: bool,
    pub(crate) max_response: Option<u64>,
    /// `extract_on_replay`: the last extractor is never deferred past the replay cache.
    pub(crate) extract_on_replay: bool,
    /// The `Transaction<DB>` parameter, if the handler is transactional.
    pub(crate) transaction: Option<Transactional>,
    /// The index of the `Idempotent` parameter among the inputs.
    pub(crate) context: Option<usize>,
}

/// A transactional handler: its transaction parameter and the arguments only it takes.
pub(crate) struct Transactional {
    /// The index of the `Transaction<DB>` parameter among the inputs.
    pub(crate) param: usize,
    pub(crate) commit: Option<Commit>,
}

/// An idempotent function: run at most once per (scope, key) under the runner it is passed.
pub(crate) struct FunctionPlan {
    pub(crate) func: ItemFn,
    /// `::idempotent_core` (or the adapter whose attribute was written), or `crate = "…"`.
    pub(crate) root: TokenStream,
    /// The records' identity, spanned at its literal.
    pub(crate) name: syn::LitStr,
    /// Where the key comes from, spanned at its literal.
    pub(crate) key_from: (ScopePath, Span),
    pub(crate) scope: Option<(ScopePath, Span)>,
    pub(crate) ttl_ms: Option<u64>,
    pub(crate) lease_ms: Option<u64>,
    pub(crate) wait_ms: Option<u64>,
    pub(crate) store_errors: bool,
    /// The binding of the `&Calls` parameter.
    pub(crate) runner: syn::Ident,
    /// The indices of the `Idempotent` and `Transaction<DB>` parameters among the inputs.
    pub(crate) context: Option<usize>,
    pub(crate) transaction: Option<usize>,
    /// What the fingerprint covers, in parameter order.
    pub(crate) inputs: Vec<Input>,
    /// `T` and `E` of the declared `Result<T, E>`.
    pub(crate) ok: Type,
    pub(crate) err: Type,
}

/// One binding of a function's parameters that its fingerprint covers, with the `#[cfg]`s of
/// its parameter (it exists only where they hold).
pub(crate) struct Input {
    pub(crate) ident: syn::Ident,
    pub(crate) cfgs: Vec<syn::Attribute>,
}

/// Checks the parsed arguments (and the errors their parsing found) against the item: a
/// handler unless `key_from` is written or the attribute is core's.
pub(crate) fn validate(
    args: Args,
    arg_errors: Vec<syn::Error>,
    item: &TokenStream,
    entry: Entry,
) -> Result<Plan, Vec<syn::Error>> {
    let root = args
        .krate
        .as_ref()
        .map_or_else(|| entry.default_crate(), |(p, _)| quote!(#p));
    match entry.framework() {
        Some(framework) if args.key_from.is_none() => {
            handler(args, arg_errors, item, framework, root)
                .map(|plan| Plan::Handler(Box::new(plan)))
        }
        // `key_from`: an idempotent function, not a handler (each adapter re-exports the
        // core's function runtime under its own `__private`).
        _ => function(args, arg_errors, item, root).map(|plan| Plan::Function(Box::new(plan))),
    }
}

fn handler(
    args: Args,
    mut arg_errors: Vec<syn::Error>,
    item: &TokenStream,
    framework: Framework,
    root: TokenStream,
) -> Result<HandlerPlan, Vec<syn::Error>> {
    if let Some(span) = args.store_errors {
        arg_errors.push(syn::Error::new(
            span,
            "`store_errors` applies to idempotent functions (`key_from = …`); a handler stores 5xx with `store_server_errors`",
        ));
    }
    if let Some((_, span)) = args.name {
        arg_errors.push(syn::Error::new(
            span,
            "`name` applies to idempotent functions (`key_from = …`); a handler's records are identified by its caller's scope and the `Idempotency-Key`, and its fingerprint holds the method and path, so it takes no name",
        ));
    }
    // Not a function: that one error alone (the arguments are checked against a handler).
    let func: ItemFn = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Fn(f)) => f,
        Ok(other) => {
            return Err(vec![syn::Error::new_spanned(
                item_head(&other),
                "#[idempotent] applies to `async fn` handlers only",
            )]);
        }
        Err(e) => return Err(vec![e]),
    };
    let mut errors = signature::check(&func);
    errors.append(&mut arg_errors);
    for arg in &func.sig.inputs {
        let FnArg::Typed(t) = arg else { continue };
        for attr in t.attrs.iter().filter(|a| signature::is_ours(a)) {
            errors.push(syn::Error::new_spanned(
                attr,
                "`#[idempotent(skip)]` applies to the parameters of idempotent functions (`key_from = …`); a handler's fingerprint is its request (method, path, query, body), not its parameters",
            ));
        }
    }
    let tx = signature::transaction(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    let context = signature::context(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    if tx.is_none() {
        for (name, span) in [("commit", args.commit.map(|c| c.1))] {
            if let Some(span) = span {
                errors.push(syn::Error::new(
                    span,
                    format!("`{name}` applies to transactional handlers: add a `tx: Transaction<DB>` parameter (DB = `Postgres` or `Sqlite`, the store's database)"),
                ));
            }
        }
    }
    errors.extend(unbound("scope", args.scope.as_ref(), &func));
    errors.extend(ungated(&func, tx, context));
    let own: Vec<&syn::PatType> = func
        .sig
        .inputs
        .iter()
        .enumerate()
        .filter(|(i, _)| ![tx, context].contains(&Some(*i)))
        .filter_map(|(_, arg)| match arg {
            FnArg::Typed(t) => Some(t),
            FnArg::Receiver(_) => None,
        })
        .collect();
    match framework {
        // axum's `Handler` takes at most 16 arguments, and the hidden context is one of them:
        // past that, axum's own error names a trait bound, not the cause.
        Framework::Axum if own.len() > AXUM_MAX_ARGUMENTS - 1 => {
            errors.push(syn::Error::new_spanned(
                own[AXUM_MAX_ARGUMENTS - 1],
                format!(
                    "`{}` takes {} extractors; with the hidden context `#[idempotent]` adds, that makes {}, and axum handlers take at most {AXUM_MAX_ARGUMENTS}: group some into one tuple extractor, such as `(a, b): (A, B)`",
                    func.sig.ident,
                    own.len(),
                    own.len() + 1,
                ),
            ));
        }
        Framework::Actix => {
            let gated: Vec<&syn::Attribute> = own
                .iter()
                .filter_map(|t| t.attrs.iter().find(|a| a.path().is_ident("cfg")))
                .collect();
            if let Some(first_over) = gated.get(MAX_GATED_ACTIX_PARAMETERS) {
                errors.push(syn::Error::new_spanned(
                    first_over,
                    format!(
                        "`{}` gates {} parameters with `#[cfg]`; an Actix handler may gate at most {} (it is expanded once per combination of them)",
                        func.sig.ident,
                        gated.len(),
                        MAX_GATED_ACTIX_PARAMETERS,
                    ),
                ));
            }
        }
        Framework::Axum => {}
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(HandlerPlan {
        func,
        framework,
        root,
        scope: args.scope,
        ttl_ms: args.ttl.map(|t| t.0),
        lease_ms: args.lease.map(|l| l.0),
        wait_ms: args.wait.map(|w| w.0),
        key: args.key.map_or(KeyReq::Required, |k| k.0),
        store_server_errors: args.store_server_errors.is_some(),
        max_response: args.max_response.map(|m| m.0),
        extract_on_replay: args.extract_on_replay.is_some(),
        transaction: tx.map(|param| Transactional {
            param,
            commit: args.commit.map(|c| c.0),
        }),
        context,
    })
}

fn function(
    args: Args,
    mut errors: Vec<syn::Error>,
    item: &TokenStream,
    root: TokenStream,
) -> Result<FunctionPlan, Vec<syn::Error>> {
    let func: ItemFn = match syn::parse2::<ItemFn>(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            errors.push(syn::Error::new(
                e.span(),
                "#[idempotent] applies to `async fn` items only",
            ));
            return Err(errors);
        }
    };
    errors.extend(signature::check(&func));
    for (name, span) in [
        ("key", args.key.as_ref().map(|k| k.1)),
        ("max_response", args.max_response.map(|m| m.1)),
        ("store_server_errors", args.store_server_errors),
    ] {
        if let Some(span) = span {
            errors.push(syn::Error::new(
                span,
                format!("`{name}` applies to HTTP handlers; a function's key comes from `key_from` (and `store_errors` stores errors that opt in)"),
            ));
        }
    }
    if let Some(span) = args.extract_on_replay {
        errors.push(syn::Error::new(
            span,
            "`extract_on_replay` applies to HTTP handlers (it keeps a handler's body extractor running on replays); a function has no extractors",
        ));
    }
    let runner = match signature::runner(&func) {
        None => {
            errors.push(syn::Error::new_spanned(
                &func.sig.ident,
                format!(
                    "`{}` needs the runner it executes under: add a parameter `calls: &Calls` (`idempotent_core::call::Calls`); callers pass it",
                    func.sig.ident
                ),
            ));
            None
        }
        // The runner is named by its pattern, which must be a plain binding (`calls: &Calls`).
        Some(i) => match func.sig.inputs.iter().nth(i) {
            Some(FnArg::Typed(t)) => match &*t.pat {
                Pat::Ident(p) => Some(p.ident.clone()),
                other => {
                    errors.push(syn::Error::new_spanned(
                        other,
                        "name the runner with a plain binding: `calls: &Calls`",
                    ));
                    None
                }
            },
            _ => None,
        },
    };
    let context = signature::context(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    let tx = signature::transaction(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    if let Some((_, span)) = args.commit {
        errors.push(syn::Error::new(
            span,
            "a function's commit path is set on its runner (`Calls::commit_path`), not in the attribute",
        ));
    }
    let (skipped, skip_errors) = signature::skipped(&func);
    errors.extend(skip_errors);
    errors.extend(ungated(&func, tx, context));
    errors.extend(unbound("key_from", args.key_from.as_ref(), &func));
    errors.extend(unbound("scope", args.scope.as_ref(), &func));
    let output = signature::result_types(&func.sig.output);
    if output.is_none() {
        errors.push(syn::Error::new_spanned(
            &func.sig.output,
            "an idempotent function returns `Result<T, E>` (T: Serialize + DeserializeOwned): its `Ok` is stored, its `Err` releases the key",
        ));
    }
    if args.key_from.is_none() {
        errors.push(syn::Error::new(
            Span::call_site(),
            "function mode needs `key_from = \"param\"` or `\"param.field\"`: where the key (a message id) comes from",
        ));
    }
    if args.name.is_none() && !args.name_refused {
        // Suggest the function's own name when it is a valid one (a fair first choice); the
        // error says why the name must then stay put even if the function does not.
        let ident = func.sig.ident.to_string();
        let ident = ident.strip_prefix("r#").unwrap_or(&ident);
        let suggestion =
            crate::args::function_name(ident).unwrap_or_else(|_| "book_payment".into());
        errors.push(syn::Error::new(
            Span::call_site(),
            format!(
                "function mode needs a stable `name = \"{suggestion}\"`: the name, not the module path, identifies the function's records and derived keys, so renaming or moving `{}` keeps them (a new `name` starts new ones)",
                func.sig.ident
            ),
        ));
    }
    // Every parameter is an input, except what the runtime provides (the runner, the
    // transaction, the context), the scope (it names the record, so it need not be
    // `Serialize`) and what the function marks `#[idempotent(skip)]`. The key's own parameter
    // stays: it was always fingerprinted, so records made before keep their fingerprints.
    let scope_binding = args
        .scope
        .as_ref()
        .filter(|(path, _)| path.fields.is_empty())
        .map(|(path, _)| path.param.as_str());
    let runner_index = signature::runner(&func);
    let inputs = func
        .sig
        .inputs
        .iter()
        .enumerate()
        .filter(|(i, _)| ![runner_index, tx, context].contains(&Some(*i)) && !skipped.contains(i))
        .filter_map(|(_, arg)| match arg {
            FnArg::Typed(t) => Some(t),
            FnArg::Receiver(_) => None,
        })
        .flat_map(|t| {
            let cfgs: Vec<syn::Attribute> = t
                .attrs
                .iter()
                .filter(|a| a.path().is_ident("cfg"))
                .cloned()
                .collect();
            signature::pattern_bindings(&t.pat)
                .into_iter()
                .filter(|ident| Some(ident.to_string().as_str()) != scope_binding)
                .map(move |ident| Input {
                    ident,
                    cfgs: cfgs.clone(),
                })
        })
        .collect();
    match (errors.is_empty(), runner, output, args.key_from, args.name) {
        (true, Some(runner), Some((ok, err)), Some(key_from), Some((name, name_span))) => {
            Ok(FunctionPlan {
                func: signature::strip_ours(func),
                root,
                name: syn::LitStr::new(&name, name_span),
                key_from,
                scope: args.scope,
                ttl_ms: args.ttl.map(|t| t.0),
                lease_ms: args.lease.map(|l| l.0),
                wait_ms: args.wait.map(|w| w.0),
                store_errors: args.store_errors.is_some(),
                runner,
                context,
                transaction: tx,
                inputs,
                ok,
                err,
            })
        }
        _ => Err(errors),
    }
}

/// The most arguments an axum handler takes (axum implements `Handler` for up to 16).
const AXUM_MAX_ARGUMENTS: usize = 16;

/// The transaction and the context are no parameters the caller or a framework passes: the
/// attribute takes them out and makes them, so it must know they are there. A `#[cfg]` on one
/// is refused (lint levels and other attributes are kept, on the binding the runtime makes).
fn ungated(func: &ItemFn, tx: Option<usize>, context: Option<usize>) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    for (index, what) in [(tx, "`Transaction`"), (context, "`Idempotent` context")] {
        let Some(FnArg::Typed(t)) = index.and_then(|i| func.sig.inputs.iter().nth(i)) else {
            continue;
        };
        for cfg in t.attrs.iter().filter(|a| a.path().is_ident("cfg")) {
            errors.push(syn::Error::new_spanned(
                cfg,
                format!(
                    "the {what} parameter cannot be gated by `#[cfg]`: `#[idempotent]` provides it, so it must exist in every configuration; gate the whole function instead"
                ),
            ));
        }
    }
    errors
}

/// The one scope check, for `scope` and `key_from`: the path's first segment must be a name
/// the function's parameter patterns bind; otherwise an error at the argument's literal that
/// lists the names they do bind.
fn unbound(what: &str, path: Option<&(ScopePath, Span)>, func: &ItemFn) -> Option<syn::Error> {
    let (path, span) = path?;
    let bound = signature::bindings(func);
    if bound.iter().any(|(n, _)| *n == path.param) {
        return None;
    }
    let list = if bound.is_empty() {
        "it binds none".to_owned()
    } else {
        let names: Vec<String> = bound.iter().map(|(n, _)| format!("`{n}`")).collect();
        format!("parameters: {}", names.join(", "))
    };
    Some(syn::Error::new(
        *span,
        format!(
            "{what} `{}` names no parameter of `{}`; {list}",
            path.param, func.sig.ident
        ),
    ))
}

/// The item's keyword and name, where "not a function" points (rather than its whole body).
fn item_head(item: &syn::Item) -> TokenStream {
    let tokens = quote!(#item);
    tokens.into_iter().take(3).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: TokenStream, item: TokenStream, entry: Entry) -> Result<Plan, Vec<String>> {
        let (args, errors) = crate::args::parse(args);
        validate(args, errors, &item, entry)
            .map_err(|e| e.iter().map(ToString::to_string).collect())
    }

    #[test]
    fn the_mode_and_the_plan() {
        let handler = plan(
            quote!(scope = "a", commit = "two", wait = "5s", key = "optional"),
            quote!(
                async fn h(a: A, tx: Transaction<Postgres>) {}
            ),
            Entry::Actix,
        );
        let Ok(Plan::Handler(h)) = handler else {
            panic!("a handler plan")
        };
        assert_eq!(h.framework, Framework::Actix);
        assert_eq!(h.root.to_string(), ":: idempotent_actix");
        assert_eq!(h.key, KeyReq::Optional);
        let tx = h.transaction.expect("transactional");
        assert_eq!(
            (tx.param, tx.commit, h.wait_ms),
            (1, Some(Commit::Two), Some(5_000))
        );
        // `key_from` on an adapter's attribute: function mode, through that adapter.
        let function = plan(
            quote!(name = "n", key_from = "m.id", unscoped, crate = "my_axum"),
            quote!(
                async fn f(c: &Calls, m: &M) -> Result<u8, E> {
                    Ok(1)
                }
            ),
            Entry::Axum,
        );
        let Ok(Plan::Function(f)) = function else {
            panic!("a function plan")
        };
        assert_eq!(f.root.to_string(), "my_axum");
        assert_eq!(
            (f.name.value(), f.runner.to_string()),
            ("n".into(), "c".into())
        );
        // Core's attribute makes functions only.
        let core = plan(
            quote!(unscoped),
            quote!(
                async fn f() {}
            ),
            Entry::Core,
        )
        .err();
        assert!(core.is_some_and(|e| {
            e.iter()
                .any(|m| m.starts_with("function mode needs `key_from"))
        }),);
    }

    #[test]
    fn a_runner_without_a_plain_binding_is_one_more_error() {
        let errors = plan(
            quote!(name = "n", key_from = "m", unscoped, key = "optional"),
            quote!(
                async fn f(_: &Calls, m: u64) -> Result<u8, E> {
                    Ok(1)
                }
            ),
            Entry::Core,
        )
        .err()
        .unwrap_or_default();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].starts_with("`key` applies to HTTP handlers"));
        assert_eq!(
            errors[1],
            "name the runner with a plain binding: `calls: &Calls`"
        );
    }
}
