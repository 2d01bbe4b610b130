//! How the public API says no: every refusal is an [`ApiError`], answered
//! as JSON `{"error": {"code": "...", "message": "..."}}` with a status and
//! a stable `code` a caller can branch on.
//!
//! In: what went wrong (a body the contract refused, a database that did not
//! answer, a bound the guard enforced). Out: the error answer, and for the
//! guard's refusals one count in `ductor_api_refused_total{reason}`.
//!
//! Guarantees: a leaf of the stage; it knows nothing of handlers or state, so
//! every room of the API can use it and none of them is used back.

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::contract::{InputError, InputErrorClass};

/// An error answer with a stable code.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Extra response headers (`WWW-Authenticate`, `Retry-After`).
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    pub(crate) fn with_header(mut self, name: HeaderName, value: &'static str) -> Self {
        self.headers.push((name, HeaderValue::from_static(value)));
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        let mut response = (self.status, axum::Json(body)).into_response();
        response.headers_mut().extend(self.headers);
        response
    }
}

/// Counts one request the listener refused before or instead of its work.
pub(crate) fn refused(reason: &'static str) {
    metrics::counter!("ductor_api_refused_total", "reason" => reason).increment(1);
}

/// The answer to a body that is no acceptable JSON: 422 with the
/// screen's class for valid JSON that cannot be kept as sent, 413 for one
/// over the size limit, 400 for anything else.
pub fn body_error(error: InputError) -> ApiError {
    match error.class {
        InputErrorClass::Refused(violation) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            violation.as_str(),
            error.message,
        ),
        InputErrorClass::TooLarge => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            error.message,
        ),
        _ => ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the body is {}", error.message),
        ),
    }
}

/// 503 for a query that failed: the caller retries, with the same key.
pub(crate) fn database(e: sqlx::Error) -> ApiError {
    tracing::warn!(error = %e, "routing query failed");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        "the database is unavailable; retry with the same key",
    )
}
