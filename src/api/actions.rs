//! An operator's actions on one run: cancel it, retry it from the step it
//! failed in. Each takes `runs:write` for the caller's tenant's runs (another
//! tenant's run answers as a missing one does, 404); on the admin listener a
//! key with the `admin` scope acts on any tenant's run, and the input
//! carries the run's tenant, as its own producer's would.
//!
//! Neither is applied here: each goes on the wakeups topic as the same input
//! a Kafka producer would send (`wakeup.cancel`, `wakeup.retry`), keyed by
//! the run, so that the run's one writer folds it in order with the run's
//! other inputs and its history records it. Each is named by an
//! `action_id`, the caller's or one the server picks, returned in the
//! answer: the run applies a retry's once, and a run is cancelled once.
//!
//! In: a run id in the path and an optional body (`reason`, `action_id`).
//! Out: 202 once the broker holds the input; for a retry, 200 when the run
//! applied its `action_id` already, 409 `run_not_failed` when the run is
//! not failed and 409 `run_compensated` when it failed compensated; 404 for a run the caller's tenant does not have.
//! Guarantees: a retry sent again with its `action_id` never retries the
//! run twice, here or in the fold.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value, json};
use tracing::Instrument;

use super::ApiState;
use super::error::{ApiError, Code, database};
use super::request::{authenticate, traced};
use super::runs::{
    Wakeup, accept, invalid, not_found, produce, read_fields, run_tenant, send, wakeup_input,
};
use crate::auth::Scope;
use crate::contract::formats::Id;
use crate::contract::input::is_id;
use crate::contract::{Input, TraceContext};

/// The cancel was handed to the run.
#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelStatus {
    /// The `wakeup.cancel` input is on the wakeups topic.
    Accepted,
}

/// The answer to `POST /v1/runs/{id}/cancel`.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "CancelAccepted")]
pub struct CancelAnswer {
    #[schemars(with = "Id")]
    pub run_id: String,
    /// The cancel's name: the one sent, or the one the server chose. The
    /// `run.cancelled` transition's detail records it.
    #[schemars(with = "Id")]
    pub action_id: String,
    pub status: CancelStatus,
}

/// Whether a retry was handed to the run now, or had been applied already.
#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RetryStatus {
    /// The `wakeup.retry` input is on the wakeups topic (202).
    Accepted,
    /// The run has applied this `action_id` (200): nothing was sent.
    Applied,
}

/// The answer to `POST /v1/runs/{id}/retry`.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "RetryAccepted")]
pub struct RetryAnswer {
    #[schemars(with = "Id")]
    pub run_id: String,
    /// The retry's idempotency key: the one sent, or the one the server
    /// chose. Send it again to retry safely.
    #[schemars(with = "Id")]
    pub action_id: String,
    pub status: RetryStatus,
}

/// Which action a request asks for.
#[derive(Clone, Copy)]
enum Action {
    Cancel,
    Retry,
}

impl Action {
    fn span(self, headers: &HeaderMap, run_id: &str) -> (tracing::Span, Option<TraceContext>) {
        let span = match self {
            Action::Cancel => tracing::info_span!(
                target: crate::infra::traces::TARGET,
                parent: None,
                "api.cancel_run",
                ductor.run_id = %run_id,
            ),
            Action::Retry => tracing::info_span!(
                target: crate::infra::traces::TARGET,
                parent: None,
                "api.retry_run",
                ductor.run_id = %run_id,
            ),
        };
        traced(headers, span)
    }

    async fn take(
        self,
        state: &ApiState,
        to: Wakeup<'_>,
        fields: Map<String, Value>,
    ) -> Result<Response, ApiError> {
        let fields = with_action_id(fields);
        match self {
            Action::Cancel => cancel(state, to, fields).await,
            Action::Retry => retry(state, to, fields).await,
        }
    }
}

/// `POST /v1/runs/{id}/cancel` with an optional `{"reason", "action_id"}`.
pub(crate) async fn cancel_run(
    state: State<ApiState>,
    run_id: Path<String>,
    request: Request<Body>,
) -> Response {
    act(Action::Cancel, Caller::Tenant, state, run_id, request).await
}

/// `POST /v1/runs/{id}/retry` with an optional `{"reason", "action_id"}`.
pub(crate) async fn retry_run(
    state: State<ApiState>,
    run_id: Path<String>,
    request: Request<Body>,
) -> Response {
    act(Action::Retry, Caller::Tenant, state, run_id, request).await
}

/// `POST /v1/runs/{id}/cancel` on the admin listener.
pub(crate) async fn admin_cancel_run(
    state: State<ApiState>,
    run_id: Path<String>,
    request: Request<Body>,
) -> Response {
    act(Action::Cancel, Caller::Operator, state, run_id, request).await
}

/// `POST /v1/runs/{id}/retry` on the admin listener.
pub(crate) async fn admin_retry_run(
    state: State<ApiState>,
    run_id: Path<String>,
    request: Request<Body>,
) -> Response {
    act(Action::Retry, Caller::Operator, state, run_id, request).await
}

/// Who acts, and so whose runs they reach.
#[derive(Clone, Copy)]
enum Caller {
    /// A tenant's key with `runs:write`: its own tenant's runs.
    Tenant,
    /// An operator's key with the `admin` scope: any tenant's run.
    Operator,
}

/// Takes `action` on the run in the path, for `caller`.
async fn act(
    action: Action,
    caller: Caller,
    State(state): State<ApiState>,
    Path(run_id): Path<String>,
    request: Request<Body>,
) -> Response {
    let (span, trace) = action.span(request.headers(), &run_id);
    let answer = async {
        let (tenant, fields) = match caller {
            Caller::Tenant => accept(&state, request, true).await?,
            Caller::Operator => operator_fields(&state, &run_id, request).await?,
        };
        let to = Wakeup {
            tenant: &tenant,
            run_id: &run_id,
            trace: trace.as_ref(),
        };
        action.take(&state, to, fields).await
    };
    answer
        .instrument(span)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// An operator's request on any tenant's run: the run's tenant, which a
/// tenant the request names must be, and the body's fields.
async fn operator_fields(
    state: &ApiState,
    run_id: &str,
    request: Request<Body>,
) -> Result<(String, Map<String, Value>), ApiError> {
    authenticate(state, request.headers(), Scope::Admin).await?;
    let (named, fields) = read_fields(state, request, true).await?;
    let tenant = run_tenant(state.decider.pool(), run_id)
        .await
        .map_err(database)?
        .ok_or_else(not_found)?;
    if named.as_ref().is_some_and(|named| *named != tenant) {
        return Err(ApiError::new(
            Code::TenantMismatch,
            "the request names a tenant other than the run's",
        ));
    }
    Ok((tenant, fields))
}

/// The body's fields with an `action_id`: the caller's, or a new one.
fn with_action_id(mut fields: Map<String, Value>) -> Map<String, Value> {
    fields
        .entry("action_id")
        .or_insert_with(|| json!(uuid::Uuid::new_v4().to_string()));
    fields
}

/// Puts the cancel of the run on the wakeups topic.
async fn cancel(
    state: &ApiState,
    to: Wakeup<'_>,
    fields: Map<String, Value>,
) -> Result<Response, ApiError> {
    let action_id = fields.get("action_id").cloned();
    send(state, to, "wakeup.cancel", fields).await?;
    let answer = CancelAnswer {
        run_id: to.run_id.to_owned(),
        action_id: action_id
            .as_ref()
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        status: CancelStatus::Accepted,
    };
    Ok((StatusCode::ACCEPTED, axum::Json(answer)).into_response())
}

/// Puts the retry of the run on the wakeups topic, unless the run applied
/// its `action_id` already (200) or is not failed by the transition the
/// retry names, by default its latest failure (409). The fold decides again
/// when the retry arrives: two retries racing with different ids both get
/// 202, and the run applies the first.
async fn retry(
    state: &ApiState,
    to: Wakeup<'_>,
    mut fields: Map<String, Value>,
) -> Result<Response, ApiError> {
    let action_id = fields
        .get("action_id")
        .and_then(Value::as_str)
        .filter(|id| is_id(id))
        .ok_or_else(|| invalid("action_id: must be 1 to 128 characters of [A-Za-z0-9_.:-]"))?
        .to_owned();
    let (status, applied, failure, compensated) = retry_state(state.decider.pool(), to, &action_id)
        .await
        .map_err(database)?
        .ok_or_else(not_found)?;
    let answer = |status| RetryAnswer {
        run_id: to.run_id.to_owned(),
        action_id: action_id.clone(),
        status,
    };
    if applied {
        return Ok((StatusCode::OK, axum::Json(answer(RetryStatus::Applied))).into_response());
    }
    if compensated {
        return Err(ApiError::new(
            Code::RunCompensated,
            "the run failed compensated: what it did is undone, so it is not retried",
        ));
    }
    let Some(failure) = failure else {
        return Err(ApiError::new(
            Code::RunNotFailed,
            format!("the run is {status}: only a failed run is retried"),
        ));
    };
    fields.entry("failed_seq").or_insert(json!(failure));
    let (input, decoded) = wakeup_input(to.tenant, to.run_id, "wakeup.retry", fields)?;
    let Input::Retry(retry) = decoded else {
        return Err(invalid("the body does not make a retry"));
    };
    if retry.failed_seq != failure {
        return Err(ApiError::new(
            Code::RunNotFailed,
            format!(
                "the run is failed by its transition {failure}, not by {}",
                retry.failed_seq
            ),
        ));
    }
    produce(state, to.tenant, to.run_id, &input, to.trace).await?;
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(answer(RetryStatus::Accepted)),
    )
        .into_response())
}

/// The run's status, whether it applied the retry `action_id`, the seq
/// of the transition that failed it if it is failed
/// ([`crate::coordinator::RunState::failure_seq`]), and whether it failed
/// compensated ([`crate::coordinator::RunState::is_compensated`]); `None`
/// when the run is not the tenant's.
async fn retry_state(
    pool: &sqlx::PgPool,
    to: Wakeup<'_>,
    action_id: &str,
) -> sqlx::Result<Option<(String, bool, Option<i64>, bool)>> {
    sqlx::query_as(
        "SELECT status, \
                EXISTS (SELECT 1 FROM jsonb_array_elements(state->'retries') r \
                        WHERE r->>'action_id' = $3), \
                CASE WHEN status = 'failed' \
                     THEN coalesce((state->>'failed_seq')::bigint, last_transition_seq) END, \
                status = 'failed' AND state ? 'compensating' \
                    AND coalesce(jsonb_array_length(state->'compensable'), 0) = 0 \
         FROM runs WHERE run_id = $1 AND tenant_scope = $2",
    )
    .bind(to.run_id)
    .bind(to.tenant)
    .bind(action_id)
    .fetch_optional(pool)
    .await
}
