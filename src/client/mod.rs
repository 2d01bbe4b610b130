//! The libraries Ductor's users link: [`worker`] runs step handlers against
//! the dispatch topic and answers on the attempt-results topic; [`dedup`]
//! makes a consumer of any published effect effectively-once by honouring
//! its `idempotency-key` header in the consumer's own transaction.

pub mod dedup;
pub mod worker;
