//! Signed inputs: `ductor-signature: v1=<hex HMAC-SHA256 of the record's
//! value>`, keyed per tenant. Where signatures are required (see
//! [`crate::config::SignaturesConfig`]), an input without one, or with one
//! that does not match its tenant's key, is dead-lettered with class
//! `unauthenticated` instead of applied. Pure.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header that carries an input's signature.
pub const SIGNATURE: &str = "ductor-signature";
/// The scheme of today's signatures; another would be `v2=`.
const SCHEME: &str = "v1=";

/// The `ductor-signature` value of `payload` under `key`.
pub fn sign(key: &[u8], payload: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(payload);
    let tag = mac.finalize().into_bytes();
    let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    format!("{SCHEME}{hex}")
}

/// Whether `header` is `payload`'s signature under `key`, compared in
/// constant time.
pub fn verify(key: &[u8], payload: &[u8], header: &[u8]) -> bool {
    let Some(hex) = header.strip_prefix(SCHEME.as_bytes()) else {
        return false;
    };
    let Some(tag) = unhex(hex) else {
        return false;
    };
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
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

    #[test]
    fn a_signature_verifies_for_its_payload_and_key_only() {
        let signature = sign(b"secret", b"{\"a\":1}");
        assert!(signature.starts_with("v1=") && signature.len() == 3 + 64);
        assert!(verify(b"secret", b"{\"a\":1}", signature.as_bytes()));
        assert!(!verify(b"other", b"{\"a\":1}", signature.as_bytes()));
        assert!(!verify(b"secret", b"{\"a\":2}", signature.as_bytes()));
        let upper = signature.to_uppercase().replacen("V1=", "v1=", 1);
        assert!(
            verify(b"secret", b"{\"a\":1}", upper.as_bytes()),
            "hex of any case"
        );
        for bad in ["", "v1=", "v2=00", &signature[3..], &signature[..40]] {
            assert!(!verify(b"secret", b"{\"a\":1}", bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn the_signature_is_hmac_sha256_as_rfc_4231_gives_it() {
        // RFC 4231, test case 2.
        assert_eq!(
            sign(b"Jefe", b"what do ya want for nothing?"),
            "v1=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
