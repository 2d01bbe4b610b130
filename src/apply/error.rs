//! What can go wrong when a batch is applied, and which of it is the
//! batch's own fault.
//!
//! In: the errors of loading, folding, encoding and writing a batch. Out:
//! an [`ApplyError`] callers branch on (retry, wait for a routing key,
//! give up after conflicts) and, through [`ApplyError::permanent`], the
//! [`ApplyFailure`] the dead-letter topic and the HTTP API report.
//! Guarantees: only a failure the same inputs would meet again is
//! permanent; everything transient, and everything that is no one input's
//! fault, is not, so good inputs are never dead-lettered for it. A
//! failure's class is stable and its message bounded
//! ([`MAX_FAILURE_MESSAGE_LEN`] characters).

use crate::coordinator::StateDecodeError;

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("the commit's reply was lost (injected fault)")]
    CommitReplyLost,
    /// The routed request at this index of the batch's.
    #[error(
        "an idempotency key of the batch (routed request {0}) is held by a caller still deciding"
    )]
    RoutingInProgress(usize),
    #[error("batch still conflicting after {0} recomputations")]
    ConflictsExhausted(u32),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("encoding state: {0}")]
    Encode(#[from] serde_json::Error),
    /// A run's stored state that gives no state of this binary's version.
    #[error("loading a stored state: {0}")]
    StoredState(#[from] crate::coordinator::StateDecodeError),
}

/// A failure that retrying cannot mend: what the database refused in the
/// inputs themselves. `class` is stable (the dead-letter class and the HTTP
/// error code); `message` names the SQLSTATE and never echoes the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyFailure {
    pub class: &'static str,
    pub message: String,
}

impl ApplyFailure {
    /// A data exception (SQLSTATE class 22, such as U+0000 in `jsonb`).
    pub const DATA_EXCEPTION: &str = "data_exception";
    /// An integrity violation (class 23) other than an expected lost race.
    pub const INTEGRITY_CONSTRAINT_VIOLATION: &str = "integrity_constraint_violation";
    /// A program limit (class 54).
    pub const PROGRAM_LIMIT_EXCEEDED: &str = "program_limit_exceeded";
    /// A stored row that does not decode.
    pub const UNDECODABLE_STATE: &str = "undecodable_state";
    /// A stored state of a newer version than this binary reads: a newer
    /// binary wrote it, and this one leaves the run alone rather than
    /// write it back in an older shape.
    pub const NEWER_STATE_VERSION: &str = "newer_state_version";
    /// A state that does not encode.
    pub const UNENCODABLE_STATE: &str = "unencodable_state";
    /// Every class [`ApplyError::permanent`] gives, for the HTTP API's
    /// description.
    pub const CLASSES: [&str; 6] = [
        Self::DATA_EXCEPTION,
        Self::INTEGRITY_CONSTRAINT_VIOLATION,
        Self::PROGRAM_LIMIT_EXCEEDED,
        Self::UNDECODABLE_STATE,
        Self::NEWER_STATE_VERSION,
        Self::UNENCODABLE_STATE,
    ];
    /// An input that failed alone, again and again, while the database
    /// answered (the apply path's isolation, not [`ApplyError::permanent`]).
    pub const TRANSIENT_EXHAUSTED: &str = "transient_exhausted";
    /// Every class an isolated input may have: [`Self::CLASSES`] and
    /// [`Self::TRANSIENT_EXHAUSTED`]. The isolation and dead-letter
    /// counters start each at zero.
    pub const ISOLATED_CLASSES: [&str; 7] = [
        Self::DATA_EXCEPTION,
        Self::INTEGRITY_CONSTRAINT_VIOLATION,
        Self::PROGRAM_LIMIT_EXCEEDED,
        Self::UNDECODABLE_STATE,
        Self::NEWER_STATE_VERSION,
        Self::UNENCODABLE_STATE,
        Self::TRANSIENT_EXHAUSTED,
    ];
}

/// Longest [`ApplyFailure::message`], in characters.
pub(super) const MAX_FAILURE_MESSAGE_LEN: usize = 512;

impl ApplyError {
    /// `Some` when the batch's own contents are what failed, so that the
    /// same inputs fail again however often they are retried: a data
    /// exception (SQLSTATE class 22, such as U+0000 in `jsonb`), an
    /// integrity violation (class 23) other than the lost races the apply
    /// path expects, a program limit (class 54), a stored state that does
    /// not decode or is of a newer version than this binary reads, or a
    /// state that does not encode. `None` for everything
    /// transient: connections, timeouts and cancels, serialization
    /// failures, deadlocks, lock waits, shutdowns, lost races, and any error
    /// that is no one input's fault (privileges, a missing table), which
    /// must not send good inputs to the dead-letter topic.
    pub fn permanent(&self) -> Option<ApplyFailure> {
        let failure = |class, message: String| {
            Some(ApplyFailure {
                class,
                message: crate::contract::input::truncate(message, MAX_FAILURE_MESSAGE_LEN),
            })
        };
        match self {
            ApplyError::Database(sqlx::Error::Database(db)) => {
                let code = db.code().unwrap_or_default().into_owned();
                let class = match code.get(..2) {
                    Some("22") => ApplyFailure::DATA_EXCEPTION,
                    Some("23") => ApplyFailure::INTEGRITY_CONSTRAINT_VIOLATION,
                    Some("54") => ApplyFailure::PROGRAM_LIMIT_EXCEEDED,
                    _ => return None,
                };
                failure(class, format!("postgres {code}: {}", db.message()))
            }
            ApplyError::Database(sqlx::Error::ColumnDecode { index, .. }) => failure(
                ApplyFailure::UNDECODABLE_STATE,
                format!("a stored row does not decode (column {index})"),
            ),
            ApplyError::Database(sqlx::Error::Decode(e)) => failure(
                ApplyFailure::UNDECODABLE_STATE,
                format!("a stored row does not decode: {e}"),
            ),
            ApplyError::Encode(e) => {
                failure(ApplyFailure::UNENCODABLE_STATE, format!("encoding: {e}"))
            }
            ApplyError::StoredState(e @ StateDecodeError::Newer { .. }) => {
                failure(ApplyFailure::NEWER_STATE_VERSION, e.to_string())
            }
            ApplyError::StoredState(e @ StateDecodeError::Malformed(_)) => {
                failure(ApplyFailure::UNDECODABLE_STATE, e.to_string())
            }
            _ => None,
        }
    }
}
