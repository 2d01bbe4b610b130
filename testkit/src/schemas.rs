//! The contract's committed JSON Schemas (`schemas/` at the workspace's
//! root), as the harnesses check what they see against them: every effect's
//! payload and headers, every dead letter's headers, and every input the
//! coordinator accepted.
//!
//! In: a record's headers and payload (or a JSON value). Out: `Ok`, or what
//! does not hold, naming the schema and the first failing path. Guarantees:
//! the schemas are the committed files, the ones users are given, read once
//! per process; formats (`uuid`, `date-time`) are checked, not only shapes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::LazyLock;

use serde_json::{Map, Value};

/// The workspace's `schemas/` directory.
pub fn dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../schemas"))
}

/// Which kind of record a set of headers marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// Published by the outbox: it carries `ce_type`.
    Effect,
    /// Published by the ingress to the dead-letter topic.
    DeadLetter,
    /// Anything else: an input, or a user's record.
    Other,
}

impl Record {
    pub fn of(headers: &[(String, Vec<u8>)]) -> Record {
        let has = |name: &str| headers.iter().any(|(k, _)| k == name);
        if has(ductor::contract::headers::DLQ_STAGE) {
            Record::DeadLetter
        } else if has(ductor::contract::headers::CE_TYPE) {
            Record::Effect
        } else {
            Record::Other
        }
    }
}

struct Catalogue {
    /// By message `type`.
    messages: HashMap<String, jsonschema::Validator>,
    /// By file stem under `headers/`.
    headers: HashMap<String, jsonschema::Validator>,
}

static CATALOGUE: LazyLock<Catalogue> = LazyLock::new(|| Catalogue {
    messages: load("messages"),
    headers: load("headers"),
});

fn load(sub: &str) -> HashMap<String, jsonschema::Validator> {
    let dir = dir().join(sub);
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading the schemas in {}: {e}", dir.display()));
    let mut out = HashMap::new();
    for entry in entries {
        let path = entry.expect("listing the schemas").path();
        let Some(stem) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(name) = stem.strip_suffix(".json") else {
            continue;
        };
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let schema: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(&schema)
            .unwrap_or_else(|e| panic!("{} is not a valid schema: {e}", path.display()));
        out.insert(name.to_owned(), validator);
    }
    out
}

fn check(validator: &jsonschema::Validator, what: &str, value: &Value) -> Result<(), String> {
    match validator.iter_errors(value).next() {
        None => Ok(()),
        Some(e) => Err(format!(
            "{what}: {} at {}",
            e.to_string().chars().take(300).collect::<String>(),
            e.instance_path()
        )),
    }
}

/// Checks a message against the schema of its `type`; a value without a
/// known `type` fails.
pub fn check_message(value: &Value) -> Result<(), String> {
    let kind = value.get("type").and_then(Value::as_str).unwrap_or("");
    let validator = CATALOGUE
        .messages
        .get(kind)
        .ok_or_else(|| format!("no schema for a message of type {kind:?}"))?;
    check(validator, &format!("messages/{kind}.json"), value)
}

/// Checks a set of headers (UTF-8 values) against `headers/<set>.json`.
pub fn check_headers(set: &str, headers: &[(String, Vec<u8>)]) -> Result<(), String> {
    let validator = CATALOGUE
        .headers
        .get(set)
        .ok_or_else(|| format!("no schema headers/{set}.json"))?;
    let mut object = Map::new();
    for (name, value) in headers {
        let text = std::str::from_utf8(value).map_err(|_| format!("header {name} is not UTF-8"))?;
        object.insert(name.clone(), Value::String(text.to_owned()));
    }
    check(
        validator,
        &format!("headers/{set}.json"),
        &Value::Object(object),
    )
}

/// Checks a record Ductor published: an effect's payload and headers, or a
/// dead letter's headers (its payload is the refused input, as sent).
/// Other records pass: they are not Ductor's to answer for.
pub fn check_published(headers: &[(String, Vec<u8>)], payload: &[u8]) -> Result<(), String> {
    match Record::of(headers) {
        Record::Effect => {
            check_headers("effect", headers)?;
            let value: Value = serde_json::from_slice(payload)
                .map_err(|e| format!("an effect's payload is not JSON: {e}"))?;
            check_message(&value)
        }
        Record::DeadLetter => check_headers("dead-letter", headers),
        Record::Other => Ok(()),
    }
}
