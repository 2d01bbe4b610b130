//! Ductor: a durable step orchestrator on Apache Kafka and PostgreSQL.
//!
//! The coordinator ([`coordinator`]) is a pure fold with no I/O; the apply
//! layer ([`store`]) commits its decisions to Postgres with optimistic
//! locking; the ingress ([`ingress`]) feeds it from Kafka and stores offsets
//! only after the commit.

pub mod api;
pub mod bench;
pub mod chaos;
pub mod config;
pub mod coordinator;
pub mod db;
pub mod dedup;
pub mod dlq;
pub mod drainer;
pub mod failpoints;
pub mod frontier;
pub mod http;
pub mod ingress;
pub mod inspect;
pub mod kafka;
pub mod routing;
pub mod serve;
pub mod store;
pub mod telemetry;
pub mod worker;
pub mod workflows;
