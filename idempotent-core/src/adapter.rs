//! The adapter glue's side of core: what `idempotent-axum`, `idempotent-actix` and the code
//! the `#[idempotent]` attributes generate call. Not a public API and not covered by semver:
//! any release may change it, which is why the adapters pin `idempotent-core` with `=`.
//!
//! - the request driver (`driver`): one request's life from its head to its answer,
//!   generic over an adapter's `driver::Glue`;
//! - what the driver is made of (`Route`, `Step`, `Reply`, `Capture`, …);
//! - function mode's runtime, as its expansion names it (`call`).

pub use crate::duration::format_duration;
pub use crate::engine::detached::Detached;
pub use crate::http::capture::{Capture, Recorder, ResponsePlan};
pub use crate::http::reply::{FIRST_EXECUTION, Reply, Step, TxReply};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use crate::http::reply::{TxStep, begin_transactional, finish_transactional};
pub use crate::http::request::{
    FINGERPRINT_INLINE_MAX, RequestHead, check_content_length, check_key, connection_options,
    is_safe_method, is_stored_header,
};
pub use crate::http::route::{Route, RoutePolicy, idempotent_context};

/// The request driver the adapters share.
pub mod driver {
    pub use crate::http::driver::*;
}

/// Function mode's runtime.
pub mod call {
    pub use crate::call::{CallError, Calls, Function, Input};
    pub use crate::scope::ScopeValue;
    pub use ::core::time::Duration;

    /// An input of the function, for its fingerprint (type-checks it against [`Input`], so a
    /// parameter that is not `Serialize` gets `Input`'s message, at the parameter).
    pub fn input<T: Input>(value: &T) -> &dyn Input {
        value
    }

    /// The scope of a parameter (type-checks it against [`ScopeValue`]).
    pub fn scope_of<T: ScopeValue + ?Sized>(
        value: &T,
    ) -> Result<crate::scope::Scope, crate::scope::ScopeError> {
        value.to_scope()
    }

    /// The unscoped namespace.
    pub fn unscoped() -> Result<crate::scope::Scope, crate::scope::ScopeError> {
        Ok(crate::scope::Scope::unscoped())
    }
}
