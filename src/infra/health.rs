//! The operational HTTP surface, on two listeners.
//!
//! The admin listener (`server.admin_listen`, loopback by default) serves
//! [`admin_router`]: `/healthz` (the process runs), the detailed `/readyz`
//! (Postgres and Kafka answer, and no apply lane is stalled, each check
//! with its error) and `/metrics` (Prometheus text); the operator's
//! endpoints join it. The public listener (`server.listen`) serves
//! [`public_router`] beside the routing API: `/healthz` and a `/readyz`
//! that says ready or not and nothing more, since an error text names
//! hosts, ports, users and lanes, which is for the operator and not for
//! every client that can reach the API.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde::Serialize;
use sqlx::PgPool;

#[derive(Clone)]
pub struct HttpState {
    pub pool: PgPool,
    /// A long-lived client used only for metadata requests.
    pub kafka_probe: Arc<BaseConsumer>,
    pub readiness_timeout: Duration,
    /// The ingress's lanes, when this process runs one.
    pub ingress: Option<Arc<dyn LaneWatch>>,
}

/// What readiness asks of a stage that works in lanes: which of them hold a
/// batch for too long now. The ingress answers it; health only reports.
pub trait LaneWatch: Send + Sync {
    /// The lanes stalled now, with how long each has held its batch.
    fn stalled(&self) -> Vec<(usize, Duration)>;
}

/// The public listener's health routes, merged with the routing API's:
/// liveness, and readiness as ready or not.
pub fn public_router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(public_readyz))
        .with_state(state)
}

/// The admin listener's routes: liveness, readiness with each check's
/// result, and the metrics. Operator endpoints are merged into it, under
/// `/admin/`.
pub fn admin_router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(admin_readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz() -> impl IntoResponse {
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({"status": "ok"})),
    )
}

/// Every readiness check's result: the admin `/readyz` body.
#[derive(Debug, Serialize)]
pub struct Readiness {
    status: &'static str,
    postgres: Check,
    kafka: Check,
    ingress: Check,
}

#[derive(Debug, Serialize)]
struct Check {
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl Check {
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
            status: if ready { "ready" } else { "not_ready" },
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
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct PublicReadiness {
    status: &'static str,
}

/// What the public listener tells of `readiness`: ready or not, with no
/// check named and no error text.
pub fn public_readiness(readiness: &Readiness) -> (StatusCode, PublicReadiness) {
    let status = if readiness.is_ready() {
        "ready"
    } else {
        "not_ready"
    };
    (readiness.status_code(), PublicReadiness { status })
}

async fn public_readyz(State(state): State<HttpState>) -> Response {
    let (code, body) = public_readiness(&check_readiness(&state).await);
    (code, axum::Json(body)).into_response()
}

async fn admin_readyz(State(state): State<HttpState>) -> Response {
    let readiness = check_readiness(&state).await;
    (readiness.status_code(), axum::Json(readiness)).into_response()
}

/// Runs every readiness check: Postgres and Kafka at once, each within
/// `readiness_timeout`, and the ingress's lanes.
pub async fn check_readiness(state: &HttpState) -> Readiness {
    let (pg, kafka) = tokio::join!(probe_postgres(state), probe_kafka(state));
    Readiness::new(
        Check::from_result(pg),
        Check::from_result(kafka),
        Check::from_result(check_lanes(state)),
    )
}

async fn probe_postgres(state: &HttpState) -> anyhow::Result<()> {
    let timeout = state.readiness_timeout;
    tokio::time::timeout(timeout, sqlx::query("SELECT 1").execute(&state.pool))
        .await
        .map_err(|_| anyhow::anyhow!("postgres did not answer within {timeout:?}"))?
        .map_err(|e| anyhow::anyhow!("postgres: {e}"))?;
    Ok(())
}

async fn probe_kafka(state: &HttpState) -> anyhow::Result<()> {
    let (probe, timeout) = (state.kafka_probe.clone(), state.readiness_timeout);
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

fn check_lanes(state: &HttpState) -> anyhow::Result<()> {
    match state.ingress.as_deref().map(LaneWatch::stalled) {
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
                    status: "not_ready"
                }
            );
        }
    }
}
