//! Run state: what the store keeps per run (as one jsonb document) and what the fold
//! reads and returns. Field and variant names are stable snake_case.
//!
//! In: a run's `runs.state` document as read back. Out: the [`RunState`]
//! the fold reads, and the document to write. Guarantees: plain data; the
//! document carries the version of its shape (`v`, [`STATE_VERSION`] when
//! written; see [`super::stored`] for how older ones load and newer ones
//! are refused); the optional fields (`waiting`, `start_fingerprint`,
//! `trace`, `retries`, `failed_seq`, a signal's `payload` and
//! `fingerprint`) default when absent, so a document written without them
//! still loads; a run records at most [`MAX_SIGNALS_PER_RUN`] signals, a
//! bound the fold enforces.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

/// Most distinct signals one run records; more are rejected. A record is
/// small (its id, name and time): the payload is kept in the history.
pub const MAX_SIGNALS_PER_RUN: usize = 256;

/// Most retries one run applies; more are rejected. Each is remembered (its
/// action id and time) so that it applies once.
pub const MAX_RETRIES_PER_RUN: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl RunStatus {
    /// Every status, for the HTTP API's description.
    pub const ALL: [RunStatus; 4] = [
        RunStatus::Running,
        RunStatus::Succeeded,
        RunStatus::Failed,
        RunStatus::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Succeeded => "succeeded",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
        }
    }

    /// A finished run: one that succeeded or was cancelled never
    /// transitions again; a failed one records signals, and is cancelled
    /// or retried (`wakeup.retry`).
    pub fn is_terminal(self) -> bool {
        self != RunStatus::Running
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptStatus {
    Dispatched,
    Succeeded,
    Failed,
    TimedOut,
    Cancelled,
}

impl AttemptStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptStatus::Dispatched => "dispatched",
            AttemptStatus::Succeeded => "succeeded",
            AttemptStatus::Failed => "failed",
            AttemptStatus::TimedOut => "timed_out",
            AttemptStatus::Cancelled => "cancelled",
        }
    }
}

/// The one attempt whose result can change the run (the fencing token is `stamp`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outstanding {
    pub stamp: Uuid,
    pub step_index: u32,
    pub attempt: u32,
    pub dispatched_at: DateTime<Utc>,
    pub deadline: DateTime<Utc>,
}

/// A step that waits (`sleep` or `await_signal`) and the timer that ends
/// the wait: its `wakeup.timer` (`"wake"`) names `stamp`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiting {
    pub stamp: Uuid,
    pub step_index: u32,
    pub since: DateTime<Utc>,
    /// When the sleep ends, or the wait for a signal times out.
    pub until: DateTime<Utc>,
    /// The signal name an `await_signal` step waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
}

/// How often a step of a looping run has started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Visits {
    /// Starts so far, this one included.
    pub count: u32,
    /// The number of the current visit's first attempt: attempts are
    /// numbered on across visits (each number names one attempt of the
    /// step), and a visit's retries count from here.
    pub first_attempt: u32,
}

/// What became of a branch of a `parallel` step or an item of a `map`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LaneStatus {
    Running,
    Succeeded,
    Failed,
    /// Stopped because another branch failed first (`fail_fast`), or the
    /// run ended.
    Cancelled,
}

/// Where one branch of a running `parallel` step stands: the same
/// cursor as the run's own (its step, attempt, outstanding attempt,
/// pending retry and wait), with its own stamps. Steps are numbered
/// across the whole workflow ([`crate::coordinator::definition::Place`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lane {
    /// Its number, unique among the run's lanes.
    pub id: u32,
    /// The lane whose step it runs in (by `id`); `None` when that is the
    /// run's own cursor. A map's items run the steps inside it at once, so
    /// a nested step's lanes are told apart by the lane they belong to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<u32>,
    /// The index of the `parallel` or `map` step.
    pub parallel: u32,
    /// Which of its branches, by position (0 in a map).
    pub branch: u32,
    /// In a map: the item, by position in its input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<u32>,
    /// Attempts of its current task step so far: its retries count them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tries: u32,
    pub status: LaneStatus,
    /// Its current step (its last, once it succeeded).
    pub step_index: u32,
    pub attempt: u32,
    /// The output of its newest finished step (the parallel step's input
    /// before one did): the branch's result once it succeeded.
    pub output: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outstanding: Option<Outstanding>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_retry: Option<PendingRetry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Waiting>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A task step that succeeded and names a compensation: what the run
/// undoes if a later failure's catch compensates it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Compensable {
    /// The index of the compensation step (not of the step it undoes).
    pub step_index: u32,
    /// The step key of the step it undoes (its visit and items included):
    /// the compensation's own is this with `/compensate`.
    pub step_key: String,
    /// The output of the step it undoes: the compensation's input.
    pub output: Value,
}

/// Why and how far a run compensates: from the catch that began it on,
/// and kept once the run failed (compensated, or its compensation failed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Compensating {
    /// The index of the step whose failure the catch compensates.
    pub failed_step: u32,
    /// The cause and error of that failure, which the run fails with
    /// once the compensations ran.
    pub cause: String,
    pub error: String,
    /// Attempts of the current compensation: its retries count them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tries: u32,
}

/// A retry waiting for its timer; the timer names the failed attempt's stamp.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingRetry {
    pub after_stamp: Uuid,
    pub due_at: DateTime<Utc>,
}

/// Every attempt ever dispatched, kept for fencing (stale vs duplicate) and inspection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub stamp: Uuid,
    pub step_index: u32,
    pub attempt: u32,
    pub status: AttemptStatus,
    pub dispatched_at: DateTime<Utc>,
    pub deadline: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
}

/// A signal the run received, kept to deduplicate by `signal_id`. Its
/// payload is in the detail of the transition that recorded it; the state
/// keeps it only while a later `await_signal` step of the run may still
/// consume it, so that the state does not grow with what signals carry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignalRecord {
    pub signal_id: String,
    pub name: String,
    pub received_at: DateTime<Utc>,
    /// The payload of a signal kept for a step that has not started yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
    /// Whether a step will consume it when it starts (the payload is then
    /// set; `null` is a payload too).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kept: bool,
    /// The `await_signal` step that consumed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumed_by: Option<u32>,
    /// [`crate::contract::fingerprint::signal`] of its name and payload: a
    /// later signal under the same id must match it. Absent in signals
    /// recorded before fingerprints were kept; those match anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

/// A retry the run applied, kept to apply each `action_id` once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryRecord {
    pub action_id: String,
    pub at: DateTime<Utc>,
    /// The step the run was started again from.
    pub step_index: u32,
}

/// What retention left of a finished run it deleted: its tombstone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Purged {
    pub tenant: String,
    /// The fingerprint of the request that started it, if it was kept.
    pub start_fingerprint: Option<String>,
}

/// The version of the stored state's shape that this binary writes. A
/// document without `v` is version 1, the shape of every state written
/// before the version was kept; version 3 keeps `retries` and `failed_seq`
/// (see [`super::stored`]), and came with the migration
/// `20261206000021_state_version_3`; version 4 keeps `results` and
/// `visits`, and came
/// with `20261207000024_state_version_4`; version 5 keeps `lanes`, and came
/// with `20261208000025_state_version_5`; version 6 keeps `compensable`
/// and `compensating`, and came with `20261209000026_state_version_6`;
/// version 7 keeps `parent`, and came with
/// `20261210000027_state_version_7`, which the column's comment names.
pub const STATE_VERSION: u32 = 7;

/// A child run's parent ([`RunState::parent`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parent {
    pub run_id: String,
    pub stamp: Uuid,
}

/// The version of a document that has no `v`.
pub(super) fn unversioned() -> u32 {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// The version of the shape of this document (`v`): [`STATE_VERSION`]
    /// in every state the fold makes or the store hands it, since loading
    /// upgrades an older one ([`super::stored::decode`]).
    #[serde(rename = "v", default = "unversioned")]
    pub encoding_version: u32,
    pub run_id: String,
    pub tenant: String,
    /// Routing pool owning the run (not the pool of a step).
    pub pool: String,
    pub workflow: String,
    pub workflow_version: u32,
    pub status: RunStatus,
    /// Current step (the last one, once the run succeeded).
    pub step_index: u32,
    /// Current attempt number of the current step, 1-based.
    pub attempt: u32,
    pub input: Value,
    /// The output of the newest step that succeeded (`null` before one
    /// did): the next step's input, and the run's result once the last
    /// step succeeded. Every step's output is in the detail of the
    /// transition its success made, so the state does not grow with them.
    pub output: Value,
    /// The run's document but its `input`: each finished step's result at
    /// its result path (`steps/<name>` by default), for the steps that
    /// select their input and the run's output selection
    /// ([`super::document`]). Absent in runs of workflows that select no
    /// data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub results: Option<Map<String, Value>>,
    /// The starts of each step (by index), in a run of a workflow that
    /// loops ([`super::flow::has_loops`]): the bound of `max_visits`, the
    /// visit a step key names, and where the attempts of the current visit
    /// begin. Absent otherwise.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub visits: BTreeMap<u32, Visits>,
    pub outstanding: Option<Outstanding>,
    pub pending_retry: Option<PendingRetry>,
    /// The branches of the `parallel` steps the run is in (the run's own
    /// cursor stays on the parallel step meanwhile), in the order they
    /// started. Absent when it is in none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lanes: Vec<Lane>,
    /// The step the run waits in, if it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Waiting>,
    /// The task steps that succeeded and name a compensation, oldest
    /// first, but those already compensated: what a compensation undoes,
    /// newest first. Absent while there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compensable: Vec<Compensable>,
    /// Once a catch began to compensate the run: why, and the retries of
    /// the compensation running. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensating: Option<Compensating>,
    /// A child run's parent: the run and the attempt of its `child` step
    /// that this run's outcome answers. Absent in a run started otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<Parent>,
    pub attempts: Vec<AttemptRecord>,
    pub signals: Vec<SignalRecord>,
    /// The retries the run applied, oldest first. Absent while there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retries: Vec<RetryRecord>,
    /// While the run is failed: the seq of the transition that failed it,
    /// which a retry names ([`RunState::failure_seq`]). Absent otherwise,
    /// and in runs that failed before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_seq: Option<i64>,
    pub correlation_id: Option<String>,
    /// The W3C trace the run belongs to, as of its last transition: its
    /// span id is that transition's, the parent of the next hop. The fold
    /// keeps it as it is; the apply stage sets it. Absent in untraced runs
    /// (and in runs started before traces were kept); one that no longer
    /// parses is dropped, so that the state always loads.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::contract::trace::deserialize_lenient"
    )]
    pub trace: Option<crate::contract::TraceContext>,
    /// [`crate::contract::fingerprint::start`] of the start that created
    /// the run: a later client-chosen start of the same run id must match
    /// it. Absent in runs started before fingerprints were kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_fingerprint: Option<String>,
    /// Why the run failed or was cancelled.
    pub error: Option<String>,
    /// Optimistic lock: the fold never changes it, the store bumps it on each UPDATE.
    pub record_version: i64,
    pub last_transition_seq: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl RunState {
    /// The seq of the transition that failed the run, if it is failed: a
    /// retry must name it. A run that failed before the seq was kept made
    /// no transition since (a failed run then took none), so its last one
    /// failed it.
    pub fn failure_seq(&self) -> Option<i64> {
        (self.status == RunStatus::Failed)
            .then(|| self.failed_seq.unwrap_or(self.last_transition_seq))
    }

    /// Whether the run is failed and compensated: every compensation ran,
    /// and there is nothing to retry.
    pub fn is_compensated(&self) -> bool {
        self.status == RunStatus::Failed
            && self.compensating.is_some()
            && self.compensable.is_empty()
    }

    /// The attempt with this stamp, if the run ever dispatched it.
    pub fn attempt_by_stamp(&self, stamp: Uuid) -> Option<&AttemptRecord> {
        self.attempts.iter().find(|a| a.stamp == stamp)
    }
}
