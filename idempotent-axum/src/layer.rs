//! The tower layer: installs the configuration and makes unsafe requests' bodies readable
//! twice (once for the fingerprint, once by the handler's own body extractor), without
//! reading them itself.

use crate::config::Idempotency;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use idempotent_core::__private::is_safe_method;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll};

impl Idempotency {
    /// The tower layer that installs this configuration: `.layer(idempotency.layer())`.
    pub fn layer(&self) -> IdempotencyLayer {
        IdempotencyLayer {
            config: self.clone(),
        }
    }
}

/// Installs an [`Idempotency`] on the routes it wraps (see the crate docs).
///
/// The layer itself reads nothing: an `#[idempotent]` handler's hidden first extractor checks
/// the key, then reads the body (up to the configured limit) for the fingerprint and leaves it
/// for the handler's own extractors. Other handlers under the layer read their bodies as usual.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    pub(crate) config: Idempotency,
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service of [`IdempotencyLayer`].
#[derive(Debug, Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Idempotency,
}

impl<S> tower_service::Service<Request> for IdempotencyService<S>
where
    S: tower_service::Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        if !is_safe_method(req.method().as_str()) {
            let (mut parts, body) = req.into_parts();
            let slot = BodySlot(Arc::new(Mutex::new(Slot::Unread(body))));
            parts.extensions.insert(slot.clone());
            req = Request::from_parts(
                parts,
                Body::new(SlotBody {
                    slot,
                    reading: None,
                }),
            );
        }
        req.extensions_mut().insert(self.config.clone());
        self.inner.call(req)
    }
}

/// The request body, shared between the idempotency context (which may read it first) and
/// the body the handler's extractor reads.
#[derive(Clone)]
pub(crate) struct BodySlot(Arc<Mutex<Slot>>);

pub(crate) enum Slot {
    /// Nobody has read it: whoever comes first takes it.
    Unread(Body),
    /// Being read by the idempotency context.
    Reading,
    /// Read by the idempotency context: the handler's extractor gets these bytes.
    Read(Bytes),
    /// Taken by the handler's extractor (no `#[idempotent]` context read it).
    Taken,
}

impl BodySlot {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        // Never held across an await; a poisoned lock only means a panic elsewhere.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the unread body for the idempotency context to read.
    pub(crate) fn take_for_reading(&self) -> Option<Body> {
        let mut slot = self.lock();
        match std::mem::replace(&mut *slot, Slot::Reading) {
            Slot::Unread(body) => Some(body),
            other => {
                *slot = other;
                None
            }
        }
    }

    /// Leaves the bytes the context read for the handler's extractor (an empty body after a
    /// failed read: the request is refused before any extractor runs anyway).
    pub(crate) fn put_read(&self, bytes: Bytes) {
        *self.lock() = Slot::Read(bytes);
    }
}

/// The body the handler's extractor sees: the context's copy if it read one, otherwise the
/// original body, streamed through.
struct SlotBody {
    slot: BodySlot,
    reading: Option<Body>,
}

impl HttpBody for SlotBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if this.reading.is_none() {
            let mut slot = this.slot.lock();
            match std::mem::replace(&mut *slot, Slot::Taken) {
                Slot::Unread(body) => this.reading = Some(body),
                Slot::Read(bytes) if bytes.is_empty() => return Poll::Ready(None),
                Slot::Read(bytes) => return Poll::Ready(Some(Ok(Frame::data(bytes)))),
                Slot::Reading => {
                    *slot = Slot::Reading;
                    return Poll::Ready(Some(Err(axum::Error::new(
                        "the request body is being read by the idempotency context",
                    ))));
                }
                Slot::Taken => return Poll::Ready(None),
            }
        }
        match this.reading.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn size_hint(&self) -> SizeHint {
        if let Some(body) = &self.reading {
            return body.size_hint();
        }
        match &*self.slot.lock() {
            Slot::Unread(body) => body.size_hint(),
            Slot::Read(bytes) => SizeHint::with_exact(bytes.len() as u64),
            Slot::Reading | Slot::Taken => SizeHint::with_exact(0),
        }
    }
}
