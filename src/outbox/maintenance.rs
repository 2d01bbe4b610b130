//! What keeps the outbox healthy between rounds: the drainer's heartbeat,
//! the reconciler, retention, the backlog gauges, and the notices of
//! parked effects.
//!
//! In: the drainer's intervals and bounds ([`DrainerConfig`]); for a
//! notice, what the release of a parked intent returned ([`Parked`]). Out:
//! this drainer's row in `eec_drainer_member`; the intents of expired
//! leases and of stopped drainers back in `pending`; completed intents and
//! long-departed drainers deleted; the backlog gauges and when the next
//! pending intent falls due; parked intents put back on request; a notice
//! intent per parked effect, on the events topic.
//!
//! Guarantees: a drainer takes back another's claims for a silent heartbeat
//! only after it has itself reached the database without a break for a
//! member timeout, so a database outage does not read as every drainer
//! dying. Retention deletes at most `purge_batch` rows per statement and
//! `purge_max_rounds` statements per round. A parked effect gets one
//! notice, with the same key however often it is parked. Every periodic
//! task stops with the shutdown token.

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;

use super::{Drainer, Wakeup};
use crate::contract::effects::{EffectParked, to_value};
use crate::contract::input::SCHEMA_VERSION;
use crate::contract::names::parked_notice_key;
use crate::contract::{EffectKind, headers};

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

/// Deletes up to `$2` intents completed more than `$1` seconds ago.
const PURGE_SQL: &str = "DELETE FROM eec_effect_intent WHERE intent_id IN ( \
     SELECT intent_id FROM eec_effect_intent \
     WHERE status = 'completed' AND completed_at < now() - make_interval(secs => $1) \
     ORDER BY completed_at LIMIT $2)";

/// Longest error text a notice carries.
const MAX_NOTICE_ERROR_LEN: usize = 512;

/// What a parked intent's release returned, for its notice.
#[derive(Debug, Clone)]
pub(super) struct Parked {
    pub(super) run_id: String,
    pub(super) seq: i64,
    pub(super) effect_index: i32,
    pub(super) tenant: String,
    pub(super) key: String,
    pub(super) topic: String,
    pub(super) headers: serde_json::Map<String, Value>,
    pub(super) error: String,
}

/// The event that tells a run's followers that one of its effects was
/// parked: on the events topic, keyed by the run, with the effect's
/// headers but an idempotency key, id, type and time of its own, and the
/// effect's position, topic and error in its payload.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ParkedNotice {
    run_id: String,
    seq: i64,
    effect_index: i32,
    key: String,
    tenant: String,
    topic: String,
    headers: Value,
    payload: Value,
}

/// The notice of `parked`, on `events_topic`, at `now`.
pub(super) fn parked_notice(
    parked: &Parked,
    events_topic: &str,
    now: DateTime<Utc>,
) -> ParkedNotice {
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

/// Writes `notices` as intents due now, each at most once.
pub(super) async fn insert_notices(
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

impl Drainer {
    /// Records that this drainer is alive. A drainer's claims are given
    /// back once its heartbeat is older than `member_timeout_ms`.
    pub async fn heartbeat(&self) -> anyhow::Result<()> {
        let beat = sqlx::query(
            "INSERT INTO eec_drainer_member (drainer_id, instance) VALUES ($1, $2) \
             ON CONFLICT (drainer_id) DO UPDATE SET heartbeat_at = now()",
        )
        .bind(&self.drainer_id)
        .bind(self.instance.as_deref())
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

    /// Gives back the claims of this process's earlier incarnations (the
    /// drainers recorded under its instance name, see
    /// [`Drainer::with_instance`]) and forgets them; returns how many
    /// claims. Nothing without an instance name.
    pub async fn take_over_predecessors(&self) -> anyhow::Result<u64> {
        let Some(instance) = &self.instance else {
            return Ok(0);
        };
        let taken = sqlx::query(
            "WITH gone AS ( \
                 DELETE FROM eec_drainer_member WHERE instance = $1 AND drainer_id <> $2 \
                 RETURNING drainer_id) \
             UPDATE eec_effect_intent i SET status = 'pending', claimed_by = NULL, \
                 claim_expires_at = NULL, last_error = 'its drainer restarted' \
             WHERE i.status = 'claimed' AND i.claimed_by IN (SELECT drainer_id FROM gone)",
        )
        .bind(instance)
        .bind(&self.drainer_id)
        .execute(&self.pool)
        .await
        .context("taking back the claims of this process's earlier incarnations")?
        .rows_affected();
        if taken > 0 {
            tracing::info!(
                taken,
                instance,
                "took back the claims of an earlier incarnation"
            );
            metrics::counter!("ductor_outbox_redrives_total").increment(taken);
        }
        Ok(taken)
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
            // The command runs outside every drainer: wake them now.
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(super::NOTIFY_CHANNEL)
                .execute(pool)
                .await
                .context("notifying the drainers of the redriven intents")?;
        }
        Ok(redriven)
    }

    /// Deletes completed intents older than the retention, at most
    /// `purge_batch` rows per statement, until none are left or `max_rounds`.
    pub async fn purge(&self) -> anyhow::Result<u64> {
        let total = crate::infra::db::delete_in_rounds(
            &self.pool,
            PURGE_SQL,
            Duration::from_millis(self.config.retention_ms),
            self.config.purge_batch,
            self.config.purge_max_rounds,
        )
        .await
        .context("purging drained intents")?;
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

    /// Updates the backlog gauges and tells the results frontier which
    /// deadline it is wanted for (the earliest timeout it holds back);
    /// returns when the next pending intent falls due, if any (a timeout
    /// held for the results frontier is not: the frontier's moving wakes
    /// the drainer).
    pub async fn observe_backlog(&self) -> anyhow::Result<Option<DateTime<Utc>>> {
        let row = sqlx::query(
            "SELECT count(*) FILTER (WHERE status <> 'parked') AS backlog, \
                 count(*) FILTER (WHERE status = 'parked') AS parked, \
                 count(*) FILTER (WHERE not_before <= now() AND status <> 'parked') AS due, \
                 EXTRACT(EPOCH FROM now() - min(not_before) \
                     FILTER (WHERE not_before <= now() AND status <> 'parked'))::float8 AS oldest_due_s, \
                 min(GREATEST(not_before, deferred_until)) FILTER (WHERE status = 'pending' \
                     AND (cancel_key IS NULL OR $1::timestamptz IS NULL OR not_before <= $1)) \
                     AS next_due, \
                 min(not_before) FILTER (WHERE status = 'pending' AND cancel_key IS NOT NULL \
                     AND $1::timestamptz IS NOT NULL AND not_before > $1) AS next_held \
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
        self.frontier.want(row.try_get("next_held")?);
        Ok(row.try_get("next_due")?)
    }
}

/// The drainer's periodic work: its heartbeat, the reconciler, retention
/// and the backlog gauges. Claims the reconciler gives back wake the claim
/// rounds (`wakeup`), so they are published at once, not at the next
/// safety-net poll.
pub(super) async fn maintenance(drainer: &Drainer, wakeup: &Wakeup, shutdown: CancellationToken) {
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
    // Until the earlier incarnations' claims are given back (once this
    // drainer is recorded, so that a later incarnation finds it in turn).
    let mut predecessors_left = drainer.instance.is_some();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = heartbeat.tick() => {
                if let Err(e) = drainer.heartbeat().await {
                    tracing::warn!(error = format!("{e:#}"), "drainer heartbeat failed");
                } else if predecessors_left {
                    match drainer.take_over_predecessors().await {
                        Ok(taken) => {
                            predecessors_left = false;
                            if taken > 0 {
                                wakeup.wake();
                            }
                        }
                        Err(e) => tracing::warn!(error = format!("{e:#}"), "taking over failed"),
                    }
                }
            }
            _ = reconcile.tick() => match drainer.reconcile().await {
                Ok(0) => {}
                Ok(_) => wakeup.wake(),
                Err(e) => tracing::warn!(error = format!("{e:#}"), "reconciler round failed"),
            },
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

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "ductor".to_string())
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
