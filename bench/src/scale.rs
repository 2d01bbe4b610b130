//! `ductor-scale`: the same batch of runs on one, two, three ... `ductor
//! serve` processes of one consumer group, to show what another process
//! buys on the machine at hand.
//!
//! In: Ductor's configuration (the stack's Postgres and Kafka), the counts
//! of serves to measure, the runs of each measurement, the partitions of
//! its topics and its worker processes. Out: a row per measurement (runs/s
//! to completion, inputs applied, optimistic-lock conflicts and inputs
//! forwarded summed over the serves, the mean apply batch, the seconds from
//! the serves' start to a ready, stable group, the load average), each
//! count's ratios to the first count's figures of the same invocation, and
//! one JSON line, the last line of stdout; progress goes to stderr.
//!
//! Guarantees: every measurement has a migrated database and topics of its
//! own, removed afterwards whatever happened. The serves, the workers and
//! the driver are processes of their own, the release programs beside this
//! one. The serves start together and the load is submitted only once each
//! of them is ready and the group is stable, so the rebalance is timed
//! apart from the load. The load is the demo's (`examples/demo_driver.rs`
//! submits runs of the workflow `order` and follows them,
//! `examples/worker.rs` answers their steps), so `scripts/demo` and this
//! measure the same work.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use ductor::config::{Config, DatabaseUrl};
use ductor_testkit::scratch::{ScratchDatabase, ScratchTopics};
use ductor_testkit::serve_process::{ServeProcess, on_config_file};

/// The demo's workflow, which the driver starts.
const WORKFLOW_FILE: &str = "config/workflows/order.toml";
/// How long the group may take to become stable once its serves are ready.
const STABLE_WITHIN: Duration = Duration::from_secs(60);

/// `ductor-scale` options.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Counts of serve processes to measure, in this order; the ratios are
    /// to the first.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 3])]
    pub serves: Vec<usize>,
    /// Runs of the workflow `order` in each measurement.
    #[arg(long, default_value_t = 2000)]
    pub runs: usize,
    /// Partitions of every topic of a measurement: the most serves that get
    /// work, and the most worker processes that do.
    #[arg(long, default_value_t = 6)]
    pub partitions: i32,
    /// Example worker processes of each measurement.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Chance that one attempt of the step `charge` fails, retryably.
    #[arg(long = "fail-rate", default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Measure every count this many times, interleaved (1,2,3,1,2,3); the
    /// ratios use each count's median runs/s.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Seconds the runs of one measurement may take.
    #[arg(long = "timeout-s", default_value_t = 600)]
    pub timeout_s: u64,
}

impl ScaleArgs {
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.serves.is_empty() && self.serves.iter().all(|&n| (1..=16).contains(&n)),
            "--serves must be counts between 1 and 16"
        );
        anyhow::ensure!(self.runs >= 1, "--runs must be at least 1");
        anyhow::ensure!(
            (1..=256).contains(&self.partitions),
            "--partitions must be between 1 and 256"
        );
        anyhow::ensure!(
            (1..=16).contains(&self.workers),
            "--workers must be between 1 and 16"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.fail_rate),
            "--fail-rate must be between 0 and 1"
        );
        anyhow::ensure!(
            (1..=10).contains(&self.rounds),
            "--rounds must be between 1 and 10"
        );
        Ok(())
    }
}

/// Measures every count of `args.serves`, `args.rounds` times, and prints
/// the report.
pub async fn main(args: ScaleArgs, config: Config) -> anyhow::Result<()> {
    args.validate()?;
    let programs = Programs::beside_this_one()?;
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let mut rows = Vec::new();
    for round in 1..=args.rounds {
        for &serves in &args.serves {
            eprintln!(
                "== {serves} serve(s), round {round}/{}: {} runs, {} partitions, load average {:.2}",
                args.rounds,
                args.runs,
                args.partitions,
                load_average().unwrap_or(f64::NAN)
            );
            let label = format!("{tag}-{serves}s-r{round}");
            let row = measure(&config, &programs, &args, serves, &label)
                .await
                .with_context(|| format!("measuring {serves} serve(s), round {round}"))?;
            eprintln!("   {}", row.line());
            rows.push(row);
        }
    }
    let report = Report::new(&args, rows);
    print!("{}", report.table());
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// The programs a measurement runs, built by cargo beside this one.
struct Programs {
    ductor: PathBuf,
    worker: PathBuf,
    driver: PathBuf,
}

impl Programs {
    fn beside_this_one() -> anyhow::Result<Programs> {
        let me = std::env::current_exe().context("finding this program")?;
        let dir = me.parent().context("this program has no directory")?;
        let find = |relative: &str, build: &str| -> anyhow::Result<PathBuf> {
            let path = dir.join(relative);
            anyhow::ensure!(
                path.is_file(),
                "{} is missing: build it with `{build}` (scripts/scale does)",
                path.display()
            );
            Ok(path)
        };
        Ok(Programs {
            ductor: find("ductor", "cargo build --release --bin ductor")?,
            worker: find("examples/worker", "cargo build --release --example worker")?,
            driver: find(
                "examples/demo_driver",
                "cargo build --release --example demo_driver",
            )?,
        })
    }
}

/// A measurement's own database, topics, workflow directory and
/// configuration file.
struct Corner {
    config: Config,
    config_file: PathBuf,
    dir: PathBuf,
    scratch: ScratchDatabase,
    topics: ScratchTopics,
}

impl Corner {
    /// Creates and migrates `ductor_scale_<random>`, writes the workflow
    /// `order` with an output topic of the measurement's own, and creates
    /// the topics (prefix `scale-<label>.`, group `scale-<label>`).
    async fn prepare(base: &Config, args: &ScaleArgs, label: &str) -> anyhow::Result<Corner> {
        let migrate_url = base.database.migrate_url().expose().to_string();
        let scratch = ScratchDatabase::create(&migrate_url, "ductor_scale_").await?;
        let dir = std::env::temp_dir().join(format!("ductor-scale-{label}"));
        let corner = Corner {
            config: corner_config(base, args, label, &scratch, &dir)?,
            config_file: dir.join("ductor.toml"),
            dir,
            scratch,
            topics: ScratchTopics::default(),
        };
        // From here on the corner is removed on failure too.
        match corner.fill().await {
            Ok(()) => Ok(corner),
            Err(e) => {
                if let Err(cleanup) = corner.remove().await {
                    eprintln!("scale: {cleanup:#}");
                }
                Err(e)
            }
        }
    }

    async fn fill(&self) -> anyhow::Result<()> {
        let workflows = &self.config.coordinator.workflows_dir;
        std::fs::create_dir_all(workflows)
            .with_context(|| format!("creating {}", workflows.display()))?;
        let output_topic = output_topic(&self.config);
        std::fs::write(workflows.join("order.toml"), order_workflow(&output_topic)?)
            .context("writing the workflow")?;
        let text = toml::to_string(&self.config).context("writing the configuration")?;
        std::fs::write(&self.config_file, text)
            .with_context(|| format!("writing {}", self.config_file.display()))?;
        ductor::infra::db::migrate_database(&self.config.database).await?;
        self.topics.own(self.config.all_topics());
        ductor::infra::kafka::create_configured_topics(&self.config).await?;
        Ok(())
    }

    /// Deletes the topics, drops the database, removes the directory;
    /// reports what it could not do.
    async fn remove(self) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        if let Err(e) = self.topics.delete(&self.config.kafka).await {
            problems.push(format!("{e:#}"));
        }
        if let Err(e) = self.scratch.drop().await {
            problems.push(format!("{e:#}"));
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            problems.push(format!("removing {}: {e}", self.dir.display()));
        }
        anyhow::ensure!(problems.is_empty(), "cleanup: {}", problems.join("; "));
        Ok(())
    }
}

/// `base` pointed at the scratch database, at topics and a group of the
/// measurement's own and at its workflow directory.
fn corner_config(
    base: &Config,
    args: &ScaleArgs,
    label: &str,
    scratch: &ScratchDatabase,
    dir: &Path,
) -> anyhow::Result<Config> {
    let mut config = base.clone();
    let migrate_url = base.database.migrate_url().expose().to_string();
    config.database.url = DatabaseUrl::new(scratch.url_for(base.database.url.expose())?);
    config.database.migrate_url = Some(DatabaseUrl::new(scratch.url_for(&migrate_url)?));
    config.database.migrate_on_start = false;
    config.kafka.topic_prefix = format!("scale-{label}.");
    config.kafka.group_id = format!("scale-{label}");
    config.kafka.partitions = args.partitions;
    config.kafka.step_pools = vec!["default".to_string()];
    config.kafka.extra_topics = vec![output_topic(&config)];
    config.coordinator.workflows_dir = dir.join("workflows");
    Ok(config)
}

/// The workflow's output topic: under the measurement's prefix, where the
/// demo's `ductor.outputs` is under Ductor's default one.
fn output_topic(config: &Config) -> String {
    format!("{}outputs", config.kafka.topic_prefix)
}

/// The demo's workflow `order`, its output going to `output_topic`.
fn order_workflow(output_topic: &str) -> anyhow::Result<String> {
    let path = ductor_testkit::programs::workspace_dir().join(WORKFLOW_FILE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut workflow: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    workflow.insert("output_topic".into(), output_topic.into());
    Ok(toml::to_string(&workflow)?)
}

/// One measurement: its corner prepared, measured and removed.
async fn measure(
    base: &Config,
    programs: &Programs,
    args: &ScaleArgs,
    serves: usize,
    label: &str,
) -> anyhow::Result<Row> {
    let corner = Corner::prepare(base, args, label).await?;
    let measured = measure_in(&corner, programs, args, serves).await;
    let removed = corner.remove().await;
    let row = measured?;
    removed?;
    Ok(row)
}

/// Starts the serves together, waits for a ready and stable group, starts
/// the workers, runs the driver, and reads the serves' metrics before
/// stopping them all.
async fn measure_in(
    corner: &Corner,
    programs: &Programs,
    args: &ScaleArgs,
    count: usize,
) -> anyhow::Result<Row> {
    let load_before = load_average();
    let started = Instant::now();
    let serves = futures::future::try_join_all(
        (0..count).map(|_| ServeProcess::start(&programs.ductor, &corner.config)),
    )
    .await?;
    group_stable(&corner.config, count).await?;
    let ready_s = started.elapsed().as_secs_f64();
    let mut workers = Vec::new();
    for i in 0..args.workers {
        workers.push(spawn_worker(corner, programs, args, i)?);
    }
    let driven = drive(corner, programs, args).await;
    let totals = Totals::scrape(&serves).await;
    let connections = connections(&corner.config).await;
    for worker in &mut workers {
        let _ = worker.kill().await;
    }
    futures::future::join_all(serves.into_iter().map(ServeProcess::stop)).await;
    let driven = driven?;
    Ok(Row {
        serves: count,
        runs: driven.runs,
        succeeded: driven.succeeded,
        seconds: driven.seconds,
        runs_per_s: driven.runs as f64 / driven.seconds,
        ready_s,
        totals: totals?,
        connections: connections?,
        load_before,
        load_after: load_average(),
    })
}

/// Waits until the group has `members` members and is stable: every
/// partition assigned, the rebalance over.
async fn group_stable(config: &Config, members: usize) -> anyhow::Result<()> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let group = config.kafka.group_id.clone();
    let observer: BaseConsumer = ductor::infra::kafka::offsets_reader_config(
        &config.kafka,
        &format!("{group}-observer"),
        "scale",
    )
    .create()
    .context("creating a client to watch the group")?;
    let deadline = Instant::now() + STABLE_WITHIN;
    let observer = std::sync::Arc::new(observer);
    loop {
        let (observer, group) = (observer.clone(), group.clone());
        let state = tokio::task::spawn_blocking(move || {
            let list = observer.fetch_group_list(Some(&group), Duration::from_secs(5))?;
            Ok::<_, rdkafka::error::KafkaError>(
                list.groups()
                    .first()
                    .map(|g| (g.state().to_string(), g.members().len())),
            )
        })
        .await?
        .context("describing the group")?;
        if let Some((s, n)) = &state
            && s == "Stable"
            && *n == members
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the group was not stable with {members} members within {} s (last seen: {state:?})",
            STABLE_WITHIN.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The sessions on the measurement's database but this one.
async fn connections(config: &Config) -> anyhow::Result<i64> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(config.database.migrate_url().expose())
        .await
        .context("connecting to count the sessions")?;
    let count = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_one(&pool)
    .await
    .context("counting the sessions");
    pool.close().await;
    count
}

/// An example worker on the measurement's configuration, its log in the
/// measurement's directory.
fn spawn_worker(
    corner: &Corner,
    programs: &Programs,
    args: &ScaleArgs,
    index: usize,
) -> anyhow::Result<tokio::process::Child> {
    let log_path = corner.dir.join(format!("worker-{index}.log"));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    on_config_file(&programs.worker, &corner.config_file)
        .args(["--fail-rate", &args.fail_rate.to_string()])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("starting an example worker")
}

/// What the driver reports in its last line.
#[derive(Debug, Deserialize)]
struct Driven {
    runs: usize,
    succeeded: usize,
    seconds: f64,
}

/// Submits the runs through the demo's driver and follows them; its
/// progress goes to this program's stderr.
async fn drive(corner: &Corner, programs: &Programs, args: &ScaleArgs) -> anyhow::Result<Driven> {
    let output = on_config_file(&programs.driver, &corner.config_file)
        .args(["--runs", &args.runs.to_string()])
        .args(["--timeout-s", &args.timeout_s.to_string()])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await
        .context("running the demo driver")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    anyhow::ensure!(
        output.status.success(),
        "not every run finished within {} s ({}): {last}",
        args.timeout_s,
        output.status
    );
    serde_json::from_str(last).with_context(|| format!("reading the driver's summary {last:?}"))
}

/// Counters summed over the serves of a measurement.
#[derive(Debug, Default, Clone, Serialize)]
struct Totals {
    applied: f64,
    deduplicated: f64,
    stale: f64,
    forwarded: f64,
    dead_lettered: f64,
    conflicts: f64,
    batches: f64,
    /// Inputs per apply transaction, on average.
    mean_batch: f64,
}

impl Totals {
    async fn scrape(serves: &[ServeProcess]) -> anyhow::Result<Totals> {
        use ductor_testkit::metrics::sum;
        let mut totals = Totals::default();
        let mut batch_inputs = 0.0;
        for serve in serves {
            let (status, body) = ductor_testkit::http::request(
                serve.admin_addr,
                "GET",
                "/metrics",
                &[],
                b"",
                Duration::from_secs(10),
            )
            .await?;
            anyhow::ensure!(status == 200, "GET /metrics answered {status}");
            let text = String::from_utf8_lossy(&body);
            let inputs = |outcome: &str| {
                let label = format!("outcome=\"{outcome}\"");
                sum(&text, "ductor_inputs_total", &label)
            };
            totals.applied += inputs("applied");
            totals.deduplicated += inputs("deduplicated");
            totals.stale += inputs("stale");
            totals.forwarded += inputs("forwarded");
            totals.dead_lettered += inputs("dead_lettered");
            totals.conflicts += sum(&text, "ductor_apply_conflicts_total", "");
            totals.batches += sum(&text, "ductor_apply_batch_size_count", "");
            batch_inputs += sum(&text, "ductor_apply_batch_size_sum", "");
        }
        totals.mean_batch = batch_inputs / totals.batches.max(1.0);
        Ok(totals)
    }
}

/// One measurement's figures.
#[derive(Debug, Clone, Serialize)]
struct Row {
    serves: usize,
    runs: usize,
    succeeded: usize,
    seconds: f64,
    runs_per_s: f64,
    /// From the serves' start to every one ready and the group stable.
    ready_s: f64,
    #[serde(flatten)]
    totals: Totals,
    /// Sessions on the measurement's database once the runs finished
    /// (the driver has ended, the workers use none): the serves' pools at
    /// the size this load grew them to.
    connections: i64,
    /// The 1-minute load average before and after (other work on the
    /// machine shows here).
    load_before: Option<f64>,
    load_after: Option<f64>,
}

impl Row {
    fn line(&self) -> String {
        let load = |l: Option<f64>| l.map_or("-".to_string(), |l| format!("{l:.2}"));
        format!(
            "{:>6} {:>6} {:>9} {:>8.1} {:>7.1} {:>9} {:>9} {:>9} {:>6.1} {:>7.1} {:>5} {:>11}",
            self.serves,
            self.runs,
            self.succeeded,
            self.seconds,
            self.runs_per_s,
            self.totals.applied,
            self.totals.conflicts,
            self.totals.forwarded,
            self.totals.mean_batch,
            self.ready_s,
            self.connections,
            format!("{}/{}", load(self.load_before), load(self.load_after)),
        )
    }
}

const HEADER: &str = "serves   runs succeeded  seconds  runs/s   applied conflicts forwarded  batch ready_s  conn    load b/a";

/// Each count's median against the first count's.
#[derive(Debug, Serialize)]
struct Ratio {
    serves: usize,
    /// Median runs/s of the count.
    runs_per_s: f64,
    /// That median over the first count's.
    runs_per_s_ratio: f64,
    /// Conflicts (median) less the first count's.
    conflicts_over: f64,
    /// Forwarded inputs (median) less the first count's.
    forwarded_over: f64,
    /// Seconds to a ready, stable group (median) over the first count's.
    ready_ratio: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    runs: usize,
    partitions: i32,
    workers: usize,
    fail_rate: f64,
    rounds: usize,
    measurements: Vec<Row>,
    ratios: Vec<Ratio>,
}

impl Report {
    fn new(args: &ScaleArgs, rows: Vec<Row>) -> Report {
        let medians: Vec<(usize, [f64; 4])> = args
            .serves
            .iter()
            .map(|&n| {
                let of = |f: fn(&Row) -> f64| {
                    median(rows.iter().filter(|r| r.serves == n).map(f).collect())
                };
                let figures = [
                    of(|r| r.runs_per_s),
                    of(|r| r.totals.conflicts),
                    of(|r| r.totals.forwarded),
                    of(|r| r.ready_s),
                ];
                (n, figures)
            })
            .collect();
        let first = medians.first().map_or([f64::NAN; 4], |m| m.1);
        let ratios = medians
            .iter()
            .map(|&(serves, [rate, conflicts, forwarded, ready])| Ratio {
                serves,
                runs_per_s: rate,
                runs_per_s_ratio: rate / first[0],
                conflicts_over: conflicts - first[1],
                forwarded_over: forwarded - first[2],
                ready_ratio: ready / first[3],
            })
            .collect();
        Report {
            runs: args.runs,
            partitions: args.partitions,
            workers: args.workers,
            fail_rate: args.fail_rate,
            rounds: args.rounds,
            measurements: rows,
            ratios,
        }
    }

    fn table(&self) -> String {
        let mut out = format!(
            "\n{} runs of \"order\" per measurement, {} partitions per topic, {} worker processes\n{HEADER}\n",
            self.runs, self.partitions, self.workers
        );
        for row in &self.measurements {
            out.push_str(&row.line());
            out.push('\n');
        }
        let first = self.ratios.first().map_or(0, |r| r.serves);
        for r in &self.ratios {
            out.push_str(&format!(
                "{} serve(s) against {first}: runs/s x{:.2} ({:.1}), conflicts {:+}, forwarded {:+}, time to a stable group x{:.2}\n",
                r.serves, r.runs_per_s_ratio, r.runs_per_s, r.conflicts_over, r.forwarded_over, r.ready_ratio
            ));
        }
        out
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The 1-minute load average, where the system tells it.
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_value_or_the_mean_of_the_two() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn the_workflow_keeps_its_steps_and_writes_to_the_given_topic() {
        let text = order_workflow("scale-x.outputs").unwrap();
        let workflow: toml::Table = toml::from_str(&text).unwrap();
        assert_eq!(workflow["output_topic"].as_str(), Some("scale-x.outputs"));
        assert_eq!(workflow["name"].as_str(), Some("order"));
        assert_eq!(workflow["steps"].as_array().map(Vec::len), Some(5));
    }
}
