//! The libraries Ductor's users link: [`worker`] runs step handlers against
//! the dispatch topic and answers on the attempt-results topic; [`dedup`]
//! makes a consumer of any published effect effectively-once by honouring
//! its `idempotency-key` header in the consumer's own transaction;
//! [`init_telemetry`] installs the log and, with `telemetry.otlp_endpoint`
//! set, the OTLP exporter of the worker's spans, as `serve` does.
//!
//! In: the records Ductor publishes: a pool's `step.dispatch`es, any effect
//! with its `idempotency-key`. Out: `attempt.result`s, and claims in the
//! consumer's own `ductor_dedup_seen`. Guarantees: they reach Ductor only
//! through Kafka, and write only to the user's database, never Ductor's.

pub mod dedup;
pub mod worker;

pub use crate::infra::telemetry::{Telemetry, init as init_telemetry};
