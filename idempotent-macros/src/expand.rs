//! Code generation: the handler becomes claim → execute → store → replay around its body.

use crate::args::{self, Args, KeyReq};
use crate::signature;
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::{ItemFn, ReturnType, Type};

/// Which adapter the generated code calls.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Framework {
    Axum,
    Actix,
}

impl Framework {
    fn default_crate(self) -> TokenStream {
        match self {
            Framework::Axum => quote!(::idempotent_axum),
            Framework::Actix => quote!(::idempotent_actix),
        }
    }
}

/// Function mode through the core's entry (`idempotent_core::idempotent`).
pub(crate) fn expand_function(args: TokenStream, item: TokenStream) -> TokenStream {
    let (parsed, arg_errors) = args::parse(args);
    crate::function::expand(parsed, arg_errors, item, quote!(::idempotent_core))
}

/// The whole attribute: on any error, the original item is emitted unchanged next to the
/// errors (tokio's `token_stream_with_error`), so the user sees our errors, not a cascade.
pub(crate) fn expand(args: TokenStream, item: TokenStream, fw: Framework) -> TokenStream {
    let (parsed, mut arg_errors) = args::parse(args);
    if parsed.key_from.is_some() {
        // `key_from`: an idempotent function, not a handler (the adapter re-exports the
        // core's function runtime under its own `__private`).
        return crate::function::expand(parsed, arg_errors, item, fw.default_crate());
    }
    if let Some(span) = parsed.store_errors {
        arg_errors.push(syn::Error::new(
            span,
            "`store_errors` applies to idempotent functions (`key_from = …`); a handler stores 5xx with `store_server_errors`",
        ));
    }
    if let Some((_, span)) = parsed.name {
        arg_errors.push(syn::Error::new(
            span,
            "`name` applies to idempotent functions (`key_from = …`); a handler's records are identified by its caller's scope and the `Idempotency-Key`, and its fingerprint holds the method and path, so it takes no name",
        ));
    }
    let func: ItemFn = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Fn(f)) => f,
        Ok(other) => {
            let e = syn::Error::new_spanned(
                item_head(&other),
                "#[idempotent] applies to `async fn` handlers only",
            );
            return with_errors(item, vec![e]);
        }
        Err(e) => return with_errors(item, vec![e]),
    };
    let mut errors = signature::check(&func);
    errors.append(&mut arg_errors);
    let tx = signature::transaction(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    let idem = signature::context(&func).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    if tx.is_none() {
        for (name, span) in [
            ("commit", parsed.commit.map(|c| c.1)),
            ("wait", parsed.wait.map(|w| w.1)),
        ] {
            if let Some(span) = span {
                errors.push(syn::Error::new(
                    span,
                    format!("`{name}` applies to transactional handlers: add a `tx: Transaction<DB>` parameter (DB = `Postgres` or `Sqlite`, the store's database)"),
                ));
            }
        }
    }
    if let Some((path, span)) = &parsed.scope {
        let bound = signature::bindings(&func);
        if !bound.iter().any(|(n, _)| *n == path.param) {
            let list = if bound.is_empty() {
                "it binds none".to_owned()
            } else {
                let names: Vec<String> = bound.iter().map(|(n, _)| format!("`{n}`")).collect();
                format!("parameters: {}", names.join(", "))
            };
            errors.push(syn::Error::new(
                *span,
                format!(
                    "scope `{}` names no parameter of `{}`; {list}",
                    path.param, func.sig.ident
                ),
            ));
        }
    }
    if errors.is_empty() {
        generate(&parsed, func, fw, tx, idem)
    } else {
        with_errors(item, errors)
    }
}

fn item_head(item: &syn::Item) -> TokenStream {
    // Point at the item's keyword and name rather than its whole body.
    let tokens = quote!(#item);
    tokens.into_iter().take(3).collect()
}

fn with_errors(item: TokenStream, errors: Vec<syn::Error>) -> TokenStream {
    let errors = errors.into_iter().map(|e| e.to_compile_error());
    quote!(#item #(#errors)*)
}

fn generate(
    a: &Args,
    func: ItemFn,
    fw: Framework,
    tx: Option<usize>,
    idem: Option<usize>,
) -> TokenStream {
    let krate = a
        .krate
        .as_ref()
        .map_or_else(|| fw.default_crate(), |(p, _)| quote!(#p));
    let p = quote!(#krate::__private);
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = func;
    // Inner attributes (`#![allow(..)]` at the top of the body) stay at the top of the body.
    let (inner, outer): (Vec<_>, Vec<_>) = attrs
        .into_iter()
        .partition(|attr| matches!(attr.style, syn::AttrStyle::Inner(_)));
    let ctx = format_ident!("__idempotent_ctx", span = Span::mixed_site());
    let scope_var = format_ident!("__idempotent_scope", span = Span::mixed_site());
    let route = format_ident!("__IDEMPOTENT_ROUTE", span = Span::mixed_site());

    let scope_expr = match &a.scope {
        Some((path, span)) => {
            let param = format_ident!("{}", path.param, span = *span);
            let fields = path.fields.iter().map(|f| match f.parse::<u32>() {
                Ok(i) => {
                    let i = syn::Index {
                        index: i,
                        span: *span,
                    };
                    quote_spanned!(*span=> .#i)
                }
                Err(_) => {
                    let f = format_ident!("{}", f, span = *span);
                    quote_spanned!(*span=> .#f)
                }
            });
            quote_spanned!(*span=> #p::scope_of(&#param #(#fields)*))
        }
        None => quote!(#p::unscoped()),
    };
    let opt_ms = |v: Option<(u64, Span)>| match v {
        Some((ms, _)) => quote!(::core::option::Option::Some(#p::Duration::from_millis(#ms))),
        None => quote!(::core::option::Option::None),
    };
    let ttl = opt_ms(a.ttl);
    let lease = opt_ms(a.lease);
    let required = !matches!(a.key, Some((KeyReq::Optional, _)));
    let key = if required {
        quote!(#p::Key::Required)
    } else {
        quote!(#p::Key::Optional)
    };
    let store_5xx = a.store_server_errors.is_some();
    let max_response = match a.max_response {
        Some((n, _)) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            quote!(::core::option::Option::Some(#n))
        }
        None => quote!(::core::option::Option::None),
    };
    let name = sig.ident.to_string();

    // The fake return edge (tracing's): fixes the async block's output type to the declared
    // return type, so `?` and type errors land in user code. `impl Trait` cannot be written
    // in a `let`, so it becomes `_` there (`Result<impl IntoResponse, E>` still anchors `E`).
    // With `impl Trait`, a generic function whose parameters stand for each `impl` checks the
    // trait bounds as written, so they (and their imports) stay part of the handler.
    let anchor = match &sig.output {
        ReturnType::Type(_, ty) => {
            let fake = format_ident!("__idempotent_fake_return", span = Span::mixed_site());
            let inferred = map_impl_trait((**ty).clone(), &mut |t| {
                Type::Infer(syn::TypeInfer {
                    attrs: Vec::new(),
                    underscore_token: syn::Token![_](syn::spanned::Spanned::span(&t)),
                })
            });
            let mut params = Vec::new();
            let generic = map_impl_trait((**ty).clone(), &mut |t| {
                let name = format_ident!(
                    "__IdempotentImpl{}",
                    params.len(),
                    span = Span::mixed_site()
                );
                let bounds = t.bounds.iter().filter(|b| {
                    matches!(
                        b,
                        syn::TypeParamBound::Trait(_) | syn::TypeParamBound::Lifetime(_)
                    )
                });
                params.push(quote!(#name: #(#bounds)+*));
                syn::parse_quote!(#name)
            });
            let bounds_check = if params.is_empty() {
                quote!()
            } else {
                // The handler's own generics too: the return type may name them.
                let outer = sig.generics.params.iter();
                let where_clause = &sig.generics.where_clause;
                let check = format_ident!("__idempotent_bounds", span = Span::mixed_site());
                quote! {
                    fn #check<#(#outer,)* #(#params),*>(_: &#generic) #where_clause {}
                    #check(&#fake);
                }
            };
            quote! {
                #[allow(unreachable_code, clippy::diverging_sub_expression, clippy::let_unit_value)]
                if false {
                    let #fake: #inferred = loop {};
                    #bounds_check
                    return #fake;
                }
            }
        }
        ReturnType::Default => quote!(),
    };

    let mut new_sig = sig;
    new_sig.output = syn::parse_quote!(-> #p::Output);
    // Transactional mode: the transaction is no extractor; the runtime opens it (after the
    // claim) and passes it to the body, which becomes a closure over it. The `Idempotent`
    // context is no extractor either: it is made from the request's scope and key, which no
    // extractor sees, and bound at the top of the body.
    let typed = |i: Option<usize>| match i.and_then(|i| new_sig.inputs.iter().nth(i)) {
        Some(syn::FnArg::Typed(t)) => Some(t.clone()),
        _ => None,
    };
    let tx_param = typed(tx);
    let idem_param = typed(idem);
    new_sig.inputs = std::mem::take(&mut new_sig.inputs)
        .into_iter()
        .enumerate()
        .filter_map(|(j, arg)| (Some(j) != tx && Some(j) != idem).then_some(arg))
        .collect();
    let idem_var = format_ident!("__idempotent_context", span = Span::mixed_site());
    let made = format_ident!("__idempotent_made", span = Span::mixed_site());
    let refused = format_ident!("__idempotent_refused", span = Span::mixed_site());
    let (idem_make, idem_bind) = match &idem_param {
        None => (quote!(), quote!()),
        Some(t) => (
            quote! {
                let #idem_var = match #p::context(&#ctx, &#route, &#scope_var) {
                    ::core::result::Result::Ok(#made) => #made,
                    ::core::result::Result::Err(#refused) => return *#refused,
                };
            },
            bind_context(t, &idem_var),
        ),
    };
    // Axum: the hidden context is the first extractor (axum runs extractors one by one).
    // Actix polls a handler's extractors together, so there the context is the only one and
    // runs the handler's own extractors, as one tuple, after its checks.
    let split = match fw {
        Framework::Axum => {
            new_sig
                .inputs
                .insert(0, syn::parse_quote!(#ctx: #p::Context<#required>));
            quote!()
        }
        Framework::Actix => {
            let (pats, tys): (Vec<_>, Vec<_>) = new_sig
                .inputs
                .iter()
                .filter_map(|arg| match arg {
                    syn::FnArg::Typed(t) => Some((t.pat.clone(), t.ty.clone())),
                    syn::FnArg::Receiver(_) => None,
                })
                .unzip();
            new_sig.inputs = syn::parse_quote!(#ctx: #p::Context<#required, (#(#tys,)*)>);
            quote!(let (#ctx, (#(#pats,)*)) = #ctx.split();)
        }
    };
    let stmts = &block.stmts;
    let body = quote! {
        async move {
            #anchor
            #idem_bind
            #(#stmts)*
        }
    };
    let (route_new, call) = match &tx_param {
        None => (
            quote!(#p::Route::new(#name, #ttl, #lease, #key, #store_5xx, #max_response)),
            quote!(#p::run(#ctx, &#route, #scope_var, #body)),
        ),
        Some(t) => {
            let commit = match a.commit {
                Some((true, _)) => quote!(::core::option::Option::Some(#p::Commit::Two)),
                Some((false, _)) => quote!(::core::option::Option::Some(#p::Commit::Single)),
                None => quote!(::core::option::Option::None),
            };
            let wait = opt_ms(a.wait);
            let (pat, ty) = (&t.pat, &t.ty);
            (
                quote!(#p::Route::new(#name, #ttl, #lease, #key, #store_5xx, #max_response)
                    .transactional(#commit, #wait)),
                quote!(#p::run_tx(#ctx, &#route, #scope_var, move |#pat: #ty| #body)),
            )
        }
    };

    quote! {
        #(#outer)*
        #vis #new_sig {
            #(#inner)*
            static #route: #p::Route = #route_new;
            #split
            let #scope_var = #scope_expr;
            #idem_make
            #call.await
        }
    }
}

/// `let idem: Idempotent = var;` (or `&var` for `idem: &Idempotent`): binds the made context
/// to the handler's or function's own parameter, at the top of its body.
pub(crate) fn bind_context(param: &syn::PatType, var: &syn::Ident) -> TokenStream {
    let (pat, ty) = (&param.pat, &param.ty);
    let value = if matches!(&**ty, Type::Reference(_)) {
        quote!(&#var)
    } else {
        quote!(#var)
    };
    quote!(let #pat: #ty = #value;)
}

/// Replaces every `impl Trait` in a type with what `f` makes of it (`_` to annotate a `let`,
/// a generic parameter to check the bounds).
fn map_impl_trait(ty: Type, f: &mut impl FnMut(syn::TypeImplTrait) -> Type) -> Type {
    match ty {
        Type::ImplTrait(t) => f(t),
        Type::Path(mut t) => {
            for seg in &mut t.path.segments {
                if let syn::PathArguments::AngleBracketed(args) = &mut seg.arguments {
                    for arg in &mut args.args {
                        if let syn::GenericArgument::Type(inner) = arg {
                            *inner = map_impl_trait(inner.clone(), f);
                        }
                    }
                }
            }
            Type::Path(t)
        }
        Type::Tuple(mut t) => {
            for elem in &mut t.elems {
                *elem = map_impl_trait(elem.clone(), f);
            }
            Type::Tuple(t)
        }
        Type::Reference(mut t) => {
            *t.elem = map_impl_trait((*t.elem).clone(), f);
            Type::Reference(t)
        }
        Type::Array(mut t) => {
            *t.elem = map_impl_trait((*t.elem).clone(), f);
            Type::Array(t)
        }
        Type::Slice(mut t) => {
            *t.elem = map_impl_trait((*t.elem).clone(), f);
            Type::Slice(t)
        }
        Type::Paren(mut t) => {
            *t.elem = map_impl_trait((*t.elem).clone(), f);
            Type::Paren(t)
        }
        Type::Group(mut t) => {
            *t.elem = map_impl_trait((*t.elem).clone(), f);
            Type::Group(t)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(args: TokenStream, item: TokenStream) -> String {
        expand(args, item, Framework::Axum).to_string()
    }

    #[test]
    fn scope_must_name_a_binding() {
        let out = expand_str(
            quote!(scope = "acount_id"),
            quote!(
                async fn create_charge(
                    db: Db,
                    AccountId(account_id): AccountId,
                    Json(req): Json<R>,
                ) {
                }
            ),
        );
        assert!(out.contains("scope `acount_id` names no parameter of `create_charge`; parameters: `db`, `account_id`, `req`"), "{out}");
        // The original function is still emitted.
        assert!(out.contains("async fn create_charge"));
    }

    #[test]
    fn generates_through_private_paths_only() {
        let out = expand_str(
            quote!(scope = "account_id", ttl = "1h"),
            quote!(
                pub async fn h(Path(account_id): Path<String>) -> Result<String, E> {
                    Ok(account_id)
                }
            ),
        );
        assert!(
            out.contains(":: idempotent_axum :: __private :: scope_of (& account_id)"),
            "{out}"
        );
        assert!(out.contains("from_millis (3600000u64)"), "{out}");
        assert!(
            out.contains("let __idempotent_fake_return : Result < String , E >"),
            "{out}"
        );
        assert!(
            out.contains(
                "pub async fn h (__idempotent_ctx : :: idempotent_axum :: __private :: Context < true >"
            ),
            "{out}"
        );
        assert!(
            out.contains(":: idempotent_axum :: __private :: Route :: new (\"h\" ,"),
            "{out}"
        );
        let custom = expand_str(
            quote!(unscoped, crate = "my_axum"),
            quote!(
                async fn h() {}
            ),
        );
        assert!(
            custom.contains("my_axum :: __private :: unscoped ()"),
            "{custom}"
        );
        // Actix: the context is the only extractor and carries the parameters as one tuple.
        let actix = expand(
            quote!(scope = "account"),
            quote!(
                async fn h(Account(account): Account, mut body: web::Bytes) -> HttpResponse {
                    body
                }
            ),
            Framework::Actix,
        )
        .to_string();
        assert!(
            actix.contains("async fn h (__idempotent_ctx : :: idempotent_actix :: __private :: Context < true , (Account , web :: Bytes ,) >)"),
            "{actix}"
        );
        assert!(
            actix.contains("let (__idempotent_ctx , (Account (account) , mut body ,)) = __idempotent_ctx . split () ;"),
            "{actix}"
        );
    }

    #[test]
    fn impl_trait_in_the_return_type_anchors_what_it_can() {
        let out = expand_str(
            quote!(unscoped, key = "optional"),
            quote!(
                async fn h() -> Result<impl IntoResponse, MyError> {
                    #![allow(unused_variables)]
                    Ok(())
                }
            ),
        );
        assert!(
            out.contains("let __idempotent_fake_return : Result < _ , MyError >"),
            "{out}"
        );
        assert!(
            out.contains("fn __idempotent_bounds < __IdempotentImpl0 : IntoResponse > (_ : & Result < __IdempotentImpl0 , MyError >)"),
            "{out}"
        );
        assert!(out.contains("Context < false >"), "{out}");
        // The inner attribute is the body's first item, not an outer attribute of the fn.
        let body = out
            .split_once("-> :: idempotent_axum :: __private :: Output {")
            .map(|x| x.1);
        assert!(
            body.is_some_and(|b| b.trim_start().starts_with("# ! [allow (unused_variables)]")),
            "{out}"
        );
        let plain = expand_str(
            quote!(unscoped),
            quote!(
                async fn h() -> impl IntoResponse {}
            ),
        );
        assert!(
            plain.contains("let __idempotent_fake_return : _ = loop { } ;"),
            "{plain}"
        );
        assert!(
            plain.contains("__IdempotentImpl0 : IntoResponse"),
            "{plain}"
        );
    }

    #[test]
    fn function_mode_is_identified_by_its_name() {
        let item = quote!(
            async fn book(calls: &Calls, msg: &Msg) -> Result<u8, E> {
                Ok(1)
            }
        );
        let out = expand_function(
            quote!(name = "billing.book", key_from = "msg.id", unscoped),
            item.clone(),
        )
        .to_string();
        assert!(out.contains("Function :: new (\"billing.book\" ,"), "{out}");
        assert!(!out.contains("module_path"), "{out}");
        let unnamed =
            expand_function(quote!(key_from = "msg.id", unscoped), item.clone()).to_string();
        assert!(
            unnamed.contains("function mode needs a stable `name = \\\"book\\\"`"),
            "{unnamed}"
        );
        assert!(unnamed.contains("async fn book"), "{unnamed}");
        // An invalid name is one error, not also a missing one.
        let invalid = expand_function(
            quote!(name = "a:b", key_from = "msg.id", unscoped),
            item.clone(),
        )
        .to_string();
        assert!(invalid.contains("holds `:`"), "{invalid}");
        assert!(!invalid.contains("needs a stable"), "{invalid}");
        // On a handler, `name` is refused.
        let handler = expand_str(
            quote!(unscoped, name = "book"),
            quote!(
                async fn h() {}
            ),
        );
        assert!(
            handler.contains("`name` applies to idempotent functions"),
            "{handler}"
        );
    }

    #[test]
    fn not_a_function() {
        let out = expand_str(
            quote!(unscoped),
            quote!(
                struct S;
            ),
        );
        assert!(out.contains("applies to `async fn` handlers only"));
        assert!(out.contains("struct S"));
    }
}
