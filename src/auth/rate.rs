//! Request rates per API key: a token bucket per key, refilled at the key's
//! rate (`ductor keys create --requests-per-second`, else
//! `server.requests_per_second`) up to `server.request_burst`. Keys are
//! issued by the operator, one or a few per tenant, so a key's rate is its
//! tenant's share of the API.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One key's bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket.
    pub fn full(burst: u32, now: Instant) -> Self {
        Bucket {
            tokens: f64::from(burst),
            at: now,
        }
    }

    /// Takes one token if there is one; otherwise how long until there is.
    pub fn take(&mut self, rate: u32, burst: u32, now: Instant) -> Result<(), Duration> {
        let rate = f64::from(rate.max(1));
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(f64::from(burst.max(1)));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
        }
    }
}

/// The buckets of every key seen lately. Bounded: past `max_keys`, the
/// buckets that have been full for a while (idle keys) are dropped, which
/// loses nothing since a dropped bucket comes back full.
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

    /// Admits one request of `key_id` (at its own `rate`, if it has one),
    /// or says when to retry.
    pub fn admit(&self, key_id: &str, rate: Option<u32>, now: Instant) -> Result<(), Duration> {
        let rate = rate.unwrap_or(self.default_rate);
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= self.max_keys && !buckets.contains_key(key_id) {
            let idle = Duration::from_secs_f64(f64::from(self.burst) / f64::from(rate.max(1)));
            buckets.retain(|_, b| now.saturating_duration_since(b.at) < idle);
        }
        buckets
            .entry(key_id.to_owned())
            .or_insert_with(|| Bucket::full(self.burst, now))
            .take(rate, self.burst, now)
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
