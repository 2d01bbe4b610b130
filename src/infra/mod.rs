//! Infrastructure around the stages: Postgres and Kafka connections, the
//! workflow catalogue on disk, telemetry, the health endpoints and the
//! server of the HTTP listeners, the crash points of fault injection, and
//! the crash hooks in-process tests stop one component with. Nothing here
//! decides anything about a run.
//!
//! In: the `database`, `kafka`, `server` and `log` sections of the
//! configuration, and `coordinator.workflows_dir`. Out: pools, Kafka
//! clients, the loaded workflows, the HTTP servers, logs and metrics.
//! Guarantees: every Kafka and Postgres client states the settings Ductor
//! relies on instead of trusting a library default.

pub mod crash;
pub mod db;
pub mod failpoints;
pub mod health;
pub mod http_server;
pub mod kafka;
pub mod telemetry;
pub mod workflows;
