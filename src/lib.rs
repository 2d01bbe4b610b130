//! Ductor: a durable step orchestrator on Apache Kafka and PostgreSQL.
//!
//! The modules follow the data, stage by stage:
//!
//! ```text
//! producers ─► requests / wakeups / attempt-results (Kafka)
//!                │
//!          [ingress]     Kafka to batches; bad messages to the dead-letter topic
//!                │
//!        [coordinator]   the pure fold: (state, input) → transition | no-op | rejection
//!                │
//!           [apply]      load, fold, plan, write: state, history and outbox in one statement
//!                │       offsets stored only after that commit
//!           [outbox]     claim, publish (at least once, keyed), fast lane, maintenance
//!                │
//!   dispatches / events / timers (Kafka) ─► [client] workers and consumers
//!
//!   HTTP / routed requests ─► [routing] reserve → decide → complete, exactly one decision
//! ```
//!
//! [`contract`] is the wire every stage shares; [`config`] the configuration;
//! [`infra`] the connections, telemetry and health around them; [`cli`] the
//! binary's entry points.

pub mod apply;
pub mod cli;
pub mod client;
pub mod config;
pub mod contract;
pub mod coordinator;
pub mod infra;
pub mod ingress;
pub mod outbox;
pub mod routing;
