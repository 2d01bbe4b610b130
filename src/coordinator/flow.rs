//! How a workflow moves from step to step: its steps as a graph.
//!
//! A step goes on to its `next`, or to the step after it; an `end` step,
//! and the last one, end the run; a `choice` goes to the first of its
//! `choices` whose condition holds, else to its `default`; a step that
//! fails for good goes on to its `catch`, if it has one. An edge to a
//! step at or before its source is a back edge, and the source must carry
//! `max_visits`, so that every cycle is bounded.
//!
//! In: a workflow definition whose step names are known to be unique.
//! Out: the edges of each step, and the checks of the whole graph: every
//! name an edge names exists, every step is reachable from the first, every
//! step can reach the end, every back edge is bounded; and the steps that
//! may have finished before a given one (what a pointer there may read).
//! Guarantees: pure; linear in steps and edges.

use std::collections::BTreeSet;

use super::definition::{StepDefinition, StepKind, WorkflowDefinition};

/// Where a step may go once it is done: a step's index, or the run's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Step(usize),
    End,
}

/// The index of the step named `name`.
pub fn index_of(def: &WorkflowDefinition, name: &str) -> Option<usize> {
    def.steps.iter().position(|s| s.name == name)
}

/// The names step `index` goes to, as written: its `next`, or its
/// choices and default. Empty for a step that goes on in order or ends.
pub fn named_targets(step: &StepDefinition) -> Vec<(&'static str, &str)> {
    let mut out: Vec<(&'static str, &str)> = Vec::new();
    if let Some(next) = &step.next {
        out.push(("next", next));
    }
    for rule in &step.choices {
        out.push(("choices", &rule.next));
    }
    if let Some(default) = &step.default {
        out.push(("default", default));
    }
    if let Some(next) = step.catch.as_ref().and_then(|c| c.next.as_ref()) {
        out.push(("catch", next));
    }
    out
}

/// Every target step `index` may go to. Names that no step has are left
/// out (the definition check refuses them first).
pub fn targets(def: &WorkflowDefinition, index: usize) -> Vec<Target> {
    let Some(step) = def.steps.get(index) else {
        return vec![Target::End];
    };
    if step.kind == StepKind::Choice {
        return named_targets(step)
            .into_iter()
            .filter_map(|(_, name)| index_of(def, name).map(Target::Step))
            .collect();
    }
    let caught = step
        .catch
        .as_ref()
        .and_then(|c| c.next.as_ref())
        .and_then(|next| index_of(def, next));
    std::iter::once(after(def, index))
        .chain(caught.map(Target::Step))
        .collect()
}

/// Where step `index`, done, goes: `end`, `next`, or the step after it
/// (the end after the last).
pub fn after(def: &WorkflowDefinition, index: usize) -> Target {
    let step = &def.steps[index.min(def.steps.len().saturating_sub(1))];
    if step.end {
        return Target::End;
    }
    if let Some(next) = &step.next {
        return index_of(def, next).map_or(Target::End, Target::Step);
    }
    if index + 1 < def.steps.len() {
        Target::Step(index + 1)
    } else {
        Target::End
    }
}

/// A step that has an edge back to itself or to a step before it.
pub fn has_back_edge(def: &WorkflowDefinition, index: usize) -> bool {
    targets(def, index)
        .into_iter()
        .any(|t| matches!(t, Target::Step(to) if to <= index))
}

/// Whether any step may run more than once in a run.
pub fn has_loops(def: &WorkflowDefinition) -> bool {
    (0..def.steps.len()).any(|i| has_back_edge(def, i))
}

/// The steps reachable from the first.
pub fn reachable(def: &WorkflowDefinition) -> BTreeSet<usize> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![0];
    while let Some(i) = todo.pop() {
        if i >= def.steps.len() || !seen.insert(i) {
            continue;
        }
        for t in targets(def, i) {
            if let Target::Step(to) = t {
                todo.push(to);
            }
        }
    }
    seen
}

/// The steps from which the run's end can be reached.
pub fn ending(def: &WorkflowDefinition) -> BTreeSet<usize> {
    let mut ends: BTreeSet<usize> = BTreeSet::new();
    loop {
        let before = ends.len();
        for i in 0..def.steps.len() {
            let reaches = targets(def, i).into_iter().any(|t| match t {
                Target::End => true,
                Target::Step(to) => ends.contains(&to),
            });
            if reaches {
                ends.insert(i);
            }
        }
        if ends.len() == before {
            return ends;
        }
    }
}

/// The steps that may have finished before step `index` starts: those
/// from which it can be reached (itself too, when it is in a cycle).
pub fn before(def: &WorkflowDefinition, index: usize) -> BTreeSet<usize> {
    let mut seen = BTreeSet::new();
    let mut todo: Vec<usize> = predecessors(def, index);
    while let Some(i) = todo.pop() {
        if seen.insert(i) {
            todo.extend(predecessors(def, i));
        }
    }
    seen
}

fn predecessors(def: &WorkflowDefinition, index: usize) -> Vec<usize> {
    (0..def.steps.len())
        .filter(|&i| targets(def, i).contains(&Target::Step(index)))
        .collect()
}
