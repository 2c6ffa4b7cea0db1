//! The `#[idempotent]` attribute. Use it through an adapter crate (`idempotent-axum`), which
//! re-exports it as `idempotent` and documents its arguments; generated code reaches the
//! runtime only through that crate's `#[doc(hidden)] __private` module.
//!
//! Stages, one per file: `args` (typed arguments with spans) → `signature` (the handler's
//! shape and the names its parameters bind) → `expand` (code generation). Everything below
//! the entry points works on `proc_macro2`, so it unit-tests without a compiler run.

use proc_macro::TokenStream;

mod args;
mod expand;
mod signature;

/// `#[idempotent(...)]` for Axum handlers (re-exported by `idempotent-axum` as `idempotent`).
#[proc_macro_attribute]
pub fn idempotent_axum(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(args.into(), item.into(), expand::Framework::Axum).into()
}
