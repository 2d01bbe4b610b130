//! The operational HTTP surface, on two listeners, and the readiness
//! verdict they tell.
//!
//! In: the checks of [`Probes`] (Postgres on a connection of its own,
//! Kafka's metadata, the ingress's lanes and whether it consumes yet), run
//! by one background task ([`watch_readiness`]) every
//! `server.readiness_interval_ms`. Out: the latest [`Readiness`], which
//! every `/readyz` request reads. Guarantees: a request to `/readyz` costs
//! no query, no broker request and no thread, whoever sends it and however
//! often, so a flood of it cannot take what the ingress and the drainer
//! need; readiness never uses the process's pool.
//!
//! The admin listener (`server.admin_listen`, loopback by default) serves
//! [`admin_router`]: `/healthz` (the process runs), the detailed `/readyz`
//! (each check with its error, and the warnings of the configuration) and
//! `/metrics` (Prometheus text); the operator's endpoints and the web
//! console join it from [`crate::api::admin_router`], and take a key with
//! the `admin` scope whatever `server.admin_auth` says. The
//! public listener (`server.listen`) serves [`public_router`] beside the
//! routing API: `/healthz` and a `/readyz` that says ready or not and
//! nothing more, since an error text names hosts, ports, users and lanes,
//! which is for the operator and not for every client that can reach the
//! API.
//!
//! Each router registers its routes through [`crate::api::routes`], the one
//! table of both listeners' routes that the API's description is made
//! from; refusals have the API's error shape ([`crate::api::error`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use rdkafka::consumer::{BaseConsumer, Consumer};
use schemars::JsonSchema;
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::api::error::{Code, ErrorBody, ErrorDetail};
use crate::api::routes::{Endpoint, add};
use crate::auth::{AuthError, Authenticator, Scope};

/// What the health endpoints read: the latest verdict, and the warnings
/// of the configuration the admin `/readyz` repeats.
#[derive(Clone)]
pub struct HttpState {
    pub verdict: Verdict,
    /// What the configuration leaves open (see
    /// `Config::security_warnings`), told on the admin `/readyz`.
    pub warnings: Arc<[String]>,
}

/// What the readiness task checks.
pub struct Probes {
    /// Readiness's own pool of one connection, apart from the process's,
    /// so that checking never waits behind (or takes from) the ingress.
    pub pool: PgPool,
    /// A long-lived client used only for metadata requests.
    pub kafka_probe: Arc<BaseConsumer>,
    /// Bound on each dependency check.
    pub timeout: Duration,
    /// The ingress's lanes, when this process runs one.
    pub ingress: Option<Arc<dyn LaneWatch>>,
    /// Why the ingress does not consume yet, while it waits.
    pub ingress_hold: Hold,
}

/// What readiness asks of a stage that works in lanes: which of them hold a
/// batch for too long now. The ingress answers it; health only reports.
pub trait LaneWatch: Send + Sync {
    /// The lanes stalled now, with how long each has held its batch.
    fn stalled(&self) -> Vec<(usize, Duration)>;
}

/// Why a stage holds back while it waits for a precondition (the ingress,
/// for the co-partition check of its topics); nothing once it runs.
#[derive(Clone, Default)]
pub struct Hold(Arc<Mutex<Option<String>>>);

impl Hold {
    /// A stage that holds back for `why` until [`Hold::release`].
    pub fn holding(why: impl Into<String>) -> Hold {
        Hold(Arc::new(Mutex::new(Some(why.into()))))
    }

    /// Holds back for `why` from now on.
    pub fn hold(&self, why: impl Into<String>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.into());
    }

    /// The stage runs from now on.
    pub fn release(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Why the stage holds back, if it does.
    pub fn reason(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The latest readiness verdict: written by one task, read by every
/// request.
#[derive(Clone)]
pub struct Verdict(Arc<tokio::sync::watch::Sender<Arc<Readiness>>>);

impl Default for Verdict {
    fn default() -> Self {
        Self::new()
    }
}

impl Verdict {
    /// Not ready, until a first check is published.
    pub fn new() -> Self {
        let unchecked = || Check::failed("not checked yet");
        let first = Readiness::new(unchecked(), unchecked(), unchecked());
        Verdict(Arc::new(tokio::sync::watch::Sender::new(Arc::new(first))))
    }

    /// The verdict readers get from now on.
    pub fn publish(&self, readiness: Readiness) {
        self.0.send_replace(Arc::new(readiness));
    }

    /// The latest verdict.
    pub fn latest(&self) -> Arc<Readiness> {
        self.0.borrow().clone()
    }

    /// Returns once a published verdict is ready: what a supervisor or a
    /// harness that started serve in its own process waits on, instead of
    /// asking `/readyz` over and over.
    pub async fn until_ready(&self) {
        let mut verdicts = self.0.subscribe();
        // The sender lives as long as `self`, so the wait cannot fail.
        let _ = verdicts.wait_for(|readiness| readiness.is_ready()).await;
    }
}

/// Checks readiness every `interval` until `shutdown`, publishing each
/// verdict. Each check is bounded by `probes.timeout`, so one round takes
/// at most that long whatever answers.
pub async fn watch_readiness(
    probes: Probes,
    verdict: Verdict,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {
                let readiness = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    readiness = check_readiness(&probes) => readiness,
                };
                metrics::gauge!("ductor_ready").set(if readiness.is_ready() { 1.0 } else { 0.0 });
                verdict.publish(readiness);
            }
        }
    }
    probes.pool.close().await;
}

/// The public listener's health routes, merged with the routing API's:
/// liveness, and readiness as ready or not.
pub fn public_router(state: HttpState) -> Router {
    let router = add(Router::new(), Endpoint::Healthz, healthz);
    add(router, Endpoint::PublicReadyz, public_readyz).with_state(state)
}

/// The admin listener's routes: liveness, readiness with each check's
/// result, and the metrics. With `admin_keys` (`server.admin_auth =
/// "key"`), every route but `/healthz` takes an API key with the `admin`
/// scope. The operator's endpoints are not among them: they check their
/// key themselves, under every `server.admin_auth`
/// ([`crate::api::admin_router`]).
pub fn admin_router(state: HttpState, admin_keys: Option<Authenticator>) -> Router {
    let guarded = add(Router::new(), Endpoint::AdminReadyz, admin_readyz);
    let guarded = add(guarded, Endpoint::Metrics, metrics);
    let guarded = match admin_keys {
        Some(keys) => guarded.route_layer(axum::middleware::from_fn_with_state(keys, admin_key)),
        None => guarded,
    };
    add(Router::new(), Endpoint::AdminHealthz, healthz)
        .merge(guarded)
        .with_state(state)
}

/// The admin listener's middleware under `server.admin_auth = "key"`: a
/// request goes on only with a valid key of the `admin` scope; 401, 403 or
/// 503 otherwise, in the API's error shape.
async fn admin_key(
    State(keys): State<Authenticator>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let refused = |code: Code, message: &str| {
        let error = ErrorDetail {
            code: code.as_str(),
            message,
        };
        ErrorBody { error }.response(code.status())
    };
    match keys.authenticate(authorization, Scope::Admin).await {
        Ok(_) => next.run(request).await,
        Err(AuthError::Unauthenticated(_)) => {
            let mut response = refused(
                Code::Unauthenticated,
                "the admin listener takes an API key with the admin scope (Authorization: Bearer <key>)",
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
            response
        }
        Err(AuthError::MissingScope(_)) => {
            refused(Code::InsufficientScope, "this key lacks the admin scope")
        }
        Err(AuthError::Unavailable(e)) => {
            tracing::warn!(error = %e, "admin keys could not be read");
            refused(
                Code::Unavailable,
                "the keys could not be read; retry shortly",
            )
        }
    }
}

/// The `/healthz` body.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Liveness {
    status: Alive,
}

/// The process runs.
#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Alive {
    Ok,
}

async fn healthz() -> impl IntoResponse {
    (StatusCode::OK, axum::Json(Liveness { status: Alive::Ok }))
}

/// The readiness verdict's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReadyStatus {
    /// Every check passed (200).
    Ready,
    /// A check failed (503).
    NotReady,
}

/// Every readiness check's result: the admin `/readyz` body.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Readiness {
    status: ReadyStatus,
    /// Postgres answered a query on readiness's own connection.
    postgres: Check,
    /// Kafka answered a metadata request.
    kafka: Check,
    /// The ingress consumes, and no apply lane is stalled.
    ingress: Check,
}

/// One check's result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Check {
    ok: bool,
    /// Why it failed; absent when it passed.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl Check {
    fn failed(error: &str) -> Self {
        Check {
            ok: false,
            error: Some(error.to_owned()),
        }
    }

    fn from_result(result: anyhow::Result<()>) -> Self {
        match result {
            Ok(()) => Check {
                ok: true,
                error: None,
            },
            Err(e) => Check {
                ok: false,
                error: Some(format!("{e:#}")),
            },
        }
    }
}

impl Readiness {
    fn new(postgres: Check, kafka: Check, ingress: Check) -> Self {
        let ready = postgres.ok && kafka.ok && ingress.ok;
        Readiness {
            status: if ready {
                ReadyStatus::Ready
            } else {
                ReadyStatus::NotReady
            },
            postgres,
            kafka,
            ingress,
        }
    }

    /// Whether every check passed.
    pub fn is_ready(&self) -> bool {
        self.postgres.ok && self.kafka.ok && self.ingress.ok
    }

    fn status_code(&self) -> StatusCode {
        if self.is_ready() {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        }
    }
}

/// The public `/readyz` body: the verdict alone.
#[derive(Debug, PartialEq, Eq, Serialize, JsonSchema)]
pub struct PublicReadiness {
    status: ReadyStatus,
}

/// What the public listener tells of `readiness`: ready or not, with no
/// check named and no error text.
pub fn public_readiness(readiness: &Readiness) -> (StatusCode, PublicReadiness) {
    let status = readiness.status;
    (readiness.status_code(), PublicReadiness { status })
}

async fn public_readyz(State(state): State<HttpState>) -> Response {
    let (code, body) = public_readiness(&state.verdict.latest());
    (code, axum::Json(body)).into_response()
}

/// The admin `/readyz` body: every check, and what the configuration
/// leaves open.
#[derive(Serialize, JsonSchema)]
#[schemars(rename = "AdminReadiness")]
pub struct AdminReadiness<'a> {
    #[serde(flatten)]
    readiness: &'a Readiness,
    /// What the configuration leaves open (such as Kafka inputs that
    /// need no signature while the API requires keys); absent when
    /// nothing is.
    #[serde(default, skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

async fn admin_readyz(State(state): State<HttpState>) -> Response {
    let readiness = state.verdict.latest();
    let body = AdminReadiness {
        readiness: &readiness,
        warnings: &state.warnings,
    };
    (readiness.status_code(), axum::Json(body)).into_response()
}

/// Runs every readiness check: Postgres and Kafka at once, each within
/// `probes.timeout`, and the ingress's lanes.
pub async fn check_readiness(probes: &Probes) -> Readiness {
    metrics::counter!("ductor_readiness_checks_total").increment(1);
    let (pg, kafka) = tokio::join!(probe_postgres(probes), probe_kafka(probes));
    Readiness::new(
        Check::from_result(pg),
        Check::from_result(kafka),
        Check::from_result(check_ingress(probes)),
    )
}

async fn probe_postgres(probes: &Probes) -> anyhow::Result<()> {
    let timeout = probes.timeout;
    tokio::time::timeout(timeout, sqlx::query("SELECT 1").execute(&probes.pool))
        .await
        .map_err(|_| anyhow::anyhow!("postgres did not answer within {timeout:?}"))?
        .map_err(|e| anyhow::anyhow!("postgres: {e}"))?;
    Ok(())
}

async fn probe_kafka(probes: &Probes) -> anyhow::Result<()> {
    let (probe, timeout) = (probes.kafka_probe.clone(), probes.timeout);
    tokio::task::spawn_blocking(move || {
        let metadata = probe
            .fetch_metadata(None, timeout)
            .map_err(|e| anyhow::anyhow!("kafka metadata: {e}"))?;
        if metadata.brokers().is_empty() {
            anyhow::bail!("kafka metadata lists no brokers");
        }
        Ok(())
    })
    .await
    .map_err(|e| anyhow::anyhow!("kafka probe task: {e}"))?
}

fn check_ingress(probes: &Probes) -> anyhow::Result<()> {
    if let Some(why) = probes.ingress_hold.reason() {
        anyhow::bail!("the ingress does not consume yet: {why}");
    }
    match probes.ingress.as_deref().map(LaneWatch::stalled) {
        Some(stalled) if !stalled.is_empty() => {
            let lanes: Vec<String> = stalled
                .iter()
                .map(|(lane, age)| format!("lane {lane} for {} s", age.as_secs()))
                .collect();
            Err(anyhow::anyhow!(
                "apply lanes stalled, each holding a batch it has not committed: {}",
                lanes.join(", ")
            ))
        }
        _ => Ok(()),
    }
}

async fn metrics() -> Response {
    let body = crate::infra::telemetry::metrics_handle().render();
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(error: &str) -> Check {
        Check::from_result(Err(anyhow::anyhow!("{error}")))
    }

    fn passed() -> Check {
        Check::from_result(Ok(()))
    }

    #[test]
    fn the_public_verdict_of_a_failed_check_names_no_check_and_no_error() {
        let readiness = Readiness::new(
            failed("postgres: error connecting to server at 10.0.0.7:5432 as user ductor"),
            passed(),
            failed(
                "apply lanes stalled, each holding a batch it has not committed: lane 1 for 40 s",
            ),
        );
        let detailed = serde_json::to_value(&readiness).unwrap();
        assert_eq!(detailed["postgres"]["ok"], false);
        assert!(
            detailed["postgres"]["error"]
                .as_str()
                .unwrap()
                .contains("10.0.0.7")
        );
        let (code, body) = public_readiness(&readiness);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({"status": "not_ready"})
        );
        assert_eq!(detailed["status"], "not_ready");
    }

    #[test]
    fn the_public_verdict_of_passed_checks_is_ready() {
        let readiness = Readiness::new(passed(), passed(), passed());
        let (code, body) = public_readiness(&readiness);
        assert_eq!(code, StatusCode::OK);
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({"status": "ready"})
        );
    }

    #[test]
    fn each_failed_check_alone_makes_the_public_verdict_not_ready() {
        let cases = [
            Readiness::new(failed("pg"), passed(), passed()),
            Readiness::new(passed(), failed("kafka"), passed()),
            Readiness::new(passed(), passed(), failed("lanes")),
        ];
        for readiness in &cases {
            let (code, body) = public_readiness(readiness);
            assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{readiness:?}");
            assert_eq!(
                body,
                PublicReadiness {
                    status: ReadyStatus::NotReady
                }
            );
        }
    }
}
