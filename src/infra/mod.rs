//! Infrastructure around the stages: Postgres and Kafka connections, the
//! workflow catalogue on disk, telemetry (logs, metrics, the spans of a
//! run's trace and their OTLP exporter), the health endpoints and the
//! server of the HTTP listeners, the crash points of fault injection, and
//! the crash hooks in-process tests stop one component with. Nothing here
//! decides anything about a run.
//!
//! In: the `database`, `kafka`, `server`, `log` and `telemetry` sections of the
//! configuration, and `coordinator.workflows_dir`. Out: pools, Kafka
//! clients, the loaded workflows, the HTTP servers, logs, metrics and spans.
//! Guarantees: every Kafka and Postgres client states the settings Ductor
//! relies on instead of trusting a library default.

pub mod crash;
pub mod db;
pub mod failpoints;
pub mod health;
pub mod http_server;
pub mod kafka;
pub mod otlp;
pub mod prompt_producer;
pub mod telemetry;
pub mod traces;
pub mod workflows;
