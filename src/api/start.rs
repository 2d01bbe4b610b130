//! `POST /v1/runs`: a start request routed to exactly one decision. The
//! caller's `Idempotency-Key` is reserved first, so that a duplicate
//! arriving while the first caller is deciding meets a `pending` row and
//! follows its pool's duplicate-waiter policy (`reject` at once, or `wait`
//! for the decision within `wait_timeout_ms`).
//!
//! In: the request's key header, trace context and JSON body, bound to
//! the caller's tenant. Out: [`Submitted`] (201 with a new decision, 200 with the same
//! body for a duplicate) or an [`ApiError`]. Guarantees: one decision per
//! `(tenant, pool, key)`, whoever asks and however often; a caller whose
//! reservation was swept while it decided never answers over the new
//! owner's decision. [`submit`] is shared with `ductor submit`.

use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::time::Instant;
use tracing::Instrument;

use super::ApiState;
use super::error::{ApiError, Code, body_error, database};
use super::request::{authenticate, read_body, tenant, traced};
use crate::auth::{Identity, Scope};
use crate::config::{DuplicatePolicy, RoutingConfig};
use crate::contract::parse_value;
use crate::routing::{
    self, Decide, DecideError, Reservation, ReserveKind, RouteOutcome, RouteRequest,
    RoutingDecision, WaiterStep,
};

/// How often a reservation is re-tried after it was lost to a sweep, before
/// the caller is told to come back.
const MAX_RESERVE_ROUNDS: u32 = 8;

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

pub(super) async fn create_run(State(state): State<ApiState>, request: Request<Body>) -> Response {
    match create_run_inner(&state, request).await {
        Ok(Submitted::Created(d)) => (StatusCode::CREATED, axum::Json(d)).into_response(),
        Ok(Submitted::Duplicate(d)) => (StatusCode::OK, axum::Json(d)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn create_run_inner(state: &ApiState, request: Request<Body>) -> Result<Submitted, ApiError> {
    let (span, trace) = traced(
        request.headers(),
        tracing::info_span!(
            target: crate::infra::traces::TARGET,
            parent: None,
            "api.start_run",
            ductor.run_id = tracing::field::Empty,
        ),
    );
    let submitted = create_traced(state, request, trace)
        .instrument(span.clone())
        .await;
    if let Ok(submitted) = &submitted {
        span.record("ductor.run_id", submitted.decision().run_id.as_str());
    }
    submitted
}

async fn create_traced(
    state: &ApiState,
    request: Request<Body>,
    trace: Option<crate::contract::TraceContext>,
) -> Result<Submitted, ApiError> {
    let identity = authenticate(state, request.headers(), Scope::RunsWrite).await?;
    let key = idempotency_key(request.headers())?;
    let bytes = read_body(state, request).await?;
    let mut body = parse_value(&bytes, &state.limits).map_err(body_error)?;
    bind_tenant(&mut body, &identity)?;
    let mut request = route_request_from_body(body, key)?;
    request.trace = trace;
    crate::contract::bound_start(&request.start, bytes.len(), &state.limits).map_err(|e| {
        ApiError::class(
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

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value.to_str().map_err(|_| {
        ApiError::new(
            Code::InvalidIdempotencyKey,
            "Idempotency-Key must be visible ASCII",
        )
    })?;
    if key.chars().count() > routing::MAX_KEY_LEN {
        return Err(ApiError::new(
            Code::InvalidIdempotencyKey,
            format!(
                "Idempotency-Key is longer than {} characters",
                routing::MAX_KEY_LEN
            ),
        ));
    }
    // An empty key opts out of deduplication.
    Ok(Some(key.to_string()).filter(|k| !k.is_empty()))
}

/// The fields of `run.start` a `POST /v1/runs` body may not set: the
/// server chooses the run id and sets the envelope, and the key comes from
/// the header.
pub const SERVER_SET: [&str; 5] = [
    "run_id",
    "idempotency_key",
    "type",
    "schema_version",
    "parent",
];

/// Turns a `POST /v1/runs` body into a routed request. The body holds
/// `workflow`, and optionally `workflow_version`, `tenant` (default
/// "default"), `pool`, `input` and `correlation_id`; the run id is the
/// server's choice and the key comes from the header.
pub fn route_request_from_body(body: Value, key: Option<String>) -> Result<RouteRequest, ApiError> {
    let Value::Object(mut obj) = body else {
        return Err(ApiError::new(
            Code::InvalidRequest,
            "the body must be a JSON object",
        ));
    };
    for forbidden in SERVER_SET {
        if obj.contains_key(forbidden) {
            return Err(ApiError::new(
                Code::InvalidRequest,
                format!(
                    "{forbidden}: not accepted here (the run id is chosen by the server, the key goes in the Idempotency-Key header, and only serve starts a child run)"
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
        .map_err(|e| ApiError::class(StatusCode::BAD_REQUEST, e.class.as_str(), e.message))?
        .ok_or_else(|| ApiError::new(Code::InvalidRequest, "not a start request"))?;
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
        Code::Contended,
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
                    Code::IdempotencyKeyMismatch,
                    "this idempotency key was already used for a different request",
                ))
            }
            WaiterStep::Decided(Some(decision)) => {
                routing::count(if self.waited { "waited" } else { "duplicate" });
                Ok(Submitted::Duplicate(decision))
            }
            WaiterStep::Decided(None) => Err(ApiError::new(
                Code::Internal,
                "a completed key has no decision",
            )),
            WaiterStep::Busy => {
                routing::count("rejected");
                Err(ApiError::new(
                    Code::InProgress,
                    "a request with this idempotency key is in progress",
                ))
            }
            WaiterStep::TimedOut | WaiterStep::Wait | WaiterStep::Reserve => {
                routing::count("rejected");
                Err(ApiError::new(
                    Code::InProgress,
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
            ApiError::class(StatusCode::UNPROCESSABLE_ENTITY, class, message)
        }
        DecideError::Unavailable(e) => {
            tracing::warn!(error = %e, "deciding a start request failed");
            ApiError::new(
                Code::Unavailable,
                "the decision could not be committed; retry with the same key",
            )
        }
        DecideError::Unanswered => {
            tracing::error!("the decision came back without an outcome");
            ApiError::new(Code::Internal, "unexpected routing outcome")
        }
    })?;
    if let RouteOutcome::Rejected(message) = outcome {
        return Err(ApiError::new(Code::UnknownWorkflow, message));
    }
    Ok(outcome)
}

fn unexpected(outcome: RouteOutcome) -> ApiError {
    tracing::error!(?outcome, "unexpected routing outcome");
    ApiError::new(Code::Internal, "unexpected routing outcome")
}
