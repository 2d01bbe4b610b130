//! The harness surface: what the project's own harnesses (`ductor-bench`,
//! `ductor-chaos`) take from inside the stages, named once, here.
//!
//! In: nothing of its own. Out: the names a harness may use besides each
//! stage's front door (`ductor::coordinator::fold`, `ductor::ingress::step`
//! and the like). Guarantees: a stage may move a file or rename one; it
//! then changes this file, not two other crates. Built only with the
//! `internals` feature, and not a stable interface.

/// One batch's rows, bound as the batch statement binds them: the bench
/// measures their footprint.
pub use crate::apply::batch::BatchWrite;
/// One round of run retention: the chaos afterlife purges every run.
pub use crate::apply::retention::purge as purge_finished_runs;
/// A key's row as `ductor keys create` stores it.
pub use crate::auth::store::KeyRequest;
/// A message's fate at the ingress, pure: what the checker replays and what
/// the hostile inputs must be refused by.
pub use crate::ingress::classify::{Classified, classify};
/// The statement that completes a published intent.
pub use crate::outbox::COMPLETE_SQL;
