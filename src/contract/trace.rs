//! W3C Trace Context (`traceparent`, `tracestate`): the trace a run belongs
//! to, as it crosses HTTP and every Kafka hop.
//!
//! A trace context arrives on a start, signal or cancel over HTTP and as the
//! headers of any input on Kafka; the run keeps it in its state, and every
//! effect of the run carries it on, with a span id of the hop that made the
//! effect ([`TraceContext::child`]). A worker answers with the same trace
//! id.
//!
//! In: header values as bytes (one or more of each name). Out: a
//! [`TraceContext`], or `None`. Guarantees: pure, no clock and no
//! randomness (the caller picks span ids); parsing never panics; a
//! malformed `traceparent` yields `None` (the input is taken as untraced,
//! never refused); a malformed `tracestate` is dropped and the
//! `traceparent` kept, and one over [`MAX_TRACESTATE_LEN`] is cut by whole
//! entries, as the W3C recommendation says; what is written back is always
//! version `00`, lowercase, 55 characters.

use serde::{Deserialize, Deserializer, Serialize};

/// Longest `tracestate` carried on: the length W3C asks every vendor to
/// propagate. A longer one loses whole entries, the longest first.
pub const MAX_TRACESTATE_LEN: usize = 512;
/// Most entries of a `tracestate` (W3C's bound): more make it invalid.
pub const MAX_TRACESTATE_ENTRIES: usize = 32;
/// An entry longer than this is the first to go when a `tracestate` is cut.
const LONG_TRACESTATE_ENTRY: usize = 128;
/// The length of a version-`00` `traceparent`.
pub const TRACEPARENT_LEN: usize = 55;
/// The flags Ductor carries on: `sampled` and `random-trace-id`; the rest
/// are reserved and written as zero.
const KNOWN_FLAGS: u8 = 0b11;
/// The `sampled` flag.
pub const FLAG_SAMPLED: u8 = 0b01;

/// One hop's place in a trace: the trace, the span that made the hop (the
/// parent of whatever the receiver does), its flags, and the vendors'
/// `tracestate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    /// The `parent-id` field of the `traceparent`: the sender's span.
    pub span_id: [u8; 8],
    pub flags: u8,
    /// Valid and within [`MAX_TRACESTATE_LEN`], or `None`.
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The context of `traceparent` (exactly one value) with the
    /// `tracestate` values joined, or `None` when there is no valid
    /// `traceparent`: none, two (W3C: ambiguous, so neither), or one that
    /// does not parse.
    pub fn from_values<'a>(
        traceparents: impl IntoIterator<Item = &'a [u8]>,
        tracestates: impl IntoIterator<Item = &'a [u8]>,
    ) -> Option<TraceContext> {
        let mut parents = traceparents.into_iter();
        let parent = parents.next()?;
        if parents.next().is_some() {
            return None;
        }
        let (trace_id, span_id, flags) = parse_traceparent(std::str::from_utf8(parent).ok()?)?;
        // Values that are not text make the whole tracestate invalid.
        let values: Option<Vec<&str>> = tracestates
            .into_iter()
            .map(|v| std::str::from_utf8(v).ok())
            .collect();
        Some(TraceContext {
            trace_id,
            span_id,
            flags,
            tracestate: values.and_then(|v| bound_tracestate(&v.join(","))),
        })
    }

    /// The `traceparent` header value: version `00`.
    pub fn traceparent(&self) -> String {
        let mut out = String::with_capacity(TRACEPARENT_LEN);
        out.push_str("00-");
        push_hex(&mut out, &self.trace_id);
        out.push('-');
        push_hex(&mut out, &self.span_id);
        out.push('-');
        push_hex(&mut out, &[self.flags & KNOWN_FLAGS]);
        out
    }

    /// The context of the next hop: the same trace, flags and
    /// `tracestate`, from span `span_id`.
    pub fn child(&self, span_id: [u8; 8]) -> TraceContext {
        TraceContext {
            span_id,
            ..self.clone()
        }
    }

    /// Whether the sender recorded its span.
    pub fn sampled(&self) -> bool {
        self.flags & FLAG_SAMPLED != 0
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        let mut out = String::with_capacity(32);
        push_hex(&mut out, &self.trace_id);
        out
    }

    /// The header pairs (name, value) to write for this context.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, String)> {
        let state = self.tracestate.clone();
        std::iter::once((super::headers::TRACEPARENT, self.traceparent()))
            .chain(state.map(|s| (super::headers::TRACESTATE, s)))
    }
}

/// Parses a `traceparent`: `version-trace_id-parent_id-flags`, lowercase
/// hex. Version `ff` is invalid; a version above `00` may carry more after
/// a `-`, which is ignored; ids of all zeros are invalid.
pub fn parse_traceparent(value: &str) -> Option<([u8; 16], [u8; 8], u8)> {
    let bytes = value.as_bytes();
    if bytes.len() < TRACEPARENT_LEN {
        return None;
    }
    let version = hex_byte(&bytes[0..2])?;
    if version == 0xff {
        return None;
    }
    if version == 0 && bytes.len() != TRACEPARENT_LEN {
        return None;
    }
    if bytes.len() > TRACEPARENT_LEN && bytes[TRACEPARENT_LEN] != b'-' {
        return None;
    }
    if bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
        return None;
    }
    let mut trace_id = [0u8; 16];
    for (i, out) in trace_id.iter_mut().enumerate() {
        *out = hex_byte(&bytes[3 + 2 * i..5 + 2 * i])?;
    }
    let mut span_id = [0u8; 8];
    for (i, out) in span_id.iter_mut().enumerate() {
        *out = hex_byte(&bytes[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&bytes[53..55])?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some((trace_id, span_id, flags))
}

/// A `tracestate` as Ductor carries it on: its entries, each checked
/// against W3C's grammar, without empty ones and blanks around them, and
/// cut by whole entries to [`MAX_TRACESTATE_LEN`] (the ones over 128
/// characters first, then from the end). `None` when it is empty or
/// invalid (an entry that breaks the grammar, a key twice, more than
/// [`MAX_TRACESTATE_ENTRIES`] entries).
pub fn bound_tracestate(value: &str) -> Option<String> {
    let mut entries: Vec<&str> = Vec::new();
    for entry in value.split(',') {
        let entry = entry.trim_matches([' ', '\t']);
        if entry.is_empty() {
            continue;
        }
        let key = entry_key(entry)?;
        if entries.iter().any(|e| entry_key(e) == Some(key)) {
            return None;
        }
        entries.push(entry);
        if entries.len() > MAX_TRACESTATE_ENTRIES {
            return None;
        }
    }
    let len = |entries: &[&str]| {
        entries.iter().map(|e| e.len()).sum::<usize>() + entries.len().saturating_sub(1)
    };
    while len(&entries) > MAX_TRACESTATE_LEN {
        match entries.iter().position(|e| e.len() > LONG_TRACESTATE_ENTRY) {
            Some(long) => entries.remove(long),
            None => entries.pop().unwrap_or_default(),
        };
    }
    (!entries.is_empty()).then(|| entries.join(","))
}

/// The key of a `tracestate` entry `key=value`, if the entry keeps W3C's
/// grammar.
fn entry_key(entry: &str) -> Option<&str> {
    let (key, value) = entry.split_once('=')?;
    (valid_key(key) && valid_value(value)).then_some(key)
}

/// `simple-key` or `tenant-id@system-id`.
fn valid_key(key: &str) -> bool {
    let rest = |s: &[u8]| {
        s.iter()
            .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/".contains(&b))
    };
    let b = key.as_bytes();
    match key.split_once('@') {
        None => !b.is_empty() && b.len() <= 256 && b[0].is_ascii_lowercase() && rest(&b[1..]),
        Some((tenant, system)) => {
            let (t, s) = (tenant.as_bytes(), system.as_bytes());
            !t.is_empty()
                && t.len() <= 241
                && (t[0].is_ascii_lowercase() || t[0].is_ascii_digit())
                && rest(&t[1..])
                && !s.is_empty()
                && s.len() <= 14
                && s[0].is_ascii_lowercase()
                && rest(&s[1..])
        }
    }
}

/// Up to 256 printable ASCII characters but `,` and `=`, not ending in a
/// space.
fn valid_value(value: &str) -> bool {
    let b = value.as_bytes();
    !b.is_empty()
        && b.len() <= 256
        && b.iter()
            .all(|&c| (0x20..=0x7e).contains(&c) && c != b',' && c != b'=')
        && b[b.len() - 1] != b' '
}

/// Two lowercase hex digits.
fn hex_byte(pair: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(digit(pair[0])? << 4 | digit(pair[1])?)
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
}

/// How a run's state document keeps its trace context.
#[derive(Serialize, Deserialize)]
struct Stored {
    traceparent: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tracestate: Option<String>,
}

impl Serialize for TraceContext {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Stored {
            traceparent: self.traceparent(),
            tracestate: self.tracestate.clone(),
        }
        .serialize(s)
    }
}

/// Reads a stored trace context leniently: one that no longer parses is
/// dropped, so that a run's state always loads.
pub fn deserialize_lenient<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<TraceContext>, D::Error> {
    let stored = Option::<serde_json::Value>::deserialize(d)?;
    Ok(stored
        .and_then(|v| serde_json::from_value::<Stored>(v).ok())
        .and_then(|s| {
            TraceContext::from_values(
                [s.traceparent.as_bytes()],
                s.tracestate.as_deref().map(str::as_bytes),
            )
        }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn context(parent: &str, state: Option<&str>) -> Option<TraceContext> {
        TraceContext::from_values([parent.as_bytes()], state.map(str::as_bytes))
    }

    #[test]
    fn a_valid_traceparent_is_read_and_written_back_the_same() {
        let cx = context(PARENT, None).expect("valid");
        assert_eq!(cx.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.span_id, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert!(cx.sampled());
        assert_eq!(cx.traceparent(), PARENT);
        let child = cx.child([1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            child.traceparent(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0102030405060708-01"
        );
        assert_eq!(child.trace_id, cx.trace_id);
    }

    #[test]
    fn a_malformed_traceparent_is_no_context() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-4bf92f3577b34da6a3ce929d0e0e473--00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\u{e9}",
        ];
        for value in bad {
            assert_eq!(context(value, None), None, "{value:?}");
        }
        assert_eq!(
            TraceContext::from_values([&[0xff, 0xfe][..]], None::<&[u8]>),
            None
        );
        assert_eq!(
            TraceContext::from_values([PARENT.as_bytes(), PARENT.as_bytes()], None::<&[u8]>),
            None,
            "two traceparents are ambiguous"
        );
        assert_eq!(TraceContext::from_values([], None::<&[u8]>), None);
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields_and_written_as_00() {
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-what-comes-next";
        let cx = context(later, None).expect("a later version is read");
        assert_eq!(cx.traceparent(), PARENT.replace("-01", "-03"));
        // Reserved flags are not carried on.
        let flagged = context(&PARENT.replace("-01", "-ff"), None).unwrap();
        assert!(flagged.traceparent().ends_with("-03"));
    }

    #[test]
    fn tracestate_is_kept_when_valid_and_dropped_when_not() {
        let cx = context(PARENT, Some(" congo=t61rcWkgMzE ,, rojo=00f067aa0ba902b7 ")).unwrap();
        assert_eq!(
            cx.tracestate.as_deref(),
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        );
        for bad in [
            "congo",
            "Congo=1",
            "congo=1,congo=2",
            "congo=a=b",
            "a@1=x",
            "t@sys=",
            "k=tab\there",
        ] {
            let cx = context(PARENT, Some(bad)).expect("the traceparent stays");
            assert_eq!(cx.tracestate, None, "{bad:?}");
        }
        let tenant = context(PARENT, Some("1tenant@vendor=v,x*y/z_-=ok")).unwrap();
        assert_eq!(
            tenant.tracestate.as_deref(),
            Some("1tenant@vendor=v,x*y/z_-=ok")
        );
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert_eq!(bound_tracestate(&many.join(",")), None);
        assert_eq!(bound_tracestate(""), None);
        // Two header values are one list.
        let joined =
            TraceContext::from_values([PARENT.as_bytes()], [&b"a=1"[..], &b"b=2"[..]]).unwrap();
        assert_eq!(joined.tracestate.as_deref(), Some("a=1,b=2"));
        let binary =
            TraceContext::from_values([PARENT.as_bytes()], [&b"a=1"[..], &[0xff][..]]).unwrap();
        assert_eq!(binary.tracestate, None);
    }

    #[test]
    fn a_long_tracestate_loses_its_longest_entries_first_then_its_last() {
        let long = format!("big={}", "x".repeat(200));
        let small: Vec<String> = (0..20)
            .map(|i| format!("k{i:02}={}", "v".repeat(16)))
            .collect();
        let mut entries = small.clone();
        entries.insert(3, long);
        let cut = bound_tracestate(&entries.join(",")).expect("something is left");
        assert!(cut.len() <= MAX_TRACESTATE_LEN, "{}", cut.len());
        assert!(!cut.contains("big="), "the long entry goes first");
        assert_eq!(cut, small.join(","), "20 entries of 20 bytes fit");
        let more: Vec<String> = (0..30)
            .map(|i| format!("k{i:02}={}", "v".repeat(16)))
            .collect();
        let cut = bound_tracestate(&more.join(",")).unwrap();
        assert!(cut.len() <= MAX_TRACESTATE_LEN);
        assert!(cut.starts_with("k00="), "entries go from the end");
        assert!(!cut.contains("k29="));
    }

    #[test]
    fn a_stored_context_round_trips_and_a_broken_one_is_dropped() {
        #[derive(Serialize, Deserialize)]
        struct Doc {
            #[serde(default, deserialize_with = "deserialize_lenient")]
            trace: Option<TraceContext>,
        }
        let cx = context(PARENT, Some("a=1")).unwrap();
        let text = serde_json::to_string(&Doc {
            trace: Some(cx.clone()),
        })
        .unwrap();
        assert_eq!(
            text,
            format!(r#"{{"trace":{{"traceparent":"{PARENT}","tracestate":"a=1"}}}}"#)
        );
        let back: Doc = serde_json::from_str(&text).unwrap();
        assert_eq!(back.trace, Some(cx));
        for broken in [
            r#"{"trace":{"traceparent":"nonsense"}}"#,
            r#"{"trace":7}"#,
            r#"{"trace":null}"#,
            r#"{}"#,
        ] {
            let doc: Doc = serde_json::from_str(broken).expect("loads");
            assert_eq!(doc.trace, None, "{broken}");
        }
    }
}
