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
//! - the fold ([`crate::coordinator::fold()`]) of each input, in order;
//! - `plan`: pure, from the fold results to one [`batch::BatchWrite`];
//! - `write`: the batch statement ([`batch::WRITE_BATCH_SQL`]), which is
//!   the batch's commit unless routed requests need a transaction.
//!
//! Guarantee: a batch applies whole or not at all. New runs are inserted,
//! changed runs updated with `WHERE run_id = .. AND record_version = ..`;
//! if any conditional write matches fewer rows than expected, another writer
//! won a race: the statement rolls back and the whole batch is recomputed
//! from fresh state, so no input of the batch is lost or applied twice.

pub mod batch;
mod decide;
mod isolate;
mod load;
pub mod missing;
mod plan;
pub mod retention;
mod write;

pub use isolate::{Holds, IsolatedBatch, RetryPolicy};
pub use load::RunCache;
use load::load_runs;
use write::{Handed, write_all};

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgPool, Postgres, Transaction as PgTx};
use uuid::Uuid;

use crate::contract::Source;
use crate::contract::effects::RunAccepted;
use crate::contract::headers::{EffectOrigin, effect_headers};
use crate::contract::input::SCHEMA_VERSION;
use crate::contract::{
    Effect, EffectKind, EffectTarget, Input, TopicNames, idempotency_key, timeout_cancel_key,
};
use crate::coordinator::{
    AttemptRecord, AttemptStatus, AttemptWrite, Decision, Entropy, NoOpReason, Purged, Rejection,
    RunState, RunStatus, Transition, Workflows, fold, fold_purged,
};
use crate::routing::{self, Reservation, ReserveKind, RouteOutcome, RouteRequest};

/// One decoded input waiting to be applied.
#[derive(Debug, Clone)]
pub struct PendingInput {
    pub input: Input,
    pub source: Option<Source>,
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

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("the commit's reply was lost (injected fault)")]
    CommitReplyLost,
    /// The routed request at this index of the batch's.
    #[error(
        "an idempotency key of the batch (routed request {0}) is held by a caller still deciding"
    )]
    RoutingInProgress(usize),
    #[error("batch still conflicting after {0} recomputations")]
    ConflictsExhausted(u32),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("encoding state: {0}")]
    Encode(#[from] serde_json::Error),
}

/// A failure that retrying cannot mend: what the database refused in the
/// inputs themselves. `class` is stable (the dead-letter class and the HTTP
/// error code); `message` names the SQLSTATE and never echoes the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyFailure {
    pub class: &'static str,
    pub message: String,
}

/// Longest [`ApplyFailure::message`].
const MAX_FAILURE_MESSAGE_LEN: usize = 512;

impl ApplyError {
    /// `Some` when the batch's own contents are what failed, so that the
    /// same inputs fail again however often they are retried: a data
    /// exception (SQLSTATE class 22, such as U+0000 in `jsonb`), an
    /// integrity violation (class 23) other than the lost races the apply
    /// path expects, a program limit (class 54), a stored state that does
    /// not decode, or a state that does not encode. `None` for everything
    /// transient: connections, timeouts and cancels, serialization
    /// failures, deadlocks, lock waits, shutdowns, lost races, and any error
    /// that is no one input's fault (privileges, a missing table), which
    /// must not send good inputs to the dead-letter topic.
    pub fn permanent(&self) -> Option<ApplyFailure> {
        let failure = |class, message: String| {
            Some(ApplyFailure {
                class,
                message: crate::contract::input::truncate(message, MAX_FAILURE_MESSAGE_LEN),
            })
        };
        match self {
            ApplyError::Database(sqlx::Error::Database(db)) => {
                let code = db.code().unwrap_or_default().into_owned();
                let class = match code.get(..2) {
                    Some("22") => "data_exception",
                    Some("23") => "integrity_constraint_violation",
                    Some("54") => "program_limit_exceeded",
                    _ => return None,
                };
                failure(class, format!("postgres {code}: {}", db.message()))
            }
            ApplyError::Database(sqlx::Error::ColumnDecode { index, .. }) => failure(
                "undecodable_state",
                format!("a stored row does not decode (column {index})"),
            ),
            ApplyError::Database(sqlx::Error::Decode(e)) => failure(
                "undecodable_state",
                format!("a stored row does not decode: {e}"),
            ),
            ApplyError::Encode(e) => failure("unencodable_state", format!("encoding: {e}")),
            _ => None,
        }
    }
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

/// Who writes a batch, as `run_transitions.writer` records it:
/// `<host>:<pid>/<role>#<epoch>`. The ingress's epoch moves on at every
/// assignment of its partitions, so that two writers of one run at once
/// (which co-partitioning rules out) would show in the history as two
/// writers interleaved.
#[derive(Debug)]
pub struct Writer {
    name: String,
    epoch: std::sync::atomic::AtomicU64,
}

impl Writer {
    /// This process in `role` (`ingress`, `api`, `submit`, ...).
    pub fn new(role: &str) -> Writer {
        let host = crate::outbox::hostname();
        Writer {
            name: format!("{host}:{}/{role}", std::process::id()),
            epoch: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A new assignment: the epoch moves on.
    pub fn reassigned(&self) {
        self.epoch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn label(&self) -> String {
        let epoch = self.epoch.load(std::sync::atomic::Ordering::Relaxed);
        format!("{}#{epoch}", self.name)
    }
}

fn fresh_entropy() -> Entropy {
    Entropy {
        stamp: Uuid::new_v4(),
        jitter_unit: rand::random::<f64>(),
    }
}

/// A run as loaded: its state and the record_version the UPDATE must match.
#[derive(Debug)]
struct Loaded {
    state: Option<RunState>,
    loaded_version: Option<i64>,
    changed: bool,
    /// The state was not read from the database: it came from the cache,
    /// or the run was taken to be new (see [`load_runs`]).
    cached: bool,
    /// The run finished and retention deleted it: its tombstone.
    purged: Option<Purged>,
}

/// Everything one attempt at committing a batch will write.
#[derive(Debug, Default)]
struct Writes {
    transitions: Vec<TransitionRow>,
    attempt_inserts: Vec<(String, AttemptRecord)>,
    attempt_finishes: Vec<AttemptFinish>,
    intents: Vec<IntentRow>,
    /// A routing row could not be completed: another caller took the key.
    routing_lost: bool,
    /// Who writes the batch, recorded in each transition ([`Writer`]).
    writer: String,
}

impl Writes {
    /// Adds one attempt write of the fold. An attempt inserted earlier in
    /// this batch is finished in memory, so each row is written once.
    fn attempt(&mut self, run_id: &str, write: AttemptWrite) {
        match write {
            AttemptWrite::Insert(attempt) => {
                self.attempt_inserts.push((run_id.to_owned(), attempt))
            }
            AttemptWrite::Finish {
                stamp,
                status,
                finished_at,
                error,
            } => {
                if let Some(row) = self
                    .attempt_inserts
                    .iter_mut()
                    .map(|(_, a)| a)
                    .find(|a| a.stamp == stamp)
                {
                    row.status = status;
                    row.finished_at = Some(finished_at);
                    row.error = error;
                } else {
                    self.attempt_finishes.push(AttemptFinish {
                        stamp,
                        status,
                        finished_at,
                        error,
                    });
                }
            }
        }
    }
}

/// An attempt the batch finishes, updated only while still `dispatched`.
#[derive(Debug)]
struct AttemptFinish {
    stamp: Uuid,
    status: AttemptStatus,
    finished_at: DateTime<Utc>,
    error: Option<String>,
}

#[derive(Debug)]
struct TransitionRow {
    run_id: String,
    seq: i64,
    input_ref: String,
    kind: &'static str,
    from_status: Option<&'static str>,
    to_status: &'static str,
    step_index: i32,
    detail: String,
    source: Option<Source>,
    at: DateTime<Utc>,
}

/// An effect intent as it will be published: topic, key, headers and payload
/// bytes are all fixed here, at commit.
#[derive(Debug)]
pub struct IntentRow {
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
    pub idempotency_key: String,
    pub tenant: String,
    pub topic: String,
    pub message_key: Vec<u8>,
    pub headers: serde_json::Map<String, Value>,
    pub payload: Vec<u8>,
    pub ce_type: String,
    pub not_before: DateTime<Utc>,
    /// Set on a step's timeout timer (`timeout:<stamp>`), so the transition
    /// that finishes the attempt can delete it while it is still pending.
    pub cancel_key: Option<String>,
    /// Due at once (no `not_before` of its own): the fast lane may take it.
    pub due: bool,
}

/// Where one attempt at a batch runs. A batch with routed requests needs a
/// transaction: the routing plane's reserve and complete statements commit
/// with the batch. Any other batch is written by one statement, which is its
/// own transaction, so it saves the BEGIN and COMMIT round trips; its loads
/// read outside any transaction, which the optimistic lock makes safe (the
/// write only lands on the `record_version` that was read).
enum Session {
    Transaction(PgTx<'static, Postgres>),
    Statement(sqlx::pool::PoolConnection<Postgres>),
}

impl Session {
    async fn open(pool: &PgPool, single_statement: bool) -> Result<Session, sqlx::Error> {
        Ok(if single_statement {
            Session::Statement(pool.acquire().await?)
        } else {
            Session::Transaction(pool.begin().await?)
        })
    }

    fn conn(&mut self) -> &mut PgConnection {
        match self {
            Session::Transaction(tx) => tx,
            Session::Statement(conn) => conn,
        }
    }

    /// Commits the transaction; the single statement has already committed.
    async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Session::Transaction(tx) => tx.commit().await,
            Session::Statement(_) => Ok(()),
        }
    }

    /// Rolls the transaction back; a single statement that failed left
    /// nothing behind.
    async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            Session::Transaction(tx) => tx.rollback().await,
            Session::Statement(_) => Ok(()),
        }
    }
}

/// What the routed requests of one attempt came to.
enum Routed {
    /// Each request's outcome, in order.
    All(Vec<RouteOutcome>),
    /// The key of the request at this index is held by another caller
    /// still deciding: nothing of the attempt may commit.
    Held(usize),
}

/// What taking a routed request's key came to.
enum Claim {
    /// This request decides, with this kind of reservation.
    Decide(ReserveKind),
    /// The key answers for it: a decision made before, or a reuse refused.
    Answered(RouteOutcome),
    /// Another caller holds the key and has not decided yet.
    Held,
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
                pending.source.as_ref(),
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

    /// Decides every routed request of the batch, in its transaction.
    async fn route_all(
        &self,
        session: &mut Session,
        routed: &[RouteRequest],
        runs: &mut HashMap<String, Loaded>,
        writes: &mut Writes,
        now: DateTime<Utc>,
    ) -> Result<Routed, ApplyError> {
        let mut outcomes = Vec::with_capacity(routed.len());
        for (at, request) in routed.iter().enumerate() {
            let Session::Transaction(tx) = session else {
                unreachable!("a batch with routed requests has its own transaction")
            };
            match self.route_one(tx, request, runs, writes, now).await? {
                Some(outcome) => outcomes.push(outcome),
                None => return Ok(Routed::Held(at)),
            }
        }
        Ok(Routed::All(outcomes))
    }

    /// Canary: publishes the batch's effects before its transaction commits,
    /// so a rolled-back or recomputed batch leaks effects that no committed
    /// intent backs. Only for proving the chaos checker notices.
    #[cfg(feature = "canary-dispatch-before-commit")]
    async fn canary_publish(&self, intents: &[IntentRow]) {
        use rdkafka::message::{Header, OwnedHeaders};
        let Some(producer) = &self.canary_producer else {
            return;
        };
        for intent in intents {
            let mut headers = OwnedHeaders::new();
            for (k, v) in &intent.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: v.as_str().map(str::as_bytes),
                });
            }
            let record = rdkafka::producer::FutureRecord::to(&intent.topic)
                .key(&intent.message_key)
                .payload(&intent.payload)
                .headers(headers);
            let _ = producer.send(record, Duration::from_secs(5)).await;
        }
    }

    /// Takes a routed request's key in the deciding transaction.
    async fn claim_key(
        &self,
        tx: &mut PgTx<'_, Postgres>,
        request: &RouteRequest,
    ) -> Result<Claim, ApplyError> {
        let Some(key) = &request.key else {
            return Ok(Claim::Decide(ReserveKind::Unkeyed));
        };
        if let Reservation::Held { epoch } = request.reservation {
            return Ok(
                if routing::fence_in_tx(tx, &request.start, key, epoch).await? {
                    Claim::Decide(ReserveKind::Fresh)
                } else {
                    Claim::Answered(RouteOutcome::ClaimLost)
                },
            );
        }
        Ok(
            match routing::reserve_in_tx(tx, request, key, self.pending_ttl).await? {
                Ok(kind) => Claim::Decide(kind),
                Err(row) if row.status == routing::KeyStatus::Pending => Claim::Held,
                Err(row) => Claim::Answered(match row.decision {
                    Some(decision) if row.fingerprint == request.fingerprint => {
                        RouteOutcome::Duplicate { decision }
                    }
                    _ => RouteOutcome::Mismatch,
                }),
            },
        )
    }

    /// Reserves (or checks) a routed request's key and, when it wins, folds
    /// its start and completes the key with the decision. `None`: the key is
    /// held by another caller still deciding.
    async fn route_one(
        &self,
        tx: &mut PgTx<'_, Postgres>,
        request: &RouteRequest,
        runs: &mut HashMap<String, Loaded>,
        writes: &mut Writes,
        now: DateTime<Utc>,
    ) -> Result<Option<RouteOutcome>, ApplyError> {
        let start = &request.start;
        let known = match start.workflow_version {
            Some(v) => self.workflows.get(&start.workflow, v).is_some(),
            None => self.workflows.latest(&start.workflow).is_some(),
        };
        if !known {
            // Rejected before reserving, so no reservation is left behind.
            return Ok(Some(RouteOutcome::Rejected(format!(
                "unknown workflow {:?}",
                start.workflow
            ))));
        }
        let kind = match self.claim_key(tx, request).await? {
            Claim::Decide(kind) => kind,
            Claim::Answered(answer) => return Ok(Some(answer)),
            Claim::Held => return Ok(None),
        };
        runs.entry(start.run_id.clone()).or_insert(Loaded {
            state: None,
            loaded_version: None,
            changed: false,
            cached: false,
            purged: None,
        });
        let input = Input::Start(start.clone());
        let (outcome, effects) =
            self.fold_one(&input, request.source.as_ref(), runs, writes, now)?;
        let InputOutcome::Applied { seq } = outcome else {
            return Ok(Some(RouteOutcome::Rejected(match outcome {
                InputOutcome::Rejected(r) => r.message,
                other => format!("start was not applied: {other:?}"),
            })));
        };
        let state = runs
            .get(&start.run_id)
            .and_then(|l| l.state.as_ref())
            .expect("an applied start leaves a run");
        let decision = routing::RoutingDecision {
            run_id: state.run_id.clone(),
            tenant: state.tenant.clone(),
            pool: state.pool.clone(),
            workflow: state.workflow.clone(),
            workflow_version: state.workflow_version,
            idempotency_key: request.key.clone(),
            decided_at: now,
        };
        let accepted = accepted(&decision, start.correlation_id.as_deref());
        let row = self.intent_row(state, seq, effects, accepted, now)?;
        writes.intents.push(row);
        if let Some(key) = &request.key
            && !routing::complete_in_tx(tx, &decision, key, self.completed_ttl).await?
        {
            writes.routing_lost = true;
        }
        Ok(Some(RouteOutcome::Decided { decision, kind }))
    }

    /// Folds one input into the in-memory runs and collects its writes.
    /// Returns the outcome and, when applied, how many effects it produced.
    fn fold_one(
        &self,
        input: &Input,
        source: Option<&Source>,
        runs: &mut HashMap<String, Loaded>,
        writes: &mut Writes,
        now: DateTime<Utc>,
    ) -> Result<(InputOutcome, usize), ApplyError> {
        let loaded = runs
            .get_mut(input.run_id())
            .expect("every input's run was looked up");
        let entropy = fresh_entropy();
        let decision = match (&loaded.state, &loaded.purged) {
            (None, Some(purged)) => fold_purged(purged, input),
            (state, _) => fold(
                state.as_ref(),
                input,
                &self.workflows,
                self.max_state_bytes,
                now,
                &entropy,
            ),
        };
        let transition = match decision {
            Decision::NoOp(reason) => return Ok((InputOutcome::NoOp(reason), 0)),
            Decision::Rejection(rejection) => return Ok((InputOutcome::Rejected(rejection), 0)),
            Decision::Transition(transition) => *transition,
        };
        let (seq, effects) = self.record(transition, source, loaded, writes)?;
        Ok((InputOutcome::Applied { seq }, effects))
    }

    /// Collects the writes of one transition of `loaded`'s run and makes
    /// its state the run's. Returns its seq and how many effects it made.
    fn record(
        &self,
        transition: Transition,
        source: Option<&Source>,
        loaded: &mut Loaded,
        writes: &mut Writes,
    ) -> Result<(i64, usize), ApplyError> {
        let state = transition.state;
        let record = transition.record;
        let seq = record.seq;
        writes.transitions.push(TransitionRow {
            run_id: state.run_id.clone(),
            seq,
            input_ref: record.input_ref,
            kind: record.kind.as_str(),
            from_status: record.from_status.map(RunStatus::as_str),
            to_status: record.to_status.as_str(),
            step_index: record.step_index as i32,
            detail: serde_json::to_string(&record.detail)?,
            source: source.cloned(),
            at: record.at,
        });
        for write in transition.attempt_writes {
            writes.attempt(&state.run_id, write);
        }
        let effects = transition.effects.len();
        for (index, effect) in transition.effects.into_iter().enumerate() {
            writes
                .intents
                .push(self.intent_row(&state, seq, index, effect, record.at)?);
        }
        loaded.state = Some(state);
        loaded.changed = true;
        Ok((seq, effects))
    }

    fn intent_row(
        &self,
        state: &RunState,
        seq: i64,
        index: usize,
        effect: Effect,
        at: DateTime<Utc>,
    ) -> Result<IntentRow, ApplyError> {
        let key = idempotency_key(&state.run_id, seq, index);
        let topic = effect.target.topic(&self.topics);
        let origin = EffectOrigin {
            run_id: &state.run_id,
            tenant: &state.tenant,
            workflow: &state.workflow,
            workflow_version: state.workflow_version,
            seq,
            at,
        };
        let headers = effect_headers(&origin, &key, effect.kind.ce_type());
        let cancel_key = match (&effect.target, effect.payload.get("timer")) {
            (EffectTarget::Wakeups, Some(timer)) if timer == "timeout" => effect
                .payload
                .get("stamp")
                .and_then(Value::as_str)
                .map(timeout_cancel_key),
            _ => None,
        };
        Ok(IntentRow {
            cancel_key,
            run_id: state.run_id.clone(),
            seq,
            effect_index: index as i32,
            idempotency_key: key,
            tenant: state.tenant.clone(),
            topic,
            message_key: state.run_id.as_bytes().to_vec(),
            headers,
            payload: serde_json::to_vec(&effect.payload)?,
            ce_type: effect.kind.ce_type().to_owned(),
            due: effect.not_before.is_none_or(|t| t <= at),
            not_before: effect.not_before.unwrap_or(at),
        })
    }
}

/// The `run.accepted` event that tells a routed start's caller its
/// decision: the last effect of the run's first transition.
fn accepted(decision: &routing::RoutingDecision, correlation_id: Option<&str>) -> Effect {
    let accepted = RunAccepted {
        schema_version: SCHEMA_VERSION,
        run_id: &decision.run_id,
        tenant: &decision.tenant,
        pool: &decision.pool,
        workflow: &decision.workflow,
        workflow_version: decision.workflow_version,
        idempotency_key: decision.idempotency_key.as_deref(),
        correlation_id,
    };
    Effect::now(EffectTarget::Events, EffectKind::RunAccepted, &accepted)
}

/// Whether the batch must be recomputed from the database: a cached state
/// that is stale (another writer moved the run on) would make its UPDATE
/// lose the race, but a verdict that writes nothing (a duplicate, a stale
/// or unknown stamp) would go unchecked.
fn unsure(
    inputs: &[PendingInput],
    outcomes: &[InputOutcome],
    runs: &HashMap<String, Loaded>,
) -> bool {
    inputs.iter().zip(outcomes).any(|(pending, outcome)| {
        !matches!(outcome, InputOutcome::Applied { .. })
            && runs
                .get(pending.input.run_id())
                .is_some_and(|loaded| loaded.cached)
    })
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

/// Intents a transaction inserted already claimed for the fast lane.
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::contract::RunStart;

    /// A started run of the example workflow, with `pad` bytes of input.
    pub(crate) fn started(run_id: &str, pad: usize) -> RunState {
        let workflows = crate::infra::workflows::load_dir(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/workflows"
        )))
        .expect("loading the example workflows");
        let input = Input::Start(RunStart {
            run_id: run_id.into(),
            tenant: "acme".into(),
            workflow: "example".into(),
            workflow_version: None,
            pool: "default".into(),
            input: Value::String("x".repeat(pad)),
            correlation_id: None,
        });
        let entropy = Entropy {
            stamp: Uuid::from_u128(1),
            jitter_unit: 0.5,
        };
        let now = DateTime::from_timestamp(1_800_000_000, 0).expect("a valid time");
        match fold(None, &input, &workflows, usize::MAX, now, &entropy) {
            Decision::Transition(t) => t.state,
            other => panic!("the start applies: {other:?}"),
        }
    }

    fn sized(state: RunState) -> (RunState, usize) {
        let size = serde_json::to_string(&state).unwrap().len();
        (state, size)
    }

    #[test]
    fn the_run_cache_is_bounded_in_bytes_and_starts_over_when_full() {
        let one = sized(started("a0", 1_000));
        let size = one.1;
        let cache = RunCache::new(1_000, size * 10 + size / 2);
        cache.put_many(vec![one]);
        assert_eq!(cache.bytes(), size);
        let more: Vec<_> = (0..9)
            .map(|k| sized(started(&format!("b{k}"), 1_000)))
            .collect();
        cache.put_many(more);
        assert_eq!(cache.bytes(), size * 10);
        assert_eq!(cache.get_many(["a0", "b8"].into_iter()).len(), 2);
        // The eleventh does not fit: the cache starts over with it.
        cache.put_many(vec![sized(started("c0", 1_000))]);
        assert_eq!(cache.bytes(), size);
        assert_eq!(cache.get_many(["a0", "c0"].into_iter()).len(), 1);
        // Replacing a run's state counts it once.
        cache.put_many(vec![sized(started("c0", 1_000))]);
        assert_eq!(cache.bytes(), size);
        cache.forget(["c0"].into_iter());
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn a_state_over_a_tenth_of_the_bound_is_not_cached() {
        let cache = RunCache::new(1_000, 20_000);
        cache.put_many(vec![sized(started("big", 5_000))]);
        assert_eq!(cache.bytes(), 0);
        assert!(cache.get_many(["big"].into_iter()).is_empty());
        cache.put_many(vec![sized(started("small", 10))]);
        assert_eq!(cache.get_many(["small"].into_iter()).len(), 1);
    }
}
