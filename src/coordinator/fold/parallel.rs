//! Steps that run branches at once: `parallel` steps, and `map` steps,
//! whose items run as branches do.
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
//! [`BRANCH_FAILED`]) or, nested, the branch around it. A map starts a
//! lane per item of its input, at most its `max_concurrency` at once, the
//! next as one ends; its result is the items' results in item order, and
//! a failed item fails it as a branch does (cause [`ITEM_FAILED`]). Each
//! lane names the lane it runs in (`owner`), since a map's items run the
//! steps inside it at once. A transition
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
use crate::coordinator::definition::{OnFailure, StepDefinition, StepKind, WorkflowDefinition};
use crate::coordinator::state::{AttemptStatus, Lane, LaneStatus, RunState, RunStatus};

/// The cause of a run failed because a branch of a parallel step failed.
pub const BRANCH_FAILED: &str = "branch_failed";
/// The cause of a run failed because an item of a map failed.
pub const ITEM_FAILED: &str = "item_failed";
/// The cause of a run failed because a map's input is no array.
pub const NOT_AN_ARRAY: &str = "not_an_array";
/// The cause of a run failed because a map's input has more items than
/// its `max_items`.
pub const TOO_MANY_ITEMS: &str = "too_many_items";

/// The items of map step `index` with `input`, or the cause and error
/// that fail it.
fn items_of(
    index: u32,
    step: &StepDefinition,
    input: &Value,
) -> Result<usize, (&'static str, String)> {
    let Value::Array(items) = input else {
        return Err((
            NOT_AN_ARRAY,
            format!(
                "{NOT_AN_ARRAY}: step {index} ({}) maps over its input, which is no array",
                step.name
            ),
        ));
    };
    let limit = step.item_limit();
    if items.len() > limit as usize {
        return Err((
            TOO_MANY_ITEMS,
            format!(
                "{TOO_MANY_ITEMS}: step {index} ({}) maps over {} items, over its max_items of {limit}",
                step.name,
                items.len()
            ),
        ));
    }
    Ok(items.len())
}

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

/// The lanes of step `parallel` run by the cursor `owner` (a lane's id,
/// `None` for the run's own), and every lane inside them.
fn lanes_under(state: &RunState, owner: Option<u32>, parallel: u32) -> Vec<usize> {
    let lanes = &state.lanes;
    let mut ids: Vec<u32> = lanes
        .iter()
        .filter(|l| l.owner == owner && l.parallel == parallel)
        .map(|l| l.id)
        .collect();
    let mut i = 0;
    while i < ids.len() {
        let id = ids[i];
        ids.extend(lanes.iter().filter(|l| l.owner == Some(id)).map(|l| l.id));
        i += 1;
    }
    (0..lanes.len())
        .filter(|&i| ids.contains(&lanes[i].id))
        .collect()
}

impl Builder<'_> {
    /// The id of the lane in focus: the owner of the lanes it starts.
    fn owner(&self) -> Option<u32> {
        let &i = self.focus.last()?;
        self.state.lanes.get(i).map(|l| l.id)
    }

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

    /// What the dispatches of the lane in focus name: the innermost branch
    /// of a parallel step around it, and the items of the maps around it,
    /// outermost first.
    pub(super) fn lane_labels(&self, def: &WorkflowDefinition) -> (Option<String>, Vec<u32>) {
        let lanes = self.focus.iter().filter_map(|&i| self.state.lanes.get(i));
        let items: Vec<u32> = lanes.clone().filter_map(|l| l.item).collect();
        let branch = lanes
            .filter(|l| l.item.is_none())
            .filter_map(|l| step(def, l.parallel)?.branches.get(l.branch as usize))
            .map(|b| b.name.clone())
            .next_back();
        (branch, items)
    }

    /// Counts an attempt of the task step of the lane in focus: its first,
    /// or one more.
    /// A compensation the run's own cursor runs counts its own too.
    pub(super) fn count_try(&mut self, first: bool) {
        let tries = match self.focus.last() {
            Some(&i) => self.state.lanes.get_mut(i).map(|l| &mut l.tries),
            None => self.state.compensating.as_mut().map(|c| &mut c.tries),
        };
        if let Some(tries) = tries {
            *tries = if first { 1 } else { tries.saturating_add(1) };
        }
    }

    /// The attempts the lane in focus, or the compensation the run runs,
    /// made of its current step, if one is.
    pub(super) fn tries(&self) -> Option<u32> {
        let tries = match self.focus.last() {
            Some(&i) => self.state.lanes.get(i)?.tries,
            None => self.state.compensating.as_ref()?.tries,
        };
        (tries > 0).then_some(tries)
    }

    /// Enters parallel step `index` with `input`: a lane per branch, each
    /// entering its first step. The cursor stays on the step.
    pub(super) fn enter_parallel(
        &mut self,
        def: &WorkflowDefinition,
        index: u32,
        input: Value,
    ) -> Result<Branches, Decision> {
        let step = step(def, index).ok_or_else(fewer_steps)?;
        let s = &mut self.state;
        s.step_index = index;
        s.attempt = 1;
        s.outstanding = None;
        s.pending_retry = None;
        s.waiting = None;
        // What an earlier start of the step left (a loop, a retry of the run).
        let old = lanes_under(&self.state, self.owner(), index);
        self.drop_lanes(&old);
        if step.kind == StepKind::Map {
            if let Err((cause, error)) = items_of(index, step, &input) {
                self.detail("cause", cause.into());
                self.fail_run(index, error);
                return Ok(Branches::Failed);
            }
            return self.branches_of(def, index);
        }
        for branch in 0..step.branches.len() {
            let branch = u32::try_from(branch).unwrap_or(u32::MAX);
            let failed = self.start_lane(def, index, branch, None, input.clone())?;
            if failed && step.on_failure == OnFailure::FailFast {
                break;
            }
        }
        self.branches_of(def, index)
    }

    /// Starts a lane of step `index` (branch `branch`, or item `item` of a
    /// map) with `input`, entering its first step; whether it failed there.
    fn start_lane(
        &mut self,
        def: &WorkflowDefinition,
        index: u32,
        branch: u32,
        item: Option<u32>,
        input: Value,
    ) -> Result<bool, Decision> {
        let first = def.branch_first(index, branch).ok_or_else(fewer_steps)?;
        let id = self
            .state
            .lanes
            .iter()
            .map(|l| l.id.saturating_add(1))
            .max()
            .unwrap_or(0);
        let owner = self.owner();
        self.state.lanes.push(Lane {
            id,
            owner,
            parallel: index,
            branch,
            item,
            tries: 0,
            status: LaneStatus::Running,
            step_index: first,
            attempt: 1,
            output: input,
            outstanding: None,
            pending_retry: None,
            waiting: None,
            error: None,
        });
        self.focus(self.state.lanes.len() - 1);
        let entered = self.enter(def, first);
        self.unfocus();
        Ok(matches!(entered?, Entered::Failed))
    }

    /// Where the lanes of step `index` stand, its cursor in the state's own
    /// fields: a map starts its next items while fewer than its
    /// `max_concurrency` run; then the step runs, or it ended (its lanes
    /// gone).
    fn branches_of(&mut self, def: &WorkflowDefinition, index: u32) -> Result<Branches, Decision> {
        let step = step(def, index).ok_or_else(fewer_steps)?;
        let items = match step.kind {
            // Nothing writes the document while a map runs: its input is
            // the one it started with.
            StepKind::Map => match self.step_input(step, index) {
                Ok(Value::Array(items)) => items,
                _ => return Err(fewer_steps()),
            },
            _ => Vec::new(),
        };
        let total = match step.kind {
            StepKind::Map => items.len(),
            _ => step.branches.len(),
        };
        let owner = self.owner();
        loop {
            let mine: Vec<usize> = (0..self.state.lanes.len())
                .filter(|&i| {
                    let lane = &self.state.lanes[i];
                    lane.parallel == index && lane.owner == owner
                })
                .collect();
            let lanes = &self.state.lanes;
            let running = mine
                .iter()
                .filter(|&&i| lanes[i].status == LaneStatus::Running)
                .count();
            let failed = mine
                .iter()
                .copied()
                .find(|&i| lanes[i].status == LaneStatus::Failed);
            let settled = running == 0 && mine.len() == total;
            if let Some(failed) = failed
                && (settled || step.on_failure == OnFailure::FailFast)
            {
                self.fail_step(def, index, failed);
                return Ok(Branches::Failed);
            }
            if mine.len() < total && running < step.concurrency() as usize {
                let item = u32::try_from(mine.len()).unwrap_or(u32::MAX);
                let input = items.get(mine.len()).cloned().unwrap_or(Value::Null);
                self.start_lane(def, index, 0, Some(item), input)?;
                continue;
            }
            if !settled {
                return Ok(Branches::Running(self.entropy.stamp));
            }
            let output = match step.kind {
                StepKind::Map => {
                    let mut done: Vec<(u32, Value)> = mine
                        .iter()
                        .map(|&i| (lanes[i].item.unwrap_or(0), lanes[i].output.clone()))
                        .collect();
                    done.sort_by_key(|(item, _)| *item);
                    Value::Array(done.into_iter().map(|(_, output)| output).collect())
                }
                _ => {
                    let mut output = Map::new();
                    for &i in &mine {
                        if let Some(branch) = step.branches.get(lanes[i].branch as usize) {
                            output.insert(branch.name.clone(), lanes[i].output.clone());
                        }
                    }
                    Value::Object(output)
                }
            };
            let under = lanes_under(&self.state, owner, index);
            self.drop_lanes(&under);
            return Ok(Branches::Succeeded(output));
        }
    }

    /// Step `index` fails because its lane `failed` did: the others are
    /// cancelled, and its cursor fails with the cause of its kind.
    fn fail_step(&mut self, def: &WorkflowDefinition, index: u32, failed: usize) {
        let Some(step) = step(def, index) else {
            return;
        };
        let lane = &self.state.lanes[failed];
        let why = lane.error.clone().unwrap_or_default();
        let (item, branch) = (lane.item, lane.branch);
        let (cause, error) = match item {
            Some(item) => {
                self.detail("failed_item", item.into());
                let error = format!(
                    "{ITEM_FAILED}: item {item} of step {index} ({}) failed: {why}",
                    step.name
                );
                (ITEM_FAILED, error)
            }
            None => {
                let name = step
                    .branches
                    .get(branch as usize)
                    .map_or("", |b| b.name.as_str());
                let error = format!(
                    "{BRANCH_FAILED}: branch {name:?} of step {index} ({}) failed: {why}",
                    step.name
                );
                self.detail("failed_branch", name.into());
                (BRANCH_FAILED, error)
            }
        };
        let under = lanes_under(&self.state, self.owner(), index);
        self.cancel_lanes(&under, &error);
        self.drop_lanes(&under);
        if let Some(cause) = self.detail.remove("cause") {
            self.detail("branch_cause", cause);
        }
        self.detail("cause", cause.into());
        self.fail_run(index, error);
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
            let progress = self.branches_of(def, index)?;
            if matches!(progress, Branches::Running(_)) && self.stamps > 0 {
                // A map's next item started.
                self.detail("next_stamp", self.entropy.stamp.to_string().into());
            }
            kind = match progress {
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
        let running = |l: &Lane| l.status == LaneStatus::Running;
        let mut current = s.lanes.iter().position(|l| running(l) && pick(l))?;
        let mut chain = vec![current];
        while let Some(owner) = s.lanes[current].owner {
            current = s.lanes.iter().position(|l| running(l) && l.id == owner)?;
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
