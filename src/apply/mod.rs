//! The apply stage: load, fold, plan, write.
//!
//! In: a batch of decoded inputs and routed starts from the ingress (from one
//! or more partitions, in arrival order). Out: one committed write of the
//! runs they changed, their history and their effect intents, the claims the
//! fast lane takes at insert, and each input's outcome for the ingress
//! (applied, no-op, rejected) to count and dead-letter.
//!
//! - `load`: the runs the batch touches, cached or read with the
//!   `record_version` the write must match;
//! - `routed`: the routed starts, each decided with its idempotency key in
//!   the batch's transaction (`session`);
//! - `fold`: the fold ([`crate::coordinator::fold()`]) of each input, in
//!   order, into the rows the attempt will write (`rows`);
//! - `plan`: pure, from the fold results to one [`batch::BatchWrite`];
//! - `write`: the batch statement ([`batch::WRITE_BATCH_SQL`]), which is
//!   the batch's commit unless routed requests need a transaction.
//!
//! Around them: `error` (what failed, and whether it was the inputs),
//! `isolate` (a batch applied whatever poison it holds), `writer` (who
//! writes, in the history), `missing` and `retention` (maintenance of
//! runs), `decide` (the stage as the routing plane's decider).
//!
//! Guarantee: a batch applies whole or not at all. New runs are inserted,
//! changed runs updated with `WHERE run_id = .. AND record_version = ..`;
//! if any conditional write matches fewer rows than expected, another writer
//! won a race: the statement rolls back and the whole batch is recomputed
//! from fresh state, so no input of the batch is lost or applied twice.

pub mod batch;
#[cfg(feature = "canary-dispatch-before-commit")]
mod canary;
mod decide;
mod error;
mod fold;
mod isolate;
mod load;
pub mod missing;
mod plan;
pub mod retention;
mod routed;
mod rows;
mod session;
mod write;
mod writer;

pub use error::{ApplyError, ApplyFailure};
pub use isolate::{Holds, IsolatedBatch, RetryPolicy};
pub use load::RunCache;
pub use writer::Writer;

use std::time::{Duration, Instant};

use chrono::Utc;
use sqlx::PgPool;
use tracing::Instrument;

use crate::contract::{Input, Source, TopicNames, TraceContext};
use crate::coordinator::{NoOpReason, Rejection, Workflows};
use crate::routing::{RouteOutcome, RouteRequest};
use fold::Carried;
use load::{load_runs, unsure};
use routed::Routed;
use rows::Writes;
use session::Session;
use write::{Handed, write_all};

/// One decoded input waiting to be applied.
#[derive(Debug, Clone)]
pub struct PendingInput {
    pub input: Input,
    pub source: Option<Source>,
    /// The trace context its message carried, if a valid one.
    pub trace: Option<TraceContext>,
}

/// What happened to one input of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum InputOutcome {
    Applied { seq: i64 },
    NoOp(NoOpReason),
    Rejected(Rejection),
}

#[derive(Debug)]
pub struct BatchReport {
    /// One outcome per input, in input order.
    pub outcomes: Vec<InputOutcome>,
    /// One outcome per routed request, in order.
    pub routed: Vec<RouteOutcome>,
    /// Times the batch was recomputed after losing a race.
    pub conflicts: u32,
    /// Effect intents committed.
    pub intents_written: usize,
    /// Of those, how many went to the drainer's fast lane.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    pub intents_handed_off: usize,
}

/// The apply layer's fixed inputs.
pub struct Applier {
    pub pool: PgPool,
    pub workflows: Workflows,
    /// `coordinator.max_state_bytes`, handed to the fold.
    pub max_state_bytes: usize,
    pub topics: TopicNames,
    pub conflict_retries: u32,
    /// How long a routing reservation may stay pending.
    pub pending_ttl: Duration,
    /// How long a routing decision stays valid.
    pub completed_ttl: Duration,
    /// Send `NOTIFY ductor_effect_intent` with every commit that wrote
    /// intents. Needed by every writer in a process without a drainer (a
    /// `serve` with `drainer.enabled = false`, whose ingress and API both
    /// write, and `ductor submit`); a process with its own drainer wakes it
    /// in-process instead, and leaves the NOTIFY out because it serialises
    /// commits.
    pub notify_commits: bool,
    /// The fast lane of the drainer running in this process, if any: due
    /// intents that wait behind nothing are inserted already claimed by it
    /// and handed over right after the commit.
    pub handoff: Option<crate::outbox::Handoff>,
    /// The states this applier committed last, by run.
    pub cache: RunCache,
    /// Who this applier is, in the transitions it writes.
    pub writer: std::sync::Arc<Writer>,
    /// Canary: publishes effects before the commit that decides them.
    #[cfg(feature = "canary-dispatch-before-commit")]
    pub canary_producer: Option<rdkafka::producer::FutureProducer>,
}

impl Applier {
    /// An applier configured from `config`.
    pub fn new(config: &crate::config::Config, pool: PgPool, workflows: Workflows) -> Self {
        Applier {
            pool,
            workflows,
            max_state_bytes: config.coordinator.max_state_bytes,
            topics: TopicNames {
                prefix: config.kafka.topic_prefix.clone(),
            },
            conflict_retries: config.coordinator.conflict_retries,
            pending_ttl: Duration::from_millis(config.routing.pending_ttl_ms),
            completed_ttl: Duration::from_millis(config.routing.completed_ttl_ms),
            notify_commits: !config.drainer.enabled,
            handoff: None,
            cache: RunCache::new(
                config.coordinator.run_cache_size,
                config.coordinator.run_cache_max_bytes,
            ),
            writer: std::sync::Arc::new(Writer::new("direct")),
            #[cfg(feature = "canary-dispatch-before-commit")]
            canary_producer: crate::infra::kafka::producer(&config.kafka, "canary").ok(),
        }
    }
}

/// How one attempt at a batch ended.
enum Attempt {
    Committed(BatchReport, Handed),
    /// A conditional write matched fewer rows than expected: recompute.
    Conflict,
    /// The key of the routed request at this index is held by another
    /// caller that has not decided.
    Busy(usize),
    /// An input changed nothing on a state taken from the cache: that
    /// verdict is only trusted on a state read from the database.
    Unsure,
}

impl Applier {
    /// Applies `inputs` in order, in one transaction, recomputing on conflict.
    #[cfg(any(test, feature = "internals"))]
    pub async fn apply_batch(&self, inputs: &[PendingInput]) -> Result<BatchReport, ApplyError> {
        self.apply(inputs, &[]).await
    }

    /// Applies routed start requests and then `inputs`, in one transaction,
    /// recomputing on conflict. A routed request whose key is held by another
    /// caller in flight fails the batch with [`ApplyError::RoutingInProgress`];
    /// retry it after a pause (the holder decides or is swept).
    pub async fn apply(
        &self,
        inputs: &[PendingInput],
        routed: &[RouteRequest],
    ) -> Result<BatchReport, ApplyError> {
        let span = tracing::info_span!(
            target: crate::infra::traces::TARGET,
            "apply",
            ductor.inputs = inputs.len(),
            ductor.routed = routed.len(),
        );
        self.apply_all(inputs, routed).instrument(span).await
    }

    async fn apply_all(
        &self,
        inputs: &[PendingInput],
        routed: &[RouteRequest],
    ) -> Result<BatchReport, ApplyError> {
        let started = Instant::now();
        let mut conflicts = 0;
        let batch_runs = || inputs.iter().map(|p| p.input.run_id());
        let mut use_cache = true;
        loop {
            // The fast lane's leases start inside this attempt.
            let leased_at = Instant::now();
            let mut session = Session::open(&self.pool, routed.is_empty()).await?;
            record_phase("begin", leased_at);
            let attempt = match self.apply_in(&mut session, inputs, routed, use_cache).await {
                Ok(attempt) => attempt,
                Err(e) => {
                    self.cache.forget(batch_runs());
                    return Err(e);
                }
            };
            match attempt {
                Attempt::Committed(mut report, handed) => {
                    self.commit(session, handed, leased_at, batch_runs())
                        .await?;
                    metrics::histogram!("ductor_apply_seconds")
                        .record(started.elapsed().as_secs_f64());
                    metrics::histogram!("ductor_apply_batch_size")
                        .record((inputs.len() + routed.len()) as f64);
                    report.conflicts = conflicts;
                    return Ok(report);
                }
                Attempt::Busy(at) => {
                    session.rollback().await?;
                    return Err(ApplyError::RoutingInProgress(at));
                }
                Attempt::Unsure => {
                    // Recompute from the database.
                    self.cache.forget(batch_runs());
                    use_cache = false;
                    session.rollback().await?;
                }
                Attempt::Conflict => {
                    // Recompute from the database: the cache's states, or
                    // the guess that a started run is new, lost the race.
                    self.cache.forget(batch_runs());
                    use_cache = false;
                    session.rollback().await?;
                    conflicts += 1;
                    metrics::counter!("ductor_apply_conflicts_total").increment(1);
                    tracing::debug!(conflicts, "batch lost an optimistic-lock race, recomputing");
                    if conflicts > self.conflict_retries {
                        return Err(ApplyError::ConflictsExhausted(conflicts));
                    }
                }
            }
        }
    }

    /// Commits a batch's session, then tells the cache and the fast lane
    /// what became of it: the states and claims of a commit that surely
    /// happened are kept, those of one that may not have are let go.
    async fn commit<'a>(
        &self,
        session: Session,
        handed: Handed,
        leased_at: Instant,
        batch_runs: impl Iterator<Item = &'a str>,
    ) -> Result<(), ApplyError> {
        let committing = Instant::now();
        let in_transaction = matches!(session, Session::Transaction(_));
        let committed = session.commit().await;
        if in_transaction {
            record_phase("commit", committing);
        }
        let lost = committed.is_ok() && commit_reply_lost();
        let kept = committed.is_ok() && !lost;
        if kept {
            self.cache.put_many(handed.states);
        } else {
            self.cache.forget(batch_runs);
        }
        if let Some(handoff) = &self.handoff {
            if kept {
                handoff
                    .committed(
                        handed.claimed,
                        leased_at,
                        handed.pending_due,
                        handed.next_timer,
                    )
                    .await;
            } else {
                // Committed or not, nobody else may hold these claims for
                // a lease: give them back.
                let ids = handed.claimed.iter().map(|c| c.intent_id).collect();
                handoff.uncertain(ids).await;
            }
        }
        committed?;
        if lost {
            return Err(ApplyError::CommitReplyLost);
        }
        Ok(())
    }

    async fn apply_in(
        &self,
        session: &mut Session,
        inputs: &[PendingInput],
        routed: &[RouteRequest],
        use_cache: bool,
    ) -> Result<Attempt, ApplyError> {
        let cache = use_cache.then_some(&self.cache);
        let loading = Instant::now();
        let mut runs = load_runs(session.conn(), inputs, cache).await?;
        record_phase("load", loading);
        let folding = Instant::now();
        let now = Utc::now();
        let mut writes = Writes {
            writer: self.writer.label(),
            ..Writes::default()
        };

        let routed_outcomes = match self
            .route_all(session, routed, &mut runs, &mut writes, now)
            .await?
        {
            Routed::All(outcomes) => outcomes,
            Routed::Held(at) => return Ok(Attempt::Busy(at)),
        };
        let mut outcomes = Vec::with_capacity(inputs.len());
        for pending in inputs {
            let (outcome, _) = self.fold_one(
                &pending.input,
                Carried {
                    source: pending.source.as_ref(),
                    trace: pending.trace.as_ref(),
                },
                &mut runs,
                &mut writes,
                now,
            )?;
            outcomes.push(outcome);
        }
        if unsure(inputs, &outcomes, &runs) {
            return Ok(Attempt::Unsure);
        }

        #[cfg(feature = "canary-dispatch-before-commit")]
        self.canary_publish(&writes.intents).await;
        if writes.routing_lost {
            return Ok(Attempt::Conflict);
        }
        record_phase("fold", folding);
        let writing = Instant::now();
        let written = write_all(
            session.conn(),
            &runs,
            &writes,
            self.notify_commits,
            self.handoff.as_ref(),
        )
        .await;
        record_phase("write", writing);
        let Some(handed) = written? else {
            return Ok(Attempt::Conflict);
        };
        Ok(Attempt::Committed(
            BatchReport {
                outcomes,
                routed: routed_outcomes,
                conflicts: 0,
                intents_written: writes.intents.len(),
                intents_handed_off: handed.claimed.len(),
            },
            handed,
        ))
    }
}

/// Time spent in one phase of an apply, whatever the attempt's outcome:
/// `begin` (the wait for a pooled connection, and BEGIN when the batch has a
/// transaction), `load`, `fold` (with the routing plane's decisions),
/// `write` (the batch statement, which is also the commit of a batch without
/// a transaction) and `commit` (only batches with a transaction).
fn record_phase(phase: &'static str, since: Instant) {
    metrics::histogram!("ductor_apply_phase_seconds", "phase" => phase)
        .record(since.elapsed().as_secs_f64());
}

/// Failpoint `apply.commit_reply_lost`: the commit went through and its
/// reply is lost, so the caller cannot know.
fn commit_reply_lost() -> bool {
    fail::fail_point!("apply.commit_reply_lost", |_| true);
    false
}
