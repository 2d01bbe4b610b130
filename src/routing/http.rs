//! The public HTTP API: the ingress of the routing plane, for callers who
//! want a synchronous answer, and the run endpoints beside it
//! ([`super::runs`]). Every request carries `Authorization: Bearer <key>`
//! (see [`crate::auth`]) and acts as its key's tenant:
//!
//! - `POST /v1/runs` with an optional `Idempotency-Key` header starts a run:
//!   201 with the decision when it is new, 200 with the same body for a
//!   duplicate, 409 while the first caller is still deciding under the
//!   `reject` policy (or when a `wait` ran out), 422 when the key was used for
//!   a different request or the workflow is unknown;
//! - `GET /v1/runs/{id}` returns the run;
//! - `POST /v1/runs/{id}/signals` and `POST /v1/runs/{id}/cancel` put a
//!   signal or a cancel for the run on the wakeups topic.
//!
//! Errors are JSON, `{"error": {"code": "...", "message": "..."}}`, with a
//! stable `code`: 401 `unauthenticated` for a missing, unknown, expired or
//! revoked key (which one is not said), 403 `insufficient_scope` and
//! `tenant_mismatch`.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::auth::rate::RateLimiter;
use crate::auth::{AuthError, Authenticator, Identity, Scope, TenantError};
use crate::config::{DuplicatePolicy, RoutingConfig};
use crate::contract::{InputError, InputErrorClass, InputLimits, parse_value};
use crate::routing::{
    self, Decide, DecideError, Reservation, ReserveKind, RouteOutcome, RouteRequest,
    RoutingDecision, WaiterStep,
};

/// How often a reservation is re-tried after it was lost to a sweep, before
/// the caller is told to come back.
const MAX_RESERVE_ROUNDS: u32 = 8;

#[derive(Clone)]
pub struct ApiState {
    /// Decides the runs, in the database the keys are reserved in.
    pub decider: Arc<dyn Decide>,
    pub routing: RoutingConfig,
    /// The bounds a body keeps, as every input does on Kafka.
    pub limits: InputLimits,
    /// Pokes the in-process drainer after a decision committed effects.
    pub wakeup: Option<crate::outbox::Wakeup>,
    /// Who the requests come from.
    pub auth: Authenticator,
    /// Where signals and cancels go.
    pub inputs: super::runs::InputSink,
    /// Each key's request rate.
    pub rates: Arc<RateLimiter>,
    /// Bound on reading a body once the headers are in.
    pub body_read_timeout: Duration,
    /// Concurrency and time bounds of every request.
    pub guard: super::guard::Guard,
}

pub fn router(state: ApiState) -> Router {
    let guard = state.guard.clone();
    Router::new()
        .route("/v1/runs", post(create_run))
        .route("/v1/runs/{run_id}", get(super::runs::get_run))
        .route("/v1/runs/{run_id}/signals", post(super::runs::signal_run))
        .route("/v1/runs/{run_id}/cancel", post(super::runs::cancel_run))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(
            guard,
            super::guard::guard,
        ))
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

/// Who sent `headers`, if it may do what needs `scope`.
pub(crate) async fn authenticate(
    state: &ApiState,
    headers: &HeaderMap,
    scope: Scope,
) -> Result<Identity, ApiError> {
    let authorization = headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    let identity = state
        .auth
        .authenticate(authorization, scope)
        .await
        .map_err(|e| match e {
            AuthError::Unauthenticated(_) => ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthenticated",
                "a valid API key is required: Authorization: Bearer <key>",
            )
            .with_header(header::WWW_AUTHENTICATE, "Bearer"),
            AuthError::MissingScope(scope) => ApiError::new(
                StatusCode::FORBIDDEN,
                "insufficient_scope",
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
            super::guard::refused("rate_limited");
            let mut error = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
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
    crate::auth::tenant_for(identity, named, default).map_err(|e| match e {
        TenantError::Mismatch => ApiError::new(
            StatusCode::FORBIDDEN,
            "tenant_mismatch",
            "the request names a tenant other than its API key's",
        ),
        TenantError::Missing => ApiError::new(
            StatusCode::BAD_REQUEST,
            "missing_tenant",
            "the X-Ductor-Tenant header is required",
        ),
    })
}

/// Sets a start body's `tenant` to the one the request acts as. A `tenant`
/// that is no string is left for the contract to refuse.
fn bind_tenant(body: &mut Value, identity: &Identity) -> Result<(), ApiError> {
    let Value::Object(obj) = body else {
        return Ok(());
    };
    let named = match obj.get("tenant") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(t.as_str()),
        Some(_) => return Ok(()),
    };
    let tenant = tenant(identity, named, Some("default"))?;
    obj.insert("tenant".into(), Value::String(tenant));
    Ok(())
}

/// The answer to a start request, as `submit` reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum Submitted {
    Created(RoutingDecision),
    Duplicate(RoutingDecision),
}

impl Submitted {
    pub fn decision(&self) -> &RoutingDecision {
        match self {
            Submitted::Created(d) | Submitted::Duplicate(d) => d,
        }
    }
}

async fn create_run(State(state): State<ApiState>, request: Request<Body>) -> Response {
    match create_run_inner(&state, request).await {
        Ok(Submitted::Created(d)) => (StatusCode::CREATED, axum::Json(d)).into_response(),
        Ok(Submitted::Duplicate(d)) => (StatusCode::OK, axum::Json(d)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn create_run_inner(state: &ApiState, request: Request<Body>) -> Result<Submitted, ApiError> {
    let identity = authenticate(state, request.headers(), Scope::RunsWrite).await?;
    let key = idempotency_key(request.headers())?;
    let bytes = read_body(state, request).await?;
    let mut body = parse_value(&bytes, &state.limits).map_err(body_error)?;
    bind_tenant(&mut body, &identity)?;
    let request = route_request_from_body(body, key)?;
    crate::contract::bound_start(&request.start, bytes.len(), &state.limits).map_err(|e| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            e.class.as_str(),
            e.message,
        )
    })?;
    let submitted = submit(state.decider.as_ref(), &state.routing, request).await?;
    if let (Submitted::Created(_), Some(wakeup)) = (&submitted, &state.wakeup) {
        wakeup.wake();
    }
    Ok(submitted)
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
            super::guard::refused("body_timeout");
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!(
                    "the body did not arrive within {} ms",
                    state.body_read_timeout.as_millis()
                ),
            )
        })?
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!("the request body exceeds {limit} bytes"),
                )
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "body_incomplete",
                    "the body ended before its length",
                )
            }
        })?
        .to_bytes();
    if !bytes.is_empty() && !json {
        super::guard::refused("unsupported_media_type");
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
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

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value.to_str().map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            "Idempotency-Key must be visible ASCII",
        )
    })?;
    if key.chars().count() > routing::MAX_KEY_LEN {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            format!(
                "Idempotency-Key is longer than {} characters",
                routing::MAX_KEY_LEN
            ),
        ));
    }
    // An empty key opts out of deduplication.
    Ok(Some(key.to_string()).filter(|k| !k.is_empty()))
}

/// Turns a `POST /v1/runs` body into a routed request. The body holds
/// `workflow`, and optionally `workflow_version`, `tenant` (default
/// "default"), `pool`, `input` and `correlation_id`; the run id is the
/// server's choice and the key comes from the header.
pub fn route_request_from_body(body: Value, key: Option<String>) -> Result<RouteRequest, ApiError> {
    let Value::Object(mut obj) = body else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the body must be a JSON object",
        ));
    };
    for forbidden in ["run_id", "idempotency_key", "type", "schema_version"] {
        if obj.contains_key(forbidden) {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!(
                    "{forbidden}: not accepted here (the run id is chosen by the server; the key goes in the Idempotency-Key header)"
                ),
            ));
        }
    }
    obj.entry("tenant").or_insert_with(|| json!("default"));
    obj.insert("type".into(), json!("run.start"));
    obj.insert("schema_version".into(), json!(1));
    obj.insert(
        "idempotency_key".into(),
        json!(key.clone().unwrap_or_default()),
    );
    let mut request = routing::decode_route_request(&Value::Object(obj), None)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.class.as_str(), e.message))?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "not a start request",
            )
        })?;
    request.key = key;
    Ok(request)
}

/// Routes one start request to its decision: reserve, decide, or follow the
/// pool's duplicate-waiter policy. Shared by HTTP and `ductor submit`.
pub async fn submit(
    decider: &dyn Decide,
    config: &RoutingConfig,
    mut request: RouteRequest,
) -> Result<Submitted, ApiError> {
    let Some(key) = request.key.clone() else {
        return submit_unkeyed(decider, request).await;
    };
    let (policy, wait_timeout) = routing::policy_for(config, &request.start.pool);
    let mut waiter = Waiter {
        policy,
        wait_timeout,
        deadline: Instant::now() + wait_timeout,
        waited: false,
        pause: Duration::from_millis(5),
    };
    let pending_ttl = Duration::from_millis(config.pending_ttl_ms);
    for _ in 0..MAX_RESERVE_ROUNDS {
        if let Some(submitted) =
            reserve_and_decide(decider, &mut request, &key, pending_ttl).await?
        {
            return Ok(submitted);
        }
        if let Some(submitted) = waiter.follow(decider, &request, &key).await? {
            return Ok(submitted);
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "contended",
        "the idempotency key changed hands too often; retry",
    ))
}

/// A start without a key: decided in one transaction, never deduplicated.
async fn submit_unkeyed(
    decider: &dyn Decide,
    mut request: RouteRequest,
) -> Result<Submitted, ApiError> {
    request.reservation = Reservation::InTransaction;
    match decide(decider, &request).await? {
        RouteOutcome::Decided { decision, .. } => {
            routing::count(ReserveKind::Unkeyed.as_str());
            Ok(Submitted::Created(decision))
        }
        other => Err(unexpected(other)),
    }
}

/// Reserves the key and, when it is won, decides the run. `None` when
/// another caller holds the key, or took it over while this one decided.
async fn reserve_and_decide(
    decider: &dyn Decide,
    request: &mut RouteRequest,
    key: &str,
    pending_ttl: Duration,
) -> Result<Option<Submitted>, ApiError> {
    let start = &request.start;
    let before = routing::existing(decider.pool(), &start.tenant, &start.pool, key)
        .await
        .map_err(database)?;
    let won = routing::reserve(
        decider.pool(),
        &start.tenant,
        &start.pool,
        key,
        &request.fingerprint,
        pending_ttl,
    )
    .await
    .map_err(database)?;
    let Some(epoch) = won else { return Ok(None) };
    let kind = ReserveKind::judged(before.map(|row| row.status));
    request.reservation = Reservation::Held { epoch };
    crate::crash_point!("routing.after_reserve");
    match decide(decider, request).await? {
        RouteOutcome::Decided { decision, .. } => {
            crate::crash_point!("api.after_decision");
            routing::count(kind.as_str());
            Ok(Some(Submitted::Created(decision)))
        }
        RouteOutcome::ClaimLost => {
            // Swept and taken over while we decided: the new owner's
            // answer is the answer.
            routing::count("claim_lost");
            Ok(None)
        }
        other => Err(unexpected(other)),
    }
}

/// A caller whose key another caller holds, waiting for that one's
/// decision within the pool's duplicate policy.
struct Waiter {
    policy: DuplicatePolicy,
    wait_timeout: Duration,
    deadline: Instant,
    waited: bool,
    pause: Duration,
}

impl Waiter {
    /// Follows the key's row until it is decided (the answer), refused, or
    /// free again (`None`: reserve once more).
    async fn follow(
        &mut self,
        decider: &dyn Decide,
        request: &RouteRequest,
        key: &str,
    ) -> Result<Option<Submitted>, ApiError> {
        let start = &request.start;
        loop {
            let row = routing::existing(decider.pool(), &start.tenant, &start.pool, key)
                .await
                .map_err(database)?;
            let Some(row) = row else { return Ok(None) };
            let past_deadline = Instant::now() >= self.deadline;
            match routing::waiter_step(&row, &request.fingerprint, self.policy, past_deadline) {
                WaiterStep::Reserve => return Ok(None),
                WaiterStep::Wait => {
                    self.waited = true;
                    tokio::time::sleep(self.pause).await;
                    self.pause = (self.pause * 2).min(Duration::from_millis(50));
                }
                step => return self.answer(step).map(Some),
            }
        }
    }

    /// The answer of a step that ends the wait.
    fn answer(&self, step: WaiterStep) -> Result<Submitted, ApiError> {
        match step {
            WaiterStep::Mismatch => {
                routing::count("mismatch");
                Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_mismatch",
                    "this idempotency key was already used for a different request",
                ))
            }
            WaiterStep::Decided(Some(decision)) => {
                routing::count(if self.waited { "waited" } else { "duplicate" });
                Ok(Submitted::Duplicate(decision))
            }
            WaiterStep::Decided(None) => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "a completed key has no decision",
            )),
            WaiterStep::Busy => {
                routing::count("rejected");
                Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "in_progress",
                    "a request with this idempotency key is in progress",
                ))
            }
            WaiterStep::TimedOut | WaiterStep::Wait | WaiterStep::Reserve => {
                routing::count("rejected");
                Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "in_progress",
                    format!(
                        "a request with this idempotency key is still in progress after {} ms",
                        self.wait_timeout.as_millis()
                    ),
                ))
            }
        }
    }
}

/// Decides one request through `decider`; a start the routing plane
/// refuses (an unknown workflow) is an error here, 422.
async fn decide(decider: &dyn Decide, request: &RouteRequest) -> Result<RouteOutcome, ApiError> {
    let outcome = decider.decide(request).await.map_err(|e| match e {
        DecideError::Refused { class, message } => {
            // The request itself is what the database refuses: the
            // same request would fail again.
            tracing::warn!(class, error = %message, "a start request cannot be stored");
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, class, message)
        }
        DecideError::Unavailable(e) => {
            tracing::warn!(error = %e, "deciding a start request failed");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the decision could not be committed; retry with the same key",
            )
        }
        DecideError::Unanswered => {
            tracing::error!("the decision came back without an outcome");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "unexpected routing outcome",
            )
        }
    })?;
    if let RouteOutcome::Rejected(message) = outcome {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_workflow",
            message,
        ));
    }
    Ok(outcome)
}

pub(crate) fn database(e: sqlx::Error) -> ApiError {
    tracing::warn!(error = %e, "routing query failed");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        "the database is unavailable; retry with the same key",
    )
}

fn unexpected(outcome: RouteOutcome) -> ApiError {
    tracing::error!(?outcome, "unexpected routing outcome");
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "unexpected routing outcome",
    )
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
