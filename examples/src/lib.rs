//! Runnable demos of `idempotent`.
//!
//! [`charges`] is the domain of the Stripe-shaped charges API (validation, the charge and
//! refund objects, the tables) and [`api`] what its routes do and answer, both without a web
//! framework; the binaries `charges-axum` and `charges-actix` hold only their framework's glue
//! around them, so they serve exactly the same contract.

pub mod api;
pub mod charges;
