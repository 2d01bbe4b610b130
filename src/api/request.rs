//! What every handler does with a request before its own work: who sent it
//! (the key, its scope, its rate), which tenant it acts as, and its body.
//!
//! In: the request's headers and body. Out: an [`Identity`], a tenant, the
//! body's bytes, the span of the request in the caller's trace, or the
//! [`ApiError`] that answers instead. Guarantees: a
//! body is read up to `routing.max_body_bytes` and within
//! `server.body_read_timeout_ms`, and only when it says it is JSON; a
//! key's rate is spent before any work is done for it.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, header};

use super::ApiState;
use super::error::{ApiError, Code, database, refused};
use crate::auth::{AuthError, Identity, Scope, TenantError};
use crate::contract::TraceContext;
use crate::contract::headers::{TRACEPARENT, TRACESTATE};
use crate::infra::traces;

/// The span of one API request, continuing the caller's W3C trace
/// (`traceparent`, `tracestate`; a malformed one is ignored), and the
/// context of the request's next hop: what the run or the input it makes
/// carries on.
pub(crate) fn traced(
    headers: &HeaderMap,
    span: tracing::Span,
) -> (tracing::Span, Option<TraceContext>) {
    let values = |name: &'static str| headers.get_all(name).into_iter().map(HeaderValue::as_bytes);
    let caller = TraceContext::from_values(values(TRACEPARENT), values(TRACESTATE));
    let hop = traces::hop(&span, caller.as_ref());
    (span, hop)
}

/// Who sent `headers`, if it may do what needs `scope`.
pub(crate) async fn authenticate(
    state: &ApiState,
    headers: &HeaderMap,
    scope: Scope,
) -> Result<Identity, ApiError> {
    authenticate_any(state, headers, &[scope]).await
}

/// Who sent `headers`, if its key has one of `scopes`.
pub(crate) async fn authenticate_any(
    state: &ApiState,
    headers: &HeaderMap,
    scopes: &[Scope],
) -> Result<Identity, ApiError> {
    let authorization = headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    let identity = state
        .auth
        .authenticate_any(authorization, scopes)
        .await
        .map_err(|e| match e {
            AuthError::Unauthenticated(_) => ApiError::new(
                Code::Unauthenticated,
                "a valid API key is required: Authorization: Bearer <key>",
            )
            .with_header(header::WWW_AUTHENTICATE, "Bearer"),
            AuthError::MissingScope(scope) => ApiError::new(
                Code::InsufficientScope,
                format!("this key does not have the {} scope", scope.as_str()),
            ),
            AuthError::Unavailable(e) => database(e),
        })?;
    if let Identity::Key(caller) = &identity {
        let now = std::time::Instant::now();
        if let Err(wait) = state
            .rates
            .admit(&caller.key_id, caller.requests_per_second, now)
        {
            refused("rate_limited");
            let mut error = ApiError::new(
                Code::RateLimited,
                "this key's request rate is used up; retry after the Retry-After seconds",
            );
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            error
                .headers
                .push((header::RETRY_AFTER, HeaderValue::from(seconds.max(1))));
            return Err(error);
        }
    }
    Ok(identity)
}

/// The tenant a request acts as (see [`crate::auth::tenant_for`]).
pub(crate) fn tenant(
    identity: &Identity,
    named: Option<&str>,
    default: Option<&str>,
) -> Result<String, ApiError> {
    crate::auth::tenant_for(identity, named, default).map_err(tenant_refusal)
}

/// The tenants an operator's request sees (see [`crate::auth::tenants_seen`]):
/// one, or every one (`None`).
pub(crate) fn tenants_seen(
    identity: &Identity,
    named: Option<&str>,
) -> Result<Option<String>, ApiError> {
    crate::auth::tenants_seen(identity, named).map_err(tenant_refusal)
}

fn tenant_refusal(e: TenantError) -> ApiError {
    match e {
        TenantError::Mismatch => ApiError::new(
            Code::TenantMismatch,
            "the request names a tenant other than its API key's",
        ),
        TenantError::Missing => ApiError::new(
            Code::MissingTenant,
            "the X-Ductor-Tenant header is required",
        ),
    }
}

/// A request's body, up to `routing.max_body_bytes` and within
/// `server.body_read_timeout_ms`. A body must say it is JSON.
pub(crate) async fn read_body(
    state: &ApiState,
    request: Request<Body>,
) -> Result<axum::body::Bytes, ApiError> {
    let json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json);
    let limit = state.routing.max_body_bytes;
    let read =
        http_body_util::BodyExt::collect(http_body_util::Limited::new(request.into_body(), limit));
    let bytes = tokio::time::timeout(state.body_read_timeout, read)
        .await
        .map_err(|_| {
            refused("body_timeout");
            ApiError::new(
                Code::BodyTimeout,
                format!(
                    "the body did not arrive within {} ms",
                    state.body_read_timeout.as_millis()
                ),
            )
        })?
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::new(
                    Code::BodyTooLarge,
                    format!("the request body exceeds {limit} bytes"),
                )
            } else {
                ApiError::new(Code::BodyIncomplete, "the body ended before its length")
            }
        })?
        .to_bytes();
    if !bytes.is_empty() && !json {
        refused("unsupported_media_type");
        return Err(ApiError::new(
            Code::UnsupportedMediaType,
            "a body must be sent with Content-Type: application/json",
        ));
    }
    Ok(bytes)
}

/// `application/json`, with or without parameters (`; charset=utf-8`).
fn is_json(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

#[cfg(test)]
mod tests {
    use super::is_json;

    #[test]
    fn json_is_json_whatever_its_parameters_and_case() {
        for yes in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
        ] {
            assert!(is_json(yes), "{yes}");
        }
        for no in [
            "",
            "text/plain",
            "application/jsonx",
            "application/x-www-form-urlencoded",
        ] {
            assert!(!is_json(no), "{no}");
        }
    }
}
