//! Standard Webhooks signatures (standardwebhooks.com), both ways: idem
//! signs the events it delivers and verifies the notifications it receives.
//!
//! A secret is `whsec_` followed by the base64 of 32 random bytes; the key
//! is those bytes. A signature is `v1,` and the base64 of HMAC-SHA256 over
//! `"{webhook-id}.{webhook-timestamp}.{body}"`. The `webhook-signature`
//! header may carry several space-separated signatures (a sender rotating
//! its secret); one that matches is enough. Comparison is constant-time
//! (`hmac`'s `verify_slice`).

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The prefix of every secret idem shows.
pub const SECRET_PREFIX: &str = "whsec_";
/// Bytes of key behind a secret.
pub const SECRET_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// A new random key and its secret as shown to the user (`whsec_...`).
pub fn new_secret() -> std::io::Result<([u8; SECRET_BYTES], String)> {
    let mut key = [0u8; SECRET_BYTES];
    getrandom::fill(&mut key).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok((key, show_secret(&key)))
}

/// The secret of a key, as shown once to the user.
pub fn show_secret(key: &[u8]) -> String {
    format!("{SECRET_PREFIX}{}", BASE64.encode(key))
}

/// The key of a `whsec_...` secret (`None` if it is not one).
#[cfg(any(test, feature = "internals"))]
pub fn parse_secret(secret: &str) -> Option<Vec<u8>> {
    BASE64
        .decode(secret.strip_prefix(SECRET_PREFIX).unwrap_or(secret))
        .ok()
        .filter(|k| !k.is_empty())
}

fn mac(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The `webhook-signature` header value for one attempt.
pub fn sign(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    format!(
        "v1,{}",
        BASE64.encode(mac(key, id, timestamp, body).finalize().into_bytes())
    )
}

/// Why a notification's signature was refused (all answer 401
/// `signature-invalid`; the reason is for the log and the `detail`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureError {
    /// A `webhook-id`, `webhook-timestamp` or `webhook-signature` header is
    /// missing or not text.
    MissingHeader,
    /// `webhook-timestamp` is not a whole number of seconds.
    BadTimestamp,
    /// The timestamp is further from now than the tolerance (a replayed
    /// signature, or a sender's clock far off).
    OutsideTolerance,
    /// No `v1` signature in the header matches.
    NoMatch,
}

impl std::fmt::Display for SignatureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SignatureError::MissingHeader => {
                "webhook-id, webhook-timestamp and webhook-signature headers are required"
            }
            SignatureError::BadTimestamp => "webhook-timestamp is not a number of seconds",
            SignatureError::OutsideTolerance => {
                "webhook-timestamp is too far from now (a replayed or delayed request)"
            }
            SignatureError::NoMatch => "no signature matches",
        })
    }
}

/// Verifies one received request: `timestamp` (the header, unix seconds)
/// within `tolerance_s` of `now_s` either way, and one of the header's `v1`
/// signatures matching `key` over id, timestamp and the raw body.
pub fn verify(
    key: &[u8],
    id: &str,
    timestamp: &str,
    signatures: &str,
    body: &[u8],
    now_s: i64,
    tolerance_s: i64,
) -> Result<(), SignatureError> {
    let ts: i64 = (!timestamp.is_empty() && timestamp.bytes().all(|b| b.is_ascii_digit()))
        .then(|| timestamp.parse().ok())
        .flatten()
        .ok_or(SignatureError::BadTimestamp)?;
    if ts.abs_diff(now_s) > tolerance_s.unsigned_abs() {
        return Err(SignatureError::OutsideTolerance);
    }
    let expected = mac(key, id, ts, body);
    for candidate in signatures.split(' ') {
        let Some(encoded) = candidate.strip_prefix("v1,") else {
            continue;
        };
        let Ok(given) = BASE64.decode(encoded) else {
            continue;
        };
        if expected.clone().verify_slice(&given).is_ok() {
            return Ok(());
        }
    }
    Err(SignatureError::NoMatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_and_any_change_breaks_it() {
        let (key, secret) = new_secret().unwrap();
        assert_eq!(parse_secret(&secret).unwrap(), key);
        let sig = sign(&key, "evt_1", 1_700_000_000, b"{\"a\":1}");
        let ok = |id: &str, ts: &str, sig: &str, body: &[u8], now: i64| {
            verify(&key, id, ts, sig, body, now, 300)
        };
        assert_eq!(
            ok("evt_1", "1700000000", &sig, b"{\"a\":1}", 1_700_000_100),
            Ok(())
        );
        // Several signatures, one good (a rotation).
        let both = format!("v1,AAAA {sig}");
        assert_eq!(
            ok("evt_1", "1700000000", &both, b"{\"a\":1}", 1_700_000_000),
            Ok(())
        );
        let no = Err(SignatureError::NoMatch);
        assert_eq!(
            ok("evt_2", "1700000000", &sig, b"{\"a\":1}", 1_700_000_000),
            no
        );
        assert_eq!(
            ok("evt_1", "1700000000", &sig, b"{\"a\":2}", 1_700_000_000),
            no
        );
        assert_eq!(
            ok("evt_1", "1700000001", &sig, b"{\"a\":1}", 1_700_000_000),
            no
        );
        assert_eq!(
            ok(
                "evt_1",
                "1700000000",
                &sig.replace("v1,", "v2,"),
                b"{\"a\":1}",
                1_700_000_000
            ),
            no
        );
        assert_eq!(
            ok("evt_1", "1700000000", &sig, b"{\"a\":1}", 1_700_000_301),
            Err(SignatureError::OutsideTolerance)
        );
        assert_eq!(
            ok("evt_1", "1700000000", &sig, b"{\"a\":1}", 1_699_999_699),
            Err(SignatureError::OutsideTolerance)
        );
        assert_eq!(
            ok("evt_1", "+1700000000", &sig, b"{\"a\":1}", 1_700_000_000),
            Err(SignatureError::BadTimestamp)
        );
    }

    #[test]
    fn the_reference_implementation_accepts_our_signatures_and_we_accept_its() {
        let (key, secret) = new_secret().unwrap();
        let body = br#"{"id":"evt_1","object":"event"}"#;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let reference = standardwebhooks::Webhook::new(&secret).unwrap();
        let mut headers = hyper::HeaderMap::new();
        headers.insert("webhook-id", "msg_1".parse().unwrap());
        headers.insert("webhook-timestamp", now.to_string().parse().unwrap());
        headers.insert(
            "webhook-signature",
            sign(&key, "msg_1", now, body).parse().unwrap(),
        );
        reference.verify(body, &headers).unwrap();
        let theirs = reference.sign("msg_1", now, body).unwrap();
        assert_eq!(
            verify(&key, "msg_1", &now.to_string(), &theirs, body, now, 300),
            Ok(())
        );
    }
}
