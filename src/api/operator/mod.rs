//! The operator's views, beside the run endpoints: list and search runs
//! (`GET /v1/runs`), count them by status (`GET /v1/runs/counts`), read
//! one run's whole history (`GET /v1/runs/{run_id}/history`); the dead
//! letters ([`letters`]); and, for an `admin` key only, the outbox (`GET
//! /v1/outbox`, `POST /v1/outbox/redrive`) and retention (`GET
//! /v1/retention`).
//!
//! A key with `runs:read` sees its own tenant's runs; a key with the
//! `admin` scope sees every tenant's, or the one its request names. The
//! admin listener serves the same views at the same paths to a key with the
//! `admin` scope alone, whatever `server.admin_auth` says. The CLI
//! (`ductor runs`, `ductor dlq`) and the web console ([`super::console`])
//! read these same routes.
//!
//! In: the request's key and query. Out: JSON ([`views`]), or the API's
//! error shape: 400 `invalid_query` for a parameter that is wrong, named.
//! Guarantees: only reads; every answer is bounded (a page to
//! `server.max_page_runs` runs, a count to `server.count_scan_limit` runs
//! scanned); another tenant's run answers exactly as a missing one.

pub mod letters;
pub mod outbox;
pub mod query;
pub mod store;
pub mod views;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};

use super::ApiState;
use super::error::{ApiError, Code, database};
use super::request::{authenticate, authenticate_any, read_body, tenants_seen};
use crate::auth::Scope;
use query::RunQuery;

/// Who may read on the public listener: a tenant's reader, or an
/// operator.
pub(crate) const READERS: [Scope; 2] = [Scope::RunsRead, Scope::Admin];

/// Who may read on the admin listener: an operator alone.
pub(crate) const OPERATORS: [Scope; 1] = [Scope::Admin];

/// `GET /v1/runs`: a page of the runs the query finds, newest first.
pub(crate) async fn list_runs(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(page(&state, &headers, raw.as_deref(), &READERS).await)
}

/// `GET /v1/runs` on the admin listener.
pub(crate) async fn admin_list_runs(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(page(&state, &headers, raw.as_deref(), &OPERATORS).await)
}

/// `GET /v1/runs/counts`: how many runs the query's filter finds, by status.
pub(crate) async fn count_runs(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(counts(&state, &headers, raw.as_deref(), &READERS).await)
}

/// `GET /v1/runs/counts` on the admin listener.
pub(crate) async fn admin_count_runs(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(counts(&state, &headers, raw.as_deref(), &OPERATORS).await)
}

/// `GET /v1/runs/{run_id}/history`: the run, its attempts, and its
/// transitions with the effects each produced and where each is.
pub(crate) async fn run_history(
    State(state): State<ApiState>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    respond(history(&state, &headers, &run_id, &READERS).await)
}

/// `GET /v1/runs/{run_id}/history` on the admin listener.
pub(crate) async fn admin_run_history(
    State(state): State<ApiState>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    respond(history(&state, &headers, &run_id, &OPERATORS).await)
}

async fn page(
    state: &ApiState,
    headers: &HeaderMap,
    raw: Option<&str>,
    scopes: &[Scope],
) -> Result<views::RunPage, ApiError> {
    let query = seen_query(state, headers, raw, scopes).await?;
    store::page(state.decider.pool(), &query)
        .await
        .map_err(database)
}

async fn counts(
    state: &ApiState,
    headers: &HeaderMap,
    raw: Option<&str>,
    scopes: &[Scope],
) -> Result<views::RunCounts, ApiError> {
    let query = seen_query(state, headers, raw, scopes).await?;
    let scan_limit = i64::try_from(state.operator.count_scan_limit).unwrap_or(i64::MAX);
    store::counts(state.decider.pool(), &query, scan_limit)
        .await
        .map_err(database)
}

async fn history(
    state: &ApiState,
    headers: &HeaderMap,
    run_id: &str,
    scopes: &[Scope],
) -> Result<views::RunHistory, ApiError> {
    let identity = authenticate_any(state, headers, scopes).await?;
    let tenant = tenants_seen(&identity, None)?;
    let pool = state.decider.pool();
    store::history(pool, run_id, tenant.as_deref(), chrono::Utc::now())
        .await
        .map_err(database)?
        .ok_or_else(|| ApiError::new(Code::NotFound, "no such run"))
}

/// `GET /v1/outbox`: what waits to be published, and what is parked.
pub(crate) async fn outbox_status(State(state): State<ApiState>, headers: HeaderMap) -> Response {
    let answer = async {
        authenticate(&state, &headers, Scope::Admin).await?;
        outbox::picture(state.decider.pool())
            .await
            .map_err(database)
    };
    respond(answer.await)
}

/// `POST /v1/outbox/redrive` with an optional `{"run_id", "topic"}`: puts
/// the parked intents it names (all, without either) back into the claim
/// rounds.
pub(crate) async fn redrive(State(state): State<ApiState>, request: Request<Body>) -> Response {
    let answer = async {
        authenticate(&state, request.headers(), Scope::Admin).await?;
        let bytes = read_body(&state, request).await?;
        let which: outbox::RedriveRequest = if bytes.is_empty() {
            outbox::RedriveRequest::default()
        } else {
            serde_json::from_slice(&bytes).map_err(|e| {
                ApiError::new(
                    Code::InvalidRequest,
                    format!("the body is not {{\"run_id\", \"topic\"}}: {e}"),
                )
            })?
        };
        let pool = state.decider.pool();
        let redriven = crate::outbox::Drainer::redrive_parked(
            pool,
            which.run_id.as_deref(),
            which.topic.as_deref(),
        )
        .await
        .map_err(|e| {
            tracing::warn!(error = format!("{e:#}"), "a redrive failed");
            ApiError::new(Code::Unavailable, "the database did not answer; retry")
        })?;
        Ok(outbox::Redriven { redriven })
    };
    respond(answer.await)
}

/// `GET /v1/retention`: what retention will delete next.
pub(crate) async fn retention_status(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Response {
    let answer = async {
        authenticate(&state, &headers, Scope::Admin).await?;
        let o = state.operator;
        let scan_limit = i64::try_from(o.count_scan_limit).unwrap_or(i64::MAX);
        outbox::retention(
            state.decider.pool(),
            o.runs_retention_ms,
            o.tombstone_retention_ms,
            scan_limit,
        )
        .await
        .map_err(database)
    };
    respond(answer.await)
}

/// The caller's query, its tenant filter set to what the caller sees.
async fn seen_query(
    state: &ApiState,
    headers: &HeaderMap,
    raw: Option<&str>,
    scopes: &[Scope],
) -> Result<RunQuery, ApiError> {
    let identity = authenticate_any(state, headers, scopes).await?;
    let mut query = RunQuery::parse(raw, state.operator.max_page_runs)
        .map_err(|message| ApiError::new(Code::InvalidQuery, message))?;
    query.filter.tenant = tenants_seen(&identity, query.filter.tenant.as_deref())?;
    Ok(query)
}

pub(crate) fn respond<T: serde::Serialize>(answer: Result<T, ApiError>) -> Response {
    match answer {
        Ok(body) => (StatusCode::OK, axum::Json(body)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The bounds of the operator's views (`server.max_page_runs`,
/// `server.count_scan_limit`) and the retention they show
/// (`runs.retention_ms`, `runs.tombstone_retention_ms`).
#[derive(Debug, Clone, Copy)]
pub struct OperatorLimits {
    pub max_page_runs: usize,
    pub count_scan_limit: u64,
    pub runs_retention_ms: u64,
    pub tombstone_retention_ms: u64,
}
