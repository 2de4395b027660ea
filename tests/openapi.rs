//! The OpenAPI document (`openapi.json`) against the router and a live
//! server: it is OpenAPI 3.1, it names exactly the routes and methods the
//! router answers, every `$ref` resolves, `GET /openapi.json` serves the
//! repository file byte for byte, and real answers are documented.
//! (CI's `ci/schemathesis` checks the rest against a live `idem serve`.)

mod support;

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex};

use idem::http::router::{match_route, ROUTES};
use serde_json::{json, Value};
use support::{charge_body, send, Resp};

const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

fn document_bytes() -> Vec<u8> {
    std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json")).expect("read openapi.json")
}

fn document() -> Value {
    serde_json::from_slice(&document_bytes()).expect("openapi.json is JSON")
}

/// `(template, METHOD)` of every operation in the document.
fn documented_operations(doc: &Value) -> BTreeSet<(String, String)> {
    let paths = doc["paths"].as_object().expect("paths");
    let mut ops = BTreeSet::new();
    for (template, item) in paths {
        for method in item.as_object().expect("path item").keys() {
            if METHODS.contains(&method.as_str()) {
                ops.insert((template.clone(), method.to_uppercase()));
            }
        }
    }
    ops
}

/// `(template, METHOD)` of every route the router answers (`Route::allow`),
/// HEAD aside: RFC 9110 §9.3.2 makes HEAD implied wherever GET is, and the
/// document says so once (`info.description`) rather than repeating every
/// GET as a `head` operation whose documented bodies never arrive — which
/// schemathesis would then check HEAD answers against.
fn router_operations() -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for template in ROUTES {
        let path = template.replace("{id}", "x");
        let route = match_route(&path).expect("a template matches");
        for method in route.allow().split(", ").filter(|m| *m != "HEAD") {
            ops.insert((template.to_string(), method.to_string()));
        }
    }
    ops
}

/// HEAD is routed exactly where GET is, and the document says so instead of
/// listing `head` operations.
#[test]
fn head_is_implied_by_get_and_said_once() {
    for template in ROUTES {
        let path = template.replace("{id}", "x");
        let allow: Vec<&str> = match_route(&path).unwrap().allow().split(", ").collect();
        assert_eq!(
            allow.contains(&"HEAD"),
            allow.contains(&"GET"),
            "{template}: {allow:?}"
        );
    }
    let doc = document();
    for (template, method) in documented_operations(&doc) {
        assert_ne!(method, "HEAD", "{template}: HEAD is implied by GET");
    }
    let description = doc["info"]["description"].as_str().unwrap();
    assert!(
        description.contains("`HEAD` is answered wherever `GET` is"),
        "{description}"
    );
}

/// Follows a local `$ref` (`#/components/...`).
fn resolve<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let pointer = r.strip_prefix('#').expect("local $ref");
            resolve(doc, doc.pointer(pointer).unwrap_or_else(|| panic!("{r}")))
        }
        None => v,
    }
}

fn every_ref<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref") {
                out.push(r);
            }
            map.values().for_each(|v| every_ref(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| every_ref(v, out)),
        _ => {}
    }
}

#[test]
fn the_document_is_openapi_3_1_and_every_ref_resolves() {
    let doc = document();
    let version = doc["openapi"].as_str().expect("openapi field");
    assert!(version.starts_with("3.1."), "openapi: {version}");
    assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    let mut refs = Vec::new();
    every_ref(&doc, &mut refs);
    assert!(!refs.is_empty());
    for r in refs {
        let pointer = r
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("non-local $ref {r}"));
        assert!(doc.pointer(pointer).is_some(), "unresolved $ref {r}");
    }
}

#[test]
fn the_document_names_exactly_the_routes_and_methods_of_the_router() {
    let doc = document();
    let documented = documented_operations(&doc);
    let routed = router_operations();
    let undocumented: Vec<_> = routed.difference(&documented).collect();
    let unrouted: Vec<_> = documented.difference(&routed).collect();
    assert!(
        undocumented.is_empty(),
        "routes missing from openapi.json: {undocumented:?}"
    );
    assert!(
        unrouted.is_empty(),
        "openapi.json documents routes the router lacks: {unrouted:?}"
    );
}

#[test]
fn exactly_the_v1_operations_require_the_bearer_key() {
    let doc = document();
    assert_eq!(doc["security"], json!([{"bearer": []}]));
    let scheme = &doc["components"]["securitySchemes"]["bearer"];
    assert_eq!(
        (&scheme["type"], &scheme["scheme"]),
        (&json!("http"), &json!("bearer"))
    );
    for (template, method) in documented_operations(&doc) {
        let op = &doc["paths"][&template][method.to_lowercase()];
        let open = op.get("security") == Some(&json!([]));
        // A source's notification is authenticated by its signature (401
        // `signature-invalid`), not by the bearer key.
        let signed = (template.as_str(), method.as_str()) == ("/v1/notifications/{id}", "POST");
        assert_eq!(
            open,
            !template.starts_with("/v1/") || signed,
            "{method} {template}: security {:?}",
            op.get("security")
        );
        let statuses = op["responses"].as_object().expect("responses");
        assert_eq!(
            statuses.contains_key("401"),
            !open || signed,
            "{method} {template}: 401 documented iff the key is required"
        );
        for status in ["413", "500", "503"] {
            assert!(
                statuses.contains_key(status),
                "{method} {template}: {status}"
            );
        }
    }
}

/// The documented response of an operation for `resp`'s status: content
/// type, required headers and (for a problem) its slug must match.
fn assert_documented(doc: &Value, template: &str, method: &str, resp: &Resp) {
    let op = &doc["paths"][template][method.to_lowercase()];
    let what = format!("{method} {template} {}", resp.status);
    let documented = op["responses"]
        .get(resp.status.to_string())
        .map(|r| resolve(doc, r))
        .unwrap_or_else(|| panic!("{what}: status not documented"));
    let content_type = resp.header("content-type").expect("content-type");
    let media = documented["content"]
        .get(content_type)
        .unwrap_or_else(|| panic!("{what}: content type {content_type} not documented"));
    if let Some(headers) = documented["headers"].as_object() {
        for (name, header) in headers {
            if resolve(doc, header)["required"] == json!(true) {
                assert!(resp.header(name).is_some(), "{what}: no {name} header");
            }
        }
    }
    for name in ["idempotent-replayed", "retry-after", "location"] {
        if resp.header(name).is_some() {
            let headers = documented["headers"].as_object();
            assert!(
                headers.is_some_and(|h| h.keys().any(|k| k.eq_ignore_ascii_case(name))),
                "{what}: header {name} sent but not documented"
            );
        }
    }
    if content_type == "application/problem+json" {
        let slug = format!("urn:idem:problem:{}", resp.slug());
        let schema = resolve(doc, &media["schema"]);
        let allowed = &schema["allOf"][1]["properties"]["type"]["enum"];
        let allowed = allowed.as_array().expect("slug enum");
        assert!(
            allowed.contains(&json!(slug)),
            "{what}: {slug} not in {allowed:?}"
        );
    }
}

#[test]
fn the_server_serves_the_file_byte_for_byte_without_auth() {
    let (server, _client) = support::server(|_| {});
    let resp = send(server.addr(), "GET", "/openapi.json", &[], b"").unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert!(resp.body == document_bytes(), "served document differs");
    assert_documented(&document(), "/openapi.json", "GET", &resp);

    let resp = send(server.addr(), "POST", "/openapi.json", &[], b"").unwrap();
    assert_eq!(
        (resp.status, resp.header("allow")),
        (405, Some("GET, HEAD"))
    );
}

#[test]
fn real_answers_are_documented() {
    let doc = document();
    // While `held` is true, a charge waits just before its ledger phase, its
    // key in progress: the 409 and the 202 below need no race with a timer.
    let held = Arc::new((Mutex::new(false), Condvar::new()));
    let gate = Arc::clone(&held);
    let (server, client) = support::server(|c| {
        c.hooks.before_ledger_phase = Some(Arc::new(move |_op: &str| {
            let (lock, released) = &*gate;
            let mut hold = lock.lock().unwrap();
            while *hold {
                hold = released.wait(hold).unwrap();
            }
        }))
    });
    let hold = |on: bool| {
        *held.0.lock().unwrap() = on;
        held.1.notify_all();
    };
    let check = |template: &str, method: &str, resp: &Resp, status: u16| {
        assert_eq!(
            resp.status,
            status,
            "{method} {template}: {}",
            String::from_utf8_lossy(&resp.body)
        );
        assert_documented(&doc, template, method, resp);
    };

    let created = client.charge("k1", &charge_body(100));
    check("/v1/charges", "POST", &created, 201);
    let replay = client.charge("k1", &charge_body(100));
    check("/v1/charges", "POST", &replay, 201);
    assert!(replay.replayed());
    check(
        "/v1/charges",
        "POST",
        &client.charge("k1", &charge_body(7)),
        422,
    );
    let no_key = client.post("/v1/charges", None, &charge_body(100));
    check("/v1/charges", "POST", &no_key, 400);

    // A duplicate while the first attempt is in progress: 409 now.
    hold(true);
    let first = {
        let client = client.clone();
        std::thread::spawn(move || client.charge("k2", &charge_body(5)))
    };
    support::wait_for_key(server.db_path(), "k2");
    check(
        "/v1/charges",
        "POST",
        &client.charge("k2", &charge_body(5)),
        409,
    );
    let prefer = [("Idempotency-Key", "k2"), ("Prefer", "respond-async")];
    let body = charge_body(5).to_string();
    let accepted = client.request("POST", "/v1/charges", &prefer, &body);
    check("/v1/charges", "POST", &accepted, 202);
    hold(false);
    check("/v1/charges", "POST", &first.join().unwrap(), 201);
    let operation = accepted.header("location").unwrap().to_string();
    check("/v1/operations/{id}", "GET", &client.get(&operation), 200);

    let charge = created.json()["id"].as_str().unwrap().to_string();
    let refunds = format!("/v1/charges/{charge}/refunds");
    let refund = client.post(&refunds, Some("r1"), &json!({"amount": 40}));
    check("/v1/charges/{id}/refunds", "POST", &refund, 201);
    let too_much = client.post(&refunds, Some("r2"), &json!({"amount": 61}));
    check("/v1/charges/{id}/refunds", "POST", &too_much, 422);
    let rest = client.post(&refunds, Some("r3"), &json!({}));
    check("/v1/charges/{id}/refunds", "POST", &rest, 201);

    let poor = json!({"amount": 1, "currency": "BRL", "source": "shop", "destination": "card"});
    let shop_balance = client.balance("shop");
    let drain =
        json!({"amount": shop_balance, "currency": "BRL", "source": "shop", "destination": "card"});
    check("/v1/charges", "POST", &client.charge("k3", &drain), 201);
    check("/v1/charges", "POST", &client.charge("k4", &poor), 402);

    let existing = client.post(
        "/v1/accounts",
        None,
        &json!({"id": "shop", "currency": "BRL"}),
    );
    check("/v1/accounts", "POST", &existing, 200);
    check(
        "/v1/accounts/{id}",
        "GET",
        &client.get("/v1/accounts/nope"),
        404,
    );
    let page = client.get("/v1/accounts/shop/entries?limit=2");
    check("/v1/accounts/{id}/entries", "GET", &page, 200);
    let bad_limit = client.get("/v1/charges?limit=101");
    check("/v1/charges", "GET", &bad_limit, 400);
    let anonymous = send(server.addr(), "GET", "/v1/charges", &[], b"").unwrap();
    check("/v1/charges", "GET", &anonymous, 401);
    let healthz = send(server.addr(), "GET", "/healthz", &[], b"").unwrap();
    check("/healthz", "GET", &healthz, 200);
}
