//! Load: the runs a batch touches, from the cache of states this applier
//! committed, or from the database with the `record_version` the write
//! must match.
//!
//! In: a batch's inputs, and the cache unless the attempt is a
//! recomputation. Out: each run the batch names as [`Loaded`]: its state
//! (none for a new run) and the version it was read at, or its tombstone.
//! Guarantees: a state from the cache, or a run taken to be new without a
//! query, is only a guess that the write checks: the write lands only on
//! the version loaded, and a verdict that writes nothing on a guess
//! ([`unsure`]) is recomputed from the database. The cache is bounded in
//! entries and in bytes. A stored state of an older version loads
//! upgraded; one of a newer version than this binary reads fails the batch
//! as [`ApplyError::StoredState`], a permanent failure, so the isolation
//! sets the input that names its run apart (class `newer_state_version`)
//! and the run's state is never written back in an older shape.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use sqlx::postgres::{PgValueFormat, PgValueRef};
use sqlx::{PgConnection, Row};

use super::rows::Loaded;
use super::{ApplyError, InputOutcome, PendingInput};
use crate::contract::Input;
use crate::coordinator::{Purged, RunState};

/// Run states as this applier last committed them, so that the next batch
/// of a run need not load it. An entry is only a guess: the runs UPDATE is
/// conditional on the `record_version` it carries, so an entry made stale by
/// another writer loses the race, is dropped, and the batch is recomputed
/// from the database. Terminal runs are not kept. Bounded twice, by entries
/// (`coordinator.run_cache_size`) and by the bytes of the states' encoding
/// (`coordinator.run_cache_max_bytes`, a fair measure of what a state holds
/// in memory): when either is full, the cache starts over (no bookkeeping
/// on the hot path), and a state larger than a tenth of the byte bound is
/// not kept at all.
pub struct RunCache {
    capacity: usize,
    max_bytes: usize,
    inner: Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    states: HashMap<String, (RunState, usize)>,
    bytes: usize,
}

impl CacheInner {
    pub(super) fn remove(&mut self, run_id: &str) {
        if let Some((_, size)) = self.states.remove(run_id) {
            self.bytes -= size;
        }
    }
}

impl RunCache {
    pub fn new(capacity: usize, max_bytes: usize) -> Self {
        RunCache {
            capacity,
            max_bytes,
            inner: Mutex::new(CacheInner::default()),
        }
    }

    /// Whether the cache keeps states at all (`run_cache_size` above 0).
    pub(super) fn enabled(&self) -> bool {
        self.capacity > 0 && self.max_bytes > 0
    }

    /// The bytes of the encoded states held now.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.inner.lock().map_or(0, |i| i.bytes)
    }

    /// The cached state of each of `ids` that has one.
    pub(super) fn get_many<'a>(
        &self,
        ids: impl Iterator<Item = &'a str>,
    ) -> HashMap<String, RunState> {
        if !self.enabled() {
            return HashMap::new();
        }
        let Ok(inner) = self.inner.lock() else {
            return HashMap::new();
        };
        ids.filter_map(|id| inner.states.get(id).map(|s| (id.to_string(), s.0.clone())))
            .collect()
    }

    /// Remembers committed states (their `record_version` is the new one),
    /// each with the length of its encoding.
    pub(super) fn put_many(&self, committed: Vec<(RunState, usize)>) {
        if !self.enabled() {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        for (state, size) in committed {
            inner.remove(&state.run_id);
            if state.status.is_terminal() || size > self.max_bytes / 10 {
                continue;
            }
            if inner.states.len() >= self.capacity || inner.bytes + size > self.max_bytes {
                inner.states.clear();
                inner.bytes = 0;
            }
            inner.bytes += size;
            inner.states.insert(state.run_id.clone(), (state, size));
        }
        metrics::gauge!("ductor_run_cache_bytes").set(inner.bytes as f64);
    }

    /// Forgets `ids`: their batch lost a race or its outcome is unknown.
    pub(super) fn forget<'a>(&self, ids: impl Iterator<Item = &'a str>) {
        if !self.enabled() {
            return;
        }
        if let Ok(mut inner) = self.inner.lock() {
            for id in ids {
                inner.remove(id);
            }
        }
    }
}

/// The runs of a batch's inputs: from the cache when it has them, else
/// from the database.
///
/// With the cache on, a run that the batch names only in `run.start`
/// inputs, and that the cache does not hold, is taken to be new without a
/// query: a start is almost always the first input of its run. The guess is
/// checked where it matters. If the run exists after all (a redelivered
/// start), its insert matches no row, the batch statement counts a lost
/// race, and the batch is recomputed from the database, where the start is
/// found a duplicate. A start that changes nothing on the guess (a
/// rejection) is recomputed the same way, like any verdict on a state not
/// read from the database.
pub(super) async fn load_runs(
    conn: &mut PgConnection,
    inputs: &[PendingInput],
    cache: Option<&RunCache>,
) -> Result<HashMap<String, Loaded>, ApplyError> {
    let mut ids: Vec<String> = inputs
        .iter()
        .map(|p| p.input.run_id().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    let mut cached = cache
        .map(|c| c.get_many(ids.iter().map(String::as_str)))
        .unwrap_or_default();
    let guess = cache.is_some_and(RunCache::enabled);
    // Runs that an input other than a start names are always read.
    let named_otherwise: HashSet<&str> = inputs
        .iter()
        .filter(|p| !matches!(p.input, Input::Start(_)))
        .map(|p| p.input.run_id())
        .collect();
    let mut runs: HashMap<String, Loaded> = HashMap::with_capacity(ids.len());
    let mut missing = Vec::with_capacity(ids.len() - cached.len());
    for id in ids {
        let state = cached.remove(&id);
        let guessed = guess && state.is_none() && !named_otherwise.contains(id.as_str());
        if state.is_none() && !guessed {
            missing.push(id.clone());
        }
        runs.insert(
            id,
            Loaded {
                loaded_version: state.as_ref().map(|s| s.record_version),
                cached: state.is_some() || guessed,
                state,
                changed: false,
                purged: None,
            },
        );
    }
    read_states(conn, &missing, &mut runs).await?;
    missing.retain(|id| runs.get(id).is_some_and(|l| l.state.is_none()));
    if !missing.is_empty() {
        load_tombstones(conn, &missing, &mut runs).await?;
    }
    Ok(runs)
}

/// The runs `ids` names, read from the database; a run that does not
/// exist is loaded without a state.
pub(super) async fn load_ids(
    conn: &mut PgConnection,
    ids: &[String],
) -> Result<HashMap<String, Loaded>, ApplyError> {
    let mut runs: HashMap<String, Loaded> = ids
        .iter()
        .map(|id| {
            let loaded = Loaded {
                state: None,
                loaded_version: None,
                changed: false,
                cached: false,
                purged: None,
            };
            (id.clone(), loaded)
        })
        .collect();
    read_states(conn, ids, &mut runs).await?;
    Ok(runs)
}

/// Whether the batch must be recomputed from the database: a cached state
/// that is stale (another writer moved the run on) would make its UPDATE
/// lose the race, but a verdict that writes nothing (a duplicate, a stale
/// or unknown stamp) would go unchecked.
pub(super) fn unsure(
    inputs: &[PendingInput],
    outcomes: &[InputOutcome],
    runs: &HashMap<String, Loaded>,
) -> bool {
    inputs.iter().zip(outcomes).any(|(pending, outcome)| {
        !matches!(outcome, InputOutcome::Applied { .. })
            && runs
                .get(pending.input.run_id())
                .is_some_and(|loaded| loaded.cached)
    })
}

/// Reads the states of `ids` into their slots of `runs`, with the
/// `record_version` each was read at.
async fn read_states(
    conn: &mut PgConnection,
    ids: &[String],
    runs: &mut HashMap<String, Loaded>,
) -> Result<(), ApplyError> {
    if ids.is_empty() {
        return Ok(());
    }
    let rows = sqlx::query("SELECT run_id, record_version, state FROM runs WHERE run_id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?;
    for row in rows {
        let run_id: String = row.try_get("run_id")?;
        let version: i64 = row.try_get("record_version")?;
        let mut state = crate::coordinator::stored::decode(jsonb_text(row.try_get_raw("state")?)?)?;
        state.record_version = version;
        if let Some(slot) = runs.get_mut(&run_id) {
            slot.state = Some(state);
            slot.loaded_version = Some(version);
        }
    }
    Ok(())
}

/// The text of a `jsonb` value as Postgres sent it, without the version
/// byte (1) that leads it in the binary format, for the stored state's own
/// decoding ([`crate::coordinator::stored::decode`]).
fn jsonb_text(value: PgValueRef<'_>) -> Result<&[u8], sqlx::Error> {
    let bytes = value.as_bytes().map_err(sqlx::Error::Decode)?;
    match (value.format(), bytes) {
        (PgValueFormat::Text, text) => Ok(text),
        (PgValueFormat::Binary, [1, text @ ..]) => Ok(text),
        (PgValueFormat::Binary, _) => Err(sqlx::Error::Decode(
            "a jsonb value of an unknown binary format version".into(),
        )),
    }
}

/// The tombstones of `ids`, runs that do not exist: finished runs that
/// retention deleted, whose late inputs must not start them again.
async fn load_tombstones(
    conn: &mut PgConnection,
    ids: &[String],
    runs: &mut HashMap<String, Loaded>,
) -> Result<(), ApplyError> {
    let rows = sqlx::query(
        "SELECT run_id, tenant_scope, start_fingerprint FROM run_tombstones \
         WHERE run_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(&mut *conn)
    .await?;
    for row in rows {
        let run_id: String = row.try_get("run_id")?;
        if let Some(slot) = runs.get_mut(&run_id) {
            slot.purged = Some(Purged {
                tenant: row.try_get("tenant_scope")?,
                start_fingerprint: row.try_get("start_fingerprint")?,
            });
        }
    }
    Ok(())
}

/// The run cache's bounds, and a started run the other tests of the stage
/// build on.
#[cfg(test)]
pub(crate) mod tests {
    use chrono::DateTime;
    use serde_json::Value;
    use uuid::Uuid;

    use super::*;
    use crate::contract::RunStart;
    use crate::coordinator::{Decision, Entropy, fold};

    /// A started run of the example workflow, with `pad` bytes of input.
    pub(crate) fn started(run_id: &str, pad: usize) -> RunState {
        let workflows = crate::infra::workflows::load_dir(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/workflows"
        )))
        .expect("loading the example workflows");
        let input = Input::Start(RunStart {
            run_id: run_id.into(),
            tenant: "acme".into(),
            workflow: "example".into(),
            workflow_version: None,
            pool: "default".into(),
            input: Value::String("x".repeat(pad)),
            correlation_id: None,
            parent: None,
        });
        let entropy = Entropy {
            stamp: Uuid::from_u128(1),
            jitter_unit: 0.5,
        };
        let now = DateTime::from_timestamp(1_800_000_000, 0).expect("a valid time");
        match fold(None, &input, &workflows, usize::MAX, now, &entropy) {
            Decision::Transition(t) => t.state,
            other => panic!("the start applies: {other:?}"),
        }
    }

    fn sized(state: RunState) -> (RunState, usize) {
        let size = serde_json::to_string(&state).unwrap().len();
        (state, size)
    }

    #[test]
    fn the_run_cache_is_bounded_in_bytes_and_starts_over_when_full() {
        let one = sized(started("a0", 1_000));
        let size = one.1;
        let cache = RunCache::new(1_000, size * 10 + size / 2);
        cache.put_many(vec![one]);
        assert_eq!(cache.bytes(), size);
        let more: Vec<_> = (0..9)
            .map(|k| sized(started(&format!("b{k}"), 1_000)))
            .collect();
        cache.put_many(more);
        assert_eq!(cache.bytes(), size * 10);
        assert_eq!(cache.get_many(["a0", "b8"].into_iter()).len(), 2);
        // The eleventh does not fit: the cache starts over with it.
        cache.put_many(vec![sized(started("c0", 1_000))]);
        assert_eq!(cache.bytes(), size);
        assert_eq!(cache.get_many(["a0", "c0"].into_iter()).len(), 1);
        // Replacing a run's state counts it once.
        cache.put_many(vec![sized(started("c0", 1_000))]);
        assert_eq!(cache.bytes(), size);
        cache.forget(["c0"].into_iter());
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn a_state_over_a_tenth_of_the_bound_is_not_cached() {
        let cache = RunCache::new(1_000, 20_000);
        cache.put_many(vec![sized(started("big", 5_000))]);
        assert_eq!(cache.bytes(), 0);
        assert!(cache.get_many(["big"].into_iter()).is_empty());
        cache.put_many(vec![sized(started("small", 10))]);
        assert_eq!(cache.get_many(["small"].into_iter()).len(), 1);
    }
}
