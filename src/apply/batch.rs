//! The batch statement ([`WRITE_BATCH_SQL`], `write_batch.sql`) and its one
//! binding.
//!
//! In: a [`BatchWrite`], every parameter as a column in the statement's
//! placeholder order, filled by the apply path from a planned batch and by
//! the benchmark from its own rows. Out: the statement with `$1`..`$66`
//! bound ([`BatchWrite::query`], [`BatchWrite::bind`]). Guarantees: neither
//! caller binds a parameter of its own; one parameter is bound per
//! placeholder and every placeholder is used (both tested);
//! [`BatchWrite::columns_aligned`] tells a column left behind, which UNNEST
//! would pad with NULLs; a conditional write that matches fewer rows than
//! [`BatchWrite::expected`] fails the statement with [`CONFLICT_SQLSTATE`]
//! (a canary build rewrites one guarantee out of the statement).

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use sqlx::Postgres;
use uuid::Uuid;

/// The statement as written, placeholders `$1`..`$66` in bind order.
const WRITE_BATCH_TEXT: &str = include_str!("write_batch.sql");

/// How many placeholders [`WRITE_BATCH_SQL`] has, and so how many
/// parameters [`BatchWrite::bind`] binds.
#[cfg(test)]
pub const WRITE_BATCH_PARAMS: usize = 66;

/// Raised by `ductor_write_guard` when a conditional write of the batch
/// statement fell short.
pub const CONFLICT_SQLSTATE: &str = "DU409";

/// The batch statement of this build (a canary build rewrites a guarantee
/// out of it).
pub static WRITE_BATCH_SQL: LazyLock<String> =
    LazyLock::new(|| canary_rewrite(WRITE_BATCH_TEXT.to_owned()));

/// The optimistic lock of the runs update.
const VERSION_CHECK: &str =
    "r.record_version = u.expected_version AND r.last_transition_seq < u.seq";

/// Canary `no-version-check`: the version check is gone, so a stale writer
/// overwrites a newer state (a lost update), and the duplicate effects it
/// re-emits are swallowed so that its lost update commits. Only for proving
/// that the chaos checker notices.
#[cfg(feature = "canary-no-version-check")]
fn canary_rewrite(sql: String) -> String {
    assert!(sql.contains(VERSION_CHECK) && sql.contains("    FROM ic\n"));
    sql.replace(VERSION_CHECK, "u.expected_version IS NOT NULL")
        .replace("    FROM ic\n", "    FROM ic ON CONFLICT DO NOTHING\n")
}

#[cfg(not(feature = "canary-no-version-check"))]
fn canary_rewrite(sql: String) -> String {
    debug_assert!(sql.contains(VERSION_CHECK));
    sql
}

/// A query of [`WRITE_BATCH_SQL`] being bound, parameter by parameter.
pub type BatchQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// New runs (`$1`..`$11`).
#[derive(Debug, Default)]
pub struct RunInserts<'a> {
    pub run_id: Vec<&'a str>,
    pub tenant: Vec<&'a str>,
    pub pool: Vec<&'a str>,
    pub workflow: Vec<&'a str>,
    pub version: Vec<i32>,
    pub status: Vec<&'a str>,
    pub seq: Vec<i64>,
    /// The encoded state.
    pub state: Vec<String>,
    pub created_at: Vec<DateTime<Utc>>,
    pub updated_at: Vec<DateTime<Utc>>,
    pub finished_at: Vec<Option<DateTime<Utc>>>,
}

/// Changed runs, each updated only at the `record_version` it was loaded
/// with (`$12`..`$18`).
#[derive(Debug, Default)]
pub struct RunUpdates<'a> {
    pub run_id: Vec<&'a str>,
    pub expected_version: Vec<i64>,
    pub status: Vec<&'a str>,
    pub seq: Vec<i64>,
    pub state: Vec<String>,
    pub updated_at: Vec<DateTime<Utc>>,
    pub finished_at: Vec<Option<DateTime<Utc>>>,
}

/// History rows (`$19`..`$30`).
#[derive(Debug, Default)]
pub struct TransitionRows<'a> {
    pub run_id: Vec<&'a str>,
    pub seq: Vec<i64>,
    pub input_ref: Vec<&'a str>,
    pub kind: Vec<&'a str>,
    pub from_status: Vec<Option<&'a str>>,
    pub to_status: Vec<&'a str>,
    pub step_index: Vec<i32>,
    pub detail: Vec<&'a str>,
    pub source_topic: Vec<Option<&'a str>>,
    pub source_partition: Vec<Option<i32>>,
    pub source_offset: Vec<Option<i64>>,
    pub at: Vec<DateTime<Utc>>,
}

/// New attempts (`$31`..`$39`).
#[derive(Debug, Default)]
pub struct AttemptInserts<'a> {
    pub stamp: Vec<Uuid>,
    pub run_id: Vec<&'a str>,
    pub step_index: Vec<i32>,
    pub attempt: Vec<i32>,
    pub status: Vec<&'a str>,
    pub dispatched_at: Vec<DateTime<Utc>>,
    pub deadline: Vec<DateTime<Utc>>,
    pub finished_at: Vec<Option<DateTime<Utc>>>,
    pub error: Vec<Option<&'a str>>,
}

/// Attempts finished, each only while still `dispatched` (`$40`..`$43`).
#[derive(Debug, Default)]
pub struct AttemptFinishes<'a> {
    pub stamp: Vec<Uuid>,
    pub status: Vec<&'a str>,
    pub finished_at: Vec<DateTime<Utc>>,
    pub error: Vec<Option<&'a str>>,
}

/// Effect intents (`$45`..`$57`).
#[derive(Debug, Default)]
pub struct IntentRows<'a> {
    pub run_id: Vec<&'a str>,
    pub seq: Vec<i64>,
    pub effect_index: Vec<i32>,
    pub key: Vec<&'a str>,
    pub tenant: Vec<&'a str>,
    pub topic: Vec<&'a str>,
    pub message_key: Vec<&'a [u8]>,
    /// The headers as a JSON object.
    pub headers: Vec<String>,
    pub payload: Vec<&'a [u8]>,
    pub ce_type: Vec<&'a str>,
    pub not_before: Vec<DateTime<Utc>>,
    pub cancel_key: Vec<Option<&'a str>>,
    pub due: Vec<bool>,
}

/// How the batch moves the runs' counts by status (`run_counts`,
/// `$62`..`$66`): one row per (tenant, workflow, version, status), the net
/// change, never zero, in key order.
#[derive(Debug, Default)]
pub struct CountMoves<'a> {
    pub tenant: Vec<&'a str>,
    pub workflow: Vec<&'a str>,
    pub version: Vec<i32>,
    pub status: Vec<&'a str>,
    pub delta: Vec<i64>,
}

/// Every parameter of one batch statement.
#[derive(Debug, Default)]
pub struct BatchWrite<'a> {
    pub inserts: RunInserts<'a>,
    pub updates: RunUpdates<'a>,
    pub transitions: TransitionRows<'a>,
    pub attempts: AttemptInserts<'a>,
    pub finishes: AttemptFinishes<'a>,
    /// The cancel keys of pending timers to delete (`$44`).
    pub cancel_keys: Vec<String>,
    pub intents: IntentRows<'a>,
    /// The fast lane's drainer, which claims due intents at insert (`$58`).
    pub claimer: Option<&'a str>,
    /// The lease of those claims, in seconds (`$59`).
    pub lease_s: f64,
    /// What the guard expects each conditional write to match: runs
    /// inserted, runs updated, transitions, attempts inserted, attempts
    /// finished; `None` checks nothing (`$60`).
    pub expected: Option<Vec<i64>>,
    /// Who writes the batch, in every transition (`$61`).
    pub writer: Option<&'a str>,
    pub counts: CountMoves<'a>,
}

/// Whether every length is the same.
fn same(lens: &[usize]) -> bool {
    lens.windows(2).all(|w| w[0] == w[1])
}

impl<'a> BatchWrite<'a> {
    /// Nothing to write: every input was a no-op or a rejection.
    pub fn is_empty(&self) -> bool {
        self.inserts.run_id.is_empty()
            && self.updates.run_id.is_empty()
            && self.transitions.run_id.is_empty()
            && self.attempts.stamp.is_empty()
            && self.finishes.stamp.is_empty()
            && self.intents.run_id.is_empty()
    }

    /// Whether every column of each group has one entry per row, as UNNEST
    /// needs to pair them up.
    pub fn columns_aligned(&self) -> bool {
        self.runs_and_history_aligned() && self.effects_aligned()
    }

    fn runs_and_history_aligned(&self) -> bool {
        let (n, u, t) = (&self.inserts, &self.updates, &self.transitions);
        let (a, f) = (&self.attempts, &self.finishes);
        same(&[
            n.run_id.len(),
            n.tenant.len(),
            n.pool.len(),
            n.workflow.len(),
            n.version.len(),
            n.status.len(),
            n.seq.len(),
            n.state.len(),
            n.created_at.len(),
            n.updated_at.len(),
            n.finished_at.len(),
        ]) && same(&[
            u.run_id.len(),
            u.expected_version.len(),
            u.status.len(),
            u.seq.len(),
            u.state.len(),
            u.updated_at.len(),
            u.finished_at.len(),
        ]) && same(&[
            t.run_id.len(),
            t.seq.len(),
            t.input_ref.len(),
            t.kind.len(),
            t.from_status.len(),
            t.to_status.len(),
            t.step_index.len(),
            t.detail.len(),
            t.source_topic.len(),
            t.source_partition.len(),
            t.source_offset.len(),
            t.at.len(),
        ]) && same(&[
            a.stamp.len(),
            a.run_id.len(),
            a.step_index.len(),
            a.attempt.len(),
            a.status.len(),
            a.dispatched_at.len(),
            a.deadline.len(),
            a.finished_at.len(),
            a.error.len(),
        ]) && same(&[
            f.stamp.len(),
            f.status.len(),
            f.finished_at.len(),
            f.error.len(),
        ])
    }

    fn effects_aligned(&self) -> bool {
        let (i, c) = (&self.intents, &self.counts);
        same(&[
            i.run_id.len(),
            i.seq.len(),
            i.effect_index.len(),
            i.key.len(),
            i.tenant.len(),
            i.topic.len(),
            i.message_key.len(),
            i.headers.len(),
            i.payload.len(),
            i.ce_type.len(),
            i.not_before.len(),
            i.cancel_key.len(),
            i.due.len(),
        ]) && same(&[
            c.tenant.len(),
            c.workflow.len(),
            c.version.len(),
            c.status.len(),
            c.delta.len(),
        ])
    }

    /// The counts the guard checks, from the columns themselves.
    pub fn guarded_counts(&self) -> Vec<i64> {
        [
            self.inserts.run_id.len(),
            self.updates.run_id.len(),
            self.transitions.run_id.len(),
            self.attempts.stamp.len(),
            self.finishes.stamp.len(),
        ]
        .map(|n| n as i64)
        .to_vec()
    }

    /// The batch statement with every parameter bound.
    pub fn query(&'a self) -> BatchQuery<'a> {
        self.bind(sqlx::query(&WRITE_BATCH_SQL))
    }

    /// Binds `$1`..`$66`, in order.
    pub fn bind(&'a self, query: BatchQuery<'a>) -> BatchQuery<'a> {
        let query = self.bind_runs(query);
        let query = self.bind_history(query);
        let query = self.bind_intents(query);
        let c = &self.counts;
        query
            .bind(&self.expected)
            .bind(self.writer)
            .bind(&c.tenant)
            .bind(&c.workflow)
            .bind(&c.version)
            .bind(&c.status)
            .bind(&c.delta)
    }

    fn bind_runs(&'a self, query: BatchQuery<'a>) -> BatchQuery<'a> {
        let (n, u) = (&self.inserts, &self.updates);
        query
            .bind(&n.run_id)
            .bind(&n.tenant)
            .bind(&n.pool)
            .bind(&n.workflow)
            .bind(&n.version)
            .bind(&n.status)
            .bind(&n.seq)
            .bind(&n.state)
            .bind(&n.created_at)
            .bind(&n.updated_at)
            .bind(&n.finished_at)
            .bind(&u.run_id)
            .bind(&u.expected_version)
            .bind(&u.status)
            .bind(&u.seq)
            .bind(&u.state)
            .bind(&u.updated_at)
            .bind(&u.finished_at)
    }

    fn bind_history(&'a self, query: BatchQuery<'a>) -> BatchQuery<'a> {
        let (t, a, f) = (&self.transitions, &self.attempts, &self.finishes);
        query
            .bind(&t.run_id)
            .bind(&t.seq)
            .bind(&t.input_ref)
            .bind(&t.kind)
            .bind(&t.from_status)
            .bind(&t.to_status)
            .bind(&t.step_index)
            .bind(&t.detail)
            .bind(&t.source_topic)
            .bind(&t.source_partition)
            .bind(&t.source_offset)
            .bind(&t.at)
            .bind(&a.stamp)
            .bind(&a.run_id)
            .bind(&a.step_index)
            .bind(&a.attempt)
            .bind(&a.status)
            .bind(&a.dispatched_at)
            .bind(&a.deadline)
            .bind(&a.finished_at)
            .bind(&a.error)
            .bind(&f.stamp)
            .bind(&f.status)
            .bind(&f.finished_at)
            .bind(&f.error)
            .bind(&self.cancel_keys)
    }

    fn bind_intents(&'a self, query: BatchQuery<'a>) -> BatchQuery<'a> {
        let i = &self.intents;
        query
            .bind(&i.run_id)
            .bind(&i.seq)
            .bind(&i.effect_index)
            .bind(&i.key)
            .bind(&i.tenant)
            .bind(&i.topic)
            .bind(&i.message_key)
            .bind(&i.headers)
            .bind(&i.payload)
            .bind(&i.ce_type)
            .bind(&i.not_before)
            .bind(&i.cancel_key)
            .bind(&i.due)
            .bind(self.claimer)
            .bind(self.lease_s)
    }
}

#[cfg(test)]
mod tests {
    use sqlx::{Arguments, Execute};

    use super::*;

    /// The highest `$n` of the statement, outside its comments.
    fn highest_placeholder(sql: &str) -> usize {
        let body: String = sql
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        body.split('$')
            .skip(1)
            .filter_map(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse::<usize>().ok()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn the_binding_binds_one_parameter_per_placeholder() {
        let write = BatchWrite::default();
        let mut query = write.query();
        let arguments = query
            .take_arguments()
            .expect("binding succeeds")
            .expect("the query has arguments");
        assert_eq!(highest_placeholder(&WRITE_BATCH_SQL), WRITE_BATCH_PARAMS);
        assert_eq!(arguments.len(), WRITE_BATCH_PARAMS);
    }

    #[test]
    fn a_column_left_behind_is_noticed() {
        let mut write = BatchWrite::default();
        assert!(write.columns_aligned());
        write.intents.run_id.push("r");
        assert!(!write.columns_aligned());
        write.intents = IntentRows::default();
        write.finishes.stamp.push(Uuid::nil());
        assert!(!write.columns_aligned());
        write.finishes = AttemptFinishes::default();
        write.counts.delta.push(1);
        assert!(!write.columns_aligned());
    }

    #[test]
    fn every_placeholder_up_to_the_last_is_used() {
        for n in 1..=WRITE_BATCH_PARAMS {
            let used = WRITE_BATCH_SQL
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .any(|l| {
                    l.match_indices(&format!("${n}"))
                        .any(|(at, m)| !l[at + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
                });
            assert!(used, "${n} is bound but never used");
        }
    }
}
