//! Steps that wait: `sleep` and `await_signal`.
//!
//! Entering a step dispatches a task, or makes the run wait with one
//! durable `wakeup.timer` (`"wake"`, named by the wait's stamp) that ends
//! the sleep or times out the wait for a signal. A wait that can end at
//! once (a sleep until a time already past, a signal kept for the step
//! because it came while an earlier step ran) ends in the same transition,
//! and the next step is entered in turn; so one transition introduces at
//! most one stamp. A waiting step's output is its input with one member
//! named after the step: `{"until": time}` for a sleep, `{"signal_id",
//! "payload"}` for the signal an await got, `{"timed_out": true}` for an
//! await whose timeout goes on.
//!
//! In: a step to enter, or the `wake` timer of a wait. Out: the run moved to
//! the first step that does not end at once, or to its end (succeeded, or
//! failed by a wait that timed out or a sleep that cannot tell until when).
//! Guarantees: only the wake timer of the wait the run is in changes it; a
//! wake of a wait that ended otherwise changes nothing. Pure: no database, no
//! clock; what it decides is tested without either.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::parallel::Branches;
use super::{Builder, Ctx, Decision, NoOpReason, RejectionClass, reject, step};
use crate::contract::effects::rfc3339;
use crate::contract::{TimerKind, TimerWakeup, TransitionKind};
use crate::coordinator::definition::{OnTimeout, StepDefinition, StepKind, WorkflowDefinition};
use crate::coordinator::state::{RunStatus, Waiting};

/// Where entering a step left the run.
pub(super) enum Entered {
    /// A task was dispatched or a wait began, under this stamp.
    Started(Uuid),
    /// Every step is done.
    Succeeded,
    /// A step could not start (a sleep whose time is not in its input).
    Failed,
}

impl Builder<'_> {
    /// Enters step `index`, and the steps after it while they end at once.
    pub(super) fn enter(
        &mut self,
        def: &WorkflowDefinition,
        mut index: u32,
    ) -> Result<Entered, Decision> {
        loop {
            if self.at_end_of_branch(index) {
                self.state.status = RunStatus::Succeeded;
                return Ok(Entered::Succeeded);
            }
            if self.focus.is_empty() && index as usize == def.steps.len() {
                if let Err(error) = self.select_output(def) {
                    let last = index.saturating_sub(1);
                    self.fail_data(last, super::UNRESOLVED_POINTER, error);
                    return Ok(Entered::Failed);
                }
                self.succeed_run(def);
                return Ok(Entered::Succeeded);
            }
            let Some(step) = step(def, index) else {
                return Err(fewer_steps());
            };
            let Some(input) = self.begin(def, index, step) else {
                return Ok(Entered::Failed);
            };
            let output = match step.kind {
                StepKind::Task | StepKind::Child => {
                    let attempt = self.first_attempt(index);
                    self.count_try(true);
                    let stamp = self
                        .dispatch(def, index, attempt, input)
                        .ok_or_else(fewer_steps)?;
                    return Ok(Entered::Started(stamp));
                }
                StepKind::Sleep => match sleep_until(self.now, index, step, &input) {
                    Ok(until) if until > self.now => {
                        return Ok(Entered::Started(self.wait(index, until, None)));
                    }
                    Ok(until) => wait_output(input, step, json!({ "until": rfc3339(until) })),
                    Err(error) => {
                        self.fail_run(index, error);
                        return Ok(Entered::Failed);
                    }
                },
                StepKind::Choice => {
                    index = self.choose(def, index, step);
                    continue;
                }
                StepKind::Parallel | StepKind::Map => {
                    match self.enter_parallel(def, index, input)? {
                        Branches::Running(stamp) => return Ok(Entered::Started(stamp)),
                        Branches::Failed => return Ok(Entered::Failed),
                        Branches::Succeeded(output) => output,
                    }
                }
                StepKind::AwaitSignal => {
                    let name = step.signal.clone().unwrap_or_default();
                    match self.take_kept_signal(&name, index) {
                        Some(got) => wait_output(input, step, got),
                        None => {
                            let until = super::add_ms(self.now, step.timeout_ms);
                            return Ok(Entered::Started(self.wait(index, until, Some(name))));
                        }
                    }
                }
            };
            self.state.step_index = index;
            if let Err(error) = self.step_done(step, output.clone()) {
                self.fail_data(index, super::RESULT_PATH_BLOCKED, error);
                return Ok(Entered::Failed);
            }
            self.pass(json!({ "step_index": index, "output": output }));
            index = super::choice::after(def, index);
        }
    }

    /// Counts a start of step `index` and selects its input; `None` when
    /// either fails the run.
    fn begin(
        &mut self,
        def: &WorkflowDefinition,
        index: u32,
        step: &StepDefinition,
    ) -> Option<Value> {
        if let Err(error) = self.visit(def, index, step) {
            self.fail_data(index, super::LOOP_BOUND, error);
            return None;
        }
        match self.step_input(step, index) {
            Ok(input) => Some(input),
            Err(error) => {
                self.fail_data(index, super::UNRESOLVED_POINTER, error);
                None
            }
        }
    }

    /// Records a step passed in this transition in `detail.passed_steps`.
    pub(super) fn pass(&mut self, passed: Value) {
        match self.detail.get_mut("passed_steps") {
            Some(Value::Array(steps)) => steps.push(passed),
            _ => self.detail("passed_steps", json!([passed])),
        }
    }

    /// The step the run waits in is done (its signal came, its time came,
    /// or its wait timed out and the run goes on); the run moves on.
    pub(super) fn complete_wait(
        &mut self,
        def: &WorkflowDefinition,
        member: Value,
    ) -> Result<TransitionKind, Decision> {
        let waiting = self.state.waiting.take().ok_or_else(fewer_steps)?;
        let step = step(def, waiting.step_index).ok_or_else(fewer_steps)?;
        self.detail("wait_stamp", waiting.stamp.to_string().into());
        self.detail("completed_step", waiting.step_index.into());
        // Nothing changed the document while the step waited: its input
        // is the one it began with.
        let input = match self.step_input(step, waiting.step_index) {
            Ok(input) => input,
            Err(error) => {
                self.fail_data(waiting.step_index, super::UNRESOLVED_POINTER, error);
                return Ok(TransitionKind::RunFailed);
            }
        };
        let output = wait_output(input, step, member);
        self.detail("output", output.clone());
        if let Err(error) = self.step_done(step, output) {
            self.fail_data(waiting.step_index, super::RESULT_PATH_BLOCKED, error);
            return Ok(TransitionKind::RunFailed);
        }
        self.after_step(def, super::choice::after(def, waiting.step_index))
    }

    /// After step `next - 1` succeeded: the kind of the transition.
    pub(super) fn after_step(
        &mut self,
        def: &WorkflowDefinition,
        next: u32,
    ) -> Result<TransitionKind, Decision> {
        Ok(match self.enter(def, next)? {
            Entered::Started(_) => {
                // The first stamp the transition introduced.
                self.detail("next_stamp", self.entropy.stamp.to_string().into());
                TransitionKind::StepSucceeded
            }
            Entered::Succeeded => TransitionKind::RunSucceeded,
            Entered::Failed => TransitionKind::RunFailed,
        })
    }

    /// The run fails in step `index` (a wait that timed out, a sleep that
    /// cannot tell until when).
    pub(super) fn fail_run(&mut self, index: u32, error: String) {
        self.state.step_index = index;
        self.state.waiting = None;
        self.state.status = RunStatus::Failed;
        self.detail(
            "error",
            crate::contract::input::truncate(error.clone(), super::MAX_DETAIL_ERROR_LEN).into(),
        );
        self.state.error = Some(error);
    }

    /// The run waits in step `index` until `until`, or for `signal`.
    fn wait(&mut self, index: u32, until: DateTime<Utc>, signal: Option<String>) -> Uuid {
        let stamp = self.stamp();
        let s = &mut self.state;
        s.step_index = index;
        s.attempt = 1;
        s.outstanding = None;
        s.pending_retry = None;
        s.waiting = Some(Waiting {
            stamp,
            step_index: index,
            since: self.now,
            until,
            signal,
        });
        self.timer(TimerKind::Wake, stamp, until);
        stamp
    }

    /// The oldest signal of this name kept for a step, consumed by `index`.
    fn take_kept_signal(&mut self, name: &str, index: u32) -> Option<Value> {
        let record = self
            .state
            .signals
            .iter_mut()
            .find(|r| r.kept && r.name == name)?;
        record.kept = false;
        record.consumed_by = Some(index);
        let payload = record.payload.take().unwrap_or(Value::Null);
        Some(json!({ "signal_id": record.signal_id, "payload": payload }))
    }
}

/// When a sleep step entered at `now` with `input` ends.
fn sleep_until(
    now: DateTime<Utc>,
    index: u32,
    step: &StepDefinition,
    input: &Value,
) -> Result<DateTime<Utc>, String> {
    if let Some(ms) = step.duration_ms {
        return Ok(super::add_ms(now, ms));
    }
    let pointer = step.until.as_deref().unwrap_or_default();
    let text = input.pointer(pointer).and_then(Value::as_str).ok_or_else(|| {
        format!(
            "step {index} ({}) sleeps until the time at {pointer}, and its input has no string there",
            step.name
        )
    })?;
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            format!(
                "step {index} ({}) sleeps until the time at {pointer}, which is not an RFC 3339 time",
                step.name
            )
        })
}

/// A waiting step's output: its input with `member` under its name (an
/// input that is no object is kept as `"input"`).
fn wait_output(input: Value, step: &StepDefinition, member: Value) -> Value {
    let mut output = match input {
        Value::Object(map) => map,
        Value::Null => Map::new(),
        other => Map::from_iter([("input".to_owned(), other)]),
    };
    output.insert(step.name.clone(), member);
    Value::Object(output)
}

impl Ctx<'_> {
    /// The timer of the step the run waits in: a sleep ends, a wait for a
    /// signal times out. Any other wake (of a wait that ended otherwise, a
    /// duplicate) changes nothing.
    pub(super) fn on_wake(&self, timer: &TimerWakeup) -> Decision {
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
}

/// Whether a signal of `name` that arrives now is kept for a step: an
/// `await_signal` step of the run from step `first` on waits for that name,
/// and fewer signals of it are kept than such steps remain. The rest are
/// recorded without their payload, so what the state keeps is bounded by the
/// definition.
pub(super) fn keeps_signal(
    def: &WorkflowDefinition,
    at: u32,
    first: u32,
    kept: &[crate::coordinator::state::SignalRecord],
    name: &str,
) -> bool {
    let awaiting = def.awaits(name, at, first);
    let already = kept.iter().filter(|r| r.kept && r.name == name).count();
    already < awaiting
}

fn fewer_steps() -> Decision {
    reject(
        RejectionClass::UnknownWorkflow,
        "workflow has fewer steps than the run",
    )
}
