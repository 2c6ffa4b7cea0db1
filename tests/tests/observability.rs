//! Spans and metrics: a test subscriber records every `idempotent` span's fields and the
//! events inside them, a debugging recorder every metric; each outcome and event is driven
//! through a real engine and asserted. One test, run in order: the gauge and the recorder are
//! process-wide.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::observe::{
    EVENTS_TOTAL, IN_FLIGHT, REQUESTS_TOTAL, STORE_SECONDS, WAIT_SECONDS, WAITS_TOTAL,
};
use idempotent_core::{clock::*, engine::*, fingerprint::*, store::*, *};
use idempotent_tests::execute::{Execute, Handled, Outcome};
use idempotent_tests::faults::FaultyStore;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// A span's fields, as text.
#[derive(Debug, Default, Clone)]
struct Fields(HashMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

/// What the test subscriber saw: closed `idempotent` spans, and events (level, message, the
/// route of the span they happened in).
#[derive(Default)]
struct Seen {
    spans: Vec<Fields>,
    events: Vec<(tracing::Level, String, Option<String>)>,
}

struct Capture(Arc<Mutex<Seen>>);

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() == "idempotent" {
            let mut fields = Fields::default();
            attrs.record(&mut fields);
            ctx.span(id).unwrap().extensions_mut().insert(fields);
        }
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<Fields>()
        {
            values.record(fields);
        }
    }
    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let route = ctx.event_scope(event).and_then(|scope| {
            scope.from_root().find_map(|s| {
                s.extensions()
                    .get::<Fields>()
                    .and_then(|f| f.0.get("route").cloned())
            })
        });
        let message = fields.0.get("message").cloned().unwrap_or_default();
        self.0
            .lock()
            .unwrap()
            .events
            .push((*event.metadata().level(), message, route));
    }
    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id)
            && let Some(fields) = span.extensions_mut().remove::<Fields>()
        {
            self.0.lock().unwrap().spans.push(fields);
        }
    }
}

struct Observed {
    seen: Arc<Mutex<Seen>>,
    metrics: Snapshotter,
    totals: Mutex<HashMap<String, f64>>,
}

impl Observed {
    fn install() -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::LevelFilter::DEBUG)
            .with(Capture(seen.clone()));
        tracing::subscriber::set_global_default(subscriber).unwrap();
        let recorder = DebuggingRecorder::new();
        let metrics = recorder.snapshotter();
        recorder.install().unwrap();
        Observed {
            seen,
            metrics,
            totals: Mutex::default(),
        }
    }

    /// The value of a counter or gauge (summed since the start) or histogram
    /// (how many values) with exactly these labels; 0 when never touched. (A debugging
    /// recorder's snapshot drains all three, so they are summed here.)
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut totals = self.totals.lock().unwrap();
        for (key, _, _, value) in self.metrics.snapshot().into_vec() {
            let key = key.key();
            let mut id: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            id.sort();
            let id = format!("{}{{{}}}", key.name(), id.join(","));
            let total = totals.entry(id).or_insert(0.0);
            match value {
                DebugValue::Counter(n) => *total += n as f64,
                DebugValue::Gauge(g) => *total += g.into_inner(),
                DebugValue::Histogram(h) => *total += h.len() as f64,
            }
        }
        let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        want.sort();
        totals
            .get(&format!("{name}{{{}}}", want.join(",")))
            .copied()
            .unwrap_or(0.0)
    }

    fn outcomes(&self, route: &str, outcome: &str) -> f64 {
        self.value(REQUESTS_TOTAL, &[("route", route), ("outcome", outcome)])
    }

    fn events(&self, route: &str, event: &str) -> f64 {
        self.value(EVENTS_TOTAL, &[("route", route), ("event", event)])
    }

    /// The closed spans of `route`.
    fn spans(&self, route: &str) -> Vec<Fields> {
        let seen = self.seen.lock().unwrap();
        seen.spans
            .iter()
            .filter(|s| s.0.get("route").map(String::as_str) == Some(route))
            .cloned()
            .collect()
    }

    fn saw_event(&self, route: &str, level: tracing::Level, words: &str) -> bool {
        let seen = self.seen.lock().unwrap();
        seen.events
            .iter()
            .any(|(l, m, r)| *l == level && m.contains(words) && r.as_deref() == Some(route))
    }
}

fn request(scope: &str, key: &str, body: &str) -> ExecuteRequest {
    ExecuteRequest {
        scope: Scope::new(scope).unwrap(),
        key: IdempotencyKey::parse(key.as_bytes()),
        fingerprint: Fingerprint::compute(&FingerprintInput {
            method: "POST",
            path: "/obs",
            query: None,
            content_type: Some("text/plain"),
            body: body.as_bytes(),
        }),
    }
}

fn policy(route: &'static str) -> Policy {
    Policy {
        route,
        lease: Duration::from_secs(1),
        ..Policy::default()
    }
}

fn handled(status: u16) -> Handled<u16> {
    Handled {
        value: status,
        record: StoredResponse::new(status, "body").into(),
    }
}

/// A store that is down.
struct Down;

fn down() -> StoreError {
    StoreError::unavailable(std::io::Error::other("connection refused"))
}

#[async_trait::async_trait]
impl Store for Down {
    async fn claim(&self, _: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        Err(down())
    }
    async fn complete(
        &self,
        _: &RecordKey,
        _: LeaseToken,
        _: &StoredOutcome,
        _: Duration,
    ) -> Result<(), StoreError> {
        Err(down())
    }
    async fn release(&self, _: &RecordKey, _: LeaseToken) -> Result<(), StoreError> {
        Err(down())
    }
    async fn extend(
        &self,
        _: &RecordKey,
        _: LeaseToken,
        _: Duration,
    ) -> Result<std::time::SystemTime, StoreError> {
        Err(down())
    }
    async fn purge_expired(&self, _: usize) -> Result<u64, StoreError> {
        Err(down())
    }
    async fn get(
        &self,
        _: &RecordKey,
    ) -> Result<Option<idempotent_core::store::Record>, StoreError> {
        Err(down())
    }
    async fn delete(&self, _: &RecordKey, _: bool) -> Result<Deleted, StoreError> {
        Err(down())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_and_event_is_traced_and_counted() {
    // Every claim answers 40 ms late, so the claim's time in a span has a known floor.
    const CLAIM_DELAY: Duration = Duration::from_millis(40);
    let o = Observed::install();
    let slow = FaultyStore::new(MemoryStore::new());
    slow.delay_claims(CLAIM_DELAY);
    let engine = Engine::from_arc(slow);

    // executed, then replayed: one span each, with the key hashed and the claim timed.
    let p = policy("obs_basic");
    let mut requests_took = Vec::new();
    let started = std::time::Instant::now();
    let first = engine.execute(request("acct", "k1", "a"), &p, || async { handled(201) });
    assert!(matches!(first.await, Outcome::Executed { .. }));
    requests_took.push(started.elapsed());
    let started = std::time::Instant::now();
    let replay = engine.execute(request("acct", "k1", "a"), &p, || async { handled(201) });
    assert!(matches!(replay.await, Outcome::Replayed(_)));
    requests_took.push(started.elapsed());
    assert_eq!(o.outcomes("obs_basic", "executed"), 1.0);
    assert_eq!(o.outcomes("obs_basic", "replayed"), 1.0);
    let spans = o.spans("obs_basic");
    assert_eq!(spans.len(), 2, "{spans:?}");
    for (span, took) in spans.iter().zip(&requests_took) {
        let key = &span.0["key"];
        assert_eq!(key.len(), 16, "{span:?}");
        assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(
            !span
                .0
                .values()
                .any(|v| v.contains("k1") || v.contains("acct")),
            "{span:?}"
        );
        // The claim's time, in milliseconds: at least the store's delay, at most the whole
        // request.
        let store_ms = span.0["store_ms"].parse::<f64>().unwrap();
        let (floor, ceiling) = (CLAIM_DELAY.as_secs_f64() * 1e3, took.as_secs_f64() * 1e3);
        assert!(
            (floor..=ceiling).contains(&store_ms),
            "store_ms {store_ms} outside [{floor}, {ceiling}]: {span:?}"
        );
    }
    assert_eq!(spans[0].0["key"], spans[1].0["key"], "one record, one hash");
    assert_eq!(spans[0].0["outcome"], "executed");
    assert_eq!(spans[0].0["recorded"], "stored");
    assert_eq!(spans[1].0["outcome"], "replayed");
    assert!(o.value(STORE_SECONDS, &[("operation", "claim")]) >= 2.0);
    assert!(o.value(STORE_SECONDS, &[("operation", "complete")]) >= 1.0);

    // mismatch, rejected.
    let other = engine.execute(request("acct", "k1", "b"), &p, || async { handled(201) });
    assert!(matches!(other.await, Outcome::Mismatch { .. }));
    let bad = engine.execute(request("acct", "", "a"), &p, || async { handled(201) });
    assert!(matches!(bad.await, Outcome::KeyRejected(_)));
    assert_eq!(o.outcomes("obs_basic", "mismatch"), 1.0);
    assert_eq!(o.outcomes("obs_basic", "rejected"), 1.0);

    // in_progress, and the in-flight gauge while the first one runs.
    let p = policy("obs_busy");
    let Begin::Claimed(running) = engine.begin(request("acct", "k2", "a"), &p).await else {
        panic!("not claimed");
    };
    assert_eq!(o.value(IN_FLIGHT, &[]), 1.0);
    let busy = engine.execute(request("acct", "k2", "a"), &p, || async { handled(201) });
    assert!(matches!(busy.await, Outcome::InProgress { .. }));
    assert_eq!(o.outcomes("obs_busy", "in_progress"), 1.0);
    // released: a 5xx outcome.
    assert!(matches!(
        running
            .finish(StoredResponse::new(503, "try again").into())
            .await,
        Recorded::Released
    ));
    assert_eq!(o.value(IN_FLIGHT, &[]), 0.0);
    assert_eq!(o.events("obs_busy", "released"), 1.0);
    let released = o.spans("obs_busy");
    assert!(
        released
            .iter()
            .any(|s| s.0.get("recorded").map(String::as_str) == Some("released"))
    );

    // store_unavailable: the handler does not run.
    let p = policy("obs_down");
    let broken = Engine::new(Down);
    let out = broken.execute(request("acct", "k3", "a"), &p, || async {
        panic!("the handler ran with the store down");
        #[allow(unreachable_code)]
        handled(201)
    });
    assert!(matches!(out.await, Outcome::StoreUnavailable(_)));
    assert_eq!(o.outcomes("obs_down", "store_unavailable"), 1.0);
    assert!(o.saw_event("obs_down", tracing::Level::ERROR, "claim failed"));

    // takeover and fence refusal: the first attempt's lease runs out (its process "froze"),
    // a retry takes over, the first one's complete is refused.
    let clock = Arc::new(ManualClock::new());
    let engine = Engine::new(MemoryStore::builder().clock(clock.clone()).build());
    let p = policy("obs_fence");
    let Begin::Claimed(frozen) = engine.begin(request("acct", "k4", "a"), &p).await else {
        panic!("not claimed");
    };
    clock.advance(Duration::from_secs(2));
    let Begin::Claimed(taker) = engine.begin(request("acct", "k4", "a"), &p).await else {
        panic!("no takeover");
    };
    assert_eq!(o.events("obs_fence", "takeover"), 1.0);
    assert!(o.saw_event("obs_fence", tracing::Level::INFO, "took over"));
    assert!(matches!(
        frozen.finish(StoredResponse::new(201, "late").into()).await,
        Recorded::Failed(StoreError::StaleLease)
    ));
    assert_eq!(o.events("obs_fence", "fence_refused"), 1.0);
    assert!(o.saw_event("obs_fence", tracing::Level::WARN, "fence refused"));
    assert!(matches!(
        taker
            .finish(StoredResponse::new(201, "stands").into())
            .await,
        Recorded::Stored
    ));

    // complete_failed: the store keeps failing the complete for half the lease.
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next_completes(1_000);
    let engine = Engine::from_arc(store.clone());
    let p = policy("obs_failed");
    let out = engine.execute(request("acct", "k5", "a"), &p, || async { handled(201) });
    assert!(matches!(
        out.await,
        Outcome::Executed {
            recorded: Recorded::Failed(_),
            ..
        }
    ));
    assert_eq!(o.events("obs_failed", "complete_failed"), 1.0);
    assert!(o.saw_event("obs_failed", tracing::Level::ERROR, "could not be stored"));
    let failed = o.spans("obs_failed");
    assert_eq!(failed[0].0["recorded"], "failed");

    // The automatic sweeper: started by the engine's first request, once however many
    // requests (or workers) share it, stopped by the drain.
    let store = FaultyStore::new(MemoryStore::new());
    let engine = Engine::builder_from_arc(store.clone())
        .sweep_every(Duration::from_millis(200))
        .build()
        .unwrap();
    assert!(!engine.sweeper_running());
    let p = policy("obs_sweep");
    let mut tasks = Vec::new();
    for i in 0..8 {
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move {
            let req = request("acct", &format!("s{i}"), "a");
            engine.execute(req, &p, || async { handled(201) }).await
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(engine.sweeper_running());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let sweeps = store.purges();
    // One sweeper: a sweep at once, then one every 200 ms (eight would sweep ~40 times).
    assert!((4..=8).contains(&sweeps), "{sweeps} sweeps in 1.1 s");
    assert!(o.value(STORE_SECONDS, &[("operation", "purge")]) >= 4.0);
    engine.drain(Duration::from_secs(1)).await;
    assert!(!engine.sweeper_running());
    let after = store.purges();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(store.purges(), after, "the drain stopped the sweeper");

    // Waits: started, and how each ended (replayed, timed out, over the bound), with times.
    let engine = Engine::builder(MemoryStore::new())
        .max_waiting_per_key(1)
        .build()
        .unwrap();
    let p = Policy {
        wait: Duration::from_millis(300),
        ..policy("obs_wait")
    };
    let Begin::Claimed(first) = engine.begin(request("acct", "w1", "a"), &p).await else {
        panic!("not claimed")
    };
    let timed_out = engine.begin(request("acct", "w1", "a"), &p).await;
    assert!(
        matches!(timed_out, Begin::InProgress { .. }),
        "{timed_out:?}"
    );
    let waiter = {
        let (engine, p) = (engine.clone(), p);
        tokio::spawn(async move { engine.begin(request("acct", "w1", "a"), &p).await })
    };
    while engine.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    let over = engine.begin(request("acct", "w1", "a"), &p).await;
    assert!(matches!(over, Begin::InProgress { .. }), "{over:?}");
    first.finish(StoredResponse::new(201, "ok").into()).await;
    assert!(matches!(waiter.await.unwrap(), Begin::Replay(_)));
    assert_eq!(o.events("obs_wait", "wait_started"), 2.0);
    for (outcome, n) in [("replayed", 1.0), ("timed_out", 1.0), ("over_bound", 1.0)] {
        let labels = [("route", "obs_wait"), ("outcome", outcome)];
        assert_eq!(o.value(WAITS_TOTAL, &labels), n, "{outcome}");
        assert_eq!(o.value(WAIT_SECONDS, &labels), n, "{outcome}");
    }
}
