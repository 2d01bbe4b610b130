//! Poison isolation: a batch applied whatever it holds.
//!
//! In: a batch of decoded inputs and routed starts, how to retry it
//! ([`RetryPolicy`]), and the idempotency keys its lane's starts wait on
//! ([`Holds`]). Out: an [`IsolatedBatch`], for every input and routed start
//! its outcome, or the failure it has on its own, or (a start only) that it
//! waits on a key another caller holds and was left out.
//!
//! Guarantee: the batch's statements commit in input order, so a partition
//! keeps its order; an input that fails on its own is named and nothing
//! else of the batch is refused for it; a start left out wrote nothing, and
//! so did every later start of the batch with the same key. A transient
//! failure that no input causes is retried for as long as it takes; only
//! shutdown ends that, with nothing of the unapplied rest committed.

use std::borrow::Cow;
use std::collections::{HashSet, VecDeque};
use std::ops::Range;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::error::MAX_FAILURE_MESSAGE_LEN;
use super::{Applier, ApplyError, ApplyFailure, BatchReport, InputOutcome, PendingInput};
use crate::routing::{RouteOutcome, RouteRequest};

/// How transient apply failures are retried: exponential backoff between
/// `min` and `max`, for as long as it takes (the database coming back is
/// the only way on), until shutdown; except that a batch that fails
/// `bisect_after` times in a way its own inputs may cause
/// ([`ApplyError::may_be_the_inputs`]) is bisected, as a permanent failure
/// is, so that one input whose statement always times out cannot hold its
/// lane.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub min: Duration,
    pub max: Duration,
    /// `coordinator.apply_bisect_after_failures`.
    pub bisect_after: u32,
}

impl RetryPolicy {
    /// The suspect failures a half of `len` inputs may have, after a
    /// suspect split: one (its sibling may hold the cause), or
    /// `bisect_after` for a single input, so that its failing is surely
    /// its own.
    fn tries_after_suspect_split(&self, len: usize) -> u32 {
        if len == 1 { self.bisect_after } else { 1 }
    }
}

/// The idempotency keys that starts of a lane wait on, because another
/// caller (an HTTP request still deciding) holds them, and how many more
/// starts may be left out for that. A start with a held key is left out of
/// the batch, and so is every later start with the same key, so that they
/// decide in the order they were read; the rest of the batch goes on.
/// Without room, a start whose key is held is retried in place, as any
/// transient failure is, and its lane waits behind it.
#[derive(Debug, Default)]
pub struct Holds {
    keys: HashSet<HeldKey>,
    room: usize,
}

/// A routing key as the routing plane scopes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct HeldKey {
    tenant: String,
    pool: String,
    key: String,
}

impl HeldKey {
    /// The key `request` reserves; `None` for an unkeyed start, which no
    /// other caller can hold.
    fn of(request: &RouteRequest) -> Option<HeldKey> {
        Some(HeldKey {
            tenant: request.start.tenant.clone(),
            pool: request.start.pool.clone(),
            key: request.key.clone()?,
        })
    }
}

impl Holds {
    /// No start is left out: each waits in place for the key it needs.
    #[cfg(any(test, feature = "internals"))]
    pub fn none() -> Holds {
        Holds::default()
    }

    /// Up to `room` starts may be left out, the keys of `parked` (starts
    /// left out earlier and not in this batch) held already.
    pub fn parking<'a>(room: usize, parked: impl IntoIterator<Item = &'a RouteRequest>) -> Holds {
        Holds {
            keys: parked.into_iter().filter_map(HeldKey::of).collect(),
            room,
        }
    }

    /// How many more starts may be left out.
    #[cfg(test)]
    pub fn room(&self) -> usize {
        self.room
    }

    /// Whether a start that finds its key held may be left out.
    fn has_room(&self) -> bool {
        self.room > 0
    }

    /// Whether `request` is to be left out: there is room for one more,
    /// and its key is held.
    pub fn holds(&self, request: &RouteRequest) -> bool {
        self.has_room() && HeldKey::of(request).is_some_and(|k| self.keys.contains(&k))
    }

    /// Another caller holds the key of `request`.
    fn hold(&mut self, request: &RouteRequest) {
        if let Some(key) = HeldKey::of(request) {
            self.keys.insert(key);
        }
    }
}

/// A batch applied with its poison isolated: one entry per input and per
/// routed request, in order, each its outcome or why it failed on its own;
/// `None` for a routed request left out ([`IsolatedBatch::held`]).
#[derive(Debug, Default)]
pub struct IsolatedBatch {
    pub outcomes: Vec<Option<Result<InputOutcome, ApplyFailure>>>,
    pub routed: Vec<Option<Result<RouteOutcome, ApplyFailure>>>,
    /// Routed requests left out because another caller holds their key
    /// (or a start left out before them has it), ascending: nothing of
    /// them is written.
    pub held: Vec<usize>,
    /// Recomputations after lost races, over every statement.
    pub conflicts: u32,
    pub intents_written: usize,
    /// Statements the batch took (1 without poison).
    pub statements: u32,
}

/// One statement's share of a batch, out of the index space where the
/// routed requests come first: its routed requests (only routed requests
/// are ever left out, so they may not follow each other) and its inputs
/// (always a range).
struct Share<'b> {
    routed_at: Vec<usize>,
    routed: Cow<'b, [RouteRequest]>,
    inputs_at: Range<usize>,
    inputs: &'b [PendingInput],
}

impl<'b> Share<'b> {
    /// The share of `part` (ascending indices) of a batch.
    fn of(part: &[usize], inputs: &'b [PendingInput], routed: &'b [RouteRequest]) -> Share<'b> {
        let r = routed.len();
        let split = part.partition_point(|&i| i < r);
        let routed_at = part[..split].to_vec();
        let inputs_at = match part[split..] {
            [] => 0..0,
            [first, ..] => first - r..part[part.len() - 1] - r + 1,
        };
        debug_assert_eq!(inputs_at.len(), part.len() - split, "inputs are a range");
        let routed = match routed_at[..] {
            [] => Cow::Borrowed(&routed[..0]),
            [first, .., last] if last - first + 1 == routed_at.len() => {
                Cow::Borrowed(&routed[first..=last])
            }
            [only] => Cow::Borrowed(&routed[only..=only]),
            _ => Cow::Owned(routed_at.iter().map(|&i| routed[i].clone()).collect()),
        };
        Share {
            routed_at,
            routed,
            inputs: &inputs[inputs_at.clone()],
            inputs_at,
        }
    }
}

/// The two halves of `part`, first and second.
fn halves(mut part: Vec<usize>) -> [Vec<usize>; 2] {
    let second = part.split_off(part.len() / 2);
    [part, second]
}

impl IsolatedBatch {
    /// Nothing applied yet of `routed` requests and `inputs` inputs.
    fn sized(routed: usize, inputs: usize) -> Self {
        IsolatedBatch {
            outcomes: vec![None; inputs],
            routed: vec![None; routed],
            ..IsolatedBatch::default()
        }
    }

    /// Records what one statement applied: its share's routed requests and
    /// inputs.
    fn applied(&mut self, share: &Share<'_>, report: BatchReport) {
        self.conflicts += report.conflicts;
        self.intents_written += report.intents_written;
        for (&at, outcome) in share.routed_at.iter().zip(report.routed) {
            self.routed[at] = Some(Ok(outcome));
        }
        let inputs = &mut self.outcomes[share.inputs_at.clone()];
        for (slot, outcome) in inputs.iter_mut().zip(report.outcomes) {
            *slot = Some(Ok(outcome));
        }
    }

    /// Records the failure of the one input at `index` of the index space
    /// where the `routed` requests come first.
    fn isolate(&mut self, index: usize, routed: usize, failure: ApplyFailure) {
        debug_assert!(ApplyFailure::ISOLATED_CLASSES.contains(&failure.class));
        metrics::counter!("ductor_apply_isolated_total", "class" => failure.class).increment(1);
        if index < routed {
            self.routed[index] = Some(Err(failure));
        } else {
            self.outcomes[index - routed] = Some(Err(failure));
        }
    }

    /// `part` without its routed requests that `holds` leaves out, which
    /// are recorded as held.
    fn hold_back(
        &mut self,
        mut part: Vec<usize>,
        routed: &[RouteRequest],
        holds: &mut Holds,
    ) -> Vec<usize> {
        part.retain(|&i| {
            let held = i < routed.len() && holds.holds(&routed[i]);
            if held {
                holds.room -= 1;
                self.held.push(i);
            }
            !held
        });
        part
    }
}

/// How [`Applier::apply_retrying`] gave up.
enum Failed {
    Permanent(ApplyFailure),
    /// Transient failures that its inputs may cause, as many as it was
    /// allowed: the last of them.
    Suspect(ApplyError),
    /// The routed request at this index waits on a key another caller
    /// holds, and may be left out.
    Held(usize),
    Stopped(ApplyError),
}

impl ApplyError {
    /// Whether this transient failure may be one input's doing, so that
    /// it repeats for as long as that input is in the batch: a statement
    /// cut off by `statement_timeout` or a lock wait (a huge state, a row
    /// locked elsewhere), a serialization failure or deadlock, races lost
    /// past `coordinator.conflict_retries`, or an idempotency key held by
    /// another caller. Not a connection lost or a right missing, which no
    /// input causes and which bisecting would only multiply.
    pub fn may_be_the_inputs(&self) -> bool {
        match self {
            ApplyError::ConflictsExhausted(_) | ApplyError::RoutingInProgress(_) => true,
            ApplyError::Database(sqlx::Error::Database(db)) => matches!(
                db.code().as_deref(),
                Some("57014" | "55P03" | "40001" | "40P01")
            ),
            _ => false,
        }
    }
}

/// Whether a transient failure that repeats for one input alone is that
/// input's own: not when it waits on another caller's idempotency key,
/// which that caller (or the sweep, after `routing.pending_ttl_ms`)
/// releases.
fn isolatable(error: &ApplyError) -> bool {
    !matches!(error, ApplyError::RoutingInProgress(_))
}

impl Applier {
    /// Applies a batch whatever it holds. Transient failures are retried
    /// under `retry`; a permanent one ([`ApplyError::permanent`]) is
    /// bisected: the first half is applied before the second, each on its
    /// own, until the inputs that fail alone are found. Those are reported
    /// as failed and everything else is committed, in order, so a partition
    /// keeps its order and no good input is refused. A routed start whose
    /// key another caller holds is left out while `holds` has room, with
    /// every later start of the same key, and the rest applied without
    /// them. Returns `Err` only on shutdown, with nothing of the unapplied
    /// rest committed.
    pub async fn apply_isolating(
        &self,
        inputs: &[PendingInput],
        routed: &[RouteRequest],
        retry: RetryPolicy,
        holds: &mut Holds,
        shutdown: &CancellationToken,
    ) -> Result<IsolatedBatch, ApplyError> {
        let r = routed.len();
        let mut done = IsolatedBatch::sized(r, inputs.len());
        // Parts of one index space: routed requests first, then inputs, the
        // order one apply takes them in; each with the suspect failures it
        // may have before it is split.
        let mut work = VecDeque::new();
        work.push_back((
            (0..r + inputs.len()).collect::<Vec<_>>(),
            retry.bisect_after,
        ));
        while let Some((part, tries)) = work.pop_front() {
            let part = done.hold_back(part, routed, holds);
            if part.is_empty() {
                continue;
            }
            let share = Share::of(&part, inputs, routed);
            done.statements += 1;
            let applied = self
                .apply_retrying(share.inputs, &share.routed, retry, tries, holds, shutdown)
                .await;
            match applied {
                Ok(report) => done.applied(&share, report),
                Err(Failed::Held(at)) => {
                    metrics::counter!("ductor_apply_held_starts_total").increment(1);
                    holds.hold(&share.routed[at]);
                    work.push_front((part, tries));
                }
                Err(Failed::Permanent(failure)) if part.len() == 1 => {
                    tracing::warn!(
                        class = failure.class,
                        error = %failure.message,
                        "an input fails on its own, isolated"
                    );
                    done.isolate(part[0], r, failure);
                }
                Err(Failed::Permanent(failure)) => {
                    tracing::info!(
                        inputs = part.len(),
                        class = failure.class,
                        "a batch fails permanently, bisecting"
                    );
                    for half in halves(part).into_iter().rev() {
                        work.push_front((half, retry.bisect_after));
                    }
                }
                Err(Failed::Suspect(error)) if part.len() > 1 => {
                    tracing::info!(
                        inputs = part.len(),
                        error = %error,
                        "a batch keeps failing in a way one of its inputs may cause, bisecting"
                    );
                    metrics::counter!("ductor_apply_suspect_bisections_total").increment(1);
                    for half in halves(part).into_iter().rev() {
                        let tries = retry.tries_after_suspect_split(half.len());
                        work.push_front((half, tries));
                    }
                }
                Err(Failed::Suspect(error)) => match self.isolate_alone(&error).await {
                    Some(failure) => {
                        tracing::warn!(
                            error = %error,
                            "an input keeps failing on its own while the database answers, isolated"
                        );
                        done.isolate(part[0], r, failure);
                    }
                    None => work.push_front((part, retry.bisect_after)),
                },
                Err(Failed::Stopped(e)) => return Err(e),
            }
        }
        Ok(done)
    }

    /// The failure of one input that failed `bisect_after` times alone
    /// with `error`, when it is surely its own: the database answers a
    /// trivial query within the statement timeout meanwhile, and the input
    /// waits on no other caller. `None`: keep retrying it.
    async fn isolate_alone(&self, error: &ApplyError) -> Option<ApplyFailure> {
        if !isolatable(error) {
            return None;
        }
        let answered = sqlx::query("SELECT 1").execute(&self.pool).await.is_ok();
        let cause = match error {
            ApplyError::Database(sqlx::Error::Database(db)) => format!(
                "postgres {}: {}",
                db.code().unwrap_or_default(),
                db.message()
            ),
            other => other.to_string(),
        };
        answered.then(|| ApplyFailure {
            class: ApplyFailure::TRANSIENT_EXHAUSTED,
            message: crate::contract::input::truncate(
                format!("failed alone, again and again, while the database answered: {cause}"),
                MAX_FAILURE_MESSAGE_LEN,
            ),
        })
    }

    /// [`Applier::apply`], retrying what is transient until shutdown, or
    /// until `tries` failures that its inputs may cause; a start whose key
    /// another caller holds is given up at once while `holds` has room.
    async fn apply_retrying(
        &self,
        inputs: &[PendingInput],
        routed: &[RouteRequest],
        retry: RetryPolicy,
        tries: u32,
        holds: &Holds,
        shutdown: &CancellationToken,
    ) -> Result<BatchReport, Failed> {
        let mut pause = retry.min;
        let mut suspect = 0;
        loop {
            let error = match self.apply(inputs, routed).await {
                Ok(report) => return Ok(report),
                Err(e) => e,
            };
            if let Some(failure) = error.permanent() {
                return Err(Failed::Permanent(failure));
            }
            if let ApplyError::RoutingInProgress(at) = error
                && holds.has_room()
            {
                return Err(Failed::Held(at));
            }
            if error.may_be_the_inputs() {
                suspect += 1;
                if suspect >= tries.max(1) {
                    return Err(Failed::Suspect(error));
                }
            }
            tracing::warn!(error = %error, retry_in_ms = pause.as_millis() as u64, "applying batch failed, retrying");
            metrics::counter!("ductor_apply_retries_total").increment(1);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Err(Failed::Stopped(error)),
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(retry.max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(tenant: &str, key: &str) -> RouteRequest {
        RouteRequest::keyed(tenant, key)
    }

    #[test]
    fn a_share_keeps_its_inputs_a_range_and_borrows_routed_requests_that_follow_each_other() {
        let routed = vec![start("acme", "a"), start("acme", "b"), start("acme", "c")];
        let inputs: Vec<PendingInput> = Vec::new();
        let all = Share::of(&[0, 1, 2], &inputs, &routed);
        assert!(matches!(all.routed, Cow::Borrowed(r) if r.len() == 3));
        assert_eq!(all.inputs_at, 0..0);
        let gap = Share::of(&[0, 2], &inputs, &routed);
        assert!(matches!(gap.routed, Cow::Owned(_)));
        assert_eq!(gap.routed_at, vec![0, 2]);
        assert_eq!(gap.routed[1].key.as_deref(), Some("c"));
        let one = Share::of(&[1], &inputs, &routed);
        assert!(matches!(one.routed, Cow::Borrowed(r) if r[0].key.as_deref() == Some("b")));
    }

    #[test]
    fn holds_leave_out_a_held_key_and_its_followers_only_while_there_is_room() {
        let routed = vec![
            start("acme", "a"),
            start("acme", "b"),
            start("acme", "a"),
            start("other", "a"),
        ];
        let mut holds = Holds::parking(4, std::iter::empty());
        holds.hold(&routed[0]);
        let mut done = IsolatedBatch::sized(routed.len(), 2);
        let rest = done.hold_back((0..6).collect(), &routed, &mut holds);
        assert_eq!(
            done.held,
            vec![0, 2],
            "the key and its follower, not another tenant's"
        );
        assert_eq!(rest, vec![1, 3, 4, 5]);
        assert_eq!(holds.room, 2, "each start left out takes room");
        let mut one = Holds::parking(1, [&routed[0]]);
        let mut done = IsolatedBatch::sized(routed.len(), 2);
        let rest = done.hold_back((0..6).collect(), &routed, &mut one);
        assert_eq!(done.held, vec![0], "past the room a start waits in place");
        assert_eq!(rest, vec![1, 2, 3, 4, 5]);
        assert!(!one.has_room());
    }

    #[test]
    fn halves_split_an_index_list_in_the_middle() {
        assert_eq!(halves(vec![1, 3, 4, 5, 6]), [vec![1, 3], vec![4, 5, 6]]);
        assert_eq!(halves(vec![7, 8]), [vec![7], vec![8]]);
    }
}
