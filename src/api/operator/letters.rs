//! The dead letters over HTTP: list, count and read them (`GET
//! /v1/dead-letters`, `/counts`, `/{letter_id}`), replay one or a filtered
//! set (`POST /v1/dead-letters/{letter_id}/replay`, `POST
//! /v1/dead-letters/replay`), discard one with a reason (`POST
//! /v1/dead-letters/{letter_id}/discard`). The operations are
//! [`crate::ingress::dead_letters::DeadLetters`]'; this is their door.
//!
//! In: a key, a query string or a JSON body. Out: the operations' answers
//! as JSON, or the API's error shape. Guarantees: a key with `runs:read`
//! (to read) or `runs:write` (to replay and discard) acts on its tenant's
//! letters only, one with `admin` on every tenant's; another tenant's
//! letter answers as a missing one; an unknown parameter or field is
//! refused, named. The admin listener serves the same routes (the `admin_`
//! handlers) to a key with the `admin` scope alone, whatever
//! `server.admin_auth` says.

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Request};
use axum::response::Response;
use chrono::{DateTime, Utc};
use serde::Deserialize;

use super::{OPERATORS, READERS, respond};
use crate::api::ApiState;
use crate::api::error::{ApiError, Code};
use crate::api::request::{authenticate_any, read_body, tenants_seen};
use crate::auth::Scope;
use crate::ingress::dead_letters::{
    DeadLetterError, DiscardOutcome, Letter, LetterFilter, LetterPage, LetterStatus, Page,
    ReplayBatch, ReplayOutcome,
};

/// Who may replay and discard: a tenant's writer, or an operator.
const WRITERS: [Scope; 2] = [Scope::RunsWrite, Scope::Admin];

/// A listing's query: the filter, the tenant an admin names, the page.
#[derive(Debug, Default, PartialEq)]
pub struct LetterQuery {
    pub tenant: Option<String>,
    pub filter: LetterFilter,
    pub page: Page,
}

impl LetterQuery {
    /// The query of `query_string`; an unknown or repeated parameter, or
    /// a value out of its bounds, is an error naming it.
    pub fn parse(query_string: Option<&str>) -> Result<LetterQuery, String> {
        let mut q = LetterQuery::default();
        let mut seen = Vec::new();
        for (name, value) in url::form_urlencoded::parse(query_string.unwrap_or("").as_bytes()) {
            if seen.contains(&name) {
                return Err(format!("`{name}` is given twice"));
            }
            seen.push(name.clone());
            let text = || Some(value.to_string());
            match &*name {
                "tenant" => q.tenant = text(),
                "class" => q.filter.class = text(),
                "stage" => q.filter.stage = text(),
                "source_topic" => q.filter.source_topic = text(),
                "status" => q.filter.status = Some(status(&value)?),
                "since" => q.filter.since = Some(time("since", &value)?),
                "until" => q.filter.until = Some(time("until", &value)?),
                "after" => q.page.cursor = Some(number("after", &value)?),
                "limit" => {
                    q.page.limit = usize::try_from(number("limit", &value)?)
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or("`limit` is at least 1")?;
                }
                other => {
                    return Err(format!(
                        "unknown parameter {other:?} (known: tenant, class, stage, source_topic, \
                         status, since, until, limit, after)"
                    ));
                }
            }
        }
        Ok(q)
    }
}

fn status(value: &str) -> Result<LetterStatus, String> {
    serde_json::from_value(serde_json::Value::String(value.to_owned()))
        .map_err(|_| "`status` is one of pending, replaying, replayed, discarded".to_owned())
}

fn time(name: &str, value: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(value)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| format!("`{name}` is an RFC 3339 time"))
}

fn number(name: &str, value: &str) -> Result<i64, String> {
    value
        .parse::<i64>()
        .ok()
        .filter(|n| *n >= 0)
        .ok_or_else(|| format!("`{name}` is a whole number"))
}

/// `POST /v1/dead-letters/replay`'s body: which letters, and where the
/// page of them starts (oldest first).
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    /// An admin's tenant to look at; a tenant's key acts on its own.
    pub tenant: Option<String>,
    #[serde(default)]
    pub filter: LetterFilter,
    #[serde(default)]
    pub page: Page,
}

/// `POST /v1/dead-letters/{letter_id}/discard`'s body.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiscardRequest {
    /// Why it is not replayed: kept with the letter.
    pub reason: String,
}

/// The answer to a failed operation.
fn refusal(e: DeadLetterError) -> ApiError {
    let message = e.to_string();
    match e {
        DeadLetterError::NotFound(_) => ApiError::new(Code::NotFound, "no such dead letter"),
        DeadLetterError::Discarded { .. } | DeadLetterError::Replayed(_) => {
            ApiError::new(Code::LetterSettled, message)
        }
        DeadLetterError::NotReplayable { .. } => ApiError::new(Code::NotReplayable, message),
        DeadLetterError::Conflict(_) => ApiError::new(Code::Contended, message),
        DeadLetterError::NoReason => ApiError::new(Code::InvalidRequest, message),
        DeadLetterError::Database(_) | DeadLetterError::Kafka(_) => {
            tracing::warn!(error = %message, "a dead-letter operation failed");
            ApiError::new(
                Code::Unavailable,
                "the database or the broker did not answer; retry",
            )
        }
    }
}

fn letter_id(raw: &str) -> Result<i64, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::new(Code::NotFound, "no such dead letter"))
}

/// The tenant scope of a reader or writer and the query it names.
async fn scope(
    state: &ApiState,
    headers: &HeaderMap,
    who: &[Scope],
    named: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let identity = authenticate_any(state, headers, who).await?;
    tenants_seen(&identity, named)
}

fn query(raw: Option<&str>) -> Result<LetterQuery, ApiError> {
    LetterQuery::parse(raw).map_err(|m| ApiError::new(Code::InvalidQuery, m))
}

/// `GET /v1/dead-letters`.
pub(crate) async fn list(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(listed(&state, &headers, raw.as_deref(), &READERS).await)
}

/// `GET /v1/dead-letters` on the admin listener.
pub(crate) async fn admin_list(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(listed(&state, &headers, raw.as_deref(), &OPERATORS).await)
}

/// `GET /v1/dead-letters/counts`.
pub(crate) async fn counts(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(counted(&state, &headers, raw.as_deref(), &READERS).await)
}

/// `GET /v1/dead-letters/counts` on the admin listener.
pub(crate) async fn admin_counts(
    State(state): State<ApiState>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    respond(counted(&state, &headers, raw.as_deref(), &OPERATORS).await)
}

/// `GET /v1/dead-letters/{letter_id}`.
pub(crate) async fn show(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    respond(shown(&state, &headers, &id, &READERS).await)
}

/// `GET /v1/dead-letters/{letter_id}` on the admin listener.
pub(crate) async fn admin_show(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    respond(shown(&state, &headers, &id, &OPERATORS).await)
}

/// `POST /v1/dead-letters/{letter_id}/replay`, without a body (one sent
/// is not read).
pub(crate) async fn replay(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    respond(replayed(&state, &headers, &id, &WRITERS).await)
}

/// `POST /v1/dead-letters/{letter_id}/replay` on the admin listener.
pub(crate) async fn admin_replay(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    respond(replayed(&state, &headers, &id, &OPERATORS).await)
}

/// `POST /v1/dead-letters/replay`: the letters a filter finds, one page.
pub(crate) async fn replay_matching(
    State(state): State<ApiState>,
    request: Request<Body>,
) -> Response {
    respond(replayed_matching(&state, request, &WRITERS).await)
}

/// `POST /v1/dead-letters/replay` on the admin listener.
pub(crate) async fn admin_replay_matching(
    State(state): State<ApiState>,
    request: Request<Body>,
) -> Response {
    respond(replayed_matching(&state, request, &OPERATORS).await)
}

/// `POST /v1/dead-letters/{letter_id}/discard` with `{"reason": ...}`.
pub(crate) async fn discard(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    request: Request<Body>,
) -> Response {
    respond(discarded(&state, &id, request, &WRITERS).await)
}

/// `POST /v1/dead-letters/{letter_id}/discard` on the admin listener.
pub(crate) async fn admin_discard(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    request: Request<Body>,
) -> Response {
    respond(discarded(&state, &id, request, &OPERATORS).await)
}

async fn listed(
    state: &ApiState,
    headers: &HeaderMap,
    raw: Option<&str>,
    who: &[Scope],
) -> Result<LetterPage, ApiError> {
    let q = query(raw)?;
    let tenant = scope(state, headers, who, q.tenant.as_deref()).await?;
    state
        .letters()?
        .list(tenant.as_deref(), &q.filter, q.page)
        .await
        .map_err(refusal)
}

async fn counted(
    state: &ApiState,
    headers: &HeaderMap,
    raw: Option<&str>,
    who: &[Scope],
) -> Result<serde_json::Value, ApiError> {
    let q = query(raw)?;
    let tenant = scope(state, headers, who, q.tenant.as_deref()).await?;
    let counts = state
        .letters()?
        .counts(tenant.as_deref(), &q.filter)
        .await
        .map_err(refusal)?;
    Ok(serde_json::json!({ "counts": counts }))
}

async fn shown(
    state: &ApiState,
    headers: &HeaderMap,
    id: &str,
    who: &[Scope],
) -> Result<Letter, ApiError> {
    let tenant = scope(state, headers, who, None).await?;
    let id = letter_id(id)?;
    state
        .letters()?
        .show(tenant.as_deref(), id)
        .await
        .map_err(refusal)
}

async fn replayed(
    state: &ApiState,
    headers: &HeaderMap,
    id: &str,
    who: &[Scope],
) -> Result<ReplayOutcome, ApiError> {
    let tenant = scope(state, headers, who, None).await?;
    let id = letter_id(id)?;
    state
        .letters()?
        .replay(tenant.as_deref(), id)
        .await
        .map_err(refusal)
}

async fn replayed_matching(
    state: &ApiState,
    request: Request<Body>,
    who: &[Scope],
) -> Result<ReplayBatch, ApiError> {
    let headers = request.headers().clone();
    let bytes = read_body(state, request).await?;
    if bytes.is_empty() {
        // A set is named, never implied: `{}` is every letter.
        return Err(ApiError::new(
            Code::InvalidRequest,
            "the body names the letters to replay: {\"filter\": {...}}, or {} for all",
        ));
    }
    let body: ReplayRequest = parse_body(&bytes, "{\"tenant\", \"filter\", \"page\"}")?;
    let tenant = scope(state, &headers, who, body.tenant.as_deref()).await?;
    state
        .letters()?
        .replay_matching(tenant.as_deref(), &body.filter, body.page)
        .await
        .map_err(refusal)
}

async fn discarded(
    state: &ApiState,
    id: &str,
    request: Request<Body>,
    who: &[Scope],
) -> Result<DiscardOutcome, ApiError> {
    let tenant = scope(state, request.headers(), who, None).await?;
    let id = letter_id(id)?;
    let bytes = read_body(state, request).await?;
    let body: DiscardRequest = parse_body(&bytes, "{\"reason\": \"...\"}")?;
    state
        .letters()?
        .discard(tenant.as_deref(), id, &body.reason)
        .await
        .map_err(refusal)
}

/// A JSON body of `T` (an empty one is `{}`).
fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8], shape: &str) -> Result<T, ApiError> {
    let bytes = if bytes.is_empty() { b"{}" } else { bytes };
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(
            Code::InvalidRequest,
            format!("the body is not {shape}: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_s_query_is_read_and_a_wrong_one_named() {
        let q = LetterQuery::parse(Some(
            "tenant=acme&class=malformed&stage=decode&status=pending&since=2026-12-01T00:00:00Z&limit=5&after=90",
        ))
        .unwrap();
        assert_eq!(q.tenant.as_deref(), Some("acme"));
        assert_eq!(q.filter.class.as_deref(), Some("malformed"));
        assert_eq!(q.filter.status, Some(LetterStatus::Pending));
        assert_eq!((q.page.limit, q.page.cursor), (5, Some(90)));
        for (bad, says) in [
            ("colour=red", "unknown parameter"),
            ("class=a&class=b", "given twice"),
            ("status=lost", "`status` is one of"),
            ("limit=0", "at least 1"),
            ("after=-1", "whole number"),
            ("since=now", "RFC 3339"),
        ] {
            let e = LetterQuery::parse(Some(bad)).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
