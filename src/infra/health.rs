//! The operational HTTP surface: `/healthz` (the process runs), `/readyz`
//! (Postgres and Kafka answer, and no apply lane is stalled) and
//! `/metrics` (Prometheus text).

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

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz() -> impl IntoResponse {
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({"status": "ok"})),
    )
}

#[derive(Serialize)]
struct Readiness {
    status: &'static str,
    postgres: Check,
    kafka: Check,
    ingress: Check,
}

#[derive(Serialize)]
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

async fn readyz(State(state): State<HttpState>) -> Response {
    let timeout = state.readiness_timeout;
    let pg = async {
        tokio::time::timeout(timeout, sqlx::query("SELECT 1").execute(&state.pool))
            .await
            .map_err(|_| anyhow::anyhow!("postgres did not answer within {timeout:?}"))?
            .map_err(|e| anyhow::anyhow!("postgres: {e}"))?;
        Ok(())
    };
    let probe = state.kafka_probe.clone();
    let kafka = async move {
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
    };
    let (pg, kafka) = tokio::join!(pg, kafka);
    let ingress = match state.ingress.as_deref().map(LaneWatch::stalled) {
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
    };
    let body = Readiness {
        status: if pg.is_ok() && kafka.is_ok() && ingress.is_ok() {
            "ready"
        } else {
            "not_ready"
        },
        postgres: Check::from_result(pg),
        kafka: Check::from_result(kafka),
        ingress: Check::from_result(ingress),
    };
    let code = if body.postgres.ok && body.kafka.ok && body.ingress.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body)).into_response()
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
