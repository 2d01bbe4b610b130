//! A run's start: from `run.start` to the run's first transition, and the
//! same start again.
//!
//! In: a `run.start` and the workflow definitions; for a run that exists, its
//! state. Out: the `run.started` transition, whose state runs the first steps
//! (a task dispatched, or a wait begun; a run whose first steps end at once
//! may be done or failed already), or a duplicate, or a rejection.
//! Guarantees: a run is created by one start only; the same request again is
//! a no-op, another request under the same run id is refused
//! (`idempotency_mismatch`). Pure: no database, no clock; what it decides is
//! tested without either.

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::waits::Entered;
use super::{Builder, Decision, Entropy, NoOpReason, RejectionClass, reject};
use crate::contract::input::RunStart;
use crate::contract::{TransitionKind, fingerprint};
use crate::coordinator::definition::Workflows;
use crate::coordinator::state::{Parent, RunState, RunStatus, STATE_VERSION};

pub(super) fn on_start(
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
        encoding_version: STATE_VERSION,
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
        results: super::data::initial_results(def),
        visits: std::collections::BTreeMap::new(),
        outstanding: None,
        pending_retry: None,
        lanes: Vec::new(),
        waiting: None,
        compensable: Vec::new(),
        compensating: None,
        parent: start.parent.as_ref().map(|p| Parent {
            run_id: p.run_id.clone(),
            stamp: p.stamp,
        }),
        attempts: Vec::new(),
        signals: Vec::new(),
        retries: Vec::new(),
        failed_seq: None,
        correlation_id: start.correlation_id.clone(),
        trace: None,
        start_fingerprint: Some(fingerprint::start(start)),
        error: None,
        record_version: 0,
        last_transition_seq: 0,
        created_at: now,
        updated_at: now,
    };
    let mut b = Builder::new(state, None, now, entropy);
    b.def = Some(def);
    b.detail("workflow", def.name.clone().into());
    b.detail("workflow_version", def.version.into());
    if let Some(parent) = &start.parent {
        b.detail(
            "parent",
            serde_json::json!({"run_id": parent.run_id, "stamp": parent.stamp.to_string()}),
        );
    }
    // A run whose first steps end at once (a sleep until a time past) may
    // be done, or failed, by the end of its first transition.
    match b.enter(def, 0) {
        Ok(Entered::Started(stamp)) => b.detail("stamp", stamp.to_string().into()),
        Ok(Entered::Succeeded | Entered::Failed) => {}
        Err(rejection) => return rejection,
    }
    b.finish(TransitionKind::RunStarted, "start".to_owned())
}

/// A start of a run that exists: the same request again is a duplicate, a
/// different one under the same run id is refused.
pub(super) fn on_duplicate_start(state: &RunState, start: &RunStart) -> Decision {
    match &state.start_fingerprint {
        Some(stored) if *stored != fingerprint::start(start) => reject(
            RejectionClass::IdempotencyMismatch,
            "run.start: the run exists, started by a different request",
        ),
        _ => Decision::NoOp(NoOpReason::DuplicateStart),
    }
}
