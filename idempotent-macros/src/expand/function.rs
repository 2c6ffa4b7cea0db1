//! Function mode: `#[idempotent(name = "book", key_from = "msg.id", scope = "msg.tenant")]` on
//! any async function returning `Result<T, E>`. The function runs under the `&Calls` its
//! callers pass, at most once per (scope, key); its output is stored and returned again on
//! redelivery. Its records belong to the required `name`, never to its module path.

use super::{bind_context, hidden, opt_ms, path_expr, scope_expr, split_attrs, take_params};
use crate::validate::{FunctionPlan, Input};
use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::ItemFn;

pub(super) fn generate(plan: FunctionPlan) -> TokenStream {
    let FunctionPlan {
        func,
        root,
        name,
        key_from: (kpath, kspan),
        scope,
        ttl_ms,
        lease_ms,
        wait_ms,
        store_errors,
        runner,
        context,
        transaction,
        inputs,
        ok,
        err,
    } = plan;
    let p = quote!(#root::__private::call);
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = func;
    let (inner, outer) = split_attrs(attrs);
    let statik = hidden("__IDEMPOTENT_FUNCTION");
    let call = hidden("__idempotent_call");
    let ctx = hidden("__idempotent_context");
    let made = hidden("__idempotent_made");
    let refused = hidden("__idempotent_refused");
    let (ttl, lease, wait) = (
        opt_ms(&p, ttl_ms),
        opt_ms(&p, lease_ms),
        opt_ms(&p, wait_ms),
    );
    let mut new_sig = sig;
    let (tx_param, idem_param) = take_params(&mut new_sig, transaction, context);
    new_sig.output = syn::parse_quote!(-> ::core::result::Result<#ok, #p::CallError<#err>>);
    let key_expr = path_expr(&kpath, kspan);
    // Each input checked against `Input` at its own binding, so a parameter that is not
    // `Serialize` is reported there; one gated by `#[cfg]` is there only where it exists.
    let inputs = inputs
        .iter()
        .map(|Input { ident, cfgs }| quote_spanned!(ident.span()=> #(#cfgs)* #p::input(&#ident)));
    let scope_expr = scope_expr(&p, scope.as_ref());
    let (make_ctx, bind_ctx) = match &idem_param {
        None => (quote!(), quote!()),
        Some(t) => (
            quote! {
                let #ctx = match #runner.context::<#err>(&#call) {
                    ::core::result::Result::Ok(#made) => #made,
                    ::core::result::Result::Err(#refused) => return ::core::result::Result::Err(#refused),
                };
            },
            bind_context(t, &ctx),
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
    let run = match &tx_param {
        None => {
            let method = if store_errors {
                quote!(run_storing)
            } else {
                quote!(run)
            };
            quote!(#runner.#method(#call, move || #body).await)
        }
        Some(t) => {
            let method = if store_errors {
                quote!(run_tx_storing)
            } else {
                quote!(run_tx)
            };
            let (attrs, pat, ty) = (&t.attrs, &t.pat, &t.ty);
            quote!(#runner.#method(#call, move |#(#attrs)* #pat: #ty| #body).await)
        }
    };
    quote! {
        #(#outer)*
        #vis #new_sig {
            #(#inner)*
            static #statik: #p::Function = #p::Function::new(#p::FunctionArgs {
                name: #name,
                ttl: #ttl,
                lease: #lease,
                wait: #wait,
            });
            let #call = match #statik.call::<_, #err>(#scope_expr, &#key_expr, &[#(#inputs),*]) {
                ::core::result::Result::Ok(#made) => #made,
                ::core::result::Result::Err(#refused) => return ::core::result::Result::Err(#refused),
            };
            #make_ctx
            #run
        }
    }
}
