//! Steps that run branches at once: `parallel` steps.
//!
//! Entering a parallel step leaves the run's own cursor on it and starts
//! one [`Lane`] per branch: each lane is a cursor like the run's (its step,
//! attempt, outstanding attempt, pending retry, wait, output), so each
//! branch has its own stamps, timeouts and retries. An input of a branch
//! (a result, a timer) is decided by the same code as one of the run's own
//! steps, with the branch's cursor swapped into the state's own fields
//! (and the cursors of the branches around it, for nested parallel steps);
//! the transition then settles the branch: a branch that ended may end its
//! parallel step, which then moves its own cursor on, in the same
//! transition. A branch's steps run in order, the first with the parallel
//! step's input; the step's result is an object of its branches' results
//! (each its last step's output) by branch name. A branch that fails for
//! good fails the step at once, cancelling the others' outstanding
//! attempts (`fail_fast`), or once every branch ended (`all_settled`); the
//! step's failure is its cursor's, and fails the run (cause
//! [`BRANCH_FAILED`]) or, nested, the branch around it. A transition
//! introduces one stamp per attempt or wait it starts, the first the
//! entropy's, the others derived from it ([`Builder::stamp`]).
//!
//! In: a parallel step to enter; an input that names a branch's attempt
//! or wait. Out: the run moved on. Guarantees: pure; a branch's input
//! changes only its branch, and the step around it when it ends; a
//! workflow without parallel steps keeps no lanes.

use serde_json::{Map, Value, json};
use uuid::Uuid;

use super::waits::Entered;
use super::{Builder, Ctx, Decision, RejectionClass, reject, step};
use crate::contract::input::truncate;
use crate::contract::{TimerKind, TimerWakeup, TransitionKind};
use crate::coordinator::definition::{OnFailure, WorkflowDefinition};
use crate::coordinator::state::{AttemptStatus, Lane, LaneStatus, RunState, RunStatus};

/// The cause of a run failed because a branch of a parallel step failed.
pub const BRANCH_FAILED: &str = "branch_failed";

/// What entering a parallel step, or ending one of its branches, did.
pub(super) enum Branches {
    /// Some branch still runs; the first stamp the transition introduced.
    Running(Uuid),
    /// Every branch succeeded: the step's result.
    Succeeded(Value),
    /// A branch failed, and the step with it: its cursor is failed.
    Failed,
}

impl Lane {
    /// Whether `timer` is this lane's: its attempt's timeout, its retry,
    /// or the end of its wait.
    pub(super) fn names(&self, timer: &TimerWakeup) -> bool {
        let stamp = timer.stamp;
        match timer.timer {
            TimerKind::Timeout => self.outstanding.as_ref().is_some_and(|o| o.stamp == stamp),
            TimerKind::Retry => self
                .pending_retry
                .as_ref()
                .is_some_and(|p| p.after_stamp == stamp),
            TimerKind::Wake => self.waiting.as_ref().is_some_and(|w| w.stamp == stamp),
        }
    }
}

fn lane_status(status: RunStatus) -> LaneStatus {
    match status {
        RunStatus::Running => LaneStatus::Running,
        RunStatus::Succeeded => LaneStatus::Succeeded,
        RunStatus::Failed => LaneStatus::Failed,
        RunStatus::Cancelled => LaneStatus::Cancelled,
    }
}

fn run_status(status: LaneStatus) -> RunStatus {
    match status {
        LaneStatus::Running => RunStatus::Running,
        LaneStatus::Succeeded => RunStatus::Succeeded,
        LaneStatus::Failed => RunStatus::Failed,
        LaneStatus::Cancelled => RunStatus::Cancelled,
    }
}

/// Swaps lane `i`'s cursor with the state's own fields: done once, the
/// lane is the state's cursor; done again, everything is back.
fn swap(state: &mut RunState, i: usize) {
    let Some(lane) = state.lanes.get_mut(i) else {
        return;
    };
    std::mem::swap(&mut state.step_index, &mut lane.step_index);
    std::mem::swap(&mut state.attempt, &mut lane.attempt);
    std::mem::swap(&mut state.output, &mut lane.output);
    std::mem::swap(&mut state.outstanding, &mut lane.outstanding);
    std::mem::swap(&mut state.pending_retry, &mut lane.pending_retry);
    std::mem::swap(&mut state.waiting, &mut lane.waiting);
    std::mem::swap(&mut state.error, &mut lane.error);
    let status = lane.status;
    lane.status = lane_status(state.status);
    state.status = run_status(status);
}

/// Whether step `index` is in a branch of the parallel step `parallel`,
/// at any depth.
fn within(def: &WorkflowDefinition, mut index: u32, parallel: u32) -> bool {
    while let Some(outer) = def.place(index).and_then(|p| p.parallel) {
        if outer == parallel {
            return true;
        }
        index = outer;
    }
    false
}

/// The lanes of the parallel step `parallel` and of those nested in it.
fn lanes_under(state: &RunState, def: &WorkflowDefinition, parallel: u32) -> Vec<usize> {
    (0..state.lanes.len())
        .filter(|&i| {
            let p = state.lanes[i].parallel;
            p == parallel || within(def, p, parallel)
        })
        .collect()
}

impl Builder<'_> {
    fn focus(&mut self, lane: usize) {
        swap(&mut self.state, lane);
        self.focus.push(lane);
    }

    fn unfocus(&mut self) -> Option<usize> {
        let lane = self.focus.pop()?;
        swap(&mut self.state, lane);
        Some(lane)
    }

    /// Whether `index` is the end of the branch in focus.
    pub(super) fn at_end_of_branch(&self, index: u32) -> bool {
        !self.focus.is_empty() && index == super::choice::END_OF_BRANCH
    }

    /// The name of the branch in focus, for its dispatches.
    pub(super) fn branch_name(&self, def: &WorkflowDefinition) -> Option<String> {
        let lane = self.state.lanes.get(*self.focus.last()?)?;
        let parallel = step(def, lane.parallel)?;
        let branch = parallel.branches.get(lane.branch as usize)?;
        Some(branch.name.clone())
    }

    /// Enters parallel step `index` with `input`: a lane per branch, each
    /// entering its first step. The cursor stays on the step.
    pub(super) fn enter_parallel(
        &mut self,
        def: &WorkflowDefinition,
        index: u32,
        input: Value,
    ) -> Result<Branches, Decision> {
        let parallel = step(def, index).ok_or_else(fewer_steps)?;
        let s = &mut self.state;
        s.step_index = index;
        s.attempt = 1;
        s.outstanding = None;
        s.pending_retry = None;
        s.waiting = None;
        // What an earlier start of the step left (a loop, a retry of the run).
        let old = lanes_under(&self.state, def, index);
        self.drop_lanes(&old);
        for branch in 0..parallel.branches.len() {
            let branch = u32::try_from(branch).unwrap_or(u32::MAX);
            let first = def.branch_first(index, branch).ok_or_else(fewer_steps)?;
            self.state.lanes.push(Lane {
                parallel: index,
                branch,
                status: LaneStatus::Running,
                step_index: first,
                attempt: 1,
                output: input.clone(),
                outstanding: None,
                pending_retry: None,
                waiting: None,
                error: None,
            });
            self.focus(self.state.lanes.len() - 1);
            let entered = self.enter(def, first);
            self.unfocus();
            if matches!(entered?, Entered::Failed) && parallel.on_failure == OnFailure::FailFast {
                break;
            }
        }
        self.branches_of(def, index)
    }

    /// Where the branches of parallel step `index` stand, its cursor in
    /// the state's own fields: running, or the step ended (its lanes gone).
    fn branches_of(&mut self, def: &WorkflowDefinition, index: u32) -> Result<Branches, Decision> {
        let parallel = step(def, index).ok_or_else(fewer_steps)?;
        let mine: Vec<usize> = (0..self.state.lanes.len())
            .filter(|&i| self.state.lanes[i].parallel == index)
            .collect();
        let lanes = &self.state.lanes;
        let failed = mine
            .iter()
            .copied()
            .find(|&i| lanes[i].status == LaneStatus::Failed);
        let settled = mine.iter().all(|&i| lanes[i].status != LaneStatus::Running);
        if let Some(failed) = failed
            && (settled || parallel.on_failure == OnFailure::FailFast)
        {
            let lane = &lanes[failed];
            let name = parallel
                .branches
                .get(lane.branch as usize)
                .map_or("", |b| b.name.as_str());
            let error = format!(
                "{BRANCH_FAILED}: branch {name:?} of step {index} ({}) failed: {}",
                parallel.name,
                lane.error.as_deref().unwrap_or_default()
            );
            self.detail("failed_branch", name.into());
            let under = lanes_under(&self.state, def, index);
            self.cancel_lanes(&under, &error);
            self.drop_lanes(&under);
            if let Some(cause) = self.detail.remove("cause") {
                self.detail("branch_cause", cause);
            }
            self.detail("cause", BRANCH_FAILED.into());
            self.fail_run(index, error);
            return Ok(Branches::Failed);
        }
        if !settled {
            return Ok(Branches::Running(self.entropy.stamp));
        }
        let mut output = Map::new();
        for &i in &mine {
            let lane = &self.state.lanes[i];
            if let Some(branch) = parallel.branches.get(lane.branch as usize) {
                output.insert(branch.name.clone(), lane.output.clone());
            }
        }
        let under = lanes_under(&self.state, def, index);
        self.drop_lanes(&under);
        Ok(Branches::Succeeded(Value::Object(output)))
    }

    /// Ends the running ones among `lanes`: each outstanding attempt is
    /// cancelled (its late result changes nothing), a retry or a wait
    /// dropped. Their stamps are in `detail.cancelled_stamps`.
    pub(super) fn cancel_lanes(&mut self, lanes: &[usize], why: &str) {
        for &i in lanes {
            let Some(lane) = self.state.lanes.get_mut(i) else {
                continue;
            };
            if lane.status != LaneStatus::Running {
                continue;
            }
            lane.status = LaneStatus::Cancelled;
            lane.pending_retry = None;
            lane.waiting = None;
            let Some(outstanding) = lane.outstanding.take() else {
                continue;
            };
            let error = truncate(why.to_owned(), super::MAX_DETAIL_ERROR_LEN);
            self.close_attempt(outstanding.stamp, AttemptStatus::Cancelled, Some(error));
            let stamp = Value::from(outstanding.stamp.to_string());
            match self.detail.get_mut("cancelled_stamps") {
                Some(Value::Array(stamps)) => stamps.push(stamp),
                _ => self.detail("cancelled_stamps", json!([stamp])),
            }
        }
    }

    /// Every branch of the run ends with it (a cancel, a failure from
    /// outside its steps).
    pub(super) fn cancel_all_lanes(&mut self, why: &str) {
        let all: Vec<usize> = (0..self.state.lanes.len()).collect();
        self.cancel_lanes(&all, why);
        self.state.lanes.clear();
    }

    fn drop_lanes(&mut self, lanes: &[usize]) {
        let mut i = 0;
        self.state.lanes.retain(|_| {
            let keep = !lanes.contains(&i);
            i += 1;
            keep
        });
    }

    /// Settles the branches in focus, innermost first, once the input's
    /// handler is done: a branch still running leaves `kind` as it is; one
    /// that ended may end its parallel step, whose cursor then moves on.
    pub(super) fn settle(&mut self, mut kind: TransitionKind) -> Result<TransitionKind, Decision> {
        while let Some(lane) = self.unfocus() {
            let def = self.def.ok_or_else(fewer_steps)?;
            let Some(ended) = self.state.lanes.get(lane) else {
                return Err(fewer_steps());
            };
            if ended.status == LaneStatus::Running {
                continue;
            }
            let failed = ended.status == LaneStatus::Failed;
            let index = ended.parallel;
            kind = match self.branches_of(def, index)? {
                Branches::Running(_) if failed => TransitionKind::BranchFailed,
                Branches::Running(_) => TransitionKind::StepSucceeded,
                Branches::Failed => TransitionKind::RunFailed,
                Branches::Succeeded(output) => self.parallel_done(def, index, output)?,
            };
        }
        Ok(kind)
    }

    /// Parallel step `index` succeeded with `output`: its cursor moves on.
    fn parallel_done(
        &mut self,
        def: &WorkflowDefinition,
        index: u32,
        output: Value,
    ) -> Result<TransitionKind, Decision> {
        let parallel = step(def, index).ok_or_else(fewer_steps)?;
        if let Err(error) = self.step_done(parallel, output.clone()) {
            self.fail_data(index, super::RESULT_PATH_BLOCKED, error);
            return Ok(TransitionKind::RunFailed);
        }
        self.pass(json!({ "step_index": index, "output": output }));
        self.after_step(def, super::choice::after(def, index))
    }
}

impl<'a> Ctx<'a> {
    /// The lanes, outermost first, whose cursors must be in the state's
    /// own fields for an input of the running lane that `pick` names.
    pub(super) fn lane_of(&self, pick: impl Fn(&Lane) -> bool) -> Option<Vec<usize>> {
        let s = self.state;
        if !self.focus.is_empty() || s.status.is_terminal() || s.lanes.is_empty() {
            return None;
        }
        let def = self.definition().ok()?;
        let running = |l: &Lane| l.status == LaneStatus::Running;
        let mut current = s.lanes.iter().position(|l| running(l) && pick(l))?;
        let mut chain = vec![current];
        while let Some(place) = def.place(s.lanes[current].parallel)
            && let Some(outer) = place.parallel
        {
            current = s
                .lanes
                .iter()
                .position(|l| running(l) && l.parallel == outer && l.branch == place.branch)?;
            chain.push(current);
        }
        chain.reverse();
        Some(chain)
    }

    /// Decides `handle` with the cursors of `chain` in the state's own
    /// fields; the transition settles them.
    pub(super) fn in_lane(
        &self,
        chain: Vec<usize>,
        handle: impl FnOnce(&Ctx<'_>) -> Decision,
    ) -> Decision {
        let mut focused = self.state.clone();
        for &i in &chain {
            swap(&mut focused, i);
        }
        let ctx = Ctx {
            state: &focused,
            input: self.input,
            workflows: self.workflows,
            now: self.now,
            entropy: self.entropy,
            focus: chain,
        };
        handle(&ctx)
    }
}

fn fewer_steps() -> Decision {
    reject(
        RejectionClass::UnknownWorkflow,
        "workflow has fewer steps than the run",
    )
}
