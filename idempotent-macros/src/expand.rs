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
}

impl Framework {
    fn default_crate(self) -> TokenStream {
        match self {
            Framework::Axum => quote!(::idempotent_axum),
        }
    }
}

/// The whole attribute: on any error, the original item is emitted unchanged next to the
/// errors (tokio's `token_stream_with_error`), so the user sees our errors, not a cascade.
pub(crate) fn expand(args: TokenStream, item: TokenStream, fw: Framework) -> TokenStream {
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
    let (parsed, mut arg_errors) = args::parse(args);
    errors.append(&mut arg_errors);
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
        generate(&parsed, func, fw)
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

fn generate(a: &Args, func: ItemFn, fw: Framework) -> TokenStream {
    let krate = a
        .krate
        .as_ref()
        .map_or_else(|| fw.default_crate(), |(p, _)| quote!(#p));
    let p = quote!(#krate::__private);
    let ItemFn {
        attrs,
        vis,
        modifiers: _,
        sig,
        block,
    } = func;
    let ctx = format_ident!("__idempotent_ctx", span = Span::mixed_site());
    let scope_var = format_ident!("__idempotent_scope", span = Span::mixed_site());
    let args_var = format_ident!("__idempotent_args", span = Span::mixed_site());

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
    let key = match a.key.map(|(k, _)| k) {
        Some(KeyReq::Optional) => quote!(#p::Key::Optional),
        _ => quote!(#p::Key::Required),
    };
    let store_5xx = a.store_server_errors.is_some();
    let max_response = match a.max_response {
        Some((n, _)) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            quote!(::core::option::Option::Some(#n))
        }
        None => quote!(::core::option::Option::None),
    };

    // The fake return edge (tracing's): fixes the async block's output type to the declared
    // return type, so `?` and type errors land in user code. Not possible for `impl Trait`.
    let anchor = match &sig.output {
        ReturnType::Type(_, ty) if !matches!(**ty, Type::ImplTrait(_)) => {
            let fake = format_ident!("__idempotent_fake_return", span = Span::mixed_site());
            quote! {
                #[allow(unreachable_code, clippy::diverging_sub_expression, clippy::let_unit_value)]
                if false {
                    let #fake: #ty = loop {};
                    return #fake;
                }
            }
        }
        _ => quote!(),
    };

    let mut new_sig = sig.clone();
    new_sig
        .inputs
        .insert(0, syn::parse_quote!(#ctx: #p::Context));
    new_sig.output = syn::parse_quote!(-> #p::Response);
    let stmts = &block.stmts;

    quote! {
        #(#attrs)*
        #vis #new_sig {
            let #scope_var = #scope_expr;
            let #args_var = #p::RouteArgs {
                ttl: #ttl,
                lease: #lease,
                key: #key,
                store_server_errors: #store_5xx,
                max_response: #max_response,
            };
            #p::run(#ctx, #scope_var, #args_var, async move {
                #anchor
                #(#stmts)*
            })
            .await
        }
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
                "pub async fn h (__idempotent_ctx : :: idempotent_axum :: __private :: Context"
            ),
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
