//! Function mode: `#[idempotent(name = "book", key_from = "msg.id", scope = "msg.tenant")]` on
//! any async function returning `Result<T, E>`. The function runs under the `&Calls` its
//! callers pass, at most once per (scope, key); its output is stored and returned again on
//! redelivery. Its records belong to the required `name`, never to its module path.

use crate::args::{Args, ScopePath};
use crate::signature;
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::{FnArg, ItemFn, ReturnType, Type};

/// Expands function mode; `default_crate` is the crate whose `__private::call` the code names
/// (`::idempotent_core`, or the adapter whose attribute was written).
pub(crate) fn expand(
    parsed: Args,
    mut errors: Vec<syn::Error>,
    item: TokenStream,
    default_crate: TokenStream,
) -> TokenStream {
    let func: ItemFn = match syn::parse2::<ItemFn>(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            errors.push(syn::Error::new(
                e.span(),
                "#[idempotent] applies to `async fn` items only",
            ));
            return with_errors(item, errors);
        }
    };
    errors.extend(signature::check(&func));
    for (name, span) in [
        ("key", parsed.key.as_ref().map(|k| k.1)),
        ("max_response", parsed.max_response.map(|m| m.1)),
        ("store_server_errors", parsed.store_server_errors),
    ] {
        if let Some(span) = span {
            errors.push(syn::Error::new(
                span,
                format!("`{name}` applies to HTTP handlers; a function's key comes from `key_from` (and `store_errors` stores errors that opt in)"),
            ));
        }
    }
    let runner = signature::runner(&func);
    if runner.is_none() {
        errors.push(syn::Error::new_spanned(
            &func.sig.ident,
            format!(
                "`{}` needs the runner it executes under: add a parameter `calls: &Calls` (`idempotent_core::call::Calls`); callers pass it",
                func.sig.ident
            ),
        ));
    }
    let idem = signature::context(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    let tx = signature::transaction(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    if let Some((_, span)) = parsed.commit {
        errors.push(syn::Error::new(
            span,
            "a function's commit path is set on its runner (`Calls::commit_path`), not in the attribute",
        ));
    }
    let bound = signature::bindings(&func);
    let names = || {
        if bound.is_empty() {
            "it binds none".to_owned()
        } else {
            let names: Vec<String> = bound.iter().map(|(n, _)| format!("`{n}`")).collect();
            format!("parameters: {}", names.join(", "))
        }
    };
    for (what, path) in [("key_from", &parsed.key_from), ("scope", &parsed.scope)] {
        if let Some((path, span)) = path
            && !bound.iter().any(|(n, _)| *n == path.param)
        {
            errors.push(syn::Error::new(
                *span,
                format!(
                    "{what} `{}` names no parameter of `{}`; {}",
                    path.param,
                    func.sig.ident,
                    names()
                ),
            ));
        }
    }
    let output = match result_types(&func.sig.output) {
        Some(types) => Some(types),
        None => {
            errors.push(syn::Error::new_spanned(
                &func.sig.output,
                "an idempotent function returns `Result<T, E>` (T: Serialize + DeserializeOwned): its `Ok` is stored, its `Err` releases the key",
            ));
            None
        }
    };
    if parsed.key_from.is_none() {
        errors.push(syn::Error::new(
            Span::call_site(),
            "function mode needs `key_from = \"param\"` or `\"param.field\"`: where the key (a message id) comes from",
        ));
    }
    if parsed.name.is_none() && !parsed.name_refused {
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
    match (errors.is_empty(), runner, output, &parsed.key_from) {
        (true, Some(runner), Some((ok, err)), Some(key_from)) => generate(
            &parsed,
            func,
            &default_crate,
            runner,
            idem,
            tx,
            (ok, err),
            key_from,
        ),
        _ => with_errors(item, errors),
    }
}

fn with_errors(item: TokenStream, errors: Vec<syn::Error>) -> TokenStream {
    let errors = errors.into_iter().map(|e| e.to_compile_error());
    quote!(#item #(#errors)*)
}

/// `T` and `E` of a declared `-> Result<T, E>` (any path ending in `Result` with two types).
fn result_types(output: &ReturnType) -> Option<(Type, Type)> {
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

/// `param.field.0` as an expression, spanned at the argument.
fn path_expr(path: &ScopePath, span: Span) -> TokenStream {
    let param = format_ident!("{}", path.param, span = span);
    let fields = path.fields.iter().map(|f| match f.parse::<u32>() {
        Ok(i) => {
            let i = syn::Index { index: i, span };
            quote_spanned!(span=> .#i)
        }
        Err(_) => {
            let f = format_ident!("{}", f, span = span);
            quote_spanned!(span=> .#f)
        }
    });
    quote_spanned!(span=> #param #(#fields)*)
}

#[allow(clippy::too_many_arguments)]
fn generate(
    a: &Args,
    func: ItemFn,
    default_crate: &TokenStream,
    runner: usize,
    idem: Option<usize>,
    tx: Option<usize>,
    (ok, err): (Type, Type),
    key_from: &(ScopePath, Span),
) -> TokenStream {
    let krate = a
        .krate
        .as_ref()
        .map_or_else(|| default_crate.clone(), |(p, _)| quote!(#p));
    let p = quote!(#krate::__private::call);
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = func;
    let (inner, outer): (Vec<_>, Vec<_>) = attrs
        .into_iter()
        .partition(|attr| matches!(attr.style, syn::AttrStyle::Inner(_)));
    // The records' identity: the stable `name` written in the attribute (checked at parse
    // time), never the module path, so a function can move or be renamed between a delivery
    // and its redelivery.
    let Some((name, name_span)) = &a.name else {
        return quote!();
    };
    let name = syn::LitStr::new(name, *name_span);
    let statik = format_ident!("__IDEMPOTENT_FUNCTION", span = Span::mixed_site());
    let call = format_ident!("__idempotent_call", span = Span::mixed_site());
    let ctx = format_ident!("__idempotent_context", span = Span::mixed_site());
    let made = format_ident!("__idempotent_made", span = Span::mixed_site());
    let refused = format_ident!("__idempotent_refused", span = Span::mixed_site());
    let opt_ms = |v: Option<(u64, Span)>| match v {
        Some((ms, _)) => quote!(::core::option::Option::Some(#p::Duration::from_millis(#ms))),
        None => quote!(::core::option::Option::None),
    };
    let (ttl, lease, wait) = (opt_ms(a.ttl), opt_ms(a.lease), opt_ms(a.wait));
    let typed = |i: Option<usize>| match i.and_then(|i| sig.inputs.iter().nth(i)) {
        Some(FnArg::Typed(t)) => Some(t.clone()),
        _ => None,
    };
    let Some(runner_param) = typed(Some(runner)) else {
        return quote!();
    };
    let runner_pat = &runner_param.pat;
    // The runner is named by its pattern, which must be a plain binding (`calls: &Calls`).
    let runner_name = match &*runner_pat.clone() {
        syn::Pat::Ident(i) => i.ident.clone(),
        other => {
            return syn::Error::new_spanned(
                other,
                "name the runner with a plain binding: `calls: &Calls`",
            )
            .to_compile_error();
        }
    };
    let idem_param = typed(idem);
    let tx_param = typed(tx);
    let mut new_sig = sig.clone();
    new_sig.inputs = sig
        .inputs
        .iter()
        .enumerate()
        .filter_map(|(j, arg)| (Some(j) != idem && Some(j) != tx).then_some(arg.clone()))
        .collect();
    new_sig.output = syn::parse_quote!(-> ::core::result::Result<#ok, #p::CallError<#err>>);
    let (kpath, kspan) = key_from;
    let key_expr = path_expr(kpath, *kspan);
    let fp_root = format_ident!("{}", kpath.param, span = *kspan);
    let scope_expr = match &a.scope {
        Some((path, span)) => {
            let e = path_expr(path, *span);
            quote_spanned!(*span=> #p::scope_of(&#e))
        }
        None => quote!(#p::unscoped()),
    };
    let (make_ctx, bind_ctx) = match &idem_param {
        None => (quote!(), quote!()),
        Some(t) => (
            quote! {
                let #ctx = match #runner_name.context::<#err>(&#call) {
                    ::core::result::Result::Ok(#made) => #made,
                    ::core::result::Result::Err(#refused) => return ::core::result::Result::Err(#refused),
                };
            },
            crate::expand::bind_context(t, &ctx),
        ),
    };
    let stmts = &block.stmts;
    let body = quote! {
        async move {
            #bind_ctx
            let #made: ::core::result::Result<#ok, #err> = async move { #(#stmts)* }.await;
            #made
        }
    };
    let storing = a.store_errors.is_some();
    let run = match &tx_param {
        None => {
            let method = if storing {
                quote!(run_storing)
            } else {
                quote!(run)
            };
            quote!(#runner_name.#method(#call, move || #body).await)
        }
        Some(t) => {
            let method = if storing {
                quote!(run_tx_storing)
            } else {
                quote!(run_tx)
            };
            let (pat, ty) = (&t.pat, &t.ty);
            quote!(#runner_name.#method(#call, move |#pat: #ty| #body).await)
        }
    };
    quote! {
        #(#outer)*
        #vis #new_sig {
            #(#inner)*
            static #statik: #p::Function = #p::Function::new(#name, #ttl, #lease, #wait);
            let #call = match #statik.call::<_, _, #err>(#scope_expr, &#key_expr, &#fp_root) {
                ::core::result::Result::Ok(#made) => #made,
                ::core::result::Result::Err(#refused) => return ::core::result::Result::Err(#refused),
            };
            #make_ctx
            #run
        }
    }
}
