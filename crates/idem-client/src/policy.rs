//! When to retry and how long to wait: exponential backoff with full jitter,
//! `Retry-After`, an attempt cap and a total deadline.

use std::time::Duration;

/// How a [`crate::Client`] retries one call.
///
/// Before attempt `n + 1` the client waits a random time in
/// `[0, min(cap, base · 2^(n−1))]` ("full jitter", so that many clients
/// failing together do not retry together), or the answer's `Retry-After` if
/// that is longer. It stops after `attempts_max` attempts, or when the next
/// attempt could not start before `deadline` (counted from the first
/// attempt): a `Retry-After` that reaches past the deadline ends the call at
/// once rather than sleeping until it. Every attempt gets at most
/// `per_request_timeout`, and never more than what is left of the deadline.
///
/// The defaults suit an interactive payment: 30 s per attempt (the seed's
/// POS terminal), 2 min in all — long enough to outlast a crashed owner's
/// `--inflight-timeout` (60 s by default), after which a retry takes the key
/// over — and at most 12 attempts, waits from 250 ms up to 10 s.
///
/// ```
/// use std::time::Duration;
/// use idem_client::RetryPolicy;
///
/// let fast = RetryPolicy {
///     per_request_timeout: Duration::from_millis(200),
///     deadline: Duration::from_secs(3),
///     ..RetryPolicy::default()
/// };
/// assert_eq!(fast.attempts_max, 12);
/// assert!(fast.backoff(3) <= Duration::from_secs(1)); // 250 ms · 2² at most
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (≥ 1).
    pub attempts_max: u32,
    /// The ceiling of the first backoff (> 0).
    pub base: Duration,
    /// The largest ceiling a backoff may reach (≥ `base`).
    pub cap: Duration,
    /// The time from the first attempt after which no attempt starts (> 0).
    pub deadline: Duration,
    /// The most one attempt may take, connecting, sending and reading the
    /// whole answer (> 0).
    pub per_request_timeout: Duration,
    /// The most opening a connection may take within an attempt (> 0).
    pub connect_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            attempts_max: 12,
            base: Duration::from_millis(250),
            cap: Duration::from_secs(10),
            deadline: Duration::from_secs(120),
            per_request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// The ceiling of the wait before attempt `failed + 1`, after `failed`
    /// failed attempts: `min(cap, base · 2^(failed−1))`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    ///
    /// let p = RetryPolicy { base: Duration::from_millis(100), cap: Duration::from_millis(500), ..RetryPolicy::default() };
    /// assert_eq!(p.backoff_ceiling(1), Duration::from_millis(100));
    /// assert_eq!(p.backoff_ceiling(3), Duration::from_millis(400));
    /// assert_eq!(p.backoff_ceiling(30), Duration::from_millis(500));
    /// ```
    pub fn backoff_ceiling(&self, failed: u32) -> Duration {
        let doublings = failed.saturating_sub(1).min(32);
        self.base
            .checked_mul(1u32 << doublings.min(31))
            .map_or(self.cap, |d| d.min(self.cap))
    }

    /// A wait drawn uniformly from `[0, backoff_ceiling(failed)]` (full
    /// jitter).
    ///
    /// ```
    /// use idem_client::RetryPolicy;
    ///
    /// let p = RetryPolicy::default();
    /// assert!(p.backoff(2) <= p.backoff_ceiling(2));
    /// ```
    pub fn backoff(&self, failed: u32) -> Duration {
        let ceiling = self.backoff_ceiling(failed).as_nanos();
        let ceiling = u64::try_from(ceiling).unwrap_or(u64::MAX);
        // The OS's generator, as for keys; if it failed, the middle of the
        // range still spreads retries less but delays them as much.
        let nanos = match getrandom::u64() {
            Ok(r) => r % ceiling.saturating_add(1).max(1),
            Err(_) => ceiling / 2,
        };
        Duration::from_nanos(nanos)
    }

    /// Checks the bounds documented on each field.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let positive = [
            ("base", self.base),
            ("deadline", self.deadline),
            ("per_request_timeout", self.per_request_timeout),
            ("connect_timeout", self.connect_timeout),
        ];
        for (name, value) in positive {
            if value.is_zero() {
                return Err(format!("{name} must be greater than zero"));
            }
        }
        if self.attempts_max == 0 {
            return Err("attempts_max must be at least 1".into());
        }
        if self.cap < self.base {
            return Err("cap must be at least base".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_double_up_to_the_cap_without_overflow() {
        let p = RetryPolicy {
            base: Duration::from_millis(10),
            cap: Duration::from_secs(1),
            ..RetryPolicy::default()
        };
        let ceilings: Vec<u128> = (1..=9).map(|n| p.backoff_ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        assert_eq!(p.backoff_ceiling(0), Duration::from_millis(10));
        assert_eq!(p.backoff_ceiling(u32::MAX), Duration::from_secs(1));
        let huge = RetryPolicy {
            base: Duration::from_secs(u64::MAX / 4),
            cap: Duration::MAX,
            ..RetryPolicy::default()
        };
        assert_eq!(huge.backoff_ceiling(10), Duration::MAX);
    }

    #[test]
    fn full_jitter_covers_the_range_and_stays_in_it() {
        let p = RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(100),
            ..RetryPolicy::default()
        };
        let draws: Vec<Duration> = (0..2000).map(|_| p.backoff(1)).collect();
        assert!(draws.iter().all(|d| *d <= Duration::from_millis(100)));
        // Full jitter, not "equal jitter": waits near zero and near the
        // ceiling both occur.
        assert!(draws.iter().any(|d| *d < Duration::from_millis(10)));
        assert!(draws.iter().any(|d| *d > Duration::from_millis(90)));
    }

    #[test]
    fn validation_names_the_field() {
        let bad = RetryPolicy {
            attempts_max: 0,
            ..RetryPolicy::default()
        };
        assert!(bad.validate().unwrap_err().contains("attempts_max"));
        let bad = RetryPolicy {
            deadline: Duration::ZERO,
            ..RetryPolicy::default()
        };
        assert!(bad.validate().unwrap_err().contains("deadline"));
        let bad = RetryPolicy {
            cap: Duration::from_millis(1),
            ..RetryPolicy::default()
        };
        assert!(bad.validate().unwrap_err().contains("cap"));
        assert!(RetryPolicy::default().validate().is_ok());
    }
}
