//! One route's arguments, resolved against the application's settings.

use super::config::Config;
use super::is_safe_method;
use crate::derive::Idempotent;
use crate::engine::{ConfigError, KeyRequirement, Policy};
use crate::key::{IdempotencyKey, KeyError};
use crate::problem::Problem;
use crate::scope::{Scope, ScopeError};
use crate::tx::{CommitPath, DEFAULT_COMMIT, TxOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// One route's attribute arguments, as `#[idempotent]` writes them (a `static` per handler);
/// `None` takes the [`Config`]'s default.
#[derive(Debug)]
pub struct Route {
    name: &'static str,
    ttl: Option<Duration>,
    lease: Option<Duration>,
    key: KeyRequirement,
    store_server_errors: bool,
    max_response: Option<usize>,
    commit: Option<CommitPath>,
    wait: Option<Duration>,
    reported: AtomicBool,
    reported_secret: AtomicBool,
}

/// What `#[idempotent(…)]` wrote for a route, by name (`None`: the [`Config`]'s default), so
/// two settings of one type can never be swapped unnoticed.
#[derive(Debug, Clone, Copy)]
pub struct RouteArgs {
    /// The handler's name, for logs.
    pub name: &'static str,
    /// `ttl = "…"`.
    pub ttl: Option<Duration>,
    /// `lease = "…"`.
    pub lease: Option<Duration>,
    /// `key = "required" | "optional"`.
    pub key: KeyRequirement,
    /// `store_server_errors`.
    pub store_server_errors: bool,
    /// `max_response = "…"`.
    pub max_response: Option<usize>,
}

/// A route's arguments resolved against the application's [`Config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutePolicy {
    /// What the engine needs.
    pub policy: Policy,
    /// The limit on stored responses.
    pub max_response: usize,
}

impl Route {
    /// A route with the arguments its attribute wrote.
    pub const fn new(args: RouteArgs) -> Self {
        let RouteArgs {
            name,
            ttl,
            lease,
            key,
            store_server_errors,
            max_response,
        } = args;
        Route {
            name,
            ttl,
            lease,
            key,
            store_server_errors,
            max_response,
            commit: None,
            wait: None,
            reported: AtomicBool::new(false),
            reported_secret: AtomicBool::new(false),
        }
    }

    /// The attribute's `wait` (`None` takes the configuration's
    /// [`wait`](crate::http::ConfigBuilder::wait)).
    #[must_use]
    pub const fn wait(mut self, wait: Option<Duration>) -> Self {
        self.wait = wait;
        self
    }

    /// The attribute's `commit` and `wait` of a transactional route (`None` takes the
    /// configuration's default).
    #[must_use]
    pub const fn transactional(
        mut self,
        commit: Option<CommitPath>,
        wait: Option<Duration>,
    ) -> Self {
        self.commit = commit;
        self.wait = wait;
        self
    }

    /// The transactional settings of this route under `config` (the commit path: the route's,
    /// else the configuration's, else [`DEFAULT_COMMIT`](crate::tx::DEFAULT_COMMIT)).
    pub fn tx_options(&self, config: &Config) -> TxOptions {
        TxOptions {
            commit: self.commit.or(config.commit).unwrap_or(DEFAULT_COMMIT),
            wait: self.wait.unwrap_or(config.tx_wait),
            max_waiters: config.max_waiters,
            read_first: config.tx_read_first,
        }
    }

    /// The handler's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether the route requires a key.
    pub fn key(&self) -> KeyRequirement {
        self.key
    }

    /// Resolves the arguments against `config`. The attribute checked what it could at compile
    /// time; what depends on the configuration (a route's ttl under the configured lease) is
    /// checked here, and the first failure per route is logged (`tracing`, error level) with
    /// the route's name.
    ///
    /// # Errors
    /// [`ConfigError`]: answer with [`Problem::misconfigured`], never run the handler.
    pub fn resolve(&self, config: &Config) -> Result<RoutePolicy, ConfigError> {
        let max_response = self.max_response.unwrap_or(config.max_response);
        let policy = Policy {
            ttl: self.ttl.unwrap_or(config.ttl),
            lease: self.lease.unwrap_or(config.engine.lease()),
            store_server_errors: self.store_server_errors,
            key: self.key,
            fail_open: config.fail_open,
            route: self.name,
            max_stored: max_response,
            wait: self.wait.unwrap_or(config.wait),
        };
        match policy.check() {
            Ok(()) => Ok(RoutePolicy {
                policy,
                max_response,
            }),
            Err(e) => {
                if !self.reported.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        route = self.name,
                        error = %e,
                        "idempotency: this route's arguments do not fit the configuration; its requests are answered 500 until fixed"
                    );
                }
                Err(e)
            }
        }
    }
}

/// The [`Idempotent`] context for a handler parameter: keyed by (scope, key) when the request
/// runs under a key, [`Idempotent::unkeyed`] when it runs without one (a safe method, or no
/// key where it is optional; also when the scope failed, whose request never reaches the
/// handler).
///
/// # Errors
/// [`Problem::misconfigured`] when the configuration has no [`DeriveSecret`](crate::DeriveSecret) (logged once per
/// route, with its name): the handler must not run, since its downstream keys would not be
/// stable.
pub fn idempotent_context(
    config: &Config,
    route: &Route,
    method: &str,
    key: &Result<IdempotencyKey, KeyError>,
    scope: &Result<Scope, ScopeError>,
) -> Result<Idempotent, Box<Problem>> {
    let Some(secret) = config.engine.derive_secret() else {
        if !route.reported_secret.swap(true, Ordering::Relaxed) {
            tracing::error!(
                route = route.name,
                "idempotency: this handler takes an `Idempotent` parameter but its engine has no derive secret (`Engine::builder(…).derive_secret(…)`); its requests are answered 500 until one is set"
            );
        }
        return Err(Box::new(Problem::misconfigured()));
    };
    Ok(match (key, scope) {
        (Ok(key), Ok(scope)) if !is_safe_method(method) => Idempotent::keyed(secret, scope, key),
        _ => Idempotent::unkeyed(),
    })
}
