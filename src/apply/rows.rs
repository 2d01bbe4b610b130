//! The rows of one attempt at a batch, in memory between the fold and the
//! batch statement.
//!
//! In: each run the batch touches as loaded ([`Loaded`]), and the fold's
//! transitions. Out: [`Writes`], everything the attempt will write: the
//! transitions, the attempts inserted and finished, and the effect intents
//! ([`IntentRow`]), which `plan` lays out as the statement's columns.
//! Guarantees: an attempt inserted and finished in the same batch is one
//! row, written once, already finished; an intent's topic, key, headers
//! and payload are fixed here, before the commit, and published as they
//! are.

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use crate::contract::Source;
use crate::coordinator::{AttemptRecord, AttemptStatus, AttemptWrite, Purged, RunState};

/// A run as loaded: its state and the record_version the UPDATE must match.
#[derive(Debug)]
pub(super) struct Loaded {
    pub(super) state: Option<RunState>,
    pub(super) loaded_version: Option<i64>,
    pub(super) changed: bool,
    /// The state was not read from the database: it came from the cache,
    /// or the run was taken to be new (see [`super::load::load_runs`]).
    pub(super) cached: bool,
    /// The run finished and retention deleted it: its tombstone.
    pub(super) purged: Option<Purged>,
}

/// Everything one attempt at committing a batch will write.
#[derive(Debug, Default)]
pub(super) struct Writes {
    pub(super) transitions: Vec<TransitionRow>,
    pub(super) attempt_inserts: Vec<(String, AttemptRecord)>,
    pub(super) attempt_finishes: Vec<AttemptFinish>,
    pub(super) intents: Vec<IntentRow>,
    /// A routing row could not be completed: another caller took the key.
    pub(super) routing_lost: bool,
    /// Who writes the batch, recorded in each transition ([`super::Writer`]).
    pub(super) writer: String,
}

impl Writes {
    /// Adds one attempt write of the fold. An attempt inserted earlier in
    /// this batch is finished in memory, so each row is written once.
    pub(super) fn attempt(&mut self, run_id: &str, write: AttemptWrite) {
        match write {
            AttemptWrite::Insert(attempt) => {
                self.attempt_inserts.push((run_id.to_owned(), attempt))
            }
            AttemptWrite::Finish {
                stamp,
                status,
                finished_at,
                error,
            } => {
                if let Some(row) = self
                    .attempt_inserts
                    .iter_mut()
                    .map(|(_, a)| a)
                    .find(|a| a.stamp == stamp)
                {
                    row.status = status;
                    row.finished_at = Some(finished_at);
                    row.error = error;
                } else {
                    self.attempt_finishes.push(AttemptFinish {
                        stamp,
                        status,
                        finished_at,
                        error,
                    });
                }
            }
        }
    }
}

/// An attempt the batch finishes, updated only while still `dispatched`.
#[derive(Debug)]
pub(super) struct AttemptFinish {
    pub(super) stamp: Uuid,
    pub(super) status: AttemptStatus,
    pub(super) finished_at: DateTime<Utc>,
    pub(super) error: Option<String>,
}

#[derive(Debug)]
pub(super) struct TransitionRow {
    pub(super) run_id: String,
    pub(super) seq: i64,
    pub(super) input_ref: String,
    pub(super) kind: &'static str,
    pub(super) from_status: Option<&'static str>,
    pub(super) to_status: &'static str,
    pub(super) step_index: i32,
    pub(super) detail: String,
    pub(super) source: Option<Source>,
    pub(super) at: DateTime<Utc>,
}

/// An effect intent as it will be published: topic, key, headers and payload
/// bytes are all fixed here, at commit.
#[derive(Debug)]
pub(super) struct IntentRow {
    pub(super) run_id: String,
    pub(super) seq: i64,
    pub(super) effect_index: i32,
    pub(super) idempotency_key: String,
    pub(super) tenant: String,
    pub(super) topic: String,
    pub(super) message_key: Vec<u8>,
    pub(super) headers: serde_json::Map<String, Value>,
    pub(super) payload: Vec<u8>,
    pub(super) ce_type: String,
    pub(super) not_before: DateTime<Utc>,
    /// Set on a step's timeout timer (`timeout:<stamp>`), so the transition
    /// that finishes the attempt can delete it while it is still pending.
    pub(super) cancel_key: Option<String>,
    /// Due at once (no `not_before` of its own): the fast lane may take it.
    pub(super) due: bool,
}
