//! The pure coordinator: the decision logic of Ductor as a fold.
//!
//! In: one decoded [`crate::contract::Input`], the run's [`RunState`] as
//! loaded (`None` for a new run), the [`Workflows`], `now` and one
//! [`Entropy`]. Out: a [`Decision`], which the apply stage commits.
//! Guarantees: no database, no clock, no randomness of its own; what it
//! decides is tested without any of them.
//!
//! `fold(state, input, workflows, max_state_bytes, now, entropy) -> Decision` decides
//! what one input does to one run. It imports no tokio, sqlx or rdkafka, reads no
//! clock, generates no randomness and performs no I/O, so it is tested exhaustively
//! (unit and property tests) and the apply layer around it stays thin:
//!
//! 1. decode the Kafka message with [`crate::contract::decode_input`] (errors go
//!    to the DLQ with [`crate::contract::InputErrorClass::as_str`] as the error class);
//! 2. load the run (`None` if it does not exist) with its `record_version`;
//! 3. call [`fold()`] with `now` and one fresh [`Entropy`];
//! 4. on [`Decision::Transition`], commit in one transaction: the new state
//!    (`UPDATE ... WHERE record_version = $old`, bumping it), the [`TransitionRecord`],
//!    the [`AttemptWrite`]s and one outbox intent per [`crate::contract::Effect`], in order. A
//!    [`Decision::NoOp`] or [`Decision::Rejection`] writes nothing.
//!
//! Exactly-once progress rests on three checks made here: `run.start` for an existing
//! run is a duplicate; only the result/timeout carrying the *outstanding* attempt's
//! stamp (and only the retry timer naming the pending retry) changes the run; signals
//! are deduplicated by `signal_id`. Every transition increments
//! `last_transition_seq` by exactly one.
//!
//! A run's state stays bounded: it keeps the newest step's output only, and signals
//! without their payloads (both are in the transitions' `detail`, the history), and
//! a transition that would leave it over `max_state_bytes` fails the run instead
//! ([`STATE_TOO_LARGE`]).
//!
//! A run's state is stored as one document whose shape carries its version
//! ([`STATE_VERSION`]); [`stored`] loads every older version and refuses a
//! newer one.
//!
//! A run whose workflow version is no longer defined can apply no input;
//! [`fail_missing_workflow`] fails it from no input at all, which `serve`
//! does at start when told to (see [`versions`]).
//!
//! Effect order within a transition is part of the contract: the `ductor.events`
//! lifecycle event comes first, then step dispatches, timers and the run output.

pub mod condition;
pub mod definition;
pub mod document;
pub mod flow;
pub mod fold;
pub mod state;
pub mod stored;
pub mod versions;

pub use definition::Workflows;
pub use fold::{
    AttemptWrite, Decision, Entropy, NoOpReason, Rejection, Transition, fail_missing_workflow,
    fold, fold_purged,
};
/// The version of the state document this binary writes (for the
/// harnesses: the upgrade tests write one newer).
#[cfg(any(test, feature = "internals"))]
pub use state::STATE_VERSION;
pub use state::{AttemptRecord, AttemptStatus, Purged, RunState, RunStatus};
pub use stored::StateDecodeError;
// The rest of the fold's vocabulary, for the harnesses and the tests.
#[cfg(any(test, feature = "internals"))]
pub use definition::{
    Branch, Catch, ChoiceRule, DefinitionError, MAX_STEPS_IN_ALL, OnFailure, OnTimeout,
    RetryPolicy, StepDefinition, StepKind, WorkflowDefinition,
};
#[cfg(any(test, feature = "internals"))]
pub use fold::{
    BRANCH_FAILED, ITEM_FAILED, RejectionClass, STATE_TOO_LARGE, TransitionRecord,
    WORKFLOW_MISSING, derived_stamp,
};
#[cfg(any(test, feature = "internals"))]
pub use state::{
    Lane, LaneStatus, MAX_RETRIES_PER_RUN, MAX_SIGNALS_PER_RUN, Outstanding, PendingRetry,
    RetryRecord, SignalRecord, Waiting,
};

#[cfg(test)]
mod catch_tests;
#[cfg(test)]
mod child_tests;
#[cfg(test)]
mod compensate_tests;
#[cfg(test)]
mod data_tests;
#[cfg(test)]
mod flow_tests;
#[cfg(test)]
mod parallel_tests;
#[cfg(test)]
mod retry_tests;
#[cfg(test)]
mod tests;
