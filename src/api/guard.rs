//! What the public listener refuses before a handler does any work: more
//! requests at once than `server.max_concurrent_requests` (shed with 503
//! `overloaded`, not queued), and requests past `server.request_timeout_ms`
//! (503 `timeout`). Each refusal is counted in
//! `ductor_api_refused_total{reason}`.
//!
//! In: every request of the public listener. Out: the handler's response,
//! or 503 with `Retry-After`. Guarantees: at most `max_concurrent_requests`
//! handlers run at once, and none runs longer than `request_timeout_ms`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;

use super::error::{ApiError, Code, refused};
use crate::config::ServerConfig;

/// The bounds of the public API, shared by its requests.
#[derive(Clone)]
pub struct Guard {
    permits: Arc<Semaphore>,
    timeout: Duration,
}

impl Guard {
    pub fn new(server: &ServerConfig) -> Self {
        Guard {
            permits: Arc::new(Semaphore::new(server.max_concurrent_requests)),
            timeout: Duration::from_millis(server.request_timeout_ms),
        }
    }
}

/// The middleware: a permit for the request's whole life, within its time.
pub(crate) async fn guard(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let Ok(_permit) = guard.permits.clone().try_acquire_owned() else {
        refused("overloaded");
        return ApiError::new(Code::Overloaded, "too many requests at once; retry shortly")
            .with_header(axum::http::header::RETRY_AFTER, "1")
            .into_response();
    };
    match tokio::time::timeout(guard.timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            refused("timeout");
            ApiError::new(
                Code::Timeout,
                format!(
                    "the request took longer than {} ms; retry (with the same idempotency key)",
                    guard.timeout.as_millis()
                ),
            )
            .with_header(axum::http::header::RETRY_AFTER, "1")
            .into_response()
        }
    }
}
