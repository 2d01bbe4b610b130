//! The stored encoding of a run's state: the `runs.state` document, the
//! version of its shape, and the upgrade of every older version to this
//! binary's.
//!
//! In: a `runs.state` document as stored, of any version. Out: the
//! [`RunState`] of this binary's version ([`STATE_VERSION`]), or why there
//! is none: the document is of a version newer than this binary knows
//! ([`StateDecodeError::Newer`]; the run is left alone rather than read and
//! written back in an older shape), or it is no run state of any version
//! ([`StateDecodeError::Malformed`]). Guarantees: pure (no database, no
//! clock); a document of the current version is parsed once, as it was
//! before versions were kept; an older one is upgraded by a chain of steps
//! on the JSON document, one per version, each tested with the shapes that
//! shipped (`tests/fixtures/stored/`).
//!
//! The versions:
//!
//! 1. No `v`: every state written before the version was kept. Its newer
//!    form, since the migration `20261202000011_state_history`, keeps the
//!    newest step's output (`output`) and signals without their payloads;
//!    the fields added while it was current (`start_fingerprint`, a
//!    signal's `fingerprint`, `waiting`, a signal's `payload`, `kept` and
//!    `consumed_by`, `trace`) default when absent. Its first form kept
//!    every step's output (`outputs`) and every signal's payload. That
//!    migration moved them to the history and gave the stored states the
//!    newer form, but a binary of the first form that went on running
//!    after it wrote the first form again: such a state loads too, its
//!    newest output becoming `output`.
//! 2. `"v": 2`: version 1's newer form with its version written. Since
//!    `7d5d594` (retries) also `retries` (each retry the run applied: its
//!    action id, when, from which step) and `failed_seq` (the `run.failed`
//!    transition a retry names), optional; the binaries of version 2
//!    before them ignore both and write a state back without them.
//! 3. `"v": 3`: version 2 with `retries` and `failed_seq`, under a version
//!    of its own that came with the migration
//!    `20261206000021_state_version_3`, so that no binary that would drop
//!    them starts on a database that may hold them. A version 2 state
//!    loads as it is, with those fields or without: without `failed_seq`,
//!    a failed run is failed by its last transition
//!    ([`RunState::failure_seq`]).
//! 4. `"v": 4`: version 3 and `results` (each finished step's result at
//!    its result path, for workflows that select their steps' inputs or
//!    their output, or choose; [`super::document`]) and `visits` (how many
//!    times each step started, for workflows that loop; [`super::flow`]),
//!    both optional, under a version of its
//!    own that came with the migration `20261207000024_state_version_4`:
//!    a binary of version 3 would write a run back without its results, and
//!    a later step that reads one would find nothing. A version 3 state
//!    loads as it is: its workflow selected no data, which no binary of
//!    version 3 knew.
//! 5. `"v": 5`: version 4 and `lanes` (where each branch of the `parallel`
//!    steps a run is in stands), optional, under a version of its own
//!    that came with the migration `20261208000025_state_version_5`: a
//!    binary of version 4 would write a run back without its branches,
//!    and no result of theirs could then apply. A version 4 state loads as
//!    it is: no binary of version 4 ran branches.
//! 6. `"v": 6`: version 5 and `compensable` (the succeeded steps a
//!    compensation would undo) and `compensating` (why and how far a run
//!    compensates), optional, under a version of its own that came with
//!    the migration `20261209000026_state_version_6`: a binary of version
//!    5 would write a run back without them, and a later failure would
//!    undo nothing. A version 5 state loads as it is: no binary of
//!    version 5 compensated.
//! 7. `"v": 7`: version 6 and `parent` (the run and attempt a child run
//!    answers), optional, under a version of its own that came with the
//!    migration `20261210000027_state_version_7`: a binary of version 6
//!    would write a child run back without its parent, and its outcome
//!    would never reach the step waiting for it. A version 6 state loads
//!    as it is: no binary of version 6 started child runs.
//!
//! A new version adds a step to [`upgrade`] and a fixture of the version
//! before it. Binaries before this version ignore fields they do not know
//! and write the state back without them; a version that such a binary
//! would misread must therefore come with a migration, since a binary
//! refuses to start on a schema that has a migration it does not know
//! (`infra::db::check_migrated`), so that no older binary meets the new
//! states. SQL that reads into the document (the retention function's
//! `start_fingerprint`, the API's `signals`, `output` and `error`) follows
//! the shape too.

use serde_json::Value;

use super::state::{RunState, STATE_VERSION};

/// Why a stored document gives no [`RunState`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateDecodeError {
    /// Written by a newer binary, in a shape this one does not know.
    #[error(
        "the stored state is version {found}, newer than version {known}, the newest this binary \
         reads: a newer binary wrote it, and only such a binary may apply the run's inputs"
    )]
    Newer { found: u64, known: u32 },
    /// Not a run state of any version.
    #[error("the stored state does not decode: {0}")]
    Malformed(String),
}

/// The run state a stored document holds, upgraded to [`STATE_VERSION`].
pub fn decode(document: &[u8]) -> Result<RunState, StateDecodeError> {
    // The common case, a document of this binary's version, in one parse.
    if let Ok(state) = serde_json::from_slice::<RunState>(document)
        && state.encoding_version == STATE_VERSION
    {
        return Ok(state);
    }
    let value: Value = serde_json::from_slice(document).map_err(malformed)?;
    serde_json::from_value(upgrade(value)?).map_err(malformed)
}

/// `document` in the shape of [`STATE_VERSION`]: each version's step in
/// turn, from the document's own. A document of a newer version is
/// refused, never cut down to this one.
pub fn upgrade(mut document: Value) -> Result<Value, StateDecodeError> {
    let version = version_of(&document)?;
    if version > u64::from(STATE_VERSION) {
        return Err(StateDecodeError::Newer {
            found: version,
            known: STATE_VERSION,
        });
    }
    if version < 2 {
        document = from_version_1(document);
    }
    if version < 3 {
        document = from_version_2(document);
    }
    if version < 4 {
        document = from_version_3(document);
    }
    if version < 5 {
        document = from_version_4(document);
    }
    if version < 6 {
        document = from_version_5(document);
    }
    if version < 7 {
        document = from_version_6(document);
    }
    Ok(document)
}

/// The version a document says it is (`v`; 1 without one).
pub fn version_of(document: &Value) -> Result<u64, StateDecodeError> {
    let Value::Object(fields) = document else {
        return Err(StateDecodeError::Malformed("not a JSON object".into()));
    };
    match fields.get("v") {
        None => Ok(1),
        Some(v) => v
            .as_u64()
            .filter(|&v| v >= 1)
            .ok_or_else(|| StateDecodeError::Malformed("v: must be a positive integer".into())),
    }
}

/// Version 1 to 2. Its first form (`outputs`, and signals with their
/// payloads) becomes its newer one, as the migration
/// `20261202000011_state_history` turned the states it found: the newest
/// output is `output` (`null` before any), and the signals keep their
/// order without their payloads (a signal of that form is never kept for
/// a later step). Then the version is written.
fn from_version_1(mut document: Value) -> Value {
    let Some(fields) = document.as_object_mut() else {
        return document;
    };
    if let Some(outputs) = fields.remove("outputs") {
        let newest = match outputs {
            Value::Array(mut outputs) => outputs.pop().unwrap_or(Value::Null),
            _ => Value::Null,
        };
        fields.entry("output").or_insert(newest);
        if let Some(Value::Array(signals)) = fields.get_mut("signals") {
            for signal in signals.iter_mut().filter_map(Value::as_object_mut) {
                signal.remove("payload");
            }
        }
    }
    fields.insert("v".into(), 2.into());
    document
}

/// Version 2 to 3: the same fields, so only the version is written. A
/// version 2 state with `retries` and `failed_seq` keeps them; one without
/// was written before retries, or by a binary that did not know them, and
/// they default (no retry applied; a failed run failed by its last
/// transition, [`RunState::failure_seq`]).
fn from_version_2(mut document: Value) -> Value {
    if let Some(fields) = document.as_object_mut() {
        fields.insert("v".into(), 3.into());
    }
    document
}

/// Version 3 to 4: the same fields, and no `results` or `visits` (no
/// binary of version 3 selected data or looped), so only the version is
/// written.
fn from_version_3(mut document: Value) -> Value {
    if let Some(fields) = document.as_object_mut() {
        fields.insert("v".into(), 4.into());
    }
    document
}

/// Version 4 to 5: the same fields, and no `lanes` (no binary of version
/// 4 ran branches), so only the version is written.
fn from_version_4(mut document: Value) -> Value {
    if let Some(fields) = document.as_object_mut() {
        fields.insert("v".into(), 5.into());
    }
    document
}

/// Version 5 to 6: the same fields, and no `compensable` or
/// `compensating` (no binary of version 5 compensated), so only the
/// version is written.
fn from_version_5(mut document: Value) -> Value {
    if let Some(fields) = document.as_object_mut() {
        fields.insert("v".into(), 6.into());
    }
    document
}

/// Version 6 to 7: the same fields, and no `parent` (no binary of
/// version 6 started child runs), so only the version is written.
fn from_version_6(mut document: Value) -> Value {
    if let Some(fields) = document.as_object_mut() {
        fields.insert("v".into(), 7.into());
    }
    document
}

fn malformed(e: serde_json::Error) -> StateDecodeError {
    StateDecodeError::Malformed(e.to_string())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A state of the newer form of version 1, as the binaries before
    /// versions wrote it with every optional field absent.
    fn version_1() -> Value {
        json!({
            "run_id": "r1", "tenant": "acme", "pool": "default", "workflow": "wf",
            "workflow_version": 1, "status": "running", "step_index": 1, "attempt": 1,
            "input": {"n": 1}, "output": {"n": 2},
            "outstanding": null, "pending_retry": null, "attempts": [],
            "signals": [{"signal_id": "s1", "name": "go",
                         "received_at": "2026-12-02T10:00:00Z"}],
            "correlation_id": null, "error": null, "record_version": 3,
            "last_transition_seq": 3,
            "created_at": "2026-12-02T10:00:00Z", "updated_at": "2026-12-02T10:00:01Z",
        })
    }

    fn bytes(v: &Value) -> Vec<u8> {
        serde_json::to_vec(v).unwrap()
    }

    #[test]
    fn a_state_without_a_version_is_version_1_and_loads_as_the_current_one() {
        let state = decode(&bytes(&version_1())).unwrap();
        assert_eq!(state.encoding_version, STATE_VERSION);
        assert_eq!(state.output, json!({"n": 2}));
        assert_eq!(state.signals[0].fingerprint, None);
        assert!(state.waiting.is_none() && state.trace.is_none());
        // Written back, it carries the current version.
        let written = serde_json::to_value(&state).unwrap();
        assert_eq!(written["v"], STATE_VERSION);
        assert_eq!(decode(&bytes(&written)).unwrap(), state);
    }

    #[test]
    fn the_first_form_of_version_1_loads_with_its_newest_output() {
        let mut first = version_1();
        let fields = first.as_object_mut().unwrap();
        fields.remove("output");
        fields.insert("outputs".into(), json!([{"n": 1}, {"n": 2}]));
        first["signals"][0]["payload"] = json!({"big": "x"});
        let upgraded = upgrade(first.clone()).unwrap();
        assert_eq!(upgraded["output"], json!({"n": 2}));
        assert!(upgraded.get("outputs").is_none());
        assert!(upgraded["signals"][0].get("payload").is_none());
        assert_eq!(
            decode(&bytes(&first)).unwrap(),
            decode(&bytes(&version_1())).unwrap()
        );
        // Before any step succeeded, there is no output.
        first["outputs"] = json!([]);
        assert_eq!(decode(&bytes(&first)).unwrap().output, Value::Null);
    }

    #[test]
    fn a_state_of_a_newer_version_is_refused_whether_or_not_it_parses() {
        let mut newer = version_1();
        newer["v"] = json!(STATE_VERSION + 1);
        let refused = StateDecodeError::Newer {
            found: u64::from(STATE_VERSION) + 1,
            known: STATE_VERSION,
        };
        assert_eq!(decode(&bytes(&newer)), Err(refused.clone()));
        // A newer shape that today's type cannot read at all is still
        // named for its version, not as a broken document.
        newer.as_object_mut().unwrap().remove("status");
        newer["phase"] = json!({"running": {}});
        assert_eq!(decode(&bytes(&newer)), Err(refused));
        newer["v"] = json!(u64::MAX);
        assert!(matches!(
            decode(&bytes(&newer)),
            Err(StateDecodeError::Newer {
                found: u64::MAX,
                ..
            })
        ));
        let message = StateDecodeError::Newer { found: 4, known: 3 }.to_string();
        assert!(
            message.contains("version 4") && message.contains("version 3"),
            "{message}"
        );
    }

    /// A state of version 2 as the binaries with retries wrote it: failed
    /// again after a retry, its retries and failure kept.
    fn version_2_retried() -> Value {
        let mut state = version_1();
        state["v"] = json!(2);
        state["status"] = json!("failed");
        state["error"] = json!("step 1 attempt 2 failed: declined");
        state["retries"] = json!([{"action_id": "retry-1",
            "at": "2026-12-06T01:00:00Z", "step_index": 1}]);
        state["failed_seq"] = json!(5);
        state["record_version"] = json!(5);
        state["last_transition_seq"] = json!(5);
        state
    }

    #[test]
    fn a_state_of_version_2_loads_as_it_is_with_or_without_retries() {
        let retried = version_2_retried();
        let mut expected = retried.clone();
        expected["v"] = json!(STATE_VERSION);
        assert_eq!(upgrade(retried.clone()), Ok(expected));
        let state = decode(&bytes(&retried)).unwrap();
        assert_eq!(state.encoding_version, STATE_VERSION);
        assert_eq!(state.retries.len(), 1);
        assert_eq!(state.retries[0].action_id, "retry-1");
        assert_eq!(state.failure_seq(), Some(5));
        // Written back in the current version, with both.
        let written = serde_json::to_value(&state).unwrap();
        assert_eq!(written["v"], STATE_VERSION);
        assert_eq!(written["retries"], retried["retries"]);
        assert_eq!(written["failed_seq"], 5);
        assert_eq!(decode(&bytes(&written)).unwrap(), state);

        // Without them (a run failed before retries, or written back by a
        // binary that did not know them): no retry applied, and the run is
        // failed by its last transition.
        let mut before = retried;
        let fields = before.as_object_mut().unwrap();
        fields.remove("retries");
        fields.remove("failed_seq");
        before["last_transition_seq"] = json!(7);
        let state = decode(&bytes(&before)).unwrap();
        assert!(state.retries.is_empty());
        assert_eq!(state.failed_seq, None);
        assert_eq!(state.failure_seq(), Some(7));
        let written = serde_json::to_value(&state).unwrap();
        assert!(written.get("retries").is_none() && written.get("failed_seq").is_none());
        // A running one of version 2 is the same run in version 3.
        let mut running = version_1();
        running["v"] = json!(2);
        let mut current = running.clone();
        current["v"] = json!(3);
        assert_eq!(
            decode(&bytes(&running)).unwrap(),
            decode(&bytes(&current)).unwrap()
        );
    }

    #[test]
    fn a_state_of_version_3_loads_as_it_is_without_results_and_keeps_them_once_made() {
        let mut three = version_2_retried();
        three["v"] = json!(3);
        let mut expected = three.clone();
        expected["v"] = json!(STATE_VERSION);
        assert_eq!(upgrade(three.clone()), Ok(expected));
        let mut state = decode(&bytes(&three)).unwrap();
        assert_eq!(state.results, None);
        let written = serde_json::to_value(&state).unwrap();
        assert!(written.get("results").is_none(), "{written}");
        // A run that selects data keeps its results, and reads them back.
        let results = json!({"steps": {"reserve": {"held": 3}}});
        state.results = results.as_object().cloned();
        let written = serde_json::to_value(&state).unwrap();
        assert_eq!(written["results"], results);
        assert_eq!(decode(&bytes(&written)).unwrap(), state);
    }

    #[test]
    fn a_state_of_version_4_loads_as_it_is_without_lanes_and_keeps_them_once_made() {
        let mut four = version_2_retried();
        four["v"] = json!(4);
        four["results"] = json!({"steps": {"reserve": {"held": 3}}});
        let mut expected = four.clone();
        expected["v"] = json!(STATE_VERSION);
        assert_eq!(upgrade(four.clone()), Ok(expected));
        let mut state = decode(&bytes(&four)).unwrap();
        assert!(state.lanes.is_empty());
        let written = serde_json::to_value(&state).unwrap();
        assert!(written.get("lanes").is_none(), "{written}");
        // A run in a parallel step keeps its lanes, and reads them back.
        let lane = json!({"id": 0, "parallel": 0, "branch": 1, "status": "running", "step_index": 4,
                          "attempt": 1, "output": {"n": 1}});
        state.lanes = vec![serde_json::from_value(lane.clone()).unwrap()];
        let written = serde_json::to_value(&state).unwrap();
        assert_eq!(written["lanes"], json!([lane]));
        assert_eq!(decode(&bytes(&written)).unwrap(), state);
    }

    #[test]
    fn a_state_of_version_5_loads_as_it_is_without_compensations_and_keeps_them_once_made() {
        let mut five = version_2_retried();
        five["v"] = json!(5);
        let mut expected = five.clone();
        expected["v"] = json!(STATE_VERSION);
        assert_eq!(upgrade(five.clone()), Ok(expected));
        let mut state = decode(&bytes(&five)).unwrap();
        assert!(state.compensable.is_empty() && state.compensating.is_none());
        let written = serde_json::to_value(&state).unwrap();
        assert!(written.get("compensable").is_none(), "{written}");
        assert!(written.get("compensating").is_none(), "{written}");
        // A run that compensates keeps what is left to undo, and why.
        let left = json!({"step_index": 5, "step_key": "r1/step/0", "output": {"charge": "ch_1"}});
        let why =
            json!({"failed_step": 2, "cause": "not_retryable", "error": "no courier", "tries": 1});
        state.compensable = vec![serde_json::from_value(left.clone()).unwrap()];
        state.compensating = Some(serde_json::from_value(why.clone()).unwrap());
        let written = serde_json::to_value(&state).unwrap();
        assert_eq!(
            (&written["compensable"], &written["compensating"]),
            (&json!([left]), &why)
        );
        assert_eq!(decode(&bytes(&written)).unwrap(), state);
    }

    #[test]
    fn a_state_of_version_6_loads_as_it_is_without_a_parent_and_keeps_one_once_made() {
        let mut six = version_2_retried();
        six["v"] = json!(6);
        let mut expected = six.clone();
        expected["v"] = json!(7);
        assert_eq!(upgrade(six.clone()), Ok(expected));
        let mut state = decode(&bytes(&six)).unwrap();
        assert!(state.parent.is_none());
        let written = serde_json::to_value(&state).unwrap();
        assert!(written.get("parent").is_none(), "{written}");
        // A child run keeps its parent, and reads it back.
        let parent = json!({"run_id": "p1", "stamp": "6f1d9a1c-7a43-4c5e-9a55-0d1f1c1b2a3e"});
        state.parent = Some(serde_json::from_value(parent.clone()).unwrap());
        let written = serde_json::to_value(&state).unwrap();
        assert_eq!(written["parent"], parent);
        assert_eq!(decode(&bytes(&written)).unwrap(), state);
    }

    #[test]
    fn a_document_that_is_no_state_of_any_version_is_malformed() {
        for bad in [
            json!([1, 2]),
            json!({"v": 0}),
            json!({"v": "2"}),
            json!({"v": -1}),
            json!({"run_id": "r1"}),
        ] {
            assert!(
                matches!(decode(&bytes(&bad)), Err(StateDecodeError::Malformed(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            decode(b"{not json"),
            Err(StateDecodeError::Malformed(_))
        ));
    }

    /// Every state of `tests/fixtures/stored/` and `dead_letters/`, the
    /// shapes that shipped, loads as the current version (the integration
    /// test `upgrades` runs them to their end).
    #[test]
    fn every_stored_shape_that_shipped_loads() {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut states = 0;
        let files = ["stored", "dead_letters"]
            .iter()
            .flat_map(|dir| std::fs::read_dir(fixtures.join(dir)).unwrap())
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|x| x == "json"));
        for path in files {
            let fixture: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            let runs = fixture["rows"]["runs"]
                .as_array()
                .map_or(&[][..], Vec::as_slice);
            for run in runs {
                let state = decode(&bytes(&run["state"]))
                    .unwrap_or_else(|e| panic!("{}: {}: {e}", path.display(), run["run_id"]));
                assert_eq!(state.encoding_version, STATE_VERSION);
                assert_eq!(state.run_id, run["run_id"].as_str().unwrap());
                states += 1;
            }
        }
        assert!(states >= 10, "{states} states");
    }

    #[test]
    fn the_current_version_is_read_as_written() {
        let mut current = version_1();
        current["v"] = json!(STATE_VERSION);
        assert_eq!(upgrade(current.clone()), Ok(current.clone()));
        assert_eq!(version_of(&current), Ok(u64::from(STATE_VERSION)));
    }
}
