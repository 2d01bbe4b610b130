//! The formats of the wire's fields as JSON Schemas: ids, names, UUIDs,
//! timestamps and the schema version, each built from the bound that the
//! decoder enforces, so that the published schemas and the decoder cannot
//! disagree on a limit.
//!
//! In: nothing (types used as `#[schemars(with = ...)]`). Out: one JSON
//! Schema per format. Guarantees: every bound is the decoder's constant;
//! pure.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};

use super::input::{MAX_ID_LEN, SCHEMA_VERSION};
use super::names::MAX_NAME_LEN;

/// `schema_version`: the only version this coordinator reads and writes.
pub struct Version;

impl JsonSchema for Version {
    fn schema_name() -> Cow<'static, str> {
        "SchemaVersion".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "The contract's version; a message of another version is dead-lettered as `unsupported_version`.",
            "type": "integer",
            "const": SCHEMA_VERSION,
        })
    }
}

/// `run_id` and `tenant`: `[A-Za-z0-9_.:-]{1,128}`.
pub struct Id;

impl JsonSchema for Id {
    fn schema_name() -> Cow<'static, str> {
        "Id".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_ID_LEN,
            "pattern": format!("^[A-Za-z0-9_.:-]{{1,{MAX_ID_LEN}}}$"),
        })
    }
}

/// Workflow and pool names: `[A-Za-z0-9_.-]{1,100}`.
pub struct Name;

impl JsonSchema for Name {
    fn schema_name() -> Cow<'static, str> {
        "Name".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_NAME_LEN,
            "pattern": format!("^[A-Za-z0-9_.-]{{1,{MAX_NAME_LEN}}}$"),
        })
    }
}

/// An instant: RFC 3339 in UTC (`Z`).
pub struct Timestamp;

impl JsonSchema for Timestamp {
    fn schema_name() -> Cow<'static, str> {
        "Timestamp".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "format": "date-time",
        })
    }
}

/// A string of at most `N` characters (Unicode scalar values, as JSON
/// Schema's `maxLength` counts them), at least `MIN`.
pub struct Text<const MIN: usize, const N: usize>;

impl<const MIN: usize, const N: usize> JsonSchema for Text<MIN, N> {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        format!("Text{MIN}To{N}").into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "minLength": MIN,
            "maxLength": N,
        })
    }
}

/// Any JSON value.
pub struct AnyValue;

impl JsonSchema for AnyValue {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "AnyValue".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "Any JSON value, within the input's size and shape limits (`coordinator.max_input_bytes`, `coordinator.max_json_depth` and the rest)."
        })
    }
}
