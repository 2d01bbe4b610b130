//! The `[telemetry]` section: the OTLP exporter of a run's trace spans.
//!
//! In: a collector's address and the exporter's bounds. Out: a
//! [`TelemetryConfig`] the exporter is built from (the section may be left
//! out: the exporter is off). Guarantees: the exporter is off unless
//! `otlp_endpoint` is set; an endpoint that is not a plain `http://` URL
//! with a host is refused, naming the key; every bound is at least 1, and
//! a batch fits the queue. Trace contexts travel on every hop whether the
//! exporter is on or not.

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The base URL of an OpenTelemetry collector that takes OTLP over
    /// HTTP with protobuf bodies, e.g. `http://127.0.0.1:4318`: the spans
    /// of the `ductor::traces` target (ingress batch, apply, fold, publish,
    /// API request, worker handler) are POSTed to `<otlp_endpoint>/v1/traces`.
    /// Plain HTTP only: run the collector (or its agent) on the host or
    /// beside the process. Unset: no exporter, the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of the exported spans.
    pub service_name: String,
    /// How long finished spans wait to be sent, at most.
    pub export_interval_ms: u64,
    /// Bound on one export request; a collector that does not answer in
    /// time loses that batch, never blocks the pipeline.
    pub export_timeout_ms: u64,
    /// Finished spans waiting to be sent, at most; past it new spans are
    /// dropped (the pipeline never waits for the collector).
    pub max_queue_spans: usize,
    /// Spans per export request, at most.
    pub max_export_batch_spans: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "ductor".to_owned(),
            export_interval_ms: 5_000,
            export_timeout_ms: 10_000,
            max_queue_spans: 2_048,
            max_export_batch_spans: 512,
        }
    }
}

impl TelemetryConfig {
    /// The collector's traces URL (`<otlp_endpoint>/v1/traces`), when the
    /// exporter is on.
    pub fn traces_url(&self) -> Option<String> {
        let base = self.otlp_endpoint.as_deref()?;
        Some(format!("{}/v1/traces", base.trim_end_matches('/')))
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("telemetry.export_interval_ms", self.export_interval_ms),
            ("telemetry.export_timeout_ms", self.export_timeout_ms),
            ("telemetry.max_queue_spans", self.max_queue_spans as u64),
            (
                "telemetry.max_export_batch_spans",
                self.max_export_batch_spans as u64,
            ),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.max_export_batch_spans > self.max_queue_spans {
            return Err(invalid(
                "telemetry.max_export_batch_spans",
                "must be at most telemetry.max_queue_spans",
            ));
        }
        if self.service_name.is_empty() {
            return Err(invalid("telemetry.service_name", "must not be empty"));
        }
        if let Some(endpoint) = &self.otlp_endpoint {
            let url = url::Url::parse(endpoint)
                .map_err(|e| invalid("telemetry.otlp_endpoint", format!("not a URL: {e}")))?;
            if url.scheme() != "http" || url.host_str().is_none() {
                return Err(invalid(
                    "telemetry.otlp_endpoint",
                    "must be http://host[:port][/path]: the exporter speaks plain HTTP, so run \
                     the collector or its agent on the host or beside the process",
                ));
            }
            if url.query().is_some() || url.fragment().is_some() {
                return Err(invalid(
                    "telemetry.otlp_endpoint",
                    "takes no query or fragment: it is the base the exporter adds /v1/traces to",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exporter_is_off_by_default_and_its_endpoint_is_checked() {
        let off = TelemetryConfig::default();
        assert_eq!(off.traces_url(), None);
        off.validate().expect("the defaults are valid");
        let on = |endpoint: &str| TelemetryConfig {
            otlp_endpoint: Some(endpoint.to_owned()),
            ..TelemetryConfig::default()
        };
        assert_eq!(
            on("http://127.0.0.1:4318/").traces_url().as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        on("http://collector:4318").validate().expect("valid");
        for bad in [
            "https://collector:4318",
            "127.0.0.1:4318",
            "http://c/?a=1",
            "nonsense",
        ] {
            let err = on(bad).validate().expect_err(bad).to_string();
            assert!(err.contains("telemetry.otlp_endpoint"), "{err}");
        }
        let batch_over_queue = TelemetryConfig {
            max_export_batch_spans: 4_096,
            ..TelemetryConfig::default()
        };
        assert!(batch_over_queue.validate().is_err());
    }
}
