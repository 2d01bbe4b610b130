//! `ductor-bench`: how fast the whole pipeline is, against the limits of the
//! machine it runs on, measured in one run on the same Kafka and Postgres.
//!
//! Phases, in order (each bounded by a deadline and a stall detector):
//!
//! 1. **capacity** (synchronous commit on, the headline): `serve::run` and an
//!    in-process echo worker; after a warm-up, a backlog of `--runs` runs of
//!    a three-step workflow is produced at once and applied. The window runs
//!    from the first applied input of the backlog to its last finished run
//!    (database timestamps), so consumer-group joins are not counted.
//! 2. **latency**: open-loop start requests at 25, 50, 75 and 90 % of the
//!    measured capacity in runs/s, `--duration-s` each; latency from the
//!    request's *intended* send time to the arrival of its `run.started`
//!    event (no coordinated omission), in an HdrHistogram. Then **idle**
//!    (see [`idle`]): `--idle-runs` runs one at a time, each from its start
//!    request to its `run.succeeded` event. Then **B3**, the hop floor (see
//!    [`floor`]), started beside Ductor and alternated with it, three
//!    rounds: latency at 25 and 50 % of Ductor's capacity and one run at a
//!    time, the ratios' medians and spreads reported.
//! 3. **B1a / B1b**: Ductor's SQL footprint per input (see [`footprint`]),
//!    one input per transaction and `k` per transaction, best client count.
//!    **B1-lean**: the Postgres work of a minimal exactly-once orchestrator
//!    per input, in tables of its own (see [`lean`]), 1, 2 and 4 clients.
//! 4. **B2**: the same Kafka traffic with Postgres taken out (see
//!    [`passthrough`]).
//! 5. **capacity** again with `synchronous_commit = off` on the database.
//!
//! L = 1 / (1/B1b + 1/B2) inputs/s is the machine's limit for this work, since
//! Kafka and Postgres share the cores. It is computed from Ductor's own SQL
//! footprint, so a heavier footprint makes it smaller; L_lean =
//! 1 / (1/B1-lean + 1/B2) does not move with Ductor's schema, and
//! capacity / L_lean says how close Ductor comes to a lean design. The report is a table on stdout
//! followed by one JSON line, the last line of stdout; progress goes to
//! stderr. Every run uses its own database and topics and removes them.
//!
//! [`scale`] is the library of the package's other binary, `ductor-scale`:
//! the same runs on one, two, three ... serve processes of one group.

pub mod env;
pub mod floor;
pub mod footprint;
pub mod idle;
pub mod lean;
pub mod outside;
pub mod passthrough;
pub mod pipeline;
pub mod scale;
pub mod stats;
pub mod views;

use anyhow::Context as _;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use ductor::config::Config;
use env::{BenchEnv, INPUTS_PER_RUN, STEPS};
use footprint::Point;
use idle::Idle;
use passthrough::Passthrough;
use pipeline::{Capacity, Latency, Pipeline};
use stats::Progress;

/// `ductor-bench` options.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Runs in each capacity backlog (and in the Kafka-only baseline).
    #[arg(long, default_value_t = 2000)]
    pub runs: usize,
    /// Seconds of open-loop load at each latency rate.
    #[arg(long = "duration-s", default_value_t = 10.0)]
    pub duration_s: f64,
    /// A smoke run of a few seconds: small backlogs, short phases, a reduced
    /// baseline grid. Its figures are not meaningful as measurements.
    #[arg(long)]
    pub quick: bool,
    /// Only the latency phases, with RUNS_PER_S as 100 % instead of a
    /// measured capacity (for comparing settings quickly at a known rate).
    /// A capacity backlog still runs first, to fill the tables as in a full
    /// run; its figure is shown, not used. No baselines, no sync-off phase.
    /// Prints the latency rows and a JSON line of them and of the capacity
    /// backlog.
    #[arg(long = "latency-at", value_name = "RUNS_PER_S")]
    pub latency_at: Option<f64>,
    /// The loads of the latency phases, in percent of the reference rate.
    /// A full run must include 50 (its p99 is a headline ratio).
    #[arg(long = "loads", value_delimiter = ',', default_values_t = [25, 50, 75, 90])]
    pub loads: Vec<u32>,
    /// Runs of the idle phase, after the latency phases: one at a time,
    /// from its start request to its end (0: no idle phase).
    #[arg(long = "idle-runs", default_value_t = 200)]
    pub idle_runs: usize,
}

impl Default for BenchArgs {
    fn default() -> Self {
        BenchArgs {
            runs: 2000,
            duration_s: 10.0,
            quick: false,
            latency_at: None,
            loads: vec![25, 50, 75, 90],
            idle_runs: 200,
        }
    }
}

/// Everything the phases need to know, derived from the arguments.
#[derive(Debug, Clone)]
struct Plan {
    quick: bool,
    runs: usize,
    warmup_runs: usize,
    latency: Duration,
    load_pcts: Vec<u32>,
    idle_runs: usize,
    b1_point: Duration,
    b1a_clients: Vec<usize>,
    b1b_ks: Vec<usize>,
    b1b_clients: Vec<usize>,
    lean_clients: Vec<usize>,
    floor_rounds: usize,
    idle_cpu_window: Duration,
    worker_in_flight: usize,
}

impl Plan {
    fn from_args(args: &BenchArgs) -> anyhow::Result<Plan> {
        anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
        anyhow::ensure!(
            !args.loads.is_empty() && args.loads.iter().all(|&p| (1..=100).contains(&p)),
            "--loads must be percentages between 1 and 100"
        );
        anyhow::ensure!(
            args.latency_at.is_some() || args.loads.contains(&50),
            "--loads must include 50 unless --latency-at is given"
        );
        anyhow::ensure!(
            args.duration_s > 0.0 && args.duration_s <= 3600.0,
            "--duration-s must be in (0, 3600]"
        );
        Ok(if args.quick {
            Plan {
                quick: true,
                runs: args.runs.min(60),
                warmup_runs: 3,
                latency: Duration::from_secs_f64(args.duration_s.min(0.5)),
                load_pcts: args.loads.clone(),
                idle_runs: args.idle_runs.min(5),
                b1_point: Duration::from_millis(300),
                b1a_clients: vec![1, 4],
                b1b_ks: vec![64],
                b1b_clients: vec![2],
                lean_clients: vec![2],
                floor_rounds: 1,
                idle_cpu_window: Duration::from_secs(1),
                worker_in_flight: 256,
            }
        } else {
            Plan {
                quick: false,
                runs: args.runs,
                warmup_runs: 20,
                latency: Duration::from_secs_f64(args.duration_s),
                load_pcts: args.loads.clone(),
                idle_runs: args.idle_runs,
                b1_point: Duration::from_secs_f64((args.duration_s / 4.0).clamp(1.0, 3.0)),
                b1a_clients: vec![1, 2, 4, 8, 16],
                b1b_ks: vec![16, 64, 256, 512],
                b1b_clients: vec![1, 2, 4, 8],
                lean_clients: vec![1, 2, 4],
                floor_rounds: 3,
                idle_cpu_window: Duration::from_secs(30),
                worker_in_flight: 256,
            }
        })
    }
}

/// The best point of a baseline grid.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    pub inputs_per_s: f64,
    pub clients: usize,
    pub k: usize,
    pub grid: Vec<Point>,
}

impl Baseline {
    /// The grid point the baseline's figure comes from.
    fn best_point(&self) -> Option<&Point> {
        self.grid
            .iter()
            .find(|p| p.clients == self.clients && p.k == self.k)
    }
}

/// CPU at rest, over a window of `seconds`.
#[derive(Debug, Clone, Serialize)]
pub struct IdleCpu {
    pub seconds: f64,
    pub cores: stats::CpuCores,
}

/// The ratios the issue asks for.
#[derive(Debug, Clone, Serialize)]
pub struct Ratios {
    pub capacity_over_l: f64,
    /// Capacity against L_lean, the limit of a lean footprint.
    pub capacity_over_l_lean: f64,
    pub capacity_over_b1b: f64,
    pub capacity_over_b1a: f64,
    pub sync_on_over_off: f64,
    pub p99_ms_at_50pct: f64,
    /// CPU time per input applied, µs, at capacity and at 50 % load.
    pub cpu_us_per_input: CpuPerInput,
    /// Latency against the hop floor B3's, median of the rounds.
    #[serde(flatten)]
    pub floor: floor::FloorRatios,
}

/// CPU time per input, µs, by process group: `ductor` is the bench's own
/// process (the pipeline, the echo worker and the load's clients).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuUs {
    pub ductor: f64,
    pub postgres: f64,
    pub kafka: f64,
    pub total: f64,
}

impl CpuUs {
    /// CPU per input from the cores used while `inputs_per_s` were applied.
    fn of(cores: &stats::CpuCores, inputs_per_s: f64) -> CpuUs {
        if inputs_per_s <= 0.0 {
            return CpuUs::default();
        }
        let us = |c: f64| 1e6 * c / inputs_per_s;
        CpuUs {
            ductor: us(cores.ductor),
            postgres: us(cores.postgres),
            kafka: us(cores.kafka),
            total: us(cores.ductor + cores.postgres + cores.kafka),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuPerInput {
    pub at_capacity: CpuUs,
    pub at_50pct: CpuUs,
}

/// Every figure of one bench run. Numbers outside `profile` objects are
/// positive in any successful run; `profile` holds diagnostics that may be 0.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub quick: bool,
    pub steps_per_run: u32,
    pub inputs_per_run: u32,
    /// Synchronous commit on: the headline.
    pub capacity: Capacity,
    pub capacity_sync_off: Capacity,
    pub latency: Vec<Latency>,
    /// One run at a time, start to end (absent with `--idle-runs 0`).
    pub idle: Option<Idle>,
    /// Ductor and the hop floor B3, alternated round by round.
    pub vs_floor: floor::VsFloor,
    /// Each process's share of a core with Ductor's pipeline running and
    /// no load (`ductor` is the bench process: serve's pipeline and the
    /// echo worker).
    pub idle_cpu: IdleCpu,
    pub b1a: Baseline,
    pub b1b: Baseline,
    /// The lean footprint, in tables of its own.
    pub b1_lean: Baseline,
    pub b2: Passthrough,
    /// L = 1 / (1/B1b + 1/B2), inputs/s.
    pub limit_inputs_per_s: f64,
    /// L_lean = 1 / (1/B1-lean + 1/B2), inputs/s.
    pub limit_lean_inputs_per_s: f64,
    pub ratios: Ratios,
    /// The bench process's peak resident set size, in MiB: the serve's
    /// pipeline (ingress, apply, drainer) with the bench's clients and echo
    /// worker, at the heaviest phase.
    pub peak_rss_mb: f64,
    pub profile: ReportProfile,
}

/// Processes outside the bench (compilers, other test suites) and, on a
/// virtual machine, the hypervisor's other guests competing for the cores:
/// cores taken from the bench during each phase (other processes' CPU plus
/// steal). Above a few tenths, the phases were not measured under the same
/// conditions.
#[derive(Debug, Clone, Serialize)]
pub struct ReportProfile {
    pub other_cores: BTreeMap<String, f64>,
}

/// Other processes' load above which the table warns.
const CONTENTION_WARN_CORES: f64 = 0.25;

impl Report {
    /// The report as one line of JSON.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The table for people.
    pub fn table(&self) -> String {
        let mut t = String::new();
        self.write_title(&mut t);
        self.write_throughput(&mut t);
        self.write_baselines(&mut t);
        let _ = writeln!(t);
        t.push_str(&latency_table(&self.latency));
        t.push_str(&idle_line(self.idle.as_ref()));
        self.write_floor(&mut t);
        self.write_contention(&mut t);
        self.write_ratios(&mut t);
        self.write_capacity_profiles(&mut t);
        self.write_baseline_profiles(&mut t);
        self.write_b2_profile(&mut t);
        t
    }

    /// What was run, and whether the figures are measurements at all.
    fn write_title(&self, t: &mut String) {
        let _ = writeln!(
            t,
            "ductor-bench: {} runs of a {STEPS}-step workflow ({INPUTS_PER_RUN} inputs per run){}",
            self.capacity.runs,
            if self.quick {
                " -- QUICK smoke run, not a measurement"
            } else {
                ""
            }
        );
        let _ = writeln!(t);
    }

    /// The throughput columns and the pipeline's capacity with either
    /// synchronous commit setting.
    fn write_throughput(&self, t: &mut String) {
        let _ = writeln!(
            t,
            "{:<34} {:>12} {:>12} {:>10}",
            "", "inputs/s", "runs/s", "seconds"
        );
        for (name, cap) in [
            ("capacity, synchronous_commit on", &self.capacity),
            ("capacity, synchronous_commit off", &self.capacity_sync_off),
        ] {
            let _ = writeln!(
                t,
                "{name:<34} {:>12.0} {:>12.1} {:>10.2}",
                cap.inputs_per_s, cap.runs_per_s, cap.seconds
            );
        }
    }

    /// The machine's baselines, the limit they set, and the memory used.
    fn write_baselines(&self, t: &mut String) {
        let _ = writeln!(
            t,
            "{:<34} {:>12.0} {:>12} {:>10}",
            format!("B1a SQL, 1 input/tx, {} clients", self.b1a.clients),
            self.b1a.inputs_per_s,
            "",
            ""
        );
        let _ = writeln!(
            t,
            "{:<34} {:>12.0}",
            format!(
                "B1b SQL, {} inputs/tx, {} clients",
                self.b1b.k, self.b1b.clients
            ),
            self.b1b.inputs_per_s
        );
        let _ = writeln!(
            t,
            "{:<34} {:>12.0}",
            format!(
                "B1-lean, {} inputs/tx, {} clients",
                self.b1_lean.k, self.b1_lean.clients
            ),
            self.b1_lean.inputs_per_s
        );
        let _ = writeln!(
            t,
            "{:<34} {:>12.0} {:>12.1} {:>10.2}",
            "B2 Kafka passthrough", self.b2.inputs_per_s, self.b2.runs_per_s, self.b2.seconds
        );
        let _ = writeln!(
            t,
            "{:<34} {:>12.0}",
            "L = 1/(1/B1b + 1/B2)", self.limit_inputs_per_s
        );
        let _ = writeln!(
            t,
            "{:<34} {:>12.0}",
            "L_lean = 1/(1/B1-lean + 1/B2)", self.limit_lean_inputs_per_s
        );
        let _ = writeln!(t, "{:<34} {:>12.1}", "peak RSS, MiB", self.peak_rss_mb);
        let c = &self.idle_cpu.cores;
        let _ = writeln!(
            t,
            "idle CPU over {:.0} s, % of a core: ductor {:.1}, postgres {:.1}, kafka {:.1}",
            self.idle_cpu.seconds,
            100.0 * c.ductor,
            100.0 * c.postgres,
            100.0 * c.kafka
        );
    }

    /// The floor's figures of each round beside Ductor's, and the ratios.
    fn write_floor(&self, t: &mut String) {
        let _ = writeln!(t);
        for (i, round) in self.vs_floor.rounds.iter().enumerate() {
            for (name, latency, idle) in [
                ("Ductor", &round.ductor, &round.ductor_idle),
                ("B3 floor", &round.floor, &round.floor_idle),
            ] {
                let points: Vec<String> = latency
                    .iter()
                    .map(|l| format!("{}% p50 {:.1} p99 {:.1}", l.load_pct, l.p50_ms, l.p99_ms))
                    .collect();
                let idle = idle
                    .as_ref()
                    .map_or(String::new(), |i| format!(", idle p50 {:.1}", i.p50_ms));
                let _ = writeln!(
                    t,
                    "round {} {name:<8} ms: {}{idle}",
                    i + 1,
                    points.join(", ")
                );
            }
        }
        let f = &self.ratios.floor;
        let spread = |s: &floor::Spread| format!("{:.2} ({:.2}-{:.2})", s.median, s.min, s.max);
        let _ = writeln!(
            t,
            "over the floor (median, spread): 25% p50 {} p99 {}; 50% p50 {} p99 {}; idle p50 {}",
            spread(&f.p50_over_floor_at_25pct),
            spread(&f.p99_over_floor_at_25pct),
            spread(&f.p50_over_floor_at_50pct),
            spread(&f.p99_over_floor_at_50pct),
            spread(&f.idle_p50_over_floor)
        );
    }

    /// A warning naming the phases that other processes disturbed, if any.
    fn write_contention(&self, t: &mut String) {
        let contended: Vec<String> = self
            .profile
            .other_cores
            .iter()
            .filter(|(_, cores)| **cores > CONTENTION_WARN_CORES)
            .map(|(phase, cores)| format!("{phase} {cores:.2}"))
            .collect();
        if !contended.is_empty() {
            let _ = writeln!(t);
            let _ = writeln!(
                t,
                "WARNING: other processes or the hypervisor took CPU during: {} cores; those figures are not comparable",
                contended.join(", ")
            );
        }
    }

    /// The headline ratios.
    fn write_ratios(&self, t: &mut String) {
        let r = &self.ratios;
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "capacity/L {:.2}   capacity/L_lean {:.2}   capacity/B1b {:.2}   capacity/B1a {:.2}   sync on/off {:.2}   p99 at 50% {:.1} ms",
            r.capacity_over_l,
            r.capacity_over_l_lean,
            r.capacity_over_b1b,
            r.capacity_over_b1a,
            r.sync_on_over_off,
            r.p99_ms_at_50pct
        );
        for (name, c) in [
            ("at capacity", &r.cpu_us_per_input.at_capacity),
            ("at 50%", &r.cpu_us_per_input.at_50pct),
        ] {
            let _ = writeln!(
                t,
                "CPU per input {name}: {:.0} us (ductor {:.0}, postgres {:.0}, kafka {:.0})",
                c.total, c.ductor, c.postgres, c.kafka
            );
        }
        let _ = writeln!(t);
    }

    /// Where the time of each capacity window went.
    fn write_capacity_profiles(&self, t: &mut String) {
        for (name, cap) in [
            ("sync on ", &self.capacity),
            ("sync off", &self.capacity_sync_off),
        ] {
            let p = &cap.profile;
            let pg = &p.postgres_per_input;
            let _ = writeln!(
                t,
                "profile {name}: {:.0} tx x {:.1} inputs, apply {:.1} ms avg ({:.0}% of the window), publish ack {:.1} ms; \
                 per input: {:.2} commits, {:.3} WAL fsyncs, {:.0} WAL bytes, {:.1} WAL records; \
                 cores: {}; {:.2} msgs/input",
                p.batches,
                p.inputs_per_batch,
                p.apply_ms_avg,
                p.apply_busy_pct,
                p.publish_ms_avg,
                pg.commits,
                pg.wal_syncs,
                pg.wal_bytes,
                pg.wal_records,
                cores_text(&p.cpu_cores),
                cap.msgs_per_input
            );
        }
    }

    /// The statements' times and the cores at the best point of each SQL
    /// baseline.
    fn write_baseline_profiles(&self, t: &mut String) {
        for (name, b, names) in [
            ("B1a", &self.b1a, &footprint::STATEMENTS[..]),
            ("B1b", &self.b1b, &footprint::STATEMENTS[..]),
            ("B1-lean", &self.b1_lean, &lean::STATEMENTS[..]),
        ] {
            if let Some(best) = b.best_point() {
                let statements: Vec<String> = names
                    .iter()
                    .filter_map(|s| {
                        best.profile
                            .statement_ms
                            .get(s)
                            .map(|ms| format!("{s} {ms:.2}"))
                    })
                    .collect();
                let cpu = &best.profile.cpu_cores;
                let _ = writeln!(
                    t,
                    "profile {name} best: ms per transaction: {}; cores: client {:.2}, postgres {:.2}, other {:.2}, steal {:.2}",
                    statements.join(", "),
                    cpu.ductor,
                    cpu.postgres,
                    cpu.other,
                    cpu.steal
                );
            }
        }
    }

    /// The cores and the message count of the Kafka-only baseline.
    fn write_b2_profile(&self, t: &mut String) {
        let _ = writeln!(
            t,
            "profile B2: cores: {}; {:.2} msgs/input",
            cores_text(&self.b2.profile.cpu_cores),
            self.b2.msgs_per_input
        );
    }
}

/// Cores per process group, as every profile line shows them.
fn cores_text(c: &stats::CpuCores) -> String {
    format!(
        "ductor {:.2}, postgres {:.2}, kafka {:.2}, other {:.2}, steal {:.2}",
        c.ductor, c.postgres, c.kafka, c.other, c.steal
    )
}

/// The latency rows and their profile lines.
fn latency_table(latency: &[Latency]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "load", "runs/s", "inputs/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms"
    );
    for l in latency {
        let _ = writeln!(
            t,
            "{:<10} {:>10.1} {:>10.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            format!("{}%", l.load_pct),
            l.runs_per_s,
            l.inputs_per_s,
            l.p50_ms,
            l.p99_ms,
            l.p999_ms,
            l.max_ms
        );
    }
    for l in latency {
        let p = &l.profile;
        let _ = writeln!(
            t,
            "profile latency {}%: request -> fold p50 {:.1} / p99 {:.1} ms, fold -> event consumed p50 {:.1} / p99 {:.1} ms \
                 (fold -> event produced p50 {:.1} / p99 {:.1}, produced -> consumed p50 {:.1} / p99 {:.1})",
            l.load_pct,
            p.to_fold_p50_ms,
            p.to_fold_p99_ms,
            p.fold_to_event_p50_ms,
            p.fold_to_event_p99_ms,
            p.fold_to_produce_p50_ms,
            p.fold_to_produce_p99_ms,
            p.produce_to_consume_p50_ms,
            p.produce_to_consume_p99_ms
        );
        let _ = writeln!(
            t,
            "    means: input age at fetch {:.1} ms, at apply {:.1} ms; apply {:.1} ms for {:.1} inputs; publish ack {:.1} ms; \
             cores: {}",
            p.fetch_age_ms_avg,
            p.apply_age_ms_avg,
            p.apply_ms_avg,
            p.inputs_per_batch,
            p.publish_ms_avg,
            cores_text(&p.cpu_cores)
        );
        let phases: Vec<String> = pipeline::APPLY_PHASES
            .iter()
            .filter_map(|phase| {
                p.apply_phase_ms_avg
                    .get(*phase)
                    .map(|ms| format!("{phase} {ms:.1}"))
            })
            .collect();
        let _ = writeln!(t, "    apply phases, mean ms: {}", phases.join(", "));
    }
    t
}

/// The CLI entry point: runs the bench until done or SIGINT/SIGTERM, prints
/// the table and then the JSON line on stdout.
pub async fn main(args: BenchArgs, config: Config) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    ductor::cli::serve::cancel_on_signals(shutdown.clone())?;
    if let Some(rate) = args.latency_at {
        let (capacity, latency, idle) = run_latency_only(&args, &config, rate, &shutdown).await?;
        print!("{}", latency_table(&latency));
        print!("{}", idle_line(idle.as_ref()));
        println!(
            "{}",
            serde_json::json!({
                "reference_runs_per_s": rate,
                "capacity": capacity,
                "latency": latency,
                "idle": idle,
                "peak_rss_mb": peak_rss_mb(),
            })
        );
        return Ok(());
    }
    let report = run(&args, &config, &shutdown).await?;
    print!("{}", report.table());
    println!("{}", report.json_line());
    Ok(())
}

/// The latency phases alone, at percentages of `rate` runs/s, and the
/// idle phase; with the capacity backlog that ran first (not used as the
/// reference, but a figure to compare builds by).
pub async fn run_latency_only(
    args: &BenchArgs,
    config: &Config,
    rate: f64,
    shutdown: &CancellationToken,
) -> anyhow::Result<(Capacity, Vec<Latency>, Option<Idle>)> {
    anyhow::ensure!(
        rate.is_finite() && rate > 0.0,
        "--latency-at must be a positive number of runs/s"
    );
    let plan = Plan::from_args(args)?;
    in_own_env(config, shutdown, async |env, progress| {
        let on = sync_on_phases(env, &plan, Some(rate), false, shutdown, progress).await?;
        Ok((on.capacity, on.latency, on.idle))
    })
    .await
}

/// Runs every phase against the stack `config` points at, in a database and
/// topics of its own that are removed at the end, whatever happened.
pub async fn run(
    args: &BenchArgs,
    config: &Config,
    shutdown: &CancellationToken,
) -> anyhow::Result<Report> {
    let plan = Plan::from_args(args)?;
    in_own_env(config, shutdown, async |env, progress| {
        phases(env, &plan, shutdown, progress).await
    })
    .await
}

/// Runs `body` in a bench database and topics of its own, removed at the
/// end whatever happened; SIGINT/SIGTERM (`shutdown`) interrupts it.
async fn in_own_env<T>(
    config: &Config,
    shutdown: &CancellationToken,
    body: impl AsyncFnOnce(&BenchEnv, &mut Progress) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let mut progress = Progress::default();
    let env = BenchEnv::create(config).await?;
    progress.done(&format!(
        "bench database {} and topics bench-{}-*",
        env.db_name, env.tag
    ));
    let result = tokio::select! {
        r = body(&env, &mut progress) => r,
        _ = shutdown.cancelled() => Err(anyhow::anyhow!("bench interrupted")),
    };
    // Give cancelled pipelines a moment to let go of their connections.
    if result.is_err() {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let cleanup = env.cleanup().await;
    match (result, cleanup) {
        (Ok(value), Ok(())) => Ok(value),
        (Ok(_), Err(e)) => Err(e),
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(c)) => Err(e.context(format!("and then {c:#}"))),
    }
}

/// What the phases with synchronous commit on measured.
struct SyncOn {
    capacity: Capacity,
    latency: Vec<Latency>,
    idle: Option<Idle>,
    vs_floor: Option<floor::VsFloor>,
    idle_cpu: IdleCpu,
}

/// Capacity, latency and idle with synchronous commit on. The latency rates
/// are percentages of `reference` runs/s, or of the measured capacity.
/// With `with_floor`, the hop floor is then alternated with Ductor.
async fn sync_on_phases(
    env: &BenchEnv,
    plan: &Plan,
    reference: Option<f64>,
    with_floor: bool,
    shutdown: &CancellationToken,
    progress: &mut Progress,
) -> anyhow::Result<SyncOn> {
    let (mut on, capacity) = capacity_phase(env, plan, true, shutdown, progress).await?;
    progress.done(&format!(
        "capacity (synchronous_commit on{}): {:.0} inputs/s, {:.1} runs/s",
        if reference.is_some() {
            ", not used"
        } else {
            ""
        },
        capacity.inputs_per_s,
        capacity.runs_per_s
    ));
    env.analyze().await?;
    let reference = reference.unwrap_or(capacity.runs_per_s);
    let loads = pipeline::Loads {
        reference_runs_per_s: reference,
        pcts: &plan.load_pcts,
        duration: plan.latency,
        round: 0,
    };
    let latency = pipeline::latency(env, &mut on, &loads, shutdown, progress).await?;
    let idle = idle_phase(&on, plan.idle_runs, progress).await?;
    let vs_floor = if with_floor {
        let compare = floor::Compare {
            capacity_runs_per_s: reference,
            rounds: plan.floor_rounds,
            duration: plan.latency,
            idle_runs: plan.idle_runs,
            worker_in_flight: plan.worker_in_flight,
        };
        Some(floor::compare(env, &mut on, &compare, shutdown, progress).await?)
    } else {
        None
    };
    let idle_cpu = idle_cpu(env, plan.idle_cpu_window).await;
    on.stop().await?;
    Ok(SyncOn {
        capacity,
        latency,
        idle,
        vs_floor,
        idle_cpu,
    })
}

/// Each process's CPU over `window` with the pipeline running and nothing
/// sent to it.
async fn idle_cpu(env: &BenchEnv, window: Duration) -> IdleCpu {
    let before = stats::CpuTicks::sample(&env.cpu);
    tokio::time::sleep(window).await;
    IdleCpu {
        seconds: window.as_secs_f64(),
        cores: before.cores_until(&stats::CpuTicks::sample(&env.cpu)),
    }
}

/// The idle phase on the running pipeline, unless it has no runs.
async fn idle_phase(
    on: &Pipeline,
    runs: usize,
    progress: &mut Progress,
) -> anyhow::Result<Option<Idle>> {
    if runs == 0 {
        return Ok(None);
    }
    let idle = idle::idle(on, runs, 0, progress).await?;
    progress.done(&format!(
        "idle, one run at a time ({runs} runs): p50 {:.1} ms, p99 {:.1} ms",
        idle.p50_ms, idle.p99_ms
    ));
    Ok(Some(idle))
}

/// The idle phase's row of the table (nothing without one).
fn idle_line(idle: Option<&Idle>) -> String {
    idle.map_or_else(String::new, |i| {
        format!(
            "idle (one run at a time, start to end, {} runs): p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms\n",
            i.runs, i.p50_ms, i.p90_ms, i.p99_ms, i.max_ms
        )
    })
}

/// Sets synchronous commit on the database, starts a pipeline that sees
/// it, and measures its capacity; the pipeline is left running for the
/// phases that follow.
async fn capacity_phase(
    env: &BenchEnv,
    plan: &Plan,
    synchronous_commit: bool,
    shutdown: &CancellationToken,
    progress: &mut Progress,
) -> anyhow::Result<(Pipeline, Capacity)> {
    let name = if synchronous_commit { "on" } else { "off" };
    let sync = env.set_synchronous_commit(synchronous_commit).await?;
    let mut pipeline = Pipeline::start(env, name, plan.worker_in_flight, shutdown).await?;
    let capacity = pipeline::capacity(
        env,
        &mut pipeline,
        name,
        sync,
        plan.runs,
        plan.warmup_runs,
        progress,
    )
    .await?;
    Ok((pipeline, capacity))
}

/// Every phase's figures, before the ratios between them.
struct Measured {
    capacity: Capacity,
    capacity_sync_off: Capacity,
    latency: Vec<Latency>,
    idle: Option<Idle>,
    vs_floor: floor::VsFloor,
    idle_cpu: IdleCpu,
    b1a: Baseline,
    b1b: Baseline,
    b1_lean: Baseline,
    b2: Passthrough,
}

async fn phases(
    env: &BenchEnv,
    plan: &Plan,
    shutdown: &CancellationToken,
    progress: &mut Progress,
) -> anyhow::Result<Report> {
    // 1 and 2: capacity and latency with synchronous commit on.
    let SyncOn {
        capacity,
        latency,
        idle,
        vs_floor,
        idle_cpu,
    } = sync_on_phases(env, plan, None, true, shutdown, progress).await?;
    let vs_floor = vs_floor.context("the floor was compared")?;

    // 3: the SQL footprint alone.
    let (b1a, b1b) = sql_baselines(env, plan, progress).await?;
    let b1_lean = baseline(lean::grid(env, &plan.lean_clients, plan.b1_point, progress).await?)?;

    // 4: the Kafka traffic alone.
    let b2 = passthrough::run(
        env,
        plan.runs,
        plan.warmup_runs,
        plan.worker_in_flight,
        shutdown,
        progress,
    )
    .await?;
    progress.done(&format!(
        "B2 Kafka passthrough: {:.0} inputs/s",
        b2.inputs_per_s
    ));

    // 5: capacity with synchronous commit off.
    let capacity_sync_off = sync_off_capacity(env, plan, shutdown, progress).await?;

    Ok(Report::new(
        plan.quick,
        Measured {
            capacity,
            capacity_sync_off,
            latency,
            idle,
            vs_floor,
            idle_cpu,
            b1a,
            b1b,
            b1_lean,
            b2,
        },
    ))
}

/// B1a (one input per transaction) and B1b (`k` per transaction), each the
/// best point of its grid.
async fn sql_baselines(
    env: &BenchEnv,
    plan: &Plan,
    progress: &mut Progress,
) -> anyhow::Result<(Baseline, Baseline)> {
    let b1a_grid =
        footprint::grid(env, &plan.b1a_clients, &[1], plan.b1_point, "B1a", progress).await?;
    let b1b_grid = footprint::grid(
        env,
        &plan.b1b_clients,
        &plan.b1b_ks,
        plan.b1_point,
        "B1b",
        progress,
    )
    .await?;
    Ok((baseline(b1a_grid)?, baseline(b1b_grid)?))
}

/// Capacity again on emptied tables, with synchronous commit off.
async fn sync_off_capacity(
    env: &BenchEnv,
    plan: &Plan,
    shutdown: &CancellationToken,
    progress: &mut Progress,
) -> anyhow::Result<Capacity> {
    env.truncate().await?;
    let (off, capacity) = capacity_phase(env, plan, false, shutdown, progress).await?;
    off.stop().await?;
    progress.done(&format!(
        "capacity (synchronous_commit off): {:.0} inputs/s, {:.1} runs/s",
        capacity.inputs_per_s, capacity.runs_per_s
    ));
    Ok(capacity)
}

impl Report {
    /// The report of a full run: the phases' figures, the machine's limit
    /// and the ratios against it, and how much other processes disturbed
    /// each phase.
    fn new(quick: bool, m: Measured) -> Report {
        let limit = 1.0 / (1.0 / m.b1b.inputs_per_s + 1.0 / m.b2.inputs_per_s);
        let limit_lean = 1.0 / (1.0 / m.b1_lean.inputs_per_s + 1.0 / m.b2.inputs_per_s);
        let ratios = m.ratios(limit, limit_lean);
        let other_cores = m.other_cores();
        Report {
            quick,
            steps_per_run: STEPS,
            inputs_per_run: INPUTS_PER_RUN,
            capacity: m.capacity,
            capacity_sync_off: m.capacity_sync_off,
            latency: m.latency,
            idle: m.idle,
            vs_floor: m.vs_floor,
            idle_cpu: m.idle_cpu,
            b1a: m.b1a,
            b1b: m.b1b,
            b1_lean: m.b1_lean,
            b2: m.b2,
            limit_inputs_per_s: limit,
            limit_lean_inputs_per_s: limit_lean,
            ratios,
            peak_rss_mb: peak_rss_mb(),
            profile: ReportProfile { other_cores },
        }
    }
}

impl Measured {
    /// The capacity against the limits `limit` and `limit_lean` inputs/s
    /// and each baseline, the p99 at half the capacity, and the CPU spent
    /// per input.
    fn ratios(&self, limit: f64, limit_lean: f64) -> Ratios {
        let capacity = self.capacity.inputs_per_s;
        let at_50 = self.latency.iter().find(|l| l.load_pct == 50);
        let p99_at_50 = at_50.map_or(0.0, |l| l.p99_ms);
        Ratios {
            capacity_over_l: capacity / limit,
            capacity_over_l_lean: capacity / limit_lean,
            capacity_over_b1b: capacity / self.b1b.inputs_per_s,
            capacity_over_b1a: capacity / self.b1a.inputs_per_s,
            sync_on_over_off: capacity / self.capacity_sync_off.inputs_per_s,
            p99_ms_at_50pct: p99_at_50,
            cpu_us_per_input: CpuPerInput {
                at_capacity: CpuUs::of(&self.capacity.profile.cpu_cores, capacity),
                at_50pct: at_50.map_or_else(CpuUs::default, |l| {
                    CpuUs::of(&l.profile.cpu_cores, l.inputs_per_s)
                }),
            },
            floor: self.vs_floor.ratios(),
        }
    }

    /// Cores other processes and the hypervisor took during each phase.
    fn other_cores(&self) -> BTreeMap<String, f64> {
        let best_cpu = |b: &Baseline| b.best_point().map_or(0.0, |p| taken(&p.profile.cpu_cores));
        let mut other_cores = BTreeMap::from([
            (
                "capacity".to_string(),
                taken(&self.capacity.profile.cpu_cores),
            ),
            (
                "capacity_sync_off".to_string(),
                taken(&self.capacity_sync_off.profile.cpu_cores),
            ),
            ("b1a".to_string(), best_cpu(&self.b1a)),
            ("b1b".to_string(), best_cpu(&self.b1b)),
            ("b1_lean".to_string(), best_cpu(&self.b1_lean)),
            ("b2".to_string(), taken(&self.b2.profile.cpu_cores)),
        ]);
        for l in &self.latency {
            other_cores.insert(
                format!("latency_{}", l.load_pct),
                taken(&l.profile.cpu_cores),
            );
        }
        other_cores
    }
}

/// This process's peak RSS in MiB (0 where the system does not say).
fn peak_rss_mb() -> f64 {
    ductor::infra::telemetry::peak_rss_bytes().map_or(0.0, |b| b as f64 / (1024.0 * 1024.0))
}

/// Cores taken from the bench by other processes and the hypervisor.
fn taken(cores: &stats::CpuCores) -> f64 {
    cores.other + cores.steal
}

fn baseline(grid: Vec<Point>) -> anyhow::Result<Baseline> {
    let best = footprint::best(&grid).ok_or_else(|| anyhow::anyhow!("empty baseline grid"))?;
    Ok(Baseline {
        inputs_per_s: best.inputs_per_s,
        clients: best.clients,
        k: best.k,
        grid,
    })
}
