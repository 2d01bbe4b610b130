//! Fold: each input of a batch through the coordinator's fold, against the
//! runs as loaded, and the rows its transition writes.
//!
//! In: one input (or a routed start) with what its message carried (where
//! it came from, its trace context), the batch's runs in memory and the
//! time of the attempt. Out: the input's [`InputOutcome`]; for a
//! transition, the run's new state in place of the old, and its
//! transition, attempt and intent rows added to the batch's [`Writes`].
//! Guarantees: no database here; the inputs of a batch fold in order, each
//! on the state the one before it left; a run retention deleted folds
//! against its tombstone, never as a new run; every intent's idempotency
//! key is its run, seq and effect index, the same at every recomputation.
//! A transition of a traced run is a hop of the run's trace: the input's
//! context continues it when the input belongs to that trace (a worker's
//! result, a timer, a signal of the same trace), the run's own otherwise
//! (an input of another trace is linked, not followed); an input's
//! tracestate replaces the run's only when it has one; the run keeps the
//! hop, and its effects carry it.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde_json::Value;
use tracing::field::Empty;
use uuid::Uuid;

use super::rows::{IntentRow, Loaded, TransitionRow, Writes};
use super::{Applier, ApplyError, InputOutcome};
use crate::contract::headers::{EffectOrigin, add_trace, effect_headers};
use crate::contract::{
    Effect, EffectTarget, Input, Source, TraceContext, idempotency_key, timeout_cancel_key,
};
use crate::coordinator::{Decision, Entropy, RunState, RunStatus, Transition, fold, fold_purged};
use crate::infra::traces;

/// What an input's message carried besides the input.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Carried<'a> {
    /// Where it was read, kept on its transition.
    pub(super) source: Option<&'a Source>,
    /// Its trace context, if a valid one.
    pub(super) trace: Option<&'a TraceContext>,
}

fn fresh_entropy() -> Entropy {
    Entropy {
        stamp: Uuid::new_v4(),
        jitter_unit: rand::random::<f64>(),
    }
}

impl Applier {
    /// Folds one input into the in-memory runs and collects its writes.
    /// Returns the outcome and, when applied, how many effects it produced.
    pub(super) fn fold_one(
        &self,
        input: &Input,
        carried: Carried<'_>,
        runs: &mut HashMap<String, Loaded>,
        writes: &mut Writes,
        now: DateTime<Utc>,
    ) -> Result<(InputOutcome, usize), ApplyError> {
        let span = tracing::info_span!(
            target: traces::TARGET,
            parent: None,
            "fold",
            ductor.run_id = input.run_id(),
            ductor.input = input_kind(input),
            ductor.step = Empty,
            ductor.seq = Empty,
        );
        let loaded = runs
            .get_mut(input.run_id())
            .expect("every input's run was looked up");
        let entropy = fresh_entropy();
        let decision = match (&loaded.state, &loaded.purged) {
            (None, Some(purged)) => fold_purged(purged, input),
            (state, _) => fold(
                state.as_ref(),
                input,
                &self.workflows,
                self.max_state_bytes,
                now,
                &entropy,
            ),
        };
        let transition = match decision {
            Decision::NoOp(reason) => return Ok((InputOutcome::NoOp(reason), 0)),
            Decision::Rejection(rejection) => return Ok((InputOutcome::Rejected(rejection), 0)),
            Decision::Transition(transition) => *transition,
        };
        let run_trace = loaded.state.as_ref().and_then(|s| s.trace.as_ref());
        let parent = match (carried.trace, run_trace) {
            (Some(own), Some(run)) if own.trace_id != run.trace_id => {
                traces::link(&span, own);
                Some(run.clone())
            }
            // An input of the run's trace without a tracestate of its own
            // (a signal's caller that has none) keeps the run's.
            (Some(own), Some(run)) if own.tracestate.is_none() => Some(TraceContext {
                tracestate: run.tracestate.clone(),
                ..own.clone()
            }),
            (own, run) => own.or(run).cloned(),
        };
        let hop = traces::hop(&span, parent.as_ref());
        span.record("ductor.step", transition.record.step_index);
        span.record("ductor.seq", transition.record.seq);
        let (seq, effects) = self.record(transition, carried.source, hop, loaded, writes)?;
        Ok((InputOutcome::Applied { seq }, effects))
    }

    /// Collects the writes of one transition of `loaded`'s run and makes
    /// its state the run's. Returns its seq and how many effects it made.
    pub(super) fn record(
        &self,
        transition: Transition,
        source: Option<&Source>,
        hop: Option<TraceContext>,
        loaded: &mut Loaded,
        writes: &mut Writes,
    ) -> Result<(i64, usize), ApplyError> {
        let mut state = transition.state;
        if hop.is_some() {
            state.trace = hop;
        }
        let record = transition.record;
        let seq = record.seq;
        writes.transitions.push(TransitionRow {
            run_id: state.run_id.clone(),
            seq,
            input_ref: record.input_ref,
            kind: record.kind.as_str(),
            from_status: record.from_status.map(RunStatus::as_str),
            to_status: record.to_status.as_str(),
            step_index: record.step_index as i32,
            detail: serde_json::to_string(&record.detail)?,
            source: source.cloned(),
            at: record.at,
        });
        for write in transition.attempt_writes {
            writes.attempt(&state.run_id, write);
        }
        let effects = transition.effects.len();
        for (index, effect) in transition.effects.into_iter().enumerate() {
            writes
                .intents
                .push(self.intent_row(&state, seq, index, effect, record.at)?);
        }
        loaded.state = Some(state);
        loaded.changed = true;
        Ok((seq, effects))
    }

    pub(super) fn intent_row(
        &self,
        state: &RunState,
        seq: i64,
        index: usize,
        effect: Effect,
        at: DateTime<Utc>,
    ) -> Result<IntentRow, ApplyError> {
        let key = idempotency_key(&state.run_id, seq, index);
        let topic = effect.target.topic(&self.topics);
        let origin = EffectOrigin {
            run_id: &state.run_id,
            tenant: &state.tenant,
            workflow: &state.workflow,
            workflow_version: state.workflow_version,
            seq,
            at,
        };
        let mut headers = effect_headers(&origin, &key, effect.kind.ce_type());
        if let Some(trace) = &state.trace {
            add_trace(&mut headers, trace);
        }
        let cancel_key = match (&effect.target, effect.payload.get("timer")) {
            (EffectTarget::Wakeups, Some(timer)) if timer == "timeout" => effect
                .payload
                .get("stamp")
                .and_then(Value::as_str)
                .map(timeout_cancel_key),
            _ => None,
        };
        Ok(IntentRow {
            cancel_key,
            run_id: state.run_id.clone(),
            seq,
            effect_index: index as i32,
            idempotency_key: key,
            tenant: state.tenant.clone(),
            topic,
            message_key: effect
                .target
                .other_run()
                .unwrap_or(&state.run_id)
                .as_bytes()
                .to_vec(),
            headers,
            payload: serde_json::to_vec(&effect.payload)?,
            ce_type: effect.kind.ce_type().to_owned(),
            due: effect.not_before.is_none_or(|t| t <= at),
            not_before: effect.not_before.unwrap_or(at),
        })
    }
}

/// The kind of an input, as its span names it.
fn input_kind(input: &Input) -> &'static str {
    match input {
        Input::Start(_) => "run.start",
        Input::Result(_) => "attempt.result",
        Input::Timer(_) => "wakeup.timer",
        Input::Signal(_) => "wakeup.signal",
        Input::Cancel(_) => "wakeup.cancel",
        Input::Retry(_) => "wakeup.retry",
    }
}
