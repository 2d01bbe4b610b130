//! Logging through `tracing` and metrics in the Prometheus text format.
//!
//! In: the `log` configuration (`log.filter`, `log.format`; `RUST_LOG`
//! wins) and what the stages record through `tracing` and `metrics`. Out:
//! log lines on stderr, and the Prometheus recorder whose handle renders
//! the metrics page. Guarantees: installing either twice keeps the first
//! and never fails; a filter that does not parse falls back to `info`.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Installs the global subscriber: readable text by default, one JSON object
/// per line when configured. `RUST_LOG` overrides the configured filter.
pub fn init_logging(config: &LogConfig) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| config.filter.clone());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second initialisation (tests, embedded use) keeps the first one.
    let _ = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
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
