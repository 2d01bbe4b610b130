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
//! 2. `"v": 2`: version 1's newer form with its version written.
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
    if version == 1 {
        document = from_version_1(document);
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
        let message = StateDecodeError::Newer { found: 3, known: 2 }.to_string();
        assert!(
            message.contains("version 3") && message.contains("version 2"),
            "{message}"
        );
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
