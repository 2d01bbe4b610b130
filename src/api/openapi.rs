//! The HTTP API described as OpenAPI 3.1: every route of both listeners,
//! every answer each can give (status, code, body), and who may call it.
//!
//! In: the table of routes ([`super::routes::ROUTES`]), the codes
//! ([`Code`]) and the classes of the contract and of the apply path, the
//! contract's JSON Schemas ([`crate::contract::schema::catalogue`]), from
//! which the request bodies are cut, and the answers' own types, from which
//! their schemas are generated. Out: [`document`], committed as
//! `schemas/openapi.json` (`ductor schemas`) and served at
//! `GET /v1/openapi.json`. Guarantees: pure and deterministic (the same
//! build gives the same bytes, whatever the configuration); one operation
//! per method and path, naming the listeners that serve it; a code or a
//! class is spelled only by the type that owns it.
//!
//! `/healthz`, `/readyz`, this description, the operator's views of runs,
//! the cancel, the dead letters, the outbox and retention are on both
//! listeners: each is one operation with both
//! listeners as its servers and the answers of both; an answer only one
//! listener gives names it (`x-ductor-listeners`).

use std::collections::BTreeMap;
use std::sync::LazyLock;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, SchemaGenerator};
use serde_json::{Map, Value, json};

use super::actions::{CancelAnswer, RetryAnswer};
use super::error::{Code, ErrorBody};
use super::routes::{Access, Endpoint, Listener, ROUTES, Route};
use super::runs::{RunSummary, SignalAnswer};
use crate::apply::ApplyFailure;
use crate::contract::InputErrorClass;
use crate::contract::screen::Violation;
use crate::infra::health::{AdminReadiness, Liveness, PublicReadiness};
use crate::infra::http_server::MAX_HEADER_BYTES;
use crate::routing::{MAX_KEY_LEN, RoutingDecision};

/// The document's path under `schemas/`.
pub const FILE: &str = "openapi.json";

/// The name of the bearer-key security scheme.
const SCHEME: &str = "apiKey";

/// The document's text, made once per process.
static TEXT: LazyLock<String> = LazyLock::new(text);

/// `GET /v1/openapi.json`.
pub(crate) async fn serve() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], TEXT.as_str()).into_response()
}

/// The document's text: pretty JSON with a final newline, as committed.
pub fn text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}

/// The whole document.
pub fn document() -> Value {
    let mut schemas = Schemas::new();
    // Every refusal's body, which the answers name by its reference.
    schemas.of::<ErrorBody<'_>>();
    let mut paths = Map::new();
    for (path, verb) in operations() {
        let rows: Vec<&Route> = ROUTES
            .iter()
            .filter(|r| r.path == path && r.verb.as_str() == verb)
            .collect();
        let item = paths
            .entry(path.to_owned())
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .map(|item| item.insert(verb.to_owned(), operation(&rows, &mut schemas)));
        debug_assert!(item.is_some(), "a path item is an object");
    }
    json!({
        "openapi": "3.1.0",
        "info": info(),
        "servers": [server(Listener::Public), server(Listener::Admin)],
        "tags": [
            { "name": "runs", "description": "Start runs and read, signal and cancel them, as the key's tenant." },
            { "name": "health", "description": "Liveness and readiness, on both listeners." },
            { "name": "operator", "description": "What the operator and the scraper read, on the admin listener." },
            { "name": "dead-letters", "description": "The recorded dead letters: list, read, replay, discard." },
            { "name": "console", "description": "The web console's page and files, on the admin listener; its data comes from the operator's routes." },
            { "name": "meta", "description": "This description." },
        ],
        "paths": paths,
        "components": {
            "schemas": schemas.finish(),
            "securitySchemes": { SCHEME: security_scheme() },
        },
    })
}

/// Each method and path once, in the table's order.
fn operations() -> Vec<(&'static str, &'static str)> {
    let mut seen = Vec::new();
    for row in &ROUTES {
        let key = (row.path, row.verb.as_str());
        if !seen.contains(&key) {
            seen.push(key);
        }
    }
    seen
}

fn info() -> Value {
    json!({
        "title": "Ductor HTTP API",
        "version": env!("CARGO_PKG_VERSION"),
        "summary": "Start, read, signal and cancel runs of a durable step orchestrator; its health and metrics.",
        "description": concat!(
            "`ductor serve` listens twice: the public listener (`server.listen`) carries the run ",
            "endpoints, `/healthz`, a `/readyz` that tells only the verdict, and this document; the ",
            "admin listener (`server.admin_listen`, loopback by default) carries `/healthz`, the ",
            "detailed `/readyz`, `/metrics`, this document, the operator's views of runs, the cancel, ",
            "the dead letters, the outbox and retention (for a key with the `admin` scope, whatever ",
            "`server.admin_auth` says), and the ",
            "web console at `/ui`. Each operation names the listeners that serve it.\n\n",
            "Every run endpoint takes an API key, `Authorization: Bearer <key>` (`ductor keys create`), ",
            "and acts as the key's tenant; the scope each needs is its security requirement. A refusal ",
            "is `{\"error\": {\"code\": ..., \"message\": ...}}` with a stable `code`, listed with each ",
            "status below. The contract's messages (`run.start`, `wakeup.signal`, `wakeup.cancel`) are ",
            "the JSON Schemas under `schemas/messages/`; a request body here is one of them without the ",
            "fields the server sets.",
        ),
        "license": { "name": "Apache-2.0", "identifier": "Apache-2.0" },
    })
}

/// A listener as a server of the document.
fn server(listener: Listener) -> Value {
    let (url, description) = match listener {
        Listener::Public => (
            "http://127.0.0.1:8080",
            "The public listener, `server.listen` (HTTPS with `server.tls_cert_file`).",
        ),
        Listener::Admin => (
            "http://127.0.0.1:9464",
            "The admin listener, `server.admin_listen` (HTTPS with `server.admin_tls_cert_file`).",
        ),
    };
    json!({ "url": url, "description": description, "x-ductor-listener": listener.as_str() })
}

fn security_scheme() -> Value {
    json!({
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "dk_<key_id>_<secret>",
        "description": concat!(
            "An API key made by `ductor keys create --tenant T --scopes ...`. A requirement names ",
            "the scope the operation needs: `runs:write` to start, signal and cancel, `runs:read` ",
            "to read, `admin` to read and cancel every tenant's runs, on the admin listener always ",
            "and for its `/readyz` and `/metrics` under `server.admin_auth = \"key\"`. With ",
            "`server.auth = \"disabled\"` (local development ",
            "only) the run endpoints take no key and a request names its tenant: the body's ",
            "`tenant`, or the `X-Ductor-Tenant` header.",
        ),
    })
}

/// The operation of `rows`: one route, or the same method and path on
/// both listeners.
fn operation(rows: &[&Route], schemas: &mut Schemas) -> Value {
    let mut answers = Vec::new();
    let mut descriptions = Vec::new();
    // The listeners that give each status.
    let mut given: BTreeMap<u16, Vec<&'static str>> = BTreeMap::new();
    for row in rows {
        let theirs = answers_of(row.endpoint, schemas);
        for answer in &theirs {
            let listeners = given.entry(answer.status().as_u16()).or_default();
            if !listeners.contains(&row.listener.as_str()) {
                listeners.push(row.listener.as_str());
            }
        }
        answers.extend(theirs);
        let text = about(row.endpoint).description;
        if !descriptions.contains(&text) {
            descriptions.push(text);
        }
    }
    let first = about(rows[0].endpoint);
    let mut op = json!({
        "operationId": first.id,
        "summary": first.summary,
        "description": descriptions.join("\n\n"),
        "tags": [first.tag],
        "servers": rows.iter().map(|r| server(r.listener)).collect::<Vec<_>>(),
        "security": security(rows),
        "responses": responses(answers),
    });
    for (status, listeners) in given {
        if listeners.len() < rows.len() {
            op["responses"][status.to_string()]["x-ductor-listeners"] = json!(listeners);
        }
    }
    let parameters = parameters(rows[0].endpoint);
    if !parameters.is_empty() {
        op["parameters"] = parameters.into();
    }
    if let Some(body) = request_body(rows[0].endpoint, schemas) {
        op["requestBody"] = body;
    }
    op
}

/// Who may call: no requirement for an open route, one of the scope for a
/// keyed one, either for the admin routes.
fn security(rows: &[&Route]) -> Value {
    let mut requirements: Vec<Value> = Vec::new();
    for row in rows {
        let needs: &[Value] = &match row.access {
            Access::Open => vec![json!({})],
            Access::Key(scope) => vec![json!({ SCHEME: [scope.as_str()] })],
            Access::AdminKey => vec![
                json!({}),
                json!({ SCHEME: [crate::auth::Scope::Admin.as_str()] }),
            ],
            Access::Reader => vec![
                json!({ SCHEME: [crate::auth::Scope::RunsRead.as_str()] }),
                json!({ SCHEME: [crate::auth::Scope::Admin.as_str()] }),
            ],
            Access::Writer => vec![
                json!({ SCHEME: [crate::auth::Scope::RunsWrite.as_str()] }),
                json!({ SCHEME: [crate::auth::Scope::Admin.as_str()] }),
            ],
            Access::Admin => vec![json!({ SCHEME: [crate::auth::Scope::Admin.as_str()] })],
        };
        for need in needs {
            if !requirements.contains(need) {
                requirements.push(need.clone());
            }
        }
    }
    if requirements == [json!({})] {
        return json!([]);
    }
    Value::Array(requirements)
}

/// What an operation is called and says of itself.
struct About {
    id: &'static str,
    summary: &'static str,
    description: &'static str,
    tag: &'static str,
}

fn about(endpoint: Endpoint) -> About {
    let (id, summary, tag, description) = match endpoint {
        Endpoint::Healthz | Endpoint::AdminHealthz => (
            "healthz",
            "The process runs",
            "health",
            "Liveness: answers while the process runs, on either listener, without a key.",
        ),
        Endpoint::PublicReadyz => (
            "readyz",
            "Ready or not",
            "health",
            "On the public listener: the latest readiness verdict and nothing more, no check named and no error text. It costs no query: one task per process checks every `server.readiness_interval_ms`.",
        ),
        Endpoint::AdminReadyz => (
            "readyz",
            "Ready or not",
            "health",
            "On the admin listener: the same verdict with each check's result and the failing check's error (Postgres, Kafka, the ingress and its apply lanes), and the `warnings` of the configuration. Under `server.admin_auth = \"key\"` it takes a key with the `admin` scope.",
        ),
        Endpoint::Metrics => (
            "metrics",
            "Prometheus metrics",
            "operator",
            "Every counter, gauge and histogram of the process, in Prometheus's text format. Under `server.admin_auth = \"key\"` it takes a key with the `admin` scope.",
        ),
        Endpoint::OpenApi | Endpoint::AdminOpenApi => (
            "openapi",
            "This description",
            "meta",
            "This document, as committed in `schemas/openapi.json`; no key needed.",
        ),
        Endpoint::CreateRun | Endpoint::GetRun => runs_about(endpoint),
        Endpoint::Console | Endpoint::ConsoleScript | Endpoint::ConsoleStyle => {
            console_about(endpoint)
        }
        Endpoint::AdminListRuns
        | Endpoint::AdminCountRuns
        | Endpoint::AdminRunHistory
        | Endpoint::AdminCancelRun
        | Endpoint::AdminRetryRun
        | Endpoint::AdminListLetters
        | Endpoint::AdminCountLetters
        | Endpoint::AdminGetLetter
        | Endpoint::AdminReplayLetter
        | Endpoint::AdminReplayLetters
        | Endpoint::AdminDiscardLetter
        | Endpoint::AdminOutboxStatus
        | Endpoint::AdminRedriveOutbox
        | Endpoint::AdminRetentionStatus => admin_about(endpoint),
        Endpoint::ListRuns | Endpoint::CountRuns | Endpoint::RunHistory => operator_about(endpoint),
        Endpoint::OutboxStatus | Endpoint::RedriveOutbox | Endpoint::RetentionStatus => {
            outbox_about(endpoint)
        }
        Endpoint::ListLetters
        | Endpoint::CountLetters
        | Endpoint::GetLetter
        | Endpoint::ReplayLetter
        | Endpoint::ReplayLetters
        | Endpoint::DiscardLetter => letters_about(endpoint),
        Endpoint::SignalRun | Endpoint::CancelRun | Endpoint::RetryRun => wakeup_about(endpoint),
    };
    About {
        id,
        summary,
        description,
        tag,
    }
}

/// What the routes that put a wakeup on a run's topic are called and say
/// of themselves.
fn wakeup_about(endpoint: Endpoint) -> (&'static str, &'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::SignalRun => (
            "signalRun",
            "Signal a run",
            "runs",
            "Puts a `wakeup.signal` for the run on the wakeups topic, keyed by the run, and answers 202 once the broker has it; the run's one writer applies it in order with its other inputs. A `signal_id` the run has recorded is answered here: 200 for the same name and payload, 422 `idempotency_mismatch` for another. Without a `signal_id` the server picks one, and a retry then signals twice. Two calls racing with one new `signal_id` both get 202; the coordinator applies the first.",
        ),
        Endpoint::CancelRun => (
            "cancelRun",
            "Cancel a run",
            "runs",
            "Puts a `wakeup.cancel` for the run on the wakeups topic, keyed by the run, and answers 202 once the broker has it, with the cancel's `action_id` (the caller's, or one the server picks), which the `run.cancelled` transition records. A run is cancelled once: a second cancel changes nothing.",
        ),
        _ => (
            "retryRun",
            "Retry a failed run",
            "runs",
            "Puts a `wakeup.retry` for the run on the wakeups topic, keyed by the run, and answers 202 once the broker has it: the run's one writer starts it again from the step it failed in, with a fresh attempt and stamp (a `run.retried` transition). The retry is named by its `action_id`, the caller's or one the server picks: the run applies each once, so a call sent again with the same `action_id` answers 200 (`applied`) once the run has applied it, and never retries twice. The retry names the failure it retries, `failed_seq` (the seq of the `run.failed` transition; by default the run's latest failure), so that it can never retry a later one. A run that is not failed, or failed by another transition, is refused (409 `run_not_failed`), and so is a run that failed compensated (409 `run_compensated`: what it did is undone); a run whose compensation failed goes on from that compensation. Two calls racing with different ids both get 202, and the run applies the first.",
        ),
    }
}

/// What the start and the read of a run are called and say of themselves.
fn runs_about(endpoint: Endpoint) -> (&'static str, &'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::CreateRun => (
            "createRun",
            "Start a run",
            "runs",
            "Routes a start request to exactly one decision per tenant, pool and `Idempotency-Key`: 201 with a new decision, 200 with the byte-identical body for a duplicate. A duplicate that arrives while the first caller decides follows the pool's `routing.duplicate_policy`: `wait` (up to `wait_timeout_ms`) for the decision, or `reject` at once with 409. A body over `routing.max_body_bytes` is 413; valid JSON that cannot be kept as sent is 422 with the screen's class.",
        ),
        _ => (
            "getRun",
            "Read a run",
            "runs",
            "The run's status, workflow, last transition, output or error. Another tenant's run answers exactly as a missing one does.",
        ),
    }
}

/// What the dead letters' routes are called and say of themselves.
fn letters_about(endpoint: Endpoint) -> (&'static str, &'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::ListLetters => (
            "listDeadLetters",
            "List dead letters",
            "dead-letters",
            "The recorded dead letters, newest first, filtered by class, stage, source topic, status and time; `next` is the `after` of the following page. A key with `runs:read` sees the letters of its tenant (those whose input named it); one with `admin` every letter.",
        ),
        Endpoint::CountLetters => (
            "countDeadLetters",
            "Count dead letters by class",
            "dead-letters",
            "The letters the filter finds, counted by stage and class, the most numerous first.",
        ),
        Endpoint::GetLetter => (
            "getDeadLetter",
            "Read a dead letter",
            "dead-letters",
            "One letter whole: where it was read from, why it was refused, its key, headers and value as recorded (text when UTF-8, else base64), and its replay or discard.",
        ),
        Endpoint::ReplayLetter => (
            "replayDeadLetter",
            "Replay a dead letter",
            "dead-letters",
            "Produces the letter's input again, byte for byte and signed again with its tenant's key, to the topic it was read from, once: a second replay answers with the first one's outcome (`already_replayed`) and produces nothing. The outcome names the run the input starts or reaches. A discarded letter is refused (409 `letter_settled`); one whose record was cut is refused (422 `not_replayable`). Takes `runs:write` for the tenant's own letters, `admin` for any.",
        ),
        Endpoint::ReplayLetters => (
            "replayDeadLetters",
            "Replay the dead letters a filter finds",
            "dead-letters",
            "Replays, oldest first, one page of the letters the filter finds that are still to be replayed; a letter that cannot be replayed is listed with its reason and the others go on. `next` is the page's cursor for the rest.",
        ),
        _ => (
            "discardDeadLetter",
            "Discard a dead letter",
            "dead-letters",
            "Sets the letter aside with a reason, kept with it: it is never replayed. A replayed letter is refused (409 `letter_settled`); a second discard keeps the first reason.",
        ),
    }
}

/// What the operator's pictures of the outbox and retention are called and
/// say of themselves.
fn outbox_about(endpoint: Endpoint) -> (&'static str, &'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::OutboxStatus => (
            "getOutbox",
            "The outbox",
            "operator",
            "What waits to be published, in all and per topic: the backlog, what of it is due now, scheduled for later (timers) or deferred after failed publishes, the parked intents, and how long the oldest due intent has waited; with the 100 oldest parked intents and their errors. Reads only undelivered intents. Takes a key with the `admin` scope.",
        ),
        Endpoint::RedriveOutbox => (
            "redriveOutbox",
            "Redrive parked intents",
            "operator",
            "Puts parked intents (all, or one run's, or those bound for one topic) back into the claim rounds once the cause is fixed, and wakes the drainers; answers how many. A redriven intent keeps its idempotency key. Takes a key with the `admin` scope.",
        ),
        _ => (
            "getRetention",
            "What retention deletes next",
            "operator",
            "The retention settings, the finished runs past `runs.retention_ms` and the tombstones past `runs.tombstone_retention_ms` due to be purged, and the oldest of each (counts bounded by `server.count_scan_limit`). Takes a key with the `admin` scope.",
        ),
    }
}

/// What the admin listener's views of runs add to the public ones'.
const ADMIN_VIEWS: &str = "On the admin listener it takes a key with the `admin` scope, whatever `server.admin_auth` says (the operator's views of every tenant are never open to whoever reaches the port), and sees every tenant's runs, or the `tenant` it names.";

/// What the operator's routes on the admin listener are called and say of
/// themselves, beside their public twins.
fn admin_about(endpoint: Endpoint) -> (&'static str, &'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::AdminRetryRun => (
            "retryRun",
            "Retry a failed run",
            "runs",
            "On the admin listener, a key with the `admin` scope retries any tenant's failed run: the wakeup carries the run's tenant, and a tenant the request names must be the run's (403 `tenant_mismatch`).",
        ),
        Endpoint::AdminCancelRun => (
            "cancelRun",
            "Cancel a run",
            "runs",
            "On the admin listener, a key with the `admin` scope cancels any tenant's run: the wakeup carries the run's tenant, and a tenant the request names must be the run's (403 `tenant_mismatch`).",
        ),
        Endpoint::AdminListRuns | Endpoint::AdminCountRuns | Endpoint::AdminRunHistory => {
            let (id, summary, tag, _) = operator_about(endpoint);
            (id, summary, tag, ADMIN_VIEWS)
        }
        Endpoint::AdminOutboxStatus
        | Endpoint::AdminRedriveOutbox
        | Endpoint::AdminRetentionStatus => {
            let (id, summary, tag, _) = outbox_about(public_twin(endpoint));
            (id, summary, tag, ADMIN_OUTBOX)
        }
        _ => {
            let (id, summary, tag, _) = letters_about(public_twin(endpoint));
            (id, summary, tag, ADMIN_LETTERS)
        }
    }
}

/// What the admin listener's dead-letter routes add to the public ones'.
const ADMIN_LETTERS: &str = "On the admin listener it takes a key with the `admin` scope, whatever `server.admin_auth` says (what acts on every tenant's letters is never open to whoever reaches the port), and acts on every tenant's letters, or the `tenant` it names.";

/// What the admin listener's outbox and retention routes add to the
/// public ones'.
const ADMIN_OUTBOX: &str = "On the admin listener it takes a key with the `admin` scope as well, whatever `server.admin_auth` says.";

/// The public route an admin listener's route repeats; `endpoint` itself
/// when it repeats none.
fn public_twin(endpoint: Endpoint) -> Endpoint {
    match endpoint {
        Endpoint::AdminListRuns => Endpoint::ListRuns,
        Endpoint::AdminCountRuns => Endpoint::CountRuns,
        Endpoint::AdminRunHistory => Endpoint::RunHistory,
        Endpoint::AdminCancelRun => Endpoint::CancelRun,
        Endpoint::AdminRetryRun => Endpoint::RetryRun,
        Endpoint::AdminListLetters => Endpoint::ListLetters,
        Endpoint::AdminCountLetters => Endpoint::CountLetters,
        Endpoint::AdminGetLetter => Endpoint::GetLetter,
        Endpoint::AdminReplayLetter => Endpoint::ReplayLetter,
        Endpoint::AdminReplayLetters => Endpoint::ReplayLetters,
        Endpoint::AdminDiscardLetter => Endpoint::DiscardLetter,
        Endpoint::AdminOutboxStatus => Endpoint::OutboxStatus,
        Endpoint::AdminRedriveOutbox => Endpoint::RedriveOutbox,
        Endpoint::AdminRetentionStatus => Endpoint::RetentionStatus,
        other => other,
    }
}

/// What the console's files are called and say of themselves.
fn console_about(endpoint: Endpoint) -> (&'static str, &'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::ConsoleScript => (
            "consoleScript",
            "The console's script",
            "console",
            "The web console's script, shipped in the binary.",
        ),
        Endpoint::ConsoleStyle => (
            "consoleStyle",
            "The console's style sheet",
            "console",
            "The web console's style sheet, shipped in the binary.",
        ),
        _ => (
            "console",
            "The web console",
            "console",
            "The web console: runs with live counts by status, one run's timeline, and an overview of the metrics. The page carries no data and takes no key; its script asks the operator for a key with the `admin` scope once, keeps it in the tab's session storage, and calls this listener's operator routes with it.",
        ),
    }
}

/// What the operator's views of runs are called and say of themselves.
fn operator_about(endpoint: Endpoint) -> (&'static str, &'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::ListRuns | Endpoint::AdminListRuns => (
            "listRuns",
            "List and search runs",
            "runs",
            "A page of runs, newest first, filtered by any of the query's parameters. A key with `runs:read` sees its own tenant's runs; one with `admin` every tenant's, or the `tenant` it names. Each page is one keyset scan of an index of `runs`, so a page costs the same however many runs there are; `next` is the `after` of the following page.",
        ),
        Endpoint::CountRuns | Endpoint::AdminCountRuns => (
            "countRuns",
            "Count runs by status",
            "runs",
            "How many runs the filter finds, by status. A filter of `tenant`, `workflow`, `version` and `status` is answered from the counts Ductor keeps as runs change status, without reading the runs; any other filter counts at most `server.count_scan_limit` runs, and says `\"exact\": false` when it stopped there.",
        ),
        _ => (
            "getRunHistory",
            "A run's whole history",
            "runs",
            "The run with its input, output and error, every attempt from dispatch to result, and every transition with the effects it produced and where each is on its way to Kafka (`delivered`, `due`, `scheduled`, `deferred`, `parked`). Delivered effects are listed until the outbox purges them (`drainer.retention_ms`). Another tenant's run answers as a missing one does, unless the key has the `admin` scope.",
        ),
    }
}

/// One answer an operation can give.
enum Answer {
    /// A body the operation answers with.
    Body {
        status: StatusCode,
        media: &'static str,
        schema: Value,
        description: &'static str,
    },
    /// A refusal with one of the API's codes.
    Refusal(Code),
    /// A refusal whose code is a class of the contract or of the apply
    /// path.
    Class {
        status: StatusCode,
        class: &'static str,
        meaning: &'static str,
    },
    /// 431 from the listener, before any route, without a body: the
    /// request's head is over [`MAX_HEADER_BYTES`].
    HeadTooLarge,
    /// A file of the console, with its Content-Security-Policy.
    ConsoleFile {
        media: &'static str,
        description: &'static str,
    },
}

fn json_body(status: StatusCode, schema: Value, description: &'static str) -> Answer {
    Answer::Body {
        status,
        media: "application/json",
        schema,
        description,
    }
}

fn refusals(codes: &[Code]) -> impl Iterator<Item = Answer> + '_ {
    codes.iter().copied().map(Answer::Refusal)
}

/// What the run endpoints refuse before their own work: the key, its
/// scope and tenant, and the guard's bounds.
const KEYED: [Code; 6] = [
    Code::Unauthenticated,
    Code::InsufficientScope,
    Code::TenantMismatch,
    Code::Unavailable,
    Code::Overloaded,
    Code::Timeout,
];

/// What the admin listener's key refuses under `server.admin_auth = "key"`.
const ADMIN_KEYED: [Code; 3] = [
    Code::Unauthenticated,
    Code::InsufficientScope,
    Code::Unavailable,
];

/// What a body is refused for before it is read as a request.
const BODY: [Code; 6] = [
    Code::BodyTimeout,
    Code::BodyTooLarge,
    Code::BodyIncomplete,
    Code::UnsupportedMediaType,
    Code::InvalidJson,
    Code::InvalidRequest,
];

/// A body's refusals: its reading, its shape (the screen's classes, 422)
/// and its fields (the contract's `invalid`, 400).
fn body_refusals() -> impl Iterator<Item = Answer> {
    let screen = Violation::ALL.map(|violation| Answer::Class {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        class: violation.as_str(),
        meaning: "valid JSON that cannot be kept as sent (U+0000, an unpaired surrogate, an inexact number, a duplicate key, or past a bound of `coordinator.max_json_depth`, `max_string_bytes`, `max_array_items`, `max_object_keys`)",
    });
    let invalid = Answer::Class {
        status: StatusCode::BAD_REQUEST,
        class: InputErrorClass::Invalid.as_str(),
        meaning: "a field the contract refuses; the message names it",
    };
    refusals(&BODY).chain(screen).chain([invalid])
}

/// Every answer of `endpoint`. Each listener answers 429 to an address
/// past its failed authentications, and 431 to a head too large.
fn answers_of(endpoint: Endpoint, schemas: &mut Schemas) -> Vec<Answer> {
    let mut answers = vec![Answer::Refusal(Code::RateLimited), Answer::HeadTooLarge];
    let ok = StatusCode::OK;
    match endpoint {
        Endpoint::Healthz | Endpoint::AdminHealthz => {
            answers.push(json_body(ok, schemas.of::<Liveness>(), "The process runs."));
        }
        Endpoint::PublicReadyz | Endpoint::AdminReadyz => {
            answers.extend(readiness_answers(endpoint, schemas));
        }
        Endpoint::Metrics => {
            answers.push(Answer::Body {
                status: ok,
                media: "text/plain",
                schema: json!({ "type": "string", "description": "Prometheus text format 0.0.4." }),
                description: "The metrics.",
            });
            answers.extend(refusals(&ADMIN_KEYED));
        }
        Endpoint::Console | Endpoint::ConsoleScript | Endpoint::ConsoleStyle => {
            answers.push(console_answer(endpoint));
        }
        Endpoint::AdminListRuns
        | Endpoint::AdminCountRuns
        | Endpoint::AdminRunHistory
        | Endpoint::AdminCancelRun
        | Endpoint::AdminRetryRun
        | Endpoint::AdminListLetters
        | Endpoint::AdminCountLetters
        | Endpoint::AdminGetLetter
        | Endpoint::AdminReplayLetter
        | Endpoint::AdminReplayLetters
        | Endpoint::AdminDiscardLetter
        | Endpoint::AdminOutboxStatus
        | Endpoint::AdminRedriveOutbox
        | Endpoint::AdminRetentionStatus => answers.extend(admin_answers(endpoint, schemas)),
        Endpoint::OpenApi | Endpoint::AdminOpenApi => {
            let document =
                json!({ "type": "object", "description": "An OpenAPI 3.1 document: this one." });
            answers.push(json_body(ok, document, "This document."));
        }
        Endpoint::CreateRun => answers.extend(start_answers(schemas)),
        Endpoint::ListRuns | Endpoint::CountRuns | Endpoint::RunHistory => {
            answers.extend(operator_answers(endpoint, schemas));
        }
        Endpoint::OutboxStatus | Endpoint::RedriveOutbox | Endpoint::RetentionStatus => {
            answers.extend(outbox_answers(endpoint, schemas));
        }
        Endpoint::ListLetters
        | Endpoint::CountLetters
        | Endpoint::GetLetter
        | Endpoint::ReplayLetter
        | Endpoint::ReplayLetters
        | Endpoint::DiscardLetter => answers.extend(letters_answers(endpoint, schemas)),
        Endpoint::GetRun | Endpoint::SignalRun | Endpoint::CancelRun | Endpoint::RetryRun => {
            answers.extend(run_answers(endpoint, schemas));
        }
    }
    answers
}

/// The answers of both `/readyz`, besides 429 and 431.
fn readiness_answers(endpoint: Endpoint, schemas: &mut Schemas) -> Vec<Answer> {
    let (ok, unavailable) = (StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE);
    if endpoint == Endpoint::PublicReadyz {
        let verdict = schemas.of::<PublicReadiness>();
        let (yes, no) = (
            "Ready; on the public listener, the verdict alone.",
            "Not ready; on the public listener, the verdict alone.",
        );
        return vec![
            json_body(ok, verdict.clone(), yes),
            json_body(unavailable, verdict, no),
        ];
    }
    let detail = schemas.of::<AdminReadiness<'_>>();
    let (yes, no) = (
        "Ready; on the admin listener, with each check's result.",
        "Not ready; on the admin listener, with each check's result and the failing check's error.",
    );
    let mut answers = vec![
        json_body(ok, detail.clone(), yes),
        json_body(unavailable, detail, no),
    ];
    answers.extend(refusals(&ADMIN_KEYED));
    answers
}

/// The answers of the operator's routes on the admin listener, besides
/// 429 and 431: their public twins', but for what an operator's key
/// cannot be refused.
fn admin_answers(endpoint: Endpoint, schemas: &mut Schemas) -> Vec<Answer> {
    let twin = public_twin(endpoint);
    match twin {
        Endpoint::ListRuns | Endpoint::CountRuns | Endpoint::RunHistory => {
            // An operator sees every tenant: no tenant is another's.
            let theirs = operator_answers(endpoint, schemas);
            without(theirs, &[Code::TenantMismatch]).collect()
        }
        Endpoint::CancelRun | Endpoint::RetryRun => {
            // The tenant is the run's: none is missing.
            let theirs = run_answers(twin, schemas);
            without(theirs, &[Code::MissingTenant]).collect()
        }
        Endpoint::OutboxStatus | Endpoint::RedriveOutbox | Endpoint::RetentionStatus => {
            outbox_answers(twin, schemas)
        }
        _ => {
            // An operator acts on every tenant's: no tenant is another's.
            let theirs = letters_answers(twin, schemas);
            without(theirs, &[Code::TenantMismatch]).collect()
        }
    }
}

/// `answers` but the refusals with one of `codes`.
fn without(answers: Vec<Answer>, codes: &[Code]) -> impl Iterator<Item = Answer> + '_ {
    answers
        .into_iter()
        .filter(move |answer| !matches!(answer, Answer::Refusal(code) if codes.contains(code)))
}

/// The answers of the endpoints of one run, besides 429 and 431.
fn run_answers(endpoint: Endpoint, schemas: &mut Schemas) -> Vec<Answer> {
    let mut answers: Vec<Answer> = refusals(&KEYED).collect();
    answers.extend(refusals(&[Code::MissingTenant, Code::NotFound]));
    match endpoint {
        Endpoint::GetRun => {
            let run = schemas.of::<RunSummary>();
            answers.push(json_body(StatusCode::OK, run, "The run."));
            answers.push(Answer::Refusal(Code::RunPurged));
        }
        Endpoint::SignalRun => {
            let signal = schemas.of::<SignalAnswer>();
            let (accepted, duplicate) = (
                "The `wakeup.signal` input is on the wakeups topic (`status`: `accepted`).",
                "The run has recorded this `signal_id` with the same name and payload (`status`: `duplicate`).",
            );
            answers.push(json_body(StatusCode::ACCEPTED, signal.clone(), accepted));
            answers.push(json_body(StatusCode::OK, signal, duplicate));
            answers.extend(body_refusals());
            answers.extend(refusals(&[
                Code::IdempotencyMismatch,
                Code::SigningKeyMissing,
            ]));
        }
        Endpoint::CancelRun => {
            let cancel = schemas.of::<CancelAnswer>();
            let accepted = "The `wakeup.cancel` input is on the wakeups topic.";
            answers.push(json_body(StatusCode::ACCEPTED, cancel, accepted));
            answers.extend(body_refusals());
            answers.push(Answer::Refusal(Code::SigningKeyMissing));
        }
        Endpoint::RetryRun => {
            let retry = schemas.of::<RetryAnswer>();
            let (accepted, applied) = (
                "The `wakeup.retry` input is on the wakeups topic (`status`: `accepted`).",
                "The run has applied this `action_id`; nothing was sent (`status`: `applied`).",
            );
            answers.push(json_body(StatusCode::ACCEPTED, retry.clone(), accepted));
            answers.push(json_body(StatusCode::OK, retry, applied));
            answers.extend(body_refusals());
            answers.extend(refusals(&[
                Code::RunNotFailed,
                Code::RunCompensated,
                Code::SigningKeyMissing,
            ]));
        }
        _ => {}
    }
    answers
}

/// The answers of the operator's views of runs, besides 429 and 431.
fn operator_answers(endpoint: Endpoint, schemas: &mut Schemas) -> Vec<Answer> {
    use super::operator::views::{RunCounts, RunHistory, RunPage};
    let mut answers: Vec<Answer> = refusals(&KEYED).collect();
    match endpoint {
        Endpoint::ListRuns | Endpoint::AdminListRuns => {
            let page = schemas.of::<RunPage>();
            answers.push(json_body(StatusCode::OK, page, "A page of runs."));
            answers.push(Answer::Refusal(Code::InvalidQuery));
        }
        Endpoint::CountRuns | Endpoint::AdminCountRuns => {
            let counts = schemas.of::<RunCounts>();
            answers.push(json_body(StatusCode::OK, counts, "The counts."));
            answers.push(Answer::Refusal(Code::InvalidQuery));
        }
        _ => {
            let history = schemas.of::<RunHistory>();
            answers.push(json_body(StatusCode::OK, history, "The run's history."));
            answers.push(Answer::Refusal(Code::NotFound));
        }
    }
    answers
}

/// The one answer of a file of the console.
fn console_answer(endpoint: Endpoint) -> Answer {
    let (media, description) = match endpoint {
        Endpoint::ConsoleScript => ("text/javascript", "The script."),
        Endpoint::ConsoleStyle => ("text/css", "The style sheet."),
        _ => ("text/html", "The page."),
    };
    Answer::ConsoleFile { media, description }
}

/// The answers of the dead letters' routes, besides 429 and 431.
fn letters_answers(endpoint: Endpoint, schemas: &mut Schemas) -> Vec<Answer> {
    use crate::ingress::dead_letters::{
        ClassCount, DiscardOutcome, Letter, LetterPage, ReplayBatch, ReplayOutcome,
    };
    let mut answers: Vec<Answer> = refusals(&KEYED).collect();
    let ok = StatusCode::OK;
    match endpoint {
        Endpoint::ListLetters => {
            answers.push(json_body(
                ok,
                schemas.of::<LetterPage>(),
                "A page of letters.",
            ));
            answers.push(Answer::Refusal(Code::InvalidQuery));
        }
        Endpoint::CountLetters => {
            let item = schemas.of::<ClassCount>();
            let counts = json!({ "type": "object", "required": ["counts"], "properties": { "counts": { "type": "array", "items": item } } });
            answers.push(json_body(ok, counts, "The counts by stage and class."));
            answers.push(Answer::Refusal(Code::InvalidQuery));
        }
        Endpoint::GetLetter => {
            answers.push(json_body(ok, schemas.of::<Letter>(), "The letter."));
            answers.push(Answer::Refusal(Code::NotFound));
        }
        Endpoint::ReplayLetter => {
            let outcome = schemas.of::<ReplayOutcome>();
            answers.push(json_body(
                ok,
                outcome,
                "The replay's outcome, first or repeated.",
            ));
            answers.extend(refusals(&[
                Code::NotFound,
                Code::LetterSettled,
                Code::NotReplayable,
                Code::Contended,
            ]));
        }
        Endpoint::ReplayLetters => {
            let batch = schemas.of::<ReplayBatch>();
            answers.push(json_body(
                ok,
                batch,
                "The letters replayed and those refused.",
            ));
            answers.extend(
                refusals(&BODY).filter(|a| !matches!(a, Answer::Refusal(Code::InvalidJson))),
            );
        }
        _ => {
            let outcome = schemas.of::<DiscardOutcome>();
            answers.push(json_body(ok, outcome, "The discard, first or repeated."));
            answers.extend(refusals(&[Code::NotFound, Code::LetterSettled]));
            answers.extend(
                refusals(&BODY).filter(|a| !matches!(a, Answer::Refusal(Code::InvalidJson))),
            );
        }
    }
    answers
}

/// The answers of the outbox's and retention's pictures, besides 429 and
/// 431.
fn outbox_answers(endpoint: Endpoint, schemas: &mut Schemas) -> Vec<Answer> {
    use super::operator::outbox::{OutboxPicture, Redriven, RetentionPicture};
    let mut answers: Vec<Answer> = refusals(&KEYED)
        .filter(|a| !matches!(a, Answer::Refusal(Code::TenantMismatch)))
        .collect();
    match endpoint {
        Endpoint::OutboxStatus => {
            let picture = schemas.of::<OutboxPicture>();
            answers.push(json_body(StatusCode::OK, picture, "The outbox now."));
        }
        Endpoint::RedriveOutbox => {
            let redriven = schemas.of::<Redriven>();
            answers.push(json_body(
                StatusCode::OK,
                redriven,
                "How many parked intents were redriven.",
            ));
            answers.extend(
                refusals(&BODY).filter(|a| !matches!(a, Answer::Refusal(Code::InvalidJson))),
            );
        }
        _ => {
            let picture = schemas.of::<RetentionPicture>();
            answers.push(json_body(
                StatusCode::OK,
                picture,
                "What retention deletes next.",
            ));
        }
    }
    answers
}

/// `POST /v1/runs`'s answers besides 429 and 431.
fn start_answers(schemas: &mut Schemas) -> Vec<Answer> {
    let decision = schemas.of::<RoutingDecision>();
    let mut answers = vec![
        json_body(
            StatusCode::CREATED,
            decision.clone(),
            "A new decision: the run is created.",
        ),
        json_body(
            StatusCode::OK,
            decision,
            "A duplicate: the first decision for this key, byte for byte.",
        ),
    ];
    let own = [
        Code::InvalidIdempotencyKey,
        Code::InProgress,
        Code::IdempotencyKeyMismatch,
        Code::UnknownWorkflow,
        Code::Contended,
        Code::Internal,
    ];
    answers.extend(
        refusals(&KEYED)
            .chain(body_refusals())
            .chain(refusals(&own)),
    );
    answers.push(Answer::Class {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        class: InputErrorClass::PayloadTooLarge.as_str(),
        meaning: "the input, written back, would not fit the effect that carries it (`kafka.message_max_bytes` less 16 KiB)",
    });
    answers.extend(ApplyFailure::CLASSES.map(|class| Answer::Class {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        class,
        meaning: "Postgres refuses the request itself (SQLSTATE class 22, 23 or 54), or its state does not encode or decode, or is of a newer version than this binary reads: the same request would fail again",
    }));
    answers
}

/// What a code means, for the answers' descriptions.
fn meaning(code: Code) -> &'static str {
    match code {
        Code::Unauthenticated => {
            "a missing, malformed, unknown, expired or revoked key, the same answer for each, with `WWW-Authenticate: Bearer`"
        }
        Code::InsufficientScope => "the key lacks the operation's scope",
        Code::TenantMismatch => {
            "the body's `tenant` or the `X-Ductor-Tenant` header names a tenant other than the key's"
        }
        Code::MissingTenant => {
            "with `server.auth = \"disabled\"`, the request names no tenant (`X-Ductor-Tenant`)"
        }
        Code::RateLimited => {
            "the key is past its rate (`server.requests_per_second` in bursts of `server.request_burst`), or the client's address past its failed authentications (`server.auth_failure_burst`, then `server.auth_failures_per_second`); `Retry-After` gives the seconds to wait"
        }
        Code::Overloaded => {
            "more requests at once than `server.max_concurrent_requests`: shed, not queued, with `Retry-After: 1`"
        }
        Code::Timeout => {
            "the request took longer than `server.request_timeout_ms`, with `Retry-After: 1`; retry with the same idempotency key"
        }
        Code::BodyTimeout => "the body did not arrive within `server.body_read_timeout_ms`",
        Code::BodyTooLarge => "the body is over `routing.max_body_bytes`",
        Code::BodyIncomplete => "the body ended before its `Content-Length`",
        Code::UnsupportedMediaType => "a body without `Content-Type: application/json`",
        Code::InvalidJson => "the body is not JSON",
        Code::InvalidRequest => "the body is no JSON object, or sets a field the server sets",
        Code::InvalidIdempotencyKey => {
            "`Idempotency-Key` is not visible ASCII, or longer than 256 characters"
        }
        Code::InvalidQuery => {
            "a query parameter is unknown, given twice, or out of its bounds; the message names it"
        }
        Code::InProgress => {
            "another request with this key is still deciding: at once under the `reject` policy, or once a `wait` ran out"
        }
        Code::IdempotencyKeyMismatch => {
            "the key was used for a different request (tenant, pool, workflow, requested version or input)"
        }
        Code::IdempotencyMismatch => {
            "the run has recorded this `signal_id` with another name or payload"
        }
        Code::UnknownWorkflow => "no such workflow, or no such version of it, is defined",
        Code::NotFound => "no such run, or another tenant's",
        Code::RunPurged => "the run finished and retention deleted it (`runs.retention_ms`)",
        Code::SigningKeyMissing => {
            "every input must be signed (`signatures.all_inputs`) and the tenant has no key, so the ingress would refuse it"
        }
        Code::Unavailable => {
            "the database, or for a signal or a cancel the broker, did not answer; retry (with the same idempotency key)"
        }
        Code::Contended => {
            "the idempotency key changed hands too often while this request decided; retry"
        }
        Code::LetterSettled => {
            "the dead letter was discarded (it is not replayed) or replayed (it is not discarded)"
        }
        Code::RunNotFailed => {
            "only a failed run is retried: this one is running, succeeded or cancelled, or failed by another transition than the `failed_seq` the request names"
        }
        Code::RunCompensated => {
            "the run failed `compensated`: what it did is undone, and there is no step to start again from; start a new run"
        }
        Code::NotReplayable => {
            "the dead letter's record does not hold what a replay sends: its value, key or headers were over `dead_letters.max_value_bytes`"
        }
        Code::Internal => "the server broke a promise of its own; the request may be retried",
    }
}

/// The answers of one status, gathered.
#[derive(Default)]
struct Reply {
    /// Media type, schema and description of each body.
    bodies: Vec<(&'static str, Value, &'static str)>,
    /// Each refusal's code and meaning.
    codes: Vec<(&'static str, &'static str)>,
    head_too_large: bool,
    retry_after: bool,
    challenge: bool,
    /// A console file's Content-Security-Policy.
    policy: bool,
}

impl Answer {
    fn status(&self) -> StatusCode {
        match self {
            Answer::Body { status, .. } | Answer::Class { status, .. } => *status,
            Answer::Refusal(code) => code.status(),
            Answer::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Answer::ConsoleFile { .. } => StatusCode::OK,
        }
    }
}

impl Reply {
    fn add(&mut self, answer: Answer) {
        match answer {
            Answer::Body {
                media,
                schema,
                description,
                ..
            } => {
                if !self.bodies.iter().any(|b| b.0 == media && b.1 == schema) {
                    self.bodies.push((media, schema, description));
                }
            }
            Answer::Refusal(code) => {
                self.retry_after |=
                    matches!(code, Code::RateLimited | Code::Overloaded | Code::Timeout);
                self.challenge |= code == Code::Unauthenticated;
                self.codes.push((code.as_str(), meaning(code)));
            }
            Answer::Class { class, meaning, .. } => self.codes.push((class, meaning)),
            Answer::HeadTooLarge => self.head_too_large = true,
            Answer::ConsoleFile { media, description } => {
                let text = json!({ "type": "string" });
                self.bodies.push((media, text, description));
                self.policy = true;
            }
        }
    }
}

/// The Responses Object of `answers`, by status.
fn responses(answers: Vec<Answer>) -> Value {
    let mut by_status: BTreeMap<u16, Reply> = BTreeMap::new();
    for answer in answers {
        let status = answer.status().as_u16();
        by_status.entry(status).or_default().add(answer);
    }
    let mut out = Map::new();
    for (status, mut reply) in by_status {
        let mut seen = Vec::new();
        reply.codes.retain(|(code, _)| {
            let new = !seen.contains(code);
            seen.push(*code);
            new
        });
        out.insert(status.to_string(), response(reply));
    }
    Value::Object(out)
}

/// One Response Object.
fn response(reply: Reply) -> Value {
    let mut lines: Vec<String> = reply.bodies.iter().map(|b| b.2.to_owned()).collect();
    if reply.head_too_large {
        lines.push(format!(
            "The request's head (request line and headers) is over {MAX_HEADER_BYTES} bytes: answered by the listener before any route, without a body."
        ));
    }
    // Codes of one meaning (the screen's classes, say) share a line.
    let mut groups: Vec<(Vec<&str>, &str)> = Vec::new();
    for (code, meaning) in &reply.codes {
        match groups.last_mut() {
            Some((codes, last)) if last == meaning => codes.push(code),
            _ => groups.push((vec![code], meaning)),
        }
    }
    lines.extend(groups.iter().map(|(codes, meaning)| {
        let codes: Vec<String> = codes.iter().map(|code| format!("`{code}`")).collect();
        format!("{}: {meaning}.", codes.join(", "))
    }));
    let mut content: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for (media, schema, _) in &reply.bodies {
        content.entry(media).or_default().push(schema.clone());
    }
    if !reply.codes.is_empty() {
        let codes: Vec<&str> = reply.codes.iter().map(|(code, _)| *code).collect();
        content.entry("application/json").or_default().push(json!({
            "allOf": [
                { "$ref": "#/components/schemas/Error" },
                { "properties": { "error": { "properties": { "code": { "enum": codes } } } } },
            ]
        }));
    }
    let content: Map<String, Value> = content
        .into_iter()
        .map(|(media, mut schemas)| {
            let schema = if schemas.len() == 1 {
                schemas.remove(0)
            } else {
                json!({ "anyOf": schemas })
            };
            (media.to_owned(), json!({ "schema": schema }))
        })
        .collect();
    let mut out = json!({ "description": lines.join("\n\n") });
    if !content.is_empty() {
        out["content"] = Value::Object(content);
    }
    let headers = headers_of(&reply);
    if !headers.is_empty() {
        out["headers"] = Value::Object(headers);
    }
    out
}

/// The headers a response promises.
fn headers_of(reply: &Reply) -> Map<String, Value> {
    let mut headers = Map::new();
    if reply.challenge {
        headers.insert(
            "WWW-Authenticate".into(),
            json!({
                "description": "`Bearer`, with `unauthenticated`.",
                "schema": { "const": "Bearer" },
            }),
        );
    }
    if reply.retry_after {
        headers.insert("Retry-After".into(), json!({
            "description": "The seconds to wait before a retry, with `rate_limited`, `overloaded` and `timeout`.",
            "schema": { "type": "integer", "minimum": 1 },
        }));
    }
    if reply.policy {
        headers.insert(
            "Content-Security-Policy".into(),
            json!({
                "description": "Only this listener's own script, style and API: no inline script or style, no other origin, no frame.",
                "schema": { "const": super::console::CONTENT_SECURITY_POLICY },
            }),
        );
    }
    headers
}

/// The path and header parameters of `endpoint`.
fn parameters(endpoint: Endpoint) -> Vec<Value> {
    let run_id = json!({
        "name": "run_id",
        "in": "path",
        "required": true,
        "description": "The run's id, as its decision gave it.",
        "schema": { "type": "string" },
    });
    let tenant = json!({
        "name": "X-Ductor-Tenant",
        "in": "header",
        "required": false,
        "description": "The tenant the request acts as: it must be the key's (403 `tenant_mismatch` otherwise); required with `server.auth = \"disabled\"`.",
        "schema": { "$ref": "#/components/schemas/Id" },
    });
    match endpoint {
        Endpoint::CreateRun => vec![json!({
            "name": "Idempotency-Key",
            "in": "header",
            "required": false,
            "description": "Requests with the same key (per tenant and pool) get the same decision; absent or empty, every request is a new run. Visible ASCII.",
            "schema": { "type": "string", "maxLength": MAX_KEY_LEN },
        })],
        Endpoint::GetRun | Endpoint::SignalRun | Endpoint::CancelRun | Endpoint::RetryRun => {
            vec![run_id, tenant]
        }
        Endpoint::RunHistory => vec![run_id],
        Endpoint::GetLetter | Endpoint::ReplayLetter | Endpoint::DiscardLetter => {
            vec![json!({
                "name": "letter_id",
                "in": "path",
                "required": true,
                "description": "The letter's id, as its listing gives it.",
                "schema": { "type": "integer", "minimum": 1 },
            })]
        }
        Endpoint::ListLetters | Endpoint::CountLetters => letter_parameters(endpoint),
        Endpoint::ListRuns => {
            let mut all = search_parameters();
            all.push(query_parameter(
                "limit",
                "Runs in the page, 1 to `server.max_page_runs` (50 when absent).",
                json!({ "type": "integer", "minimum": 1 }),
            ));
            all.push(query_parameter(
                "after",
                "The `next` of the previous page.",
                json!({ "type": "string" }),
            ));
            all
        }
        Endpoint::CountRuns => search_parameters(),
        _ => Vec::new(),
    }
}

/// The filters of a listing of dead letters (and its page).
fn letter_parameters(endpoint: Endpoint) -> Vec<Value> {
    let text = json!({ "type": "string", "minLength": 1 });
    let time = json!({ "$ref": "#/components/schemas/Timestamp" });
    let statuses = crate::ingress::dead_letters::LetterStatus::ALL.map(|s| s.as_str());
    let mut all = vec![
        query_parameter(
            "tenant",
            "Letters of this tenant: for a key without `admin` it must be the key's (403 `tenant_mismatch`).",
            text.clone(),
        ),
        query_parameter(
            "class",
            "Letters of this class (`malformed`, `unknown_run`, ...).",
            text.clone(),
        ),
        query_parameter(
            "stage",
            "Letters refused at this stage (`decode`, `validate`, `route`, `apply`).",
            text.clone(),
        ),
        query_parameter("source_topic", "Letters read from this topic.", text),
        query_parameter(
            "status",
            "Letters in this status.",
            json!({ "type": "string", "enum": statuses }),
        ),
        query_parameter(
            "since",
            "Dead-lettered at or after this time.",
            time.clone(),
        ),
        query_parameter("until", "Dead-lettered before this time.", time),
    ];
    if endpoint == Endpoint::ListLetters {
        all.push(query_parameter(
            "limit",
            "Letters in the page, up to `dead_letters.max_page_rows`.",
            json!({ "type": "integer", "minimum": 1 }),
        ));
        all.push(query_parameter(
            "after",
            "The `next` of the previous page.",
            json!({ "type": "integer", "minimum": 0 }),
        ));
    }
    all
}

fn query_parameter(name: &str, description: &str, schema: Value) -> Value {
    json!({ "name": name, "in": "query", "required": false, "description": description, "schema": schema })
}

/// The filters of a search of runs; an unknown parameter is refused (400
/// `invalid_query`).
fn search_parameters() -> Vec<Value> {
    let text = json!({ "type": "string", "minLength": 1 });
    let time = json!({ "$ref": "#/components/schemas/Timestamp" });
    let statuses = crate::coordinator::state::RunStatus::ALL.map(|s| s.as_str());
    vec![
        query_parameter(
            "tenant",
            "Runs of this tenant: for a key with `runs:read` it must be the key's (403 `tenant_mismatch`); a key with `admin` sees every tenant without it.",
            text.clone(),
        ),
        query_parameter("workflow", "Runs of this workflow.", text.clone()),
        query_parameter(
            "version",
            "Runs of this version of `workflow` (which it needs).",
            json!({ "type": "integer", "minimum": 1 }),
        ),
        query_parameter(
            "status",
            "Runs in this status.",
            json!({ "type": "string", "enum": statuses }),
        ),
        query_parameter(
            "step",
            "Runs whose current step has this index (0-based).",
            json!({ "type": "integer", "minimum": 0 }),
        ),
        query_parameter(
            "correlation_id",
            "Runs started with this correlation id.",
            text,
        ),
        query_parameter(
            "created_after",
            "Runs created at or after this time.",
            time.clone(),
        ),
        query_parameter("created_before", "Runs created before this time.", time),
    ]
}

/// The request body of the dead letters' routes that take one.
fn letters_body(endpoint: Endpoint, schemas: &mut Schemas) -> Option<Value> {
    use super::operator::letters::{DiscardRequest, ReplayRequest};
    let (schema, required, description) = match endpoint {
        Endpoint::ReplayLetters => (
            schemas.of::<ReplayRequest>(),
            true,
            "Which letters: an admin's `tenant`, the `filter` and the `page` (`cursor`: the `next` of the page before; `limit`). Required, so that a set is always named: `{}` is every letter of the caller's scope still to be replayed, one page.",
        ),
        Endpoint::DiscardLetter => (
            schemas.of::<DiscardRequest>(),
            true,
            "Why the letter is discarded.",
        ),
        _ => return None,
    };
    Some(json!({
        "description": description,
        "required": required,
        "content": { "application/json": { "schema": schema } },
    }))
}

/// The request body of `endpoint`: a contract message less the fields the
/// server sets, which are refused (400 `invalid_request`).
fn request_body(endpoint: Endpoint, schemas: &mut Schemas) -> Option<Value> {
    if let Some(body) = letters_body(endpoint, schemas) {
        return Some(body);
    }
    if endpoint == Endpoint::RedriveOutbox {
        let schema = schemas.of::<super::operator::outbox::RedriveRequest>();
        return Some(json!({
            "description": "Optional (an empty body redrives every parked intent): only the run's, or only those bound for the topic.",
            "required": false,
            "content": { "application/json": { "schema": schema } },
        }));
    }
    let (message, title, server_set, optional, required): (_, _, &[&str], &[&str], _) =
        match endpoint {
            Endpoint::CreateRun => (
                "run.start",
                "StartRun",
                &super::start::SERVER_SET,
                &[],
                true,
            ),
            Endpoint::SignalRun => (
                "wakeup.signal",
                "Signal",
                &super::runs::SERVER_SET,
                &["signal_id"],
                true,
            ),
            Endpoint::CancelRun => (
                "wakeup.cancel",
                "Cancel",
                &super::runs::SERVER_SET,
                &["action_id"],
                false,
            ),
            Endpoint::RetryRun => (
                "wakeup.retry",
                "Retry",
                &super::runs::SERVER_SET,
                &["action_id", "failed_seq"],
                false,
            ),
            _ => return None,
        };
    let schema = schemas.cut(message, title, server_set, optional);
    let mut body = json!({
        "description": format!(
            "The fields of `{message}` (`schemas/messages/{message}.json`) the caller gives; `tenant`, if given, must be the key's."
        ),
        "required": required,
        "content": { "application/json": { "schema": schema } },
    });
    if !required {
        body["description"] = format!(
            "Optional (an empty body is `{{}}`): the fields of `{message}` (`schemas/messages/{message}.json`) the caller gives; `tenant`, if given, must be the key's."
        )
        .into();
    }
    Some(body)
}

/// The document's schemas: the answers' types, generated, and the request
/// bodies, cut from the contract's schemas; one set of definitions for
/// both, under `#/components/schemas`.
struct Schemas {
    generator: SchemaGenerator,
    /// The request bodies and the definitions their messages use.
    cut: Map<String, Value>,
}

const COMPONENTS: &str = "#/components/schemas/";

impl Schemas {
    fn new() -> Self {
        let settings = SchemaSettings::draft2020_12()
            .with(|s| s.definitions_path = "/components/schemas".into());
        Schemas {
            generator: settings.into_generator(),
            cut: Map::new(),
        }
    }

    /// A reference to `T`'s schema.
    fn of<T: JsonSchema>(&mut self) -> Value {
        self.generator.subschema_for::<T>().to_value()
    }

    /// The schema of `message` as an HTTP body, named `title`: without the
    /// fields in `server_set` (each refused), with `tenant` and those in
    /// `optional` no longer required. A reference to it.
    fn cut(&mut self, message: &str, title: &str, server_set: &[&str], optional: &[&str]) -> Value {
        let path = crate::contract::schema::message_path(message);
        let Some(file) = crate::contract::schema::catalogue()
            .into_iter()
            .find(|f| f.path == path)
        else {
            panic!("the contract has no schema {path}");
        };
        let Value::Object(mut schema) = file.schema else {
            panic!("{path} is not an object");
        };
        schema.remove("$schema");
        // A rule between two fields the server sets (a start's `run_id`
        // and `idempotency_key`) says nothing about a body that has neither.
        if server_set.contains(&"run_id") {
            schema.remove("if");
            schema.remove("then");
        }
        let defs = match schema.remove("$defs") {
            Some(Value::Object(defs)) => defs,
            _ => Map::new(),
        };
        if let Some(Value::Object(properties)) = schema.get_mut("properties") {
            for field in server_set {
                properties.insert((*field).to_owned(), Value::Bool(false));
            }
            if let Some(Value::Object(tenant)) = properties.get_mut("tenant") {
                tenant.insert("description".into(), TENANT.into());
            }
        }
        if let Some(Value::Array(required)) = schema.get_mut("required") {
            required.retain(|name| {
                let name = name.as_str().unwrap_or_default();
                name != "tenant" && !server_set.contains(&name) && !optional.contains(&name)
            });
        }
        schema.insert("title".into(), title.into());
        let description = format!(
            "The fields of `{message}` (`schemas/messages/{message}.json`) that a caller gives; those the server sets are refused (400 `invalid_request`)."
        );
        schema.insert("description".into(), description.into());
        let mut schema = Value::Object(schema);
        // The definitions the body still uses, and those they use.
        let mut wanted = Vec::new();
        refs_into(&schema, &mut wanted);
        while let Some(name) = wanted.pop() {
            if self.cut.contains_key(&name) {
                continue;
            }
            if let Some(def) = defs.get(&name) {
                refs_into(def, &mut wanted);
                self.cut.insert(name, def.clone());
            }
        }
        rebase(&mut schema);
        self.cut.insert(title.to_owned(), schema);
        json!({ "$ref": format!("{COMPONENTS}{title}") })
    }

    /// Every definition, the generated and the cut; one name is one schema.
    fn finish(mut self) -> Value {
        let mut all = self.generator.take_definitions(true);
        for (name, mut schema) in std::mem::take(&mut self.cut) {
            rebase(&mut schema);
            match all.get(&name) {
                Some(generated) if *generated != schema => {
                    panic!("two schemas named {name}: {generated} and {schema}")
                }
                _ => {
                    all.insert(name, schema);
                }
            }
        }
        all.sort_keys();
        Value::Object(all)
    }
}

/// What a body's `tenant` means over HTTP.
const TENANT: &str = "Optional: the key's tenant (403 `tenant_mismatch` for another). With `server.auth = \"disabled\"`, the tenant the request acts as.";

/// The names of the contract definitions (`#/$defs/X`) that `schema`
/// refers to.
fn refs_into(schema: &Value, names: &mut Vec<String>) {
    match schema {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("$ref", Value::String(target)) => {
                        if let Some(name) = target.strip_prefix("#/$defs/") {
                            names.push(name.to_owned());
                        }
                    }
                    (_, value) => refs_into(value, names),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| refs_into(v, names)),
        _ => {}
    }
}

/// Points a contract schema's references (`#/$defs/X`) at the document's
/// definitions.
fn rebase(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                match (key.as_str(), value) {
                    ("$ref", Value::String(target)) => {
                        if let Some(name) = target.strip_prefix("#/$defs/") {
                            *target = format!("{COMPONENTS}{name}");
                        }
                    }
                    (_, value) => rebase(value),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(rebase),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_is_made_and_names_every_route() {
        let document = document();
        for route in &ROUTES {
            let operation = &document["paths"][route.path][route.verb.as_str()];
            assert!(operation.is_object(), "{route:?}");
            let servers = operation["servers"].as_array().unwrap();
            assert!(
                servers
                    .iter()
                    .any(|s| s["x-ductor-listener"] == route.listener.as_str()),
                "{route:?}"
            );
        }
        assert_eq!(text(), text(), "deterministic");
    }

    #[test]
    fn every_reference_has_its_definition() {
        let document = document();
        let mut refs = Vec::new();
        collect_refs(&document, &mut refs);
        assert!(!refs.is_empty());
        for target in refs {
            let name = target
                .strip_prefix(COMPONENTS)
                .unwrap_or_else(|| panic!("{target}"));
            assert!(
                document["components"]["schemas"][name].is_object(),
                "{target} has no definition"
            );
        }
    }

    fn collect_refs(value: &Value, refs: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("$ref", Value::String(target)) => refs.push(target.clone()),
                        (_, value) => collect_refs(value, refs),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| collect_refs(v, refs)),
            _ => {}
        }
    }

    #[test]
    fn every_code_is_documented_with_its_status() {
        let text = text();
        for code in Code::ALL {
            assert!(text.contains(&format!("\"{}\"", code.as_str())), "{code:?}");
        }
    }
}
