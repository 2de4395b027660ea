//! Request decoding — route match, method, declared size, `Idempotency-Key`,
//! `Prefer`, body → typed request, query → page — through the router's own
//! `decode`, with no database.
//!
//! Input format (so that seeds are readable requests):
//! `METHOD TARGET\nname: value\n…\n\nbody`. The target splits at the first
//! `?` into path and query; header names are lower-cased as the engine does;
//! a `content-length` over the body limit marks the body too large, as the
//! engine does before reading it.
//!
//! Asserts, beyond "no panic":
//! - decoding is deterministic, and fails only with 400, 404, 405 or 413,
//!   in the contract's order: no route → 404; a method the route does not
//!   allow → 405 naming the route's methods; a body over the limit → 413;
//! - a decoded write keeps a body whose validation gives the same request
//!   again, that serde_json reads alike from the bytes sent (the strict
//!   parser only refuses more: a repeated member), and whose
//!   re-serialisation fingerprints alike; the `Operation`
//!   kept in the key row round-trips through its JSON (the reaper reads it
//!   back); the key obeys the contract's syntax and is present on charges
//!   and refunds; amounts and ids are in range;
//! - a decoded page has `limit` in 1..=100, a non-empty `starting_after`,
//!   and came from a query whose every `%` escape is two hex digits.
#![no_main]

use idem::config::{AMOUNT_MINOR_MAX, BODY_SIZE_MAX_BYTES, LIST_LIMIT_MAX};
use idem::http::router::{decode, match_route, needs_auth, Command, Write};
use idem::http::Request;
use idem::idempotency::{fingerprint, IdempotencyKey, Mode};
use idem::model::{
    valid_account_id, AccountRequest, CancelRequest, CaptureRequest, ChargeRequest, Operation,
    RefundRequest,
};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let req = request(data);
    let route = match_route(&req.path);
    let _ = needs_auth(&req, route.as_ref());
    let result = decode(&req, route.clone());
    assert_eq!(
        result,
        decode(&req, match_route(&req.path)),
        "not deterministic"
    );

    match (&route, &result) {
        (None, r) => assert!(matches!(r, Err(p) if p.status() == 404), "{r:?}"),
        (Some(route), r) if !route.allow().split(", ").any(|m| m == req.method) => {
            let want = idem::api::Problem::MethodNotAllowed {
                allow: route.allow(),
            };
            assert_eq!(r.as_ref().err(), Some(&want));
        }
        (Some(_), r) if req.body_too_large => {
            assert!(matches!(r, Err(p) if p.status() == 413), "{r:?}")
        }
        (Some(_), Err(p)) => assert_eq!(p.status(), 400, "{p:?}"),
        (Some(_), Ok(command)) => check_command(&req, command),
    }
});

fn check_command(req: &Request, command: &Command<'_>) {
    match command {
        Command::CreateAccount(w) => {
            check_write(
                req,
                w,
                AccountRequest::from_json(&w.body),
                Operation::Account,
            );
            if let Some(key) = &w.key {
                check_key(key);
            }
            if let Some(id) = &w.request.id {
                assert!(valid_account_id(id));
            }
        }
        Command::CreateCharge(w) => {
            check_write(req, w, ChargeRequest::from_json(&w.body), Operation::Charge);
            check_key(&w.key);
            let c = &w.request;
            assert!((1..=AMOUNT_MINOR_MAX).contains(&c.amount));
            assert!(valid_account_id(&c.source) && valid_account_id(&c.destination));
            assert_ne!(c.source, c.destination);
        }
        Command::CreateRefund(w) => {
            let again = RefundRequest::from_json(&w.request.charge, &w.body);
            check_write(req, w, again, Operation::Refund);
            check_key(&w.key);
            assert!(w
                .request
                .amount
                .is_none_or(|a| (1..=AMOUNT_MINOR_MAX).contains(&a)));
        }
        Command::CreateCapture(w) => {
            let again = CaptureRequest::from_json(&w.request.charge, &w.body);
            check_write(req, w, again, Operation::Capture);
            check_key(&w.key);
            assert!(w
                .request
                .amount
                .is_none_or(|a| (1..=AMOUNT_MINOR_MAX).contains(&a)));
        }
        Command::CreateCancel(w) => {
            let again = CancelRequest::from_json(&w.request.charge, &w.body);
            check_write(req, w, again, Operation::Cancel);
            check_key(&w.key);
        }
        Command::CreateWebhookEndpoint(w) => {
            let again = idem::model::WebhookEndpointRequest::from_json(&w.body);
            check_write(req, w, again, Operation::WebhookEndpoint);
            if let Some(key) = &w.key {
                check_key(key);
            }
        }
        Command::CreateNotificationSource(w) => {
            let again = idem::inbound::SourceRequest::from_json(&w.body);
            check_write(req, w, again, Operation::NotificationSource);
            if let Some(key) = &w.key {
                check_key(key);
            }
        }
        Command::ListEntries(_, page)
        | Command::ListCharges(page)
        | Command::ListEvents(page, _)
        | Command::ListWebhookEndpoints(page)
        | Command::ListNotificationSources(page)
        | Command::ListNotifications(page, _) => {
            assert!((1..=LIST_LIMIT_MAX).contains(&page.limit));
            assert!(page.starting_after.as_ref().is_none_or(|s| !s.is_empty()));
            let query = req.query.as_deref().unwrap_or("").as_bytes();
            for (i, _) in query.iter().enumerate().filter(|(_, &b)| b == b'%') {
                let hex = query.get(i + 1..i + 3);
                assert!(
                    hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)),
                    "accepted a bad escape in {:?}",
                    req.query
                );
            }
        }
        Command::Healthz
        | Command::Metrics
        | Command::OpenApi
        | Command::GetAccount(_)
        | Command::GetCharge(_)
        | Command::GetOperation(_)
        | Command::GetEvent(_)
        | Command::ListDeliveries(_)
        | Command::GetWebhookEndpoint(_)
        | Command::DeleteWebhookEndpoint(_)
        | Command::GetNotificationSource(_)
        // Decoded only up to its source: the signature is checked by `App`.
        | Command::Notify(..) => {}
    }
}

fn check_write<T, K, E>(req: &Request, w: &Write<T, K>, again: Result<T, E>, op: fn(T) -> Operation)
where
    T: Clone + PartialEq + std::fmt::Debug,
    E: std::fmt::Debug,
{
    assert_eq!(
        again.as_ref().ok(),
        Some(&w.request),
        "validation not stable"
    );
    // serde_json's `Value` reads an object whose first member is named
    // like its raw-value token as the JSON text in that member; idem reads
    // a member (a metadata key may be named so).
    let raw_token = "$serde_json::private::RawValue";
    let has_token = w.body["metadata"]
        .as_object()
        .is_some_and(|m| m.contains_key(raw_token));
    if !req.body.iter().all(u8::is_ascii_whitespace) && !has_token {
        let sent: Value = serde_json::from_slice(&req.body).expect("serde_json reads the body");
        assert_eq!(sent, w.body, "serde_json reads another body");
    }
    let reread = idem::json::from_slice(w.body.to_string().as_bytes()).expect("body re-parses");
    assert_eq!(reread, w.body);
    assert_eq!(fingerprint(&reread), fingerprint(&w.body));
    let op = op(w.request.clone());
    let stored = serde_json::to_string(&op).expect("operation serialises");
    let back: Operation = serde_json::from_str(&stored).expect("operation reads back");
    assert_eq!(back, op, "{stored}");
    let wants_async = req.headers("prefer").any(|v| {
        v.split(|b| *b == b',')
            .any(|p| p.trim_ascii().eq_ignore_ascii_case(b"respond-async"))
    });
    assert_eq!(w.mode == Mode::Async, wants_async);
}

fn check_key(key: &IdempotencyKey) {
    let s = key.as_str();
    assert!((1..=255).contains(&s.len()));
    assert!(s.bytes().all(|b| (0x21..=0x7e).contains(&b)));
}

/// `METHOD TARGET\nheaders…\n\nbody` → the engine's `Request`.
fn request(data: &[u8]) -> Request {
    let (head, body) = match data.windows(2).position(|w| w == b"\n\n") {
        Some(i) => (&data[..i], &data[i + 2..]),
        None => (data, &[][..]),
    };
    let mut lines = head.split(|&b| b == b'\n');
    let first = lines.next().unwrap_or_default();
    let (method, target) = match first.iter().position(|&b| b == b' ') {
        Some(i) => (&first[..i], &first[i + 1..]),
        None => (first, &b"/"[..]),
    };
    let target = String::from_utf8_lossy(target);
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (target.to_string(), None),
    };
    let headers: Vec<(String, Vec<u8>)> = lines
        .filter_map(|line| {
            let i = line.iter().position(|&b| b == b':')?;
            let name = String::from_utf8_lossy(&line[..i]).to_ascii_lowercase();
            let value = line[i + 1..].trim_ascii_start().to_vec();
            Some((name, value))
        })
        .collect();
    let declared: Option<u64> = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.trim().parse().ok());
    let body_too_large = declared.is_some_and(|n| n > BODY_SIZE_MAX_BYTES as u64)
        || body.len() > BODY_SIZE_MAX_BYTES;
    Request {
        method: String::from_utf8_lossy(method).into_owned(),
        path,
        query,
        headers,
        body: if body_too_large {
            Vec::new()
        } else {
            body.to_vec()
        },
        body_too_large,
    }
}
