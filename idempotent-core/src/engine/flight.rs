//! What [`Engine::drain`](super::Engine::drain) waits for: the executions in flight, and the
//! automatic sweeper it stops.

use super::Inner;
use crate::observe;
use crate::store::Store;
use crate::store::sweeper::Sweeper;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Executions in flight, for [`Engine::drain`](super::Engine::drain).
#[derive(Default)]
pub(super) struct Flight {
    pub(super) running: AtomicUsize,
    pub(super) draining: AtomicBool,
    pub(super) idle: tokio::sync::Notify,
    /// Executions dropped before they finished (their records stay in progress).
    pub(super) dropped: AtomicUsize,
}

/// One request counted towards [`Engine::drain`](super::Engine::drain) from before its claim
/// until its execution finishes (or the claim found nothing to run).
pub(crate) struct InFlight {
    pub(crate) engine: Arc<Inner>,
}

impl InFlight {
    pub(crate) fn enter(engine: Arc<Inner>) -> Self {
        engine.flight.running.fetch_add(1, Ordering::SeqCst);
        observe::in_flight(1.0);
        InFlight { engine }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        observe::in_flight(-1.0);
        let flight = &self.engine.flight;
        // Only a drain waits for the count; both sides use SeqCst, so either the drain sees
        // this decrement when it reads the count, or this sees the drain's flag and wakes it.
        if flight.running.fetch_sub(1, Ordering::SeqCst) == 1
            && flight.draining.load(Ordering::SeqCst)
        {
            flight.idle.notify_waiters();
        }
    }
}

/// The engine's sweeper ([`EngineBuilder::sweep_every`](super::EngineBuilder::sweep_every)):
/// started on the current tokio runtime by the engine's first request, once per engine however
/// many workers share it, and stopped by [`Engine::drain`](super::Engine::drain).
#[derive(Default)]
pub(crate) struct AutoSweep {
    /// The interval in milliseconds; 0: no automatic sweeper.
    interval_ms: AtomicU64,
    started: AtomicBool,
    task: std::sync::Mutex<Option<Sweeper>>,
}

impl AutoSweep {
    /// Records expired rows deleted per batch.
    const BATCH: usize = 1_000;

    pub(crate) fn configure(&self, every: Option<Duration>) {
        let ms = every.map_or(0, |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
        });
        self.interval_ms.store(ms, Ordering::SeqCst);
    }

    /// Starts the sweeper if one is configured and none was started (cheap after the first
    /// call: one atomic load). The flag is set and the task stored under one lock, so a drain
    /// racing the first request either stops the sweeper or keeps it from starting.
    pub(crate) fn ensure(&self, store: &Arc<dyn Store>) {
        if self.started.load(Ordering::Acquire) {
            return;
        }
        let ms = self.interval_ms.load(Ordering::Acquire);
        if ms == 0 || store.expires_by_itself() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        *task = Some(Sweeper::spawn(
            Arc::clone(store),
            Duration::from_millis(ms),
            Self::BATCH,
        ));
    }

    /// Whether the sweeper's task is alive (not when its runtime went away).
    pub(crate) fn is_running(&self) -> bool {
        self.task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(Sweeper::is_running)
    }

    /// Stops the sweeper (for good: a drained engine starts no other).
    pub(crate) async fn stop(&self) {
        let sweeper = {
            let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
            self.started.store(true, Ordering::SeqCst);
            task.take()
        };
        if let Some(sweeper) = sweeper {
            sweeper.shutdown().await;
        }
    }
}
