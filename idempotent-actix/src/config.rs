//! The configuration an application installs once: [`Idempotency`].

use idempotent_core::engine::Drained;
use std::time::Duration;

idempotent_core::__idempotency_type!(
    idempotent_actix,
    install = "`App::new().wrap(idempotency.middleware())`",
    drain = "Run it **before** actix stops its workers: a handler whose client went away keeps \
             running as a task on its worker's runtime, and actix's own graceful stop waits \
             only for connections, then drops that runtime with the task on it. \
             [`Idempotency::stop_server`] does it in that order."
);

impl Idempotency {
    /// Graceful shutdown in the order that loses no execution: stop accepting connections,
    /// [drain](Idempotency::drain) (at most `timeout`), then stop the server gracefully (its
    /// `shutdown_timeout` for open connections). Build the server with `.disable_signals()`
    /// and call this from your own signal handler.
    ///
    /// ```no_run
    /// # async fn demo(idempotency: idempotent_actix::Idempotency) -> std::io::Result<()> {
    /// use actix_web::{App, HttpServer};
    /// use std::time::Duration;
    ///
    /// let middleware = idempotency.middleware();
    /// let server = HttpServer::new(move || App::new().wrap(middleware.clone()))
    ///     .disable_signals()
    ///     .bind("127.0.0.1:8080")?
    ///     .run();
    /// let handle = server.handle();
    /// actix_web::rt::spawn(async move {
    ///     let _ = tokio::signal::ctrl_c().await;
    ///     idempotency.stop_server(&handle, Duration::from_secs(30)).await;
    /// });
    /// server.await
    /// # }
    /// ```
    pub async fn stop_server(
        &self,
        server: &actix_web::dev::ServerHandle,
        timeout: Duration,
    ) -> Drained {
        server.pause().await;
        let drained = self.drain(timeout).await;
        server.stop(true).await;
        drained
    }
}
