//! Logging through `tracing`, the spans of a run's trace and their OTLP
//! exporter, and metrics in the Prometheus text format.
//!
//! In: the `log` configuration (`log.filter`, `log.format`; `RUST_LOG`
//! wins), the `telemetry` section, and what the stages record through
//! `tracing` and `metrics`. Out: log lines on stderr, spans of the
//! [`traces::TARGET`] target sent to the collector when
//! `telemetry.otlp_endpoint` is set, and the Prometheus recorder whose
//! handle renders the metrics page. Guarantees: installing either twice
//! keeps the first and never fails; a filter that does not parse falls
//! back to `info`; trace spans never reach the log, and with the exporter
//! off no layer wants them, so they cost a disabled callsite; once
//! [`register_series`] ran, every series the dashboard and the alert rules
//! under `deploy/` read is on the page, at zero until it is counted.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use super::traces;
use crate::config::{LogConfig, LogFormat, TelemetryConfig};

/// What [`init`] installed: the exporter's provider, to flush at the end.
#[must_use = "dropping it at once would end the exporter"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans still queued, within the export timeout. Blocks:
    /// call it off the runtime's threads (or after the runtime).
    pub fn flush(&self) {
        if let Some(provider) = &self.provider
            && let Err(e) = provider.force_flush()
        {
            tracing::warn!(error = %e, "exporting the last spans failed");
        }
    }

    /// Sends the spans still queued and stops the exporter. Blocks, as
    /// [`Telemetry::flush`].
    pub fn shutdown(mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "stopping the span exporter failed");
        }
    }
}

/// Installs the global subscriber: the log, readable text by default, one
/// JSON object per line when configured (`RUST_LOG` overrides the
/// configured filter); and with `telemetry.otlp_endpoint` set, the OTLP
/// exporter of the trace spans. An exporter that cannot be built is
/// reported, and the process goes on without it.
pub fn init(log: &LogConfig, telemetry: &TelemetryConfig) -> Telemetry {
    let provider = match super::otlp::provider(telemetry) {
        Ok(provider) => provider,
        Err(e) => {
            eprintln!("warning: the OTLP exporter is off: {e:#}");
            None
        }
    };
    let installed = install(log, provider.as_ref());
    if installed && let Some(url) = telemetry.traces_url() {
        tracing::info!(endpoint = %url, "exporting trace spans over OTLP");
    }
    Telemetry {
        provider: provider.filter(|_| installed),
    }
}

/// Installs the subscriber; `false` when one was installed before.
fn install(config: &LogConfig, provider: Option<&SdkTracerProvider>) -> bool {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| config.filter.clone());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info"));
    // Trace spans are for the exporter; in the log they would cost every
    // input a span's bookkeeping.
    // The hint keeps the log's filter as the process's level bound (that of
    // the `log` crate's records too): a filter without one would lift it
    // to TRACE.
    let not_traces = filter_fn(|meta| !meta.target().starts_with(traces::TARGET))
        .with_max_level_hint(LevelFilter::TRACE);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let log: Box<dyn Layer<Registry> + Send + Sync> = match config.format {
        LogFormat::Text => fmt.with_filter(filter.and(not_traces)).boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_filter(filter.and(not_traces))
            .boxed(),
    };
    let spans = provider.map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("ductor"))
            .with_tracked_inactivity(false)
            .with_filter(Targets::new().with_target(traces::TARGET, tracing::Level::INFO))
    });
    // A second initialisation (tests, embedded use) keeps the first one.
    tracing_subscriber::registry()
        .with(log)
        .with(spans)
        .try_init()
        .is_ok()
}

static METRICS: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process-wide Prometheus recorder, installed on first use.
pub fn metrics_handle() -> &'static PrometheusHandle {
    METRICS.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets(&[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ])
            .expect("static bucket list is not empty")
            .build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed when Ductor is embedded;
        // then our handle renders an empty page rather than failing.
        let _ = metrics::set_global_recorder(recorder);
        describe();
        handle
    })
}

/// Puts every series that the dashboard and the alert rules under
/// `deploy/` read on the metrics page before anything is counted, labelled
/// as the stages will label them: an absent series shows as "no data" and
/// hides a rule's verdict, and a counter that first appears at 1 is an
/// increase that `rate()` never sees. Gauges a disabled part of `serve`
/// would never set (the outbox's without a drainer, the lag without
/// statistics) stay off the page rather than read 0.
pub fn register_series(config: &crate::config::Config) {
    use metrics::{counter, gauge, histogram};
    for name in COUNTERS {
        counter!(name).increment(0);
    }
    for name in GAUGES {
        gauge!(name).increment(0.0);
    }
    // Registering a histogram is what puts its buckets on the page.
    for name in HISTOGRAMS {
        let _ = histogram!(name);
    }
    for phase in ["begin", "load", "fold", "write", "commit"] {
        let _ = histogram!("ductor_apply_phase_seconds", "phase" => phase);
    }
    let inputs = config.topic_names().inputs();
    for topic in &inputs {
        for outcome in [
            "applied",
            "deduplicated",
            "stale",
            "rejected",
            "dead_lettered",
            "forwarded",
        ] {
            counter!("ductor_inputs_total", "topic" => topic.clone(), "outcome" => outcome)
                .increment(0);
        }
        if config.kafka.statistics_interval_ms > 0 {
            gauge!(crate::ingress::CONSUMER_LAG, "topic" => topic.clone()).increment(0.0);
        }
    }
    for (stage, class) in dead_letter_classes() {
        counter!("ductor_dead_letters_total", "stage" => stage, "class" => class).increment(0);
    }
    for class in crate::apply::ApplyFailure::ISOLATED_CLASSES {
        counter!("ductor_apply_isolated_total", "class" => class).increment(0);
    }
    let refusals = crate::auth::key::Refusal::ALL.map(|r| r.as_str());
    for reason in refusals.into_iter().chain(["missing_scope"]) {
        counter!("ductor_api_auth_failures_total", "reason" => reason).increment(0);
    }
    for reason in crate::api::error::REFUSED_REASONS {
        counter!("ductor_api_refused_total", "reason" => reason).increment(0);
    }
    for outcome in crate::routing::OUTCOMES {
        counter!("ductor_routing_requests_total", "outcome" => outcome).increment(0);
    }
    for path in crate::routing::MismatchPath::ALL {
        counter!("ductor_routing_idempotency_mismatches_total", "path" => path.as_str())
            .increment(0);
    }
    for listener in ["public", "admin"] {
        counter!("ductor_http_connections_refused_total", "listener" => listener).increment(0);
        gauge!("ductor_http_open_connections", "listener" => listener).increment(0.0);
    }
    for lane in 0..config.coordinator.apply_lanes.max(1) {
        gauge!("ductor_ingress_parked_starts", "lane" => lane.to_string()).increment(0.0);
    }
    if config.drainer.enabled {
        for name in DRAINER_GAUGES {
            gauge!(name).increment(0.0);
        }
        for cause in crate::outbox::PublishFailureCause::ALL {
            counter!("ductor_outbox_publish_failures_total", "cause" => cause.as_str())
                .increment(0);
        }
    }
}

/// Counters without labels that the dashboard or the alerts read.
const COUNTERS: [&str; 9] = [
    "ductor_apply_conflicts_total",
    "ductor_apply_retries_total",
    "ductor_apply_suspect_bisections_total",
    "ductor_apply_held_starts_total",
    "ductor_outbox_parked_total",
    "ductor_outbox_completed_total",
    "ductor_outbox_redrives_total",
    "ductor_outbox_fast_lane_total",
    "ductor_readiness_checks_total",
];

/// Gauges without labels that every `serve` sets.
const GAUGES: [&str; 5] = [
    "ductor_ready",
    "ductor_ingress_stalled_lanes",
    "ductor_ingress_oldest_batch_age_seconds",
    "ductor_process_peak_rss_bytes",
    "ductor_run_cache_bytes",
];

/// Gauges that only a `serve` with a drainer sets.
const DRAINER_GAUGES: [&str; 5] = [
    "ductor_outbox_backlog",
    "ductor_outbox_due",
    "ductor_outbox_parked",
    "ductor_outbox_oldest_due_age_seconds",
    "ductor_results_frontier_lag_seconds",
];

/// Histograms without labels.
const HISTOGRAMS: [&str; 6] = [
    "ductor_apply_seconds",
    "ductor_apply_batch_size",
    "ductor_outbox_publish_seconds",
    "ductor_outbox_dispatch_lag_seconds",
    "ductor_ingress_fetch_age_seconds",
    "ductor_ingress_apply_age_seconds",
];

/// Every `(stage, class)` a dead letter can have: the decoder's classes,
/// the coordinator's rejections (a routed start of an unknown workflow
/// among them, and an input forwarded to its partition too often), a key
/// reused for another request, and the apply path's failures.
pub fn dead_letter_classes() -> Vec<(&'static str, &'static str)> {
    use crate::contract::InputErrorClass;
    use crate::contract::headers::DeadLetterStage;
    let decode = InputErrorClass::all().map(|c| match c {
        InputErrorClass::Misrouted => (DeadLetterStage::Validate, c.as_str()),
        _ => (DeadLetterStage::Decode, c.as_str()),
    });
    let validate = crate::coordinator::fold::RejectionClass::ALL
        .into_iter()
        .map(|c| (DeadLetterStage::Validate, c.as_str()));
    let route = [(DeadLetterStage::Route, "idempotency_mismatch")];
    let apply = crate::apply::ApplyFailure::ISOLATED_CLASSES.map(|c| (DeadLetterStage::Apply, c));
    decode
        .chain(validate)
        .chain(route)
        .chain(apply)
        .map(|(stage, class)| (stage.as_str(), class))
        .collect()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "ductor_inputs_total",
        "Inputs seen by the coordinator, by topic and outcome (applied, deduplicated, stale, rejected, dead_lettered, forwarded)"
    );
    describe_counter!(
        "ductor_apply_conflicts_total",
        "Batches recomputed after losing an optimistic-lock race on record_version"
    );
    describe_histogram!(
        "ductor_apply_batch_size",
        "Inputs applied per Postgres transaction"
    );
    describe_histogram!(
        "ductor_apply_seconds",
        "Time to load, fold and commit one batch"
    );
    describe_counter!(
        "ductor_dead_letters_total",
        "Inputs sent to the dead-letter topic, by stage and error class"
    );
    describe_gauge!(
        crate::ingress::CONSUMER_LAG,
        "Messages of an input topic the ingress's group has not committed, on the partitions this process consumes"
    );
    describe_gauge!(
        "ductor_ready",
        "1 while the last readiness check passed (Postgres, Kafka, the ingress's lanes), else 0"
    );
}

/// The process's peak resident set size in bytes (`VmHWM` of
/// `/proc/self/status`), where the system tells it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_peak_rss(&status)
}

/// `VmHWM` of a `/proc/<pid>/status` text, in bytes.
pub fn parse_peak_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Sets `ductor_process_peak_rss_bytes`; `serve` calls it every second.
pub fn observe_process() {
    if let Some(bytes) = peak_rss_bytes() {
        metrics::gauge!("ductor_process_peak_rss_bytes").set(bytes as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_rss_is_read_from_the_status_text() {
        let status = "Name:\tductor\nVmPeak:\t  100 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1024 kB\n";
        assert_eq!(parse_peak_rss(status), Some(2048 * 1024));
        assert_eq!(parse_peak_rss("Name:\tductor\n"), None);
        assert!(peak_rss_bytes().is_none_or(|b| b > 0));
    }
}
