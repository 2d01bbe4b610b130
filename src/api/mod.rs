//! The public HTTP API: the routing plane's door for callers who want a
//! synchronous answer, and the run endpoints beside it. Every request
//! carries `Authorization: Bearer <key>` (see [`crate::auth`]) and acts as
//! its key's tenant:
//!
//! - `POST /v1/runs` with an optional `Idempotency-Key` header starts a run
//!   ([`start`]): 201 with the decision when it is new, 200 with the same
//!   body for a duplicate, 409 while the first caller is still deciding
//!   under the `reject` policy (or when a `wait` ran out), 422 when the key
//!   was used for a different request or the workflow is unknown;
//! - `GET /v1/runs/{id}` returns the run ([`runs`]);
//! - `GET /v1/runs`, `GET /v1/runs/counts` and `GET /v1/runs/{id}/history`
//!   list, count and trace runs for an operator ([`operator`]): a key with
//!   `runs:read` sees its tenant's runs, one with `admin` every tenant's;
//! - `POST /v1/runs/{id}/signals` and `POST /v1/runs/{id}/cancel` put a
//!   signal or a cancel for the run on the wakeups topic ([`runs`]);
//! - `GET /v1/openapi.json`, without a key, describes all of it
//!   ([`openapi`]), from the one table of routes ([`routes`]).
//!
//! The admin listener serves the operator's views, the cancel, the dead
//! letters, the outbox and retention again, at the same paths, to a key
//! with the `admin` scope alone, the description, and the web console at
//! `/ui` ([`console`]), whose pages call those routes ([`admin_router`]).
//!
//! Errors are JSON, `{"error": {"code": "...", "message": "..."}}`, with a
//! stable `code` ([`error`]): 401 `unauthenticated` for a missing, unknown,
//! expired or revoked key (which one is not said), 403 `insufficient_scope`
//! and `tenant_mismatch`.
//!
//! In: HTTP requests from the public listener ([`crate::infra::http_server`]).
//! Out: decisions through [`crate::routing`] and the [`Decide`] the apply
//! stage provides; signals and cancels on Kafka. Guarantees: a request is
//! bounded in concurrency and time before it reaches a handler ([`guard`]),
//! in size and read time before its body is parsed (`request`), and its
//! tenant is its key's, never one it names.

pub mod actions;
pub mod console;
pub mod error;
pub mod guard;
pub mod openapi;
pub mod operator;
mod request;
pub mod routes;
pub mod runs;
pub mod start;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;

use crate::auth::Authenticator;
use crate::auth::rate::RateLimiter;
use crate::config::{RoutingConfig, SignaturesConfig};
use crate::contract::InputLimits;
use crate::routing::Decide;

/// What every handler shares.
#[derive(Clone)]
pub struct ApiState {
    /// Decides the runs, in the database the keys are reserved in.
    pub decider: Arc<dyn Decide>,
    pub routing: RoutingConfig,
    /// The bounds a body keeps, as every input does on Kafka.
    pub limits: InputLimits,
    /// Pokes the in-process drainer after a decision committed effects.
    pub wakeup: Option<crate::outbox::Wakeup>,
    /// Who the requests come from.
    pub auth: Authenticator,
    /// Where signals and cancels go.
    pub inputs: InputSink,
    /// Each key's request rate.
    pub rates: Arc<RateLimiter>,
    /// Bound on reading a body once the headers are in.
    pub body_read_timeout: Duration,
    /// Concurrency and time bounds of every request.
    pub guard: guard::Guard,
    /// The bounds of the operator's views.
    pub operator: operator::OperatorLimits,
    /// The recorded dead letters' operations (`None` where no serve runs
    /// them).
    pub dead_letters: Option<crate::ingress::dead_letters::DeadLetters>,
}

impl ApiState {
    /// The dead letters' operations, or 503 where this process has none.
    pub(crate) fn letters(
        &self,
    ) -> Result<&crate::ingress::dead_letters::DeadLetters, error::ApiError> {
        self.dead_letters.as_ref().ok_or_else(|| {
            error::ApiError::new(error::Code::Unavailable, "dead letters are not served here")
        })
    }
}

/// Where the API puts the inputs it accepts for the coordinator.
#[derive(Clone)]
pub struct InputSink {
    /// Made at the first input (see [`crate::infra::kafka::LazyProducer`]).
    pub producer: crate::infra::kafka::LazyProducer,
    /// The wakeups topic.
    pub topic: String,
    /// Bound on the broker's acknowledgement.
    pub timeout: Duration,
    /// The tenants' signing keys: an input of a tenant with one is signed,
    /// as the ingress may require.
    pub signatures: SignaturesConfig,
}

/// The API's routes: the run endpoints, each behind the guard, and the
/// description, which costs nothing to answer and so is not.
pub fn router(state: ApiState) -> Router {
    use routes::{Endpoint, add};
    let guard = state.guard.clone();
    let runs = add(Router::new(), Endpoint::CreateRun, start::create_run);
    let runs = add(runs, Endpoint::GetRun, runs::get_run);
    let runs = add(runs, Endpoint::SignalRun, runs::signal_run);
    let runs = add(runs, Endpoint::ListRuns, operator::list_runs);
    let runs = add(runs, Endpoint::CountRuns, operator::count_runs);
    let runs = add(runs, Endpoint::RunHistory, operator::run_history);
    let runs = add(runs, Endpoint::OutboxStatus, operator::outbox_status);
    let runs = add(runs, Endpoint::RedriveOutbox, operator::redrive);
    let runs = add(runs, Endpoint::RetentionStatus, operator::retention_status);
    let runs = add(runs, Endpoint::ListLetters, operator::letters::list);
    let runs = add(runs, Endpoint::CountLetters, operator::letters::counts);
    let runs = add(runs, Endpoint::GetLetter, operator::letters::show);
    let runs = add(runs, Endpoint::ReplayLetter, operator::letters::replay);
    let runs = add(
        runs,
        Endpoint::ReplayLetters,
        operator::letters::replay_matching,
    );
    let runs = add(runs, Endpoint::DiscardLetter, operator::letters::discard);
    let runs = add(runs, Endpoint::RetryRun, actions::retry_run);
    let runs = add(runs, Endpoint::CancelRun, actions::cancel_run)
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(guard, guard::guard));
    add(Router::new(), Endpoint::OpenApi, openapi::serve).merge(runs)
}

/// The admin listener's share of the API: the operator's views, the
/// cancel, the dead letters, the outbox and retention, each of which takes
/// a key with the `admin` scope, behind the
/// same guard as the public routes; the description; and the console,
/// whose pages and scripts carry no data and so take no key.
pub fn admin_router(state: ApiState) -> Router {
    use routes::{Endpoint, add};
    let guard = state.guard.clone();
    let ops = add(
        Router::new(),
        Endpoint::AdminListRuns,
        operator::admin_list_runs,
    );
    let ops = add(ops, Endpoint::AdminCountRuns, operator::admin_count_runs);
    let ops = add(ops, Endpoint::AdminRunHistory, operator::admin_run_history);
    let ops = add(ops, Endpoint::AdminRetryRun, actions::admin_retry_run);
    let ops = add(ops, Endpoint::AdminCancelRun, actions::admin_cancel_run);
    let ops = add(
        ops,
        Endpoint::AdminListLetters,
        operator::letters::admin_list,
    );
    let ops = add(
        ops,
        Endpoint::AdminCountLetters,
        operator::letters::admin_counts,
    );
    let ops = add(ops, Endpoint::AdminGetLetter, operator::letters::admin_show);
    let ops = add(
        ops,
        Endpoint::AdminReplayLetter,
        operator::letters::admin_replay,
    );
    let ops = add(
        ops,
        Endpoint::AdminReplayLetters,
        operator::letters::admin_replay_matching,
    );
    let ops = add(
        ops,
        Endpoint::AdminDiscardLetter,
        operator::letters::admin_discard,
    );
    // The outbox's and retention's routes take the `admin` scope on
    // either listener: one handler serves both.
    let ops = add(ops, Endpoint::AdminOutboxStatus, operator::outbox_status);
    let ops = add(ops, Endpoint::AdminRedriveOutbox, operator::redrive);
    let ops = add(
        ops,
        Endpoint::AdminRetentionStatus,
        operator::retention_status,
    )
    .with_state(state)
    .layer(axum::middleware::from_fn_with_state(guard, guard::guard));
    let open = add(Router::new(), Endpoint::AdminOpenApi, openapi::serve);
    console::router().merge(open).merge(ops)
}
