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
use schemars::JsonSchema;
use serde::Serialize;

use crate::contract::{InputError, InputErrorClass};

/// Every code the HTTP listeners answer with besides the contract's classes
/// (which name what a body or an input broke: see [`ApiError::class`]).
/// Each code has one status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    /// A missing, malformed, unknown, expired or revoked key; which one is
    /// not said.
    Unauthenticated,
    InsufficientScope,
    TenantMismatch,
    /// Without authentication, a run endpoint's request names no tenant.
    MissingTenant,
    /// A key past its rate, or an address past its failed authentications.
    RateLimited,
    Overloaded,
    Timeout,
    BodyTimeout,
    BodyTooLarge,
    BodyIncomplete,
    UnsupportedMediaType,
    InvalidJson,
    InvalidRequest,
    InvalidIdempotencyKey,
    /// A query string parameter of an operator's view is wrong.
    InvalidQuery,
    InProgress,
    IdempotencyKeyMismatch,
    IdempotencyMismatch,
    UnknownWorkflow,
    NotFound,
    RunPurged,
    SigningKeyMissing,
    Unavailable,
    Contended,
    /// A dead letter already discarded (not replayed) or replayed (not
    /// discarded).
    LetterSettled,
    /// A dead letter whose record does not hold what a replay sends.
    NotReplayable,
    /// A retry of a run that is not failed.
    RunNotFailed,
    /// A retry of a run that failed compensated: nothing is left to retry.
    RunCompensated,
    Internal,
}

impl Code {
    /// Every code, for the tests of the API's description.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))]
    pub const ALL: [Code; 29] = [
        Code::Unauthenticated,
        Code::InsufficientScope,
        Code::TenantMismatch,
        Code::MissingTenant,
        Code::RateLimited,
        Code::Overloaded,
        Code::Timeout,
        Code::BodyTimeout,
        Code::BodyTooLarge,
        Code::BodyIncomplete,
        Code::UnsupportedMediaType,
        Code::InvalidJson,
        Code::InvalidRequest,
        Code::InvalidIdempotencyKey,
        Code::InvalidQuery,
        Code::InProgress,
        Code::IdempotencyKeyMismatch,
        Code::IdempotencyMismatch,
        Code::UnknownWorkflow,
        Code::NotFound,
        Code::RunPurged,
        Code::SigningKeyMissing,
        Code::Unavailable,
        Code::Contended,
        Code::LetterSettled,
        Code::NotReplayable,
        Code::RunNotFailed,
        Code::RunCompensated,
        Code::Internal,
    ];

    /// The stable name a caller branches on.
    pub const fn as_str(self) -> &'static str {
        match self {
            Code::Unauthenticated => "unauthenticated",
            Code::InsufficientScope => "insufficient_scope",
            Code::TenantMismatch => "tenant_mismatch",
            Code::MissingTenant => "missing_tenant",
            Code::RateLimited => "rate_limited",
            Code::Overloaded => "overloaded",
            Code::Timeout => "timeout",
            Code::BodyTimeout => "body_timeout",
            Code::BodyTooLarge => "body_too_large",
            Code::BodyIncomplete => "body_incomplete",
            Code::UnsupportedMediaType => "unsupported_media_type",
            Code::InvalidJson => "invalid_json",
            Code::InvalidRequest => "invalid_request",
            Code::InvalidIdempotencyKey => "invalid_idempotency_key",
            Code::InvalidQuery => "invalid_query",
            Code::InProgress => "in_progress",
            Code::IdempotencyKeyMismatch => "idempotency_key_mismatch",
            Code::IdempotencyMismatch => "idempotency_mismatch",
            Code::UnknownWorkflow => "unknown_workflow",
            Code::NotFound => "not_found",
            Code::RunPurged => "run_purged",
            Code::SigningKeyMissing => "signing_key_missing",
            Code::Unavailable => "unavailable",
            Code::Contended => "contended",
            Code::LetterSettled => "letter_settled",
            Code::NotReplayable => "not_replayable",
            Code::RunNotFailed => "run_not_failed",
            Code::RunCompensated => "run_compensated",
            Code::Internal => "internal",
        }
    }

    /// The status every answer with this code has.
    pub const fn status(self) -> StatusCode {
        match self {
            Code::MissingTenant
            | Code::BodyIncomplete
            | Code::InvalidJson
            | Code::InvalidRequest
            | Code::InvalidIdempotencyKey
            | Code::InvalidQuery => StatusCode::BAD_REQUEST,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::InsufficientScope | Code::TenantMismatch | Code::SigningKeyMissing => {
                StatusCode::FORBIDDEN
            }
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Code::InProgress | Code::LetterSettled | Code::RunNotFailed | Code::RunCompensated => {
                StatusCode::CONFLICT
            }
            Code::RunPurged => StatusCode::GONE,
            Code::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Code::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Code::IdempotencyKeyMismatch
            | Code::IdempotencyMismatch
            | Code::UnknownWorkflow
            | Code::NotReplayable => StatusCode::UNPROCESSABLE_ENTITY,
            Code::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Overloaded | Code::Timeout | Code::Unavailable | Code::Contended => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }
}

/// The body of every refusal: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "Error")]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

/// What went wrong.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorDetail<'a> {
    /// Stable: a caller branches on it.
    pub code: &'a str,
    /// For people; bounded, and never echoes what was sent.
    pub message: &'a str,
}

impl ErrorBody<'_> {
    /// The answer with `status` and this body, as JSON.
    pub fn response(&self, status: StatusCode) -> Response {
        (status, axum::Json(self)).into_response()
    }
}

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
    pub(crate) fn new(code: Code, message: impl Into<String>) -> Self {
        Self::class(code.status(), code.as_str(), message)
    }

    /// An answer whose code is a class of the contract or of the apply
    /// path (`invalid`, `nul_character`, `data_exception`, ...), with the
    /// status its refusal has here.
    pub(crate) fn class(
        status: StatusCode,
        class: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            code: class,
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
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: &self.message,
            },
        };
        let mut response = body.response(self.status);
        response.headers_mut().extend(self.headers);
        response
    }
}

/// Every `reason` of `ductor_api_refused_total`: the guard's and the
/// body's refusals, and `auth_failures` (an address held back for failing
/// to authenticate, counted by the listeners).
pub(crate) const REFUSED_REASONS: [&str; 6] = [
    "overloaded",
    "timeout",
    "rate_limited",
    "body_timeout",
    "unsupported_media_type",
    "auth_failures",
];

/// Counts one request the listener refused before or instead of its work.
pub(crate) fn refused(reason: &'static str) {
    debug_assert!(REFUSED_REASONS.contains(&reason), "{reason} is not listed");
    metrics::counter!("ductor_api_refused_total", "reason" => reason).increment(1);
}

/// The answer to a body that is no acceptable JSON: 422 with the
/// screen's class for valid JSON that cannot be kept as sent, 413 for one
/// over the size limit, 400 for anything else.
pub fn body_error(error: InputError) -> ApiError {
    match error.class {
        InputErrorClass::Refused(violation) => ApiError::class(
            StatusCode::UNPROCESSABLE_ENTITY,
            violation.as_str(),
            error.message,
        ),
        InputErrorClass::TooLarge => ApiError::new(Code::BodyTooLarge, error.message),
        _ => ApiError::new(Code::InvalidJson, format!("the body is {}", error.message)),
    }
}

/// 503 for a query that failed: the caller retries, with the same key.
pub(crate) fn database(e: sqlx::Error) -> ApiError {
    tracing::warn!(error = %e, "routing query failed");
    ApiError::new(
        Code::Unavailable,
        "the database is unavailable; retry with the same key",
    )
}
