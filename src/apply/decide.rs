//! The apply stage as the routing plane's decider: an HTTP start is a batch
//! of one routed request and no inputs.
//!
//! In: one [`RouteRequest`] from the routing plane. Out: its
//! [`RouteOutcome`], or a [`DecideError`]: `Refused`, with the failure's
//! stable class, when the database refuses the request itself;
//! `Unavailable` for anything transient. Guarantees: an HTTP start is
//! decided by the same path, in the same kind of transaction, as a routed
//! start read from Kafka.

use futures::future::BoxFuture;
use sqlx::PgPool;

use crate::apply::Applier;
use crate::routing::{Decide, DecideError, RouteOutcome, RouteRequest};

impl Decide for Applier {
    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn decide<'a>(
        &'a self,
        request: &'a RouteRequest,
    ) -> BoxFuture<'a, Result<RouteOutcome, DecideError>> {
        Box::pin(async move {
            let report = self
                .apply(&[], std::slice::from_ref(request))
                .await
                .map_err(|e| match e.permanent() {
                    Some(failure) => DecideError::Refused {
                        class: failure.class,
                        message: failure.message,
                    },
                    None => DecideError::Unavailable(e.into()),
                })?;
            report
                .routed
                .into_iter()
                .next()
                .ok_or(DecideError::Unanswered)
        })
    }
}
