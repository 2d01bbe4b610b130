//! API keys on their own: the format, the hash kept of them, and the verdict
//! on a presented key against the stored row. Pure: no database, no clock.
//!
//! In: a token (`dk_<16 hex>_<64 hex>`, or the `Authorization` value around
//! it) and the [`StoredKey`] row of its id, if any. Out: a [`Caller`] or a
//! [`Refusal`]; for a key being made, a [`NewKey`]. Guarantees: only the
//! exact shape parses; the secret is compared in constant time, against a
//! stand-in when no row exists; only the secret's SHA-256 is handed on to
//! store; `Debug` never shows a token or a secret.

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Every key starts with this, so that a secret scanner (or a person) can
/// tell a Ductor key from any other token.
pub const KEY_PREFIX: &str = "dk_";
/// Random bytes of a key's id (hex on the wire: 16 characters).
const ID_BYTES: usize = 8;
/// Random bytes of a key's secret (hex on the wire: 64 characters).
const SECRET_BYTES: usize = 32;

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// Start, signal and cancel runs.
    RunsWrite,
    /// Read runs.
    RunsRead,
    /// The operator endpoints.
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::RunsWrite, Scope::RunsRead, Scope::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::RunsWrite => "runs:write",
            Scope::RunsRead => "runs:read",
            Scope::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|scope| scope.as_str() == s)
    }
}

/// `runs:write,runs:read` to its scopes, sorted and without repeats; an
/// empty list or an unknown name is an error that names it.
pub fn parse_scopes(list: &str) -> Result<Vec<Scope>, String> {
    let mut scopes = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let scope = Scope::parse(name).ok_or_else(|| {
            let known: Vec<_> = Scope::ALL.iter().map(|s| s.as_str()).collect();
            format!("unknown scope {name:?} (known: {})", known.join(", "))
        })?;
        scopes.push(scope);
    }
    scopes.sort();
    scopes.dedup();
    if scopes.is_empty() {
        return Err("at least one scope is required".into());
    }
    Ok(scopes)
}

/// When a key given `--expires` ends: a duration from `now` (`90d`, `12h`,
/// `30m`, `45s`) or an RFC 3339 time, which must lie in the future.
pub fn parse_expiry(text: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let at = match DateTime::parse_from_rfc3339(text) {
        Ok(at) => at.with_timezone(&Utc),
        Err(_) => now + parse_duration(text)?,
    };
    if at <= now {
        return Err(format!("{text}: the expiry must lie in the future"));
    }
    Ok(at)
}

fn parse_duration(text: &str) -> Result<chrono::Duration, String> {
    let bad = || format!("{text}: not a duration (90d, 12h, 30m, 45s) nor an RFC 3339 time");
    let split = text.len().checked_sub(1).ok_or_else(bad)?;
    let (number, unit) = text.split_at(split);
    let n: i64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "d" => n.checked_mul(86_400),
        "h" => n.checked_mul(3_600),
        "m" => n.checked_mul(60),
        "s" => Some(n),
        _ => None,
    }
    .ok_or_else(bad)?;
    chrono::Duration::try_seconds(seconds).ok_or_else(bad)
}

/// A key just made: the token to hand over once, and what is stored of it.
pub struct NewKey {
    pub key_id: String,
    /// `dk_<key_id>_<secret>`; shown once, never stored.
    pub token: String,
    pub secret_sha256: [u8; 32],
}

impl std::fmt::Debug for NewKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewKey")
            .field("key_id", &self.key_id)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// A fresh key from the operating system's random source.
pub fn generate() -> Result<NewKey, rand::rand_core::OsError> {
    use rand::TryRngCore;
    let mut id = [0u8; ID_BYTES];
    let mut secret = [0u8; SECRET_BYTES];
    rand::rngs::OsRng.try_fill_bytes(&mut id)?;
    rand::rngs::OsRng.try_fill_bytes(&mut secret)?;
    let (key_id, secret) = (hex(&id), hex(&secret));
    Ok(NewKey {
        token: format!("{KEY_PREFIX}{key_id}_{secret}"),
        secret_sha256: secret_hash(&secret),
        key_id,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of a key's secret: what the database keeps.
pub fn secret_hash(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// A token split into its id and secret, once its shape is right.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Presented<'a> {
    pub key_id: &'a str,
    secret: &'a str,
}

impl std::fmt::Debug for Presented<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Presented({}, <redacted>)", self.key_id)
    }
}

/// `dk_<16 hex>_<64 hex>`, or `None`.
pub fn parse(token: &str) -> Option<Presented<'_>> {
    let rest = token.strip_prefix(KEY_PREFIX)?;
    let (key_id, secret) = rest.split_once('_')?;
    let lower_hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    (lower_hex(key_id, ID_BYTES * 2) && lower_hex(secret, SECRET_BYTES * 2))
        .then_some(Presented { key_id, secret })
}

/// The token of an `Authorization: Bearer <token>` header value (the
/// scheme's case does not matter).
pub fn bearer(header: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(header).ok()?;
    let (scheme, token) = text.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// A key's row, as the database has it, with what the database's own
/// clock says of its times: expiry and revocation are decided where they
/// were written (`revoked_at IS NOT NULL`, `expires_at <= now()`), so a
/// serve whose clock is off can neither keep a revoked key alive nor end
/// a key early.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredKey {
    pub key_id: String,
    pub tenant: String,
    pub scopes: Vec<Scope>,
    pub secret_sha256: Vec<u8>,
    pub requests_per_second: Option<u32>,
    /// `expires_at <= now()`, in the database.
    pub expired: bool,
    /// `revoked_at IS NOT NULL`.
    pub revoked: bool,
    /// Whether `last_used_at` is older than its resolution (or unset), in
    /// the database's clock: the request notes its use.
    pub use_unnoted: bool,
}

/// Who a request comes from, once its key held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub key_id: String,
    pub tenant: String,
    pub scopes: Vec<Scope>,
    /// This key's own request rate, if it has one.
    pub requests_per_second: Option<u32>,
}

impl Caller {
    pub fn allows(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }
}

/// Why a request is not authenticated. The caller is told none of it (every
/// refusal is the same 401); the failure counter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Malformed,
    Unknown,
    WrongSecret,
    Expired,
    Revoked,
}

impl Refusal {
    /// Every refusal: the failure counter starts each at zero.
    pub const ALL: [Refusal; 6] = [
        Refusal::Missing,
        Refusal::Malformed,
        Refusal::Unknown,
        Refusal::WrongSecret,
        Refusal::Expired,
        Refusal::Revoked,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed => "malformed",
            Refusal::Unknown => "unknown",
            Refusal::WrongSecret => "wrong_secret",
            Refusal::Expired => "expired",
            Refusal::Revoked => "revoked",
        }
    }
}

/// The verdict on a presented key and the row stored under its id. The
/// secret is compared in constant time, and against a stand-in when no row
/// exists, so that neither the time taken nor the answer tells an unknown
/// id from a wrong secret.
pub fn verify(stored: Option<&StoredKey>, presented: Presented<'_>) -> Result<Caller, Refusal> {
    const STAND_IN: [u8; 32] = [0; 32];
    let expected = stored.map_or(&STAND_IN[..], |k| &k.secret_sha256[..]);
    let same = secret_hash(presented.secret)[..].ct_eq(expected);
    let Some(key) = stored else {
        return Err(Refusal::Unknown);
    };
    if !bool::from(same) {
        return Err(Refusal::WrongSecret);
    }
    if key.revoked {
        return Err(Refusal::Revoked);
    }
    if key.expired {
        return Err(Refusal::Expired);
    }
    Ok(Caller {
        key_id: key.key_id.clone(),
        tenant: key.tenant.clone(),
        scopes: key.scopes.clone(),
        requests_per_second: key.requests_per_second,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(new: &NewKey) -> StoredKey {
        StoredKey {
            key_id: new.key_id.clone(),
            tenant: "acme".into(),
            scopes: vec![Scope::RunsWrite],
            secret_sha256: new.secret_sha256.to_vec(),
            requests_per_second: None,
            expired: false,
            revoked: false,
            use_unnoted: true,
        }
    }

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-12-02T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn a_generated_key_parses_and_verifies_against_its_row() {
        let new = generate().unwrap();
        assert!(new.token.starts_with(KEY_PREFIX));
        assert_eq!(new.token.len(), 3 + 16 + 1 + 64);
        let presented = parse(&new.token).expect("the key's own shape");
        assert_eq!(presented.key_id, new.key_id);
        let caller = verify(Some(&stored(&new)), presented).unwrap();
        assert_eq!(caller.tenant, "acme");
        assert!(caller.allows(Scope::RunsWrite));
        assert!(!caller.allows(Scope::RunsRead));
    }

    #[test]
    fn two_keys_differ() {
        let (a, b) = (generate().unwrap(), generate().unwrap());
        assert_ne!(a.key_id, b.key_id);
        assert_ne!(a.secret_sha256, b.secret_sha256);
    }

    #[test]
    fn every_way_to_be_wrong_is_refused_with_its_reason() {
        let new = generate().unwrap();
        let presented = parse(&new.token).unwrap();
        assert_eq!(verify(None, presented), Err(Refusal::Unknown));
        let other = generate().unwrap();
        let mut wrong = stored(&new);
        wrong.secret_sha256 = other.secret_sha256.to_vec();
        assert_eq!(verify(Some(&wrong), presented), Err(Refusal::WrongSecret));
        let mut revoked = stored(&new);
        revoked.revoked = true;
        assert_eq!(verify(Some(&revoked), presented), Err(Refusal::Revoked));
        let mut expired = stored(&new);
        expired.expired = true;
        assert_eq!(verify(Some(&expired), presented), Err(Refusal::Expired));
        assert!(verify(Some(&stored(&new)), presented).is_ok());
    }

    #[test]
    fn only_the_exact_shape_parses() {
        let new = generate().unwrap();
        let token = new.token.as_str();
        assert!(parse(token).is_some());
        for bad in [
            "",
            "dk_",
            &token[3..],
            &token[..token.len() - 1],
            &format!("{token}0"),
            &token.to_uppercase(),
            &token.replacen('_', "-", 2),
            &format!("xk_{}", &token[3..]),
        ] {
            assert!(parse(bad).is_none(), "{bad:?} parsed");
        }
    }

    #[test]
    fn bearer_takes_the_token_whatever_the_scheme_case() {
        assert_eq!(bearer(b"Bearer abc"), Some("abc"));
        assert_eq!(bearer(b"bearer  abc "), Some("abc"));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"Bearer"), None);
        assert_eq!(bearer(&[0xff, 0x20, 0x41]), None);
    }

    #[test]
    fn scopes_parse_sorted_and_unknown_ones_are_named() {
        assert_eq!(
            parse_scopes("runs:read, runs:write,runs:read").unwrap(),
            vec![Scope::RunsWrite, Scope::RunsRead]
        );
        assert!(
            parse_scopes("runs:delete")
                .unwrap_err()
                .contains("runs:delete")
        );
        assert!(parse_scopes(" , ").is_err());
    }

    #[test]
    fn expiry_takes_a_duration_or_a_time_in_the_future() {
        assert_eq!(
            parse_expiry("90d", now()).unwrap(),
            now() + chrono::Duration::days(90)
        );
        assert_eq!(
            parse_expiry("30m", now()).unwrap(),
            now() + chrono::Duration::minutes(30)
        );
        assert_eq!(
            parse_expiry("2027-01-01T00:00:00Z", now())
                .unwrap()
                .to_rfc3339(),
            "2027-01-01T00:00:00+00:00"
        );
        for bad in [
            "",
            "d",
            "10y",
            "-5d",
            "2020-01-01T00:00:00Z",
            "99999999999999d",
        ] {
            assert!(parse_expiry(bad, now()).is_err(), "{bad:?} accepted");
        }
    }
}
