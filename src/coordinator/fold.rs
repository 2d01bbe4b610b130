//! The fold: `(run state, input, definitions, now, entropy) -> Decision`.
//!
//! Pure and total: no I/O, no clock, no randomness of its own (the caller supplies
//! `now` and one [`Entropy`] per call), never panics. A NoOp or Rejection leaves the
//! state untouched (the fold only borrows it); a Transition carries the whole new
//! state plus the rows and effects the store commits with it in one transaction.

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::definition::{OnTimeout, StepDefinition, StepKind, WorkflowDefinition, Workflows};
use super::state::{
    AttemptRecord, AttemptStatus, MAX_SIGNALS_PER_RUN, Outstanding, PendingRetry, Purged, RunState,
    RunStatus, SignalRecord,
};
use crate::contract::effects::{RunEvent, RunOutput, rfc3339};
use crate::contract::input::{
    AttemptOutcome, AttemptResult, CancelWakeup, Input, MISSING_WORKFLOW_REF, RunStart,
    SCHEMA_VERSION, SignalWakeup, TimerKind, TimerWakeup, encoded_len, truncate,
};
use crate::contract::{
    Effect, EffectKind, EffectTarget, StepDispatch, TransitionKind, fingerprint, names,
};

mod waits;
use waits::{Entered, keeps_signal};

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
    /// Any non-duplicate input to a finished run, including a second cancel.
    RunTerminal,
    /// Any input to a finished run that retention deleted (but a start
    /// with another request than the run's): it stays deleted.
    RunPurged,
}

impl NoOpReason {
    pub fn as_str(self) -> &'static str {
        match self {
            NoOpReason::DuplicateStart => "duplicate_start",
            NoOpReason::DuplicateResult => "duplicate_result",
            NoOpReason::StaleResult => "stale_result",
            NoOpReason::DuplicateTimer => "duplicate_timer",
            NoOpReason::DuplicateSignal => "duplicate_signal",
            NoOpReason::RunTerminal => "run_terminal",
            NoOpReason::RunPurged => "run_purged",
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
}

impl RejectionClass {
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionClass::UnknownRun => "unknown_run",
            RejectionClass::TenantMismatch => "tenant_mismatch",
            RejectionClass::UnknownStamp => "unknown_stamp",
            RejectionClass::UnknownWorkflow => "unknown_workflow",
            RejectionClass::TooManySignals => "too_many_signals",
            RejectionClass::StateTooLarge => STATE_TOO_LARGE,
            RejectionClass::IdempotencyMismatch => "idempotency_mismatch",
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
    bound_state(decision, state, input, max_state_bytes, now, entropy)
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
            Input::Start(start) => on_start(start, workflows, now, entropy),
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
    };
    match input {
        Input::Start(start) => on_duplicate_start(state, start),
        Input::Result(result) => ctx.on_result(result),
        Input::Timer(timer) => ctx.on_timer(timer),
        Input::Signal(signal) => ctx.on_signal(signal),
        Input::Cancel(cancel) => ctx.on_cancel(cancel),
    }
}

/// Every input of a run loads its state and writes it back whole, so the
/// state's size bounds what each of them costs. A transition that would
/// leave it over `max` bytes, as Ductor encodes it, is not taken: the run
/// fails instead, for good, with class [`STATE_TOO_LARGE`] (a start has no
/// run to fail, and is refused with that class). The failure is taken
/// whatever its own size: it adds one error text to the state the run
/// had, and the run grows no more.
fn bound_state(
    decision: Decision,
    state: Option<&RunState>,
    input: &Input,
    max: usize,
    now: DateTime<Utc>,
    entropy: &Entropy,
) -> Decision {
    let Decision::Transition(t) = &decision else {
        return decision;
    };
    let len = encoded_len(&t.state);
    if len <= max {
        return decision;
    }
    let error =
        format!("{STATE_TOO_LARGE}: the run's state would be {len} bytes, over the limit of {max}");
    match state {
        None => reject(RejectionClass::StateTooLarge, error),
        Some(state) => fail_too_large(state, input, error, now, entropy),
    }
}

/// Fails the run whose next state would be too large. The outstanding
/// attempt, if any, ends: failed when the input is its own result (what it
/// returned is what did not fit), cancelled otherwise (it is abandoned, as
/// a cancel abandons it), so its late result changes nothing.
fn fail_too_large(
    state: &RunState,
    input: &Input,
    error: String,
    now: DateTime<Utc>,
    entropy: &Entropy,
) -> Decision {
    let own = |stamp: Uuid| matches!(input, Input::Result(r) if r.stamp == stamp);
    let failure = Failure {
        cause: STATE_TOO_LARGE,
        error,
        input_ref: input.dedup_ref(),
    };
    fail_run(state, failure, own, now, entropy)
}

/// Fails a run whose workflow version `workflows` no longer defines, so
/// that no input of it can apply any more: its outstanding attempt is
/// abandoned (cancelled, so a late result changes nothing), a pending
/// retry is dropped, a wait is ended (its wake timer then finds the run
/// finished), and the `run.failed` transition, from no input, has
/// [`MISSING_WORKFLOW_REF`] for its input and [`WORKFLOW_MISSING`] for its
/// cause. `None` when there is nothing to fail: the run is finished, or
/// its version is defined. Like the failure of a state too large, it is
/// taken whatever its size.
pub fn fail_missing_workflow(
    state: &RunState,
    workflows: &Workflows,
    now: DateTime<Utc>,
) -> Option<Transition> {
    if state.status.is_terminal()
        || workflows
            .get(&state.workflow, state.workflow_version)
            .is_some()
    {
        return None;
    }
    let failure = Failure {
        cause: WORKFLOW_MISSING,
        error: format!(
            "{WORKFLOW_MISSING}: workflow {:?} version {} is no longer defined",
            state.workflow, state.workflow_version
        ),
        input_ref: MISSING_WORKFLOW_REF.to_owned(),
    };
    // Nothing is dispatched and nothing is jittered.
    let entropy = Entropy {
        stamp: Uuid::nil(),
        jitter_unit: 0.0,
    };
    match fail_run(state, failure, |_| false, now, &entropy) {
        Decision::Transition(transition) => Some(*transition),
        Decision::NoOp(_) | Decision::Rejection(_) => None,
    }
}

/// Why a run is failed from outside its steps.
struct Failure {
    /// The class, in the detail's `cause` and at the start of `error`.
    cause: &'static str,
    error: String,
    input_ref: String,
}

/// Fails the run for good. Its outstanding attempt, if any, ends: failed
/// when `own(stamp)` says the input is that attempt's own result,
/// cancelled otherwise.
fn fail_run(
    state: &RunState,
    failure: Failure,
    own: impl Fn(Uuid) -> bool,
    now: DateTime<Utc>,
    entropy: &Entropy,
) -> Decision {
    let Failure {
        cause,
        error,
        input_ref,
    } = failure;
    let mut b = Builder::new(state.clone(), Some(state.status), now, entropy);
    if let Some(outstanding) = state.outstanding.as_ref() {
        let status = if own(outstanding.stamp) {
            AttemptStatus::Failed
        } else {
            AttemptStatus::Cancelled
        };
        b.detail("stamp", outstanding.stamp.to_string().into());
        b.finish_attempt(outstanding.stamp, status, Some(error.clone()));
    }
    b.state.pending_retry = None;
    b.state.waiting = None;
    b.state.status = RunStatus::Failed;
    b.detail("cause", cause.into());
    b.detail(
        "error",
        truncate(error.clone(), MAX_DETAIL_ERROR_LEN).into(),
    );
    b.state.error = Some(error);
    b.finish(TransitionKind::RunFailed, input_ref)
}

fn reject(class: RejectionClass, message: impl Into<String>) -> Decision {
    Decision::Rejection(Rejection {
        class,
        message: truncate(message.into(), 512),
    })
}

fn on_start(
    start: &RunStart,
    workflows: &Workflows,
    now: DateTime<Utc>,
    entropy: &Entropy,
) -> Decision {
    let def = match start.workflow_version {
        Some(v) => workflows.get(&start.workflow, v),
        None => workflows.latest(&start.workflow),
    };
    let Some(def) = def else {
        return reject(
            RejectionClass::UnknownWorkflow,
            format!(
                "workflow {:?} version {} is not defined",
                start.workflow,
                start
                    .workflow_version
                    .map_or("latest".to_owned(), |v| v.to_string())
            ),
        );
    };
    let state = RunState {
        run_id: start.run_id.clone(),
        tenant: start.tenant.clone(),
        pool: start.pool.clone(),
        workflow: def.name.clone(),
        workflow_version: def.version,
        status: RunStatus::Running,
        step_index: 0,
        attempt: 1,
        input: start.input.clone(),
        output: Value::Null,
        outstanding: None,
        pending_retry: None,
        waiting: None,
        attempts: Vec::new(),
        signals: Vec::new(),
        correlation_id: start.correlation_id.clone(),
        start_fingerprint: Some(fingerprint::start(start)),
        error: None,
        record_version: 0,
        last_transition_seq: 0,
        created_at: now,
        updated_at: now,
    };
    let mut b = Builder::new(state, None, now, entropy);
    b.detail("workflow", def.name.clone().into());
    b.detail("workflow_version", def.version.into());
    // A run whose first steps end at once (a sleep until a time past) may
    // be done, or failed, by the end of its first transition.
    match b.enter(def, 0) {
        Ok(Entered::Started(stamp)) => b.detail("stamp", stamp.to_string().into()),
        Ok(Entered::Succeeded | Entered::Failed) => {}
        Err(rejection) => return rejection,
    }
    b.finish(TransitionKind::RunStarted, "start".to_owned())
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

/// A start of a run that exists: the same request again is a duplicate, a
/// different one under the same run id is refused.
fn on_duplicate_start(state: &RunState, start: &RunStart) -> Decision {
    match &state.start_fingerprint {
        Some(stored) if *stored != fingerprint::start(start) => reject(
            RejectionClass::IdempotencyMismatch,
            "run.start: the run exists, started by a different request",
        ),
        _ => Decision::NoOp(NoOpReason::DuplicateStart),
    }
}

/// The borrowed arguments of one fold over an existing run.
struct Ctx<'a> {
    state: &'a RunState,
    input: &'a Input,
    workflows: &'a Workflows,
    now: DateTime<Utc>,
    entropy: &'a Entropy,
}

impl Ctx<'_> {
    fn builder(&self) -> Builder<'_> {
        Builder::new(
            self.state.clone(),
            Some(self.state.status),
            self.now,
            self.entropy,
        )
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

    fn on_result(&self, result: &AttemptResult) -> Decision {
        let Some(attempt) = self.state.attempt_by_stamp(result.stamp) else {
            return reject(
                RejectionClass::UnknownStamp,
                "stamp names no attempt of this run",
            );
        };
        // Canary: without stamp fencing, a duplicate or a late result of an
        // abandoned attempt changes the run. Only for proving the chaos
        // checker notices.
        let fenced =
            cfg!(not(feature = "canary-no-stamp-dedup")) || self.state.status.is_terminal();
        if fenced
            && (!self.is_outstanding(result.stamp) || attempt.status != AttemptStatus::Dispatched)
        {
            return Decision::NoOp(match attempt.status {
                AttemptStatus::Succeeded | AttemptStatus::Failed => NoOpReason::DuplicateResult,
                AttemptStatus::Dispatched | AttemptStatus::TimedOut | AttemptStatus::Cancelled => {
                    NoOpReason::StaleResult
                }
            });
        }
        let def = match self.definition() {
            Ok(def) => def,
            Err(rejection) => return rejection,
        };
        match &result.outcome {
            AttemptOutcome::Succeeded { output } => self.on_success(def, attempt, output),
            AttemptOutcome::Failed { message, retryable } => {
                let mut b = self.builder();
                b.finish_attempt(attempt.stamp, AttemptStatus::Failed, Some(message.clone()));
                let error = format!(
                    "step {} attempt {} failed: {message}",
                    attempt.step_index, attempt.attempt
                );
                let kind = b.after_failure(
                    def,
                    attempt,
                    error,
                    *retryable,
                    TransitionKind::StepRetryScheduled,
                );
                b.finish(kind, self.input.dedup_ref())
            }
        }
    }

    fn on_success(
        &self,
        def: &WorkflowDefinition,
        attempt: &AttemptRecord,
        output: &Value,
    ) -> Decision {
        let mut b = self.builder();
        b.finish_attempt(attempt.stamp, AttemptStatus::Succeeded, None);
        b.state.output = output.clone();
        b.detail("stamp", attempt.stamp.to_string().into());
        b.detail("completed_step", attempt.step_index.into());
        b.detail("output", output.clone());
        match b.after_step(def, attempt.step_index.saturating_add(1)) {
            Ok(kind) => b.finish(kind, self.input.dedup_ref()),
            Err(rejection) => rejection,
        }
    }

    fn on_timer(&self, timer: &TimerWakeup) -> Decision {
        if timer.timer == TimerKind::Wake {
            return self.on_wake(timer);
        }
        let Some(attempt) = self.state.attempt_by_stamp(timer.stamp) else {
            return reject(
                RejectionClass::UnknownStamp,
                "stamp names no attempt of this run",
            );
        };
        let due = match timer.timer {
            TimerKind::Timeout => {
                self.is_outstanding(timer.stamp) && attempt.status == AttemptStatus::Dispatched
            }
            TimerKind::Wake => false,
            TimerKind::Retry => {
                !self.state.status.is_terminal()
                    && self
                        .state
                        .pending_retry
                        .as_ref()
                        .is_some_and(|p| p.after_stamp == timer.stamp)
            }
        };
        if !due {
            return Decision::NoOp(NoOpReason::DuplicateTimer);
        }
        let def = match self.definition() {
            Ok(def) => def,
            Err(rejection) => return rejection,
        };
        let mut b = self.builder();
        match timer.timer {
            TimerKind::Timeout => {
                let timeout_ms = step(def, attempt.step_index).map_or(0, |s| s.timeout_ms);
                let error = format!(
                    "step {} attempt {} timed out after {timeout_ms} ms",
                    attempt.step_index, attempt.attempt
                );
                b.finish_attempt(attempt.stamp, AttemptStatus::TimedOut, Some(error.clone()));
                let kind = b.after_failure(def, attempt, error, true, TransitionKind::StepTimedOut);
                b.finish(kind, self.input.dedup_ref())
            }
            TimerKind::Wake => Decision::NoOp(NoOpReason::DuplicateTimer),
            TimerKind::Retry => {
                let next_attempt = self.state.attempt.saturating_add(1);
                let Some(stamp) = b.dispatch(def, self.state.step_index, next_attempt) else {
                    return reject(
                        RejectionClass::UnknownWorkflow,
                        "workflow has fewer steps than the run",
                    );
                };
                b.detail("after_stamp", timer.stamp.to_string().into());
                b.detail("stamp", stamp.to_string().into());
                b.finish(TransitionKind::StepRetried, self.input.dedup_ref())
            }
        }
    }

    fn on_signal(&self, signal: &SignalWakeup) -> Decision {
        let s = self.state;
        let fingerprint = fingerprint::signal(&signal.name, &signal.payload);
        let recorded = s.signals.iter().find(|r| r.signal_id == signal.signal_id);
        if let Some(stored) = recorded.and_then(|r| r.fingerprint.as_ref())
            && *stored != fingerprint
        {
            return reject(
                RejectionClass::IdempotencyMismatch,
                "wakeup.signal: signal_id already recorded with another name or payload",
            );
        }
        if s.status.is_terminal() {
            return Decision::NoOp(NoOpReason::RunTerminal);
        }
        if recorded.is_some() {
            return Decision::NoOp(NoOpReason::DuplicateSignal);
        }
        if s.signals.len() >= MAX_SIGNALS_PER_RUN {
            return reject(
                RejectionClass::TooManySignals,
                format!("run already holds {MAX_SIGNALS_PER_RUN} signals"),
            );
        }
        let mut b = self.builder();
        let mut record = SignalRecord {
            signal_id: signal.signal_id.clone(),
            name: signal.name.clone(),
            received_at: self.now,
            payload: None,
            kept: false,
            consumed_by: None,
            fingerprint: Some(fingerprint),
        };
        b.detail("signal_id", signal.signal_id.clone().into());
        b.detail("name", signal.name.clone().into());
        b.detail("payload", signal.payload.clone());
        let def = self.definition().ok();
        let awaited = s
            .waiting
            .as_ref()
            .filter(|w| w.signal.as_deref() == Some(signal.name.as_str()));
        if let (Some(def), Some(waiting)) = (def, awaited) {
            // The step waits for this signal: it is consumed, the run moves on.
            record.consumed_by = Some(waiting.step_index);
            b.state.signals.push(record);
            let member = json!({"signal_id": signal.signal_id, "payload": signal.payload});
            return match b.complete_wait(def, member) {
                Ok(kind) => b.finish(kind, self.input.dedup_ref()),
                Err(rejection) => rejection,
            };
        }
        if def.is_some_and(|def| keeps_signal(def, s.step_index, &s.signals, &signal.name)) {
            record.kept = true;
            record.payload = Some(signal.payload.clone());
        }
        b.state.signals.push(record);
        b.finish(TransitionKind::RunSignalled, self.input.dedup_ref())
    }

    /// The timer of the step the run waits in: a sleep ends, a wait for a
    /// signal times out. Any other wake (of a wait that ended otherwise, a
    /// duplicate) changes nothing.
    fn on_wake(&self, timer: &TimerWakeup) -> Decision {
        let s = self.state;
        let Some(waiting) = s
            .waiting
            .as_ref()
            .filter(|w| w.stamp == timer.stamp && !s.status.is_terminal())
        else {
            return Decision::NoOp(NoOpReason::DuplicateTimer);
        };
        let def = match self.definition() {
            Ok(def) => def,
            Err(rejection) => return rejection,
        };
        let Some(step) = step(def, waiting.step_index) else {
            return reject(
                RejectionClass::UnknownWorkflow,
                "workflow has fewer steps than the run",
            );
        };
        let mut b = self.builder();
        let outcome = match (step.kind, step.on_timeout) {
            (StepKind::AwaitSignal, OnTimeout::Fail) => {
                let error = format!(
                    "step {} ({}) waited {} ms for the signal {:?}, which did not come",
                    waiting.step_index,
                    step.name,
                    step.timeout_ms,
                    waiting.signal.as_deref().unwrap_or_default()
                );
                b.detail("wait_stamp", waiting.stamp.to_string().into());
                b.detail("cause", "signal_timeout".into());
                b.fail_run(waiting.step_index, error);
                Ok(TransitionKind::RunFailed)
            }
            (StepKind::AwaitSignal, OnTimeout::Continue) => {
                b.complete_wait(def, json!({"timed_out": true}))
            }
            _ => b.complete_wait(def, json!({"until": rfc3339(waiting.until)})),
        };
        match outcome {
            Ok(kind) => b.finish(kind, self.input.dedup_ref()),
            Err(rejection) => rejection,
        }
    }

    fn on_cancel(&self, cancel: &CancelWakeup) -> Decision {
        if self.state.status.is_terminal() {
            return Decision::NoOp(NoOpReason::RunTerminal);
        }
        let mut b = self.builder();
        let reason = cancel
            .reason
            .clone()
            .unwrap_or_else(|| "cancelled".to_owned());
        if let Some(outstanding) = self.state.outstanding.as_ref() {
            b.detail("stamp", outstanding.stamp.to_string().into());
            b.finish_attempt(
                outstanding.stamp,
                AttemptStatus::Cancelled,
                Some(reason.clone()),
            );
        }
        b.state.pending_retry = None;
        b.state.waiting = None;
        b.state.status = RunStatus::Cancelled;
        b.detail(
            "reason",
            truncate(reason.clone(), MAX_DETAIL_ERROR_LEN).into(),
        );
        b.state.error = Some(reason);
        b.finish(TransitionKind::RunCancelled, self.input.dedup_ref())
    }
}

fn step(def: &WorkflowDefinition, index: u32) -> Option<&StepDefinition> {
    def.steps.get(usize::try_from(index).ok()?)
}

/// `t + ms`, saturating at the largest representable time.
fn add_ms(t: DateTime<Utc>, ms: u64) -> DateTime<Utc> {
    TimeDelta::try_milliseconds(i64::try_from(ms).unwrap_or(i64::MAX))
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// Accumulates one transition: the new state, attempt writes, effects after the event.
struct Builder<'a> {
    state: RunState,
    from_status: Option<RunStatus>,
    now: DateTime<Utc>,
    entropy: &'a Entropy,
    attempt_writes: Vec<AttemptWrite>,
    effects: Vec<Effect>,
    detail: Map<String, Value>,
}

impl<'a> Builder<'a> {
    fn new(
        state: RunState,
        from_status: Option<RunStatus>,
        now: DateTime<Utc>,
        entropy: &'a Entropy,
    ) -> Self {
        Self {
            state,
            from_status,
            now,
            entropy,
            attempt_writes: Vec::new(),
            effects: Vec::new(),
            detail: Map::new(),
        }
    }

    fn detail(&mut self, key: &str, value: Value) {
        self.detail.insert(key.to_owned(), value);
    }

    /// Dispatches `attempt` of step `step_index` with the entropy's stamp: the attempt
    /// row, the step message and its timeout timer. `None` if the step does not exist.
    fn dispatch(
        &mut self,
        def: &WorkflowDefinition,
        step_index: u32,
        attempt: u32,
    ) -> Option<Uuid> {
        let step = step(def, step_index)?;
        let stamp = self.entropy.stamp;
        let deadline = add_ms(self.now, step.timeout_ms);
        let s = &mut self.state;
        s.step_index = step_index;
        s.attempt = attempt;
        s.pending_retry = None;
        s.outstanding = Some(Outstanding {
            stamp,
            step_index,
            attempt,
            dispatched_at: self.now,
            deadline,
        });
        let record = AttemptRecord {
            stamp,
            step_index,
            attempt,
            status: AttemptStatus::Dispatched,
            dispatched_at: self.now,
            deadline,
            finished_at: None,
            error: None,
        };
        s.attempts.push(record.clone());
        self.attempt_writes.push(AttemptWrite::Insert(record));
        let step_input = if step_index == 0 {
            s.input.clone()
        } else {
            s.output.clone()
        };
        let dispatch = StepDispatch {
            schema_version: SCHEMA_VERSION,
            run_id: s.run_id.clone(),
            tenant: s.tenant.clone(),
            workflow: s.workflow.clone(),
            workflow_version: s.workflow_version,
            step: step.name.clone(),
            step_index,
            attempt,
            step_key: names::step_key(&s.run_id, step_index),
            stamp,
            deadline,
            input: step_input,
        };
        let target = EffectTarget::StepQueue {
            pool: step.pool.clone(),
        };
        let effect = Effect::now(target, EffectKind::StepDispatch, &dispatch);
        self.effects.push(effect);
        self.timer(TimerKind::Timeout, stamp, deadline);
        Some(stamp)
    }

    /// A durable timer: the canonical `wakeup.timer` input, published at `due`.
    fn timer(&mut self, kind: TimerKind, stamp: Uuid, due: DateTime<Utc>) {
        let wakeup = Input::Timer(TimerWakeup {
            run_id: self.state.run_id.clone(),
            tenant: self.state.tenant.clone(),
            timer: kind,
            stamp,
        });
        self.effects.push(Effect {
            target: EffectTarget::Wakeups,
            kind: EffectKind::WakeupTimer,
            payload: wakeup.to_json(),
            not_before: Some(due),
        });
    }

    /// Every step is done: the run succeeded with the last one's output,
    /// published to the workflow's output topic if it has one.
    fn succeed_run(&mut self, def: &WorkflowDefinition) {
        self.state.status = RunStatus::Succeeded;
        if let Some(topic) = &def.output_topic {
            let s = &self.state;
            let output = RunOutput {
                schema_version: SCHEMA_VERSION,
                run_id: &s.run_id,
                tenant: &s.tenant,
                workflow: &s.workflow,
                output: &s.output,
            };
            let target = EffectTarget::Output {
                topic: topic.clone(),
            };
            let effect = Effect::now(target, EffectKind::RunOutput, &output);
            self.effects.push(effect);
        }
    }

    /// Closes the outstanding attempt `stamp` with a final status.
    fn finish_attempt(&mut self, stamp: Uuid, status: AttemptStatus, error: Option<String>) {
        if let Some(record) = self
            .state
            .attempts
            .iter_mut()
            .find(|a| a.stamp == stamp && a.status == AttemptStatus::Dispatched)
        {
            record.status = status;
            record.finished_at = Some(self.now);
            record.error.clone_from(&error);
        }
        self.state.outstanding = None;
        self.attempt_writes.push(AttemptWrite::Finish {
            stamp,
            status,
            finished_at: self.now,
            error,
        });
    }

    /// After a failed or timed-out attempt: schedule a retry if the policy allows one,
    /// otherwise fail the run. Returns the transition kind.
    fn after_failure(
        &mut self,
        def: &WorkflowDefinition,
        attempt: &AttemptRecord,
        error: String,
        retryable: bool,
        retry_kind: TransitionKind,
    ) -> TransitionKind {
        self.detail("stamp", attempt.stamp.to_string().into());
        self.detail(
            "error",
            truncate(error.clone(), MAX_DETAIL_ERROR_LEN).into(),
        );
        let policy = step(def, attempt.step_index).map(|s| &s.retry);
        match policy {
            Some(policy) if retryable && attempt.attempt < policy.max_attempts => {
                let backoff_ms = policy.backoff_ms(attempt.attempt, self.entropy.jitter_unit);
                let due_at = add_ms(self.now, backoff_ms);
                self.state.pending_retry = Some(PendingRetry {
                    after_stamp: attempt.stamp,
                    due_at,
                });
                self.timer(TimerKind::Retry, attempt.stamp, due_at);
                self.detail("backoff_ms", backoff_ms.into());
                self.detail("retry_due_at", rfc3339(due_at).into());
                retry_kind
            }
            _ => {
                let cause = if retryable {
                    "attempts_exhausted"
                } else {
                    "not_retryable"
                };
                self.detail("cause", cause.into());
                self.state.status = RunStatus::Failed;
                self.state.error = Some(error);
                TransitionKind::RunFailed
            }
        }
    }

    /// Numbers the transition, prepends the lifecycle event and seals it.
    fn finish(mut self, kind: TransitionKind, input_ref: String) -> Decision {
        let seq = self.state.last_transition_seq.saturating_add(1);
        self.state.last_transition_seq = seq;
        self.state.updated_at = self.now;
        let s = &self.state;
        let event = RunEvent {
            schema_version: SCHEMA_VERSION,
            run_id: &s.run_id,
            tenant: &s.tenant,
            seq,
            kind,
            status: s.status.as_str(),
            step_index: s.step_index,
            attempt: s.attempt,
            at: self.now,
        };
        let event = Effect::now(EffectTarget::Events, EffectKind::RunEvent, &event);
        let mut effects = Vec::with_capacity(self.effects.len() + 1);
        effects.push(event);
        effects.append(&mut self.effects);
        let record = TransitionRecord {
            seq,
            input_ref,
            kind,
            from_status: self.from_status,
            to_status: s.status,
            step_index: s.step_index,
            at: self.now,
            detail: Value::Object(self.detail),
        };
        Decision::Transition(Box::new(Transition {
            state: self.state,
            record,
            attempt_writes: self.attempt_writes,
            effects,
        }))
    }
}
