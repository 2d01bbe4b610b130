//! The run endpoints beside the start: read a run, signal it (its cancel
//! and retry are in `actions`). Each acts only on runs of the caller's
//! tenant: another tenant's run answers exactly as a missing one does (404).
//!
//! A signal is not applied here: it goes on the wakeups topic
//! as the same input a Kafka producer would send, keyed by the run, so that
//! the run's one writer (the coordinator) folds it in order with the run's
//! other inputs. 202 means the broker has it.
//!
//! In: a run id in the path, a signal's JSON body, and the caller's trace
//! context, which the input carries on to the run. Out: the run's
//! summary (200), 404 for a run the caller's tenant does not have, 410 for
//! one retention deleted, or 202 once the broker holds the input.
//! Guarantees: a tenant never learns whether another tenant's run exists; a
//! signal id already recorded with another name or payload is 422, not a
//! second signal.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use rdkafka::producer::FutureRecord;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value, json};
use sqlx::Row;
use tracing::Instrument;

use super::ApiState;
use super::error::{ApiError, Code, body_error, database};
use super::request::{authenticate, read_body, tenant, traced};
use crate::auth::Scope;
use crate::contract::formats::{AnyValue, Id, Name, Timestamp};
use crate::contract::{Input, InputTopic, SignalWakeup, TraceContext, decode_value, parse_value};
use crate::coordinator::state::RunStatus;
use crate::routing;

/// `GET /v1/runs/{id}`: the run as its tenant sees it.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "Run")]
pub struct RunSummary {
    #[schemars(with = "Id")]
    pub run_id: String,
    #[schemars(with = "Id")]
    pub tenant: String,
    #[schemars(with = "Name")]
    pub pool: String,
    #[schemars(with = "Name")]
    pub workflow: String,
    #[schemars(range(min = 1))]
    pub workflow_version: i32,
    #[schemars(with = "RunStatusName")]
    pub status: String,
    /// The run's last transition (`last_transition_seq`).
    #[schemars(range(min = 0))]
    pub last_transition_seq: i64,
    #[schemars(with = "Timestamp")]
    pub created_at: DateTime<Utc>,
    #[schemars(with = "Timestamp")]
    pub updated_at: DateTime<Utc>,
    /// `null` while the run is running.
    #[schemars(with = "Option<Timestamp>")]
    pub finished_at: Option<DateTime<Utc>>,
    /// The last step's output once the run succeeded; `null` before, and
    /// for a run that did not succeed.
    #[schemars(with = "AnyValue")]
    pub output: Value,
    /// Why the run failed, once it failed; `null` otherwise.
    #[schemars(with = "AnyValue")]
    pub error: Value,
}

/// A run's status, as [`RunStatus`] names it.
struct RunStatusName;

impl JsonSchema for RunStatusName {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> std::borrow::Cow<'static, str> {
        "RunStatus".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let names = RunStatus::ALL.map(RunStatus::as_str);
        schemars::json_schema!({ "type": "string", "enum": names })
    }
}

/// Whether a signal was handed to the run now, or had been already.
#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SignalStatus {
    /// The `wakeup.signal` input is on the wakeups topic (202).
    Accepted,
    /// The run has recorded this `signal_id` with the same name and
    /// payload (200).
    Duplicate,
}

/// The answer to `POST /v1/runs/{id}/signals`.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "SignalAccepted")]
pub struct SignalAnswer {
    #[schemars(with = "Id")]
    pub run_id: String,
    /// The signal's id: the one sent, or the one the server chose.
    pub signal_id: String,
    pub status: SignalStatus,
}

/// `GET /v1/runs/{id}`: the run, if it is the caller's tenant's.
pub(crate) async fn get_run(
    State(state): State<ApiState>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let answer = async {
        let identity = authenticate(&state, &headers, Scope::RunsRead).await?;
        let tenant = tenant(&identity, named_tenant(&headers), None)?;
        let pool = state.decider.pool();
        if let Some(run) = run_summary(pool, &run_id, &tenant)
            .await
            .map_err(database)?
        {
            return Ok(run);
        }
        Err(
            match purged_at(pool, &run_id, &tenant).await.map_err(database)? {
                Some(at) => purged(at),
                None => not_found(),
            },
        )
    };
    match answer.await {
        Ok(body) => (StatusCode::OK, axum::Json(body)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/runs/{id}/signals` with `{"name": ..., "payload": ...,
/// "signal_id": ...}`. A `signal_id` the run has recorded is answered here:
/// 200 for the same name and payload, 422 `idempotency_mismatch` for
/// others; a new one goes to the coordinator, 202. Without a `signal_id`
/// the server chooses one, and a retry then signals twice.
pub(crate) async fn signal_run(
    State(state): State<ApiState>,
    Path(run_id): Path<String>,
    request: Request<Body>,
) -> Response {
    let (span, trace) = traced(
        request.headers(),
        tracing::info_span!(
            target: crate::infra::traces::TARGET,
            parent: None,
            "api.signal_run",
            ductor.run_id = %run_id,
        ),
    );
    let answer = async {
        let (tenant, mut fields) = accept(&state, request, false).await?;
        fields
            .entry("signal_id")
            .or_insert_with(|| json!(uuid::Uuid::new_v4().to_string()));
        fields.entry("payload").or_insert(Value::Null);
        let (input, signal) = wakeup_input(&tenant, &run_id, "wakeup.signal", fields)?;
        let Input::Signal(signal) = signal else {
            return Err(invalid("the body does not make a signal"));
        };
        let recorded = recorded_signal(state.decider.pool(), &run_id, &tenant, &signal.signal_id)
            .await
            .map_err(database)?
            .ok_or_else(not_found)?;
        let answer = |status| SignalAnswer {
            run_id: run_id.clone(),
            signal_id: signal.signal_id.clone(),
            status,
        };
        if let Some(record) = recorded {
            already_signalled(&signal, &record)?;
            return Ok((StatusCode::OK, answer(SignalStatus::Duplicate)));
        }
        produce(&state, &tenant, &run_id, &input, trace.as_ref()).await?;
        Ok((StatusCode::ACCEPTED, answer(SignalStatus::Accepted)))
    };
    match answer.instrument(span).await {
        Ok(answer) => (answer.0, axum::Json(answer.1)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Whether a signal whose id the run has recorded may be answered as a
/// duplicate: the same one again (or one recorded before fingerprints were
/// kept) is; one with another name or payload is refused.
fn already_signalled(signal: &SignalWakeup, record: &Value) -> Result<(), ApiError> {
    let ours = crate::contract::fingerprint::signal(&signal.name, &signal.payload);
    match record.get("fingerprint").and_then(Value::as_str) {
        Some(stored) if stored != ours => {
            routing::count_mismatch(routing::MismatchPath::Signal);
            Err(ApiError::new(
                Code::IdempotencyMismatch,
                "this signal_id was already used with another name or payload",
            ))
        }
        _ => Ok(()),
    }
}

/// The run's record of `signal_id`: `None` when the run is not the
/// tenant's, `Some(None)` when it has no such signal.
async fn recorded_signal(
    pool: &sqlx::PgPool,
    run_id: &str,
    tenant: &str,
    signal_id: &str,
) -> sqlx::Result<Option<Option<Value>>> {
    sqlx::query_scalar(
        "SELECT (SELECT s FROM jsonb_array_elements(state->'signals') s \
                 WHERE s->>'signal_id' = $3 LIMIT 1) \
         FROM runs WHERE run_id = $1 AND tenant_scope = $2",
    )
    .bind(run_id)
    .bind(tenant)
    .bind(signal_id)
    .fetch_optional(pool)
    .await
}

/// The fields of a wakeup a signal's, a cancel's or a retry's body may not set: the
/// server sets the envelope, and the run is the path's.
pub const SERVER_SET: [&str; 3] = ["type", "schema_version", "run_id"];

/// Authenticates a write, and reads its tenant and its body's fields (an
/// empty body is `{}` where `empty_ok`). The fields that name the input
/// itself are the server's to set.
pub(super) async fn accept(
    state: &ApiState,
    request: Request<Body>,
    empty_ok: bool,
) -> Result<(String, Map<String, Value>), ApiError> {
    let identity = authenticate(state, request.headers(), Scope::RunsWrite).await?;
    let (named, fields) = read_fields(state, request, empty_ok).await?;
    Ok((tenant(&identity, named.as_deref(), None)?, fields))
}

/// A write's body's fields (an empty body is `{}` where `empty_ok`), less
/// the tenant it names, by its body or its `X-Ductor-Tenant` header, which
/// is returned apart. The fields that name the input itself are the
/// server's to set.
pub(super) async fn read_fields(
    state: &ApiState,
    request: Request<Body>,
    empty_ok: bool,
) -> Result<(Option<String>, Map<String, Value>), ApiError> {
    let header = named_tenant(request.headers()).map(str::to_owned);
    let bytes = read_body(state, request).await?;
    let body = if bytes.is_empty() && empty_ok {
        Value::Object(Map::new())
    } else {
        parse_value(&bytes, &state.limits).map_err(body_error)?
    };
    let Value::Object(mut fields) = body else {
        return Err(invalid("the body must be a JSON object"));
    };
    for forbidden in SERVER_SET {
        if fields.contains_key(forbidden) {
            return Err(invalid(format!(
                "{forbidden}: not accepted here (the server sets it)"
            )));
        }
    }
    let body_tenant = match fields.remove("tenant") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(t),
        Some(_) => return Err(invalid("tenant: must be a string")),
    };
    let named = match (body_tenant, header) {
        (Some(body), Some(header)) if body != header => {
            return Err(ApiError::new(
                Code::TenantMismatch,
                "the body's tenant and X-Ductor-Tenant differ",
            ));
        }
        (body, header) => body.or(header),
    };
    Ok((named, fields))
}

/// Builds the input of `kind` for the run from `fields`, checks it as the
/// ingress would, and puts it on the wakeups topic once the run is known
/// to be the tenant's.
pub(super) async fn send(
    state: &ApiState,
    to: Wakeup<'_>,
    kind: &str,
    input: Map<String, Value>,
) -> Result<(), ApiError> {
    let (input, _) = wakeup_input(to.tenant, to.run_id, kind, input)?;
    if !run_exists(state.decider.pool(), to.run_id, to.tenant)
        .await
        .map_err(database)?
    {
        return Err(not_found());
    }
    produce(state, to.tenant, to.run_id, &input, to.trace).await
}

/// Where a wakeup made over HTTP goes, and the trace it continues.
#[derive(Clone, Copy)]
pub(super) struct Wakeup<'a> {
    pub(super) tenant: &'a str,
    pub(super) run_id: &'a str,
    pub(super) trace: Option<&'a TraceContext>,
}

/// The wakeup input of `kind` for the run, from the body's `fields`, as
/// JSON and decoded: refused as the ingress would refuse it.
pub(super) fn wakeup_input(
    tenant: &str,
    run_id: &str,
    kind: &str,
    mut input: Map<String, Value>,
) -> Result<(Value, Input), ApiError> {
    input.insert("type".into(), json!(kind));
    input.insert(
        "schema_version".into(),
        json!(crate::contract::input::SCHEMA_VERSION),
    );
    input.insert("run_id".into(), json!(run_id));
    input.insert("tenant".into(), json!(tenant));
    let input = Value::Object(input);
    let decoded = decode_value(InputTopic::Wakeups, &input)
        .map_err(|e| ApiError::class(StatusCode::BAD_REQUEST, e.class.as_str(), e.message))?;
    Ok((input, decoded))
}

/// Puts `input` on the wakeups topic, keyed by the run, signed when the
/// tenant has a key and with the request's trace context when it has one;
/// returns once the broker has it.
pub(super) async fn produce(
    state: &ApiState,
    tenant: &str,
    run_id: &str,
    input: &Value,
    trace: Option<&TraceContext>,
) -> Result<(), ApiError> {
    let bytes = serde_json::to_vec(input).expect("a JSON value serializes");
    let sink = &state.inputs;
    let signed_at_ms = chrono::Utc::now().timestamp_millis();
    let signature = sink
        .signatures
        .key(tenant)
        .map(|key| crate::contract::signature::sign(key, &bytes, signed_at_ms));
    if signature.is_none() && sink.signatures.required(None) {
        // The ingress would refuse it: say so now rather than answer 202
        // for an input that only the dead-letter topic will see.
        return Err(ApiError::new(
            Code::SigningKeyMissing,
            "this deployment requires every input to be signed with its tenant's key, and \
             this tenant has none (signatures.tenant_keys): ask the operator for one",
        ));
    }
    let mut headers = Vec::new();
    if let Some(signature) = signature {
        headers.push((crate::contract::signature::SIGNATURE, signature));
    }
    headers.extend(trace.into_iter().flat_map(TraceContext::headers));
    let mut record = FutureRecord::to(&sink.topic).key(run_id).payload(&bytes);
    if !headers.is_empty() {
        let mut owned = rdkafka::message::OwnedHeaders::new_with_capacity(headers.len());
        for (key, value) in &headers {
            owned = owned.insert(rdkafka::message::Header {
                key,
                value: Some(value.as_str()),
            });
        }
        record = record.headers(owned);
    }
    let producer = sink.producer.get().map_err(|e| {
        tracing::warn!(error = %e, "no producer for the API's inputs");
        ApiError::new(
            Code::Unavailable,
            "the input could not be handed to Kafka; retry",
        )
    })?;
    producer
        .send(record, sink.timeout)
        .await
        .map_err(|(e, _)| {
            tracing::warn!(error = %e, "an API input was not accepted by the broker");
            ApiError::new(
                Code::Unavailable,
                "the input could not be handed to Kafka; retry",
            )
        })?;
    Ok(())
}

/// The tenant of the run `run_id`, whoever's it is.
pub(super) async fn run_tenant(pool: &sqlx::PgPool, run_id: &str) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT tenant_scope FROM runs WHERE run_id = $1")
        .bind(run_id)
        .fetch_optional(pool)
        .await
}

async fn run_exists(pool: &sqlx::PgPool, run_id: &str, tenant: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM runs WHERE run_id = $1 AND tenant_scope = $2)")
        .bind(run_id)
        .bind(tenant)
        .fetch_one(pool)
        .await
}

pub(super) fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(Code::InvalidRequest, message)
}

/// When retention deleted the tenant's run `run_id`, if it did.
async fn purged_at(
    pool: &sqlx::PgPool,
    run_id: &str,
    tenant: &str,
) -> sqlx::Result<Option<chrono::DateTime<chrono::Utc>>> {
    sqlx::query_scalar(
        "SELECT purged_at FROM run_tombstones WHERE run_id = $1 AND tenant_scope = $2",
    )
    .bind(run_id)
    .bind(tenant)
    .fetch_optional(pool)
    .await
}

/// `410 run_purged`: the run finished and retention deleted it.
fn purged(at: chrono::DateTime<chrono::Utc>) -> ApiError {
    let at = crate::contract::effects::rfc3339(at);
    let message = format!("the run finished and was deleted by retention at {at}");
    ApiError::new(Code::RunPurged, message)
}

pub(super) fn not_found() -> ApiError {
    ApiError::new(Code::NotFound, "no such run")
}

/// The `X-Ductor-Tenant` header: the tenant a request names, which must be
/// its key's (and is required without authentication).
fn named_tenant(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("x-ductor-tenant")
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.is_empty())
}

async fn run_summary(
    pool: &sqlx::PgPool,
    run_id: &str,
    tenant: &str,
) -> Result<Option<RunSummary>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT run_id, tenant_scope, pool_id, workflow_name, workflow_version, status, \
             last_transition_seq, created_at, updated_at, finished_at, \
             state->'output' AS output, state->'error' AS error \
         FROM runs WHERE run_id = $1 AND tenant_scope = $2",
    )
    .bind(run_id)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let status: String = row.try_get("status")?;
    let output: Option<Value> = row.try_get("output")?;
    let succeeded = status == RunStatus::Succeeded.as_str();
    Ok(Some(RunSummary {
        run_id: row.try_get("run_id")?,
        tenant: row.try_get("tenant_scope")?,
        pool: row.try_get("pool_id")?,
        workflow: row.try_get("workflow_name")?,
        workflow_version: row.try_get("workflow_version")?,
        status,
        last_transition_seq: row.try_get("last_transition_seq")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        finished_at: row.try_get("finished_at")?,
        output: output.filter(|_| succeeded).unwrap_or(Value::Null),
        error: row
            .try_get::<Option<Value>, _>("error")?
            .unwrap_or(Value::Null),
    }))
}
