//! Fingerprints: what makes two requests "the same" on every dedup path.
//!
//! A fingerprint is the SHA-256 (hex) of a request's meaning written as
//! canonical JSON: object keys sorted, no whitespace. Envelope fields (a
//! correlation id, timestamps, the order of keys) do not take part, so a
//! redelivered or re-sent request matches its first copy, and a request
//! that reuses a key with another meaning does not. The routing plane
//! compares them for server-chosen starts, the fold for client-chosen
//! starts and for signals.
//!
//! In: a [`RunStart`], or a signal's name and payload. Out: 64 hex
//! characters. Guarantees: pure; the order of object keys never changes a
//! fingerprint, a change of any field that takes part does; the run id, a
//! correlation id and a signal's id take no part.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::input::RunStart;

/// The fingerprint of a start request: its tenant, pool, workflow,
/// requested version (not the one it resolved to) and input. The run id is
/// not part of it: it is the key the fingerprint is stored under. A child
/// run's parent takes part only when there is one, so that every start
/// without one keeps the fingerprint it always had.
pub fn start(start: &RunStart) -> String {
    let mut meaning = json!({
        "tenant": start.tenant,
        "pool": start.pool,
        "workflow": start.workflow,
        "workflow_version": start.workflow_version,
        "input": start.input,
    });
    if let (Some(parent), Value::Object(map)) = (&start.parent, &mut meaning) {
        map.insert(
            "parent".into(),
            json!({"run_id": parent.run_id, "stamp": parent.stamp.to_string()}),
        );
    }
    digest(&meaning)
}

/// The fingerprint of a signal: its name and payload (the `signal_id` is
/// the key it is stored under).
pub fn signal(name: &str, payload: &Value) -> String {
    digest(&json!({"name": name, "payload": payload}))
}

fn digest(meaning: &Value) -> String {
    let mut canonical = String::new();
    write_canonical(meaning, &mut canonical);
    let digest = Sha256::digest(canonical.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                write_canonical(&map[k.as_str()], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_does_not_matter_and_meaning_does() {
        let a = signal("poke", &json!({"a": 1, "b": [1, {"y": 2, "x": 1}]}));
        let b = signal("poke", &json!({"b": [1, {"x": 1, "y": 2}], "a": 1}));
        assert_eq!(a, b);
        assert_ne!(
            a,
            signal("poke", &json!({"a": 1, "b": [{"x": 1, "y": 2}, 1]}))
        );
        assert_ne!(
            a,
            signal("prod", &json!({"a": 1, "b": [1, {"x": 1, "y": 2}]}))
        );
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn a_start_is_its_meaning_not_its_envelope() {
        let first = RunStart {
            run_id: "r1".into(),
            tenant: "acme".into(),
            workflow: "w".into(),
            workflow_version: None,
            pool: "default".into(),
            input: json!({"n": 1}),
            correlation_id: Some("c1".into()),
            parent: None,
        };
        let resent = RunStart {
            run_id: "r2".into(),
            correlation_id: None,
            ..first.clone()
        };
        assert_eq!(start(&first), start(&resent));
        for changed in [
            RunStart {
                input: json!({"n": 2}),
                ..first.clone()
            },
            RunStart {
                workflow_version: Some(1),
                ..first.clone()
            },
            RunStart {
                pool: "p".into(),
                ..first.clone()
            },
            RunStart {
                tenant: "other".into(),
                ..first.clone()
            },
        ] {
            assert_ne!(start(&first), start(&changed));
        }
    }
}
