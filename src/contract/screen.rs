//! The shape screen: refuses, before anything is parsed or stored, the JSON
//! that is valid JSON but that Ductor cannot keep as it was sent.
//!
//! Postgres refuses U+0000 in `jsonb` and `text`, and unpaired UTF-16
//! surrogate escapes in `jsonb`; a number that a double cannot hold exactly
//! would be written back with another value; deep, wide or long values cost
//! memory and CPU out of proportion to their bytes; a duplicated key means
//! one thing to one parser and another to the next. Each is refused here,
//! with its own class, so it reaches the dead-letter topic (or a 422) instead
//! of failing a batch statement or changing meaning on the way.
//!
//! The screen is one pass over the bytes, pure, and never panics. It is
//! lenient about JSON syntax itself: a malformed value passes the screen
//! and is refused by the parser that runs after it.
//!
//! In: the bytes of one JSON text and its [`ShapeLimits`] (from
//! `coordinator.max_json_depth` and its neighbours). Out: `Ok`, or a
//! [`ShapeError`]: the [`Violation`], its byte offset and a message that
//! never quotes the bytes. Guarantees: a value that passes the screen and
//! parses is the same value once written back and read again (a randomized
//! test holds it to that).

use std::collections::HashSet;

/// The bounds a value must keep, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeLimits {
    /// Deepest nesting of arrays and objects (the top level is depth 1).
    pub max_depth: usize,
    /// Longest string, in bytes once escapes are decoded (keys included).
    pub max_string_bytes: usize,
    /// Most elements of one array.
    pub max_array_items: usize,
    /// Most members of one object.
    pub max_object_keys: usize,
}

impl Default for ShapeLimits {
    fn default() -> Self {
        ShapeLimits {
            max_depth: 64,
            max_string_bytes: 262_144,
            max_array_items: 10_000,
            max_object_keys: 1_000,
        }
    }
}

/// What the screen refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Violation {
    /// U+0000 in a string or key, escaped or raw.
    Nul,
    /// A `\uD800`-`\uDFFF` escape that is not half of a surrogate pair.
    UnpairedSurrogate,
    /// A number that would not be written back with the same value: an
    /// integer outside the 64-bit range, or a decimal with more precision
    /// (or range) than a double.
    InexactNumber,
    TooDeep,
    StringTooLong,
    ArrayTooLong,
    ObjectTooWide,
    /// The same key twice in one object.
    DuplicateKey,
}

impl Violation {
    /// Stable snake_case name, the dead-letter class and the HTTP error code.
    pub fn as_str(self) -> &'static str {
        match self {
            Violation::Nul => "nul_character",
            Violation::UnpairedSurrogate => "unpaired_surrogate",
            Violation::InexactNumber => "inexact_number",
            Violation::TooDeep => "too_deep",
            Violation::StringTooLong => "string_too_long",
            Violation::ArrayTooLong => "array_too_long",
            Violation::ObjectTooWide => "object_too_wide",
            Violation::DuplicateKey => "duplicate_key",
        }
    }

    /// Every violation, for documentation and tests.
    pub const ALL: [Violation; 8] = [
        Violation::Nul,
        Violation::UnpairedSurrogate,
        Violation::InexactNumber,
        Violation::TooDeep,
        Violation::StringTooLong,
        Violation::ArrayTooLong,
        Violation::ObjectTooWide,
        Violation::DuplicateKey,
    ];
}

/// A refusal: what, and where (byte offset), never the offending bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError {
    pub violation: Violation,
    pub offset: usize,
    pub message: String,
}

impl ShapeError {
    fn new(violation: Violation, offset: usize, what: String) -> ShapeError {
        ShapeError {
            violation,
            offset,
            message: format!("{what} (at byte {offset})"),
        }
    }
}

/// An open array or object.
enum Frame {
    Array {
        items: usize,
    },
    Object {
        keys: HashSet<String>,
        want_key: bool,
    },
}

/// Screens `bytes` (one JSON text) against `limits`.
pub fn screen(bytes: &[u8], limits: &ShapeLimits) -> Result<(), ShapeError> {
    Scanner {
        bytes,
        at: 0,
        limits,
        stack: Vec::new(),
    }
    .run()
}

struct Scanner<'a> {
    bytes: &'a [u8],
    at: usize,
    limits: &'a ShapeLimits,
    stack: Vec<Frame>,
}

impl Scanner<'_> {
    fn run(mut self) -> Result<(), ShapeError> {
        while self.at < self.bytes.len() {
            let b = self.bytes[self.at];
            match b {
                b'{' | b'[' => {
                    self.value_starts()?;
                    self.stack.push(if b == b'{' {
                        Frame::Object {
                            keys: HashSet::new(),
                            want_key: true,
                        }
                    } else {
                        Frame::Array { items: 0 }
                    });
                    if self.stack.len() > self.limits.max_depth {
                        return Err(self.error(
                            Violation::TooDeep,
                            format!("nested deeper than {}", self.limits.max_depth),
                        ));
                    }
                    self.at += 1;
                }
                b'}' | b']' => {
                    self.stack.pop();
                    self.at += 1;
                }
                b',' => {
                    if let Some(Frame::Object { want_key, .. }) = self.stack.last_mut() {
                        *want_key = true;
                    }
                    self.at += 1;
                }
                b'"' => self.string()?,
                b'-' | b'0'..=b'9' => {
                    self.value_starts()?;
                    self.number()?;
                }
                b't' | b'f' | b'n' => {
                    self.value_starts()?;
                    while self.at < self.bytes.len() && self.bytes[self.at].is_ascii_alphabetic() {
                        self.at += 1;
                    }
                }
                0 => return Err(self.error(Violation::Nul, "a NUL byte".into())),
                // Whitespace, ':' and anything the parser will refuse.
                _ => self.at += 1,
            }
        }
        Ok(())
    }

    fn error(&self, violation: Violation, what: String) -> ShapeError {
        ShapeError::new(violation, self.at, what)
    }

    /// A value (not a key) starts here: counts it in its array.
    fn value_starts(&mut self) -> Result<(), ShapeError> {
        let max = self.limits.max_array_items;
        if let Some(Frame::Array { items }) = self.stack.last_mut() {
            *items += 1;
            if *items > max {
                return Err(self.error(
                    Violation::ArrayTooLong,
                    format!("an array has more than {max} items"),
                ));
            }
        }
        Ok(())
    }

    /// A string, as a key or a value.
    fn string(&mut self) -> Result<(), ShapeError> {
        let is_key = matches!(
            self.stack.last(),
            Some(Frame::Object { want_key: true, .. })
        );
        if !is_key {
            self.value_starts()?;
        }
        let start = self.at;
        self.at += 1;
        let mut decoded = is_key.then(String::new);
        let mut len = 0usize;
        let mut raw_from = self.at;
        loop {
            let Some(&b) = self.bytes.get(self.at) else {
                // Unterminated: the parser says so.
                return Ok(());
            };
            match b {
                b'"' => break,
                0 => return Err(self.error(Violation::Nul, "a NUL byte in a string".into())),
                b'\\' => {
                    if let Some(d) = decoded.as_mut() {
                        d.push_str(&String::from_utf8_lossy(&self.bytes[raw_from..self.at]));
                    }
                    let ch = self.escape()?;
                    raw_from = self.at;
                    if let Some(ch) = ch {
                        len += ch.len_utf8();
                        if let Some(d) = decoded.as_mut() {
                            d.push(ch);
                        }
                    }
                }
                _ => {
                    len += 1;
                    self.at += 1;
                }
            }
            if len > self.limits.max_string_bytes {
                return Err(ShapeError::new(
                    Violation::StringTooLong,
                    start,
                    format!(
                        "a string is longer than {} bytes",
                        self.limits.max_string_bytes
                    ),
                ));
            }
        }
        let end = self.at;
        self.at += 1;
        let Some(mut key) = decoded else {
            return Ok(());
        };
        key.push_str(&String::from_utf8_lossy(&self.bytes[raw_from..end]));
        self.key(key, start)
    }

    /// Records an object's key: counted, and unique.
    fn key(&mut self, key: String, start: usize) -> Result<(), ShapeError> {
        let max = self.limits.max_object_keys;
        let Some(Frame::Object { keys, want_key }) = self.stack.last_mut() else {
            return Ok(());
        };
        *want_key = false;
        if keys.len() >= max {
            return Err(ShapeError::new(
                Violation::ObjectTooWide,
                start,
                format!("an object has more than {max} keys"),
            ));
        }
        if !keys.insert(key) {
            return Err(ShapeError::new(
                Violation::DuplicateKey,
                start,
                "a key appears twice in one object".into(),
            ));
        }
        Ok(())
    }

    /// One escape at `self.at` (a backslash); the character it stands for,
    /// `None` where the parser will refuse it anyway.
    fn escape(&mut self) -> Result<Option<char>, ShapeError> {
        let Some(&kind) = self.bytes.get(self.at + 1) else {
            self.at += 1;
            return Ok(None);
        };
        if kind != b'u' {
            self.at += 2;
            return Ok(Some(match kind {
                b'n' => '\n',
                b't' => '\t',
                b'r' => '\r',
                b'b' => '\u{8}',
                b'f' => '\u{c}',
                other => other as char,
            }));
        }
        let Some(unit) = self.hex4(self.at + 2) else {
            self.at += 2;
            return Ok(None);
        };
        if unit == 0 {
            return Err(self.error(Violation::Nul, "a \\u0000 escape".into()));
        }
        if (0xDC00..=0xDFFF).contains(&unit) {
            return Err(self.error(
                Violation::UnpairedSurrogate,
                "a low surrogate escape without a high one before it".into(),
            ));
        }
        if (0xD800..=0xDBFF).contains(&unit) {
            let low = (self.bytes.get(self.at + 6) == Some(&b'\\')
                && self.bytes.get(self.at + 7) == Some(&b'u'))
            .then(|| self.hex4(self.at + 8))
            .flatten()
            .filter(|low| (0xDC00..=0xDFFF).contains(low));
            let Some(low) = low else {
                return Err(self.error(
                    Violation::UnpairedSurrogate,
                    "a high surrogate escape without a low one after it".into(),
                ));
            };
            self.at += 12;
            let code = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
            return Ok(char::from_u32(code));
        }
        self.at += 6;
        Ok(char::from_u32(unit))
    }

    /// Four hex digits at `at`.
    fn hex4(&self, at: usize) -> Option<u32> {
        let digits = self.bytes.get(at..at + 4)?;
        let text = std::str::from_utf8(digits).ok()?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(text, 16).ok()
    }

    fn number(&mut self) -> Result<(), ShapeError> {
        let start = self.at;
        while self.at < self.bytes.len()
            && matches!(
                self.bytes[self.at],
                b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
            )
        {
            self.at += 1;
        }
        // ASCII by construction.
        let token = std::str::from_utf8(&self.bytes[start..self.at]).unwrap_or_default();
        if number_is_exact(token) {
            Ok(())
        } else {
            Err(ShapeError::new(
                Violation::InexactNumber,
                start,
                "a number that would not be stored with the value sent (outside the 64-bit \
                 integer range, or beyond a double's precision)"
                    .into(),
            ))
        }
    }
}

/// Whether the number `token` is written back with the value it has: an
/// integer that fits 64 bits, or a decimal that a double holds exactly as
/// written (its shortest round-trip form denotes the same decimal).
/// A token that is not a number at all passes: the parser refuses it.
pub fn number_is_exact(token: &str) -> bool {
    if !is_json_number(token) {
        return true;
    }
    if !token.contains(['.', 'e', 'E']) {
        return token.parse::<i64>().is_ok() || token.parse::<u64>().is_ok();
    }
    let Ok(value) = token.parse::<f64>() else {
        return false;
    };
    if !value.is_finite() {
        return false;
    }
    match (Decimal::parse(token), Decimal::parse(&format!("{value:e}"))) {
        (Some(sent), Some(kept)) => sent == kept,
        // An exponent too large to write down is no double's.
        _ => false,
    }
}

/// JSON's number grammar: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
fn is_json_number(token: &str) -> bool {
    let b = token.as_bytes();
    let mut i = usize::from(b.first() == Some(&b'-'));
    let digits = |i: &mut usize| {
        let from = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i - from
    };
    let int_from = i;
    let int = digits(&mut i);
    if int == 0 || (int > 1 && b[int_from] == b'0') {
        return false;
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

/// A decimal as digits without leading or trailing zeros and a power of
/// ten; zero has no digits (and no sign).
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    digits: String,
    exponent: i128,
}

impl Decimal {
    fn parse(text: &str) -> Option<Decimal> {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent) = match rest.find(['e', 'E']) {
            Some(at) => (&rest[..at], rest[at + 1..].parse::<i128>().ok()?),
            None => (rest, 0),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        if int.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
            return None;
        }
        let all = format!("{int}{frac}");
        let trimmed = all.trim_start_matches('0');
        let digits = trimmed.trim_end_matches('0');
        let exponent = exponent - frac.len() as i128 + (trimmed.len() - digits.len()) as i128;
        Some(if digits.is_empty() {
            Decimal {
                negative: false,
                digits: String::new(),
                exponent: 0,
            }
        } else {
            Decimal {
                negative,
                digits: digits.to_owned(),
                exponent,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Result<(), Violation> {
        screen(text.as_bytes(), &ShapeLimits::default()).map_err(|e| e.violation)
    }

    fn tight() -> ShapeLimits {
        ShapeLimits {
            max_depth: 3,
            max_string_bytes: 8,
            max_array_items: 3,
            max_object_keys: 2,
        }
    }

    fn check_tight(text: &str) -> Result<(), Violation> {
        screen(text.as_bytes(), &tight()).map_err(|e| e.violation)
    }

    #[test]
    fn ordinary_values_pass() {
        for text in [
            r#"{"type":"run.start","input":{"a":[1,2.5,-3,true,null,"x"]}}"#,
            r#"{"s":"caf\u00e9 \ud83d\ude00 \" \\ \n"}"#,
            r#"[0, -0, 1e3, 1.5E-7, 0.1, 12345678901234567890, -9223372036854775808]"#,
            "  {}  ",
            r#"{"a":{"a":{"a":1}}}"#,
        ] {
            assert_eq!(check(text), Ok(()), "{text}");
        }
    }

    #[test]
    fn nul_is_refused_in_values_keys_and_raw() {
        assert_eq!(check(r#"{"a":"x\u0000y"}"#), Err(Violation::Nul));
        assert_eq!(check(r#"{"k\u0000":1}"#), Err(Violation::Nul));
        assert_eq!(check("{\"a\":\"x\0\"}"), Err(Violation::Nul));
        assert_eq!(check(r#"{"a":"\\u0000"}"#), Ok(()), "an escaped backslash");
    }

    #[test]
    fn unpaired_surrogates_are_refused() {
        assert_eq!(check(r#"["\ud800"]"#), Err(Violation::UnpairedSurrogate));
        assert_eq!(check(r#"["\ud800x"]"#), Err(Violation::UnpairedSurrogate));
        assert_eq!(
            check(r#"["\ud800\u0041"]"#),
            Err(Violation::UnpairedSurrogate)
        );
        assert_eq!(check(r#"["\udc00"]"#), Err(Violation::UnpairedSurrogate));
        assert_eq!(check(r#"{"\udfff":1}"#), Err(Violation::UnpairedSurrogate));
        assert_eq!(check(r#"["\uD83D\uDE00"]"#), Ok(()));
    }

    #[test]
    fn inexact_numbers_are_refused() {
        for token in [
            "1e400",
            "-1e400",
            "18446744073709551616",
            "-9223372036854775809",
            "0.10000000000000000001",
            "1e-400",
            "3.141592653589793238462643383279",
            "1e99999999999999999999999999999999999999999",
        ] {
            assert!(!number_is_exact(token), "{token}");
            assert_eq!(
                check(&format!("[{token}]")),
                Err(Violation::InexactNumber),
                "{token}"
            );
        }
        for token in [
            "0",
            "-0",
            "0.0",
            "1.50",
            "1E+2",
            "100e-2",
            "5e-324",
            "1.7976931348623157e308",
            "18446744073709551615",
            "0.1",
            "123.456",
        ] {
            assert!(number_is_exact(token), "{token}");
        }
    }

    #[test]
    fn limits_are_enforced_at_their_bound() {
        assert_eq!(check_tight("[[[1]]]"), Ok(()));
        assert_eq!(check_tight("[[[[1]]]]"), Err(Violation::TooDeep));
        assert_eq!(check_tight(r#"["12345678"]"#), Ok(()));
        assert_eq!(
            check_tight(r#"["123456789"]"#),
            Err(Violation::StringTooLong)
        );
        assert_eq!(
            check_tight(r#"["\u00e9\u00e9\u00e9\u00e9x"]"#),
            Err(Violation::StringTooLong),
            "counted in decoded bytes"
        );
        assert_eq!(check_tight("[1,2,3]"), Ok(()));
        assert_eq!(check_tight("[1,2,3,4]"), Err(Violation::ArrayTooLong));
        assert_eq!(check_tight(r#"[[1,2],[3,4],{"a":[5,6]}]"#), Ok(()));
        assert_eq!(check_tight(r#"{"a":1,"b":2}"#), Ok(()));
        assert_eq!(
            check_tight(r#"{"a":1,"b":2,"c":3}"#),
            Err(Violation::ObjectTooWide)
        );
    }

    #[test]
    fn duplicate_keys_are_refused_even_when_spelled_differently() {
        assert_eq!(check(r#"{"a":1,"a":2}"#), Err(Violation::DuplicateKey));
        assert_eq!(check(r#"{"a":1,"\u0061":2}"#), Err(Violation::DuplicateKey));
        assert_eq!(check(r#"{"a":{"a":1},"b":{"a":2}}"#), Ok(()));
        assert_eq!(check(r#"{"a":"a","b":"a"}"#), Ok(()), "values are not keys");
    }

    /// What passes the screen and parses is kept as sent: written back and
    /// read again, it is the same value and passes again.
    #[test]
    fn what_passes_and_parses_is_kept_as_sent() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut parsed = 0;
        for round in 0..20_000 {
            let len = 1 + (round % 24);
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    b"{}[]\",:\\u0dD8e-.1a \x00"[(seed % 20) as usize]
                })
                .collect();
            let Ok(()) = screen(&bytes, &ShapeLimits::default()) else {
                continue;
            };
            let Ok(value) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
                continue;
            };
            parsed += 1;
            let written = serde_json::to_vec(&value).unwrap();
            assert_eq!(screen(&written, &ShapeLimits::default()), Ok(()));
            let again: serde_json::Value = serde_json::from_slice(&written).unwrap();
            assert_eq!(again, value, "{}", String::from_utf8_lossy(&bytes));
        }
        assert!(
            parsed > 100,
            "the generator makes some valid JSON: {parsed}"
        );
        for text in [
            "",
            "\"",
            "\\",
            "\"\\u",
            "{\"a",
            "]]]]}}}",
            "-",
            "1e",
            "--1",
            "\"\\uzzzz\"",
            "{,,,}",
            "[\"\\",
            "nul",
            "{\"a\":}",
            "01",
            "1.",
            ".5",
        ] {
            assert_eq!(check(text), Ok(()), "left to the parser: {text}");
        }
    }
}
