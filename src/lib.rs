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
//!   HTTP ─► [api] the public endpoints: guard, body, handlers by resource
//!            ├─► [auth] the caller's key: its tenant and scopes
//!            └─► [routing] reserve → decide → complete, exactly one decision
//! ```
//!
//! [`contract`] is the wire every stage shares; [`config`] the configuration;
//! [`infra`] the connections, telemetry and health around them; [`cli`] the
//! binary's entry points.
//!
//! In: input records on Kafka (`requests`, `wakeups`, `attempt-results`)
//! and requests over HTTP. Out: runs, their history and their outbox in
//! Postgres; dispatches, events, timers and outputs on Kafka. Guarantees:
//! a run's state is written only over the version it was loaded at (the
//! conditional update on `record_version`); an input's offset is stored
//! only after its batch commits; effects are published at least once, in
//! transition order per run and topic, each with its idempotency key.

//! The public surface is what a user needs: [`contract`], [`client`],
//! [`config`] and [`cli`]. The stages themselves are crate-private; the
//! `internals` feature makes them public for the project's own harnesses
//! (integration tests, `ductor-bench`, `ductor-chaos`), which drive one stage
//! at a time. It is not a stable interface.

pub mod cli;
pub mod client;
pub mod config;
pub mod contract;

// Each stage twice: public with `internals`, crate-private without.
#[cfg(feature = "internals")]
pub mod api;
#[cfg(not(feature = "internals"))]
pub(crate) mod api;
#[cfg(feature = "internals")]
pub mod apply;
#[cfg(not(feature = "internals"))]
pub(crate) mod apply;
#[cfg(feature = "internals")]
pub mod auth;
#[cfg(not(feature = "internals"))]
pub(crate) mod auth;
#[cfg(feature = "internals")]
pub mod coordinator;
#[cfg(not(feature = "internals"))]
pub(crate) mod coordinator;
#[cfg(feature = "internals")]
pub mod harness;
#[cfg(feature = "internals")]
pub mod infra;
#[cfg(not(feature = "internals"))]
pub(crate) mod infra;
#[cfg(feature = "internals")]
pub mod ingress;
#[cfg(not(feature = "internals"))]
pub(crate) mod ingress;
#[cfg(feature = "internals")]
pub mod outbox;
#[cfg(not(feature = "internals"))]
pub(crate) mod outbox;
#[cfg(feature = "internals")]
pub mod routing;
#[cfg(not(feature = "internals"))]
pub(crate) mod routing;
