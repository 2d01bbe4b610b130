//! Workflow definitions: the typed, validated form of `config/workflows/*.toml`.
//!
//! Everything here is pure: parsing files is the job of `crate::infra::workflows`.
//!
//! In: [`WorkflowDefinition`]s as deserialized, one per file. Out: the
//! [`Workflows`] by name and version, or the first [`DefinitionError`],
//! naming its field. Guarantees: every definition a [`Workflows`] holds
//! passed [`WorkflowDefinition::validate`] (names, 1 to [`MAX_STEPS`]
//! steps, no field of another kind of step, every timeout, sleep and retry
//! policy within its bound) and no `(name, version)` is held twice;
//! [`RetryPolicy::backoff_ms`] is total and never above `max_backoff_ms`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::condition::Condition;
use super::document::{self, MAX_POINTER_LEN};
use super::flow;
use crate::contract::names::{MAX_NAME_LEN, is_name, is_topic};

/// Most steps one workflow may declare.
pub const MAX_STEPS: usize = 64;
/// Longest step timeout, and longest wait for a signal (one day).
pub const MAX_TIMEOUT_MS: u64 = 86_400_000;
/// Longest `duration_ms` of a sleep step (a year).
pub const MAX_SLEEP_MS: u64 = 366 * 86_400_000;
/// Most attempts one step may be given.
pub const MAX_ATTEMPTS_LIMIT: u32 = 100;
/// Longest retry backoff (one day).
pub const MAX_BACKOFF_LIMIT_MS: u64 = 86_400_000;
/// Most choices one `choice` step may list.
pub const MAX_CHOICES: usize = 32;
/// Largest `max_visits` of a step.
pub const MAX_VISITS_LIMIT: u32 = 1_000;
/// Most branches one `parallel` step may have.
pub const MAX_BRANCHES: usize = 16;
/// Most steps one workflow may declare in all, its branches' steps
/// included.
pub const MAX_STEPS_IN_ALL: usize = 256;
/// How deep `parallel` and `map` steps may nest: a step in a branch of a
/// parallel step in a branch is at depth 2.
pub const MAX_DEPTH: u32 = 3;
/// Largest `max_items` of a `map` step.
pub const MAX_ITEMS_LIMIT: u32 = 1_000;
/// The `max_items` of a `map` step that names none.
pub const DEFAULT_MAX_ITEMS: u32 = 100;
/// Largest `max_concurrency` of a `map` step.
pub const MAX_CONCURRENCY_LIMIT: u32 = 64;
/// The `max_concurrency` of a `map` step that names none.
pub const DEFAULT_MAX_CONCURRENCY: u32 = 8;

/// One versioned workflow: an ordered list of steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowDefinition {
    /// Workflow name, `[A-Za-z0-9_.-]{1,100}`; start requests refer to it.
    pub name: String,
    /// Version, >= 1; a start request without a version gets the latest.
    pub version: u32,
    /// Steps, run in order; the output of one is the input of the next.
    pub steps: Vec<StepDefinition>,
    /// Topic that receives the run's final output, if any.
    #[serde(default)]
    pub output_topic: Option<String>,
    /// The run's output: a JSON pointer over the run's document. Without
    /// it, the last step's output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

/// One step of a workflow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDefinition {
    /// Step name, unique within the workflow.
    pub name: String,
    /// What the step does: a worker's task (the default), or a wait.
    #[serde(default)]
    pub kind: StepKind,
    /// Worker pool of a task; attempts are published to
    /// `ductor.steps.<pool>`. Waits have none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
    /// A task: how long one attempt may take before it is abandoned (timed
    /// out). An `await_signal`: how long the step waits for its signal.
    #[serde(default)]
    pub timeout_ms: u64,
    /// Retry policy for failed and timed-out attempts of a task.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// An `await_signal`: the `name` of the signal it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// An `await_signal`: what its timeout does.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// A `sleep` for this long from when the step starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// A `sleep` until the time (RFC 3339) at this JSON pointer in the
    /// step's input (`/ship_at`); a time already past ends it at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    /// The step's input: a JSON pointer over the run's document
    /// (`/input/order`, `/steps/charge`). Without it, the output of the
    /// step before (the run's input for the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// Where the step's result goes in the run's document: a JSON pointer
    /// outside `/input`. Without it, `/steps/<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The step the run goes on to once this one is done. Without it, the
    /// step after it (the run ends after the last).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// The run succeeds once this step is done.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub end: bool,
    /// How many times the step may start in one run: needed by a step
    /// that goes back (its `next` or a choice names itself or a step
    /// before it). One more fails the run with cause `loop_bound`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_visits: Option<u32>,
    /// A `choice`: its rules, tried in order; the first whose condition
    /// holds names the next step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub choices: Vec<ChoiceRule>,
    /// A `choice`: the next step when no rule holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// A `parallel`: its branches, which run at once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub branches: Vec<Branch>,
    /// A `parallel` or a `map`: what a branch or an item that fails for
    /// good does.
    #[serde(default)]
    pub on_failure: OnFailure,
    /// A `map`: the steps run for each item of its input, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<StepDefinition>,
    /// A `map`: how many items run at once (default
    /// [`DEFAULT_MAX_CONCURRENCY`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// A `map`: the most items its input may have (default
    /// [`DEFAULT_MAX_ITEMS`]); more fail the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_items: Option<u32>,
    /// What happens when the step fails for good: the run goes on at
    /// another step, with the error in its document, or undoes the steps
    /// that succeeded and fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch: Option<Catch>,
    /// A task: the task that undoes it, run with its output as the input
    /// when a later failure's catch compensates the run. A task of its own
    /// (name, pool, timeout, retries) and nothing more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<Box<StepDefinition>>,
    /// A `child`: the workflow its run runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<String>,
    /// A `child`: that workflow's version; without it, the latest when the
    /// child starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
}

/// What a run does when a step fails for good: it goes on at another
/// step (`next`), or it compensates (`compensate = true`): the
/// compensations of the steps that succeeded run, newest first, and the
/// run fails with cause `compensated`. Exactly one of the two.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catch {
    /// The step the run goes on at; it gets the error as its input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// Where the error goes in the run's document: a JSON pointer outside
    /// `/input`. Without it, `/errors/<step>`. Only with `next`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Undo the steps that succeeded, then fail.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compensate: bool,
}

/// One branch of a `parallel` step: a sequence of steps, run in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Branch {
    /// Its name, unique within the step: its result's key in the step's
    /// result, and the `branch` of its attempts' dispatches.
    pub name: String,
    /// Its steps, of any kind, each taking the output of the one before
    /// (the first takes the parallel step's input); a choice among them
    /// skips ahead in the branch.
    pub steps: Vec<StepDefinition>,
}

/// What a branch of a `parallel` step that fails for good does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// The step fails at once, and the other branches' attempts are
    /// cancelled.
    #[default]
    FailFast,
    /// The step fails once every branch has ended.
    AllSettled,
}

/// One rule of a `choice` step: where to go when its condition holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChoiceRule {
    /// The step to go to.
    pub next: String,
    /// The condition, over the run's document.
    pub when: Condition,
}

/// The kinds of step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// A worker of `pool` runs it, with attempts, a timeout and retries.
    #[default]
    Task,
    /// The run waits for a `wakeup.signal` of the step's `signal` name (one
    /// that came before the step started counts), at most `timeout_ms`.
    AwaitSignal,
    /// The run waits for `duration_ms`, or until the time named by `until`.
    Sleep,
    /// The run goes on at the step its first holding rule names, or at its
    /// default; at once, with nothing dispatched.
    Choice,
    /// Its branches run at once; it ends when each has ended, with an
    /// object of their results by branch name.
    Parallel,
    /// Its steps run for each item of its input (an array), some items at
    /// once; it ends with their results in item order.
    Map,
    /// It starts a run of another workflow with its input, through the
    /// routing plane, and ends with that run's outcome: its output, or its
    /// failure. Each attempt is one child run.
    Child,
}

/// What the timeout of an `await_signal` step does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// The run fails.
    #[default]
    Fail,
    /// The step succeeds without a signal, and the run goes on.
    Continue,
}

/// Retry policy of one step: bounded attempts, exponential backoff with jitter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    /// Attempts in total, including the first (1 = never retry).
    pub max_attempts: u32,
    /// Backoff after the first failed attempt.
    pub initial_backoff_ms: u64,
    /// Upper bound of any backoff.
    pub max_backoff_ms: u64,
    /// Growth factor of the backoff per failed attempt, >= 1.0.
    pub multiplier: f64,
    /// Fraction in [0, 1] by which a backoff may be shortened at random.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff_ms: 200,
            max_backoff_ms: 10_000,
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Backoff before the attempt after `failed_attempt` (1-based).
    ///
    /// `base = min(max, initial * multiplier^(failed_attempt - 1))`, then shortened by
    /// `jitter * jitter_unit` (`jitter_unit` in `[0, 1)`, supplied by the caller). The
    /// result never exceeds `max_backoff_ms` and is never below `base * (1 - jitter)`.
    /// Total: out-of-range or NaN arguments are clamped, never panic.
    pub fn backoff_ms(&self, failed_attempt: u32, jitter_unit: f64) -> u64 {
        let max = self.max_backoff_ms as f64;
        // powi takes i32; anything past 1024 doublings is already infinite.
        let exponent = failed_attempt.saturating_sub(1).min(1024) as i32;
        let raw = self.initial_backoff_ms as f64 * self.multiplier.powi(exponent);
        // f64::min returns the non-NaN operand, so NaN and +inf both become `max`.
        let base = raw.min(max).max(0.0);
        let jitter = clamp_unit(self.jitter);
        let unit = clamp_unit(jitter_unit);
        let lowest = (base * (1.0 - jitter)).ceil().min(max);
        let value = (base * (1.0 - jitter * unit)).round();
        value.clamp(lowest, max) as u64
    }
}

fn clamp_unit(x: f64) -> f64 {
    if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) }
}

/// A definition that does not validate: `field` is a path such as
/// `steps[1].retry.multiplier`, `step` the name of the step it is in, and
/// `rule` the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: [{}] {message}", rule.as_str())]
pub struct DefinitionError {
    pub field: String,
    pub step: Option<String>,
    pub rule: Rule,
    pub message: String,
}

/// The rules a definition is checked against, each with a stable name
/// that every refusal prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A field out of its bounds or format.
    Invalid,
    /// A field that the step's kind does not take.
    FieldOfOtherKind,
    /// Two steps of one name.
    DuplicateStep,
    /// A workflow name and version defined twice.
    DuplicateVersion,
    /// A pointer that nothing in the run's document can answer where it
    /// is read: the input, or the result of a step before it.
    UnresolvablePointer,
    /// A result path that cannot hold a result.
    ResultPath,
    /// A `next`, choice or default that names no step.
    UnknownStep,
    /// A step that no path from the first step reaches.
    UnreachableStep,
    /// A step from which no path reaches the end of the run.
    NoEnd,
    /// A step that goes back without `max_visits`.
    UnboundedBackEdge,
    /// A field that a step in a branch cannot hold, or a choice there that
    /// names no later step of its own branch.
    NotInBranch,
    /// `parallel` steps nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A compensation that is more than a task.
    NotInCompensation,
    /// A `child` step whose workflow (or version) is not defined.
    UnknownWorkflow,
    /// Workflows whose `child` steps start each other, without end.
    ChildCycle,
    /// A file that is no TOML, or a value of the wrong type.
    Syntax,
    /// A field that no definition has.
    UnknownField,
}

impl Rule {
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Invalid => "invalid",
            Rule::FieldOfOtherKind => "field_of_other_kind",
            Rule::DuplicateStep => "duplicate_step",
            Rule::DuplicateVersion => "duplicate_version",
            Rule::UnresolvablePointer => "unresolvable_pointer",
            Rule::ResultPath => "result_path",
            Rule::UnknownStep => "unknown_step",
            Rule::UnreachableStep => "unreachable_step",
            Rule::NoEnd => "no_end",
            Rule::UnboundedBackEdge => "unbounded_back_edge",
            Rule::NotInBranch => "not_in_branch",
            Rule::TooDeep => "too_deep",
            Rule::NotInCompensation => "not_in_compensation",
            Rule::UnknownWorkflow => "unknown_workflow",
            Rule::ChildCycle => "child_cycle",
            Rule::Syntax => "syntax",
            Rule::UnknownField => "unknown_field",
        }
    }
}

impl DefinitionError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::of(Rule::Invalid, field, message)
    }

    fn of(rule: Rule, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            step: None,
            rule,
            message: message.into(),
        }
    }

    fn in_step(mut self, name: &str) -> Self {
        self.step = Some(name.to_owned());
        self
    }
}

impl WorkflowDefinition {
    /// Checks every bound; the first violation names its field.
    pub fn validate(&self) -> Result<(), DefinitionError> {
        if !is_name(&self.name, MAX_NAME_LEN) {
            return Err(DefinitionError::new(
                "name",
                "must be 1 to 100 characters of [A-Za-z0-9_.-]",
            ));
        }
        if self.version < 1 {
            return Err(DefinitionError::new("version", "must be >= 1"));
        }
        if self.steps.is_empty() || self.steps.len() > MAX_STEPS {
            return Err(DefinitionError::new(
                "steps",
                format!("must declare 1 to {MAX_STEPS} steps"),
            ));
        }
        self.validate_steps()?;
        self.validate_flow()?;
        self.validate_data()?;
        if let Some(topic) = &self.output_topic
            && !is_topic(topic)
        {
            return Err(DefinitionError::new(
                "output_topic",
                "must be a Kafka topic name: 1 to 249 characters of [A-Za-z0-9._-]",
            ));
        }
        Ok(())
    }
}

/// Where a step sits in its workflow, by the index that numbers every
/// step of the workflow: first the steps of its own sequence in order
/// (the indices of a workflow without `parallel` steps), then, for each
/// `parallel` step in the order of its index, its branches' steps, each
/// branch's in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// The `parallel` step whose branch holds it; `None` in the
    /// workflow's own sequence.
    pub parallel: Option<u32>,
    /// The branch of that step (0 in the workflow's own sequence).
    pub branch: u32,
    /// The index of the first step of its sequence.
    pub first: u32,
    /// How many steps its sequence has.
    pub len: u32,
    /// How many `parallel` steps enclose it.
    pub depth: u32,
    /// A compensation: the index of the task step it undoes.
    pub compensates: Option<u32>,
}

impl WorkflowDefinition {
    /// Every step with its place, by index.
    pub fn layout(&self) -> Vec<(&StepDefinition, Place)> {
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let top = Place {
            parallel: None,
            branch: 0,
            first: 0,
            len: count(self.steps.len()),
            depth: 0,
            compensates: None,
        };
        let mut out: Vec<(&StepDefinition, Place)> = self.steps.iter().map(|s| (s, top)).collect();
        let mut i = 0;
        while i < out.len() && out.len() <= MAX_STEPS_IN_ALL {
            let (step, place) = out[i];
            for (b, steps) in step.sequences().into_iter().enumerate() {
                let inner = Place {
                    parallel: Some(count(i)),
                    branch: count(b),
                    first: count(out.len()),
                    len: count(steps.len()),
                    depth: place.depth.saturating_add(1),
                    compensates: None,
                };
                out.extend(steps.iter().map(|s| (s, inner)));
            }
            i += 1;
        }
        // Then the compensations, each after every step, in the order of
        // the steps they undo.
        for i in 0..out.len() {
            if let Some(compensation) = out[i].0.compensate.as_deref() {
                let place = Place {
                    parallel: None,
                    branch: 0,
                    first: count(out.len()),
                    len: 1,
                    depth: 0,
                    compensates: Some(count(i)),
                };
                out.push((compensation, place));
            }
        }
        out
    }

    /// The step of index `index` (see [`Place`]).
    pub fn step(&self, index: u32) -> Option<&StepDefinition> {
        let i = usize::try_from(index).ok()?;
        match self.steps.get(i) {
            Some(step) => Some(step),
            None if self.has_inner() => self.layout().get(i).map(|(s, _)| *s),
            None => None,
        }
    }

    /// Where the step of index `index` sits.
    pub fn place(&self, index: u32) -> Option<Place> {
        let i = usize::try_from(index).ok()?;
        if !self.has_inner() {
            return (i < self.steps.len()).then_some(Place {
                parallel: None,
                branch: 0,
                first: 0,
                len: u32::try_from(self.steps.len()).unwrap_or(u32::MAX),
                depth: 0,
                compensates: None,
            });
        }
        self.layout().get(i).map(|(_, p)| *p)
    }

    /// The index of the first step of branch `branch` of the parallel
    /// step of index `parallel`.
    pub fn branch_first(&self, parallel: u32, branch: u32) -> Option<u32> {
        let layout = self.layout();
        let i = layout
            .iter()
            .position(|(_, p)| p.parallel == Some(parallel) && p.branch == branch)?;
        u32::try_from(i).ok()
    }

    /// Its `child` steps, wherever they are: each one's path, the workflow
    /// it starts and the version it names.
    pub fn children(&self) -> Vec<(String, &str, Option<u32>)> {
        let layout = self.layout();
        layout
            .iter()
            .enumerate()
            .filter(|(_, (step, _))| step.kind == StepKind::Child)
            .filter_map(|(i, (step, _))| {
                let workflow = step.workflow.as_deref()?;
                Some((self.path_of(&layout, i), workflow, step.version))
            })
            .collect()
    }

    /// The step named `name` in the sequence that holds step `index`.
    pub fn sibling(&self, index: u32, name: &str) -> Option<u32> {
        let layout = self.layout();
        let (_, place) = layout.get(index as usize)?;
        let first = place.first as usize;
        let end = first.saturating_add(place.len as usize).min(layout.len());
        let at = layout[first..end]
            .iter()
            .position(|(s, _)| s.name == name)?;
        u32::try_from(first + at).ok()
    }

    /// How many waits for the signal `name` a run at top-level step `at`
    /// may still begin: the `await_signal` steps of the workflow's sequence
    /// from `first` on, and those in the branches and maps of the steps
    /// from `at` on, one in a map for each item it may have.
    pub fn awaits(&self, name: &str, at: u32, first: u32) -> usize {
        let layout = self.layout();
        (0..layout.len())
            .filter(|&i| {
                let (step, place) = &layout[i];
                let top = u32::try_from(Self::top_of(&layout, i)).unwrap_or(u32::MAX);
                let ahead = match place.parallel {
                    None => top >= first,
                    Some(_) => top >= at,
                };
                step.kind == StepKind::AwaitSignal
                    && step.signal.as_deref() == Some(name)
                    && place.compensates.is_none()
                    && ahead
            })
            .map(|i| Self::items_around(&layout, i))
            .fold(0, usize::saturating_add)
    }

    /// How many times step `index` may run at once: the product of the
    /// item limits of the maps around it.
    fn items_around(layout: &[(&StepDefinition, Place)], mut index: usize) -> usize {
        let mut times: usize = 1;
        while let Some(outer) = layout.get(index).and_then(|(_, p)| p.parallel) {
            index = outer as usize;
            if let Some((step, _)) = layout.get(index).filter(|(s, _)| s.kind == StepKind::Map) {
                times = times.saturating_mul(step.item_limit() as usize);
            }
        }
        times
    }

    /// Whether any step runs steps inside it (a parallel step or a map).
    pub fn has_branches(&self) -> bool {
        self.steps
            .iter()
            .any(|s| matches!(s.kind, StepKind::Parallel | StepKind::Map))
    }

    /// Whether any step is numbered after the workflow's own: a branch's,
    /// an item's, or a compensation (those of a branch's steps come with
    /// the branches).
    fn has_inner(&self) -> bool {
        self.has_branches() || self.steps.iter().any(|s| s.compensate.is_some())
    }

    /// The index of the compensation of step `index`, if it has one.
    pub fn compensation_of(&self, index: u32) -> Option<u32> {
        let layout = self.layout();
        let i = layout
            .iter()
            .position(|(_, p)| p.compensates == Some(index))?;
        u32::try_from(i).ok()
    }

    /// The path of the step of index `index` in its file
    /// (`steps[2].branches[0].steps[1]`).
    fn path_of(&self, layout: &[(&StepDefinition, Place)], index: usize) -> String {
        let Some((_, place)) = layout.get(index) else {
            return String::new();
        };
        if let Some(undone) = place.compensates {
            return format!("{}.compensate", self.path_of(layout, undone as usize));
        }
        let position = index.saturating_sub(place.first as usize);
        let Some(parallel) = place.parallel else {
            return format!("steps[{position}]");
        };
        let outer = self.path_of(layout, parallel as usize);
        match layout.get(parallel as usize).map(|(s, _)| s.kind) {
            Some(StepKind::Map) => format!("{outer}.steps[{position}]"),
            _ => format!("{outer}.branches[{}].steps[{position}]", place.branch),
        }
    }

    /// The index, in the workflow's own sequence, of the step that holds
    /// the step of index `index` (itself, outside branches).
    fn top_of(layout: &[(&StepDefinition, Place)], mut index: usize) -> usize {
        while let Some(parallel) = layout.get(index).and_then(|(_, p)| p.parallel) {
            index = parallel as usize;
        }
        index
    }

    /// Each step, in the workflow's sequence or in a branch, within its
    /// bounds, of a unique name, and of a kind and with fields that its
    /// place allows.
    fn validate_steps(&self) -> Result<(), DefinitionError> {
        let layout = self.layout();
        if layout.len() > MAX_STEPS_IN_ALL {
            return Err(DefinitionError::new(
                "steps",
                format!(
                    "must declare at most {MAX_STEPS_IN_ALL} steps in all, with those of branches"
                ),
            ));
        }
        for (i, (step, place)) in layout.iter().enumerate() {
            let at = self.path_of(&layout, i);
            let refuse = |rule: Rule, field: &str, message: String| {
                Err(DefinitionError::of(rule, format!("{at}{field}"), message).in_step(&step.name))
            };
            step.validate(&at).map_err(|e| e.in_step(&step.name))?;
            if layout[..i].iter().any(|(s, _)| s.name == step.name) {
                return refuse(
                    Rule::DuplicateStep,
                    ".name",
                    format!("duplicate step name \"{}\"", step.name),
                );
            }
            if place.depth > MAX_DEPTH {
                return refuse(
                    Rule::TooDeep,
                    "",
                    format!("parallel steps nest at most {MAX_DEPTH} deep"),
                );
            }
            if place.compensates.is_some() {
                step.validate_compensation(&at)
                    .map_err(|e| e.in_step(&step.name))?;
                continue;
            }
            if place.parallel.is_none() {
                continue;
            }
            self.validate_in_branch(i, step)
                .map_err(|e| e.in_step(&step.name))?;
        }
        Ok(())
    }

    /// A step of any kind runs in a branch (or a map's steps), in order:
    /// it takes no way on of its own, and a choice there skips ahead in
    /// its own branch.
    fn validate_in_branch(&self, i: usize, step: &StepDefinition) -> Result<(), DefinitionError> {
        let at = self.path_of(&self.layout(), i);
        let refuse = |field: &str, message: String| {
            Err(DefinitionError::of(
                Rule::NotInBranch,
                format!("{at}.{field}"),
                message,
            ))
        };
        for (field, name) in flow::named_targets(step) {
            let later = self
                .sibling(u32::try_from(i).unwrap_or(u32::MAX), name)
                .is_some_and(|j| j as usize > i);
            if step.kind == StepKind::Choice && !later {
                return refuse(
                    field,
                    format!(
                        "a choice in a branch goes on at a later step of its own branch, and \"{name}\" is none"
                    ),
                );
            }
        }
        let fields = [
            ("next", step.next.is_some()),
            ("end", step.end),
            ("max_visits", step.max_visits.is_some()),
            ("result", step.result.is_some()),
            ("catch", step.catch.is_some()),
        ];
        match fields.iter().find(|(_, given)| *given) {
            Some((field, _)) => refuse(
                field,
                "a branch's steps run in order, and its result is its last step's output: a step in a branch takes no next, end, max_visits, result or catch".into(),
            ),
            None => Ok(()),
        }
    }
}

/// The data a workflow moves between its steps: its selections and result
/// paths, checked where they are read.
impl WorkflowDefinition {
    /// Whether its runs keep a document of results: a step selects its
    /// input or places its result, or the run selects its output.
    pub fn uses_document(&self) -> bool {
        self.output.is_some()
            || self.layout().iter().any(|(s, _)| {
                s.input.is_some()
                    || s.result.is_some()
                    || s.error_path().is_some()
                    || s.kind == StepKind::Choice
            })
    }

    /// Each pointer is a JSON pointer; each result goes outside `/input`,
    /// and under `/steps` only at the step's own name; each selection
    /// reads the input or what a step before it placed.
    fn validate_data(&self) -> Result<(), DefinitionError> {
        let layout = self.layout();
        for (i, (step, place)) in layout.iter().enumerate() {
            if place.compensates.is_some() {
                // Its input is the output of the step it undoes.
                continue;
            }
            let path = self.path_of(&layout, i);
            let at = |field: &str| format!("{path}.{field}");
            if let Some(result) = &step.result {
                check_result(&step.name, result)
                    .map_err(|(rule, m)| DefinitionError::of(rule, at("result"), m))
                    .map_err(|e| e.in_step(&step.name))?;
            }
            if let Some(result) = step.catch.as_ref().and_then(|c| c.result.as_ref()) {
                check_result(&step.name, result)
                    .map_err(|(rule, m)| DefinitionError::of(rule, at("catch.result"), m))
                    .map_err(|e| e.in_step(&step.name))?;
            }
            // A step in a branch reads what its parallel step could.
            let before: Vec<StepDefinition> = flow::before(self, Self::top_of(&layout, i))
                .into_iter()
                .map(|j| self.steps[j].clone())
                .collect();
            if let Some(input) = &step.input {
                check_read(input, &before)
                    .map_err(|(rule, m)| DefinitionError::of(rule, at("input"), m))
                    .map_err(|e| e.in_step(&step.name))?;
            }
            for (j, rule) in step.choices.iter().enumerate() {
                for pointer in rule.when.pointers() {
                    check_read(pointer, &before)
                        .map_err(|(r, m)| {
                            DefinitionError::of(r, at(&format!("choices[{j}].when")), m)
                        })
                        .map_err(|e| e.in_step(&step.name))?;
                }
            }
        }
        if let Some(output) = &self.output {
            check_read(output, &self.steps)
                .map_err(|(rule, m)| DefinitionError::of(rule, "output", m))?;
        }
        Ok(())
    }
}

/// The graph of a workflow's steps: each name an edge names is a step,
/// every step is reachable and can reach the end, every back edge is
/// bounded ([`flow`]).
impl WorkflowDefinition {
    fn validate_flow(&self) -> Result<(), DefinitionError> {
        for (i, step) in self.steps.iter().enumerate() {
            let refuse = |rule: Rule, field: String, message: String| {
                Err(
                    DefinitionError::of(rule, format!("steps[{i}].{field}"), message)
                        .in_step(&step.name),
                )
            };
            let mut choice = 0;
            for (field, name) in flow::named_targets(step) {
                let field = match field {
                    "choices" => {
                        choice += 1;
                        format!("choices[{}].next", choice - 1)
                    }
                    "catch" => "catch.next".to_owned(),
                    other => other.to_owned(),
                };
                if flow::index_of(self, name).is_none() {
                    return refuse(
                        Rule::UnknownStep,
                        field,
                        format!("names no step of this workflow: {name:?}"),
                    );
                }
            }
            if flow::has_back_edge(self, i) && step.max_visits.is_none() {
                return refuse(
                    Rule::UnboundedBackEdge,
                    "max_visits".into(),
                    "the step goes back to itself or a step before it, so it needs max_visits to bound the loop".into(),
                );
            }
        }
        let reachable = flow::reachable(self);
        let ending = flow::ending(self);
        for (i, step) in self.steps.iter().enumerate() {
            let at = format!("steps[{i}]");
            if !reachable.contains(&i) {
                return Err(DefinitionError::of(
                    Rule::UnreachableStep,
                    at,
                    "no path from the first step reaches it",
                )
                .in_step(&step.name));
            }
            if !ending.contains(&i) {
                return Err(DefinitionError::of(
                    Rule::NoEnd,
                    at,
                    "no path from it reaches the end of the run: it only loops",
                )
                .in_step(&step.name));
            }
        }
        Ok(())
    }
}

fn pointer_tokens(pointer: &str) -> Result<Vec<String>, (Rule, String)> {
    document::tokens(pointer)
        .filter(|_| pointer.len() <= MAX_POINTER_LEN)
        .ok_or_else(|| {
            (
                Rule::Invalid,
                format!(
                    "must be a JSON pointer (\"/input/order\"), at most {MAX_POINTER_LEN} bytes"
                ),
            )
        })
}

fn check_result(name: &str, pointer: &str) -> Result<(), (Rule, String)> {
    let tokens = pointer_tokens(pointer)?;
    match tokens.first().map(String::as_str) {
        None => Err((Rule::ResultPath, "cannot replace the whole document".into())),
        Some(document::INPUT) => Err((
            Rule::ResultPath,
            "cannot go in the run's input (/input)".into(),
        )),
        Some(document::STEPS) if tokens.get(1).map(String::as_str) != Some(name) => Err((
            Rule::ResultPath,
            format!(
                "under /steps a step places only its own result: {}",
                document::default_result(name)
            ),
        )),
        Some(_) => Ok(()),
    }
}

/// `pointer` reads the whole document, the input, or what one of `before`
/// places: at, under or above its result path.
fn check_read(pointer: &str, before: &[StepDefinition]) -> Result<(), (Rule, String)> {
    let tokens = pointer_tokens(pointer)?;
    if tokens.first().is_none_or(|t| t == document::INPUT) {
        return Ok(());
    }
    let placed = before.iter().any(|step| {
        let paths = [Some(step.result_path()), step.error_path()];
        paths.into_iter().flatten().any(|path| {
            let path = document::tokens(&path).unwrap_or_default();
            let common = path.len().min(tokens.len());
            path[..common] == tokens[..common]
        })
    });
    if placed {
        Ok(())
    } else {
        Err((
            Rule::UnresolvablePointer,
            format!(
                "{pointer} reads neither /input nor what a step before it places (/steps/<name>, or its result path)"
            ),
        ))
    }
}

impl StepDefinition {
    /// A task of `pool`, with the default retry policy.
    #[cfg(any(test, feature = "internals"))]
    pub fn task(name: &str, pool: &str, timeout_ms: u64) -> Self {
        Self {
            name: name.to_owned(),
            kind: StepKind::Task,
            pool: pool.to_owned(),
            timeout_ms,
            retry: RetryPolicy::default(),
            signal: None,
            on_timeout: OnTimeout::default(),
            duration_ms: None,
            until: None,
            input: None,
            result: None,
            next: None,
            end: false,
            max_visits: None,
            choices: Vec::new(),
            default: None,
            branches: Vec::new(),
            on_failure: OnFailure::default(),
            steps: Vec::new(),
            max_concurrency: None,
            max_items: None,
            catch: None,
            compensate: None,
            workflow: None,
            version: None,
        }
    }

    /// A child run of `workflow` (its latest version), an attempt at most
    /// `timeout_ms`.
    #[cfg(any(test, feature = "internals"))]
    pub fn child(name: &str, workflow: &str, timeout_ms: u64) -> Self {
        Self {
            kind: StepKind::Child,
            workflow: Some(workflow.into()),
            ..Self::task(name, "", timeout_ms)
        }
    }

    /// A map of `steps` over the items of its input.
    #[cfg(any(test, feature = "internals"))]
    pub fn map(name: &str, steps: Vec<StepDefinition>) -> Self {
        Self {
            kind: StepKind::Map,
            steps,
            ..Self::task(name, "", 0)
        }
    }

    /// A parallel step of `branches` (name, steps), failing fast.
    #[cfg(any(test, feature = "internals"))]
    pub fn parallel(name: &str, branches: Vec<(&str, Vec<StepDefinition>)>) -> Self {
        Self {
            kind: StepKind::Parallel,
            branches: branches
                .into_iter()
                .map(|(name, steps)| Branch {
                    name: name.to_owned(),
                    steps,
                })
                .collect(),
            ..Self::task(name, "", 0)
        }
    }

    /// A choice among `choices` (next step, condition), else `default`.
    #[cfg(any(test, feature = "internals"))]
    pub fn choice(name: &str, choices: Vec<(&str, Condition)>, default: &str) -> Self {
        Self {
            kind: StepKind::Choice,
            choices: choices
                .into_iter()
                .map(|(next, when)| ChoiceRule {
                    next: next.to_owned(),
                    when,
                })
                .collect(),
            default: Some(default.to_owned()),
            ..Self::task(name, "", 0)
        }
    }

    /// A sleep of `duration_ms`.
    #[cfg(any(test, feature = "internals"))]
    pub fn sleep(name: &str, duration_ms: u64) -> Self {
        Self {
            kind: StepKind::Sleep,
            pool: String::new(),
            timeout_ms: 0,
            duration_ms: Some(duration_ms),
            ..Self::task(name, "", 0)
        }
    }

    /// A wait of at most `timeout_ms` for the signal `signal`.
    #[cfg(any(test, feature = "internals"))]
    pub fn await_signal(name: &str, signal: &str, timeout_ms: u64, on_timeout: OnTimeout) -> Self {
        Self {
            kind: StepKind::AwaitSignal,
            signal: Some(signal.to_owned()),
            on_timeout,
            ..Self::task(name, "", timeout_ms)
        }
    }

    fn validate(&self, at: &str) -> Result<(), DefinitionError> {
        if !is_name(&self.name, MAX_NAME_LEN) {
            return Err(DefinitionError::new(
                format!("{at}.name"),
                "must be 1 to 100 characters of [A-Za-z0-9_.-]",
            ));
        }
        self.validate_fields_of_kind(at)?;
        if let Some(max) = self.max_visits
            && !(1..=MAX_VISITS_LIMIT).contains(&max)
        {
            return Err(DefinitionError::new(
                format!("{at}.max_visits"),
                format!("must be in 1..={MAX_VISITS_LIMIT}"),
            ));
        }
        if self.end && self.next.is_some() {
            return Err(DefinitionError::new(
                format!("{at}.next"),
                "a step that ends the run goes nowhere next: end or next, not both",
            ));
        }
        if let Some(catch) = &self.catch {
            catch.validate(&format!("{at}.catch"))?;
        }
        match self.kind {
            StepKind::Task => self.validate_task(at),
            StepKind::AwaitSignal => self.validate_await(at),
            StepKind::Sleep => self.validate_sleep(at),
            StepKind::Choice => self.validate_choice(at),
            StepKind::Parallel => self.validate_parallel(at),
            StepKind::Map => self.validate_map(at),
            StepKind::Child => self.validate_child(at),
        }
    }

    fn validate_map(&self, at: &str) -> Result<(), DefinitionError> {
        if self.steps.is_empty() {
            return Err(DefinitionError::new(
                format!("{at}.steps"),
                "a map step needs at least one step to run for each item",
            ));
        }
        let bounds = [
            (
                "max_concurrency",
                self.max_concurrency,
                MAX_CONCURRENCY_LIMIT,
            ),
            ("max_items", self.max_items, MAX_ITEMS_LIMIT),
        ];
        for (field, value, limit) in bounds {
            if value.is_some_and(|v| !(1..=limit).contains(&v)) {
                return Err(DefinitionError::new(
                    format!("{at}.{field}"),
                    format!("must be in 1..={limit}"),
                ));
            }
        }
        Ok(())
    }

    /// The sequences of steps the step runs inside it: a parallel step's
    /// branches', a map's steps; none for any other kind.
    pub fn sequences(&self) -> Vec<&[StepDefinition]> {
        match self.kind {
            StepKind::Parallel => self.branches.iter().map(|b| b.steps.as_slice()).collect(),
            StepKind::Map => vec![self.steps.as_slice()],
            _ => Vec::new(),
        }
    }

    /// A map's `max_concurrency`, or its default.
    pub fn concurrency(&self) -> u32 {
        self.max_concurrency.unwrap_or(DEFAULT_MAX_CONCURRENCY)
    }

    /// A map's `max_items`, or its default.
    pub fn item_limit(&self) -> u32 {
        self.max_items.unwrap_or(DEFAULT_MAX_ITEMS)
    }

    fn validate_parallel(&self, at: &str) -> Result<(), DefinitionError> {
        if self.branches.is_empty() || self.branches.len() > MAX_BRANCHES {
            return Err(DefinitionError::new(
                format!("{at}.branches"),
                format!("a parallel step needs 1 to {MAX_BRANCHES} branches"),
            ));
        }
        for (b, branch) in self.branches.iter().enumerate() {
            let field = format!("{at}.branches[{b}]");
            if !is_name(&branch.name, MAX_NAME_LEN) {
                return Err(DefinitionError::new(
                    format!("{field}.name"),
                    "must be 1 to 100 characters of [A-Za-z0-9_.-]",
                ));
            }
            if self.branches[..b].iter().any(|o| o.name == branch.name) {
                return Err(DefinitionError::new(
                    format!("{field}.name"),
                    format!("duplicate branch name {:?}", branch.name),
                ));
            }
            if branch.steps.is_empty() {
                return Err(DefinitionError::new(
                    format!("{field}.steps"),
                    "a branch needs at least one step",
                ));
            }
        }
        Ok(())
    }

    fn validate_choice(&self, at: &str) -> Result<(), DefinitionError> {
        if self.choices.is_empty() || self.choices.len() > MAX_CHOICES {
            return Err(DefinitionError::new(
                format!("{at}.choices"),
                format!("a choice step needs 1 to {MAX_CHOICES} choices"),
            ));
        }
        for (j, rule) in self.choices.iter().enumerate() {
            rule.when.validate().map_err(|(path, message)| {
                let field = format!("{at}.choices[{j}].when");
                let field = if path.is_empty() {
                    field
                } else {
                    format!("{field}.{path}")
                };
                DefinitionError::new(field, message)
            })?;
            for pointer in rule.when.pointers() {
                if pointer_tokens(pointer).is_err() {
                    return Err(DefinitionError::new(
                        format!("{at}.choices[{j}].when"),
                        format!(
                            "{pointer:?} is no JSON pointer of at most {MAX_POINTER_LEN} bytes"
                        ),
                    ));
                }
            }
        }
        if self.default.is_none() {
            return Err(DefinitionError::new(
                format!("{at}.default"),
                "a choice step needs a default: the next step when no choice holds",
            ));
        }
        Ok(())
    }

    /// A field of another kind of step is a mistake, not something to ignore.
    fn validate_fields_of_kind(&self, at: &str) -> Result<(), DefinitionError> {
        use StepKind::{AwaitSignal, Child, Choice, Map, Parallel, Sleep, Task};
        // The kinds that are steps of the run's flow, each with its own
        // result and its own way on.
        const GOES_ON: &[StepKind] = &[Task, AwaitSignal, Sleep, Parallel, Map, Child];
        let given: [(&str, bool, &[StepKind]); 22] = [
            ("pool", !self.pool.is_empty(), &[Task]),
            (
                "retry",
                self.retry != RetryPolicy::default(),
                &[Task, Child],
            ),
            (
                "timeout_ms",
                self.timeout_ms != 0,
                &[Task, AwaitSignal, Child],
            ),
            ("signal", self.signal.is_some(), &[AwaitSignal]),
            (
                "on_timeout",
                self.on_timeout != OnTimeout::default(),
                &[AwaitSignal],
            ),
            ("duration_ms", self.duration_ms.is_some(), &[Sleep]),
            ("until", self.until.is_some(), &[Sleep]),
            ("input", self.input.is_some(), GOES_ON),
            ("result", self.result.is_some(), GOES_ON),
            ("next", self.next.is_some(), GOES_ON),
            ("end", self.end, GOES_ON),
            ("choices", !self.choices.is_empty(), &[Choice]),
            ("default", self.default.is_some(), &[Choice]),
            ("branches", !self.branches.is_empty(), &[Parallel]),
            (
                "on_failure",
                self.on_failure != OnFailure::default(),
                &[Parallel, Map],
            ),
            ("steps", !self.steps.is_empty(), &[Map]),
            ("max_concurrency", self.max_concurrency.is_some(), &[Map]),
            ("max_items", self.max_items.is_some(), &[Map]),
            ("catch", self.catch.is_some(), GOES_ON),
            ("compensate", self.compensate.is_some(), &[Task]),
            ("workflow", self.workflow.is_some(), &[Child]),
            ("version", self.version.is_some(), &[Child]),
        ];
        match given
            .iter()
            .find(|(_, present, kinds)| *present && !kinds.contains(&self.kind))
        {
            Some((field, _, _)) => Err(DefinitionError::of(
                Rule::FieldOfOtherKind,
                format!("{at}.{field}"),
                format!("is not a field of a {} step", self.kind.as_str()),
            )),
            None => Ok(()),
        }
    }

    fn validate_await(&self, at: &str) -> Result<(), DefinitionError> {
        match &self.signal {
            Some(name) if !name.is_empty() && name.len() <= MAX_NAME_LEN => {}
            _ => {
                return Err(DefinitionError::new(
                    format!("{at}.signal"),
                    format!(
                        "an await_signal step needs the signal's name, 1 to {MAX_NAME_LEN} bytes"
                    ),
                ));
            }
        }
        validate_timeout(at, self.timeout_ms)
    }

    fn validate_sleep(&self, at: &str) -> Result<(), DefinitionError> {
        match (self.duration_ms, &self.until) {
            (Some(ms), None) if (1..=MAX_SLEEP_MS).contains(&ms) => Ok(()),
            (Some(_), None) => Err(DefinitionError::new(
                format!("{at}.duration_ms"),
                format!("must be in 1..={MAX_SLEEP_MS}"),
            )),
            (None, Some(pointer)) if pointer.starts_with('/') && pointer.len() <= MAX_NAME_LEN => {
                Ok(())
            }
            (None, Some(_)) => Err(DefinitionError::new(
                format!("{at}.until"),
                format!("must be a JSON pointer (\"/ship_at\"), at most {MAX_NAME_LEN} bytes"),
            )),
            _ => Err(DefinitionError::new(
                format!("{at}.duration_ms"),
                "a sleep step needs exactly one of duration_ms and until",
            )),
        }
    }

    fn validate_task(&self, at: &str) -> Result<(), DefinitionError> {
        if !is_name(&self.pool, MAX_NAME_LEN) {
            return Err(DefinitionError::new(
                format!("{at}.pool"),
                "must be 1 to 100 characters of [A-Za-z0-9._-]",
            ));
        }
        validate_timeout(at, self.timeout_ms)?;
        self.retry.validate(&format!("{at}.retry"))
    }

    /// A child names the workflow it runs; its attempts time out and retry
    /// as a task's do.
    fn validate_child(&self, at: &str) -> Result<(), DefinitionError> {
        if !self
            .workflow
            .as_deref()
            .is_some_and(|w| is_name(w, MAX_NAME_LEN))
        {
            return Err(DefinitionError::new(
                format!("{at}.workflow"),
                "a child step names its workflow: 1 to 100 characters of [A-Za-z0-9_.-]",
            ));
        }
        if self.version == Some(0) {
            return Err(DefinitionError::new(
                format!("{at}.version"),
                "must be >= 1",
            ));
        }
        validate_timeout(at, self.timeout_ms)?;
        self.retry.validate(&format!("{at}.retry"))
    }

    /// A compensation is a plain task: what it gets is the output of the
    /// step it undoes, and after it comes the compensation before.
    fn validate_compensation(&self, at: &str) -> Result<(), DefinitionError> {
        let fields = [
            ("kind", self.kind != StepKind::Task),
            ("input", self.input.is_some()),
            ("result", self.result.is_some()),
            ("next", self.next.is_some()),
            ("end", self.end),
            ("max_visits", self.max_visits.is_some()),
            ("catch", self.catch.is_some()),
            ("compensate", self.compensate.is_some()),
        ];
        match fields.iter().find(|(_, given)| *given) {
            Some((field, _)) => Err(DefinitionError::of(
                Rule::NotInCompensation,
                format!("{at}.{field}"),
                "a compensation is a task (name, pool, timeout_ms, retry) that gets the output of the step it undoes: it takes no kind but task, no input, result, next, end, max_visits, catch or compensate",
            )),
            None => Ok(()),
        }
    }

    /// Where the error of its caught failure goes in the run's document,
    /// if a catch goes on with it.
    pub fn error_path(&self) -> Option<String> {
        let catch = self.catch.as_ref().filter(|c| c.next.is_some())?;
        Some(
            catch
                .result
                .clone()
                .unwrap_or_else(|| document::default_error(&self.name)),
        )
    }

    /// Where its result goes in the run's document.
    pub fn result_path(&self) -> String {
        self.result
            .clone()
            .unwrap_or_else(|| document::default_result(&self.name))
    }

    /// The pool whose workers run it: a task's, none for a wait.
    #[cfg(any(test, feature = "internals"))]
    pub fn task_pool(&self) -> Option<&str> {
        (self.kind == StepKind::Task).then_some(self.pool.as_str())
    }
}

impl Catch {
    /// Goes on at a step or compensates: one of the two.
    fn validate(&self, at: &str) -> Result<(), DefinitionError> {
        match (&self.next, self.compensate) {
            (Some(_), false) => Ok(()),
            (None, true) if self.result.is_none() => Ok(()),
            (None, true) => Err(DefinitionError::new(
                format!("{at}.result"),
                "a catch that compensates puts no error in the document: result goes with next",
            )),
            _ => Err(DefinitionError::new(
                format!("{at}.next"),
                "a catch names the step to go on at (next) or compensates (compensate = true): one of the two",
            )),
        }
    }
}

fn validate_timeout(at: &str, timeout_ms: u64) -> Result<(), DefinitionError> {
    if (1..=MAX_TIMEOUT_MS).contains(&timeout_ms) {
        Ok(())
    } else {
        Err(DefinitionError::new(
            format!("{at}.timeout_ms"),
            format!("must be in 1..={MAX_TIMEOUT_MS}"),
        ))
    }
}

impl StepKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Task => "task",
            StepKind::AwaitSignal => "await_signal",
            StepKind::Sleep => "sleep",
            StepKind::Choice => "choice",
            StepKind::Parallel => "parallel",
            StepKind::Map => "map",
            StepKind::Child => "child",
        }
    }
}

impl RetryPolicy {
    fn validate(&self, at: &str) -> Result<(), DefinitionError> {
        let err = |field: &str, message: String| {
            Err(DefinitionError::new(format!("{at}.{field}"), message))
        };
        if !(1..=MAX_ATTEMPTS_LIMIT).contains(&self.max_attempts) {
            return err(
                "max_attempts",
                format!("must be in 1..={MAX_ATTEMPTS_LIMIT}"),
            );
        }
        if self.max_backoff_ms > MAX_BACKOFF_LIMIT_MS {
            return err(
                "max_backoff_ms",
                format!("must be <= {MAX_BACKOFF_LIMIT_MS}"),
            );
        }
        if self.initial_backoff_ms > self.max_backoff_ms {
            return err("initial_backoff_ms", "must be <= max_backoff_ms".to_owned());
        }
        if !self.multiplier.is_finite() || self.multiplier < 1.0 {
            return err("multiplier", "must be >= 1.0".to_owned());
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return err("jitter", "must be in [0, 1]".to_owned());
        }
        Ok(())
    }
}

/// The validated workflow definitions a coordinator knows, by name and version.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Workflows {
    by_name: BTreeMap<String, BTreeMap<u32, WorkflowDefinition>>,
}

impl Workflows {
    /// Validates every definition; a repeated `(name, version)` is an
    /// error, and so is a `child` step refused by [`Workflows::check_children`].
    #[cfg(any(test, feature = "internals"))]
    pub fn new(definitions: Vec<WorkflowDefinition>) -> Result<Self, DefinitionError> {
        let workflows = Self::each_valid(definitions)?;
        match workflows.check_children().into_iter().next() {
            Some((_, error)) => Err(error),
            None => Ok(workflows),
        }
    }

    /// Validates every definition on its own; a repeated `(name, version)`
    /// is an error. What their `child` steps start is not checked.
    pub fn each_valid(definitions: Vec<WorkflowDefinition>) -> Result<Self, DefinitionError> {
        let mut by_name: BTreeMap<String, BTreeMap<u32, WorkflowDefinition>> = BTreeMap::new();
        for def in definitions {
            def.validate()?;
            let versions = by_name.entry(def.name.clone()).or_default();
            if versions.contains_key(&def.version) {
                return Err(DefinitionError::of(
                    Rule::DuplicateVersion,
                    "version",
                    format!(
                        "workflow \"{}\" version {} is defined twice",
                        def.name, def.version
                    ),
                ));
            }
            versions.insert(def.version, def);
        }
        Ok(Self { by_name })
    }

    /// What the `child` steps of these workflows start: each names a
    /// workflow (and version) that is defined here, and no workflow starts
    /// itself through its children. Each refusal with the workflow (name,
    /// version) whose step it names.
    pub fn check_children(&self) -> Vec<((String, u32), DefinitionError)> {
        let mut refused = Vec::new();
        for def in self.iter() {
            for (at, child, version) in def.children() {
                let known = match version {
                    Some(v) => self.get(child, v).is_some(),
                    None => self.latest(child).is_some(),
                };
                if !known {
                    let named = version.map_or(String::new(), |v| format!(" version {v}"));
                    refused.push((
                        (def.name.clone(), def.version),
                        DefinitionError::of(
                            Rule::UnknownWorkflow,
                            format!("{at}.workflow"),
                            format!("starts workflow \"{child}\"{named}, which is not defined"),
                        ),
                    ));
                } else if self.reaches(child, &def.name) {
                    refused.push((
                        (def.name.clone(), def.version),
                        DefinitionError::of(
                            Rule::ChildCycle,
                            format!("{at}.workflow"),
                            format!(
                                "starts workflow \"{child}\", whose child runs start \"{}\" again: runs that start each other never end",
                                def.name
                            ),
                        ),
                    ));
                }
            }
        }
        refused
    }

    /// Whether a run of `from` (any version) can start, through child
    /// steps, a run of `to`.
    fn reaches(&self, from: &str, to: &str) -> bool {
        let mut seen = std::collections::BTreeSet::new();
        let mut next = vec![from.to_owned()];
        while let Some(name) = next.pop() {
            if name == to {
                return true;
            }
            if !seen.insert(name.clone()) {
                continue;
            }
            let Some(versions) = self.by_name.get(&name) else {
                continue;
            };
            for def in versions.values() {
                next.extend(def.children().into_iter().map(|(_, w, _)| w.to_owned()));
            }
        }
        false
    }

    /// The definition of exactly this version.
    pub fn get(&self, name: &str, version: u32) -> Option<&WorkflowDefinition> {
        self.by_name.get(name)?.get(&version)
    }

    /// The highest version of `name`.
    pub fn latest(&self, name: &str) -> Option<&WorkflowDefinition> {
        self.by_name.get(name)?.values().next_back()
    }

    /// Every definition, ordered by name then version.
    pub fn iter(&self) -> impl Iterator<Item = &WorkflowDefinition> {
        self.by_name.values().flat_map(BTreeMap::values)
    }

    #[cfg(any(test, feature = "internals"))]
    pub fn len(&self) -> usize {
        self.by_name.values().map(BTreeMap::len).sum()
    }

    #[cfg(any(test, feature = "internals"))]
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}
