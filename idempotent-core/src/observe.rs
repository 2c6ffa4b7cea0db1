//! What the engine tells operators: `tracing` spans and events, and metrics through the
//! [`metrics`] facade (no exporter is forced on you: install any recorder, such as
//! `metrics-exporter-prometheus`, and these appear; install none and they cost a few atomic
//! loads).
//!
//! # Spans
//! One span per idempotent request, named `idempotent`, at `DEBUG` level (so the default `INFO`
//! filter skips it: turn it on with `RUST_LOG=idempotent_core=debug`), with fields:
//! - `route`: the route's name: the handler function's name for HTTP routes (the attribute
//!   sets it; static, so labels cost no allocation), the function's `module::name` in function
//!   mode;
//! - `key`: a short keyed hash of (scope, key), 16 hex characters: HMAC-SHA-256 under a key
//!   derived from the configuration's derive secret (so every instance sharing it logs the
//!   same hash for one record), else under a key made per process. Keyed, because a plain
//!   hash of a low-entropy key such as `order-123` is easy to reverse. Neither the raw key nor
//!   the scope nor the body is ever logged;
//! - `outcome`: one of [`OUTCOMES`];
//! - `store_ms`: how long the claim took (the store's part of the decision), milliseconds;
//! - `recorded`: for executions, what became of the record (`stored`, `released`, `failed`).
//!
//! Events inside it: a take-over of a record whose lease or ttl ran out (`INFO`), a release
//! (`DEBUG`), a failed complete (`ERROR`), a fence refusal (`WARN`).
//!
//! # Metrics
//! - [`REQUESTS_TOTAL`] (counter), labels `route` and `outcome`;
//! - [`STORE_SECONDS`] (histogram), label `operation`: `claim`, `complete`, `release`,
//!   `extend`, `purge`, and on the transactional paths `begin` (read, BEGIN and the claim in
//!   the transaction) and `commit` (the complete in the transaction and COMMIT);
//! - [`IN_FLIGHT`] (gauge): requests being claimed or executed now;
//! - [`EVENTS_TOTAL`] (counter), labels `route` and `event`: `takeover`, `released`,
//!   `complete_failed`, `release_failed`, `fence_refused`;
//! - with a replay cache ([`ReplayCache`](crate::engine::ReplayCache)):
//!   [`REPLAY_CACHE_LOOKS_TOTAL`] (counter), label `result`: `hit`, `mismatch`, `miss`;
//!   [`REPLAY_CACHE_EVICTIONS_TOTAL`] (counter), label `cause`: `size` (evicted for room),
//!   `refused` (not kept: its scope was at its budget); [`REPLAY_CACHE_BYTES`] (gauge).
//!
//! What is counted: every request that reaches the engine's claim, and key refusals the
//! adapters answer before it. Requests refused earlier for other reasons (a body over the
//! limit or too slow, a scope that cannot be built, a missing layer) and requests without a
//! key on a route where it is optional (they run without the engine) are not counted. In
//! function mode with `Concurrent::Wait`, each poll of a waiting call is a request.
//!
//! ```
//! // Names to query or alert on:
//! assert_eq!(idempotent_core::observe::REQUESTS_TOTAL, "idempotent_requests_total");
//! assert!(idempotent_core::observe::OUTCOMES.contains(&"replayed"));
//! ```

// What is counted and logged, on plain values: the engine, the transactional paths and the
// sweeper say which (`RequestOutcome`, `Settled`, an operation's name); this module depends
// on none of them.

use crate::derive::DeriveSecret;
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::sync::OnceLock;
use std::time::Duration;

/// Counter of idempotent requests, labels `route` and `outcome`.
pub const REQUESTS_TOTAL: &str = "idempotent_requests_total";
/// Histogram of store call latency in seconds, label `operation`.
pub const STORE_SECONDS: &str = "idempotent_store_duration_seconds";
/// Gauge of requests being claimed or executed.
pub const IN_FLIGHT: &str = "idempotent_in_flight";
/// Counter of notable events, labels `route` and `event` (`wait_started` among them: a
/// request began to wait for a running duplicate's answer).
pub const EVENTS_TOTAL: &str = "idempotent_events_total";
/// Counter of looks in the replay cache, label `result` (`hit`, `mismatch`, `miss`).
pub const REPLAY_CACHE_LOOKS_TOTAL: &str = "idempotent_replay_cache_looks_total";
/// Counter of entries the replay cache evicted for room (`cause="size"`) or did not keep
/// because their scope was at its budget (`cause="refused"`).
pub const REPLAY_CACHE_EVICTIONS_TOTAL: &str = "idempotent_replay_cache_evictions_total";
/// Gauge of the bytes the replay cache holds, as it estimates them.
pub const REPLAY_CACHE_BYTES: &str = "idempotent_replay_cache_bytes";
/// Counter of ended waits for a running duplicate's answer, labels `route` and `outcome`
/// ([`WAIT_OUTCOMES`]).
pub const WAITS_TOTAL: &str = "idempotent_waits_total";
/// Histogram of how long those waits took in seconds, labels `route` and `outcome`.
pub const WAIT_SECONDS: &str = "idempotent_wait_duration_seconds";
/// The values of the waits' `outcome` label:
/// - `replayed`: the first attempt's answer was stored, and replayed;
/// - `ran`: the record was released (a 5xx, a panic) or its lease ran out, and this request
///   claimed it and ran the handler;
/// - `timed_out`: still in progress at the deadline (409);
/// - `over_bound`: no place to wait (too many waiters on the record or in the engine; 409 at once);
/// - `gone`: the client went away;
/// - `other`: another answer (the key reused for another request, the store failing, a drain).
pub const WAIT_OUTCOMES: [&str; 6] = [
    "replayed",
    "ran",
    "timed_out",
    "over_bound",
    "gone",
    "other",
];

/// The values of the `outcome` label and span field:
/// - `executed`: the handler ran under a claimed record;
/// - `replayed`: a stored response was replayed;
/// - `in_progress`: another attempt holds the key (409);
/// - `mismatch`: the key was used for another request (422);
/// - `rejected`: the key is missing or malformed (400; counted with the request's route
///   template, or `unmatched`, since it is answered before the handler's route is known);
/// - `store_unavailable`: the store failed; the handler did not run (503);
/// - `unprotected`: fail-open after a store failure, or no key where it is optional (for
///   direct [`Engine`](crate::Engine) callers; the HTTP adapters run such requests without
///   the engine): the handler ran without a record;
/// - `draining`: the engine is shutting down (503);
/// - `misconfigured`: the route's settings are out of bounds (500).
pub const OUTCOMES: [&str; 9] = [
    "executed",
    "replayed",
    "in_progress",
    "mismatch",
    "rejected",
    "store_unavailable",
    "unprotected",
    "draining",
    "misconfigured",
];

/// The key of the log hashes: from the engine's derive secret if it has one, else made per
/// process.
pub(crate) struct LogKey(OnceLock<Hmac<Sha256>>);

impl LogKey {
    pub(crate) const fn new() -> Self {
        LogKey(OnceLock::new())
    }

    /// The key derived from `secret`.
    pub(crate) fn from_secret(secret: &DeriveSecret) -> Self {
        LogKey(OnceLock::from(hmac_with(&secret.log_key())))
    }

    fn get(&self) -> &Hmac<Sha256> {
        self.0.get_or_init(|| {
            let mut key = [0_u8; 32];
            key[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
            key[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
            hmac_with(&key)
        })
    }

    /// 16 hex characters of HMAC(scope, key), length-prefixed.
    pub(crate) fn hash(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        let mut mac = self.get().clone();
        for field in [scope.as_str().as_bytes(), key.as_str().as_bytes()] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        let digest = mac.finalize().into_bytes();
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// An HMAC-SHA-256 under `key` (HMAC takes keys of any length).
fn hmac_with(key: &[u8; 32]) -> Hmac<Sha256> {
    match Hmac::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    }
}

/// The span of one request (its `key` recorded by the caller, when the span is enabled).
pub(crate) fn span(route: &'static str) -> tracing::Span {
    tracing::debug_span!(
        "idempotent",
        route,
        key = tracing::field::Empty,
        outcome = tracing::field::Empty,
        store_ms = tracing::field::Empty,
        recorded = tracing::field::Empty,
    )
}

/// A request's outcome, as counted: one of [`OUTCOMES`], in its order (the engine maps what
/// it found to these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestOutcome {
    Executed,
    Replayed,
    InProgress,
    Mismatch,
    Rejected,
    StoreUnavailable,
    Unprotected,
    Draining,
    Misconfigured,
}

impl RequestOutcome {
    /// The `outcome` label and span field.
    pub(crate) const fn label(self) -> &'static str {
        OUTCOMES[self as usize]
    }
}

/// Counts a request's outcome and records it, with the store's time, on its span.
pub(crate) fn outcome(
    span: &tracing::Span,
    route: &'static str,
    outcome: RequestOutcome,
    store: Option<Duration>,
) {
    count_request(route, outcome);
    let outcome = outcome.label();
    span.record("outcome", outcome);
    if let Some(store) = store {
        span.record("store_ms", store.as_secs_f64() * 1e3);
    }
}

/// What `metrics`' macros give the recorder for a metric registered in this module.
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// Adds one to [`REQUESTS_TOTAL`] for `route` and `outcome`, as
/// `metrics::counter!(REQUESTS_TOTAL, "route" => route, "outcome" => …).increment(1)` does.
///
/// That macro, given a label that is not a literal, allocates the labels and hashes the key
/// on every call, recorder or none: about 1,000 instructions and an allocation a request
/// (callgrind). So each thread keeps, per outcome, the key of the last route it counted, and
/// builds one only when the route changes. The recorder is still asked on every call, so a
/// recorder installed later, or a thread's local one, gets every count.
fn count_request(route: &'static str, outcome: RequestOutcome) {
    type Slots = [Option<(&'static str, metrics::Key)>; OUTCOMES.len()];
    thread_local! {
        static KEYS: std::cell::RefCell<Slots> =
            const { std::cell::RefCell::new([const { None }; OUTCOMES.len()]) };
    }
    let build = || {
        metrics::Key::from_parts(
            REQUESTS_TOTAL,
            vec![
                metrics::Label::from_static_parts("route", route),
                metrics::Label::from_static_parts("outcome", outcome.label()),
            ],
        )
    };
    let count = |key: &metrics::Key| {
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA)).increment(1);
    };
    let counted = KEYS
        .try_with(|keys| {
            // Already borrowed (a recorder that counts a request from inside `count`) or the
            // thread exiting: the key is built for this call, as without the cache.
            let mut keys = keys.try_borrow_mut().ok()?;
            let slot = &mut keys[outcome as usize];
            if !matches!(&*slot, Some((cached, _)) if *cached == route) {
                *slot = Some((route, build()));
            }
            let (_, key) = slot.as_ref()?;
            count(key);
            Some(())
        })
        .ok()
        .flatten();
    if counted.is_none() {
        count(&build());
    }
}

/// Counts a key refused before its route was known (see [`OUTCOMES`]); for the adapters.
#[doc(hidden)]
pub fn rejected(route_template: Option<&str>) {
    let route = route_template.unwrap_or("unmatched").to_owned();
    metrics::counter!(REQUESTS_TOTAL, "route" => route, "outcome" => "rejected").increment(1);
}

/// Records a store call's latency.
pub(crate) fn store_time(operation: &'static str, took: Duration) {
    let seconds = took.as_secs_f64();
    // A key built at compile time for each known operation: `histogram!` with a name that is
    // a constant builds and hashes the key on every call, and with a `&str` variable for the
    // label allocates its labels too (twice per first execution).
    macro_rules! by_operation {
        ($($known:literal),*) => {
            match operation {
                $($known => {
                    static LABELS: [metrics::Label; 1] =
                        [metrics::Label::from_static_parts("operation", $known)];
                    static KEY: metrics::Key =
                        metrics::Key::from_static_parts(STORE_SECONDS, &LABELS);
                    metrics::with_recorder(|recorder| recorder.register_histogram(&KEY, &METADATA))
                        .record(seconds)
                })*
                other => metrics::histogram!(STORE_SECONDS, "operation" => other).record(seconds),
            }
        };
    }
    by_operation!(
        "claim", "complete", "release", "extend", "commit", "begin", "purge"
    );
}

/// Runs `fut`, recording its latency as `operation`.
pub(crate) async fn timed<T>(operation: &'static str, fut: impl Future<Output = T>) -> T {
    let start = std::time::Instant::now();
    let out = fut.await;
    store_time(operation, start.elapsed());
    out
}

/// Counts an ended wait and its time.
pub(crate) fn wait_ended(route: &'static str, outcome: &'static str, took: Duration) {
    metrics::counter!(WAITS_TOTAL, "route" => route, "outcome" => outcome).increment(1);
    metrics::histogram!(WAIT_SECONDS, "route" => route, "outcome" => outcome)
        .record(took.as_secs_f64());
}

/// A counter with one static label, registered without building its key (the cache's hit
/// path calls these once per request).
macro_rules! static_counter {
    ($name:expr, $label:literal, $value:expr, [$($known:literal),*]) => {
        match $value {
            $(
                $known => {
                    static LABELS: [metrics::Label; 1] =
                        [metrics::Label::from_static_parts($label, $known)];
                    static KEY: metrics::Key = metrics::Key::from_static_parts($name, &LABELS);
                    metrics::with_recorder(|recorder| recorder.register_counter(&KEY, &METADATA))
                        .increment(1);
                }
            )*
            other => metrics::counter!($name, $label => other).increment(1),
        }
    };
}

/// Counts a look in the replay cache.
pub(crate) fn replay_cache_look(result: &'static str) {
    static_counter!(
        REPLAY_CACHE_LOOKS_TOTAL,
        "result",
        result,
        ["hit", "mismatch", "miss"]
    );
}

/// Counts an entry the replay cache evicted for room.
pub(crate) fn replay_cache_eviction() {
    static_counter!(REPLAY_CACHE_EVICTIONS_TOTAL, "cause", "size", ["size"]);
}

/// Counts an entry the replay cache did not keep (its scope at its budget).
pub(crate) fn replay_cache_refused() {
    static_counter!(
        REPLAY_CACHE_EVICTIONS_TOTAL,
        "cause",
        "refused",
        ["refused"]
    );
}

/// Sets the replay cache's bytes gauge.
pub(crate) fn replay_cache_bytes(bytes: u64) {
    static KEY: metrics::Key = metrics::Key::from_static_name(REPLAY_CACHE_BYTES);
    #[allow(clippy::cast_precision_loss, reason = "a gauge of bytes")]
    metrics::with_recorder(|recorder| recorder.register_gauge(&KEY, &METADATA)).set(bytes as f64);
}

/// Counts a notable event.
pub(crate) fn event(route: &'static str, event: &'static str) {
    metrics::counter!(EVENTS_TOTAL, "route" => route, "event" => event).increment(1);
}

/// What became of an execution's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Stored (committed, on the transactional paths).
    Stored,
    /// Released (rolled back): a retry runs again.
    Released,
    /// The fence refused the write: another attempt holds the record.
    FenceRefused,
    /// Storing failed; the record stays as it was.
    Failed,
    /// Releasing failed; the record stays in progress until its lease ends.
    ReleaseFailed,
}

/// Counts what became of an execution's record and records it on its span.
pub(crate) fn settled(span: &tracing::Span, route: &'static str, settled: Settled) {
    let what = match settled {
        Settled::Stored => "stored",
        Settled::Released => {
            event(route, "released");
            tracing::debug!("idempotency: the key was released; a retry runs the handler again");
            "released"
        }
        Settled::ReleaseFailed => {
            event(route, "release_failed");
            "failed"
        }
        Settled::FenceRefused => {
            event(route, "fence_refused");
            "failed"
        }
        Settled::Failed => {
            event(route, "complete_failed");
            "failed"
        }
    };
    span.record("recorded", what);
}

/// One more request in flight.
pub(crate) fn in_flight(delta: f64) {
    // A key built at compile time: `gauge!` with a name that is a constant, not a literal,
    // builds and hashes it on every call.
    static KEY: metrics::Key = metrics::Key::from_static_name(IN_FLIGHT);
    metrics::with_recorder(|recorder| recorder.register_gauge(&KEY, &METADATA)).increment(delta);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_has_its_label() {
        use RequestOutcome::*;
        let all = [
            Executed,
            Replayed,
            InProgress,
            Mismatch,
            Rejected,
            StoreUnavailable,
            Unprotected,
            Draining,
            Misconfigured,
        ];
        assert_eq!(all.map(RequestOutcome::label), OUTCOMES);
        assert_eq!(InProgress.label(), "in_progress");
        assert_eq!(StoreUnavailable.label(), "store_unavailable");
    }

    /// Every registration a recorder is asked for: its kind, key and metadata.
    #[derive(Default)]
    struct Registrations(std::sync::Mutex<Vec<Registered>>);

    type Registered = (
        &'static str,
        metrics::Key,
        String,
        metrics::Level,
        Option<String>,
    );

    impl Registrations {
        fn push(&self, kind: &'static str, key: &metrics::Key, meta: &metrics::Metadata<'_>) {
            self.0.lock().unwrap().push((
                kind,
                key.clone(),
                meta.target().to_owned(),
                *meta.level(),
                meta.module_path().map(str::to_owned),
            ));
        }

        fn taken(self) -> Vec<Registered> {
            self.0.into_inner().unwrap()
        }
    }

    impl metrics::Recorder for Registrations {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn register_counter(
            &self,
            key: &metrics::Key,
            meta: &metrics::Metadata<'_>,
        ) -> metrics::Counter {
            self.push("counter", key, meta);
            metrics::Counter::noop()
        }
        fn register_gauge(
            &self,
            key: &metrics::Key,
            meta: &metrics::Metadata<'_>,
        ) -> metrics::Gauge {
            self.push("gauge", key, meta);
            metrics::Gauge::noop()
        }
        fn register_histogram(
            &self,
            key: &metrics::Key,
            meta: &metrics::Metadata<'_>,
        ) -> metrics::Histogram {
            self.push("histogram", key, meta);
            metrics::Histogram::noop()
        }
    }

    /// What `ours` registers against what `macros` does (the metrics' macros as this module
    /// called them before): the same kinds and keys, in order, each with this module's
    /// metadata, which the macros gave at their old call sites here.
    fn registers_as_the_macros(ours: impl Fn(), macros: impl Fn()) {
        let (a, b) = (Registrations::default(), Registrations::default());
        metrics::with_local_recorder(&a, ours);
        metrics::with_local_recorder(&b, macros);
        let (a, b) = (a.taken(), b.taken());
        // The key, and its labels in order (a key's equality ignores their order, which
        // exporters show).
        let keys = |r: &[Registered]| {
            r.iter()
                .map(|(kind, key, ..)| {
                    (
                        *kind,
                        key.clone(),
                        key.labels().cloned().collect::<Vec<_>>(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert!(!a.is_empty());
        assert_eq!(keys(&a), keys(&b));
        let module = "idempotent_core::observe";
        for (_, _, target, level, path) in &a {
            assert_eq!(
                (target.as_str(), *level, path.as_deref()),
                (module, metrics::Level::INFO, Some(module))
            );
        }
    }

    #[test]
    fn requests_are_counted_under_the_key_and_metadata_the_macro_gives() {
        use RequestOutcome::*;
        // Routes and outcomes interleaved, so the thread's kept keys are hit, missed and
        // replaced; each count must register what `counter!` registers for the same labels.
        let calls = [
            ("a", Executed),
            ("b", Executed),
            ("a", Executed),
            ("a", Replayed),
            ("a", Executed),
            ("b", Replayed),
            ("b", Replayed),
            ("a", Replayed),
        ];
        registers_as_the_macros(
            || {
                for (route, outcome) in calls {
                    count_request(route, outcome);
                }
            },
            || {
                for (route, outcome) in calls {
                    let outcome = outcome.label();
                    metrics::counter!(REQUESTS_TOTAL, "route" => route, "outcome" => outcome)
                        .increment(1);
                }
            },
        );
    }

    #[test]
    fn gauges_and_histograms_register_the_keys_the_macros_give() {
        let operations = [
            "claim", "complete", "release", "extend", "commit", "begin", "purge", "another",
        ];
        registers_as_the_macros(
            || {
                in_flight(1.0);
                in_flight(-1.0);
                for operation in operations {
                    store_time(operation, Duration::from_millis(1));
                }
            },
            || {
                metrics::gauge!(IN_FLIGHT).increment(1.0);
                metrics::gauge!(IN_FLIGHT).increment(-1.0);
                for operation in operations {
                    metrics::histogram!(STORE_SECONDS, "operation" => operation).record(0.001);
                }
            },
        );
    }
}
