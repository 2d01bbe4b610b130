//! The outbox drainer: publishes committed effect intents to Kafka, at least
//! once, in transition order per run and topic.
//!
//! In: the `eec_effect_intent` rows the apply stage commits, handed over
//! ([`Handoff`]) or claimed in rounds of at most `drainer.batch_max_intents`,
//! and wake-ups ([`Wakeup`], `NOTIFY ductor_effect_intent`). Out: Kafka
//! records with their stored key and headers; intents marked `completed`,
//! released with a backoff, or `parked`. Guarantees: an intent is marked
//! completed only after the broker's acknowledgement, and only by the
//! drainer whose claim on it still stands.
//!
//! A round claims a bounded batch of due intents (`not_before <= now()`) with
//! `FOR UPDATE SKIP LOCKED`, skipping any intent that still has an earlier,
//! due, undelivered intent of the same run and topic which this round did not
//! also claim — that earlier one is in another drainer's hands, and
//! publishing past it would reorder the run's effects. Claimed intents are
//! grouped into chains (one per run and topic) that are published
//! concurrently; inside a chain each publish waits for the broker's
//! acknowledgement before the next one starts, and a failure releases the
//! rest of the chain back to `pending`. Intents are marked `completed` only
//! after their acknowledgement.
//!
//! The fast lane skips the claim for the common case. When the drainer runs
//! in the coordinator's process, the apply transaction inserts each due
//! intent that has no earlier undelivered intent of its run and topic
//! already `claimed` by this drainer, and hands it over in memory right
//! after the commit ([`Handoff`]): it is published at once, with no claim
//! statement and no round to wait for, and marked completed after its
//! acknowledgement like any other claim. If the process dies first, the
//! lease expires and the reconciler redrives it.
//!
//! Rounds are triggered by an in-process wake-up right after a coordinator
//! commit, by Postgres `LISTEN/NOTIFY` for commits of other processes, by the
//! next timer falling due, and by a periodic poll as the safety net. A
//! reconciler returns intents whose claim lease expired (their drainer died)
//! to `pending`; retention deletes completed intents in bounded batches.
//!
//! Each stage has a module of its own: `claim` is the database side of a
//! round (claim, complete, release), `publish` its Kafka side, `fast_lane`
//! the in-memory handover from the apply layer, and `maintenance` what
//! keeps the table and the drainer's membership healthy between rounds
//! (heartbeats, the reconciler, retention, the backlog gauges, the notices
//! of parked effects). This module holds the drainer and the loop that
//! decides when a round runs.

mod claim;
mod fast_lane;
pub mod frontier;
mod maintenance;
mod publish;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::producer::FutureProducer;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use self::claim::Released;
use self::frontier::Frontier;
pub(crate) use self::maintenance::hostname;
use self::maintenance::maintenance;
use crate::config::DrainerConfig;
use crate::infra::crash::{CrashHooks, CrashPoint};
use crate::infra::prompt_producer::PromptProducer;

#[cfg(any(test, feature = "internals"))]
pub use self::claim::COMPLETE_SQL;
pub use self::claim::{ClaimedIntent, IntentPosition};
pub use self::fast_lane::{FastLane, Handoff};
pub(crate) use self::publish::Cause as PublishFailureCause;
pub(crate) use self::publish::ordered_headers;

/// The channel the apply layer notifies after committing intents.
pub const NOTIFY_CHANNEL: &str = "ductor_effect_intent";

/// What one round did; tests drive the drainer round by round with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundOutcome {
    /// Nothing was due.
    Idle,
    /// Intents were claimed: how many were published and marked completed,
    /// how many were released after a failed publish (or parked), and how
    /// many of the failures were transient (the broker away, a timeout):
    /// only those slow the claim rounds down, since a permanent one is no
    /// sign that anything else would fail.
    Drained {
        completed: usize,
        released: usize,
        transient: usize,
    },
}

pub struct Drainer {
    pub pool: PgPool,
    pub producer: FutureProducer,
    pub config: DrainerConfig,
    /// Names this drainer's claims, so it completes only its own.
    pub drainer_id: String,
    pub publish_timeout: Duration,
    /// Where a test stops this drainer as a crash would
    /// ([`CrashPoint::DrainerAfterPublish`]).
    pub crash: CrashHooks,
    /// Due intents committed as `pending` behind an undelivered one, as the
    /// fast lane was told; cleared when a claim round finds none due.
    pub(super) pending_behind: Arc<AtomicUsize>,
    /// When this drainer's heartbeats began to succeed without a break
    /// (Unix ms; 0 after a failed one).
    pub(super) healthy_since_ms: AtomicI64,
    /// Publishes intents that failed as if for good, one at a time (see
    /// [`Drainer::with_solo_producer`]).
    pub(super) solo: Option<crate::infra::kafka::LazyProducer>,
    /// Held while an intent that failed before is sent: one at a time.
    pub(super) solo_turn: tokio::sync::Mutex<()>,
    /// Sends without linger while few publishes are in flight (see
    /// [`Drainer::with_prompt_producer`]).
    pub(super) prompt: Option<PromptProducer>,
    /// The name of the process this drainer runs in, stable across its
    /// restarts (see [`Drainer::with_instance`]).
    pub(super) instance: Option<String>,
    /// Timeout timers wait for it to pass their deadline.
    pub(super) frontier: Frontier,
    /// The events topic, when parked effects get a notice there.
    pub(super) parked_notices: Option<String>,
    /// `signatures.timer_key`: the timers it publishes carry serve's
    /// signature (see [`Drainer::with_timer_key`]).
    pub(super) timer_key: Option<crate::config::SigningKey>,
}

impl Drainer {
    pub fn new(
        pool: PgPool,
        producer: FutureProducer,
        config: DrainerConfig,
        publish_timeout: Duration,
    ) -> Self {
        let drainer_id = format!(
            "{}-{}-{}",
            hostname(),
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Drainer {
            pool,
            producer,
            config,
            drainer_id,
            publish_timeout,
            crash: CrashHooks::default(),
            pending_behind: Arc::new(AtomicUsize::new(0)),
            healthy_since_ms: AtomicI64::new(0),
            solo: None,
            solo_turn: tokio::sync::Mutex::new(()),
            prompt: None,
            frontier: Frontier::default(),
            parked_notices: None,
            timer_key: None,
            instance: None,
        }
    }

    /// Names the process this drainer runs in with a name that stays the
    /// same across its restarts and that no other live process has
    /// (`kafka.group_instance_id`). Once its first heartbeat is recorded,
    /// the drainer gives back the claims its earlier incarnations left
    /// (they died with their process) at once, instead of after
    /// `member_timeout_ms` of silence.
    pub fn with_instance(mut self, instance: Option<String>) -> Self {
        self.instance = instance;
        self
    }

    /// Signs every timer it publishes with serve's `key`, which the ingress
    /// then requires of every timer it reads.
    pub fn with_timer_key(mut self, key: Option<crate::config::SigningKey>) -> Self {
        self.timer_key = key;
        self
    }

    /// Holds each step's timeout timer until `frontier` has passed its
    /// deadline (see [`crate::outbox::frontier`]).
    pub fn with_results_frontier(mut self, frontier: Frontier) -> Self {
        self.frontier = frontier;
        self
    }

    /// A producer of its own for intents whose publish failed as if for
    /// good (too large, say). The broker refuses a whole batch for one
    /// record in it, so a failure seen in a batch may be a neighbour's; one
    /// seen alone, on this producer, is the intent's own. Without it such
    /// intents are still sent one at a time, on the shared producer.
    /// Made at the first such intent (see
    /// [`LazyProducer`](crate::infra::kafka::LazyProducer)).
    pub fn with_solo_producer(self, producer: crate::infra::kafka::LazyProducer) -> Self {
        Drainer {
            solo: Some(producer),
            ..self
        }
    }

    /// A producer without linger for the publishes that start while fewer
    /// than `kafka.prompt_max_in_flight` others are in flight: a quiet
    /// system's effects go out at once instead of after `kafka.linger_ms`.
    /// A run's effects on one topic stay in order whichever producer
    /// carries each: a chain publishes one effect at a time, each after
    /// the acknowledgement of the one before.
    pub fn with_prompt_producer(self, producer: PromptProducer) -> Self {
        Drainer {
            prompt: Some(producer),
            ..self
        }
    }

    /// Publishes a notice of every effect parked from now on, on
    /// `events_topic` (the run's followers learn of it there).
    pub fn with_parked_notices(mut self, events_topic: String) -> Self {
        self.parked_notices = Some(events_topic);
        self
    }

    /// Claims due intents, publishes them, marks them completed.
    pub async fn drain_once(&self) -> anyhow::Result<RoundOutcome> {
        let claimed = self.claim().await?;
        if claimed.is_empty() {
            return Ok(RoundOutcome::Idle);
        }
        let (delivered, failed) = self.publish_all(&claimed).await;
        if self.crash.fires(CrashPoint::DrainerAfterPublish) && !delivered.is_empty() {
            anyhow::bail!("crash hook: stopped after publishing, before marking completed");
        }
        if !delivered.is_empty() {
            crate::crash_point!("drainer.after_publish");
        }
        let completed = self.complete(&delivered).await?;
        self.restart_late_clocks(&claimed, &delivered).await?;
        let released = if failed.is_empty() {
            Released::default()
        } else {
            self.release(&failed).await?
        };
        Ok(RoundOutcome::Drained {
            completed,
            released: released.pending + released.parked,
            transient: released.transient,
        })
    }
}

/// The drainer's wake-up sources, shared with the ingress.
#[derive(Clone, Default)]
pub struct Wakeup(Arc<WakeupInner>);

#[derive(Default)]
struct WakeupInner {
    /// A claim round is wanted now.
    round: Notify,
    /// An earlier `due_ms` was told.
    retime: Notify,
    /// The earliest instant an intent committed in this process falls due
    /// at, told since the idle claim rounds last asked the database (Unix
    /// ms; 0: none).
    due_ms: AtomicI64,
}

impl Wakeup {
    /// Called after a commit that wrote intents due now.
    pub fn wake(&self) {
        self.0.round.notify_one();
    }

    pub async fn woken(&self) {
        self.0.round.notified().await
    }

    /// Called after a commit that wrote an intent due at `at` (a timer):
    /// an idle drainer looks again by then, without a claim round now.
    pub fn due_at(&self, at: DateTime<Utc>) {
        let ms = at.timestamp_millis().max(1);
        let earlier = self
            .0
            .due_ms
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |told| {
                (told == 0 || ms < told).then_some(ms)
            });
        if earlier.is_ok() {
            self.0.retime.notify_one();
        }
    }

    /// Forgets what was told: called before the database is asked for the
    /// next due intent, which then answers for everything committed so far.
    fn forget_due(&self) {
        self.0.due_ms.store(0, Ordering::Release);
    }

    /// The earliest instant told since [`Wakeup::forget_due`].
    fn told_due(&self) -> Option<DateTime<Utc>> {
        match self.0.due_ms.load(Ordering::Acquire) {
            0 => None,
            ms => DateTime::from_timestamp_millis(ms),
        }
    }

    async fn retimed(&self) {
        self.0.retime.notified().await
    }
}

/// How long an idle drainer waits before its next claim round: until the
/// earliest of the next intent due in the database (`next_due`), the
/// earliest one committed since it asked (`told`), and the safety-net
/// `poll`; at least a millisecond.
fn idle_wait(
    next_due: Option<DateTime<Utc>>,
    told: Option<DateTime<Utc>>,
    poll: Duration,
    now: DateTime<Utc>,
) -> Duration {
    [next_due, told]
        .into_iter()
        .flatten()
        .map(|t| (t - now).to_std().unwrap_or(BLOCKED_RETRY))
        .fold(poll, Duration::min)
        .max(Duration::from_millis(1))
}

/// How soon an idle round looks again when due intents are blocked behind
/// ones in flight (their completion wakes it sooner).
const BLOCKED_RETRY: Duration = Duration::from_millis(100);

/// Runs the drainer, its listener, reconciler and retention until shutdown.
#[cfg(any(test, feature = "internals"))]
pub async fn run(
    drainer: Drainer,
    wakeup: Wakeup,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    run_with_fast_lane(drainer, wakeup, None, shutdown).await
}

/// [`run`], plus the fast lane for intents the apply layer hands over.
pub async fn run_with_fast_lane(
    drainer: Drainer,
    wakeup: Wakeup,
    lane: Option<FastLane>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // Announce this drainer before it claims anything, so that its claims
    // are given back promptly if it dies.
    if let Err(e) = drainer.heartbeat().await {
        tracing::warn!(error = format!("{e:#}"), "drainer heartbeat failed");
    }
    let drainer = Arc::new(drainer);
    let tracker = tokio_util::task::TaskTracker::new();
    if let Some(lane) = lane {
        let (drainer, wakeup) = (drainer.clone(), wakeup.clone());
        tracker.spawn(async move { fast_lane::fast_lane(drainer, lane, wakeup).await });
    }
    {
        let (pool, wakeup, shutdown) = (drainer.pool.clone(), wakeup.clone(), shutdown.clone());
        tracker.spawn(async move { listen(pool, wakeup, shutdown).await });
    }
    {
        let (drainer, wakeup, shutdown) = (drainer.clone(), wakeup.clone(), shutdown.clone());
        tracker.spawn(async move { maintenance(&drainer, &wakeup, shutdown).await });
    }
    tracker.close();
    let result = drain_loop(&drainer, &wakeup, &shutdown).await;
    // The helpers stop with the token; make sure they do if the loop failed.
    shutdown.cancel();
    tracker.wait().await;
    result
}

async fn drain_loop(
    drainer: &Drainer,
    wakeup: &Wakeup,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let poll = Duration::from_millis(drainer.config.poll_interval_ms);
    let mut failures: u32 = 0;
    while !shutdown.is_cancelled() {
        match drainer.drain_once().await {
            Ok(RoundOutcome::Drained { transient, .. }) => {
                if transient == 0 {
                    failures = 0;
                    continue;
                }
                failures = failures.saturating_add(1);
            }
            Ok(RoundOutcome::Idle) => {
                failures = 0;
                wakeup.forget_due();
                let observed = drainer.observe_backlog().await;
                let next_due = observed.as_ref().ok().copied().flatten();
                if observed.is_ok() && next_due.is_none_or(|t| t > Utc::now()) {
                    // Nothing pending is due: nothing waits behind the
                    // fast lane any more.
                    drainer.pending_behind.store(0, Ordering::Relaxed);
                }
                // Something due but unclaimable waits behind an intent in
                // flight: its completion wakes this loop, so do not spin.
                // A timer committed meanwhile only shortens the wait.
                loop {
                    let wait = idle_wait(next_due, wakeup.told_due(), poll, Utc::now());
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = wakeup.woken() => break,
                        _ = tokio::time::sleep(wait) => break,
                        _ = wakeup.retimed() => {}
                    }
                }
                continue;
            }
            // Armed, the drainer ends at the failed round, as a crash
            // would end it.
            Err(e) if drainer.crash.fires(CrashPoint::DrainerAfterPublish) => return Err(e),
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::warn!(error = format!("{e:#}"), "drain round failed");
            }
        }
        // Back off after failures so a broker or database outage is not a
        // busy loop; any progress resets it.
        let backoff =
            Duration::from_millis((50u64 << failures.min(7)).min(drainer.config.max_backoff_ms));
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
    Ok(())
}

/// Forwards `NOTIFY ductor_effect_intent` to the wake-up, reconnecting with
/// backoff when the connection drops.
async fn listen(pool: PgPool, wakeup: Wakeup, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "outbox listener cannot connect, retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if let Err(e) = listener.listen(NOTIFY_CHANNEL).await {
            tracing::warn!(error = %e, "outbox listener cannot LISTEN, retrying");
            continue;
        }
        backoff = Duration::from_millis(100);
        // A notification may have been missed while disconnected.
        wakeup.wake();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                n = listener.try_recv() => match n {
                    Ok(Some(_)) => wakeup.wake(),
                    Ok(None) => { wakeup.wake(); }
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox listener lost its connection");
                        break;
                    }
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use chrono::{TimeZone, Utc};

    use super::{BLOCKED_RETRY, Wakeup, idle_wait};

    const POLL: Duration = Duration::from_secs(5);

    #[test]
    fn an_idle_drainer_waits_for_the_earliest_of_the_due_the_told_and_the_poll() {
        let now = Utc.timestamp_millis_opt(1_000_000).unwrap();
        let at = |ms: i64| Some(now + chrono::Duration::milliseconds(ms));
        assert_eq!(idle_wait(None, None, POLL, now), POLL);
        assert_eq!(
            idle_wait(at(2_000), None, POLL, now),
            Duration::from_secs(2)
        );
        assert_eq!(
            idle_wait(None, at(300), POLL, now),
            Duration::from_millis(300)
        );
        assert_eq!(
            idle_wait(at(2_000), at(300), POLL, now),
            Duration::from_millis(300)
        );
        assert_eq!(idle_wait(at(9_000), at(7_000), POLL, now), POLL);
        // Due already but not claimable: what is in flight ahead of it
        // wakes the drainer; until then it does not spin.
        assert_eq!(idle_wait(at(-50), None, POLL, now), BLOCKED_RETRY);
        assert_eq!(idle_wait(at(0), None, POLL, now), Duration::from_millis(1));
    }

    #[test]
    fn only_an_earlier_timer_retimes_the_wait_and_forgetting_clears_it() {
        let wakeup = Wakeup::default();
        let t = |ms: i64| Utc.timestamp_millis_opt(ms).unwrap();
        assert_eq!(wakeup.told_due(), None);
        wakeup.due_at(t(5_000));
        assert_eq!(wakeup.told_due(), Some(t(5_000)));
        wakeup.due_at(t(7_000));
        assert_eq!(
            wakeup.told_due(),
            Some(t(5_000)),
            "a later timer is not news"
        );
        wakeup.due_at(t(3_000));
        assert_eq!(wakeup.told_due(), Some(t(3_000)));
        wakeup.forget_due();
        assert_eq!(wakeup.told_due(), None);
    }

    #[tokio::test]
    async fn an_earlier_timer_wakes_the_waiting_loop_to_retime() {
        let wakeup = Wakeup::default();
        wakeup.due_at(Utc.timestamp_millis_opt(5_000).unwrap());
        tokio::time::timeout(Duration::from_secs(5), wakeup.retimed())
            .await
            .expect("the first timer told retimes the wait");
        wakeup.due_at(Utc.timestamp_millis_opt(6_000).unwrap());
        assert!(
            tokio::time::timeout(Duration::from_millis(50), wakeup.retimed())
                .await
                .is_err(),
            "a later timer does not"
        );
    }
}
