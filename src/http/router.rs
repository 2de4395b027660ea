//! Routing and decoding: method and path to an application call, in the
//! contract's order of checks — auth (401), route and method (404/405),
//! declared body size (413), the `Idempotency-Key` header (400), the body
//! (400), then the application. Runs no SQL.

use serde_json::Value;

use super::Request;
use crate::api::{Answer, Problem, Reply, JSON, OPENAPI_DOCUMENT};
use crate::app::App;
use crate::config::{LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX};
use crate::idempotency::{IdempotencyKey, KeyError, Mode};
use crate::model::{parse_object, AccountRequest, ChargeRequest, FieldError, Page, RefundRequest};

/// A matched route: its template (the metrics label) and what it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route<'a> {
    Healthz,
    Metrics,
    OpenApi,
    Accounts,
    Account(&'a str),
    AccountEntries(&'a str),
    Charges,
    Charge(&'a str),
    Refunds(&'a str),
    Operation(&'a str),
}

impl Route<'_> {
    pub fn template(&self) -> &'static str {
        match self {
            Route::Healthz => "/healthz",
            Route::Metrics => "/metrics",
            Route::OpenApi => "/openapi.json",
            Route::Accounts => "/v1/accounts",
            Route::Account(_) => "/v1/accounts/{id}",
            Route::AccountEntries(_) => "/v1/accounts/{id}/entries",
            Route::Charges => "/v1/charges",
            Route::Charge(_) => "/v1/charges/{id}",
            Route::Refunds(_) => "/v1/charges/{id}/refunds",
            Route::Operation(_) => "/v1/operations/{id}",
        }
    }

    /// The methods the route answers (the `Allow` header).
    pub fn allow(&self) -> &'static str {
        match self {
            Route::Accounts | Route::Refunds(_) => "POST",
            Route::Charges => "GET, POST",
            _ => "GET",
        }
    }

    fn needs_auth(&self) -> bool {
        !matches!(self, Route::Healthz | Route::Metrics | Route::OpenApi)
    }
}

/// Every route template, for documentation and tests.
pub const ROUTES: &[&str] = &[
    "/healthz",
    "/metrics",
    "/openapi.json",
    "/v1/accounts",
    "/v1/accounts/{id}",
    "/v1/accounts/{id}/entries",
    "/v1/charges",
    "/v1/charges/{id}",
    "/v1/charges/{id}/refunds",
    "/v1/operations/{id}",
];

pub fn match_route(path: &str) -> Option<Route<'_>> {
    let segments: Vec<&str> = path.strip_prefix('/')?.split('/').collect();
    let id_ok = |s: &str| !s.is_empty();
    Some(match segments.as_slice() {
        ["healthz"] => Route::Healthz,
        ["metrics"] => Route::Metrics,
        ["openapi.json"] => Route::OpenApi,
        ["v1", "accounts"] => Route::Accounts,
        ["v1", "accounts", id] if id_ok(id) => Route::Account(id),
        ["v1", "accounts", id, "entries"] if id_ok(id) => Route::AccountEntries(id),
        ["v1", "charges"] => Route::Charges,
        ["v1", "charges", id] if id_ok(id) => Route::Charge(id),
        ["v1", "charges", id, "refunds"] if id_ok(id) => Route::Refunds(id),
        ["v1", "operations", id] if id_ok(id) => Route::Operation(id),
        _ => return None,
    })
}

/// Handles one request; returns the route template for metrics.
pub fn handle(app: &App, req: &Request) -> (&'static str, Answer) {
    let route = match_route(&req.path);
    let template = route.as_ref().map_or("unmatched", Route::template);
    let answer = dispatch(app, req, route).unwrap_or_else(|p| Answer::Now(p.reply()));
    (template, answer)
}

fn dispatch(app: &App, req: &Request, route: Option<Route<'_>>) -> Result<Answer, Problem> {
    let under_v1 = req.path == "/v1" || req.path.starts_with("/v1/");
    let consumer = if under_v1 || route.as_ref().is_some_and(Route::needs_auth) {
        Some(authenticate(app, req)?)
    } else {
        None
    };
    let route = route.ok_or(Problem::NotFound)?;
    let method = req.method.as_str();
    let allowed = route.allow().split(", ").any(|m| m == method);
    if !allowed {
        return Err(Problem::MethodNotAllowed {
            allow: route.allow(),
        });
    }
    if req.body_too_large {
        return Err(Problem::BodyTooLarge);
    }
    let Some(consumer) = consumer else {
        return Ok(Answer::Now(match route {
            Route::Healthz => Reply::json(200, &serde_json::json!({"status": "ok"})),
            Route::OpenApi => Reply::raw(200, JSON, OPENAPI_DOCUMENT.as_bytes().to_vec()),
            _ => Reply::raw(
                200,
                "text/plain; version=0.0.4",
                app.metrics.render().into_bytes(),
            ),
        }));
    };
    match (method, route) {
        ("POST", Route::Accounts) => {
            let key = idempotency_key(req, false)?;
            let body = body(req)?;
            let account = AccountRequest::from_json(&body).map_err(invalid)?;
            Ok(app.create_account(consumer, key, mode(req), &body, account))
        }
        ("POST", Route::Charges) => {
            let key = idempotency_key(req, true)?.expect("required");
            let body = body(req)?;
            let charge = ChargeRequest::from_json(&body).map_err(invalid)?;
            Ok(app.create_charge(consumer, key, mode(req), &body, charge))
        }
        ("POST", Route::Refunds(charge)) => {
            let key = idempotency_key(req, true)?.expect("required");
            let body = body(req)?;
            let refund = RefundRequest::from_json(charge, &body).map_err(invalid)?;
            Ok(app.create_refund(consumer, key, mode(req), &body, refund))
        }
        (_, Route::Account(id)) => Ok(app.get_account(consumer, id).into()),
        (_, Route::AccountEntries(id)) => Ok(app.list_entries(consumer, id, &page(req)?).into()),
        (_, Route::Charges) => Ok(app.list_charges(consumer, &page(req)?).into()),
        (_, Route::Charge(id)) => Ok(app.get_charge(consumer, id).into()),
        (_, Route::Operation(id)) => Ok(app.get_operation(consumer, id).into()),
        (_, route) => unreachable!("method {method} allowed on {route:?}"),
    }
}

fn authenticate(app: &App, req: &Request) -> Result<i64, Problem> {
    let header = req.header("authorization").ok_or(Problem::Unauthorized)?;
    let token = bearer_token(header).ok_or(Problem::Unauthorized)?;
    app.authenticate(token)
}

/// The token of `Bearer <token>` (scheme case-insensitive).
fn bearer_token(header: &[u8]) -> Option<&[u8]> {
    let header = header.trim_ascii();
    let (scheme, rest) = header.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !rest.first()?.is_ascii_whitespace() {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

fn idempotency_key(req: &Request, required: bool) -> Result<Option<IdempotencyKey>, Problem> {
    let mut values = req.headers("idempotency-key");
    let Some(first) = values.next() else {
        return if required {
            Err(Problem::IdempotencyKeyMissing)
        } else {
            Ok(None)
        };
    };
    if values.next().is_some() {
        return Err(Problem::IdempotencyKeyInvalid);
    }
    match IdempotencyKey::parse(first) {
        Ok(key) => Ok(Some(key)),
        Err(KeyError::Missing) => Err(Problem::IdempotencyKeyMissing),
        Err(KeyError::Invalid) => Err(Problem::IdempotencyKeyInvalid),
    }
}

fn body(req: &Request) -> Result<Value, Problem> {
    parse_object(&req.body).map_err(invalid)
}

fn invalid(e: FieldError) -> Problem {
    Problem::InvalidRequest(e.to_string())
}

/// `Prefer: respond-async` (RFC 7240), in any of the header's values.
fn mode(req: &Request) -> Mode {
    let wants_async = req.headers("prefer").any(|v| {
        v.split(|b| *b == b',')
            .any(|p| p.trim_ascii().eq_ignore_ascii_case(b"respond-async"))
    });
    if wants_async {
        Mode::Async
    } else {
        Mode::Sync
    }
}

fn page(req: &Request) -> Result<Page, Problem> {
    let mut page = Page {
        limit: LIST_LIMIT_DEFAULT,
        starting_after: None,
    };
    let query = req.query.as_deref().unwrap_or("");
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value)
            .ok_or_else(|| Problem::InvalidRequest(format!("{name}: bad percent-encoding")))?;
        match name {
            "limit" => {
                page.limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=LIST_LIMIT_MAX).contains(n))
                    .ok_or_else(|| {
                        Problem::InvalidRequest(format!(
                            "limit: must be an integer from 1 to {LIST_LIMIT_MAX}"
                        ))
                    })?;
            }
            "starting_after" if !value.is_empty() => page.starting_after = Some(value),
            "starting_after" => {
                return Err(Problem::InvalidRequest(
                    "starting_after: must not be empty".into(),
                ))
            }
            other => {
                return Err(Problem::InvalidRequest(format!(
                    "{other}: unknown query parameter"
                )))
            }
        }
    }
    Ok(page)
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_match_their_templates() {
        let cases = [
            ("/healthz", Some(Route::Healthz)),
            ("/v1/accounts", Some(Route::Accounts)),
            ("/v1/accounts/a-1", Some(Route::Account("a-1"))),
            (
                "/v1/accounts/a-1/entries",
                Some(Route::AccountEntries("a-1")),
            ),
            ("/v1/charges/ch_1/refunds", Some(Route::Refunds("ch_1"))),
            ("/v1/operations/op_1", Some(Route::Operation("op_1"))),
            ("/v1/charges/", None),
            ("/v1/accounts//entries", None),
            ("/v1/charges/x/y", None),
            ("v1/charges", None),
            ("/", None),
        ];
        for (path, want) in cases {
            assert_eq!(match_route(path), want, "{path}");
        }
        for template in ROUTES {
            let path = template.replace("{id}", "x");
            assert_eq!(match_route(&path).map(|r| r.template()), Some(*template));
        }
    }

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer_token(b"Bearer sk_1"), Some(&b"sk_1"[..]));
        assert_eq!(bearer_token(b"bearer   sk_1 "), Some(&b"sk_1"[..]));
        assert_eq!(bearer_token(b"Bearer"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Basic sk_1"), None);
        assert_eq!(bearer_token(b"Bearersk_1"), None);
    }

    #[test]
    fn prefer_async_and_pages() {
        let mut req = Request::default();
        assert_eq!(mode(&req), Mode::Sync);
        req.headers
            .push(("prefer".into(), b"wait=5, Respond-Async".to_vec()));
        assert_eq!(mode(&req), Mode::Async);
        req.query = Some("limit=100&starting_after=ch_%41".into());
        assert_eq!(
            page(&req).unwrap(),
            Page {
                limit: 100,
                starting_after: Some("ch_A".into())
            }
        );
        for bad in [
            "limit=0",
            "limit=101",
            "limit=x",
            "limit=1.5",
            "colour=red",
            "starting_after=",
        ] {
            req.query = Some(bad.into());
            assert!(page(&req).is_err(), "{bad}");
        }
    }
}
