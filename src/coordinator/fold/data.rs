//! Data between steps: what a step gets, where its result goes, and what
//! the run ends with.
//!
//! A step's input is its `input` selection over the run's document, or the
//! output of the step before it (the run's input for the first); its
//! result becomes the newest output and, in a run that keeps a document,
//! goes to its result path; the run's output is its `output` selection, or
//! the last step's output. A selection that finds nothing, or a result
//! path through a value that is no object, fails the run with its cause
//! ([`UNRESOLVED_POINTER`], [`RESULT_PATH_BLOCKED`]); a result that makes
//! the state too large fails it as any other growth does
//! ([`super::STATE_TOO_LARGE`]).
//!
//! In: the state being built and the definition. Out: values, or the run
//! failed. Guarantees: pure; a run without a document (`results` absent)
//! moves data exactly as a straight line did before selections.

use serde_json::{Map, Value};

use super::Builder;
use crate::coordinator::definition::{StepDefinition, WorkflowDefinition};
use crate::coordinator::document;

/// The cause of a run failed because a selection found nothing in its
/// document.
pub const UNRESOLVED_POINTER: &str = "unresolved_pointer";
/// The cause of a run failed because a step's result path goes through a
/// value that is no object.
pub const RESULT_PATH_BLOCKED: &str = "result_path_blocked";

/// The document a run of `def` starts with: empty results when it selects
/// data, none otherwise.
pub(super) fn initial_results(def: &WorkflowDefinition) -> Option<Map<String, Value>> {
    def.uses_document().then(Map::new)
}

impl Builder<'_> {
    /// The input of step `index`.
    pub(super) fn step_input(&self, step: &StepDefinition, index: u32) -> Result<Value, String> {
        if let Some(input) = self.compensation_input(index) {
            return Ok(input);
        }
        let s = &self.state;
        match &step.input {
            Some(pointer) => document::resolve(&s.input, s.results.as_ref(), pointer)
                .ok_or_else(|| {
                    format!(
                        "{UNRESOLVED_POINTER}: step {index} ({}) takes its input from {pointer}, where the run's document holds nothing",
                        step.name
                    )
                }),
            None if index == 0 => Ok(s.input.clone()),
            None => Ok(s.output.clone()),
        }
    }

    /// Step `step` finished with `output`: the newest output, kept at its
    /// result path in a run with a document. A step in a branch keeps it
    /// in its branch only: the branches' results reach the document
    /// together, as their parallel step's result.
    pub(super) fn step_done(&mut self, step: &StepDefinition, output: Value) -> Result<(), String> {
        if let Some(results) = self
            .state
            .results
            .as_mut()
            .filter(|_| self.focus.is_empty())
        {
            document::place(results, &step.result_path(), output.clone()).map_err(|why| {
                format!(
                    "{RESULT_PATH_BLOCKED}: step {:?} cannot place its result: {why}",
                    step.name
                )
            })?;
        }
        self.state.output = output;
        Ok(())
    }

    /// The run's output, once its last step finished: its selection, or
    /// the last step's output as it is.
    pub(super) fn select_output(&mut self, def: &WorkflowDefinition) -> Result<(), String> {
        let Some(pointer) = &def.output else {
            return Ok(());
        };
        let s = &self.state;
        let output = document::resolve(&s.input, s.results.as_ref(), pointer).ok_or_else(|| {
            format!(
                "{UNRESOLVED_POINTER}: the run's output is {pointer}, where its document holds nothing"
            )
        })?;
        self.state.output = output;
        Ok(())
    }

    /// The run fails in step `index` because of its data: `error` starts
    /// with its cause.
    pub(super) fn fail_data(&mut self, index: u32, cause: &'static str, error: String) {
        self.detail("cause", cause.into());
        self.state.outstanding = None;
        self.state.pending_retry = None;
        self.fail_run(index, error);
    }
}
