//! Code generation from a validated plan: a handler becomes claim → execute → store → replay
//! around its body (`handler`), a function runs under its runner at most once per (scope, key)
//! (`function`). On any error, the original item is emitted unchanged next to the errors
//! (tokio's `token_stream_with_error`), so the user sees our errors, not a cascade.

mod function;
mod handler;

use crate::args::{self, ScopePath};
use crate::validate::{self, Entry, Plan};
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::{FnArg, PatType, Signature, Type};

/// The whole attribute: arguments → signature and validation → a plan → code.
pub(crate) fn expand(args: TokenStream, item: TokenStream, entry: Entry) -> TokenStream {
    let (args, arg_errors) = args::parse(args);
    match validate::validate(args, arg_errors, &item, entry) {
        Ok(Plan::Handler(plan)) => handler::generate(*plan),
        Ok(Plan::Function(plan)) => function::generate(*plan),
        Err(errors) => with_errors(item, errors),
    }
}

/// The item unchanged, then every error. Only the attribute's own parameter attributes
/// (`#[idempotent(skip)]`) are taken off, which the compiler would report again.
fn with_errors(item: TokenStream, errors: Vec<syn::Error>) -> TokenStream {
    let item = match syn::parse2::<syn::ItemFn>(item.clone()) {
        Ok(f) if f.sig.inputs.iter().any(|arg| {
            matches!(arg, FnArg::Typed(t) if t.attrs.iter().any(crate::signature::is_ours))
        }) =>
        {
            let f = crate::signature::strip_ours(f);
            quote!(#f)
        }
        _ => item,
    };
    let errors = errors.into_iter().map(|e| e.to_compile_error());
    quote!(#item #(#errors)*)
}

/// A name the macro introduces, out of the user's code's reach.
fn hidden(name: &str) -> syn::Ident {
    syn::Ident::new(name, Span::mixed_site())
}

/// The function's attributes: inner ones (`#![allow(..)]` at the top of the body) stay at the
/// top of the body, outer ones on the function.
fn split_attrs(attrs: Vec<syn::Attribute>) -> (Vec<syn::Attribute>, Vec<syn::Attribute>) {
    attrs
        .into_iter()
        .partition(|attr| matches!(attr.style, syn::AttrStyle::Inner(_)))
}

/// `Some(Duration::from_millis(ms))` or `None`, through the runtime path `p`.
fn opt_ms(p: &TokenStream, ms: Option<u64>) -> TokenStream {
    match ms {
        Some(ms) => quote!(::core::option::Option::Some(#p::Duration::from_millis(#ms))),
        None => quote!(::core::option::Option::None),
    }
}

/// `scope_of(&param.field)` spanned at the `scope` literal (so a type without `ScopeValue` is
/// reported there), or `unscoped()`.
fn scope_expr(p: &TokenStream, scope: Option<&(ScopePath, Span)>) -> TokenStream {
    match scope {
        Some((path, span)) => {
            let e = path_expr(path, *span);
            quote_spanned!(*span=> #p::scope_of(&#e))
        }
        None => quote!(#p::unscoped()),
    }
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

/// Takes the transaction and the idempotency context out of the signature's inputs (neither
/// is an extractor or an argument callers pass: the runtime makes both), returning them.
fn take_params(
    sig: &mut Signature,
    tx: Option<usize>,
    context: Option<usize>,
) -> (Option<PatType>, Option<PatType>) {
    let typed = |i: Option<usize>| match i.and_then(|i| sig.inputs.iter().nth(i)) {
        Some(FnArg::Typed(t)) => Some(t.clone()),
        _ => None,
    };
    let taken = (typed(tx), typed(context));
    sig.inputs = std::mem::take(&mut sig.inputs)
        .into_iter()
        .enumerate()
        .filter_map(|(j, arg)| (Some(j) != tx && Some(j) != context).then_some(arg))
        .collect();
    taken
}

/// `let idem: Idempotent = var;` (or `&var` for `idem: &Idempotent`): binds the made context
/// to the handler's or function's own parameter, at the top of its body, with the
/// parameter's attributes.
fn bind_context(param: &PatType, var: &syn::Ident) -> TokenStream {
    let (attrs, pat, ty) = (&param.attrs, &param.pat, &param.ty);
    let value = if matches!(&**ty, Type::Reference(_)) {
        quote!(&#var)
    } else {
        quote!(#var)
    };
    quote!(#(#attrs)* let #pat: #ty = #value;)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(args: TokenStream, item: TokenStream) -> String {
        expand(args, item, Entry::Axum).to_string()
    }

    fn expand_function(args: TokenStream, item: TokenStream) -> TokenStream {
        expand(args, item, Entry::Core)
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
            out.contains(":: idempotent_axum :: __private :: call :: scope_of (& account_id)"),
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
            out.contains(":: idempotent_axum :: __private :: Route :: new (:: idempotent_axum :: __private :: RouteArgs { name : \"h\" ,"),
            "{out}"
        );
        let custom = expand_str(
            quote!(unscoped, crate = "my_axum"),
            quote!(
                async fn h() {}
            ),
        );
        assert!(
            custom.contains("my_axum :: __private :: call :: unscoped ()"),
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
            Entry::Actix,
        )
        .to_string();
        // The body extractor (`Bytes`) is deferred past the replay cache: `Later`, bound by
        // the closure that makes the handler's future.
        assert!(
            actix.contains("async fn h (__idempotent_ctx : :: idempotent_actix :: __private :: Context < true , (Account , :: idempotent_actix :: __private :: Later < web :: Bytes > ,) >)"),
            "{actix}"
        );
        assert!(
            actix.contains("let (__idempotent_ctx , __idempotent_args) = __idempotent_ctx . split () ; let Account (account) = __idempotent_args . 0 ; let __idempotent_later = __idempotent_args . 1 ;"),
            "{actix}"
        );
        assert!(
            actix.contains("__idempotent_scope , __idempotent_later , move | mut body : web :: Bytes | async move"),
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
        assert!(
            out.contains("Function :: new (:: idempotent_core :: __private :: call :: FunctionArgs { name : \"billing.book\" ,"),
            "{out}"
        );
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
