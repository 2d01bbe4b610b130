//! The routed-start path: starts whose run the routing plane decides, in
//! the batch's own transaction.
//!
//! In: the batch's routed requests (HTTP starts, and Kafka starts without a
//! `run_id`), its transaction, and the runs and writes of the attempt.
//! Out: each request's [`RouteOutcome`] (decided, a duplicate of an earlier
//! decision, a key reused for another request, a start refused), or
//! [`Routed::Held`] when another caller holds a key and has not decided.
//! Guarantees: a key yields exactly one decision. Its reservation, the
//! run's first transition with its `run.accepted` event, and the key's
//! completion commit together or not at all; a key another caller holds
//! leaves the attempt with nothing to commit; a start of an unknown
//! workflow is refused before it reserves anything.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction as PgTx};

use super::fold::Carried;
use super::rows::{Loaded, Writes};
use super::session::Session;
use super::{Applier, ApplyError, InputOutcome};
use crate::contract::effects::RunAccepted;
use crate::contract::input::SCHEMA_VERSION;
use crate::contract::{Effect, EffectKind, EffectTarget, Input};
use crate::routing::{self, Reservation, ReserveKind, Reserved, RouteOutcome, RouteRequest};

/// What the routed requests of one attempt came to.
pub(super) enum Routed {
    /// Each request's outcome, in order.
    All(Vec<RouteOutcome>),
    /// The key of the request at this index is held by another caller
    /// still deciding: nothing of the attempt may commit.
    Held(usize),
}

/// What taking a routed request's key came to.
enum Claim {
    /// This request decides, with this kind of reservation.
    Decide(ReserveKind),
    /// The key answers for it: a decision made before, or a reuse refused.
    Answered(RouteOutcome),
    /// Another caller holds the key and has not decided yet.
    Held,
}

impl Applier {
    /// Decides every routed request of the batch, in its transaction.
    pub(super) async fn route_all(
        &self,
        session: &mut Session,
        routed: &[RouteRequest],
        runs: &mut HashMap<String, Loaded>,
        writes: &mut Writes,
        now: DateTime<Utc>,
    ) -> Result<Routed, ApplyError> {
        let mut outcomes = Vec::with_capacity(routed.len());
        for (at, request) in routed.iter().enumerate() {
            let Session::Transaction(tx) = session else {
                unreachable!("a batch with routed requests has its own transaction")
            };
            match self.route_one(tx, request, runs, writes, now).await? {
                Some(outcome) => outcomes.push(outcome),
                None => return Ok(Routed::Held(at)),
            }
        }
        Ok(Routed::All(outcomes))
    }

    /// Takes a routed request's key in the deciding transaction.
    async fn claim_key(
        &self,
        tx: &mut PgTx<'_, Postgres>,
        request: &RouteRequest,
    ) -> Result<Claim, ApplyError> {
        let Some(key) = &request.key else {
            return Ok(Claim::Decide(ReserveKind::Unkeyed));
        };
        if let Reservation::Held { epoch } = request.reservation {
            return Ok(
                if routing::fence_in_tx(tx, &request.start, key, epoch).await? {
                    Claim::Decide(ReserveKind::Fresh)
                } else {
                    Claim::Answered(RouteOutcome::ClaimLost)
                },
            );
        }
        Ok(
            match routing::reserve_in_tx(tx, request, key, self.pending_ttl).await? {
                Reserved::Won(kind) => Claim::Decide(kind),
                Reserved::Taken(row) if row.status == routing::KeyStatus::Pending => Claim::Held,
                Reserved::Taken(row) => Claim::Answered(match row.decision {
                    Some(decision) if row.fingerprint == request.fingerprint => {
                        RouteOutcome::Duplicate { decision }
                    }
                    _ => RouteOutcome::Mismatch,
                }),
            },
        )
    }

    /// Reserves (or checks) a routed request's key and, when it wins, folds
    /// its start and completes the key with the decision. `None`: the key is
    /// held by another caller still deciding.
    async fn route_one(
        &self,
        tx: &mut PgTx<'_, Postgres>,
        request: &RouteRequest,
        runs: &mut HashMap<String, Loaded>,
        writes: &mut Writes,
        now: DateTime<Utc>,
    ) -> Result<Option<RouteOutcome>, ApplyError> {
        let start = &request.start;
        let known = match start.workflow_version {
            Some(v) => self.workflows.get(&start.workflow, v).is_some(),
            None => self.workflows.latest(&start.workflow).is_some(),
        };
        if !known {
            // Rejected before reserving, so no reservation is left behind.
            return Ok(Some(RouteOutcome::Rejected(format!(
                "unknown workflow {:?}",
                start.workflow
            ))));
        }
        let kind = match self.claim_key(tx, request).await? {
            Claim::Decide(kind) => kind,
            Claim::Answered(answer) => return Ok(Some(answer)),
            Claim::Held => return Ok(None),
        };
        runs.entry(start.run_id.clone()).or_insert(Loaded {
            state: None,
            loaded_version: None,
            changed: false,
            cached: false,
            purged: None,
        });
        let input = Input::Start(start.clone());
        let carried = Carried {
            source: request.source.as_ref(),
            trace: request.trace.as_ref(),
        };
        let (outcome, effects) = self.fold_one(&input, carried, runs, writes, now)?;
        let InputOutcome::Applied { seq } = outcome else {
            return Ok(Some(RouteOutcome::Rejected(match outcome {
                InputOutcome::Rejected(r) => r.message,
                other => format!("start was not applied: {other:?}"),
            })));
        };
        let state = runs
            .get(&start.run_id)
            .and_then(|l| l.state.as_ref())
            .expect("an applied start leaves a run");
        let decision = routing::RoutingDecision {
            run_id: state.run_id.clone(),
            tenant: state.tenant.clone(),
            pool: state.pool.clone(),
            workflow: state.workflow.clone(),
            workflow_version: state.workflow_version,
            idempotency_key: request.key.clone(),
            decided_at: now,
        };
        let accepted = accepted(&decision, start.correlation_id.as_deref());
        let row = self.intent_row(state, seq, effects, accepted, now)?;
        writes.intents.push(row);
        if let Some(key) = &request.key
            && !routing::complete_in_tx(tx, &decision, key, self.completed_ttl).await?
        {
            writes.routing_lost = true;
        }
        Ok(Some(RouteOutcome::Decided { decision, kind }))
    }
}

/// The `run.accepted` event that tells a routed start's caller its
/// decision: the last effect of the run's first transition.
fn accepted(decision: &routing::RoutingDecision, correlation_id: Option<&str>) -> Effect {
    let accepted = RunAccepted {
        schema_version: SCHEMA_VERSION,
        run_id: &decision.run_id,
        tenant: &decision.tenant,
        pool: &decision.pool,
        workflow: &decision.workflow,
        workflow_version: decision.workflow_version,
        idempotency_key: decision.idempotency_key.as_deref(),
        correlation_id,
    };
    Effect::now(EffectTarget::Events, EffectKind::RunAccepted, &accepted)
}
