//! The signal both example services stop on.

/// Resolves on Ctrl-C or SIGTERM, for `axum::serve(..).with_graceful_shutdown`:
/// requests in flight finish (their locks released, their transactions
/// committed) before the service stops. A signal that cannot be listened
/// for is logged and never fires; the other still does.
///
/// ```no_run
/// # async fn demo(listener: tokio::net::TcpListener, app: axum::Router) -> std::io::Result<()> {
/// axum::serve(listener, app).with_graceful_shutdown(dlock_examples::shutdown::signal()).await
/// # }
/// ```
pub async fn signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: finishing requests in flight");
}
