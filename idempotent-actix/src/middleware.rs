//! The middleware: installs the configuration on every request it wraps.

use crate::config::Idempotency;
use actix_web::Error;
use actix_web::HttpMessage;
use actix_web::dev::{Service, ServiceRequest, ServiceResponse, Transform, forward_ready};
use std::future::{Ready, ready};

impl Idempotency {
    /// The middleware that installs this configuration: `App::new().wrap(idempotency.middleware())`.
    /// `HttpServer` builds the app once per worker; every worker shares this one configuration.
    pub fn middleware(&self) -> IdempotencyMiddleware {
        IdempotencyMiddleware {
            config: self.clone(),
        }
    }
}

/// Installs an [`Idempotency`] on the services it wraps (see the crate docs). It reads nothing
/// itself: an `#[idempotent]` handler's hidden first extractor checks the key, then reads the
/// body for the fingerprint and hands it on to the handler's own extractors.
#[derive(Debug, Clone)]
pub struct IdempotencyMiddleware {
    pub(crate) config: Idempotency,
}

impl<S, B> Transform<S, ServiceRequest> for IdempotencyMiddleware
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
{
    type Response = ServiceResponse<B>;
    type Error = Error;
    type Transform = IdempotencyService<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotencyService {
            service,
            config: self.config.clone(),
        }))
    }
}

/// The service of [`IdempotencyMiddleware`].
#[derive(Debug)]
pub struct IdempotencyService<S> {
    service: S,
    config: Idempotency,
}

impl<S, B> Service<ServiceRequest> for IdempotencyService<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
{
    type Response = ServiceResponse<B>;
    type Error = Error;
    type Future = S::Future;

    forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        req.extensions_mut().insert(self.config.clone());
        self.service.call(req)
    }
}
