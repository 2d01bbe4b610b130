//! The OTLP exporter of the trace spans: OTLP over HTTP with protobuf
//! bodies, to the collector `telemetry.otlp_endpoint` names.
//!
//! In: the `telemetry` section. Out: a tracer provider whose batch
//! processor sends finished spans from a thread of its own. Guarantees:
//! the pipeline never waits for the collector: spans queue up to
//! `telemetry.max_queue_spans` and are dropped past it, and one export
//! takes at most `telemetry.export_timeout_ms`; the HTTP client runs on a
//! runtime of its own, so it works before, beside and after the process's
//! runtime, and a collector that is down costs the exporter's thread
//! alone.

use std::time::Duration;

use anyhow::Context;
use http_body_util::{BodyExt, Full};
use hyper::header::HOST;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};

use crate::config::TelemetryConfig;

/// Largest answer read from the collector: its answers are small (an
/// empty success or a partial-success message).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// The tracer provider exporting to `config`'s collector, or `None` when
/// the exporter is off.
pub fn provider(config: &TelemetryConfig) -> anyhow::Result<Option<SdkTracerProvider>> {
    let Some(url) = config.traces_url() else {
        return Ok(None);
    };
    let timeout = Duration::from_millis(config.export_timeout_ms);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(timeout)
        .with_http_client(Client::new(timeout)?)
        .build()
        .context("building the OTLP span exporter")?;
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(config.max_queue_spans)
        .with_max_export_batch_size(config.max_export_batch_spans)
        .with_scheduled_delay(Duration::from_millis(config.export_interval_ms))
        .build();
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch)
        .build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .build();
    Ok(Some(
        SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build(),
    ))
}

/// One HTTP/1.1 POST per export, on a current-thread runtime of its own.
/// The batch processor calls it from its own thread, which may block.
#[derive(Debug)]
struct Client {
    /// Always set until the client is dropped.
    runtime: Option<tokio::runtime::Runtime>,
    timeout: Duration,
}

impl Client {
    fn new(timeout: Duration) -> anyhow::Result<Client> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .context("starting the OTLP exporter's runtime")?;
        Ok(Client {
            runtime: Some(runtime),
            timeout,
        })
    }
}

impl Drop for Client {
    /// Without blocking: the client may be dropped on a runtime's thread.
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[async_trait::async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let timeout = self.timeout;
        let runtime = self.runtime.as_ref().ok_or("the exporter is shut down")?;
        runtime.block_on(async move {
            tokio::time::timeout(timeout, post(request))
                .await
                .map_err(|_| HttpError::from("the collector did not answer in time"))?
        })
    }
}

/// Sends `request` on a connection of its own and reads the answer.
async fn post(request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
    let uri = request.uri().clone();
    let host = uri.host().ok_or("the collector's URL has no host")?;
    let port = uri.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host, port)).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let driver = tokio::spawn(connection);
    let (mut parts, body) = request.into_parts();
    if let Some(authority) = uri.authority() {
        parts.headers.insert(HOST, authority.as_str().parse()?);
    }
    // Origin form: the path and query alone.
    parts.uri = uri.path_and_query().map_or("/", |p| p.as_str()).parse()?;
    let answer = sender
        .send_request(hyper::Request::from_parts(parts, Full::new(body)))
        .await?;
    let (parts, body) = answer.into_parts();
    let body = http_body_util::Limited::new(body, MAX_RESPONSE_BYTES)
        .collect()
        .await?
        .to_bytes();
    driver.abort();
    Ok(Response::from_parts(parts, body))
}
