//! What the operator's views answer: pages of runs, counts by status, one
//! run's history. Each type is its answer's JSON and the schema the API's
//! description gives it.
//!
//! In: rows read by `store`. Out: JSON. Guarantees: plain data; an
//! effect's publish status is a pure function of its row and the time
//! ([`PublishStatus::of`]).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;

use crate::contract::formats::{AnyValue, Id, Name, Timestamp};

/// A run in a list.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RunItem {
    #[schemars(with = "Id")]
    pub run_id: String,
    #[schemars(with = "Id")]
    pub tenant: String,
    #[schemars(with = "Name")]
    pub pool: String,
    #[schemars(with = "Name")]
    pub workflow: String,
    #[schemars(range(min = 1))]
    pub workflow_version: i32,
    /// `running`, `succeeded`, `failed` or `cancelled`.
    pub status: String,
    /// The current step's index (the last step's, once the run succeeded).
    #[schemars(range(min = 0))]
    pub step_index: i32,
    /// The current step's attempt number, 1-based.
    #[schemars(range(min = 0))]
    pub attempt: i32,
    pub correlation_id: Option<String>,
    #[schemars(range(min = 0))]
    pub last_transition_seq: i64,
    #[schemars(with = "Timestamp")]
    pub created_at: DateTime<Utc>,
    #[schemars(with = "Timestamp")]
    pub updated_at: DateTime<Utc>,
    #[schemars(with = "Option<Timestamp>")]
    pub finished_at: Option<DateTime<Utc>>,
}

/// `GET /v1/runs`: a page of runs, newest first.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RunPage {
    pub runs: Vec<RunItem>,
    /// The `after` of the next page; `null` on the last page.
    pub next: Option<String>,
}

/// `GET /v1/runs/counts`: how many runs the filter finds, by status.
#[derive(Debug, Default, Serialize, JsonSchema)]
pub struct RunCounts {
    pub running: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub cancelled: i64,
    pub total: i64,
    /// `false` when the filter had to count runs one by one and stopped at
    /// `server.count_scan_limit`: each count is then at least this.
    pub exact: bool,
}

impl RunCounts {
    pub fn add(&mut self, status: &str, n: i64) {
        let slot = match status {
            "running" => &mut self.running,
            "succeeded" => &mut self.succeeded,
            "failed" => &mut self.failed,
            "cancelled" => &mut self.cancelled,
            _ => return,
        };
        *slot += n;
        self.total += n;
    }
}

/// One attempt of a step: from its dispatch to its result.
#[derive(Debug, Serialize, JsonSchema)]
pub struct AttemptView {
    /// The attempt's stamp, its fencing token.
    pub stamp: String,
    pub step_index: i32,
    pub attempt: i32,
    /// `dispatched`, `succeeded`, `failed`, `timed_out` or `cancelled`.
    pub status: String,
    #[schemars(with = "Timestamp")]
    pub dispatched_at: DateTime<Utc>,
    #[schemars(with = "Timestamp")]
    pub deadline: DateTime<Utc>,
    #[schemars(with = "Option<Timestamp>")]
    pub finished_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
}

/// Where an effect is on its way to Kafka.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PublishStatus {
    /// Published and acknowledged.
    Delivered,
    /// Due now, not yet acknowledged (waiting for the drainer, or being
    /// published).
    Due,
    /// Due later: a timer.
    Scheduled,
    /// Held back after failed publishes until `deferred_until`.
    Deferred,
    /// Set aside after `drainer.park_after_failures` failed publishes,
    /// until an operator redrives it.
    Parked,
}

impl PublishStatus {
    /// The publish status of an intent with this `status`, `not_before`
    /// and `deferred_until`, at `now`.
    pub fn of(
        status: &str,
        not_before: DateTime<Utc>,
        deferred_until: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> PublishStatus {
        match status {
            "completed" => PublishStatus::Delivered,
            "parked" => PublishStatus::Parked,
            _ if deferred_until.is_some_and(|t| t > now) => PublishStatus::Deferred,
            _ if not_before > now => PublishStatus::Scheduled,
            _ => PublishStatus::Due,
        }
    }
}

/// An effect a transition produced, as the outbox holds it.
#[derive(Debug, Serialize, JsonSchema)]
pub struct EffectView {
    pub effect_index: i32,
    /// The `idempotency-key` header it is published with.
    pub idempotency_key: String,
    pub topic: String,
    /// The CloudEvents type: `ductor.step.dispatch`, `ductor.run.event`,
    /// `ductor.run.output`, ...
    pub ce_type: String,
    pub publish_status: PublishStatus,
    #[schemars(with = "Timestamp")]
    pub not_before: DateTime<Utc>,
    pub attempts: i32,
    pub publish_failures: i32,
    pub last_error: Option<String>,
    #[schemars(with = "Option<Timestamp>")]
    pub completed_at: Option<DateTime<Utc>>,
    #[schemars(with = "Option<Timestamp>")]
    pub parked_at: Option<DateTime<Utc>>,
}

/// One transition of the run's history, with the effects it produced.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TransitionView {
    pub seq: i64,
    /// What happened: `run.started`, `step.succeeded`, `run.cancelled`, ...
    pub kind: String,
    /// The input that caused it.
    pub input_ref: String,
    pub from_status: Option<String>,
    pub to_status: String,
    pub step_index: i32,
    #[schemars(with = "AnyValue")]
    pub detail: Value,
    pub source_topic: Option<String>,
    pub source_partition: Option<i32>,
    pub source_offset: Option<i64>,
    #[schemars(with = "Timestamp")]
    pub created_at: DateTime<Utc>,
    /// The effects the outbox still holds (delivered ones until
    /// `drainer.retention_ms` purges them).
    pub effects: Vec<EffectView>,
}

/// `GET /v1/runs/{run_id}/history`: the run, its attempts and its
/// transitions with their effects.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RunHistory {
    pub run: RunItem,
    #[schemars(with = "AnyValue")]
    pub input: Value,
    /// The newest step output (the run's result once it succeeded).
    #[schemars(with = "AnyValue")]
    pub output: Value,
    #[schemars(with = "AnyValue")]
    pub error: Value,
    /// The wait the run is in (a `sleep` or an `await_signal` step), if any.
    #[schemars(with = "AnyValue")]
    pub waiting: Value,
    /// The retry the run waits for, if any.
    #[schemars(with = "AnyValue")]
    pub pending_retry: Value,
    pub attempts: Vec<AttemptView>,
    pub transitions: Vec<TransitionView>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_effect_is_delivered_parked_deferred_scheduled_or_due() {
        let now = DateTime::from_timestamp(1_000_000, 0).unwrap();
        let (before, after) = (
            now - chrono::Duration::seconds(1),
            now + chrono::Duration::seconds(1),
        );
        use PublishStatus::*;
        assert_eq!(
            PublishStatus::of("completed", after, Some(after), now),
            Delivered
        );
        assert_eq!(PublishStatus::of("parked", before, None, now), Parked);
        assert_eq!(
            PublishStatus::of("pending", before, Some(after), now),
            Deferred
        );
        assert_eq!(PublishStatus::of("pending", before, Some(before), now), Due);
        assert_eq!(PublishStatus::of("claimed", before, None, now), Due);
        assert_eq!(PublishStatus::of("pending", after, None, now), Scheduled);
    }

    #[test]
    fn counts_add_up_and_ignore_what_is_no_status() {
        let mut c = RunCounts::default();
        c.add("running", 3);
        c.add("failed", 2);
        c.add("bogus", 7);
        assert_eq!((c.running, c.failed, c.total), (3, 2, 5));
    }
}
