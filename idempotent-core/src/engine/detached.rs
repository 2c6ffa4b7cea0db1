//! A future that outlives its caller.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future that keeps running when it is dropped: if it is dropped before it finished (a
/// client that went away), the rest of it is spawned onto the current tokio runtime and runs
/// to completion there. Polled in place until then, so the common path costs no spawn. A
/// future that panics is dropped as the panic leaves it, never spawned again: the panic is
/// reported once.
///
/// This is how an HTTP adapter makes "client gone" different from "cancelled": the claimed
/// execution, its handler and the storing of its outcome live in the detached future.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use idempotent_core::__private::Detached;
/// let (tx, rx) = tokio::sync::oneshot::channel();
/// let work = Detached::new(async move {
///     tokio::task::yield_now().await;
///     let _ = tx.send("done");
/// });
/// // The caller gives up after the first poll ...
/// let _ = tokio::time::timeout(std::time::Duration::ZERO, work).await;
/// // ... and the work still finishes.
/// assert_eq!(rx.await, Ok("done"));
/// # }
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct Detached<F: Future + Send + 'static>
where
    F::Output: Send,
{
    fut: Option<Pin<Box<F>>>,
}

impl<F: Future + Send + 'static> Detached<F>
where
    F::Output: Send,
{
    /// Wraps `fut`.
    pub fn new(fut: F) -> Self {
        Detached {
            fut: Some(Box::pin(fut)),
        }
    }
}

impl<F: Future + Send + 'static> Future for Detached<F>
where
    F::Output: Send,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(fut) = self.fut.as_mut() else {
            // Polled after completion (or after it panicked): never ready again (as a fused
            // future would be).
            return Poll::Pending;
        };
        // A future that panicked is spent: it is dropped here, so the drop that the unwind
        // brings does not spawn it again (polled again it would only panic a second time).
        let out = match std::panic::catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(out)) => out,
            Err(panic) => {
                self.fut = None;
                std::panic::resume_unwind(panic)
            }
        };
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<F: Future + Send + 'static> Drop for Detached<F>
where
    F::Output: Send,
{
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                drop(rt.spawn(async move {
                    let _ = fut.await;
                }));
            }
            Err(_) => tracing::warn!(
                "idempotency: unfinished work dropped outside a tokio runtime; its record stays in progress until its lease ends"
            ),
        }
    }
}
