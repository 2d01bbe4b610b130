//! What the HTTP side of the routing plane needs from whatever decides a
//! run: one routed request decided in one transaction, and the database its
//! keys are reserved in. The apply stage implements it; routing itself does
//! not know how a start becomes a run.
//!
//! In: one [`RouteRequest`]. Out: its [`RouteOutcome`], or a
//! [`DecideError`]. Guarantees, which the implementer keeps: a key is
//! reserved, fenced and completed in the one database [`Decide::pool`]
//! returns; `Refused` is only for what the same request would meet again
//! (the API answers 422), `Unavailable` for what may pass (503).

use futures::future::BoxFuture;
use sqlx::PgPool;

use crate::routing::{RouteOutcome, RouteRequest};

/// Decides routed start requests. Boxed futures keep it usable as
/// `dyn Decide`, which is what the HTTP state holds.
pub trait Decide: Send + Sync {
    /// The database of the keys' rows. Reservations are taken here, and the
    /// decision is fenced on them here, so both must be the same database.
    fn pool(&self) -> &PgPool;

    /// Decides `request` (reserving its key when it holds none, completing
    /// it when it does) and commits the decision.
    fn decide<'a>(
        &'a self,
        request: &'a RouteRequest,
    ) -> BoxFuture<'a, Result<RouteOutcome, DecideError>>;
}

/// Why a request has no outcome.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The database refuses the request itself: the same request would
    /// fail again. `class` is stable (the HTTP error code); `message` never
    /// echoes the request.
    #[error("{class}: {message}")]
    Refused {
        class: &'static str,
        message: String,
    },
    /// The decision could not be committed, for a reason that may pass
    /// (the database away, a lost race, a key held by another caller).
    #[error(transparent)]
    Unavailable(anyhow::Error),
    /// The decider committed without answering for the request: a broken
    /// promise of the decider, not a fault of the request.
    #[error("the decision came back without an outcome")]
    Unanswered,
}
