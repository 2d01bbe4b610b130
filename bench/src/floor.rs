//! The hop floor, B3: the least a pipeline of Ductor's topology can take
//! per run, measured beside Ductor at the same offered rates.
//!
//! B3 is the Kafka passthrough of B2 (the same hops: start, dispatch,
//! result, ..., the end; the same messages, headers and client settings)
//! with one small Postgres transaction at each coordinator hop: one row
//! inserted and one updated per input, set-based per batch of inputs, in
//! tables of its own, committed with the database's `synchronous_commit`
//! (on in these phases) before the batch's effects are published, as
//! Ductor commits before its drainer publishes.
//!
//! [`compare`] alternates the floor and Ductor, round after round, at 25
//! and 50 % of Ductor's capacity (open loop, from intended send times,
//! the same histograms) and one run at a time, and reports each ratio's
//! median over the rounds with its spread.

use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::producer::FutureProducer;
use serde::Serialize;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio_util::sync::CancellationToken;

use super::env::BenchEnv;
use super::idle::{self, Idle};
use super::passthrough::{Hop, Relay};
use super::pipeline::{self, Latency, Pipeline, Target, produce_start_requests};
use super::stats::{Progress, Watchdog};
use ductor::config::Config;

/// The floor's tables: a run row and one row per hop.
const CREATE_SQL: &str = "
CREATE TABLE IF NOT EXISTS floor_runs (
    run_id text PRIMARY KEY,
    seq bigint NOT NULL
) WITH (fillfactor = 80);
CREATE TABLE IF NOT EXISTS floor_hops (
    run_id text NOT NULL,
    seq bigint NOT NULL,
    PRIMARY KEY (run_id, seq)
);";

/// One batch of hops: each input's row inserted, its run's row inserted
/// (at the start) or updated.
const HOP_SQL: &str = "
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::bigint[]) AS i(run_id, seq)
), runs AS (
    INSERT INTO floor_runs (run_id, seq) SELECT run_id, seq FROM input
    ON CONFLICT (run_id) DO UPDATE SET seq = EXCLUDED.seq
)
INSERT INTO floor_hops (run_id, seq) SELECT run_id, seq FROM input";

/// The loads the floor is compared at, in percent of Ductor's capacity.
pub const LOADS: [u32; 2] = [25, 50];
/// Warm-up runs of the floor before it is measured.
const WARMUP_RUNS: usize = 20;
/// How often the floor's finished runs are looked at.
const POLL: Duration = Duration::from_millis(20);
/// A floor with no progress for this long has failed.
const STALL: Duration = Duration::from_secs(30);

/// B3's Postgres share of a hop.
pub struct HopStore {
    conn: PgConnection,
}

impl HopStore {
    /// Creates the floor's tables and connects as the bench database's owner.
    async fn connect(env: &BenchEnv) -> anyhow::Result<HopStore> {
        env.as_owner(CREATE_SQL, "creating the floor's tables")
            .await?;
        let conn = PgConnection::connect_with(&env.owner_connect_options()?)
            .await
            .context("connecting the floor to Postgres")?;
        Ok(HopStore { conn })
    }

    /// Commits one batch of hops in one transaction.
    pub(crate) async fn commit(&mut self, hops: &[Hop]) -> anyhow::Result<()> {
        let ids: Vec<&str> = hops.iter().map(|h| h.run_id.as_str()).collect();
        let seqs: Vec<i64> = hops.iter().map(|h| h.seq).collect();
        let written = sqlx::query(HOP_SQL)
            .bind(&ids)
            .bind(&seqs)
            .execute(&mut self.conn)
            .await
            .context("the floor's hop transaction")?;
        anyhow::ensure!(
            written.rows_affected() == hops.len() as u64,
            "the floor wrote {} of {} hops",
            written.rows_affected(),
            hops.len()
        );
        Ok(())
    }
}

/// The hop floor running: the relay with its store, and the echo worker.
pub struct Floor {
    relay: Relay,
    shutdown: CancellationToken,
}

impl Drop for Floor {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Floor {
    /// Creates the floor's topics and tables, starts it under `parent`
    /// and warms it up (its consumer group joined, its connections open).
    pub async fn start(
        env: &BenchEnv,
        worker_in_flight: usize,
        parent: &CancellationToken,
        progress: &mut Progress,
    ) -> anyhow::Result<Floor> {
        let config = env.pipeline_config("b3");
        env.create_topics(&config).await?;
        let store = HopStore::connect(env).await?;
        let shutdown = parent.child_token();
        let relay = Relay::start(config, worker_in_flight, Some(store), &shutdown)?;
        let mut floor = Floor { relay, shutdown };
        produce_start_requests(
            &floor.relay.producer,
            &floor.relay.config,
            "warm-b3",
            WARMUP_RUNS,
        )
        .await?;
        floor
            .wait_finished(
                env,
                "warm-b3",
                WARMUP_RUNS,
                Duration::from_secs(120),
                progress,
                "B3 warm-up",
            )
            .await?;
        Ok(floor)
    }

    /// Stops the floor and reports how its tasks ended.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.relay.join().await
    }
}

impl Target for Floor {
    fn config(&self) -> &Config {
        &self.relay.config
    }

    fn producer(&self) -> &FutureProducer {
        &self.relay.producer
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        self.relay.check_alive()
    }

    async fn wait_finished(
        &mut self,
        _env: &BenchEnv,
        prefix: &str,
        n: usize,
        limit: Duration,
        progress: &mut Progress,
        label: &str,
    ) -> anyhow::Result<()> {
        let mut watchdog = Watchdog::new(label, limit, STALL);
        let started = Instant::now();
        loop {
            self.relay.check_alive()?;
            let done = self.relay.counters.finished_with_prefix(prefix);
            let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-3);
            progress.update(&format!(
                "{label}: {done}/{n} runs finished ({rate:.0} runs/s)"
            ));
            if done >= n as u64 {
                return Ok(());
            }
            watchdog.check(done, n as u64)?;
            tokio::time::sleep(POLL).await;
        }
    }
}

/// A ratio's median over the rounds, with its smallest and largest.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (all zero when there are none).
    pub fn of(values: &[f64]) -> Spread {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        sorted.sort_by(f64::total_cmp);
        let Some((&min, &max)) = sorted.first().zip(sorted.last()) else {
            return Spread::default();
        };
        let mid = sorted.len() / 2;
        let median = if sorted.len() % 2 == 1 {
            sorted[mid]
        } else {
            f64::midpoint(sorted[mid - 1], sorted[mid])
        };
        Spread { median, min, max }
    }
}

/// One round of the comparison: Ductor and the floor at [`LOADS`], and
/// one run at a time.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub ductor: Vec<Latency>,
    pub floor: Vec<Latency>,
    pub ductor_idle: Option<Idle>,
    pub floor_idle: Option<Idle>,
}

/// Ductor against the floor, over every round.
#[derive(Debug, Clone, Serialize)]
pub struct VsFloor {
    pub rounds: Vec<Round>,
}

/// The ratios against the floor: each the median of the rounds' ratios,
/// with their spread.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FloorRatios {
    pub p50_over_floor_at_25pct: Spread,
    pub p99_over_floor_at_25pct: Spread,
    pub p50_over_floor_at_50pct: Spread,
    pub p99_over_floor_at_50pct: Spread,
    pub idle_p50_over_floor: Spread,
}

impl VsFloor {
    /// The ratio of Ductor's figure to the floor's in every round.
    fn per_round(&self, figure: impl Fn(&[Latency]) -> Option<f64>) -> Spread {
        let ratios: Vec<f64> = self
            .rounds
            .iter()
            .filter_map(|r| Some(figure(&r.ductor)? / figure(&r.floor)?))
            .collect();
        Spread::of(&ratios)
    }

    pub fn ratios(&self) -> FloorRatios {
        let at = |pct: u32, p99: bool| {
            move |l: &[Latency]| {
                l.iter()
                    .find(|l| l.load_pct == pct)
                    .map(|l| if p99 { l.p99_ms } else { l.p50_ms })
            }
        };
        let idle: Vec<f64> = self
            .rounds
            .iter()
            .filter_map(|r| Some(r.ductor_idle.as_ref()?.p50_ms / r.floor_idle.as_ref()?.p50_ms))
            .collect();
        FloorRatios {
            p50_over_floor_at_25pct: self.per_round(at(25, false)),
            p99_over_floor_at_25pct: self.per_round(at(25, true)),
            p50_over_floor_at_50pct: self.per_round(at(50, false)),
            p99_over_floor_at_50pct: self.per_round(at(50, true)),
            idle_p50_over_floor: Spread::of(&idle),
        }
    }
}

/// What one comparison needs to know.
pub struct Compare {
    /// Ductor's capacity, runs/s: the reference of the loads.
    pub capacity_runs_per_s: f64,
    pub rounds: usize,
    pub duration: Duration,
    pub idle_runs: usize,
    pub worker_in_flight: usize,
}

/// Starts the floor beside the running Ductor `pipeline` and alternates
/// the two, `rounds` times: the latency at [`LOADS`], then one run at a
/// time; the floor first in odd rounds, Ductor first in even ones.
pub async fn compare(
    env: &BenchEnv,
    ductor: &mut Pipeline,
    c: &Compare,
    shutdown: &CancellationToken,
    progress: &mut Progress,
) -> anyhow::Result<VsFloor> {
    let mut floor = Floor::start(env, c.worker_in_flight, shutdown, progress).await?;
    progress.done("B3 hop floor started and warmed up");
    let mut rounds = Vec::with_capacity(c.rounds);
    for round in 1..=c.rounds {
        let floor_first = round % 2 == 1;
        let (d, f) = if floor_first {
            let f = one_side(env, &mut floor, c, round, shutdown, progress, "B3").await?;
            (
                one_side(env, ductor, c, round, shutdown, progress, "Ductor").await?,
                f,
            )
        } else {
            let d = one_side(env, ductor, c, round, shutdown, progress, "Ductor").await?;
            (
                d,
                one_side(env, &mut floor, c, round, shutdown, progress, "B3").await?,
            )
        };
        rounds.push(Round {
            ductor: d.0,
            floor: f.0,
            ductor_idle: d.1,
            floor_idle: f.1,
        });
    }
    floor.stop().await?;
    Ok(VsFloor { rounds })
}

/// One side of one round: the latency at [`LOADS`] and the idle runs.
async fn one_side(
    env: &BenchEnv,
    target: &mut impl Target,
    c: &Compare,
    round: usize,
    shutdown: &CancellationToken,
    progress: &mut Progress,
    name: &str,
) -> anyhow::Result<(Vec<Latency>, Option<Idle>)> {
    let loads = pipeline::Loads {
        reference_runs_per_s: c.capacity_runs_per_s,
        pcts: &LOADS,
        duration: c.duration,
        round,
    };
    let latency = pipeline::latency(env, target, &loads, shutdown, progress)
        .await
        .with_context(|| format!("{name}, round {round} against the floor"))?;
    let idle = if c.idle_runs == 0 {
        None
    } else {
        let idle = idle::idle(target, c.idle_runs, round, progress).await?;
        progress.done(&format!(
            "{name} round {round}: idle p50 {:.1} ms, p99 {:.1} ms",
            idle.p50_ms, idle.p99_ms
        ));
        Some(idle)
    };
    Ok((latency, idle))
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn a_spread_is_the_median_and_the_extremes() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let s = Spread::of(&[4.0, 1.0, 2.0, 3.0]);
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
    }

    #[test]
    fn a_spread_ignores_what_is_not_a_number() {
        let s = Spread::of(&[f64::NAN, 2.0, f64::INFINITY]);
        assert_eq!((s.median, s.min, s.max), (2.0, 2.0, 2.0));
        let s = Spread::of(&[]);
        assert_eq!((s.median, s.min, s.max), (0.0, 0.0, 0.0));
    }
}
