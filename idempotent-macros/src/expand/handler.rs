//! A handler: the hidden `Context` extractor, the route's settings in a `static`, the scope,
//! then `run` (or `run_tx`) around the body kept as tokens inside `async move { }`, which
//! `run` gets inside a closure (`move || async move { }`) and `run_tx` inside the closure that
//! takes the transaction, so the handler's future is built only when the handler runs.

use super::{bind_context, hidden, opt_ms, scope_expr, split_attrs, take_params};
use crate::args::{Commit, KeyReq};
use crate::validate::{Framework, HandlerPlan, MAX_GATED_ACTIX_PARAMETERS, Transactional};
use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, format_ident, quote};
use syn::{ItemFn, ReturnType, Type};

pub(super) fn generate(plan: HandlerPlan) -> TokenStream {
    let HandlerPlan {
        func,
        framework,
        root,
        scope,
        ttl_ms,
        lease_ms,
        wait_ms,
        key,
        store_server_errors,
        max_response,
        extract_on_replay,
        transaction,
        context,
    } = plan;
    let p = quote!(#root::__private);
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = func;
    let (inner, mut outer) = split_attrs(attrs);
    let ctx = hidden("__idempotent_ctx");
    let scope_var = hidden("__idempotent_scope");
    let route = hidden("__IDEMPOTENT_ROUTE");

    // The scope through core's function mode runtime, which the adapter re-exports: one
    // `scope_of` for handlers and functions alike.
    let scope_expr = scope_expr(&quote!(#p::call), scope.as_ref());
    let ttl = opt_ms(&p, ttl_ms);
    let lease = opt_ms(&p, lease_ms);
    let required = key == KeyReq::Required;
    let key = if required {
        quote!(#p::Key::Required)
    } else {
        quote!(#p::Key::Optional)
    };
    let max_response = match max_response {
        Some(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            quote!(::core::option::Option::Some(#n))
        }
        None => quote!(::core::option::Option::None),
    };
    let name = sig.ident.to_string();
    let anchor = anchor(&sig);

    // The handler's own argument count, before the context is added and the transaction and
    // `Idempotent` taken out.
    let written = sig.inputs.len();
    let mut new_sig = sig;
    new_sig.output = syn::parse_quote!(-> #p::Output);
    // Transactional mode: the transaction is no extractor; the runtime opens it (after the
    // claim) and passes it to the body, which becomes a closure over it. The `Idempotent`
    // context is no extractor either: it is made from the request's scope and key, which no
    // extractor sees, and bound at the top of the body.
    let (tx_param, idem_param) =
        take_params(&mut new_sig, transaction.as_ref().map(|t| t.param), context);
    // The last extractor of a plain route, deferred past the replay cache's look (see
    // `deferred_param`); `None` on transactional routes.
    let later_var = hidden("__idempotent_later");
    let deferred = if transaction.is_none() && !extract_on_replay {
        deferred_param(
            &new_sig,
            framework,
            scope.as_ref().map(|(path, _)| path.param.as_str()),
        )
    } else {
        None
    };
    let idem_var = hidden("__idempotent_context");
    let made = hidden("__idempotent_made");
    let refused = hidden("__idempotent_refused");
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
    // runs the handler's own extractors, as one tuple, after its checks. Each variant is one
    // copy of the function: its `#[cfg]` (none on Axum), signature and the statements that
    // bind the extracted parameters.
    let variants: Vec<(TokenStream, syn::Signature, TokenStream)> = match framework {
        Framework::Axum => {
            new_sig
                .inputs
                .insert(0, syn::parse_quote!(#ctx: #p::Context<#required>));
            // The context is one argument more than the handler was written with: clippy's
            // limit (7) is for the signature the user wrote, so the one argument we add must
            // not be what crosses it.
            // Not where the user set the lint's level themselves (an `expect` that our
            // `allow` would leave unfulfilled, a `forbid` it may not override).
            let theirs = outer.iter().any(|attr| {
                attr.to_token_stream()
                    .to_string()
                    .contains("too_many_arguments")
            });
            if new_sig.inputs.len() > CLIPPY_MAX_ARGUMENTS
                && written <= CLIPPY_MAX_ARGUMENTS
                && !theirs
            {
                outer.push(syn::parse_quote!(#[allow(clippy::too_many_arguments)]));
            }
            if let Some(deferred) = &deferred
                && let Some(syn::FnArg::Typed(last)) = new_sig.inputs.last_mut()
            {
                let ty = &deferred.ty;
                *last.pat = syn::parse_quote!(#later_var);
                *last.ty = syn::parse_quote!(#p::Later<#ty>);
            }
            vec![(quote!(), new_sig, quote!())]
        }
        Framework::Actix => actix_variants(
            &new_sig,
            &p,
            &ctx,
            required,
            deferred.is_some().then_some(&later_var),
        ),
    };
    let stmts = &block.stmts;
    let body = quote! {
        async move {
            #anchor
            #idem_bind
            #(#stmts)*
        }
    };
    let route_new = quote!(#p::Route::new(#p::RouteArgs {
        name: #name,
        ttl: #ttl,
        lease: #lease,
        key: #key,
        store_server_errors: #store_server_errors,
        max_response: #max_response,
    }));
    let (route_new, call) = match (&transaction, &tx_param) {
        (Some(Transactional { commit, .. }), Some(t)) => {
            let commit = match commit {
                Some(Commit::Two) => quote!(::core::option::Option::Some(#p::Commit::Two)),
                Some(Commit::Single) => {
                    quote!(::core::option::Option::Some(#p::Commit::Single))
                }
                None => quote!(::core::option::Option::None),
            };
            let wait = opt_ms(&p, wait_ms);
            let (attrs, pat, ty) = (&t.attrs, &t.pat, &t.ty);
            (
                quote!(#route_new.transactional(#commit, #wait)),
                quote!(#p::run_tx(#ctx, &#route, #scope_var, move |#(#attrs)* #pat: #ty| #body)),
            )
        }
        // A closure that makes the future from the deferred extractor's value: a replay never
        // builds (or moves) it, nor runs that extractor.
        _ => (
            match wait_ms {
                Some(_) => {
                    let wait = opt_ms(&p, wait_ms);
                    quote!(#route_new.wait(#wait))
                }
                None => route_new,
            },
            match &deferred {
                Some(t) => {
                    let (pat, ty) = (&t.pat, &t.ty);
                    quote!(#p::run(#ctx, &#route, #scope_var, #later_var, move |#pat: #ty| #body))
                }
                None => {
                    quote!(#p::run(#ctx, &#route, #scope_var, #p::Later::none(), move |()| #body))
                }
            },
        ),
    };

    let copies = variants.into_iter().map(|(cfg, new_sig, split)| {
        quote! {
            #cfg
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
    });
    quote!(#(#copies)*)
}

/// Actix: the handler takes one extractor, the hidden context, which extracts the handler's
/// own parameters as one tuple; each parameter is then bound by a `let` of its own that
/// carries its attributes (lint levels, `cfg_attr`). A tuple type has no place for a
/// parameter's `#[cfg]`, so the function is written once per combination of the gated
/// parameters, each copy under the `#[cfg]` that selects it.
fn actix_variants(
    sig: &syn::Signature,
    p: &TokenStream,
    ctx: &syn::Ident,
    required: bool,
    later: Option<&syn::Ident>,
) -> Vec<(TokenStream, syn::Signature, TokenStream)> {
    let params = typed_params(sig);
    // Each gated parameter's condition: all of its `#[cfg]`s.
    let conditions: Vec<Option<TokenStream>> = params
        .iter()
        .map(|t| {
            let cfgs: Vec<TokenStream> = t
                .attrs
                .iter()
                .filter_map(|a| match &a.meta {
                    syn::Meta::List(list) if list.path.is_ident("cfg") => Some(list.tokens.clone()),
                    _ => None,
                })
                .collect();
            match cfgs.as_slice() {
                [] => None,
                [one] => Some(one.clone()),
                several => Some(quote!(all(#(#several),*))),
            }
        })
        .collect();
    let gated: Vec<usize> = (0..params.len())
        .filter(|&i| conditions[i].is_some())
        .collect();
    let args = hidden("__idempotent_args");
    // Validation refuses more gated parameters than this; the bound keeps the shift sound.
    let gated_count = gated.len().min(MAX_GATED_ACTIX_PARAMETERS);
    (0..1_usize << gated_count)
        .map(|combination| {
            let present = |i: usize| {
                gated
                    .iter()
                    .position(|&g| g == i)
                    .is_none_or(|bit| combination & (1 << bit) != 0)
            };
            let kept: Vec<&syn::PatType> = (0..params.len())
                .filter(|&i| present(i))
                .map(|i| params[i])
                .collect();
            // The deferred extractor (only where no parameter is gated: it is the last one).
            let last = kept.len().wrapping_sub(1);
            let deferred = |i: usize| later.filter(|_| i == last);
            let tys = kept.iter().enumerate().map(|(i, t)| {
                let ty = &t.ty;
                match deferred(i) {
                    Some(_) => quote!(#p::Later<#ty>),
                    None => quote!(#ty),
                }
            });
            let mut new_sig = sig.clone();
            new_sig.inputs = syn::parse_quote!(#ctx: #p::Context<#required, (#(#tys,)*)>);
            let binds = kept.iter().enumerate().map(|(i, t)| {
                let index = syn::Index::from(i);
                let attrs = t.attrs.iter().filter(|a| !a.path().is_ident("cfg"));
                match deferred(i) {
                    Some(later) => quote!(let #later = #args.#index;),
                    None => {
                        let pat = &t.pat;
                        quote!(#(#attrs)* let #pat = #args.#index;)
                    }
                }
            });
            let split = quote!(let (#ctx, #args) = #ctx.split(); #(#binds)*);
            let cfg = if gated.is_empty() {
                quote!()
            } else {
                let each: Vec<TokenStream> = gated
                    .iter()
                    .enumerate()
                    .map(|(bit, &i)| {
                        let condition = &conditions[i];
                        if combination & (1 << bit) != 0 {
                            quote!(#condition)
                        } else {
                            quote!(not(#condition))
                        }
                    })
                    .collect();
                match each.as_slice() {
                    [one] => quote!(#[cfg(#one)]),
                    all => quote!(#[cfg(all(#(#all),*))]),
                }
            };
            (cfg, new_sig, split)
        })
        .collect()
}

/// The parameter `run` extracts only after the replay cache missed: the handler's last one,
/// when it carries no attribute and does not bind the scope (the scope's extractor, which may
/// authenticate, always runs first). On Axum every such parameter is passed through
/// `Later`, which defers only body extractors (`FromRequest`) and runs a parts extractor (a
/// guard, a path) at once, so the type decides. Actix has no such split, so there only the
/// body extractors known by name are deferred (`Json`, `Form`, `Bytes`, `String`), and none
/// when a parameter is `#[cfg]`-gated; any other extractor runs in its place, as before.
fn deferred_param(
    sig: &syn::Signature,
    framework: Framework,
    scope: Option<&str>,
) -> Option<syn::PatType> {
    let params = typed_params(sig);
    let last = *params.last()?;
    if !last.attrs.is_empty()
        || crate::signature::pattern_bindings(&last.pat)
            .iter()
            .any(|ident| Some(ident.to_string().as_str()) == scope)
    {
        return None;
    }
    if framework == Framework::Actix {
        let gated = params
            .iter()
            .any(|t| t.attrs.iter().any(|a| a.path().is_ident("cfg")));
        let Type::Path(path) = &*last.ty else {
            return None;
        };
        let name = path.path.segments.last()?.ident.to_string();
        if gated || !["Json", "Form", "Bytes", "String"].contains(&name.as_str()) {
            return None;
        }
    }
    Some(last.clone())
}

/// The signature's parameters other than `self`.
fn typed_params(sig: &syn::Signature) -> Vec<&syn::PatType> {
    sig.inputs
        .iter()
        .filter_map(|arg| match arg {
            syn::FnArg::Typed(t) => Some(t),
            syn::FnArg::Receiver(_) => None,
        })
        .collect()
}

/// Clippy's default limit on a function's arguments (`too_many_arguments`).
const CLIPPY_MAX_ARGUMENTS: usize = 7;

/// The fake return edge (tracing's): fixes the async block's output type to the declared
/// return type, so `?` and type errors land in user code. `impl Trait` cannot be written in a
/// `let`, so it becomes `_` there (`Result<impl IntoResponse, E>` still anchors `E`). With
/// `impl Trait`, a generic function whose parameters stand for each `impl` checks the trait
/// bounds as written, so they (and their imports) stay part of the handler.
fn anchor(sig: &syn::Signature) -> TokenStream {
    let ReturnType::Type(_, ty) = &sig.output else {
        return quote!();
    };
    let fake = hidden("__idempotent_fake_return");
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
        let check = hidden("__idempotent_bounds");
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
