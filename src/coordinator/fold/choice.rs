//! Steps that choose, and steps that run again: `choice` steps, `next` and
//! `end`, and the visits that bound a loop.
//!
//! A choice takes no time: entering it picks the first rule whose
//! condition holds over the run's document (else the default) and enters
//! that step in the same transition, as a sleep already over does; its
//! `detail.passed_steps` entry names the step it chose. In a workflow that
//! loops, each start of a step counts a visit; a step started more often
//! than its `max_visits` fails the run with cause [`LOOP_BOUND`] instead.
//!
//! In: the step being entered, the definition, the run's document. Out:
//! the step to enter next, or the run failed. Guarantees: pure; a
//! workflow without loops counts nothing, so its state stays as it was.

use serde_json::json;

use super::Builder;
use crate::coordinator::definition::{StepDefinition, WorkflowDefinition};
use crate::coordinator::flow::{self, Target};
use crate::coordinator::state::Visits;

/// The cause of a run failed because a step started more often than its
/// `max_visits`.
pub const LOOP_BOUND: &str = "loop_bound";

/// The index `enter` takes for a target: a step's, or one past the last
/// for the end of the run.
pub(super) fn index_of(def: &WorkflowDefinition, target: Target) -> u32 {
    let index = match target {
        Target::Step(i) => i,
        Target::End => def.steps.len(),
    };
    u32::try_from(index).unwrap_or(u32::MAX)
}

/// The index `enter` takes for the end of a branch's steps.
pub(super) const END_OF_BRANCH: u32 = u32::MAX;

/// The step after `index`, done: its `end`, its `next`, or the one after
/// it; in a branch, the one after it or the branch's end.
pub(super) fn after(def: &WorkflowDefinition, index: u32) -> u32 {
    match def.place(index) {
        Some(place) if place.parallel.is_some() => {
            let next = index.saturating_add(1);
            if next < place.first.saturating_add(place.len) {
                next
            } else {
                END_OF_BRANCH
            }
        }
        _ => index_of(def, flow::after(def, index as usize)),
    }
}

impl Builder<'_> {
    /// Counts a start of step `index` in a workflow that loops; the error
    /// when it starts once more than its `max_visits`.
    pub(super) fn visit(
        &mut self,
        def: &WorkflowDefinition,
        index: u32,
        step: &StepDefinition,
    ) -> Result<(), String> {
        if !flow::has_loops(def) {
            return Ok(());
        }
        let first_attempt = self.first_attempt(index);
        let visits = self.state.visits.entry(index).or_insert(Visits {
            count: 0,
            first_attempt,
        });
        visits.count = visits.count.saturating_add(1);
        visits.first_attempt = first_attempt;
        let count = visits.count;
        match step.max_visits {
            Some(max) if count > max => Err(format!(
                "{LOOP_BOUND}: step {index} ({}) would start a {}th time, over its max_visits of {max}",
                step.name, count
            )),
            _ => Ok(()),
        }
    }

    /// The number the next first attempt of step `index` takes: one past
    /// every attempt it had, so that each number names one attempt.
    pub(super) fn first_attempt(&self, index: u32) -> u32 {
        self.state
            .attempts
            .iter()
            .filter(|a| a.step_index == index)
            .map(|a| a.attempt)
            .max()
            .unwrap_or(0)
            .saturating_add(1)
    }

    /// The step a choice goes to, recorded among the steps passed.
    pub(super) fn choose(
        &mut self,
        def: &WorkflowDefinition,
        index: u32,
        step: &StepDefinition,
    ) -> u32 {
        let s = &self.state;
        let chosen = step
            .choices
            .iter()
            .find(|rule| rule.when.holds(&s.input, s.results.as_ref()))
            .map(|rule| rule.next.as_str())
            .or(step.default.as_deref())
            .unwrap_or_default();
        self.state.step_index = index;
        let passed = json!({ "step_index": index, "chose": chosen });
        self.pass(passed);
        // In a branch, a later step of its own branch.
        if def.place(index).is_some_and(|p| p.parallel.is_some()) {
            return def.sibling(index, chosen).unwrap_or(END_OF_BRANCH);
        }
        let target = flow::index_of(def, chosen).map_or(Target::End, Target::Step);
        index_of(def, target)
    }
}
