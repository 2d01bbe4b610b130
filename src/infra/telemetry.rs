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
//! off no layer wants them, so they cost a disabled callsite.

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

fn describe() {
    use metrics::{describe_counter, describe_histogram};
    describe_counter!(
        "ductor_inputs_total",
        "Inputs seen by the coordinator, by topic and outcome (applied, deduplicated, stale, rejected, dead_lettered)"
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
