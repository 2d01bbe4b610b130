//! Write: one batch statement per batch, planned by [`super::plan`], and
//! what its answer hands to the fast lane.
//!
//! In: the runs and writes of an attempt, on its session's connection.
//! Out: [`Handed`]: the intents the fast lane claimed at insert, ready to
//! publish, how many due ones it did not, the next timer, and the states
//! as written, for the cache; or `None` when another writer won a race.
//! Guarantees: one round trip per batch, whatever its size; a lost race
//! writes nothing (the statement rolls back on its own); the claims of a
//! statement whose reply never came are given back, since it may have
//! committed.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};

use super::rows::{IntentRow, Loaded, Writes};
use super::{ApplyError, batch, plan};
use crate::coordinator::RunState;
use crate::outbox::IntentPosition;

#[derive(Default)]
pub(super) struct Handed {
    pub(super) claimed: Vec<crate::outbox::ClaimedIntent>,
    /// Due intents inserted as `pending` (behind an undelivered one).
    pub(super) pending_due: usize,
    /// The earliest `not_before` of the timers inserted.
    pub(super) next_timer: Option<DateTime<Utc>>,
    /// The runs as written, with the length of their encoded state, for
    /// the cache once committed.
    pub(super) states: Vec<(RunState, usize)>,
}

/// Writes everything; `Ok(None)` when a conditional write lost a race.
///
/// One statement, [`batch::WRITE_BATCH_SQL`]: the runs (inserts and
/// conditional updates), the history and the effects (transitions,
/// attempts, timer cancels and intents), each set-based over the whole
/// batch, so a batch costs one round trip whatever its size. A count that
/// falls short of what was sent is a lost race, and the statement rolls
/// back on its own.
pub(super) async fn write_all(
    conn: &mut PgConnection,
    runs: &HashMap<String, Loaded>,
    writes: &Writes,
    notify: bool,
    handoff: Option<&crate::outbox::Handoff>,
) -> Result<Option<Handed>, ApplyError> {
    let claim = handoff.map(|h| plan::FastLaneClaim {
        drainer_id: h.drainer_id(),
        lease_s: h.lease_s(),
    });
    let plan = plan::plan(runs, writes, claim)?;
    if plan.write.is_empty() {
        return Ok(Some(Handed::default()));
    }
    // Nothing of the batch has reached the database yet.
    crate::crash_point!("apply.after_update");
    let written = {
        let fetch = std::pin::pin!(plan.write.query().fetch_one(&mut *conn));
        // Sent, and the process dies before the reply: whether the batch
        // committed is up to the database.
        #[cfg(feature = "failpoints")]
        let fetch = crate::infra::failpoints::send_then_crash("apply.mid_batch", fetch).await;
        fetch.await
    };
    let row = match written {
        Ok(row) => row,
        Err(e) if lost_race(&e) => return Ok(None),
        Err(e) => {
            // Without a transaction around it, a statement whose reply never
            // came (the connection broke) may still have committed, claims
            // and all: they are nobody's, so give them back.
            if let Some(handoff) = handoff {
                handoff.uncertain_at(due_positions(&plan.intents)).await;
            }
            return Err(e.into());
        }
    };
    let handed = handed(plan, &row)?;
    if !writes.intents.is_empty() {
        crate::crash_point!("apply.after_intents");
    }
    if notify && !writes.intents.is_empty() {
        // Wakes drainers in other processes at the commit (which, without a
        // transaction around the batch, has just happened).
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(crate::outbox::NOTIFY_CHANNEL)
            .execute(&mut *conn)
            .await?;
    }
    Ok(Some(handed))
}

/// The positions of the due intents, which the fast lane may have claimed.
pub(super) fn due_positions(intents: &[&IntentRow]) -> Vec<IntentPosition> {
    intents
        .iter()
        .filter(|i| i.due)
        .map(|i| IntentPosition {
            run_id: i.run_id.clone(),
            seq: i.seq,
            effect_index: i.effect_index,
        })
        .collect()
}

/// Whether the batch statement failed because another writer won: the
/// guard's shortfall, or an intent position another writer took first
/// (rows of one statement are written in no set order, so the intents may
/// meet the other writer's before the runs update does).
pub(super) fn lost_race(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = error else {
        return false;
    };
    match db.code().as_deref() {
        Some(batch::CONFLICT_SQLSTATE) => true,
        Some("23505") => db.constraint() == Some("eec_effect_intent_position_unique"),
        _ => false,
    }
}

/// The claimed intents in the statement's answer, ready to publish, and
/// what the drainer's claim rounds must be told.
pub(super) fn handed(
    plan: plan::Plan<'_>,
    row: &sqlx::postgres::PgRow,
) -> Result<Handed, ApplyError> {
    let ids: Vec<i64> = row.try_get("claimed_ids")?;
    let runs: Vec<String> = row.try_get("claimed_runs")?;
    let seqs: Vec<i64> = row.try_get("claimed_seqs")?;
    let indexes: Vec<i32> = row.try_get("claimed_indexes")?;
    let created: Vec<DateTime<Utc>> = row.try_get("claimed_created")?;
    let by_position: HashMap<(&str, i64, i32), &IntentRow> = plan
        .intents
        .iter()
        .map(|i| ((i.run_id.as_str(), i.seq, i.effect_index), *i))
        .collect();
    let mut handed = Handed::default();
    for (k, intent_id) in ids.into_iter().enumerate() {
        let Some(&intent) = by_position.get(&(runs[k].as_str(), seqs[k], indexes[k])) else {
            continue;
        };
        handed.claimed.push(crate::outbox::ClaimedIntent {
            intent_id,
            run_id: intent.run_id.clone(),
            seq: intent.seq,
            effect_index: intent.effect_index,
            topic: intent.topic.clone(),
            message_key: intent.message_key.clone(),
            headers: crate::outbox::ordered_headers(&intent.headers),
            payload: intent.payload.clone(),
            not_before: intent.not_before,
            created_at: created[k],
            publish_failures: 0,
        });
    }
    let due = plan.intents.iter().filter(|i| i.due).count();
    handed.pending_due = due.saturating_sub(handed.claimed.len());
    handed.next_timer = plan
        .intents
        .iter()
        .filter(|i| !i.due)
        .map(|i| i.not_before)
        .min();
    handed.states = plan.states;
    Ok(handed)
}
