//! The database side of a round: claiming due intents, marking the
//! published ones completed, and giving back the ones that were not.
//!
//! In: the due `pending` rows of `eec_effect_intent`; after the publish,
//! the ids the broker acknowledged and the [`Unpublished`] ones with their
//! cause. Out: [`ClaimedIntent`]s sorted by run, topic and position, each
//! exactly as it will be published; how many were completed; what a
//! release did ([`Released`]).
//!
//! Guarantees: a claim never passes an earlier, due, undelivered intent of
//! the same run and topic that it did not claim too (another drainer holds
//! it), and a step's timeout timer waits for the rest of its transition
//! and for the results frontier. Completing, releasing and releasing by
//! position touch only this drainer's own claims, so an intent whose lease
//! ran out and went to another drainer is left to that one. A failure
//! defers the intent with a backoff; a permanent one, repeated
//! `park_after_failures` times, parks it, with its notice written in the
//! same transaction. A transition whose effects went out late gets its
//! timeout timers pushed back by as long as they were late.

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::Row;

use super::Drainer;
use super::maintenance::{Parked, insert_notices, parked_notice};
use super::publish::{Cause, Unpublished, ordered_headers};

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
/// transition (the step's dispatch above all) but the other timeout
/// timers (a transition that starts branches has one per attempt, and
/// they would wait for each other for ever): a timer must not end an
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
           AND d.cancel_key IS NULL \
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

/// An intent's place in its run's history, unique among intents: the
/// transition that made it and its index among that transition's effects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntentPosition {
    pub run_id: String,
    pub seq: i64,
    pub effect_index: i32,
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

/// What a release did.
#[derive(Debug, Default)]
pub(super) struct Released {
    pub(super) pending: usize,
    pub(super) parked: usize,
    pub(super) transient: usize,
}

impl Drainer {
    pub(super) async fn claim(&self) -> anyhow::Result<Vec<ClaimedIntent>> {
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

    pub(super) async fn complete(&self, ids: &[i64]) -> anyhow::Result<usize> {
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
    pub(super) async fn release(&self, failed: &[Unpublished]) -> anyhow::Result<Released> {
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

    /// Gives back this drainer's claims at the given positions, if any.
    pub(super) async fn release_at(&self, positions: &[IntentPosition]) -> anyhow::Result<usize> {
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
    /// published late (more than [`crate::contract::LATE_DISPATCH_MS`]
    /// after they were committed: their first drainer died holding them),
    /// by as long as they were late, so the step keeps its whole timeout
    /// from the moment a worker could see its dispatch.
    pub(super) async fn restart_late_clocks(
        &self,
        claimed: &[ClaimedIntent],
        delivered: &[i64],
    ) -> anyhow::Result<()> {
        let now = Utc::now();
        let late_after = chrono::TimeDelta::milliseconds(crate::contract::LATE_DISPATCH_MS);
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
}
