//! The `[coordinator]` section: the workflows, and how the ingress turns
//! inputs into batches and applies them.
//!
//! In: the workflows' directory, the bounds of a batch and of one input
//! (its bytes and its JSON's shape), the apply lanes and their retries, the
//! bound on a run's state, the run cache. Out: a [`CoordinatorConfig`] the
//! ingress and the apply lanes are built from. Guarantees: every bound here
//! is at least 1 (and the lanes, batches and JSON depth below their
//! ceilings), retries back off from a shortest pause to a longer one. What
//! must fit Kafka's or Postgres's bounds (an input in a dispatch, a run's
//! state, a lane's connection) spans sections and is checked in
//! `config/mod.rs`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// Directory of workflow definitions (`*.toml`, one workflow each).
    /// A run keeps the version it started with, so a version must stay
    /// here while running runs need it: `serve` refuses to start when one
    /// is missing, naming it with its runs (see
    /// `fail_runs_of_missing_workflows`).
    pub workflows_dir: PathBuf,
    /// Have `serve`, as it starts and before it consumes anything, fail
    /// every running run whose workflow version `workflows_dir` no longer
    /// defines, instead of refusing to start. Each such run goes to
    /// `failed` with the error `workflow_missing: workflow "<name>" version
    /// <n> is no longer defined`, by a `run.failed` transition (input
    /// `maintenance:missing_workflow`) and its `run.event`, like any other
    /// failure; its outstanding attempt is cancelled, a pending retry
    /// dropped and a wait ended. Off by default: retiring a version with
    /// its runs is decided by an operator, once; a value that is not a
    /// boolean is refused.
    pub fail_runs_of_missing_workflows: bool,
    /// Most inputs applied in one Postgres transaction. Only a backlog fills
    /// a batch (under open-loop load at 90% of capacity batches averaged 89
    /// inputs), so the bound trades the cost a batch statement has whatever
    /// its size against how long one batch holds its lane. Measured with
    /// `ductor-bench --runs 8000` on two cores: 512 took a backlog at 6226 and
    /// 7023 inputs/s where 256 took it at 4186 and 5694; p99 at 50% load was
    /// 117 and 84 ms against 98 and 100 (at the higher rates that 50% of the
    /// higher capacities makes).
    pub batch_max_inputs: usize,
    /// How long an idle apply lane waits for more inputs after its first
    /// one. Inputs that queued while the lane was applying form the next
    /// batch at once, without this wait. (With `apply_lanes = 1` the single
    /// ingress loop always waits this long to fill a batch.)
    pub batch_linger_ms: u64,
    /// Batches applied at once, each on its own connection: input partition
    /// `p` goes to lane `p % apply_lanes`, so one partition stays in order
    /// while one lane's commit overlaps another's work.
    pub apply_lanes: usize,
    /// With several lanes, a batch smaller than this waits for its turn:
    /// the lanes apply one at a time, and what arrives meanwhile joins the
    /// waiting batch, so the traffic is not split into many small
    /// transactions that each pay a statement, a WAL flush and their round
    /// trips. A batch this large (a backlog) applies at once, alongside the
    /// others. The default, 1, lets every batch apply at once: taking turns
    /// saves CPU per input, but once the one turn is busy most of the time
    /// every input waits a whole batch for it. On two cores at half of the
    /// capacity, turns (64) used about 15 % less CPU per input and raised
    /// the p99 latency by about half.
    pub concurrent_batch_min_inputs: usize,
    /// Inputs larger than this go to the dead-letter topic (class
    /// `too_large`); so do HTTP bodies over `routing.max_body_bytes`. With
    /// [`EFFECT_ENVELOPE_BYTES`](super::EFFECT_ENVELOPE_BYTES) for the
    /// effect that carries it, it must fit `kafka.message_max_bytes`, or the
    /// configuration is refused.
    pub max_input_bytes: usize,
    /// Largest a run's state may get, in bytes of its JSON encoding. Every
    /// input of a run loads its state and writes it back whole, so this
    /// bounds what each costs in memory and in the row. The state keeps the
    /// newest step's output only, and signals without their payloads (the
    /// history keeps those); what still grows is the attempt and signal
    /// records. A transition that would leave a state larger than this
    /// fails the run instead, for good, with class `state_too_large`. It
    /// must hold the largest input and one output (each
    /// `kafka.message_max_bytes` less
    /// [`EFFECT_ENVELOPE_BYTES`](super::EFFECT_ENVELOPE_BYTES) once written
    /// back) plus [`STATE_ENVELOPE_BYTES`](super::STATE_ENVELOPE_BYTES), or
    /// the configuration is refused.
    pub max_state_bytes: usize,
    /// Deepest nesting of arrays and objects in an input or an HTTP body
    /// (the top level is 1); deeper ones are refused as `too_deep`. At
    /// most 128, the JSON parser's own bound.
    pub max_json_depth: usize,
    /// Longest string (or object key) in an input, in bytes once escapes
    /// are decoded; longer ones are refused as `string_too_long`.
    pub max_string_bytes: usize,
    /// Most elements of one array in an input; more are refused as
    /// `array_too_long`.
    pub max_array_items: usize,
    /// Most members of one object in an input; more are refused as
    /// `object_too_wide`.
    pub max_object_keys: usize,
    /// First pause before a batch that failed transiently (the database
    /// unreachable, a timeout, a serialization failure) is applied again;
    /// each further failure doubles it, up to `apply_retry_max_ms`. A batch
    /// that fails permanently is not retried but bisected: the inputs that
    /// fail alone go to the dead-letter topic (stage `apply`).
    pub apply_retry_min_ms: u64,
    /// Longest pause between two tries of a transiently failing batch.
    pub apply_retry_max_ms: u64,
    /// Transient failures that a batch's own inputs may cause (a statement
    /// cut off by `database.statement_timeout_ms` or a lock wait, a
    /// serialization failure or deadlock, races lost past
    /// `conflict_retries`, an idempotency key another caller holds) after
    /// which the batch is bisected like one that fails permanently, so
    /// that one such input cannot hold its lane. Each half gets one try
    /// before it is split again; an input that fails this many times
    /// alone, while the database answers a trivial query, goes to the
    /// dead-letter topic with class `transient_exhausted`, unless it waits
    /// on another caller's idempotency key (that caller or the sweep
    /// releases it). A database that does not answer is retried, whole,
    /// for as long as it takes.
    pub apply_bisect_after_failures: u32,
    /// Kafka starts that each apply lane may park beside it because an
    /// HTTP request holds their idempotency key, still deciding: the lane
    /// applies its other inputs meanwhile, and applies the parked starts
    /// again after `apply_retry_min_ms`, doubling up to
    /// `apply_retry_max_ms`, until that request decides or the sweep frees
    /// the key (`routing.pending_ttl_ms`). A later start with the same key
    /// is parked behind them. The partition's stored offset stays at the
    /// oldest parked start, so nothing parked is lost to a crash. Past this
    /// many a start waits in its lane, and the lane behind it; 0 never
    /// parks. Each parked start holds up to `max_input_bytes` of memory.
    pub max_parked_starts: usize,
    /// An apply lane that has held a batch this long without committing it
    /// (the database away, a lock held, a dead letter the broker will not
    /// take) is stalled, with the partitions behind it: `/readyz` answers
    /// 503 (naming it on the admin listener), and
    /// `ductor_ingress_stalled_lanes` counts it.
    pub stall_after_ms: u64,
    /// Times an input on the wrong partition for its run (see
    /// [`crate::contract::partition`]) is forwarded to the right one. Each
    /// forward carries the count (`ductor-forwards`); an input that would
    /// need more (the topic's partitions changing again and again, or
    /// processes that disagree on their count) is dead-lettered as
    /// `misrouted` instead of travelling on. 0 dead-letters every
    /// misrouted input.
    pub max_input_forwards: u32,
    /// How old the ingress's count of an input topic's partitions may be
    /// before it reads it again from the broker; an input that looks
    /// misrouted is judged again with a count read at most a second ago,
    /// so partitions added meanwhile do not send it astray.
    pub partition_count_refresh_ms: u64,
    /// Times a batch is recomputed after losing an optimistic-lock race
    /// before the batch fails (and is retried from Kafka).
    pub conflict_retries: u32,
    /// Run states kept in memory after a commit, so the next batch of a run
    /// skips loading it (the conditional UPDATE still checks its
    /// `record_version`; a stale entry costs one recomputation). With the
    /// cache on, a run that a batch names only in `run.start` inputs, and
    /// that the cache does not hold, is taken to be new without a read; a
    /// redelivered start costs one recomputation. 0 turns the cache, and
    /// that guess, off.
    pub run_cache_size: usize,
    /// Bound on the run cache in bytes of the states' encoding (what a
    /// state holds in memory is about that); when full the cache starts
    /// over, and a state over a tenth of it is not cached. 0 turns the
    /// cache off.
    pub run_cache_max_bytes: usize,
    /// Most bytes of input values in one batch, besides
    /// `batch_max_inputs`: a lane stops gathering a batch once it holds
    /// this much (a single larger input is a batch of its own).
    pub batch_max_bytes: usize,
    /// Bound on error messages written to dead-letter headers.
    pub max_error_message_bytes: usize,
}

impl CoordinatorConfig {
    /// The apply lanes, the bounds of a batch and of one input, the stall
    /// detector and the apply retries.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.validate_batches()?;
        self.validate_inputs()
    }

    /// The apply lanes and the bounds of a batch and of one input.
    fn validate_batches(&self) -> Result<(), ConfigError> {
        if self.apply_lanes == 0 || self.apply_lanes > 64 {
            return Err(invalid(
                "coordinator.apply_lanes",
                "must be between 1 and 64",
            ));
        }
        if self.concurrent_batch_min_inputs == 0 {
            return Err(invalid(
                "coordinator.concurrent_batch_min_inputs",
                "must be at least 1",
            ));
        }
        if self.batch_max_inputs == 0 || self.batch_max_inputs > 10_000 {
            return Err(invalid(
                "coordinator.batch_max_inputs",
                "must be between 1 and 10000",
            ));
        }
        if self.batch_max_bytes == 0 {
            return Err(invalid("coordinator.batch_max_bytes", "must be at least 1"));
        }
        if self.max_input_bytes == 0 {
            return Err(invalid("coordinator.max_input_bytes", "must be at least 1"));
        }
        Ok(())
    }

    /// The stall detector, the apply retries and the shape limits of inputs.
    fn validate_inputs(&self) -> Result<(), ConfigError> {
        if self.partition_count_refresh_ms == 0 {
            return Err(invalid(
                "coordinator.partition_count_refresh_ms",
                "must be at least 1",
            ));
        }
        if self.stall_after_ms == 0 {
            return Err(invalid("coordinator.stall_after_ms", "must be at least 1"));
        }
        if self.apply_bisect_after_failures == 0 {
            return Err(invalid(
                "coordinator.apply_bisect_after_failures",
                "must be at least 1",
            ));
        }
        if self.apply_retry_min_ms == 0 || self.apply_retry_max_ms < self.apply_retry_min_ms {
            return Err(invalid(
                "coordinator.apply_retry_max_ms",
                "apply_retry_min_ms must be at least 1 and apply_retry_max_ms at least apply_retry_min_ms",
            ));
        }
        if self.max_json_depth == 0 || self.max_json_depth > 128 {
            return Err(invalid(
                "coordinator.max_json_depth",
                "must be between 1 and 128 (the JSON parser's own bound)",
            ));
        }
        for (key, value) in [
            ("coordinator.max_string_bytes", self.max_string_bytes),
            ("coordinator.max_array_items", self.max_array_items),
            ("coordinator.max_object_keys", self.max_object_keys),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.max_error_message_bytes < 32 {
            return Err(invalid(
                "coordinator.max_error_message_bytes",
                "must be at least 32",
            ));
        }
        Ok(())
    }
}
