//! The fold: `(run state, input, definitions, now, entropy) -> Decision`.
//!
//! Pure and total: no I/O, no clock, no randomness of its own (the caller supplies
//! `now` and one [`Entropy`] per call), never panics. A NoOp or Rejection leaves the
//! state untouched (the fold only borrows it); a Transition carries the whole new
//! state plus the rows and effects the store commits with it in one transaction.
//!
//! In: the run's [`RunState`] (`None` before its start; [`fold_purged`]
//! takes its [`Purged`] tombstone instead), one [`Input`], the
//! [`Workflows`], `coordinator.max_state_bytes`, `now` and an [`Entropy`].
//! Out: a [`Decision`]. Guarantees: an input naming another run or tenant
//! than the state's is rejected; each transition adds one to
//! `last_transition_seq`; no transition leaves a state over
//! `max_state_bytes` but the one that fails the run for it.
//!
//! Here: what a decision is, the entry points, and the checks every input to an
//! existing run passes first (its run, its tenant). Each kind of input is decided
//! in a file of its own: `start`, `attempts` (results, timeouts, retries),
//! `signals`, `waits` (sleeps and waits for a signal, and moving from one step
//! to the next), `choice` (choices, and the visits that bound a loop),
//! `data` (what a step gets and where its result goes), `halt`
//! (a cancel, and the failures from outside a run's steps),
//! `retry` (a failed run started again from the step it failed in);
//! `builder` accumulates what any of them writes.

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::definition::{StepDefinition, WorkflowDefinition, Workflows};
use super::state::{AttemptRecord, AttemptStatus, Purged, RunState, RunStatus};
use crate::contract::input::{Input, truncate};
use crate::contract::{Effect, TransitionKind, fingerprint};

mod attempts;
mod builder;
mod catch;
mod child;
mod choice;
mod compensate;
mod data;
mod halt;
mod parallel;
mod retry;
mod signals;
mod start;
mod waits;
use builder::Builder;
#[cfg(any(test, feature = "internals"))]
pub use builder::derived_stamp;
pub use choice::LOOP_BOUND;
#[cfg(any(test, feature = "internals"))]
pub use compensate::{COMPENSATED, COMPENSATION_FAILED};
pub use data::{RESULT_PATH_BLOCKED, UNRESOLVED_POINTER};
pub use halt::fail_missing_workflow;
#[cfg(any(test, feature = "internals"))]
pub use parallel::{BRANCH_FAILED, ITEM_FAILED, NOT_AN_ARRAY, TOO_MANY_ITEMS};

/// Longest error text copied into a transition's `detail`.
pub const MAX_DETAIL_ERROR_LEN: usize = 256;
/// The class of a run failed because its state would have outgrown
/// `coordinator.max_state_bytes`: the `cause` in the detail of its
/// `run.failed` transition, the start of its error, and the class of a
/// start refused for it.
pub const STATE_TOO_LARGE: &str = "state_too_large";
/// The class of a run failed because the workflow version it runs is no
/// longer defined: the `cause` in the detail of its `run.failed`
/// transition ([`fail_missing_workflow`]) and the start of its error.
pub const WORKFLOW_MISSING: &str = "workflow_missing";

/// Fresh randomness supplied by the caller: at most one stamp and one jitter are used
/// per transition. `stamp` must be new to the run; `jitter_unit` is in `[0, 1)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entropy {
    pub stamp: Uuid,
    pub jitter_unit: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Nothing to write: a duplicate, stale or late input.
    NoOp(NoOpReason),
    /// One state change with everything to commit alongside it.
    Transition(Box<Transition>),
    /// The input cannot apply to this run; nothing to write (dead-letter or log it).
    Rejection(Rejection),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoOpReason {
    DuplicateStart,
    DuplicateResult,
    /// A late result of an abandoned (timed-out or cancelled) attempt.
    StaleResult,
    /// A timer for something no longer pending.
    DuplicateTimer,
    DuplicateSignal,
    /// A retry whose `action_id` the run applied already.
    DuplicateRetry,
    /// A retry of a run that is not failed: running (a retry of it was
    /// applied first, or it never failed), succeeded or cancelled.
    RunNotFailed,
    /// A retry naming another failure than the one the run is failed by.
    StaleRetry,
    /// Any non-duplicate input to a finished run, including a second cancel.
    RunTerminal,
    /// Any input to a finished run that retention deleted (but a start
    /// with another request than the run's): it stays deleted.
    RunPurged,
    /// A retry of a run that failed compensated: what it did is undone,
    /// and there is no step to start again from.
    RunCompensated,
}

impl NoOpReason {
    pub fn as_str(self) -> &'static str {
        match self {
            NoOpReason::DuplicateStart => "duplicate_start",
            NoOpReason::DuplicateResult => "duplicate_result",
            NoOpReason::StaleResult => "stale_result",
            NoOpReason::DuplicateTimer => "duplicate_timer",
            NoOpReason::DuplicateSignal => "duplicate_signal",
            NoOpReason::DuplicateRetry => "duplicate_retry",
            NoOpReason::RunNotFailed => "run_not_failed",
            NoOpReason::StaleRetry => "stale_retry",
            NoOpReason::RunTerminal => "run_terminal",
            NoOpReason::RunPurged => "run_purged",
            NoOpReason::RunCompensated => "run_compensated",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub class: RejectionClass,
    /// Bounded; names the offending field, never echoes payloads.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectionClass {
    UnknownRun,
    TenantMismatch,
    UnknownStamp,
    UnknownWorkflow,
    TooManySignals,
    /// A start whose run's state would be over `coordinator.max_state_bytes`.
    StateTooLarge,
    /// A client-chosen start of an existing run, or a signal under a
    /// recorded `signal_id`, that means something else than the first one.
    IdempotencyMismatch,
    /// A retry of a run that has applied `MAX_RETRIES_PER_RUN` already.
    TooManyRetries,
}

impl RejectionClass {
    /// Every class: the dead-letter counter starts each at zero.
    pub const ALL: [RejectionClass; 8] = [
        RejectionClass::UnknownRun,
        RejectionClass::TenantMismatch,
        RejectionClass::UnknownStamp,
        RejectionClass::UnknownWorkflow,
        RejectionClass::TooManySignals,
        RejectionClass::StateTooLarge,
        RejectionClass::IdempotencyMismatch,
        RejectionClass::TooManyRetries,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectionClass::UnknownRun => "unknown_run",
            RejectionClass::TenantMismatch => "tenant_mismatch",
            RejectionClass::UnknownStamp => "unknown_stamp",
            RejectionClass::UnknownWorkflow => "unknown_workflow",
            RejectionClass::TooManySignals => "too_many_signals",
            RejectionClass::StateTooLarge => STATE_TOO_LARGE,
            RejectionClass::IdempotencyMismatch => "idempotency_mismatch",
            RejectionClass::TooManyRetries => "too_many_retries",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// The new state: `last_transition_seq = old + 1` (1 for a start), `updated_at = now`.
    pub state: RunState,
    pub record: TransitionRecord,
    pub attempt_writes: Vec<AttemptWrite>,
    /// In publication order: the `ductor.events` lifecycle event is always first.
    pub effects: Vec<Effect>,
}

/// The append-only history row of one transition.
#[derive(Debug, Clone, PartialEq)]
pub struct TransitionRecord {
    pub seq: i64,
    /// [`Input::dedup_ref`] of the input that caused it.
    pub input_ref: String,
    pub kind: TransitionKind,
    /// `None` for the transition that created the run.
    pub from_status: Option<RunStatus>,
    pub to_status: RunStatus,
    /// The run's step index after the transition.
    pub step_index: u32,
    pub at: DateTime<Utc>,
    /// JSON with the specifics: stamps, bounded error text, retry due time,
    /// and what the state does not keep: a succeeded step's `output`, a
    /// signal's `payload` (each bounded by the size budget of the input
    /// that carried it).
    pub detail: Value,
}

/// A row change in the attempts table, mirroring `RunState::attempts`.
#[derive(Debug, Clone, PartialEq)]
pub enum AttemptWrite {
    Insert(AttemptRecord),
    Finish {
        stamp: Uuid,
        status: AttemptStatus,
        finished_at: DateTime<Utc>,
        error: Option<String>,
    },
}

/// Folds one input into a run. See the module docs of `crate::coordinator`.
/// No transition leaves a state that encodes to more than `max_state_bytes`
/// (`coordinator.max_state_bytes`), except the one that fails the run for it.
pub fn fold(
    state: Option<&RunState>,
    input: &Input,
    workflows: &Workflows,
    max_state_bytes: usize,
    now: DateTime<Utc>,
    entropy: &Entropy,
) -> Decision {
    let decision = decide(state, input, workflows, now, entropy);
    let at = halt::At {
        def: state.and_then(|s| workflows.get(&s.workflow, s.workflow_version)),
        now,
        entropy,
    };
    halt::bound_state(decision, state, input, max_state_bytes, &at)
}

/// What `input` does to the run, before the new state's size is looked at.
fn decide(
    state: Option<&RunState>,
    input: &Input,
    workflows: &Workflows,
    now: DateTime<Utc>,
    entropy: &Entropy,
) -> Decision {
    let Some(state) = state else {
        return match input {
            Input::Start(start) => start::on_start(start, workflows, now, entropy),
            _ => reject(RejectionClass::UnknownRun, "run does not exist"),
        };
    };
    if state.run_id != input.run_id() {
        return reject(
            RejectionClass::UnknownRun,
            "input names a different run than the state",
        );
    }
    if state.tenant != input.tenant() {
        return reject(
            RejectionClass::TenantMismatch,
            "tenant does not match the run's tenant",
        );
    }
    let ctx = Ctx {
        state,
        input,
        workflows,
        now,
        entropy,
        focus: Vec::new(),
    };
    match input {
        Input::Start(start) => start::on_duplicate_start(state, start),
        Input::Result(result) => ctx.on_result(result),
        Input::Timer(timer) => ctx.on_timer(timer),
        Input::Signal(signal) => ctx.on_signal(signal),
        Input::Cancel(cancel) => ctx.on_cancel(cancel),
        Input::Retry(retry) => ctx.on_retry(retry),
    }
}

/// What `input` does to a finished run that retention deleted: nothing, as
/// it did to the run before it was deleted. A start of it with another
/// request, and an input of another tenant, are refused as they were then.
pub fn fold_purged(purged: &Purged, input: &Input) -> Decision {
    if purged.tenant != input.tenant() {
        return reject(
            RejectionClass::TenantMismatch,
            "tenant does not match the run's tenant",
        );
    }
    match (input, &purged.start_fingerprint) {
        (Input::Start(start), Some(stored)) if *stored != fingerprint::start(start) => reject(
            RejectionClass::IdempotencyMismatch,
            "run.start: the run existed (it finished and was purged), started by a different request",
        ),
        _ => Decision::NoOp(NoOpReason::RunPurged),
    }
}

fn reject(class: RejectionClass, message: impl Into<String>) -> Decision {
    Decision::Rejection(Rejection {
        class,
        message: truncate(message.into(), 512),
    })
}

/// The borrowed arguments of one fold over an existing run.
struct Ctx<'a> {
    state: &'a RunState,
    input: &'a Input,
    workflows: &'a Workflows,
    now: DateTime<Utc>,
    entropy: &'a Entropy,
    /// The lanes whose cursors are in `state`'s own fields, outermost
    /// first: the input is a branch's (see `parallel`).
    focus: Vec<usize>,
}

impl Ctx<'_> {
    fn builder(&self) -> Builder<'_> {
        let mut b = Builder::new(
            self.state.clone(),
            Some(self.state.status),
            self.now,
            self.entropy,
        );
        b.focus.clone_from(&self.focus);
        b.def = self.definition().ok();
        b
    }

    fn definition(&self) -> Result<&WorkflowDefinition, Decision> {
        let s = self.state;
        self.workflows
            .get(&s.workflow, s.workflow_version)
            .ok_or_else(|| {
                reject(
                    RejectionClass::UnknownWorkflow,
                    format!(
                        "workflow {:?} version {} is not defined",
                        s.workflow, s.workflow_version
                    ),
                )
            })
    }

    /// The attempt this stamp names if it is the one outstanding on a running run.
    fn is_outstanding(&self, stamp: Uuid) -> bool {
        !self.state.status.is_terminal()
            && self
                .state
                .outstanding
                .as_ref()
                .is_some_and(|o| o.stamp == stamp)
    }
}

fn step(def: &WorkflowDefinition, index: u32) -> Option<&StepDefinition> {
    def.step(index)
}

/// `t + ms`, saturating at the largest representable time.
fn add_ms(t: DateTime<Utc>, ms: u64) -> DateTime<Utc> {
    TimeDelta::try_milliseconds(i64::try_from(ms).unwrap_or(i64::MAX))
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}
