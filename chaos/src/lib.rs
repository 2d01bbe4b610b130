//! Fault injection harness: a load driver that logs what it sent and what was
//! acknowledged, and a checker that proves, from that log, the database and
//! every topic read from the beginning, that Ductor kept its guarantees.
//!
//! `scripts/chaos` runs two `ductor serve` processes (built with the
//! `failpoints` feature) under [`load`] while it kills them, crashes Postgres
//! and the Kafka broker and forces rebalances; then it lets the system settle
//! and runs [`check`]. The binary is `ductor-chaos` (`chaos/src/main.rs`):
//!
//! ```text
//! ductor-chaos load  --log FILE --duration-s S [--rate R] [--http ADDR]... [--admin ADDR]... [--config FILE]
//! ductor-chaos check --log FILE [--faults FILE] [--settle-timeout-s S] [--config FILE]
//! ```
//!
//! Both read Ductor's own configuration (defaults, `--config`, `DUCTOR__*`,
//! `DATABASE_URL`, `KAFKA_BOOTSTRAP_SERVERS`), so they find the same topics,
//! consumer group, database and workflow definitions as the `serve`
//! processes under test.
//!
//! # The log
//!
//! One JSON object per line ([`log::Record`]), written and flushed to the
//! kernel before the driver goes on, so a crash of the system under test
//! loses nothing from it (the driver itself is never killed). Every produced
//! input is logged once its fate is known: acknowledged by the broker (with
//! partition and offset) or not; intended good or bad; and the input id the
//! coordinator will record for it (`start`, `result:<stamp>`,
//! `signal:<id>`, `cancel`). HTTP requests are logged with their key, tenant,
//! status and the decision they got back.
//!
//! # What the checker proves
//!
//! See [`check`] for the list of violation kinds and [`history`] for what
//! "the stored state agrees with its history" means precisely.

pub mod afterlife;
pub mod check;
pub mod counts;
pub mod fuzz;
pub mod history;
pub mod keys;
pub mod load;
pub mod log;
pub mod replays;
pub mod restart;
pub mod snapshot;
pub mod topics;
pub mod violations;

use std::path::PathBuf;

/// `ductor-chaos load`.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Append one JSON line per event to this file.
    #[arg(long)]
    pub log: PathBuf,
    /// How long new inputs are produced; the driver then keeps answering
    /// dispatches as a well-behaved worker until every run it saw is
    /// terminal (at most `--drain-s`).
    #[arg(long)]
    pub duration_s: u64,
    /// Operations per second (starts, signals, cancels, bad inputs, HTTP
    /// requests); worker answers come on top.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// `ductor serve` HTTP addresses for `POST /v1/runs` (repeatable); no
    /// HTTP traffic without one.
    #[arg(long)]
    pub http: Vec<std::net::SocketAddr>,
    /// `ductor serve` admin addresses (`server.admin_listen`, repeatable)
    /// whose `/metrics` the driver reads each second for stalled lanes, and
    /// through which it replays dead letters with an `admin` key; none, no
    /// such watch and no replays.
    #[arg(long)]
    pub admin: Vec<std::net::SocketAddr>,
    /// Upper bound of the wind-down after `--duration-s`.
    #[arg(long, default_value_t = 90)]
    pub drain_s: u64,
    /// The chance that a replayed letter is replayed again a few seconds
    /// later (a second replay, which must produce nothing). A canary that
    /// breaks exactly that asks for every one.
    #[arg(long, default_value_t = 0.35)]
    pub replay_again: f64,
    /// Tenants to spread the runs over.
    #[arg(long, value_delimiter = ',', default_value = "acme,globex,initech")]
    pub tenants: Vec<String>,
}

/// `ductor-chaos check`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// The load driver's log.
    #[arg(long)]
    pub log: PathBuf,
    /// JSON lines with a `kind` field, one per injected fault (counted in the report).
    #[arg(long)]
    pub faults: Option<PathBuf>,
    /// Bound on the wait for the system to settle (outbox backlog and the
    /// coordinator's consumer lag zero, every run terminal).
    #[arg(long, default_value_t = 180)]
    pub settle_timeout_s: u64,
    /// Once settled and checked: purge every finished run, deliver the
    /// load's good inputs that name a run again, and check that none comes
    /// back (`purge_incomplete`, `purged_run_resurrected`).
    #[arg(long)]
    pub afterlife: bool,
}
