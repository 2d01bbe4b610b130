//! The idle phase: one run at a time, from its start request to its end.
//!
//! The latency phases time the first hop of runs under load; an operator
//! of a quiet deployment sees something else: how long one run takes when
//! nothing else is in flight, every hop of it (start, three dispatches and
//! results, the end), each paying whatever a component does when it is
//! idle (a fetch that waits for data, a linger, a poll interval). Each run
//! is started after the previous one ended and a pause, so that every loop
//! of the pipeline has gone back to waiting.
//!
//! In: a running pipeline (serve and the echo worker). Out: the runs'
//! latency from the send of the start request to the arrival of the run's
//! `run.succeeded` event, in an HdrHistogram.

use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use rdkafka::consumer::StreamConsumer;
use rdkafka::message::Message;
use serde::Serialize;

use super::pipeline::{Target, events_consumer, produce_start_requests};
use super::stats::Progress;

/// The pause between one run's end and the next run's start: longer than
/// the waits of an idle pipeline's loops (the ingress's fetch wait, the
/// producers' linger), so that each run starts a pipeline at rest.
const PAUSE: Duration = Duration::from_millis(100);
/// How long one run may take before the phase fails.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// One run at a time, start to end.
#[derive(Debug, Clone, Serialize)]
pub struct Idle {
    pub runs: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Runs `runs` runs one after the other on `pipeline`, each started
/// [`PAUSE`] after the previous one ended.
pub async fn idle(
    pipeline: &impl Target,
    runs: usize,
    round: usize,
    progress: &mut Progress,
) -> anyhow::Result<Idle> {
    let events = events_consumer(pipeline.config()).await?;
    one_at_a_time(runs, &events, progress, async |i| {
        let prefix = format!("idle{round}-{i}");
        produce_start_requests(pipeline.producer(), pipeline.config(), &prefix, 1).await?;
        Ok(format!("{prefix}-0"))
    })
    .await
}

/// Times `runs` runs one after the other, each started [`PAUSE`] after the
/// previous one ended: `start(i)` sends run `i`'s start request and answers
/// its run id; the run ends with its `run.succeeded` on `events` (a
/// consumer of the events topic, assigned at its end).
pub async fn one_at_a_time(
    runs: usize,
    events: &StreamConsumer,
    progress: &mut Progress,
    start: impl AsyncFn(usize) -> anyhow::Result<String>,
) -> anyhow::Result<Idle> {
    anyhow::ensure!(runs >= 1, "the idle phase needs at least one run");
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
        .context("creating the idle histogram")?;
    for i in 0..runs {
        tokio::time::sleep(PAUSE).await;
        let sent = Instant::now();
        let run_id = start(i).await?;
        tokio::time::timeout(RUN_LIMIT, succeeded(events, &run_id))
            .await
            .with_context(|| {
                format!("idle: run {run_id} did not succeed within {RUN_LIMIT:?}")
            })??;
        let us = sent.elapsed().as_micros().max(1) as u64;
        histogram.saturating_record(us);
        progress.update(&format!("idle: {}/{runs} runs, one at a time", i + 1));
    }
    let ms = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
    Ok(Idle {
        runs,
        p50_ms: ms(0.5),
        p90_ms: ms(0.9),
        p99_ms: ms(0.99),
        max_ms: histogram.max() as f64 / 1000.0,
    })
}

/// Waits for the `run.succeeded` event of `run_id`, passing over every
/// other event.
async fn succeeded(events: &StreamConsumer, run_id: &str) -> anyhow::Result<()> {
    loop {
        let message = events.recv().await.context("reading the events topic")?;
        if message.key() != Some(run_id.as_bytes()) {
            continue;
        }
        let kind = message
            .payload()
            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
            .and_then(|v| v["kind"].as_str().map(str::to_owned));
        match kind.as_deref() {
            Some("run.succeeded") => return Ok(()),
            Some("run.failed" | "run.cancelled") => {
                anyhow::bail!("idle: run {run_id} ended as {kind:?}; the echo worker never fails")
            }
            _ => {}
        }
    }
}
