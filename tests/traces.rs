//! Traces across every hop, against the real Kafka and Postgres: a start
//! over HTTP with a W3C `traceparent` keeps one trace id through its
//! dispatches, the worker library's results, a signal, a durable timer,
//! the events and the output, each hop with a span of its own; and the
//! exporter, switched on by `telemetry.otlp_endpoint`, delivers the spans
//! of serve (a process of its own, configured like any other) and of the
//! worker to a collector: a stub here, which takes OTLP/HTTP protobuf
//! POSTs on `/v1/traces` and decodes them.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use ductor::auth::Scope;
use ductor::client::worker::{StepDispatch, StepOutcome, WorkerOptions};
use ductor::config::Config;
use ductor::contract::TraceContext;
use ductor_testkit::programs::ductor_bin;
use ductor_testkit::schemas::check_headers;
use ductor_testkit::serve_process::ServeProcess;
use http_body_util::BodyExt;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message as _;
use rdkafka::message::{Headers, Message, OwnedMessage};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(90);

/// A span as the collector received it.
#[derive(Debug, Clone)]
struct Seen {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent_span_id: Vec<u8>,
    attributes: BTreeMap<String, String>,
}

/// An OTLP/HTTP collector that keeps every span it is sent.
struct Collector {
    url: String,
    spans: Arc<Mutex<Vec<Seen>>>,
    /// Requests that were not protobuf POSTs to /v1/traces.
    refused: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the collector");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let spans = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(Mutex::new(Vec::new()));
        let (kept, wrong) = (spans.clone(), refused.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (kept, wrong) = (kept.clone(), wrong.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        receive(request, kept.clone(), wrong.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Collector {
            url,
            spans,
            refused,
            task,
        }
    }

    fn spans(&self) -> Vec<Seen> {
        self.spans.lock().unwrap().clone()
    }
}

/// One export request: decoded and kept when it is what OTLP/HTTP with
/// protobuf sends, refused (and noted) otherwise.
async fn receive(
    request: hyper::Request<hyper::body::Incoming>,
    kept: Arc<Mutex<Vec<Seen>>>,
    wrong: Arc<Mutex<Vec<String>>>,
) -> Result<hyper::Response<http_body_util::Full<hyper::body::Bytes>>, std::convert::Infallible> {
    let content_type = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let what = format!(
        "{} {} ({content_type})",
        request.method(),
        request.uri().path()
    );
    let answer = |status: u16, body: Vec<u8>| {
        Ok(hyper::Response::builder()
            .status(status)
            .header("content-type", "application/x-protobuf")
            .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
            .unwrap())
    };
    if request.method() != hyper::Method::POST
        || request.uri().path() != "/v1/traces"
        || content_type != "application/x-protobuf"
    {
        wrong.lock().unwrap().push(what);
        return answer(404, Vec::new());
    }
    let Ok(body) = request.into_body().collect().await else {
        wrong.lock().unwrap().push(format!("{what}: body unread"));
        return answer(400, Vec::new());
    };
    let Ok(export) = ExportTraceServiceRequest::decode(body.to_bytes()) else {
        wrong
            .lock()
            .unwrap()
            .push(format!("{what}: not an export request"));
        return answer(400, Vec::new());
    };
    let mut seen = Vec::new();
    for resource in export.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .and_then(|r| attributes(&r.attributes).remove("service.name"))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                seen.push(Seen {
                    service: service.clone(),
                    name: span.name,
                    trace_id: span.trace_id,
                    span_id: span.span_id,
                    parent_span_id: span.parent_span_id,
                    attributes: attributes(&span.attributes),
                });
            }
        }
    }
    kept.lock().unwrap().extend(seen);
    answer(200, ExportTraceServiceResponse::default().encode_to_vec())
}

fn attributes(
    list: &[opentelemetry_proto::tonic::common::v1::KeyValue],
) -> BTreeMap<String, String> {
    list.iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                Some(any_value::Value::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

/// A task, a wait for the signal `go`, a short durable sleep, a task, and
/// the output on the test's own topic.
fn workflow(dir: &std::path::Path, output_topic: &str) {
    let toml = format!(
        "name = \"traced\"\nversion = 1\noutput_topic = \"{output_topic}\"\n\n\
         [[steps]]\nname = \"first\"\npool = \"default\"\ntimeout_ms = 10000\n\n\
         [[steps]]\nname = \"go\"\nkind = \"await_signal\"\nsignal = \"go\"\ntimeout_ms = 60000\n\n\
         [[steps]]\nname = \"nap\"\nkind = \"sleep\"\nduration_ms = 20\n\n\
         [[steps]]\nname = \"last\"\npool = \"default\"\ntimeout_ms = 10000\n"
    );
    std::fs::write(dir.join("traced.toml"), toml).unwrap();
}

fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

fn all_headers(m: &OwnedMessage) -> Vec<(String, Vec<u8>)> {
    m.headers()
        .map(|hs| {
            hs.iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default()
}

/// The trace context a record carries, which must be there.
fn carried(m: &OwnedMessage) -> TraceContext {
    let parent = header(m, "traceparent")
        .unwrap_or_else(|| panic!("{} @{} carries no traceparent", m.topic(), m.offset()));
    let state = header(m, "tracestate");
    TraceContext::from_values([parent.as_bytes()], state.as_deref().map(str::as_bytes))
        .unwrap_or_else(|| panic!("{parent:?} is not a valid traceparent"))
}

/// Reads the records of `run_id` on `topics` until `done` says they are
/// all there (the topics are read concurrently, in no order among them).
async fn read_run(
    topics: &[&str],
    run_id: &str,
    done: impl Fn(&[OwnedMessage]) -> bool,
) -> Vec<OwnedMessage> {
    let consumer = reader(topics);
    let mut records = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done(&records) {
        let m = match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Ok(Ok(m)) => m.detach(),
            Ok(Err(e)) => panic!("consumer error: {e}"),
            Err(_) => panic!(
                "the records of {run_id} did not all come within {WAIT:?}; read {:?}",
                records
                    .iter()
                    .map(|m: &OwnedMessage| (m.topic().to_owned(), header(m, "ce_type")))
                    .collect::<Vec<_>>()
            ),
        };
        if m.key() == Some(run_id.as_bytes()) {
            records.push(m);
        }
    }
    records
}

/// How many of `records` are on `topic` with CloudEvents type `ce_type`
/// (`None`: without one).
fn count(records: &[OwnedMessage], topic: &str, ce_type: Option<&str>) -> usize {
    records
        .iter()
        .filter(|m| m.topic() == topic && header(m, "ce_type").as_deref() == ce_type)
        .count()
}

/// The caller's trace: its id, and the span its start request came from.
const CALLER_SPAN: &str = "00f067aa0ba902b7";
const CALLER_SPAN_ID: [u8; 8] = [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7];

/// Serve (exporting to `collector`), the worker library in this process
/// (exporting too, under a name of its own), and an API key.
struct Stage {
    db: TestDb,
    config: Config,
    serve: ServeProcess,
    token: String,
    telemetry: ductor::infra::telemetry::Telemetry,
    worker_stop: CancellationToken,
    worker: tokio::task::JoinHandle<anyhow::Result<()>>,
    output_topic: String,
    _workflows: tempfile::TempDir,
}

impl Stage {
    async fn start(collector: &Collector) -> Stage {
        let db = TestDb::migrated().await;
        let mut config = test_config(&db);
        let workflows = tempfile::tempdir().unwrap();
        let output_topic = format!("{}outputs", config.kafka.topic_prefix);
        workflow(workflows.path(), &output_topic);
        config.coordinator.workflows_dir = workflows.path().to_path_buf();
        config.telemetry.otlp_endpoint = Some(collector.url.clone());
        config.telemetry.export_interval_ms = 100;
        ductor::infra::kafka::create_configured_topics(&config)
            .await
            .expect("creating topics");
        let serve = ServeProcess::start(&ductor_bin(), &config)
            .await
            .expect("starting serve");
        let mut worker_telemetry = config.telemetry.clone();
        worker_telemetry.service_name = "traces-test-worker".into();
        let telemetry = ductor::infra::telemetry::init(&config.log, &worker_telemetry);
        assert!(
            telemetry.exporting(),
            "this test installs the first subscriber"
        );
        let worker_stop = CancellationToken::new();
        let worker = tokio::spawn(ductor::client::worker::run(
            WorkerOptions::from_config(&config, "default"),
            |step: StepDispatch| async move { StepOutcome::Succeeded(json!({ "after": step.step })) },
            worker_stop.clone(),
        ));
        let token = api_key(&db, "acme", &[Scope::RunsWrite, Scope::RunsRead]).await;
        Stage {
            db,
            config,
            serve,
            token,
            telemetry,
            worker_stop,
            worker,
            output_topic,
            _workflows: workflows,
        }
    }

    /// POSTs `body` to `path` with the key and `headers`; the answer's JSON.
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8], expect: u16) -> Value {
        let auth = bearer(&self.token);
        let mut all = vec![
            (auth.0, auth.1.as_str()),
            ("Content-Type", "application/json"),
        ];
        all.extend_from_slice(headers);
        let (status, answer) = http(self.serve.addr, "POST", path, &all, body).await;
        assert_eq!(status, expect, "{}", String::from_utf8_lossy(&answer));
        serde_json::from_slice(&answer).unwrap()
    }

    /// The topics a run's records are on.
    fn topics(&self) -> Topics {
        let names = self.config.topic_names();
        Topics {
            steps: names.steps("default"),
            results: names.attempt_results(),
            events: names.events(),
            wakeups: names.wakeups(),
            output: self.output_topic.clone(),
        }
    }

    async fn stop(self) {
        self.worker_stop.cancel();
        self.worker
            .await
            .unwrap()
            .expect("the worker stops cleanly");
        let telemetry = self.telemetry;
        tokio::task::spawn_blocking(move || telemetry.shutdown())
            .await
            .unwrap();
        self.serve.stop().await;
        self.db.drop_db().await;
    }
}

struct Topics {
    steps: String,
    results: String,
    events: String,
    wakeups: String,
    output: String,
}

impl Topics {
    fn all(&self) -> [&str; 5] {
        [
            &self.steps,
            &self.results,
            &self.events,
            &self.wakeups,
            &self.output,
        ]
    }

    /// Every record of a run that went through all its steps is there.
    fn complete(&self, read: &[OwnedMessage]) -> bool {
        count(read, &self.steps, Some("ductor.step.dispatch")) == 2
            && count(read, &self.results, None) == 2
            && count(read, &self.wakeups, None) == 1
            && count(read, &self.wakeups, Some("ductor.wakeup.timer")) >= 1
            && count(read, &self.events, Some("ductor.run.event")) >= 5
            && count(read, &self.output, Some("ductor.run.output")) == 1
    }
}

/// Every record of the run is in the caller's trace (with its tracestate,
/// but for the signal, an input of its own caller), each on the contract,
/// each hop from a span of its own.
fn check_hops(records: &[OwnedMessage], topics: &Topics, trace_id: &str) {
    let mut by_kind: BTreeMap<String, Vec<TraceContext>> = BTreeMap::new();
    for m in records {
        let cx = carried(m);
        assert_eq!(cx.trace_id_hex(), trace_id, "{} @{}", m.topic(), m.offset());
        assert!(cx.sampled());
        assert_ne!(cx.span_id, CALLER_SPAN_ID, "each hop has a span of its own");
        let input = m.topic() == topics.results
            || (m.topic() == topics.wakeups && header(m, "ce_type").is_none());
        let kind = if input {
            check_headers("input", &all_headers(m))
                .expect("an input's headers are on the contract");
            m.topic().to_owned()
        } else {
            on_contract(m.clone());
            // The start's tracestate, which the signal (without one) kept.
            assert_eq!(
                cx.tracestate.as_deref(),
                Some("caller=abc"),
                "{}",
                m.topic()
            );
            header(m, "ce_type").unwrap()
        };
        by_kind.entry(kind).or_default().push(cx);
    }
    let spans =
        |kind: &str| -> BTreeSet<[u8; 8]> { by_kind[kind].iter().map(|c| c.span_id).collect() };
    assert_eq!(
        spans("ductor.step.dispatch").len(),
        2,
        "one span per transition"
    );
    assert_eq!(spans(&topics.results).len(), 2);
    assert!(
        spans("ductor.step.dispatch").is_disjoint(&spans(&topics.results)),
        "a result is the worker's hop"
    );
    assert!(by_kind.contains_key("ductor.run.output"));
}

/// The spans of the run's trace at the collector, parented hop by hop:
/// the API continues the caller, the start's fold the API, a handler the
/// fold that dispatched it, the result's fold the handler, a publish the
/// fold that made its effect.
fn check_spans(spans: &[Seen], run_id: &str) {
    let start = spans.iter().find(|s| s.name == "api.start_run").unwrap();
    assert_eq!(start.parent_span_id, CALLER_SPAN_ID.to_vec());
    assert_eq!(start.service, "ductor");
    let folds: Vec<&Seen> = spans.iter().filter(|s| s.name == "fold").collect();
    for fold in &folds {
        assert_eq!(
            fold.attributes.get("ductor.run_id").map(String::as_str),
            Some(run_id)
        );
        assert!(fold.attributes.contains_key("ductor.step"), "{fold:?}");
    }
    let first_fold = folds
        .iter()
        .find(|f| f.attributes.get("ductor.input").map(String::as_str) == Some("run.start"))
        .expect("the start's fold");
    assert_eq!(first_fold.parent_span_id, start.span_id);
    let handlers: Vec<&Seen> = spans.iter().filter(|s| s.name == "step.handle").collect();
    for handler in &handlers {
        assert_eq!(handler.service, "traces-test-worker");
        assert_eq!(
            handler.attributes.get("ductor.run_id").map(String::as_str),
            Some(run_id)
        );
        assert!(folds.iter().any(|f| f.span_id == handler.parent_span_id));
        assert!(folds.iter().any(|f| f.parent_span_id == handler.span_id));
    }
    let steps: BTreeSet<&str> = handlers
        .iter()
        .filter_map(|h| h.attributes.get("ductor.step").map(String::as_str))
        .collect();
    assert_eq!(steps, BTreeSet::from(["first", "last"]));
    for publish in spans.iter().filter(|s| s.name == "publish") {
        assert!(folds.iter().any(|f| f.span_id == publish.parent_span_id));
    }
}

/// Waits until the collector has the spans of every hop of `trace_id`
/// (and the batch spans, in traces of their own); returns the trace's.
async fn spans_of(collector: &Collector, trace_id: &str) -> Vec<Seen> {
    let trace = hex(trace_id);
    let spans = eventually("the spans of every hop at the collector", WAIT, || {
        let spans = collector.spans();
        let ours: Vec<Seen> = spans
            .iter()
            .filter(|s| s.trace_id == trace)
            .cloned()
            .collect();
        let named = |name: &str| ours.iter().filter(|s| s.name == name).count();
        let batches = |name: &str| {
            spans
                .iter()
                .any(|s| s.name == name && s.service == "ductor")
        };
        let ready = named("api.start_run") == 1
            && named("api.signal_run") == 1
            && named("fold") >= 5
            && named("publish") >= 5
            && named("step.handle") == 2
            && batches("ingress.batch")
            && batches("apply");
        async move { ready.then_some(ours) }
    })
    .await;
    let refused = collector.refused.lock().unwrap().clone();
    assert!(refused.is_empty(), "{refused:?}");
    spans
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_an_http_start_through_every_hop_to_the_collector() {
    let collector = Collector::start().await;
    let stage = Stage::start(&collector).await;
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let traceparent = format!("00-{trace_id}-{CALLER_SPAN}-01");
    let started = stage
        .post(
            "/v1/runs",
            &[("traceparent", &traceparent), ("tracestate", "caller=abc")],
            br#"{"workflow": "traced", "input": {"n": 1}}"#,
            201,
        )
        .await;
    let run_id = started["run_id"].as_str().unwrap().to_owned();
    // The signal continues the same trace from another span of the caller.
    let signal_parent = format!("00-{trace_id}-1111111111111111-01");
    stage
        .post(
            &format!("/v1/runs/{run_id}/signals"),
            &[("traceparent", &signal_parent)],
            br#"{"name": "go"}"#,
            202,
        )
        .await;
    // A malformed traceparent is ignored, not refused: with the exporter
    // on, that run gets a trace of its own.
    let other = stage
        .post(
            "/v1/runs",
            &[("traceparent", "00-not-a-trace-01")],
            br#"{"workflow": "traced"}"#,
            201,
        )
        .await;
    let other_run = other["run_id"].as_str().unwrap().to_owned();

    let topics = stage.topics();
    let records = read_run(&topics.all(), &run_id, |read| topics.complete(read)).await;
    check_hops(&records, &topics, &trace_id);
    let state: Value = sqlx::query_scalar("SELECT state FROM runs WHERE run_id = $1")
        .bind(&run_id)
        .fetch_one(&stage.db.pool)
        .await
        .unwrap();
    let stored = state["trace"]["traceparent"].as_str().unwrap_or_default();
    assert!(
        stored.contains(&trace_id),
        "the run keeps its trace: {state}"
    );
    let other = read_run(&topics.all(), &other_run, |read| {
        count(read, &topics.steps, Some("ductor.step.dispatch")) == 1
    })
    .await;
    assert_ne!(carried(&other[0]).trace_id_hex(), trace_id);

    tokio::task::block_in_place(|| stage.telemetry.flush());
    let spans = spans_of(&collector, &trace_id).await;
    check_spans(&spans, &run_id);
    stage.stop().await;
    collector.task.abort();
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}
