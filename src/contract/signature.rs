//! Signed inputs, in the `ductor-signature` header. Pure.
//!
//! A tenant's input is signed with the tenant's key, over the time it was
//! signed and its value: `t=<unix ms>,v2=<hex HMAC-SHA256 of "<t>." ++
//! value>`. Where signatures are required (see
//! [`crate::config::SignaturesConfig`]), an input without one, with one
//! that does not match, or signed outside `signatures.max_age_ms` of when
//! it reached Kafka, is dead-lettered with class `unauthenticated`. The
//! time bounds how long a copy can be replayed; within it every input is
//! deduplicated by what it names (a start by its idempotency key or run
//! id, a signal by its id, a result by its stamp), so a replay is a no-op.
//!
//! Ductor's own timers are signed with a key only `serve` holds
//! (`signatures.timer_key`), over the value alone: `v1=<hex HMAC-SHA256 of
//! value>`. A timer may be published long after it was decided (a
//! sleep), and a copy of one is harmless (it is fenced by its attempt's
//! stamp), so it carries no time.
//!
//! In: a key, the value's bytes, the `ductor-signature` header and, for a
//! tenant's input, when it reached Kafka and `signatures.max_age_ms`. Out:
//! the header to send, or the verdict: `Ok` or a [`Refusal`] for a
//! tenant's, a `bool` for a timer's. Guarantees: pure; tags are compared in
//! constant time; a signature without its time (`v1=`) never passes as a
//! tenant's, nor a tenant's as a timer's.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header that carries an input's signature.
pub const SIGNATURE: &str = "ductor-signature";
/// The scheme of a timer's signature: the value only.
const TIMER_SCHEME: &str = "v1=";
/// The scheme of a tenant's signature, after its time.
const TIMED_SCHEME: &str = "v2=";

/// Why a tenant's signature does not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Not `t=<ms>,v2=<64 hex>`; `v1=` (no time) included.
    Malformed,
    /// Its HMAC is not the value's under the tenant's key at its time.
    Mismatch,
    /// Signed more than the window before or after the reference time
    /// (both Unix milliseconds).
    OutsideWindow {
        signed_at_ms: i64,
        reference_ms: i64,
    },
}

impl Refusal {
    /// What the dead letter says.
    pub fn message(&self) -> String {
        match self {
            Refusal::Malformed => format!(
                "{SIGNATURE} must be t=<unix ms>,v2=<hex HMAC-SHA256 of \"<t>.\" and the value>"
            ),
            Refusal::Mismatch => {
                format!("{SIGNATURE} does not match the input, its time and its tenant's key")
            }
            Refusal::OutsideWindow {
                signed_at_ms,
                reference_ms,
            } => format!(
                "{SIGNATURE} was made at {signed_at_ms} ms, {} ms from when the input reached \
                 Kafka ({reference_ms} ms): outside signatures.max_age_ms",
                (reference_ms - signed_at_ms).abs()
            ),
        }
    }
}

fn mac(key: &[u8]) -> Hmac<Sha256> {
    Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The `ductor-signature` value of a tenant's `payload` under `key`, signed
/// at `signed_at_ms` (Unix milliseconds).
pub fn sign(key: &[u8], payload: &[u8], signed_at_ms: i64) -> String {
    let mut mac = mac(key);
    mac.update(format!("{signed_at_ms}.").as_bytes());
    mac.update(payload);
    let tag = hex(&mac.finalize().into_bytes());
    format!("t={signed_at_ms},{TIMED_SCHEME}{tag}")
}

/// Whether `header` signs `payload` under `key` at a time within
/// `window_ms` of `reference_ms` (when the input reached Kafka). The tag
/// is compared in constant time.
pub fn verify(
    key: &[u8],
    payload: &[u8],
    header: &[u8],
    reference_ms: i64,
    window_ms: u64,
) -> Result<(), Refusal> {
    let text = std::str::from_utf8(header).map_err(|_| Refusal::Malformed)?;
    let (time, tag) = text.split_once(',').ok_or(Refusal::Malformed)?;
    let signed_at_ms: i64 = time
        .strip_prefix("t=")
        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|t| t.parse().ok())
        .ok_or(Refusal::Malformed)?;
    let tag = tag
        .strip_prefix(TIMED_SCHEME)
        .and_then(|t| unhex(t.as_bytes()))
        .ok_or(Refusal::Malformed)?;
    let mut mac = mac(key);
    mac.update(format!("{signed_at_ms}.").as_bytes());
    mac.update(payload);
    mac.verify_slice(&tag).map_err(|_| Refusal::Mismatch)?;
    let apart = reference_ms.abs_diff(signed_at_ms);
    if apart > window_ms {
        return Err(Refusal::OutsideWindow {
            signed_at_ms,
            reference_ms,
        });
    }
    Ok(())
}

/// The `ductor-signature` value of a timer's `payload` under serve's
/// timer key.
pub fn sign_timer(key: &[u8], payload: &[u8]) -> String {
    let mut mac = mac(key);
    mac.update(payload);
    format!("{TIMER_SCHEME}{}", hex(&mac.finalize().into_bytes()))
}

/// Whether `header` is a timer `payload`'s signature under serve's timer
/// key, compared in constant time.
pub fn verify_timer(key: &[u8], payload: &[u8], header: &[u8]) -> bool {
    let Some(tag) = header.strip_prefix(TIMER_SCHEME.as_bytes()).and_then(unhex) else {
        return false;
    };
    let mut mac = mac(key);
    mac.update(payload);
    mac.verify_slice(&tag).is_ok()
}

fn unhex(hex: &[u8]) -> Option<Vec<u8>> {
    if hex.len() != 64 {
        return None;
    }
    hex.chunks(2)
        .map(|pair| {
            let text = std::str::from_utf8(pair).ok()?;
            u8::from_str_radix(text, 16).ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT: i64 = 1_800_000_000_000;
    const WINDOW: u64 = 300_000;

    #[test]
    fn a_signature_verifies_for_its_payload_key_and_time_only() {
        let signature = sign(b"secret", b"{\"a\":1}", AT);
        assert!(signature.starts_with(&format!("t={AT},v2=")));
        let ok = |key: &[u8], payload: &[u8], header: &str| {
            verify(key, payload, header.as_bytes(), AT + 1_000, WINDOW)
        };
        assert_eq!(ok(b"secret", b"{\"a\":1}", &signature), Ok(()));
        assert_eq!(
            ok(b"other", b"{\"a\":1}", &signature),
            Err(Refusal::Mismatch)
        );
        assert_eq!(
            ok(b"secret", b"{\"a\":2}", &signature),
            Err(Refusal::Mismatch)
        );
        // The time is signed: moving it breaks the tag.
        let moved = signature.replacen(&AT.to_string(), &(AT + 5).to_string(), 1);
        assert_eq!(ok(b"secret", b"{\"a\":1}", &moved), Err(Refusal::Mismatch));
        let untimed = sign_timer(b"secret", b"{\"a\":1}");
        for bad in [
            "",
            "t=,v2=00",
            "v2=00",
            &untimed,
            &signature[..signature.len() - 1],
            &signature.replacen("t=", "t=-", 1),
        ] {
            assert_eq!(
                ok(b"secret", b"{\"a\":1}", bad),
                Err(Refusal::Malformed),
                "{bad:?}"
            );
        }
    }

    /// A header is bytes from whoever wrote the record: none of these
    /// panics or passes.
    #[test]
    fn hostile_headers_are_malformed_not_a_panic() {
        let signature = sign(b"secret", b"{}", AT);
        let huge_time = format!(
            "t={},v2={}",
            "9".repeat(40),
            &signature[signature.len() - 64..]
        );
        let with_nul = signature.replacen(',', "\0,", 1);
        let long = "a".repeat(1 << 20);
        for bad in [
            &b"\xff\xfe,v2="[..],
            b"t=\xed\xa0\x80,v2=00",
            huge_time.as_bytes(),
            with_nul.as_bytes(),
            long.as_bytes(),
            b",",
            b"t=1,v2=zz",
        ] {
            assert_eq!(
                verify(b"secret", b"{}", bad, AT, WINDOW),
                Err(Refusal::Malformed),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
            assert!(!verify_timer(b"secret", b"{}", bad));
        }
    }

    #[test]
    fn a_signature_made_outside_the_window_is_refused() {
        let signature = sign(b"secret", b"{}", AT);
        let at = |reference_ms: i64| {
            verify(b"secret", b"{}", signature.as_bytes(), reference_ms, WINDOW)
        };
        assert_eq!(at(AT + WINDOW as i64), Ok(()));
        assert_eq!(at(AT - WINDOW as i64), Ok(()), "a clock a little behind");
        assert!(matches!(
            at(AT + WINDOW as i64 + 1),
            Err(Refusal::OutsideWindow { .. })
        ));
        assert!(matches!(
            at(AT - WINDOW as i64 - 1),
            Err(Refusal::OutsideWindow { .. })
        ));
    }

    #[test]
    fn a_timer_signature_covers_the_value_under_serve_s_key() {
        let signature = sign_timer(b"timer-key", b"{\"timer\":\"wake\"}");
        assert!(verify_timer(
            b"timer-key",
            b"{\"timer\":\"wake\"}",
            signature.as_bytes()
        ));
        assert!(!verify_timer(
            b"tenant-key",
            b"{\"timer\":\"wake\"}",
            signature.as_bytes()
        ));
        assert!(!verify_timer(
            b"timer-key",
            b"{\"timer\":\"timeout\"}",
            signature.as_bytes()
        ));
        let timed = sign(b"timer-key", b"{\"timer\":\"wake\"}", AT);
        assert!(!verify_timer(
            b"timer-key",
            b"{\"timer\":\"wake\"}",
            timed.as_bytes()
        ));
    }

    #[test]
    fn the_timer_signature_is_hmac_sha256_as_rfc_4231_gives_it() {
        // RFC 4231, test case 2.
        assert_eq!(
            sign_timer(b"Jefe", b"what do ya want for nothing?"),
            "v1=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
