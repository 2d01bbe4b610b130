//! Recorded dead letters, and what an operator does with them: list and
//! count them, read one, replay one or a filtered set to the topic it was
//! read from, or discard one with a reason.
//!
//! The ingress's dead-letter writer ([`super::dead_letter`]) records every
//! letter in `dead_letters` before it publishes it to the dead-letter
//! topic ([`record`], [`store::insert`]); this module owns the table, and
//! the operator API, the CLI and the console act on it through
//! [`DeadLetters`], one handle built once.
//!
//! In: the caller's tenant scope, `Option<&str>`, which the caller's
//! credentials decide (a tenant's key: `Some(its tenant)`; an admin:
//! `None` for every tenant, or `Some(t)` to look at one), a
//! [`LetterFilter`], a [`Page`], a letter's id, a discard's reason. Out:
//! [`LetterPage`], [`ClassCount`]s, a [`Letter`], a [`ReplayOutcome`] or
//! [`ReplayBatch`], a [`DiscardOutcome`]; or a [`DeadLetterError`] the
//! caller branches on. Guarantees:
//! - a tenant's scope sees and acts on only the letters whose recorded
//!   tenant is its own; a letter of another tenant is [`DeadLetterError::NotFound`],
//!   as a missing one is;
//! - a letter is replayed at most once: the replay is claimed in its row
//!   (with a fresh replay id) before the record is produced and recorded
//!   after, so a second replay returns the first one's outcome and produces
//!   nothing; a replay cut short (a crash, a broker away) is finished by the
//!   next with the same replay id, and every copy of one replay carries
//!   that id, by which the ingress keys a start that names no key of its
//!   own, so that even two copies make one run;
//! - a discarded letter is never replayed, and a replayed one (or one a
//!   replay has claimed) is never discarded; a discard keeps its first
//!   reason;
//! - a replay sends the input's recorded key, value and headers byte for
//!   byte, signed again with its tenant's key ([`replay`] says why), to
//!   one of the input topics only, and only when the row holds them whole;
//! - every page is bounded by `dead_letters.max_page_rows` and keyset by
//!   id ([`query`]), so a listing costs the same at any depth.
//!
//! The decisions are pure ([`record`], [`query`], [`replay`]); [`store`]
//! holds the statements; [`retention`] deletes old letters.

pub mod query;
pub mod record;
pub mod replay;
pub mod retention;
pub mod store;
pub mod view;

use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::{Header as KafkaHeader, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

pub use query::{LetterFilter, LetterStatus, Order, Page};
// What the answers are made of, for the harnesses and the API's schemas.
#[cfg_attr(not(any(test, feature = "internals")), allow(unused_imports))]
pub use record::{Bytes, Header, LetterRow, Refused};
pub use replay::{
    DiscardOutcome, DiscardStatus, NotReplayable, ReplayBatch, ReplayOutcome, ReplayRefusal,
    ReplayStatus, RunReached,
};
#[cfg_attr(not(any(test, feature = "internals")), allow(unused_imports))]
pub use view::{ClassCount, DiscardState, Letter, LetterPage, LetterSummary, ReplayState};

use crate::config::{Config, SignaturesConfig};

/// Why an operation on a letter did not happen.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    /// No letter of this id in the caller's scope.
    #[error("no dead letter {0}")]
    NotFound(i64),
    /// A discarded letter is not replayed.
    #[error("dead letter {id} was discarded: {reason}")]
    Discarded { id: i64, reason: String },
    /// A letter a replay has claimed is not discarded.
    #[error("dead letter {0} has been replayed (or a replay of it is under way)")]
    Replayed(i64),
    /// The row does not hold what a replay needs.
    #[error("dead letter {id} cannot be replayed: {why}")]
    NotReplayable { id: i64, why: NotReplayable },
    /// A letter changed between a replay's claim and its reading back.
    #[error("dead letter {0} changed during its replay; try again")]
    Conflict(i64),
    /// A discard needs a reason.
    #[error("a discard needs a reason")]
    NoReason,
    #[error("reading or writing dead letters: {0}")]
    Database(#[from] sqlx::Error),
    #[error("producing a replay: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

/// The operations on recorded dead letters: one handle, built once.
#[derive(Clone)]
pub struct DeadLetters {
    pool: PgPool,
    /// A replay's producer: idempotent, the Java client's partitioner, and
    /// the dead-letter producer's limit and compression, so that an input
    /// that reached the broker compressed goes back whole.
    /// Made at the first replay (see [`LazyProducer`]).
    producer: crate::infra::kafka::LazyProducer,
    /// The topics a replay may produce to.
    inputs: Vec<String>,
    signatures: SignaturesConfig,
    max_page_rows: usize,
    /// Bound on a discard's reason: `coordinator.max_error_message_bytes`.
    max_reason_bytes: usize,
    timeout: Duration,
}

impl DeadLetters {
    pub fn new(config: &Config, pool: PgPool) -> anyhow::Result<DeadLetters> {
        Ok(DeadLetters {
            pool,
            producer: super::dead_letter::producer(config, "dlq-replay")?,
            inputs: config.topic_names().inputs(),
            signatures: config.signatures.clone(),
            max_page_rows: config.dead_letters.max_page_rows,
            max_reason_bytes: config.coordinator.max_error_message_bytes,
            timeout: Duration::from_millis(config.kafka.delivery_timeout_ms),
        })
    }

    /// The scope's letters that `filter` matches, newest first, one page.
    pub async fn list(
        &self,
        tenant: Option<&str>,
        filter: &LetterFilter,
        page: Page,
    ) -> Result<LetterPage, DeadLetterError> {
        let rows = page.rows(self.max_page_rows);
        let mut q = query::page(
            query::SUMMARY_COLUMNS,
            tenant,
            filter,
            page.cursor,
            Order::NewestFirst,
            rows,
        );
        let letters = q
            .build()
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(view::summary)
            .collect::<Result<Vec<_>, _>>()?;
        let next = (letters.len() == rows)
            .then(|| letters.last().map(|l| l.id))
            .flatten();
        Ok(LetterPage { letters, next })
    }

    /// The scope's letters that `filter` matches, counted by stage and
    /// class, the most numerous first.
    pub async fn counts(
        &self,
        tenant: Option<&str>,
        filter: &LetterFilter,
    ) -> Result<Vec<ClassCount>, DeadLetterError> {
        use sqlx::Row;
        let rows = query::counts(tenant, filter)
            .build()
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(ClassCount {
                    stage: r.try_get("stage")?,
                    class: r.try_get("class")?,
                    letters: r.try_get("letters")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// One letter of the scope, whole.
    pub async fn show(&self, tenant: Option<&str>, id: i64) -> Result<Letter, DeadLetterError> {
        let row = store::letter(&self.pool, tenant, id)
            .await?
            .ok_or(DeadLetterError::NotFound(id))?;
        Ok(view::letter(&row)?)
    }

    /// Replays letter `id` of the scope to the topic it was read from,
    /// once: a second call answers with the first one's outcome.
    pub async fn replay(
        &self,
        tenant: Option<&str>,
        id: i64,
    ) -> Result<ReplayOutcome, DeadLetterError> {
        let before = store::letter(&self.pool, tenant, id)
            .await?
            .ok_or(DeadLetterError::NotFound(id))?;
        if view::summary(&before)?.status == LetterStatus::Pending {
            // Refused before it is claimed, so that it stays pending (and
            // can still be discarded).
            self.outgoing(&store::stored(&before)?, uuid::Uuid::nil())?;
            store::claim(&self.pool, tenant, id, uuid::Uuid::new_v4()).await?;
        }
        let row = store::letter(&self.pool, tenant, id)
            .await?
            .ok_or(DeadLetterError::NotFound(id))?;
        let letter = view::letter(&row)?;
        let state = letter.summary.replay.as_ref();
        let replay_id = state.and_then(|r| uuid::Uuid::parse_str(&r.replay_id).ok());
        let replayed = state.is_some_and(|r| r.replayed_at.is_some());
        match replay::next(replay_id, replayed, letter.summary.discard.is_some()) {
            replay::Next::Produce(replay_id) => {
                let stored = store::stored(&row)?;
                let status = if self.produce(&stored, replay_id).await? {
                    ReplayStatus::Replayed
                } else {
                    // Another caller finished the same replay first: its
                    // record is the one the letter names.
                    ReplayStatus::AlreadyReplayed
                };
                let letter = self.show(tenant, id).await?;
                self.outcome(&letter, status).await
            }
            replay::Next::Answer => self.outcome(&letter, ReplayStatus::AlreadyReplayed).await,
            replay::Next::Discarded => Err(DeadLetterError::Discarded {
                id,
                reason: letter.summary.discard.map(|d| d.reason).unwrap_or_default(),
            }),
            replay::Next::Unclaimed => Err(DeadLetterError::Conflict(id)),
        }
    }

    /// Replays the scope's letters that `filter` matches and that are
    /// still to be replayed (pending, or a replay cut short), oldest first,
    /// at most one page of them; a letter that cannot be replayed is
    /// listed with the reason and the others go on.
    pub async fn replay_matching(
        &self,
        tenant: Option<&str>,
        filter: &LetterFilter,
        page: Page,
    ) -> Result<ReplayBatch, DeadLetterError> {
        let rows = page.rows(self.max_page_rows);
        let mut q = query::select("id", tenant, filter);
        q.push(" AND replayed_at IS NULL AND discarded_at IS NULL");
        if let Some(cursor) = page.cursor {
            q.push(" AND id > ").push_bind(cursor);
        }
        q.push(" ORDER BY id ASC LIMIT ").push_bind(rows as i64);
        let ids: Vec<i64> = q.build_query_scalar().fetch_all(&self.pool).await?;
        let mut batch = ReplayBatch {
            replayed: Vec::new(),
            refused: Vec::new(),
            next: (ids.len() == rows).then(|| ids.last().copied()).flatten(),
        };
        for id in ids {
            match self.replay(tenant, id).await {
                Ok(outcome) => batch.replayed.push(outcome),
                Err(
                    e @ (DeadLetterError::NotReplayable { .. }
                    | DeadLetterError::Discarded { .. }
                    | DeadLetterError::Conflict(_)),
                ) => batch.refused.push(ReplayRefusal {
                    id,
                    reason: e.to_string(),
                }),
                Err(e) => return Err(e),
            }
        }
        Ok(batch)
    }

    /// Discards letter `id` of the scope with `reason`, so that it is never
    /// replayed; a second discard answers with the first one's outcome.
    pub async fn discard(
        &self,
        tenant: Option<&str>,
        id: i64,
        reason: &str,
    ) -> Result<DiscardOutcome, DeadLetterError> {
        let reason = super::dead_letter::truncate(reason.trim(), self.max_reason_bytes);
        let reason = reason.replace('\0', "\u{FFFD}");
        if reason.is_empty() {
            return Err(DeadLetterError::NoReason);
        }
        let now = store::discard(&self.pool, tenant, id, &reason).await?;
        let letter = self.show(tenant, id).await?;
        match letter.summary.discard {
            Some(d) => Ok(DiscardOutcome {
                id,
                status: if now {
                    DiscardStatus::Discarded
                } else {
                    DiscardStatus::AlreadyDiscarded
                },
                discarded_at: d.discarded_at,
                reason: d.reason,
            }),
            None => Err(DeadLetterError::Replayed(id)),
        }
    }

    /// The record replay `replay_id` of `letter` produces, signed now.
    fn outgoing(
        &self,
        letter: &replay::Stored,
        replay_id: uuid::Uuid,
    ) -> Result<replay::Outgoing, DeadLetterError> {
        let now_ms = chrono::Utc::now().timestamp_millis();
        replay::outgoing(letter, replay_id, &self.inputs, &self.signatures, now_ms)
            .map_err(|why| DeadLetterError::NotReplayable { id: letter.id, why })
    }

    /// Produces replay `replay_id` of `letter` and records where it
    /// landed; false when another caller of the same replay recorded first.
    async fn produce(
        &self,
        letter: &replay::Stored,
        replay_id: uuid::Uuid,
    ) -> Result<bool, DeadLetterError> {
        let out = self.outgoing(letter, replay_id)?;
        let mut headers = OwnedHeaders::new_with_capacity(out.headers.len());
        for (key, value) in &out.headers {
            headers = headers.insert(KafkaHeader {
                key,
                value: value.as_deref(),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&out.topic).headers(headers);
        if let Some(key) = &out.key {
            record = record.key(key);
        }
        if let Some(value) = &out.value {
            record = record.payload(value);
        }
        let producer = self
            .producer
            .get()
            .map_err(|e| KafkaError::ClientCreation(format!("{e:#}")))?;
        let delivery = producer
            .send(record, self.timeout)
            .await
            .map_err(|(e, _)| e)?;
        let at = (delivery.partition, delivery.offset);
        let first = store::replayed(&self.pool, letter.id, replay_id, at, out.signed).await?;
        tracing::info!(
            letter = letter.id,
            replay_id = %replay_id,
            topic = out.topic,
            partition = at.0,
            offset = at.1,
            "dead letter replayed"
        );
        metrics::counter!("ductor_dead_letters_replayed_total").increment(1);
        Ok(first)
    }

    /// The outcome of `letter`'s recorded replay, with its run as it
    /// stands now.
    async fn outcome(
        &self,
        letter: &Letter,
        status: ReplayStatus,
    ) -> Result<ReplayOutcome, DeadLetterError> {
        let s = &letter.summary;
        let state = s.replay.as_ref();
        let (Some(state), Some(replayed_at), Some(partition), Some(offset)) = (
            state,
            state.and_then(|r| r.replayed_at),
            state.and_then(|r| r.partition),
            state.and_then(|r| r.offset),
        ) else {
            return Err(DeadLetterError::Conflict(s.id));
        };
        let run = match &s.run_id {
            Some(run_id) => Some(RunReached {
                run_id: run_id.clone(),
                exists: store::run_exists(&self.pool, run_id, s.tenant.as_deref()).await?,
            }),
            None => None,
        };
        Ok(ReplayOutcome {
            id: s.id,
            status,
            replay_id: state.replay_id.clone(),
            topic: s.source_topic.clone(),
            partition,
            offset,
            replayed_at,
            signed: state.signed.unwrap_or(false),
            run,
        })
    }
}
