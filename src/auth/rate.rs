//! Request rates per API key: a token bucket per key, refilled at the key's
//! rate (`ductor keys create --requests-per-second`, else
//! `server.requests_per_second`) up to `server.request_burst`. Keys are
//! issued by the operator, one or a few per tenant, so a key's rate is its
//! tenant's share of the API.
//!
//! In: a key id with its own rate, if any, or a client address, and `now`.
//! Out: admitted, or how long until a token is there. Guarantees: time is
//! an argument, never read here; the maps of failing addresses and of
//! unknown key ids never pass `MAX_FAILING_CLIENTS` and `MAX_UNKNOWN_KEYS`
//! entries, and past its bound the limiter drops only buckets that would
//! be full again; a poisoned lock is recovered, never a panic.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One key's bucket, refilled at its own rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    tokens: f64,
    at: Instant,
    /// The rate it was last refilled at: its key's.
    rate: u32,
}

impl Bucket {
    /// A full bucket.
    pub fn full(burst: u32, now: Instant) -> Self {
        Bucket {
            tokens: f64::from(burst),
            at: now,
            rate: 1,
        }
    }

    /// Whether it would be full by `now`, at its own rate: dropping it then
    /// loses nothing, since a dropped bucket comes back full.
    pub fn full_by(&self, burst: u32, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens + elapsed * f64::from(self.rate.max(1)) >= f64::from(burst.max(1))
    }

    /// Takes one token if there is one; otherwise how long until there is.
    pub fn take(&mut self, rate: u32, burst: u32, now: Instant) -> Result<(), Duration> {
        self.ready(rate, burst, now)?;
        self.tokens -= 1.0;
        Ok(())
    }

    /// Whether a token is there by `now` (refilling the bucket at `rate`),
    /// without taking it; otherwise how long until there is.
    pub fn ready(&mut self, rate: u32, burst: u32, now: Instant) -> Result<(), Duration> {
        self.rate = rate.max(1);
        let rate = f64::from(rate.max(1));
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(f64::from(burst.max(1)));
        self.at = now;
        if self.tokens >= 1.0 {
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
        }
    }
}

/// The buckets of every key seen lately. Past `max_keys`, the buckets that
/// are full again by their own key's rate (idle keys) are dropped, which
/// loses nothing since a dropped bucket comes back full; a throttled key's
/// bucket is kept whatever the rate of the key that came in. Only keys that
/// authenticated reach the limiter, so the map holds at most the keys the
/// operator issued.
pub struct RateLimiter {
    default_rate: u32,
    burst: u32,
    max_keys: usize,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    pub fn new(default_rate: u32, burst: u32) -> Self {
        RateLimiter {
            default_rate,
            burst,
            max_keys: 100_000,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `key_id` authenticated lately (its bucket is kept).
    pub fn knows(&self, key_id: &str) -> bool {
        let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        buckets.contains_key(key_id)
    }

    /// Admits one request of `key_id` (at its own `rate`, if it has one),
    /// or says when to retry.
    pub fn admit(&self, key_id: &str, rate: Option<u32>, now: Instant) -> Result<(), Duration> {
        let rate = rate.unwrap_or(self.default_rate);
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= self.max_keys && !buckets.contains_key(key_id) {
            buckets.retain(|_, b| !b.full_by(self.burst, now));
        }
        buckets
            .entry(key_id.to_owned())
            .or_insert_with(|| Bucket::full(self.burst, now))
            .take(rate, self.burst, now)
    }
}

/// Most client addresses whose failures are counted at once; past it, the
/// addresses whose buckets are full again are dropped, and all of them if
/// none is.
const MAX_FAILING_CLIENTS: usize = 100_000;

/// Failed authentications per client address (`server.auth_failures_per_second`,
/// `server.auth_failure_burst`): each failure takes a token of the
/// address's bucket, and an address with none left is refused (429) before
/// its key is looked up, so guessing keys costs the guesser time and the API
/// pool nothing. A client with a valid key never fails and is never held
/// back by this. Addresses are counted whole (an IPv6 client with many
/// addresses of one prefix has a bucket per address).
pub struct FailureGate {
    rate: u32,
    burst: u32,
    max_clients: usize,
    buckets: Mutex<HashMap<std::net::IpAddr, Bucket>>,
}

impl FailureGate {
    pub fn new(rate: u32, burst: u32) -> Self {
        FailureGate {
            rate,
            burst,
            max_clients: MAX_FAILING_CLIENTS,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `client` may try to authenticate now; otherwise when it may.
    pub fn check(&self, client: std::net::IpAddr, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        match buckets.get_mut(&client) {
            Some(bucket) => bucket.ready(self.rate, self.burst, now),
            None => Ok(()),
        }
    }

    /// Counts a failed authentication of `client`.
    pub fn failed(&self, client: std::net::IpAddr, now: Instant) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= self.max_clients && !buckets.contains_key(&client) {
            buckets.retain(|_, b| !b.full_by(self.burst, now));
            // Still full: every address is failing now (many addresses of
            // one guesser, say). Start over rather than sweep the whole map
            // again for each new address, which would make each failure
            // cost a scan of it.
            if buckets.len() >= self.max_clients {
                buckets.clear();
            }
        }
        let (rate, burst) = (self.rate, self.burst);
        let bucket = buckets
            .entry(client)
            .or_insert_with(|| Bucket::full(burst, now));
        // An empty bucket stays empty: the failure is counted all the same.
        let _ = bucket.take(rate, burst, now);
    }
}

/// Most key ids remembered as unknown at once; past it, the expired ones
/// are dropped, and if none is, all of them.
const MAX_UNKNOWN_KEYS: usize = 100_000;

/// Key ids lately found in no row, for `server.unknown_key_cache_ms`: a
/// request with one of them is refused without a query. A key id is not
/// a secret (`ductor keys list` and the logs show it), and a new key's id
/// is random, so no key is refused for having been guessed before it was
/// made.
pub struct UnknownKeys {
    ttl: Duration,
    ids: Mutex<HashMap<String, Instant>>,
}

impl UnknownKeys {
    pub fn new(ttl: Duration) -> Self {
        UnknownKeys {
            ttl,
            ids: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `key_id` was found in no row within the time kept.
    pub fn known_unknown(&self, key_id: &str, now: Instant) -> bool {
        let ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        ids.get(key_id)
            .is_some_and(|at| now.saturating_duration_since(*at) < self.ttl)
    }

    /// Notes that `key_id` is in no row.
    pub fn note(&self, key_id: &str, now: Instant) {
        let mut ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        if ids.len() >= MAX_UNKNOWN_KEYS {
            let ttl = self.ttl;
            ids.retain(|_, at| now.saturating_duration_since(*at) < ttl);
            if ids.len() >= MAX_UNKNOWN_KEYS {
                ids.clear();
            }
        }
        ids.insert(key_id.to_owned(), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rate_holds() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(10, 5);
        for _ in 0..5 {
            assert_eq!(limiter.admit("k", None, t0), Ok(()));
        }
        let wait = limiter.admit("k", None, t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(100));
        // 100 ms later one token has come back, and only one.
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!(limiter.admit("k", None, t1), Ok(()));
        assert!(limiter.admit("k", None, t1).is_err());
    }

    #[test]
    fn keys_have_their_own_buckets_and_rates() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(1, 1);
        assert!(limiter.admit("a", None, t0).is_ok());
        assert!(limiter.admit("a", None, t0).is_err());
        assert!(
            limiter.admit("b", None, t0).is_ok(),
            "another key is unaffected"
        );
        let t1 = t0 + Duration::from_millis(10);
        assert!(limiter.admit("fast", Some(1000), t0).is_ok());
        assert!(limiter.admit("fast", Some(1000), t0).is_err());
        assert!(
            limiter.admit("fast", Some(1000), t1).is_ok(),
            "its own rate refills it"
        );
        assert!(
            limiter.admit("a", None, t1).is_err(),
            "the default rate does not"
        );
    }

    #[test]
    fn a_bucket_never_holds_more_than_the_burst() {
        let t0 = Instant::now();
        let mut bucket = Bucket::full(3, t0);
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..3 {
            assert!(bucket.take(100, 3, later).is_ok());
        }
        assert!(bucket.take(100, 3, later).is_err());
    }

    /// Past the bound, a key that came in at a fast rate must not push out
    /// a throttled key of a slow rate: that key would come back with a
    /// full bucket, and so with its burst again.
    #[test]
    fn a_throttled_key_keeps_its_empty_bucket_past_the_bound() {
        let t0 = Instant::now();
        let mut limiter = RateLimiter::new(1, 5);
        limiter.max_keys = 2;
        for _ in 0..5 {
            assert!(limiter.admit("slow", None, t0).is_ok());
        }
        assert!(limiter.admit("slow", None, t0).is_err(), "throttled");
        assert!(limiter.admit("fast", Some(1000), t0).is_ok());
        // 100 ms on: by the fast key's rate every bucket would be full again;
        // by its own (1 per second) the slow key's is not.
        let t1 = t0 + Duration::from_millis(100);
        assert!(limiter.admit("newcomer", Some(1000), t1).is_ok());
        assert!(
            limiter.admit("slow", None, t1).is_err(),
            "the throttled key is still throttled"
        );
        assert!(limiter.buckets.lock().unwrap().contains_key("slow"));
        assert!(!limiter.buckets.lock().unwrap().contains_key("fast"));
    }

    #[test]
    fn an_address_that_keeps_failing_is_held_back_and_others_are_not() {
        let t0 = Instant::now();
        let gate = FailureGate::new(1, 3);
        let (guesser, other): (std::net::IpAddr, std::net::IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        assert!(gate.check(guesser, t0).is_ok(), "no failure yet");
        for _ in 0..3 {
            assert!(gate.check(guesser, t0).is_ok());
            gate.failed(guesser, t0);
        }
        assert_eq!(gate.check(guesser, t0), Err(Duration::from_secs(1)));
        assert!(gate.check(other, t0).is_ok(), "another address is free");
        let t1 = t0 + Duration::from_secs(1);
        assert!(
            gate.check(guesser, t1).is_ok(),
            "one more try a second later"
        );
        gate.failed(guesser, t1);
        assert!(gate.check(guesser, t1).is_err());
    }

    #[test]
    fn failing_addresses_past_the_bound_never_grow_the_map() {
        let t0 = Instant::now();
        let mut gate = FailureGate::new(1, 1);
        gate.max_clients = 4;
        for i in 0..20u8 {
            gate.failed(std::net::IpAddr::from([10, 0, 0, i]), t0);
            assert!(gate.buckets.lock().unwrap().len() <= 4, "after {i}");
        }
        // An address whose bucket refilled is the one that goes first.
        let mut gate = FailureGate::new(1, 1);
        gate.max_clients = 2;
        let (old, busy, new) = (
            std::net::IpAddr::from([10, 0, 1, 1]),
            std::net::IpAddr::from([10, 0, 1, 2]),
            std::net::IpAddr::from([10, 0, 1, 3]),
        );
        gate.failed(old, t0);
        let t1 = t0 + Duration::from_secs(5);
        gate.failed(busy, t1);
        gate.failed(new, t1);
        assert!(gate.check(busy, t1).is_err(), "the busy one is kept");
        assert!(!gate.buckets.lock().unwrap().contains_key(&old));
    }

    #[test]
    fn unknown_key_ids_are_remembered_for_a_while() {
        let t0 = Instant::now();
        let unknown = UnknownKeys::new(Duration::from_secs(10));
        assert!(!unknown.known_unknown("abc", t0));
        unknown.note("abc", t0);
        assert!(unknown.known_unknown("abc", t0 + Duration::from_secs(9)));
        assert!(!unknown.known_unknown("abc", t0 + Duration::from_secs(10)));
        assert!(!unknown.known_unknown("abd", t0));
    }

    #[test]
    fn idle_buckets_are_dropped_past_the_bound() {
        let t0 = Instant::now();
        let mut limiter = RateLimiter::new(10, 10);
        limiter.max_keys = 2;
        assert!(limiter.admit("a", None, t0).is_ok());
        assert!(limiter.admit("b", None, t0).is_ok());
        let later = t0 + Duration::from_secs(2);
        assert!(limiter.admit("c", None, later).is_ok());
        assert_eq!(limiter.buckets.lock().unwrap().len(), 1);
    }
}
