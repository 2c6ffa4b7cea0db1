//! A background task that deletes expired records.

use crate::observe;
use crate::store::Store;
use std::sync::Arc;
use std::time::Duration;

/// Calls [`Store::purge_expired`] every `interval`, in batches of `batch`, until stopped.
///
/// Within one tick it keeps purging while full batches come back, so a backlog drains without
/// one huge delete. Dropping the handle stops the task; [`Sweeper::shutdown`] stops it and waits.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_core::{MemoryStore, store::Sweeper};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let sweeper = Sweeper::spawn(Arc::new(MemoryStore::new()), Duration::from_secs(60), 1_000);
/// sweeper.shutdown().await;
/// # }
/// ```
#[derive(Debug)]
pub struct Sweeper {
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Sweeper {
    /// Starts sweeping on the current tokio runtime.
    ///
    /// # Panics
    /// Outside a tokio runtime (as `tokio::spawn` does).
    pub fn spawn<S: Store + ?Sized>(store: Arc<S>, interval: Duration, batch: usize) -> Self {
        let batch = batch.max(1);
        // `tokio::time::interval` panics on zero.
        let interval = interval.max(Duration::from_millis(1));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // Bounded: at most 100 batches per tick, then yield to the next tick.
                for _ in 0..100 {
                    match observe::timed("purge", store.purge_expired(batch)).await {
                        Ok(n) if n as usize >= batch => tokio::task::yield_now().await,
                        _ => break,
                    }
                }
            }
        });
        Sweeper { task: Some(task) }
    }

    /// Whether the task is alive (it stops when shut down, or when its runtime goes away).
    pub fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the task and waits until it has stopped.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
