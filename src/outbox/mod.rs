//! The outbox drainer: publishes committed effect intents to Kafka, at least
//! once, in transition order per run and topic.
//!
//! A round claims a bounded batch of due intents (`not_before <= now()`) with
//! `FOR UPDATE SKIP LOCKED`, skipping any intent that still has an earlier,
//! due, undelivered intent of the same run and topic which this round did not
//! also claim — that earlier one is in another drainer's hands, and
//! publishing past it would reorder the run's effects. Claimed intents are
//! grouped into chains (one per run and topic) that are published
//! concurrently; inside a chain each publish waits for the broker's
//! acknowledgement before the next one starts, and a failure releases the
//! rest of the chain back to `pending`. Intents are marked `completed` only
//! after their acknowledgement.
//!
//! The fast lane skips the claim for the common case. When the drainer runs
//! in the coordinator's process, the apply transaction inserts each due
//! intent that has no earlier undelivered intent of its run and topic
//! already `claimed` by this drainer, and hands it over in memory right
//! after the commit ([`Handoff`]): it is published at once, with no claim
//! statement and no round to wait for, and marked completed after its
//! acknowledgement like any other claim. If the process dies first, the
//! lease expires and the reconciler redrives it.
//!
//! Rounds are triggered by an in-process wake-up right after a coordinator
//! commit, by Postgres `LISTEN/NOTIFY` for commits of other processes, by the
//! next timer falling due, and by a periodic poll as the safety net. A
//! reconciler returns intents whose claim lease expired (their drainer died)
//! to `pending`; retention deletes completed intents in bounded batches.

pub mod frontier;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use futures::future::join_all;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;

use sqlx::postgres::PgListener;
use sqlx::{PgPool, Row};
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use self::frontier::Frontier;
use crate::config::DrainerConfig;
use crate::contract::effects::{EffectParked, to_value};
use crate::contract::input::SCHEMA_VERSION;
use crate::contract::names::parked_notice_key;
use crate::contract::{EffectKind, headers};

/// The channel the apply layer notifies after committing intents.
pub const NOTIFY_CHANNEL: &str = "ductor_effect_intent";

/// An intent's headers in the order every delivery of it carries them:
/// by name, byte for byte. The stored `jsonb` object keeps its own key
/// order, and the fast lane holds the headers as they were built, so both
/// publish paths put them in this one order, and a redelivery is
/// byte-identical to the first delivery, headers and all.
pub(crate) fn ordered_headers(headers: &serde_json::Map<String, Value>) -> Vec<(String, String)> {
    let mut list: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect();
    list.sort();
    list
}

/// Claims due intents, never past an earlier undelivered intent of the same
/// run and topic.
///
/// The `OFFSET 0` keeps the ordering check a per-candidate probe of the
/// run-order index on (run_id, topic, seq, effect_index). Without it Postgres
/// may turn the check into an anti-join, and with an estimate of one
/// candidate (statistics lag behind a queue table) it chose an inner scan of
/// the whole index with no index condition, once per candidate: 60 ms claim
/// rounds with 200 undelivered intents, and quadratic beyond.
///
/// A step's timeout timer waits, besides, for the other effects of its
/// transition (the step's dispatch above all): a timer must not end an
/// attempt whose dispatch no worker could have seen yet; and for the
/// results frontier (`$4`, see [`crate::outbox::frontier`]) to pass its deadline: a
/// timer must not beat a result the worker sent in time.
const CLAIM_SQL: &str = "WITH candidate AS ( \
     SELECT intent_id, run_id, topic, seq, effect_index, cancel_key \
     FROM eec_effect_intent \
     WHERE status = 'pending' AND not_before <= now() \
       AND (deferred_until IS NULL OR deferred_until <= now()) \
       AND (cancel_key IS NULL OR $4::timestamptz IS NULL OR not_before <= $4) \
     ORDER BY not_before, intent_id \
     LIMIT $1 \
     FOR UPDATE SKIP LOCKED \
 ), claimable AS ( \
     SELECT c.intent_id FROM candidate c \
     WHERE NOT EXISTS ( \
         SELECT 1 FROM eec_effect_intent e \
         WHERE e.run_id = c.run_id AND e.topic = c.topic \
           AND e.status <> 'completed' AND e.status <> 'parked' \
           AND (e.not_before <= now() OR e.attempts > 0) \
           AND (e.seq, e.effect_index) < (c.seq, c.effect_index) \
           AND e.intent_id NOT IN (SELECT intent_id FROM candidate) \
         OFFSET 0) \
     AND NOT (c.cancel_key IS NOT NULL AND EXISTS ( \
         SELECT 1 FROM eec_effect_intent d \
         WHERE d.run_id = c.run_id AND d.seq = c.seq AND d.intent_id <> c.intent_id \
           AND d.status <> 'completed' AND d.status <> 'parked' \
         OFFSET 0)) \
 ) \
 UPDATE eec_effect_intent i \
 SET status = 'claimed', claimed_by = $2, \
     claim_expires_at = now() + make_interval(secs => $3), \
     attempts = i.attempts + 1 \
 FROM claimable \
 WHERE i.intent_id = claimable.intent_id \
 RETURNING i.intent_id, i.run_id, i.seq, i.effect_index, i.topic, i.message_key, \
     i.headers, i.payload, i.not_before, i.created_at, i.publish_failures";

/// Gives claimed intents back: `$1` ids, `$2` errors, `$3` causes
/// ([`Cause::as_str`]); a permanent failure that makes `$4` parks the
/// intent; a failure defers it (`deferred_until`) by `$5` seconds doubled
/// per claim so far, at most `$6`; only this drainer's (`$7`) claims.
const RELEASE_SQL: &str = "UPDATE eec_effect_intent i SET \
     status = CASE WHEN u.cause = 'permanent' AND i.publish_failures + 1 >= $4 \
         THEN 'parked' ELSE 'pending' END, \
     parked_at = CASE WHEN u.cause = 'permanent' AND i.publish_failures + 1 >= $4 \
         THEN now() END, \
     publish_failures = i.publish_failures + CASE WHEN u.cause = 'permanent' THEN 1 ELSE 0 END, \
     deferred_until = CASE WHEN u.cause = 'not_tried' THEN i.deferred_until \
         ELSE now() + make_interval(secs => LEAST($6::float8, \
             $5::float8 * power(2, LEAST(GREATEST(i.attempts, 1), 30) - 1))) END, \
     claimed_by = NULL, claim_expires_at = NULL, last_error = left(u.error, 1024) \
 FROM UNNEST($1::int8[], $2::text[], $3::text[]) AS u(intent_id, error, cause) \
 WHERE i.intent_id = u.intent_id AND i.claimed_by = $7 \
   AND CASE WHEN i.status = 'claimed' THEN true END \
 RETURNING i.intent_id, i.run_id, i.seq, i.effect_index, i.tenant_scope, i.idempotency_key, \
     i.topic, i.headers, i.status, i.last_error";

/// Writes the notices of parked effects, each at most once (`$1`.. the
/// columns, see [`ParkedNotice`]).
const NOTICE_SQL: &str = "INSERT INTO eec_effect_intent (run_id, seq, effect_index, \
     idempotency_key, tenant_scope, topic, message_key, headers, payload, ce_type, not_before) \
 SELECT n.run_id, n.seq, n.effect_index, n.key, n.tenant, n.topic, convert_to(n.run_id, 'UTF8'), \
     n.headers::jsonb, convert_to(n.payload, 'UTF8'), $9, now() \
 FROM UNNEST($1::text[], $2::int8[], $3::int4[], $4::text[], $5::text[], $6::text[], \
     $7::text[], $8::text[]) AS n(run_id, seq, effect_index, key, tenant, topic, headers, payload) \
 ON CONFLICT DO NOTHING";

/// A parked effect's notice takes the effect's place in its transition
/// shifted by this, so that it has a position of its own.
const NOTICE_INDEX_OFFSET: i32 = 1 << 20;
/// Longest error text a notice carries.
const MAX_NOTICE_ERROR_LEN: usize = 512;

/// An intent's place in its run's history, unique among intents: the
/// transition that made it and its index among that transition's effects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntentPosition {
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
}

/// What a parked intent's release returned, for its notice.
#[derive(Debug, Clone)]
pub struct Parked {
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
    pub tenant: String,
    pub key: String,
    pub topic: String,
    pub headers: serde_json::Map<String, Value>,
    pub error: String,
}

/// The event that tells a run's followers that one of its effects was
/// parked: on the events topic, keyed by the run, with the effect's
/// headers but an idempotency key, id, type and time of its own, and the
/// effect's position, topic and error in its payload.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkedNotice {
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
    pub key: String,
    pub tenant: String,
    pub topic: String,
    pub headers: Value,
    pub payload: Value,
}

/// The notice of `parked`, on `events_topic`, at `now`.
pub fn parked_notice(parked: &Parked, events_topic: &str, now: DateTime<Utc>) -> ParkedNotice {
    let key = parked_notice_key(&parked.key);
    let mut headers = parked.headers.clone();
    let at = now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let ce_type = EffectKind::EffectParked.ce_type();
    for (name, value) in [
        (headers::IDEMPOTENCY_KEY, key.as_str()),
        (headers::CE_ID, key.as_str()),
        (headers::CE_TYPE, ce_type),
        (headers::CE_TIME, at.as_str()),
    ] {
        headers.insert(name.to_string(), Value::String(value.to_string()));
    }
    let mut error = parked.error.clone();
    if let Some((cut, _)) = error.char_indices().nth(MAX_NOTICE_ERROR_LEN) {
        error.truncate(cut);
    }
    let payload = EffectParked {
        schema_version: SCHEMA_VERSION,
        run_id: &parked.run_id,
        tenant: &parked.tenant,
        seq: parked.seq,
        effect_index: parked.effect_index,
        topic: &parked.topic,
        error: &error,
        at: &at,
    };
    ParkedNotice {
        run_id: parked.run_id.clone(),
        seq: parked.seq,
        effect_index: parked.effect_index.saturating_add(NOTICE_INDEX_OFFSET),
        key,
        tenant: parked.tenant.clone(),
        topic: events_topic.to_string(),
        headers: Value::Object(headers),
        payload: to_value(&payload),
    }
}

/// Why a claimed intent was not published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// The broker or the producer failed in a way that may pass (a broker
    /// away, a timeout, a leader election).
    Transient,
    /// It can never be published as it is: too large, its topic unknown or
    /// invalid, or not authorised.
    Permanent,
    /// Not tried: an earlier effect of its chain failed, or its claim was
    /// given back unused.
    NotTried,
}

impl Cause {
    fn as_str(self) -> &'static str {
        match self {
            Cause::Transient => "transient",
            Cause::Permanent => "permanent",
            Cause::NotTried => "not_tried",
        }
    }
}

/// A claimed intent given back, and why.
#[derive(Debug, Clone)]
struct Unpublished {
    intent_id: i64,
    error: String,
    cause: Cause,
}

impl Unpublished {
    fn new(intent_id: i64, error: impl Into<String>, cause: Cause) -> Self {
        Unpublished {
            intent_id,
            error: error.into(),
            cause,
        }
    }
}

/// What a release did.
#[derive(Debug, Default)]
struct Released {
    pending: usize,
    parked: usize,
    transient: usize,
}

/// Whether a publish failure can only repeat: the record is too large for
/// the producer or the broker, the topic does not exist or is invalid, or
/// the producer may not write it.
fn is_permanent(error: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        error.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::MessageBatchTooLarge
                | Code::InvalidRecord
                | Code::UnknownTopic
                | Code::UnknownTopicOrPartition
                | Code::InvalidTopic
                | Code::TopicAuthorizationFailed
        )
    )
}

/// The record of an effect: its topic, key, payload and headers, as every
/// delivery of it carries them.
fn effect_record(intent: &ClaimedIntent) -> FutureRecord<'_, Vec<u8>, Vec<u8>> {
    let mut headers = OwnedHeaders::new_with_capacity(intent.headers.len());
    for (k, v) in &intent.headers {
        headers = headers.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    FutureRecord::to(&intent.topic)
        .key(&intent.message_key)
        .payload(&intent.payload)
        .headers(headers)
}

/// Logs a delivered effect and measures how long its publish took and how
/// long after it was due it went out.
fn note_delivered(
    intent: &ClaimedIntent,
    delivery: &rdkafka::producer::future_producer::Delivery,
    started: Instant,
) {
    // Where the broker says the effect landed: with it, an effect that is
    // completed but missing from its topic can be looked for at its
    // partition and offset.
    tracing::debug!(
        intent_id = intent.intent_id,
        topic = %intent.topic,
        partition = delivery.partition,
        offset = delivery.offset,
        "effect delivered"
    );
    metrics::histogram!("ductor_outbox_publish_seconds").record(started.elapsed().as_secs_f64());
    let due = intent.not_before.max(intent.created_at);
    let lag = (Utc::now() - due).num_microseconds().unwrap_or(0).max(0);
    metrics::histogram!("ductor_outbox_dispatch_lag_seconds").record(lag as f64 / 1e6);
}

/// Logs and counts a failed publish, and says why the intent stays
/// undelivered: it and the rest of its chain go back to pending.
fn note_publish_failure(intent: &ClaimedIntent, e: rdkafka::error::KafkaError) -> Unpublished {
    let cause = if is_permanent(&e) {
        Cause::Permanent
    } else {
        Cause::Transient
    };
    tracing::warn!(
        intent_id = intent.intent_id,
        run_id = %intent.run_id,
        topic = %intent.topic,
        error = %e,
        cause = cause.as_str(),
        "publishing effect failed; it and the rest of its chain go back to pending"
    );
    metrics::counter!("ductor_outbox_publish_failures_total", "cause" => cause.as_str())
        .increment(1);
    Unpublished::new(intent.intent_id, e.to_string(), cause)
}

/// Marks published intents completed, only while this drainer's claim
/// stands. `ductor-bench` runs the same statement for its baseline.
///
/// The status test is written as a `CASE` on purpose. A plain
/// `status = 'claimed'` implies the predicate of the partial index
/// `eec_effect_intent_run_order_idx` (`status <> 'completed'`), whose live
/// part is small, so the planner scanned all of it (with every entry left by
/// completed intents until the next vacuum) instead of probing the primary
/// key a few times: 250-700 buffers per call instead of about 20.
/// The `CASE` hides the implication, which leaves the primary key as the
/// only index that fits.
pub const COMPLETE_SQL: &str = "UPDATE eec_effect_intent SET status = 'completed', \
     completed_at = now(), claimed_by = NULL, claim_expires_at = NULL, last_error = NULL \
     WHERE intent_id = ANY($1) AND claimed_by = $2 \
       AND CASE WHEN status = 'claimed' THEN true END";

/// Hooks that let tests stop the drainer at a chosen point, as a crash would.
#[derive(Debug, Clone, Default)]
pub struct DrainerHooks {
    /// Return an error after the first publishes were acknowledged and before
    /// they are marked completed.
    pub fail_after_publish: bool,
}

/// One claimed intent, exactly as it will be published.
#[derive(Debug, Clone)]
pub struct ClaimedIntent {
    pub intent_id: i64,
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
    pub topic: String,
    pub message_key: Vec<u8>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
    pub not_before: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    /// Permanent-looking failures so far: such an intent is published
    /// alone (see [`Drainer::with_solo_producer`]).
    pub publish_failures: i32,
}

/// What one round did; tests drive the drainer round by round with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundOutcome {
    /// Nothing was due.
    Idle,
    /// Intents were claimed: how many were published and marked completed,
    /// how many were released after a failed publish (or parked), and how
    /// many of the failures were transient (the broker away, a timeout):
    /// only those slow the claim rounds down, since a permanent one is no
    /// sign that anything else would fail.
    Drained {
        completed: usize,
        released: usize,
        transient: usize,
    },
}

pub struct Drainer {
    pub pool: PgPool,
    pub producer: FutureProducer,
    pub config: DrainerConfig,
    /// Names this drainer's claims, so it completes only its own.
    pub drainer_id: String,
    pub publish_timeout: Duration,
    pub hooks: DrainerHooks,
    /// Due intents committed as `pending` behind an undelivered one, as the
    /// fast lane was told; cleared when a claim round finds none due.
    pending_behind: Arc<AtomicUsize>,
    /// When this drainer's heartbeats began to succeed without a break
    /// (Unix ms; 0 after a failed one).
    healthy_since_ms: AtomicI64,
    /// Publishes intents that failed as if for good, one at a time (see
    /// [`Drainer::with_solo_producer`]).
    solo: tokio::sync::Mutex<Option<FutureProducer>>,
    /// Timeout timers wait for it to pass their deadline.
    frontier: Frontier,
    /// The events topic, when parked effects get a notice there.
    parked_notices: Option<String>,
}

impl Drainer {
    pub fn new(
        pool: PgPool,
        producer: FutureProducer,
        config: DrainerConfig,
        publish_timeout: Duration,
    ) -> Self {
        let drainer_id = format!(
            "{}-{}-{}",
            hostname(),
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Drainer {
            pool,
            producer,
            config,
            drainer_id,
            publish_timeout,
            hooks: DrainerHooks::default(),
            pending_behind: Arc::new(AtomicUsize::new(0)),
            healthy_since_ms: AtomicI64::new(0),
            solo: tokio::sync::Mutex::new(None),
            frontier: Frontier::default(),
            parked_notices: None,
        }
    }

    /// Holds each step's timeout timer until `frontier` has passed its
    /// deadline (see [`crate::outbox::frontier`]).
    pub fn with_results_frontier(mut self, frontier: Frontier) -> Self {
        self.frontier = frontier;
        self
    }

    /// A producer of its own for intents whose publish failed as if for
    /// good (too large, say). The broker refuses a whole batch for one
    /// record in it, so a failure seen in a batch may be a neighbour's; one
    /// seen alone, on this producer, is the intent's own. Without it such
    /// intents are still sent one at a time, on the shared producer.
    pub fn with_solo_producer(self, producer: FutureProducer) -> Self {
        Drainer {
            solo: tokio::sync::Mutex::new(Some(producer)),
            ..self
        }
    }

    /// Claims due intents, publishes them, marks them completed.
    pub async fn drain_once(&self) -> anyhow::Result<RoundOutcome> {
        let claimed = self.claim().await?;
        if claimed.is_empty() {
            return Ok(RoundOutcome::Idle);
        }
        let (delivered, failed) = self.publish_all(&claimed).await;
        if self.hooks.fail_after_publish && !delivered.is_empty() {
            anyhow::bail!("test hook: stopped after publishing, before marking completed");
        }
        if !delivered.is_empty() {
            crate::crash_point!("drainer.after_publish");
        }
        let completed = self.complete(&delivered).await?;
        self.restart_late_clocks(&claimed, &delivered).await?;
        let released = if failed.is_empty() {
            Released::default()
        } else {
            self.release(&failed).await?
        };
        Ok(RoundOutcome::Drained {
            completed,
            released: released.pending + released.parked,
            transient: released.transient,
        })
    }

    async fn claim(&self) -> anyhow::Result<Vec<ClaimedIntent>> {
        let rows = sqlx::query(CLAIM_SQL)
            .bind(self.config.batch_max_intents as i64)
            .bind(&self.drainer_id)
            .bind(self.config.lease_ms as f64 / 1000.0)
            .bind(self.frontier.at())
            .fetch_all(&self.pool)
            .await
            .context("claiming due intents")?;
        let mut claimed = Vec::with_capacity(rows.len());
        for row in rows {
            let headers: Value = row.try_get("headers")?;
            let headers = headers.as_object().map(ordered_headers).unwrap_or_default();
            claimed.push(ClaimedIntent {
                intent_id: row.try_get("intent_id")?,
                run_id: row.try_get("run_id")?,
                seq: row.try_get("seq")?,
                effect_index: row.try_get("effect_index")?,
                topic: row.try_get("topic")?,
                message_key: row.try_get("message_key")?,
                headers,
                payload: row.try_get("payload")?,
                not_before: row.try_get("not_before")?,
                created_at: row.try_get("created_at")?,
                publish_failures: row.try_get("publish_failures")?,
            });
        }
        claimed.sort_by(|a, b| {
            (&a.run_id, &a.topic, a.seq, a.effect_index).cmp(&(
                &b.run_id,
                &b.topic,
                b.seq,
                b.effect_index,
            ))
        });
        Ok(claimed)
    }

    /// Publishes `intents` as chains, one per (run, topic) in (seq,
    /// effect_index) order, the chains concurrently. Returns the delivered
    /// ids and the ids left undelivered with their reason.
    async fn publish_all(&self, intents: &[ClaimedIntent]) -> (Vec<i64>, Vec<Unpublished>) {
        let mut chains: BTreeMap<(&str, &str), Vec<&ClaimedIntent>> = BTreeMap::new();
        for intent in intents {
            chains
                .entry((intent.run_id.as_str(), intent.topic.as_str()))
                .or_default()
                .push(intent);
        }
        for chain in chains.values_mut() {
            chain.sort_by_key(|i| (i.seq, i.effect_index));
        }
        let results = join_all(chains.into_values().map(|chain| self.publish_chain(chain))).await;
        let mut delivered = Vec::new();
        let mut failed = Vec::new();
        for (ok, err) in results {
            delivered.extend(ok);
            failed.extend(err);
        }
        (delivered, failed)
    }

    /// Publishes a chain in order; returns (delivered, not delivered) ids.
    async fn publish_chain(&self, chain: Vec<&ClaimedIntent>) -> (Vec<i64>, Vec<Unpublished>) {
        let mut delivered = Vec::with_capacity(chain.len());
        let mut failed = Vec::new();
        let mut iter = chain.into_iter();
        for intent in iter.by_ref() {
            match self.publish_one(intent).await {
                Ok(()) => delivered.push(intent.intent_id),
                Err(unpublished) => {
                    failed.push(unpublished);
                    break;
                }
            }
        }
        for rest in iter {
            failed.push(Unpublished::new(
                rest.intent_id,
                "an earlier effect of the chain failed",
                Cause::NotTried,
            ));
        }
        (delivered, failed)
    }

    /// Publishes one intent and waits for the broker's acknowledgement; an
    /// intent that failed before goes through the solo producer. A failure
    /// comes back as the reason it stays undelivered.
    async fn publish_one(&self, intent: &ClaimedIntent) -> Result<(), Unpublished> {
        let record = effect_record(intent);
        let started = Instant::now();
        let sent = if intent.publish_failures > 0 {
            // One at a time, so that the batch it goes in is its own.
            let solo = self.solo.lock().await;
            solo.as_ref()
                .unwrap_or(&self.producer)
                .send(record, self.publish_timeout)
                .await
        } else {
            self.producer.send(record, self.publish_timeout).await
        };
        match sent {
            Ok(delivery) => {
                note_delivered(intent, &delivery, started);
                Ok(())
            }
            Err((e, _)) => Err(note_publish_failure(intent, e)),
        }
    }

    async fn complete(&self, ids: &[i64]) -> anyhow::Result<usize> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(COMPLETE_SQL)
            .bind(ids)
            .bind(&self.drainer_id)
            .execute(&self.pool)
            .await
            .context("marking intents completed")?
            .rows_affected();
        if done as usize != ids.len() {
            // Our lease expired and the reconciler handed some to another
            // drainer: they will be published again, with the same key.
            tracing::warn!(
                expected = ids.len(),
                done,
                "some claims expired before completion; they will be redelivered"
            );
        }
        metrics::counter!("ductor_outbox_completed_total").increment(done);
        Ok(done as usize)
    }

    /// Gives intents that were not published back to the claim rounds. One
    /// that failed waits out a backoff (`deferred_until`, so it is not the
    /// first claimed in every round, and the effects behind it in its run
    /// and topic wait too); one that failed permanently
    /// `park_after_failures` times is parked instead.
    async fn release(&self, failed: &[Unpublished]) -> anyhow::Result<Released> {
        let ids: Vec<i64> = failed.iter().map(|f| f.intent_id).collect();
        let errors: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
        let causes: Vec<&str> = failed.iter().map(|f| f.cause.as_str()).collect();
        let mut tx = self
            .pool
            .begin()
            .await
            .context("releasing failed intents")?;
        let rows = sqlx::query(RELEASE_SQL)
            .bind(&ids)
            .bind(&errors)
            .bind(&causes)
            .bind(self.config.park_after_failures as i32)
            .bind(self.config.publish_retry_min_ms as f64 / 1000.0)
            .bind(self.config.max_backoff_ms as f64 / 1000.0)
            .bind(&self.drainer_id)
            .fetch_all(&mut *tx)
            .await
            .context("releasing failed intents")?;
        let mut notices = Vec::new();
        let mut released = Released {
            transient: failed
                .iter()
                .filter(|f| f.cause == Cause::Transient)
                .count(),
            ..Released::default()
        };
        for row in rows {
            let status: String = row.try_get("status")?;
            if status != "parked" {
                released.pending += 1;
                continue;
            }
            released.parked += 1;
            let run_id: String = row.try_get("run_id")?;
            let topic: String = row.try_get("topic")?;
            let error: Option<String> = row.try_get("last_error")?;
            tracing::error!(
                intent_id = row.try_get::<i64, _>("intent_id")?,
                run_id = %run_id,
                topic = %topic,
                error = error.as_deref().unwrap_or_default(),
                "effect parked: it cannot be published as it is; fix the cause, then `ductor outbox redrive`"
            );
            metrics::counter!("ductor_outbox_parked_total").increment(1);
            match &self.parked_notices {
                // A notice of a notice, or of an event the events topic
                // refused, would be refused as well.
                Some(events) if &topic != events => {
                    let headers: Value = row.try_get("headers")?;
                    let parked = Parked {
                        run_id,
                        seq: row.try_get("seq")?,
                        effect_index: row.try_get("effect_index")?,
                        tenant: row.try_get("tenant_scope")?,
                        key: row.try_get("idempotency_key")?,
                        topic,
                        headers: headers.as_object().cloned().unwrap_or_default(),
                        error: error.unwrap_or_default(),
                    };
                    notices.push(parked_notice(&parked, events, Utc::now()));
                }
                _ => {}
            }
        }
        if !notices.is_empty() {
            insert_notices(&mut tx, &notices).await?;
        }
        tx.commit().await.context("releasing failed intents")?;
        Ok(released)
    }

    /// Publishes a notice of every effect parked from now on, on
    /// `events_topic` (the run's followers learn of it there).
    pub fn with_parked_notices(mut self, events_topic: String) -> Self {
        self.parked_notices = Some(events_topic);
        self
    }

    /// Gives back this drainer's claims at the given positions, if any.
    async fn release_at(&self, positions: &[IntentPosition]) -> anyhow::Result<usize> {
        let runs: Vec<&str> = positions.iter().map(|p| p.run_id.as_str()).collect();
        let seqs: Vec<i64> = positions.iter().map(|p| p.seq).collect();
        let indexes: Vec<i32> = positions.iter().map(|p| p.effect_index).collect();
        let released = sqlx::query(
            "UPDATE eec_effect_intent i SET status = 'pending', claimed_by = NULL, \
                 claim_expires_at = NULL, last_error = $4 \
             FROM UNNEST($1::text[], $2::int8[], $3::int4[]) AS u(run_id, seq, effect_index) \
             WHERE i.run_id = u.run_id AND i.seq = u.seq AND i.effect_index = u.effect_index \
               AND i.claimed_by = $5 AND CASE WHEN i.status = 'claimed' THEN true END",
        )
        .bind(&runs)
        .bind(&seqs)
        .bind(&indexes)
        .bind("the batch statement's outcome was unknown")
        .bind(&self.drainer_id)
        .execute(&self.pool)
        .await
        .context("releasing the claims of an uncertain batch")?
        .rows_affected();
        Ok(released as usize)
    }

    /// Pushes back the timeout timers of the transitions whose effects were
    /// published late (more than [`crate::coordinator::LATE_DISPATCH_MS`]
    /// after they were committed: their first drainer died holding them),
    /// by as long as they were late, so the step keeps its whole timeout
    /// from the moment a worker could see its dispatch.
    async fn restart_late_clocks(
        &self,
        claimed: &[ClaimedIntent],
        delivered: &[i64],
    ) -> anyhow::Result<()> {
        let now = Utc::now();
        let late_after = chrono::TimeDelta::milliseconds(crate::coordinator::LATE_DISPATCH_MS);
        // Lateness first: it is rare, and cheap to test; the delivered
        // list is searched only for the few that are late.
        let mut late: Vec<(&str, i64)> = claimed
            .iter()
            .filter(|c| now - c.not_before.max(c.created_at) > late_after)
            .filter(|c| delivered.contains(&c.intent_id))
            .map(|c| (c.run_id.as_str(), c.seq))
            .collect();
        if late.is_empty() {
            return Ok(());
        }
        late.sort_unstable();
        late.dedup();
        let runs: Vec<&str> = late.iter().map(|l| l.0).collect();
        let seqs: Vec<i64> = late.iter().map(|l| l.1).collect();
        let pushed = sqlx::query(
            "UPDATE eec_effect_intent t \
             SET deferred_until = GREATEST(t.deferred_until, \
                 now() + (t.not_before - t.created_at)) \
             FROM UNNEST($1::text[], $2::int8[]) AS u(run_id, seq) \
             WHERE t.run_id = u.run_id AND t.seq = u.seq AND t.cancel_key IS NOT NULL \
               AND CASE WHEN t.status = 'pending' THEN true END",
        )
        .bind(&runs)
        .bind(&seqs)
        .execute(&self.pool)
        .await
        .context("restarting the step clocks of late dispatches")?
        .rows_affected();
        if pushed > 0 {
            tracing::info!(
                timers = pushed,
                "step clocks restarted for dispatches published late"
            );
            metrics::counter!("ductor_outbox_late_clocks_restarted_total").increment(pushed);
        }
        Ok(())
    }

    /// Records that this drainer is alive. A drainer's claims are given
    /// back once its heartbeat is older than `member_timeout_ms`.
    pub async fn heartbeat(&self) -> anyhow::Result<()> {
        let beat = sqlx::query(
            "INSERT INTO eec_drainer_member (drainer_id) VALUES ($1) \
             ON CONFLICT (drainer_id) DO UPDATE SET heartbeat_at = now()",
        )
        .bind(&self.drainer_id)
        .execute(&self.pool)
        .await;
        let now_ms = Utc::now().timestamp_millis();
        match beat {
            Ok(_) => {
                // The first beat after a failure starts a healthy stretch.
                let _ = self.healthy_since_ms.compare_exchange(
                    0,
                    now_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                Ok(())
            }
            Err(e) => {
                self.healthy_since_ms.store(0, Ordering::Relaxed);
                Err(anyhow::Error::new(e).context("recording the drainer's heartbeat"))
            }
        }
    }

    /// Whether this drainer has reached the database without a break for
    /// a member timeout: only then is another drainer's silent heartbeat a
    /// sign that it died, rather than that the database was away for
    /// everyone (after a Postgres restart every heartbeat is old).
    fn may_judge_members(&self) -> bool {
        let since = self.healthy_since_ms.load(Ordering::Relaxed);
        since > 0 && Utc::now().timestamp_millis() - since >= self.config.member_timeout_ms as i64
    }

    /// Returns to `pending` the intents whose claim lease expired, and those
    /// claimed by a drainer whose heartbeat stopped. Their drainer died or
    /// stalled; they are published again with the same key.
    pub async fn reconcile(&self) -> anyhow::Result<u64> {
        let judge = self.may_judge_members();
        let redriven = sqlx::query(
            "UPDATE eec_effect_intent i SET status = 'pending', claimed_by = NULL, \
                 claim_expires_at = NULL, last_error = CASE WHEN i.claim_expires_at < now() \
                     THEN 'claim lease expired' ELSE 'its drainer stopped' END \
             WHERE i.status = 'claimed' AND (i.claim_expires_at < now() \
                OR ($1 AND i.claimed_by IN ( \
                    SELECT m.drainer_id FROM eec_drainer_member m \
                    WHERE m.heartbeat_at < now() - make_interval(secs => $2) \
                      AND m.drainer_id <> $3)))",
        )
        .bind(judge)
        .bind(self.config.member_timeout_ms as f64 / 1000.0)
        .bind(&self.drainer_id)
        .execute(&self.pool)
        .await
        .context("redriving expired claims")?
        .rows_affected();
        if redriven > 0 {
            tracing::info!(redriven, "redrove intents whose claim lease expired");
            metrics::counter!("ductor_outbox_redrives_total").increment(redriven);
        }
        Ok(redriven)
    }

    /// Puts parked intents back into the claim rounds, due at once, with
    /// their failure count reset: for after the cause (a topic's limit, a
    /// missing topic, an ACL) was fixed. Only those of `run_id` or `topic`
    /// when given; returns how many.
    pub async fn redrive_parked(
        pool: &PgPool,
        run_id: Option<&str>,
        topic: Option<&str>,
    ) -> anyhow::Result<u64> {
        let redriven = sqlx::query(
            "UPDATE eec_effect_intent SET status = 'pending', parked_at = NULL, \
                 publish_failures = 0, deferred_until = NULL \
             WHERE status = 'parked' AND ($1::text IS NULL OR run_id = $1) \
               AND ($2::text IS NULL OR topic = $2)",
        )
        .bind(run_id)
        .bind(topic)
        .execute(pool)
        .await
        .context("redriving parked intents")?
        .rows_affected();
        if redriven > 0 {
            tracing::info!(redriven, "parked intents redriven");
        }
        Ok(redriven)
    }

    /// Deletes completed intents older than the retention, at most
    /// `purge_batch` rows per statement, until none are left or `max_rounds`.
    pub async fn purge(&self) -> anyhow::Result<u64> {
        let mut total = 0;
        for _ in 0..self.config.purge_max_rounds {
            let deleted = sqlx::query(
                "DELETE FROM eec_effect_intent WHERE intent_id IN ( \
                     SELECT intent_id FROM eec_effect_intent \
                     WHERE status = 'completed' \
                       AND completed_at < now() - make_interval(secs => $1) \
                     ORDER BY completed_at LIMIT $2)",
            )
            .bind(self.config.retention_ms as f64 / 1000.0)
            .bind(self.config.purge_batch as i64)
            .execute(&self.pool)
            .await
            .context("purging drained intents")?
            .rows_affected();
            total += deleted;
            if deleted < self.config.purge_batch as u64 {
                break;
            }
        }
        if total > 0 {
            tracing::debug!(purged = total, "purged drained intents");
        }
        // Drainers long gone; a claim of theirs was given back long ago.
        sqlx::query(
            "DELETE FROM eec_drainer_member \
             WHERE heartbeat_at < now() - make_interval(secs => $1)",
        )
        .bind(self.config.retention_ms as f64 / 1000.0)
        .execute(&self.pool)
        .await
        .context("purging departed drainers")?;
        Ok(total)
    }

    /// Updates the backlog gauges; returns when the next pending intent
    /// falls due, if any (a timeout held for the results frontier is not:
    /// the frontier's moving wakes the drainer).
    pub async fn observe_backlog(&self) -> anyhow::Result<Option<DateTime<Utc>>> {
        let row = sqlx::query(
            "SELECT count(*) FILTER (WHERE status <> 'parked') AS backlog, \
                 count(*) FILTER (WHERE status = 'parked') AS parked, \
                 count(*) FILTER (WHERE not_before <= now() AND status <> 'parked') AS due, \
                 EXTRACT(EPOCH FROM now() - min(not_before) \
                     FILTER (WHERE not_before <= now() AND status <> 'parked'))::float8 AS oldest_due_s, \
                 min(GREATEST(not_before, deferred_until)) FILTER (WHERE status = 'pending' \
                     AND (cancel_key IS NULL OR $1::timestamptz IS NULL OR not_before <= $1)) \
                     AS next_due \
             FROM eec_effect_intent WHERE status <> 'completed'",
        )
        .bind(self.frontier.at())
        .fetch_one(&self.pool)
        .await
        .context("measuring outbox backlog")?;
        let backlog: i64 = row.try_get("backlog")?;
        let due: i64 = row.try_get("due")?;
        let oldest: Option<f64> = row.try_get("oldest_due_s")?;
        let parked: i64 = row.try_get("parked")?;
        metrics::gauge!("ductor_outbox_backlog").set(backlog as f64);
        metrics::gauge!("ductor_outbox_parked").set(parked as f64);
        metrics::gauge!("ductor_outbox_due").set(due as f64);
        metrics::gauge!("ductor_outbox_oldest_due_age_seconds").set(oldest.unwrap_or(0.0));
        Ok(row.try_get("next_due")?)
    }
}

/// The drainer's wake-up sources, shared with the ingress.
#[derive(Clone, Default)]
pub struct Wakeup(Arc<Notify>);

impl Wakeup {
    /// Called after a commit that wrote intents.
    pub fn wake(&self) {
        self.0.notify_one();
    }

    pub async fn woken(&self) {
        self.0.notified().await
    }
}

/// How soon an idle round looks again when due intents are blocked behind
/// ones in flight (their completion wakes it sooner).
const BLOCKED_RETRY: Duration = Duration::from_millis(100);

/// Batches handed over at once before the apply waits for the fast lane.
const HANDOFF_QUEUE: usize = 64;
/// Handed-over batches being published at once.
const FAST_LANE_IN_FLIGHT: usize = 64;

/// The apply layer's side of the fast lane: who claims at insert, for how
/// long, and where the committed claims go.
#[derive(Clone)]
pub struct Handoff {
    drainer_id: String,
    lease_s: f64,
    poll_interval: chrono::Duration,
    sender: mpsc::Sender<Handed>,
    wakeup: Wakeup,
    /// Due intents committed as `pending` (they wait behind an undelivered
    /// one) since the fast lane last completed something.
    pending_behind: Arc<AtomicUsize>,
}

/// What the apply layer hands over after a transaction ended.
enum Handed {
    /// Committed and claimed by this drainer, the lease running since the
    /// instant given: publish now.
    Publish(Vec<ClaimedIntent>, Instant),
    /// The commit's outcome is unknown: give the claims back (a no-op if
    /// the transaction in fact rolled back).
    Release(Vec<i64>),
    /// A batch statement failed without its reply, which would have named
    /// the intents it claimed: give back, by position (run, seq, effect
    /// index), whatever it claimed if it committed after all.
    ReleaseAt(Vec<IntentPosition>),
}

/// The drainer's side of the fast lane.
pub struct FastLane {
    receiver: mpsc::Receiver<Handed>,
    pending_behind: Arc<AtomicUsize>,
}

impl Handoff {
    /// The claimer named in intents inserted as `claimed`.
    pub fn drainer_id(&self) -> &str {
        &self.drainer_id
    }

    /// The claim lease, in seconds.
    pub fn lease_s(&self) -> f64 {
        self.lease_s
    }

    /// After a commit: publish `claimed` now; wake the claim rounds when
    /// other due intents were committed as `pending`, or a timer falls due
    /// before their next poll would notice it.
    pub async fn committed(
        &self,
        claimed: Vec<ClaimedIntent>,
        leased_at: Instant,
        pending_due: usize,
        next_timer: Option<DateTime<Utc>>,
    ) {
        if pending_due > 0 {
            self.pending_behind
                .fetch_add(pending_due, Ordering::Relaxed);
            self.wakeup.wake();
        } else if next_timer.is_some_and(|t| t < Utc::now() + self.poll_interval) {
            self.wakeup.wake();
        }
        if claimed.is_empty() {
            return;
        }
        if self
            .sender
            .send(Handed::Publish(claimed, leased_at))
            .await
            .is_err()
        {
            // The drainer stopped: the claims expire and are redriven.
            tracing::debug!("fast lane closed; claims are left to the reconciler");
        }
    }

    /// After a commit whose outcome is unknown: hand the claims back.
    pub async fn uncertain(&self, claimed: Vec<i64>) {
        if !claimed.is_empty() && self.sender.send(Handed::Release(claimed)).await.is_err() {
            tracing::debug!("fast lane closed; claims are left to the reconciler");
        }
    }

    /// After a batch statement that failed without its reply: whatever it
    /// may have claimed at these positions goes back to the claim rounds at
    /// once, instead of waiting for the lease. Nothing of it was handed over,
    /// so nothing of it is in flight.
    pub async fn uncertain_at(&self, positions: Vec<IntentPosition>) {
        if !positions.is_empty()
            && self
                .sender
                .send(Handed::ReleaseAt(positions))
                .await
                .is_err()
        {
            tracing::debug!("fast lane closed; claims are left to the reconciler");
        }
    }
}

impl Drainer {
    /// The fast lane of this drainer: give the [`Handoff`] to the apply
    /// layer and the [`FastLane`] to [`run_with_fast_lane`].
    pub fn fast_lane(&self, wakeup: &Wakeup) -> (Handoff, FastLane) {
        let (sender, receiver) = mpsc::channel(HANDOFF_QUEUE);
        let pending_behind = self.pending_behind.clone();
        (
            Handoff {
                drainer_id: self.drainer_id.clone(),
                lease_s: self.config.lease_ms as f64 / 1000.0,
                poll_interval: chrono::Duration::milliseconds(self.config.poll_interval_ms as i64),
                sender,
                wakeup: wakeup.clone(),
                pending_behind: pending_behind.clone(),
            },
            FastLane {
                receiver,
                pending_behind,
            },
        )
    }

    /// Publishes one handed-over batch and passes what was delivered to
    /// the completer.
    async fn publish_handed(
        &self,
        claimed: Vec<ClaimedIntent>,
        leased_at: Instant,
        lane: &FastLaneShared,
    ) {
        // A publish must end before the lease does, or the reconciler could
        // hand the intent to another drainer while it is still in flight
        // (a duplicate that may land after a later effect). One that waited
        // too long in the lane goes back to the claim rounds instead.
        let lease = Duration::from_millis(self.config.lease_ms);
        if leased_at.elapsed() + self.publish_timeout >= lease {
            let late: Vec<Unpublished> = claimed
                .iter()
                .map(|c| {
                    Unpublished::new(
                        c.intent_id,
                        "waited too long in the fast lane",
                        Cause::NotTried,
                    )
                })
                .collect();
            if let Err(e) = self.release(&late).await {
                tracing::warn!(error = format!("{e:#}"), "releasing late intents failed");
            }
            lane.wakeup.wake();
            return;
        }
        let (delivered, failed) = self.publish_all(&claimed).await;
        metrics::counter!("ductor_outbox_fast_lane_total").increment(delivered.len() as u64);
        if let Err(e) = self.restart_late_clocks(&claimed, &delivered).await {
            tracing::warn!(
                error = format!("{e:#}"),
                "restarting late step clocks failed"
            );
        }
        if !delivered.is_empty() {
            crate::crash_point!("drainer.after_publish");
            // The completer outlives every publish task.
            let _ = lane.completions.send(delivered);
        }
        if !failed.is_empty() {
            if let Err(e) = self.release(&failed).await {
                tracing::warn!(error = format!("{e:#}"), "releasing failed intents failed");
            }
            lane.wakeup.wake();
        }
    }
}

struct FastLaneShared {
    completions: mpsc::UnboundedSender<Vec<i64>>,
    wakeup: Wakeup,
}

/// Marks what the fast lane delivered completed: everything that arrived
/// while the previous statement ran goes into the next one, so a busy lane
/// makes few, large updates instead of one per batch.
async fn completer(
    drainer: Arc<Drainer>,
    mut completions: mpsc::UnboundedReceiver<Vec<i64>>,
    pending_behind: Arc<AtomicUsize>,
    wakeup: Wakeup,
) {
    while let Some(first) = completions.recv().await {
        let mut ids = first;
        while ids.len() < drainer.config.batch_max_intents {
            match completions.try_recv() {
                Ok(more) => ids.extend(more),
                Err(_) => break,
            }
        }
        if let Err(e) = drainer.complete(&ids).await {
            // Left claimed: after the lease they are published again, with
            // the same key and bytes.
            tracing::warn!(
                error = format!("{e:#}"),
                "marking published intents completed failed"
            );
        }
        // Intents committed behind these may be claimable now.
        if pending_behind.load(Ordering::Relaxed) > 0 {
            wakeup.wake();
        }
    }
}

/// Publishes what the apply layer hands over until every [`Handoff`] is
/// gone (the ingress and the API stopped, so a batch committed during
/// shutdown is still published), then waits for the publishes in flight
/// and their completion.
async fn fast_lane(drainer: Arc<Drainer>, mut lane: FastLane, wakeup: Wakeup) {
    let (completions, completed) = mpsc::unbounded_channel();
    let completing = tokio::spawn(completer(
        drainer.clone(),
        completed,
        lane.pending_behind.clone(),
        wakeup.clone(),
    ));
    let shared = Arc::new(FastLaneShared {
        completions,
        wakeup,
    });
    let in_flight = Arc::new(Semaphore::new(FAST_LANE_IN_FLIGHT));
    let tasks = tokio_util::task::TaskTracker::new();
    while let Some(handed) = lane.receiver.recv().await {
        match handed {
            Handed::Publish(claimed, leased_at) => {
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                let (drainer, shared) = (drainer.clone(), shared.clone());
                tasks.spawn(async move {
                    drainer.publish_handed(claimed, leased_at, &shared).await;
                    drop(permit);
                });
            }
            Handed::Release(ids) => {
                let failed: Vec<Unpublished> = ids
                    .into_iter()
                    .map(|id| {
                        Unpublished::new(id, "the commit's outcome was unknown", Cause::NotTried)
                    })
                    .collect();
                if let Err(e) = drainer.release(&failed).await {
                    tracing::debug!(
                        error = format!("{e:#}"),
                        "giving back uncertain claims failed"
                    );
                }
                shared.wakeup.wake();
            }
            Handed::ReleaseAt(positions) => {
                if let Err(e) = drainer.release_at(&positions).await {
                    tracing::debug!(
                        error = format!("{e:#}"),
                        "giving back the claims of an uncertain batch failed"
                    );
                }
                shared.wakeup.wake();
            }
        }
    }
    tasks.close();
    tasks.wait().await;
    drop(shared);
    let _ = completing.await;
}

/// Runs the drainer, its listener, reconciler and retention until shutdown.
#[cfg(any(test, feature = "internals"))]
pub async fn run(
    drainer: Drainer,
    wakeup: Wakeup,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    run_with_fast_lane(drainer, wakeup, None, shutdown).await
}

/// [`run`], plus the fast lane for intents the apply layer hands over.
pub async fn run_with_fast_lane(
    drainer: Drainer,
    wakeup: Wakeup,
    lane: Option<FastLane>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // Announce this drainer before it claims anything, so that its claims
    // are given back promptly if it dies.
    if let Err(e) = drainer.heartbeat().await {
        tracing::warn!(error = format!("{e:#}"), "drainer heartbeat failed");
    }
    let drainer = Arc::new(drainer);
    let tracker = tokio_util::task::TaskTracker::new();
    if let Some(lane) = lane {
        let (drainer, wakeup) = (drainer.clone(), wakeup.clone());
        tracker.spawn(async move { fast_lane(drainer, lane, wakeup).await });
    }
    {
        let (pool, wakeup, shutdown) = (drainer.pool.clone(), wakeup.clone(), shutdown.clone());
        tracker.spawn(async move { listen(pool, wakeup, shutdown).await });
    }
    {
        let (drainer, shutdown) = (drainer.clone(), shutdown.clone());
        tracker.spawn(async move { maintenance(&drainer, shutdown).await });
    }
    tracker.close();
    let result = drain_loop(&drainer, &wakeup, &shutdown).await;
    // The helpers stop with the token; make sure they do if the loop failed.
    shutdown.cancel();
    tracker.wait().await;
    result
}

async fn drain_loop(
    drainer: &Drainer,
    wakeup: &Wakeup,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let poll = Duration::from_millis(drainer.config.poll_interval_ms);
    let mut failures: u32 = 0;
    while !shutdown.is_cancelled() {
        match drainer.drain_once().await {
            Ok(RoundOutcome::Drained { transient, .. }) => {
                if transient == 0 {
                    failures = 0;
                    continue;
                }
                failures = failures.saturating_add(1);
            }
            Ok(RoundOutcome::Idle) => {
                failures = 0;
                let observed = drainer.observe_backlog().await;
                let next_due = observed.as_ref().ok().copied().flatten();
                if observed.is_ok() && next_due.is_none_or(|t| t > Utc::now()) {
                    // Nothing pending is due: nothing waits behind the
                    // fast lane any more.
                    drainer.pending_behind.store(0, Ordering::Relaxed);
                }
                // Something due but unclaimable waits behind an intent in
                // flight: its completion wakes this loop, so do not spin.
                let wait = next_due
                    .map(|t| {
                        (t - Utc::now())
                            .to_std()
                            .unwrap_or(BLOCKED_RETRY)
                            .max(Duration::from_millis(1))
                    })
                    .map_or(poll, |d| d.min(poll));
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = wakeup.woken() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            Err(e) if drainer.hooks.fail_after_publish => return Err(e),
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::warn!(error = format!("{e:#}"), "drain round failed");
            }
        }
        // Back off after failures so a broker or database outage is not a
        // busy loop; any progress resets it.
        let backoff =
            Duration::from_millis((50u64 << failures.min(7)).min(drainer.config.max_backoff_ms));
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
    Ok(())
}

/// Forwards `NOTIFY ductor_effect_intent` to the wake-up, reconnecting with
/// backoff when the connection drops.
async fn listen(pool: PgPool, wakeup: Wakeup, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "outbox listener cannot connect, retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if let Err(e) = listener.listen(NOTIFY_CHANNEL).await {
            tracing::warn!(error = %e, "outbox listener cannot LISTEN, retrying");
            continue;
        }
        backoff = Duration::from_millis(100);
        // A notification may have been missed while disconnected.
        wakeup.wake();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                n = listener.try_recv() => match n {
                    Ok(Some(_)) => wakeup.wake(),
                    Ok(None) => { wakeup.wake(); }
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox listener lost its connection");
                        break;
                    }
                },
            }
        }
    }
}

async fn maintenance(drainer: &Drainer, shutdown: CancellationToken) {
    let mut reconcile =
        tokio::time::interval(Duration::from_millis(drainer.config.reconcile_interval_ms));
    let mut purge = tokio::time::interval(Duration::from_millis(drainer.config.purge_interval_ms));
    let mut observe =
        tokio::time::interval(Duration::from_millis(drainer.config.metrics_interval_ms));
    let mut heartbeat =
        tokio::time::interval(Duration::from_millis(drainer.config.heartbeat_interval_ms));
    for i in [&mut reconcile, &mut purge, &mut observe, &mut heartbeat] {
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = heartbeat.tick() => {
                if let Err(e) = drainer.heartbeat().await {
                    tracing::warn!(error = format!("{e:#}"), "drainer heartbeat failed");
                }
            }
            _ = reconcile.tick() => {
                if let Err(e) = drainer.reconcile().await {
                    tracing::warn!(error = format!("{e:#}"), "reconciler round failed");
                }
            }
            _ = purge.tick() => {
                if let Err(e) = drainer.purge().await {
                    tracing::warn!(error = format!("{e:#}"), "outbox retention round failed");
                }
            }
            _ = observe.tick() => {
                if let Err(e) = drainer.observe_backlog().await {
                    tracing::debug!(error = format!("{e:#}"), "backlog metrics skipped");
                }
            }
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "ductor".to_string())
}

/// Writes `notices` as intents due now, each at most once.
async fn insert_notices(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    notices: &[ParkedNotice],
) -> anyhow::Result<()> {
    let col = |f: fn(&ParkedNotice) -> String| notices.iter().map(f).collect::<Vec<String>>();
    sqlx::query(NOTICE_SQL)
        .bind(col(|n| n.run_id.clone()))
        .bind(notices.iter().map(|n| n.seq).collect::<Vec<i64>>())
        .bind(notices.iter().map(|n| n.effect_index).collect::<Vec<i32>>())
        .bind(col(|n| n.key.clone()))
        .bind(col(|n| n.tenant.clone()))
        .bind(col(|n| n.topic.clone()))
        .bind(col(|n| n.headers.to_string()))
        .bind(col(|n| n.payload.to_string()))
        .bind(EffectKind::EffectParked.ce_type())
        .execute(&mut **tx)
        .await
        .context("writing the notices of parked effects")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_effect_s_notice_has_its_own_key_type_and_place() {
        let mut headers = serde_json::Map::new();
        for (k, v) in [
            ("idempotency-key", "r1/3/2"),
            ("ce_id", "r1/3/2"),
            ("ce_type", "ductor.run.output"),
            ("ce_time", "2026-01-01T00:00:00.000000Z"),
            ("ductor-run-id", "r1"),
            ("ductor-tenant", "acme"),
        ] {
            headers.insert(k.into(), Value::String(v.into()));
        }
        let parked = Parked {
            run_id: "r1".into(),
            seq: 3,
            effect_index: 2,
            tenant: "acme".into(),
            key: "r1/3/2".into(),
            topic: "ductor.outputs".into(),
            headers,
            error: "x".repeat(2_000),
        };
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let n = parked_notice(&parked, "ductor.events", now);
        assert_eq!(n.key, "r1/3/2/parked");
        assert_eq!(n.topic, "ductor.events");
        assert_eq!((n.seq, n.effect_index), (3, 2 + NOTICE_INDEX_OFFSET));
        assert_eq!(n.headers["idempotency-key"], "r1/3/2/parked");
        assert_eq!(n.headers["ce_id"], "r1/3/2/parked");
        assert_eq!(n.headers["ce_type"], "ductor.run.effect_parked");
        assert_eq!(n.headers["ductor-run-id"], "r1");
        assert_eq!(n.payload["type"], "run.effect_parked");
        assert_eq!(n.payload["topic"], "ductor.outputs");
        assert_eq!(n.payload["effect_index"], 2);
        assert_eq!(
            n.payload["error"].as_str().unwrap().len(),
            MAX_NOTICE_ERROR_LEN
        );
        // The same effect parked again gets the same notice.
        assert_eq!(parked_notice(&parked, "ductor.events", now), n);
    }
}
