//! Runnable demos of `idempotent`.
//!
//! [`charges`] is the contract of the Stripe-shaped charges API, shared by every framework's
//! binary (`charges-axum` now; an Actix twin later): request parsing and validation, the
//! charge object, the charges table, and the command-line configuration.

pub mod charges;
