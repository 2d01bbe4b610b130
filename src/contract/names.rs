//! Names on the wire: topics, and the keys Ductor derives for what it
//! publishes.
//!
//! In: `kafka.topic_prefix`, a pool's name, a run's id and an effect's
//! position in its run. Out: topic names ([`TopicNames`]) and keys.
//! Guarantees: pure and deterministic: every redelivery of an effect
//! carries its first copy's key; [`is_topic`] accepts only names a broker
//! takes (1 to [`MAX_TOPIC_LEN`] of `[A-Za-z0-9_.-]`, not `.` or `..`).

/// Longest workflow, step or pool name.
pub const MAX_NAME_LEN: usize = 100;
/// Longest Kafka topic name the broker accepts.
pub const MAX_TOPIC_LEN: usize = 249;

/// `[A-Za-z0-9_.-]{1,max}`: the characters Kafka allows in a topic name.
pub fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// A legal Kafka topic name (`.` and `..` are reserved by the broker).
pub fn is_topic(s: &str) -> bool {
    is_name(s, MAX_TOPIC_LEN) && s != "." && s != ".."
}

/// The topics of one deployment, all under `kafka.topic_prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicNames {
    pub prefix: String,
}

impl TopicNames {
    /// `<prefix>requests`: run starts.
    pub fn requests(&self) -> String {
        format!("{}requests", self.prefix)
    }

    /// `<prefix>wakeups`: durable timers (published at their due time),
    /// signals and cancels.
    pub fn wakeups(&self) -> String {
        format!("{}wakeups", self.prefix)
    }

    /// `<prefix>attempt-results`: what workers made of their attempts.
    pub fn attempt_results(&self) -> String {
        format!("{}attempt-results", self.prefix)
    }

    /// `<prefix>events`: every run's lifecycle.
    pub fn events(&self) -> String {
        format!("{}events", self.prefix)
    }

    /// `<prefix>steps.<pool>`: the dispatches of one worker pool.
    pub fn steps(&self, pool: &str) -> String {
        format!("{}steps.{pool}", self.prefix)
    }

    /// `<prefix>dlq`: inputs that cannot apply, with their class.
    pub fn dead_letters(&self) -> String {
        format!("{}dlq", self.prefix)
    }

    /// The topics the coordinator consumes: requests, wakeups and attempt
    /// results, in that order. They must be co-partitioned, so that one
    /// process reads every input of a run.
    pub fn inputs(&self) -> Vec<String> {
        vec![self.requests(), self.wakeups(), self.attempt_results()]
    }
}

/// The deterministic idempotency key of an effect: the same on every
/// redelivery because it is derived from the run, the transition seq and the
/// effect's index in that transition.
pub fn idempotency_key(run_id: &str, seq: i64, effect_index: usize) -> String {
    format!("{run_id}/{seq}/{effect_index}")
}

/// The key of one step of one run, the same for every attempt of it: what a
/// worker passes as the `Idempotency-Key` of the external call the step
/// makes, so that a retried attempt (after a timeout, a crash or a failure)
/// does not repeat the call's effect. Run ids and tenants have no `/`, so
/// it is never an effect's idempotency key.
pub fn step_key(run_id: &str, step_index: u32) -> String {
    format!("{run_id}/step/{step_index}")
}

/// The key of the `visit`-th start of one step of a run that loops: the
/// first is [`step_key`], each later one its own (`<run>/step/<index>/visit/<n>`),
/// so that a step run again by a loop makes its external call again,
/// while a retried attempt of one visit does not.
pub fn step_key_of_visit(run_id: &str, step_index: u32, visit: u32) -> String {
    if visit <= 1 {
        step_key(run_id, step_index)
    } else {
        format!("{run_id}/step/{step_index}/visit/{visit}")
    }
}

/// The idempotency key of the run a `child` step's `attempt` starts: its
/// step key, `/child/` and the attempt, so that each attempt starts one
/// run however often its start is delivered, and a retry starts another.
pub fn child_key(step_key: &str, attempt: u32) -> String {
    format!("{step_key}/child/{attempt}")
}

/// The key of one start of a step inside the items of `map` steps:
/// [`step_key_of_visit`], then `/item/<k>` with the item of each map it is
/// in, outermost first (`<run>/step/<index>/item/3`), so that each item
/// makes its own external call.
pub fn step_key_of_items(run_id: &str, step_index: u32, visit: u32, items: &[u32]) -> String {
    let mut key = step_key_of_visit(run_id, step_index, visit);
    if !items.is_empty() {
        key.push_str("/item");
        for item in items {
            key.push('/');
            key.push_str(&item.to_string());
        }
    }
    key
}

/// The step key of the compensation of the step whose key is `step_key`:
/// one compensation per execution of the step it undoes.
pub fn compensation_key(step_key: &str) -> String {
    format!("{step_key}/compensate")
}

/// The idempotency key of the `run.effect_parked` notice of the effect whose
/// key is `effect_key`: one notice per parked effect.
pub fn parked_notice_key(effect_key: &str) -> String {
    format!("{effect_key}/parked")
}

/// The cancel key of the timeout timer of the attempt `stamp`.
pub fn timeout_cancel_key(stamp: &str) -> String {
    format!("timeout:{stamp}")
}
