//! A dead letter as its row records it: what of the input it keeps, and
//! what can be read from it.
//!
//! In: the refused message's position, key, headers and value, the stage,
//! class and error, and `dead_letters.max_value_bytes`. Out: a
//! [`LetterRow`], bound as the insert binds it. Guarantees: pure; the value
//! keeps its first `max_value_bytes` bytes and its original length; a key
//! or headers over the bound are left out and flagged, never cut (a cut key
//! or header would replay as another input); the signature header is never
//! kept; every text is one Postgres can store (no U+0000), and every header
//! value comes back byte for byte ([`Bytes`]); the tenant, run id and type
//! are read only from a value that is a JSON object naming them as strings
//! of at most [`MAX_ID_LEN`] bytes, else left empty.

use base64::Engine as _;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::contract::input::MAX_ID_LEN;
use crate::contract::signature::SIGNATURE;

/// Bytes as the operator API shows them and `dead_letters.headers` stores
/// them: UTF-8 text when they are (and hold no U+0000, which `jsonb` and
/// `text` cannot), else base64.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Bytes {
    Utf8(String),
    Base64(String),
}

impl Bytes {
    pub fn of(bytes: &[u8]) -> Bytes {
        match std::str::from_utf8(bytes) {
            Ok(text) if !text.contains('\0') => Bytes::Utf8(text.to_owned()),
            _ => Bytes::Base64(base64_engine().encode(bytes)),
        }
    }

    /// The bytes themselves; `None` for base64 that does not decode.
    pub fn to_vec(&self) -> Option<Vec<u8>> {
        match self {
            Bytes::Utf8(text) => Some(text.as_bytes().to_vec()),
            Bytes::Base64(b64) => base64_engine().decode(b64).ok(),
        }
    }
}

fn base64_engine() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// One header of an input, in the order it carried them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Header {
    pub key: String,
    /// `null` for a header without a value.
    pub value: Option<Bytes>,
}

/// The row of one dead letter, as [`super::store::insert`] writes it.
#[derive(Debug, Clone, PartialEq)]
pub struct LetterRow {
    pub source_topic: String,
    pub source_partition: i32,
    pub source_offset: i64,
    pub stage: &'static str,
    pub class: String,
    pub error: String,
    pub key: Option<Vec<u8>>,
    pub key_dropped: bool,
    /// A JSON array of [`Header`].
    pub headers: Value,
    pub headers_dropped: bool,
    pub value: Option<Vec<u8>>,
    /// The original value's length.
    pub value_bytes: i32,
    pub read: Read,
}

/// What a letter's value says of itself, when it can be read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Read {
    pub input_type: Option<String>,
    pub tenant: Option<String>,
    pub run_id: Option<String>,
}

/// What of a refused input its row keeps.
#[derive(Debug, Clone, Copy)]
pub struct Refused<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    /// The input's headers, in order.
    pub headers: &'a [(&'a str, Option<&'a [u8]>)],
    pub value: Option<&'a [u8]>,
}

impl LetterRow {
    /// The row of `input`, refused at `stage` with `class` and `error`,
    /// keeping at most `max_bytes` of its value, key and headers each.
    pub fn of(
        input: Refused<'_>,
        stage: &'static str,
        class: &str,
        error: &str,
        max_bytes: usize,
    ) -> LetterRow {
        let kept: Vec<&(&str, Option<&[u8]>)> = input
            .headers
            .iter()
            .filter(|(k, _)| *k != SIGNATURE)
            .collect();
        let header_bytes: usize = kept
            .iter()
            .map(|(k, v)| k.len() + v.map_or(0, <[u8]>::len))
            .sum();
        let headers_dropped = header_bytes > max_bytes;
        let headers = if headers_dropped {
            Vec::new()
        } else {
            kept.iter()
                .map(|(k, v)| Header {
                    key: (*k).to_owned(),
                    value: v.map(Bytes::of),
                })
                .collect()
        };
        let key_dropped = input.key.is_some_and(|k| k.len() > max_bytes);
        let value_len = input.value.map_or(0, <[u8]>::len);
        LetterRow {
            source_topic: input.topic.to_owned(),
            source_partition: input.partition,
            source_offset: input.offset,
            stage,
            class: storable(class),
            error: storable(error),
            key: input.key.filter(|_| !key_dropped).map(<[u8]>::to_vec),
            key_dropped,
            headers: serde_json::to_value(headers).unwrap_or_else(|_| Value::Array(Vec::new())),
            headers_dropped,
            value: input.value.map(|v| v[..v.len().min(max_bytes)].to_vec()),
            value_bytes: i32::try_from(value_len).unwrap_or(i32::MAX),
            read: input
                .value
                .filter(|v| v.len() <= max_bytes)
                .map(read)
                .unwrap_or_default(),
        }
    }
}

/// `s` as Postgres stores text: U+0000 replaced.
fn storable(s: &str) -> String {
    s.replace('\0', "\u{FFFD}")
}

/// The type, tenant and run id a value names, each when it is a string
/// Postgres can store and no longer than an id may be.
pub fn read(value: &[u8]) -> Read {
    #[derive(Deserialize)]
    struct Probe {
        #[serde(rename = "type")]
        input_type: Option<Value>,
        tenant: Option<Value>,
        run_id: Option<Value>,
    }
    let Ok(probe) = serde_json::from_slice::<Probe>(value) else {
        return Read::default();
    };
    let text = |v: Option<Value>| match v {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_ID_LEN && !s.contains('\0') => {
            Some(s)
        }
        _ => None,
    };
    Read {
        input_type: text(probe.input_type),
        tenant: text(probe.tenant),
        run_id: text(probe.run_id),
    }
}

/// The headers a row keeps, as the record of a replay carries them.
pub fn headers_of(stored: &Value) -> Vec<Header> {
    serde_json::from_value(stored.clone()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused<'a>(headers: &'a [(&'a str, Option<&'a [u8]>)], value: &'a [u8]) -> Refused<'a> {
        Refused {
            topic: "t.requests",
            partition: 2,
            offset: 41,
            key: Some(b"run-1"),
            headers,
            value: Some(value),
        }
    }

    #[test]
    fn a_row_keeps_the_value_whole_up_to_the_bound_and_its_length_beyond() {
        let value = br#"{"type":"run.start","tenant":"acme","run_id":"r-1"}"#;
        let row = LetterRow::of(refused(&[], value), "decode", "invalid", "no", 1 << 20);
        assert_eq!(row.value.as_deref(), Some(&value[..]));
        assert_eq!(row.value_bytes, value.len() as i32);
        assert_eq!(
            row.read,
            Read {
                input_type: Some("run.start".into()),
                tenant: Some("acme".into()),
                run_id: Some("r-1".into())
            }
        );
        let row = LetterRow::of(refused(&[], value), "decode", "invalid", "no", 10);
        assert_eq!(row.value.as_deref(), Some(&value[..10]));
        assert_eq!(row.value_bytes, value.len() as i32);
        assert_eq!(row.read, Read::default(), "a cut value is not read");
    }

    #[test]
    fn headers_keep_order_repeats_and_bytes_but_never_the_signature() {
        let headers: [(&str, Option<&[u8]>); 5] = [
            ("a", Some(b"1")),
            (SIGNATURE, Some(b"t=1,v2=00")),
            ("a", Some(b"2")),
            ("bin", Some(&[0xff, 0x00, 0x01])),
            ("none", None),
        ];
        let row = LetterRow::of(refused(&headers, b"{}"), "decode", "c", "e", 1 << 20);
        let back = headers_of(&row.headers);
        let keys: Vec<&str> = back.iter().map(|h| h.key.as_str()).collect();
        assert_eq!(keys, ["a", "a", "bin", "none"]);
        assert_eq!(back[1].value, Some(Bytes::Utf8("2".into())));
        assert_eq!(
            back[2].value.as_ref().and_then(Bytes::to_vec),
            Some(vec![0xff, 0x00, 0x01])
        );
        assert_eq!(back[3].value, None);
        assert!(!row.headers_dropped);
        // Text with U+0000 is base64 too: jsonb cannot hold it.
        assert!(matches!(Bytes::of(b"a\0b"), Bytes::Base64(_)));
    }

    #[test]
    fn a_key_or_headers_over_the_bound_are_dropped_whole_and_flagged() {
        let big = vec![b'h'; 64];
        let headers: [(&str, Option<&[u8]>); 1] = [("garbage", Some(&big))];
        let mut input = refused(&headers, b"{}");
        let long_key = vec![b'k'; 64];
        input.key = Some(&long_key);
        let row = LetterRow::of(input, "decode", "c", "e", 32);
        assert!(row.headers_dropped && row.key_dropped);
        assert_eq!(row.headers, Value::Array(Vec::new()));
        assert_eq!(row.key, None);
        assert_eq!(row.value.as_deref(), Some(&b"{}"[..]));
    }

    #[test]
    fn only_plain_short_strings_are_read_and_texts_hold_no_nul() {
        let long = "x".repeat(MAX_ID_LEN + 1);
        for value in [
            format!(r#"{{"tenant":"{long}"}}"#),
            r#"{"tenant":"a\u0000b"}"#.to_owned(),
            r#"{"tenant":7}"#.to_owned(),
            r#"{"tenant":"a","tenant":"b"}"#.to_owned(),
            "[1,2]".to_owned(),
            "{not json".to_owned(),
        ] {
            assert_eq!(read(value.as_bytes()).tenant, None, "{value}");
        }
        let row = LetterRow::of(refused(&[], b"{}"), "decode", "c", "bad \0 byte", 64);
        assert!(!row.error.contains('\0'));
    }
}
