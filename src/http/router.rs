//! Routing and decoding: method and path to an application call, in the
//! contract's order of checks — auth (401), route and method (404/405),
//! declared body size (413), the `Idempotency-Key` header (400), the body
//! (400), then the sandbox's `Idem-Simulate` header (400), then the
//! application. Runs no SQL.

use serde_json::Value;

use super::Request;
use crate::api::{Answer, Handover, Problem, Reply, JSON, OPENAPI_DOCUMENT};
use crate::app::{App, Signed};
use crate::config::{LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX};
use crate::events::EventType;
use crate::idempotency::{IdempotencyKey, KeyError, Mode};
use crate::inbound::{SourceRequest, Status};
use crate::model::{
    parse_object, AccountRequest, CancelRequest, CaptureRequest, ChargeRequest, FieldError, Page,
    RefundRequest, WebhookEndpointRequest,
};
use crate::sandbox::{Directive, Directives, ResponseFault, Target, SIMULATE_HEADER};

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
    Capture(&'a str),
    Cancel(&'a str),
    Operation(&'a str),
    Events,
    Event(&'a str),
    EventDeliveries(&'a str),
    WebhookEndpoints,
    WebhookEndpoint(&'a str),
    NotificationSources,
    NotificationSource(&'a str),
    Notifications,
    /// `POST /v1/notifications/{id}`: a source's inbound notification,
    /// authenticated by its signature, not by a bearer key.
    Notify(&'a str),
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
            Route::Capture(_) => "/v1/charges/{id}/capture",
            Route::Cancel(_) => "/v1/charges/{id}/cancel",
            Route::Operation(_) => "/v1/operations/{id}",
            Route::Events => "/v1/events",
            Route::Event(_) => "/v1/events/{id}",
            Route::EventDeliveries(_) => "/v1/events/{id}/deliveries",
            Route::WebhookEndpoints => "/v1/webhook_endpoints",
            Route::WebhookEndpoint(_) => "/v1/webhook_endpoints/{id}",
            Route::NotificationSources => "/v1/notification_sources",
            Route::NotificationSource(_) => "/v1/notification_sources/{id}",
            Route::Notifications => "/v1/notifications",
            Route::Notify(_) => "/v1/notifications/{id}",
        }
    }

    /// The methods the route answers (the `Allow` header). HEAD wherever
    /// GET (RFC 9110 §9.3.2): it is decoded and answered as GET, and the
    /// engine sends GET's status and headers without the body.
    pub fn allow(&self) -> &'static str {
        match self {
            Route::Accounts
            | Route::Refunds(_)
            | Route::Capture(_)
            | Route::Cancel(_)
            | Route::Notify(_) => "POST",
            Route::Charges | Route::WebhookEndpoints | Route::NotificationSources => {
                "GET, HEAD, POST"
            }
            Route::WebhookEndpoint(_) => "GET, HEAD, DELETE",
            _ => "GET, HEAD",
        }
    }

    /// What kind of POST the route takes, for the sandbox's directives.
    fn target(&self) -> Target {
        match self {
            Route::Charges => Target::Charge,
            Route::Refunds(_) | Route::Capture(_) | Route::Cancel(_) => Target::Settlement,
            _ => Target::Other,
        }
    }

    fn needs_auth(&self) -> bool {
        !matches!(
            self,
            Route::Healthz | Route::Metrics | Route::OpenApi | Route::Notify(_)
        )
    }
}

/// Every route template, for documentation and tests.
#[cfg(any(test, feature = "internals"))]
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
    "/v1/charges/{id}/capture",
    "/v1/charges/{id}/cancel",
    "/v1/operations/{id}",
    "/v1/events",
    "/v1/events/{id}",
    "/v1/events/{id}/deliveries",
    "/v1/webhook_endpoints",
    "/v1/webhook_endpoints/{id}",
    "/v1/notification_sources",
    "/v1/notification_sources/{id}",
    "/v1/notifications",
    "/v1/notifications/{id}",
];

/// The kind of POST `path` (a concrete path or a route template) takes;
/// `None` if no route there answers POST.
pub fn post_target(path: &str) -> Option<Target> {
    let route = match_route(path)?;
    route
        .allow()
        .split(", ")
        .any(|m| m == "POST")
        .then(|| route.target())
}

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
        ["v1", "charges", id, "capture"] if id_ok(id) => Route::Capture(id),
        ["v1", "charges", id, "cancel"] if id_ok(id) => Route::Cancel(id),
        ["v1", "operations", id] if id_ok(id) => Route::Operation(id),
        ["v1", "events"] => Route::Events,
        ["v1", "events", id] if id_ok(id) => Route::Event(id),
        ["v1", "events", id, "deliveries"] if id_ok(id) => Route::EventDeliveries(id),
        ["v1", "webhook_endpoints"] => Route::WebhookEndpoints,
        ["v1", "webhook_endpoints", id] if id_ok(id) => Route::WebhookEndpoint(id),
        ["v1", "notification_sources"] => Route::NotificationSources,
        ["v1", "notification_sources", id] if id_ok(id) => Route::NotificationSource(id),
        ["v1", "notifications"] => Route::Notifications,
        ["v1", "notifications", id] if id_ok(id) => Route::Notify(id),
        _ => return None,
    })
}

/// What a request asks for, decoded without the database: everything the
/// contract checks after auth — route (404), method (405), declared body
/// size (413), the `Idempotency-Key` (400), the body (400) and the query.
/// `handle` runs it on `App`; the fuzz target `decode` runs this alone, so
/// it exercises the very code the server runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Command<'a> {
    Healthz,
    Metrics,
    OpenApi,
    CreateAccount(Write<AccountRequest, Option<IdempotencyKey>>),
    CreateCharge(Write<ChargeRequest>),
    CreateRefund(Write<RefundRequest>),
    CreateCapture(Write<CaptureRequest>),
    CreateCancel(Write<CancelRequest>),
    GetAccount(&'a str),
    ListEntries(&'a str, Page),
    ListCharges(Page),
    GetCharge(&'a str),
    GetOperation(&'a str),
    /// `GET /v1/events`, of one type if filtered.
    ListEvents(Page, Option<EventType>),
    GetEvent(&'a str),
    /// `GET /v1/events/{id}/deliveries`.
    ListDeliveries(&'a str),
    /// `POST /v1/webhook_endpoints` (an `Idempotency-Key` is optional).
    CreateWebhookEndpoint(Write<WebhookEndpointRequest, Option<IdempotencyKey>>),
    ListWebhookEndpoints(Page),
    GetWebhookEndpoint(&'a str),
    DeleteWebhookEndpoint(&'a str),
    CreateNotificationSource(Write<SourceRequest, Option<IdempotencyKey>>),
    GetNotificationSource(&'a str),
    ListNotificationSources(Page),
    /// `GET /v1/notifications`, of one status if filtered.
    ListNotifications(Page, Option<Status>),
    /// A notification for source `.0`, not yet authenticated: the
    /// signature needs the source's secret, so `App` checks it first.
    Notify(&'a str, Signed<'a>),
}

/// A decoded POST: its key (required unless `K` is an `Option`), its mode,
/// the body as parsed (what the fingerprint is taken of) and the validated
/// request.
#[derive(Debug, Clone, PartialEq)]
pub struct Write<T, K = IdempotencyKey> {
    pub key: K,
    pub mode: Mode,
    pub body: Value,
    pub request: T,
}

/// Handles one request; returns the route template for metrics.
pub fn handle(app: &App, req: &Request) -> (&'static str, Answer) {
    let route = match_route(&req.path);
    let template = route.as_ref().map_or("unmatched", Route::template);
    let answer = dispatch(app, req, route).unwrap_or_else(|p| Answer::Now(p.reply()));
    (template, answer)
}

fn dispatch(app: &App, req: &Request, route: Option<Route<'_>>) -> Result<Answer, Problem> {
    let consumer = if needs_auth(req, route.as_ref()) {
        Some(authenticate(app, req)?)
    } else {
        None
    };
    let sandboxed = route.as_ref().map(|r| (r.template(), r.target()));
    let command = decode(req, route)?;
    let faults = simulation(app, req, sandboxed)?;
    let answer = run(app, consumer, command, faults)?;
    Ok(respond(app, answer, faults.response))
}

/// The sandbox's faults for this request, checked after everything
/// `decode` checks: those its `Idem-Simulate` header asks for, or else
/// those of the first script that matches it (`Server::simulate`). Outside
/// sandbox mode the header is 400 `simulation-disabled`; in it, a header
/// sent twice, on anything but a POST, unparsable, or asking for what the
/// route cannot do is 400 `invalid-request` naming why.
fn simulation(
    app: &App,
    req: &Request,
    route: Option<(&'static str, Target)>,
) -> Result<Directives, Problem> {
    let target = route.filter(|_| req.method == "POST");
    let mut values = req.headers(SIMULATE_HEADER);
    let Some(value) = values.next() else {
        let scripted =
            target.and_then(|(template, target)| app.sandbox().take(&req.path, template, target));
        return Ok(scripted.unwrap_or_default());
    };
    if !app.sandbox().enabled() {
        return Err(Problem::SimulationDisabled);
    }
    if values.next().is_some() {
        return Err(Problem::InvalidRequest(
            "Idem-Simulate: send one header, directives separated by commas".into(),
        ));
    }
    let Some((_, target)) = target else {
        return Err(Problem::InvalidRequest(
            "Idem-Simulate: applies to POST requests only".into(),
        ));
    };
    let directives = Directives::parse(value).map_err(Problem::InvalidRequest)?;
    directives
        .check_target(target)
        .map_err(Problem::InvalidRequest)?;
    Ok(directives)
}

/// The sandbox's `response=` directive on whatever this attempt answers:
/// closed unanswered (`drop`), answered later by the connection task
/// (`delay`), or replaced by 503 (`503`). An attempt already abandoned by
/// a crash stays unanswered.
fn respond(app: &App, answer: Answer, fault: Option<ResponseFault>) -> Answer {
    let Some(fault) = fault else {
        return answer;
    };
    let metrics = std::sync::Arc::clone(&app.metrics);
    let apply = move |reply: Reply| -> Reply {
        if reply.handover == Handover::Abandon {
            return reply;
        }
        match fault {
            ResponseFault::Drop => {
                metrics.simulated(Directive::ResponseDrop);
                Reply {
                    handover: Handover::Abandon,
                    ..reply
                }
            }
            ResponseFault::Delay(wait) => {
                metrics.simulated(Directive::ResponseDelay(wait));
                Reply {
                    handover: Handover::After(wait),
                    ..reply
                }
            }
            ResponseFault::Unavailable => {
                metrics.simulated(Directive::Response503);
                Problem::TemporarilyUnavailable(
                    "sandbox: response=503 replaced the answer; retry with the same key".into(),
                )
                .reply()
            }
        }
    };
    match answer {
        Answer::Now(reply) => Answer::Now(apply(reply)),
        Answer::Later(start) => Answer::Later(Box::new(move |deliver| {
            start(Box::new(move |reply| deliver(apply(reply))))
        })),
    }
}

/// Runs a decoded command on `app`, as `consumer` where it needs one.
fn run(
    app: &App,
    consumer: Option<i64>,
    command: Command<'_>,
    faults: Directives,
) -> Result<Answer, Problem> {
    if let Command::Notify(source, signed) = &command {
        return Ok(app.receive_notification(source, signed));
    }
    let Some(consumer) = consumer else {
        return Ok(Answer::Now(match command {
            // Written out: json! would sort the members.
            Command::Healthz if app.sandbox().enabled() => {
                Reply::raw(200, JSON, br#"{"status":"ok","sandbox":true}"#.to_vec())
            }
            Command::Healthz => Reply::json(200, &serde_json::json!({"status": "ok"})),
            Command::Metrics => Reply::raw(
                200,
                "text/plain; version=0.0.4",
                app.metrics.render().into_bytes(),
            ),
            Command::OpenApi => Reply::raw(200, JSON, OPENAPI_DOCUMENT.as_bytes().to_vec()),
            // Never print the command: it holds the body and the key.
            _ => unreachable!("an authenticated route decoded without auth"),
        }));
    };
    Ok(match command {
        Command::CreateAccount(w) => {
            app.create_account(consumer, w.key, w.mode, &w.body, w.request)
        }
        Command::CreateCharge(w) => {
            app.create_charge(consumer, w.key, w.mode, &w.body, w.request, faults)
        }
        Command::CreateRefund(w) => {
            app.create_refund(consumer, w.key, w.mode, &w.body, w.request, faults)
        }
        Command::CreateCapture(w) => {
            app.create_capture(consumer, w.key, w.mode, &w.body, w.request, faults)
        }
        Command::CreateCancel(w) => {
            app.create_cancel(consumer, w.key, w.mode, &w.body, w.request, faults)
        }
        Command::GetAccount(id) => app.get_account(consumer, id).into(),
        Command::ListEntries(id, page) => app.list_entries(consumer, id, &page).into(),
        Command::ListCharges(page) => app.list_charges(consumer, &page).into(),
        Command::GetCharge(id) => app.get_charge(consumer, id).into(),
        Command::GetOperation(id) => app.get_operation(consumer, id).into(),
        Command::ListEvents(page, kind) => app.list_events(consumer, kind, &page).into(),
        Command::GetEvent(id) => app.get_event(consumer, id).into(),
        Command::ListDeliveries(id) => app.list_deliveries(consumer, id).into(),
        Command::CreateWebhookEndpoint(w) => {
            app.create_webhook_endpoint(consumer, w.key, w.mode, &w.body, w.request)
        }
        Command::ListWebhookEndpoints(page) => app.list_webhook_endpoints(consumer, &page).into(),
        Command::GetWebhookEndpoint(id) => app.get_webhook_endpoint(consumer, id).into(),
        Command::DeleteWebhookEndpoint(id) => app.delete_webhook_endpoint(consumer, id),
        Command::CreateNotificationSource(w) => {
            app.create_notification_source(consumer, w.key, w.mode, &w.body, w.request)
        }
        Command::GetNotificationSource(id) => app.get_notification_source(consumer, id).into(),
        Command::ListNotificationSources(page) => {
            app.list_notification_sources(consumer, &page).into()
        }
        Command::ListNotifications(page, status) => {
            app.list_notifications(consumer, status, &page).into()
        }
        Command::Healthz | Command::Metrics | Command::OpenApi | Command::Notify(..) => {
            unreachable!("a public route authenticated")
        }
    })
}

/// Whether the request must carry a bearer key (checked first, 401):
/// everything under `/v1`, matched or not, and every `/v1` route — but a
/// source's notifications, which its signature authenticates.
pub fn needs_auth(req: &Request, route: Option<&Route<'_>>) -> bool {
    if matches!(route, Some(Route::Notify(_))) {
        return false;
    }
    let under_v1 = req.path == "/v1" || req.path.starts_with("/v1/");
    under_v1 || route.is_some_and(Route::needs_auth)
}

/// Decodes `req`, whose path matched `route`, in the contract's order of
/// checks after auth.
pub fn decode<'a>(req: &'a Request, route: Option<Route<'a>>) -> Result<Command<'a>, Problem> {
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
    // Past this point a method is one the route allows; everything but POST
    // and DELETE reads (GET, and HEAD, which is GET without the body).
    Ok(match (method, route) {
        (_, Route::Healthz) => Command::Healthz,
        (_, Route::Metrics) => Command::Metrics,
        (_, Route::OpenApi) => Command::OpenApi,
        ("POST", Route::Accounts) => {
            let key = idempotency_key(req, false)?;
            let body = body(req)?;
            let request = AccountRequest::from_json(&body).map_err(invalid)?;
            Command::CreateAccount(Write {
                key,
                mode: mode(req),
                body,
                request,
            })
        }
        ("POST", Route::Charges) => {
            let key = idempotency_key(req, true)?.expect("required");
            let body = body(req)?;
            let request = ChargeRequest::from_json(&body).map_err(invalid)?;
            Command::CreateCharge(Write {
                key,
                mode: mode(req),
                body,
                request,
            })
        }
        ("POST", Route::Refunds(charge)) => {
            let key = idempotency_key(req, true)?.expect("required");
            let body = body(req)?;
            let request = RefundRequest::from_json(charge, &body).map_err(invalid)?;
            Command::CreateRefund(Write {
                key,
                mode: mode(req),
                body,
                request,
            })
        }
        ("POST", Route::Capture(charge)) => {
            let key = idempotency_key(req, true)?.expect("required");
            let body = body(req)?;
            let request = CaptureRequest::from_json(charge, &body).map_err(invalid)?;
            Command::CreateCapture(Write {
                key,
                mode: mode(req),
                body,
                request,
            })
        }
        ("POST", Route::Cancel(charge)) => {
            let key = idempotency_key(req, true)?.expect("required");
            let body = body(req)?;
            let request = CancelRequest::from_json(charge, &body).map_err(invalid)?;
            Command::CreateCancel(Write {
                key,
                mode: mode(req),
                body,
                request,
            })
        }
        ("POST", Route::WebhookEndpoints) => {
            let key = idempotency_key(req, false)?;
            let body = body(req)?;
            let request = WebhookEndpointRequest::from_json(&body).map_err(invalid)?;
            Command::CreateWebhookEndpoint(Write {
                key,
                mode: mode(req),
                body,
                request,
            })
        }
        ("DELETE", Route::WebhookEndpoint(id)) => Command::DeleteWebhookEndpoint(id),
        (_, Route::Account(id)) => Command::GetAccount(id),
        (_, Route::AccountEntries(id)) => Command::ListEntries(id, page(req)?),
        (_, Route::Charges) => Command::ListCharges(page(req)?),
        (_, Route::Charge(id)) => Command::GetCharge(id),
        (_, Route::Operation(id)) => Command::GetOperation(id),
        (_, Route::Events) => {
            let (page, kind) = filtered_page(req, "type")?;
            let kind = kind
                .map(|k| {
                    EventType::parse(&k).ok_or_else(|| {
                        Problem::InvalidRequest(format!("type: '{k}' is not an event type"))
                    })
                })
                .transpose()?;
            Command::ListEvents(page, kind)
        }
        (_, Route::Event(id)) => Command::GetEvent(id),
        (_, Route::EventDeliveries(id)) => Command::ListDeliveries(id),
        (_, Route::WebhookEndpoints) => Command::ListWebhookEndpoints(page(req)?),
        (_, Route::WebhookEndpoint(id)) => Command::GetWebhookEndpoint(id),
        ("POST", Route::NotificationSources) => {
            let key = idempotency_key(req, false)?;
            let body = body(req)?;
            let request = SourceRequest::from_json(&body).map_err(invalid)?;
            Command::CreateNotificationSource(Write {
                key,
                mode: mode(req),
                body,
                request,
            })
        }
        (_, Route::NotificationSources) => Command::ListNotificationSources(page(req)?),
        (_, Route::NotificationSource(id)) => Command::GetNotificationSource(id),
        (_, Route::Notifications) => {
            let (page, status) = filtered_page(req, "status")?;
            let status = status
                .map(|s| {
                    Status::parse(&s).ok_or_else(|| {
                        Problem::InvalidRequest(format!(
                            "status: '{s}' is not applied, ignored or unmatched"
                        ))
                    })
                })
                .transpose()?;
            Command::ListNotifications(page, status)
        }
        ("POST", Route::Notify(source)) => {
            let text = |name| single(req, name).and_then(|v| std::str::from_utf8(v).ok());
            Command::Notify(
                source,
                Signed {
                    id: single(req, "webhook-id"),
                    timestamp: text("webhook-timestamp"),
                    signature: text("webhook-signature"),
                    body: &req.body,
                },
            )
        }
        (_, route) => unreachable!("method {method} allowed on {}", route.template()),
    })
}

/// The value of a header sent exactly once (a repeated Standard Webhooks
/// header is as good as a missing one).
fn single<'a>(req: &'a Request, name: &'a str) -> Option<&'a [u8]> {
    let mut values = req.headers(name);
    let first = values.next()?;
    values.next().is_none().then_some(first)
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
    filtered_page(req, "").map(|(page, _)| page)
}

/// A list's page and the value of its one filter parameter `filter` (such
/// as `type`), which must not be empty when given.
fn filtered_page(req: &Request, filter: &str) -> Result<(Page, Option<String>), Problem> {
    let mut filtered = None;
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
                // Digits only: Rust's parse would also take a leading `+`.
                let digits = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
                page.limit = digits
                    .then(|| value.parse().ok())
                    .flatten()
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
            name if !filter.is_empty() && name == filter => {
                if value.is_empty() {
                    return Err(Problem::InvalidRequest(format!(
                        "{name}: must not be empty"
                    )));
                }
                filtered = Some(value);
            }
            other => {
                return Err(Problem::InvalidRequest(format!(
                    "{other}: unknown query parameter"
                )))
            }
        }
    }
    Ok((page, filtered))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                // Two hex digits, checked as such: `from_str_radix` alone
                // also takes a sign (`%+1`).
                let hex = bytes.get(i + 1..i + 3)?;
                if !hex.iter().all(u8::is_ascii_hexdigit) {
                    return None;
                }
                out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
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

    /// `decode` checks in the contract's order: route, method, declared
    /// size, key, body — each check wins over every later one.
    #[test]
    fn decode_checks_in_contract_order() {
        let charge = br#"{"amount":1,"currency":"BRL","source":"a","destination":"b"}"#;
        let req = |method: &str, path: &str, key: Option<&str>, body: &[u8], too_large| {
            let mut r = Request {
                method: method.into(),
                path: path.into(),
                body: body.to_vec(),
                body_too_large: too_large,
                ..Request::default()
            };
            if let Some(key) = key {
                r.headers.push(("idempotency-key".into(), key.into()));
            }
            r
        };
        let status = |r: &Request| match decode(r, match_route(&r.path)) {
            Ok(_) => 0,
            Err(p) => p.status(),
        };
        #[rustfmt::skip]
        let cases = [
            (req("POST", "/v1/nope", None, b"{", true), 404),
            (req("PUT", "/v1/charges", None, b"{", true), 405),
            (req("POST", "/v1/charges", None, b"{", true), 413),
            (req("POST", "/v1/charges", None, b"{", false), 400),
            (req("POST", "/v1/charges", Some("a b"), b"{", false), 400),
            (req("POST", "/v1/charges", Some("k"), b"{", false), 400),
            (req("POST", "/v1/charges", Some("k"), charge, false), 0),
            (req("POST", "/v1/accounts", None, b"{\"currency\":\"BRL\"}", false), 0),
            (req("POST", "/v1/charges/ch_1/refunds", Some("k"), b"", false), 0),
            (req("GET", "/v1/charges", None, b"", true), 413),
            (req("HEAD", "/v1/charges", None, b"", false), 0),
            (req("HEAD", "/v1/accounts/a", None, b"", false), 0),
            (req("HEAD", "/healthz", None, b"", false), 0),
            (req("HEAD", "/v1/accounts", None, b"", false), 405),
            (req("HEAD", "/v1/charges/ch_1/refunds", Some("k"), b"", false), 405),
            (req("HEAD", "/v1/charges", None, b"", true), 413),
            (req("DELETE", "/v1/webhook_endpoints", None, b"", false), 405),
            (req("DELETE", "/v1/webhook_endpoints/we_1", None, b"", false), 0),
            (req("DELETE", "/v1/events/evt_1", None, b"", false), 405),
            (req("POST", "/v1/webhook_endpoints/we_1", None, b"{}", false), 405),
            (req("POST", "/v1/events/evt_1/deliveries", None, b"{}", false), 405),
            (req("POST", "/v1/webhook_endpoints", None, b"{}", false), 400),
            (req("HEAD", "/v1/events/evt_1/deliveries", None, b"", false), 0),
        ];
        for (i, (r, want)) in cases.iter().enumerate() {
            assert_eq!(status(r), *want, "case {i}: {r:?}");
        }
        // HEAD decodes to the very command GET decodes to.
        for path in ["/v1/charges?limit=2", "/v1/accounts/a/entries", "/metrics"] {
            let (path, query) = path.split_once('?').unwrap_or((path, ""));
            let mut get = req("GET", path, None, b"", false);
            get.query = Some(query.to_string());
            let head = Request {
                method: "HEAD".into(),
                ..get.clone()
            };
            let get_command = decode(&get, match_route(&get.path));
            assert_eq!(
                decode(&head, match_route(&head.path)),
                get_command,
                "{path}"
            );
            assert!(get_command.is_ok(), "{path}");
        }
        assert!(needs_auth(&req("GET", "/v1", None, b"", false), None));
        assert!(!needs_auth(
            &req("GET", "/healthz", None, b"", false),
            Some(&Route::Healthz)
        ));
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
            "limit=+5",
            "limit=%2B5",
            "limit=",
            "colour=red",
            "starting_after=",
            // Found by the decode fuzz target: a sign passed as a hex digit.
            "starting_after=en_%+b",
            "starting_after=%-1",
            "starting_after=%4",
            "starting_after=%zz",
        ] {
            req.query = Some(bad.into());
            assert!(page(&req).is_err(), "{bad}");
        }
    }
}
