//! The restart measurement: a healthy workload, its one `serve` SIGKILLed
//! in the middle of it and started again at once (as a supervisor does),
//! and what that cost the runs.
//!
//! The serve runs in a process of its own under a `kafka.group_instance_id`
//! (static membership; `--dynamic-membership` measures a serve without
//! one), the worker in this one and always answers at once, and every step
//! has a short timeout and no retry: an attempt that
//! times out fails its run, so a crash that made a healthy run wait past
//! its step's clock shows as a failure. The report is one JSON line:
//! `{"runs":N,"succeeded":N,"failed":N,"timed_out_attempts":N,
//! "first_completion_after_kill_ms":N,"longest_pause_ms":N,
//! "slowest_run_ms":N,"violations":{..}}`; any failed run or timed-out
//! attempt is a violation.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use ductor::config::Config;
use ductor_testkit::programs::beside_this_program;
use ductor_testkit::serve_process::ServeProcess;

/// The workflow the measurement starts, written to a folder of its own.
const WORKFLOW: &str = "restart";

/// What to run.
#[derive(Debug, Clone, clap::Args)]
pub struct RestartArgs {
    /// Runs to start.
    #[arg(long, default_value_t = 3_000)]
    pub runs: usize,
    /// Starts per second.
    #[arg(long, default_value_t = 150.0)]
    pub rate: f64,
    /// Seconds after the first start at which the serve is SIGKILLed.
    #[arg(long, default_value_t = 5.0)]
    pub kill_after_s: f64,
    /// Steps of the workflow.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub steps: u32,
    /// Timeout of each step (no retries).
    #[arg(long, default_value_t = 2_000)]
    pub step_timeout_ms: u64,
    /// Run the serve without a `kafka.group_instance_id`, as a deployment
    /// without static membership does: the restarted serve then gets its
    /// partitions back only once the group let the killed member go
    /// (`kafka.session_timeout_ms`).
    #[arg(long)]
    pub dynamic_membership: bool,
    /// How long the runs may take to end after the last start.
    #[arg(long, default_value_t = 300)]
    pub settle_timeout_s: u64,
    /// The `ductor` binary the serve runs from; by default the one beside
    /// this program.
    #[arg(long)]
    pub serve_bin: Option<PathBuf>,
}

/// What the kill cost.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RestartReport {
    pub runs: usize,
    pub succeeded: i64,
    pub failed: i64,
    pub timed_out_attempts: i64,
    /// From the SIGKILL to the first run that succeeded after it.
    pub first_completion_after_kill_ms: i64,
    /// Longest time without a run succeeding, from the kill to the end.
    pub longest_pause_ms: i64,
    /// Longest a run took, from its start request's send to its end (a
    /// start that waited in the topic while no serve consumed it counts
    /// the wait).
    pub slowest_run_ms: i64,
    pub violations: BTreeMap<String, i64>,
}

impl RestartReport {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// `steps` steps on the pool `restart`, each `timeout_ms`, never retried.
fn workflow_toml(steps: u32, timeout_ms: u64) -> String {
    let step = |n: u32| {
        format!(
            "[[steps]]\nname = \"step-{n}\"\npool = \"{WORKFLOW}\"\ntimeout_ms = {timeout_ms}\n\
             [steps.retry]\nmax_attempts = 1\n"
        )
    };
    let steps: Vec<String> = (1..=steps).map(step).collect();
    format!("name = \"{WORKFLOW}\"\nversion = 1\n\n{}", steps.join("\n"))
}

/// Runs the measurement on `config`'s database and topic prefix.
pub async fn run(config: &Config, args: &RestartArgs) -> anyhow::Result<RestartReport> {
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    let dir = std::env::temp_dir().join(format!("ductor-restart-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(
        dir.join(format!("{WORKFLOW}.toml")),
        workflow_toml(args.steps, args.step_timeout_ms),
    )?;
    let mut config = config.clone();
    config.coordinator.workflows_dir = dir.clone();
    config.kafka.step_pools = vec![WORKFLOW.into()];
    if args.dynamic_membership {
        config.kafka.group_instance_id = None;
    } else if config.kafka.group_instance_id.is_none() {
        config.kafka.group_instance_id = Some(format!("{}-restart", config.kafka.group_id));
    }
    ductor::infra::db::migrate_database(&config.database).await?;
    ductor::infra::kafka::create_configured_topics(&config).await?;
    let bin = match &args.serve_bin {
        Some(bin) => bin.clone(),
        None => beside_this_program("ductor")?,
    };
    let mut serve = ServeProcess::start(&bin, &config).await?;
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(ductor::client::worker::run(
        ductor::client::worker::WorkerOptions::from_config(&config, WORKFLOW),
        |step: ductor::client::worker::StepDispatch| async move {
            ductor::client::worker::StepOutcome::Succeeded(json!({"step": step.step}))
        },
        shutdown.clone(),
    ));
    let outcome = drive(&config, args, &mut serve).await;
    shutdown.cancel();
    let _ = worker.await;
    serve.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

/// Starts the runs at the rate, kills and restarts the serve on the way,
/// waits for the runs to end and measures.
async fn drive(
    config: &Config,
    args: &RestartArgs,
    serve: &mut ServeProcess,
) -> anyhow::Result<RestartReport> {
    let prefix = format!("restart-{}", uuid::Uuid::new_v4().simple());
    // The starts keep coming while the serve is down, as a producer's do.
    let sending = send_starts(config, args, &prefix);
    let killing = async {
        tokio::time::sleep(Duration::from_secs_f64(args.kill_after_s.max(0.0))).await;
        let at = Utc::now();
        serve.kill_and_restart().await.map(|()| at)
    };
    let (sent_at, killed_at) = tokio::join!(sending, killing);
    let (sent_at, killed_at) = (sent_at?, killed_at?);
    let last_sent = sent_at.values().max().copied();
    anyhow::ensure!(
        last_sent.is_some_and(|last| last > killed_at),
        "the runs were all sent before the kill: raise --runs"
    );
    let pool = ductor::infra::db::connect(&config.database).await?;
    let pattern = format!("{prefix}-%");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.settle_timeout_s);
    loop {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM runs WHERE run_id LIKE $1 AND status = 'running'",
        )
        .bind(&pattern)
        .fetch_one(&pool)
        .await?;
        let all: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE run_id LIKE $1")
            .bind(&pattern)
            .fetch_one(&pool)
            .await?;
        if (running == 0 && all as usize == args.runs) || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    measure(&pool, &pattern, &sent_at, killed_at).await
}

/// Produces `args.runs` start requests at `args.rate`; returns when each
/// was sent, by run id, once every send was acknowledged.
async fn send_starts(
    config: &Config,
    args: &RestartArgs,
    prefix: &str,
) -> anyhow::Result<HashMap<String, DateTime<Utc>>> {
    let producer: FutureProducer = ductor::infra::kafka::producer(&config.kafka, "restart")?;
    let topic = config.topic_names().requests();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
    let mut sends = Vec::with_capacity(args.runs);
    let mut sent_at = HashMap::with_capacity(args.runs);
    for i in 0..args.runs {
        tick.tick().await;
        let run_id = format!("{prefix}-{i}");
        sent_at.insert(run_id.clone(), Utc::now());
        let value = json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
            "tenant": "acme", "workflow": WORKFLOW, "input": {"i": i}})
        .to_string();
        let producer = producer.clone();
        let topic = topic.clone();
        sends.push(tokio::spawn(async move {
            let record = FutureRecord::to(&topic)
                .key(run_id.as_bytes())
                .payload(value.as_bytes());
            producer
                .send(record, Duration::from_secs(30))
                .await
                .map(|_| ())
                .map_err(|(e, _)| anyhow::anyhow!("producing a start: {e}"))
        }));
    }
    for send in sends {
        send.await.context("a start's send task")??;
    }
    Ok(sent_at)
}

async fn measure(
    pool: &sqlx::PgPool,
    pattern: &str,
    sent_at: &HashMap<String, DateTime<Utc>>,
    killed_at: DateTime<Utc>,
) -> anyhow::Result<RestartReport> {
    let runs = sent_at.len();
    let row: (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'succeeded'), \
                count(*) FILTER (WHERE status = 'failed') \
         FROM runs WHERE run_id LIKE $1",
    )
    .bind(pattern)
    .fetch_one(pool)
    .await
    .context("counting runs")?;
    let (succeeded, failed) = row;
    let ended: Vec<(String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT run_id, finished_at FROM runs WHERE run_id LIKE $1 AND finished_at IS NOT NULL",
    )
    .bind(pattern)
    .fetch_all(pool)
    .await
    .context("reading end times")?;
    let timed_out: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_attempts WHERE run_id LIKE $1 AND status = 'timed_out'",
    )
    .bind(pattern)
    .fetch_one(pool)
    .await
    .context("counting timed-out attempts")?;
    let finishes: Vec<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT finished_at FROM runs WHERE run_id LIKE $1 AND status = 'succeeded' \
             AND finished_at > $2 ORDER BY finished_at",
    )
    .bind(pattern)
    .bind(killed_at)
    .fetch_all(pool)
    .await
    .context("reading completion times")?;
    let mut report = RestartReport {
        runs,
        succeeded,
        failed,
        timed_out_attempts: timed_out,
        slowest_run_ms: slowest_ms(sent_at, &ended),
        ..RestartReport::default()
    };
    let (first, longest) = pauses(killed_at, &finishes);
    report.first_completion_after_kill_ms = first;
    report.longest_pause_ms = longest;
    for (kind, n) in [
        ("run_failed", failed),
        ("attempt_timed_out", timed_out),
        ("run_not_ended", runs as i64 - succeeded - failed),
    ] {
        if n > 0 {
            report.violations.insert(kind.into(), n);
        }
    }
    Ok(report)
}

/// The longest time from a run's start request to its end, over the runs
/// that ended.
fn slowest_ms(sent_at: &HashMap<String, DateTime<Utc>>, ended: &[(String, DateTime<Utc>)]) -> i64 {
    ended
        .iter()
        .filter_map(|(run_id, end)| {
            sent_at
                .get(run_id)
                .map(|sent| (*end - *sent).num_milliseconds())
        })
        .max()
        .unwrap_or(0)
}

/// From `from`, the wait for the first of `finishes` (sorted) and the
/// longest gap between two of them (or from `from` to the first).
fn pauses(from: DateTime<Utc>, finishes: &[DateTime<Utc>]) -> (i64, i64) {
    let Some(first) = finishes.first() else {
        return (-1, -1);
    };
    let first_ms = (*first - from).num_milliseconds();
    let longest = finishes
        .windows(2)
        .map(|w| (w[1] - w[0]).num_milliseconds())
        .fold(first_ms, i64::max);
    (first_ms, longest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_is_timed_from_its_start_request_to_its_end() {
        let t = |ms: i64| DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap();
        let sent = HashMap::from([("a".to_owned(), t(0)), ("b".to_owned(), t(100))]);
        assert_eq!(slowest_ms(&sent, &[]), 0);
        // b's start waited in the topic: it counts.
        let ended = [("a".to_owned(), t(250)), ("b".to_owned(), t(9_100))];
        assert_eq!(slowest_ms(&sent, &ended), 9_000);
        // A run this measurement did not start is not its business.
        let other = [("a".to_owned(), t(250)), ("z".to_owned(), t(99_000))];
        assert_eq!(slowest_ms(&sent, &other), 250);
    }

    #[test]
    fn pauses_are_measured_from_the_kill() {
        let t = |ms: i64| DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap();
        assert_eq!(pauses(t(0), &[]), (-1, -1));
        assert_eq!(
            pauses(t(0), &[t(1_500), t(1_600), t(4_600)]),
            (1_500, 3_000)
        );
        assert_eq!(pauses(t(0), &[t(2_000), t(2_100)]), (2_000, 2_000));
    }

    #[test]
    fn the_workflow_has_the_steps_asked_for_without_retries() {
        for steps in [1, 2, 3] {
            let dir = tempfile::tempdir().unwrap();
            let toml = workflow_toml(steps, 1_500);
            std::fs::write(dir.path().join("restart.toml"), toml).unwrap();
            let workflows = ductor::infra::workflows::load_dir(dir.path()).unwrap();
            let def = workflows.iter().next().expect("one workflow");
            assert_eq!(def.name, WORKFLOW);
            assert_eq!(def.steps.len(), steps as usize);
            assert!(def.steps.iter().all(|s| s.timeout_ms == 1_500));
            assert!(def.steps.iter().all(|s| s.retry.max_attempts == 1));
        }
    }
}
