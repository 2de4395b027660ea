//! A retrying client for [idem](../idem/index.html), the payment ledger where
//! a request sent twice moves the money once.
//!
//! The server keeps that promise only if the client keeps its half: **one
//! `Idempotency-Key` per intent, chosen by the client where the intent is
//! formed, and reused on every retry of that intent**. This crate does that
//! for you, and retries the way a payment client should:
//!
//! - every write runs under one key — a UUID v4 made per call, or the key of
//!   an [`Intent`] you keep (and may persist across a restart);
//! - connection failures, resets and timeouts are retried with the same
//!   key: the lost attempt may have committed, and the retry then gets its
//!   stored answer ([`Reply::replayed`]) instead of a second charge;
//! - 409 (`idempotency-key-in-use`, `reference-in-use`), 429 and 5xx are
//!   retried, honouring `Retry-After`; the waits grow exponentially with
//!   full jitter, within an attempt cap and a total deadline
//!   ([`RetryPolicy`]), and then the call ends in [`Error::GaveUp`];
//! - a business answer (402, 404, 409 `invalid-charge-state`, 422…) is final
//!   ([`Error::Problem`]), and 422 `idempotency-key-reused` is reported as the
//!   caller's bug it is ([`Error::KeyReused`]), never retried.
//!
//! It is blocking (on [ureq](https://docs.rs/ureq)): a test of your retry
//! logic is a plain `#[test]`, with no async runtime to start. A [`Client`]
//! is cheap to clone and safe to share between threads.
//!
//! ```
//! use idem_client::{Client, NewAccount, NewCharge};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = idem::Server::start_temporary(|_| {})?;
//! let client = Client::new(server.url(), server.initial_key().unwrap())?;
//! client.create_account(&NewAccount::new("BRL").id("card").allow_negative(true))?;
//! client.create_account(&NewAccount::new("BRL").id("shop"))?;
//!
//! // One intent: a key is made here and reused by every retry of it.
//! let intent = client.intent();
//! let charge = NewCharge::new(4990, "BRL", "card", "shop");
//! let first = intent.create_charge(&charge)?;
//! // The same intent again (what a retry after a lost answer does):
//! // the stored answer, no second charge.
//! let again = intent.create_charge(&charge)?;
//! assert!(again.replayed && !first.replayed);
//! assert_eq!(first.value.id, again.value.id);
//! assert_eq!(client.get_account("shop")?.value.balance, 4990);
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod error;
mod model;
mod policy;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use error::{Error, Problem, Transport, TransportKind, slug};
pub use model::{
    Account, Capture, Charge, ChargeStatus, Entry, List, Metadata, NewAccount, NewCharge,
    NewRefund, Page, Refund,
};
pub use policy::RetryPolicy;

/// The request header that carries a sandbox server's fault directives
/// (`idem serve --sandbox`); see [`Intent::simulate`].
pub const SIMULATE_HEADER: &str = "Idem-Simulate";

/// The most of an answer's body the client reads (a list of 100 charges is
/// about 50 KiB).
pub const RESPONSE_BYTES_MAX: u64 = 4 << 20;

/// A successful answer: the decoded object, and how it came.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = idem::Server::start_temporary(|_| {})?;
/// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
/// let reply = client.create_account(&idem_client::NewAccount::new("BRL").id("a"))?;
/// assert_eq!((reply.status, reply.replayed, reply.attempts), (201, false, 1));
/// let again = client.create_account(&idem_client::NewAccount::new("BRL").id("a"))?;
/// assert_eq!((again.status, again.replayed), (200, true));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply<T> {
    /// The object.
    pub value: T,
    /// `Idempotent-Replayed: true`: this is the stored answer of an earlier
    /// attempt with the same key (or an existing resource with the same
    /// natural id or reference), not a new effect.
    pub replayed: bool,
    /// The HTTP status (201 created, 200 for a replayed natural id, …).
    pub status: u16,
    /// How many attempts the call took.
    pub attempts: u32,
}

/// What [`ClientBuilder::on_retry`] is told before each retry.
///
/// ```
/// let client = idem_client::Client::builder("http://127.0.0.1:1", "sk_x")
///     .on_retry(|r: &idem_client::Retry<'_>| eprintln!("attempt {} failed ({}); next in {:?}", r.attempt, r.cause, r.delay))
///     .build()
///     .unwrap();
/// # drop(client);
/// ```
#[derive(Debug)]
pub struct Retry<'a> {
    /// The attempt that failed (1 for the first).
    pub attempt: u32,
    /// The idempotency key every attempt of this call carries, if any.
    pub key: Option<&'a str>,
    /// Why it failed.
    pub cause: &'a Error,
    /// How long the client waits before the next attempt.
    pub delay: Duration,
}

type RetryHook = Arc<dyn Fn(&Retry<'_>) + Send + Sync>;

/// Builds a [`Client`] with a [`RetryPolicy`] and options.
///
/// ```
/// use std::time::Duration;
/// use idem_client::{Client, RetryPolicy};
///
/// let client = Client::builder("http://127.0.0.1:8080", "sk_…")
///     .policy(RetryPolicy { deadline: Duration::from_secs(10), ..RetryPolicy::default() })
///     .build()
///     .unwrap();
/// assert_eq!(client.policy().deadline, Duration::from_secs(10));
/// ```
pub struct ClientBuilder {
    base_url: String,
    secret_key: String,
    policy: RetryPolicy,
    on_retry: Option<RetryHook>,
}

impl ClientBuilder {
    /// Retries by `policy` instead of [`RetryPolicy::default`].
    ///
    /// ```
    /// let b = idem_client::Client::builder("http://h", "sk").policy(Default::default());
    /// # drop(b);
    /// ```
    pub fn policy(mut self, policy: RetryPolicy) -> ClientBuilder {
        self.policy = policy;
        self
    }

    /// Calls `hook` before every retry (to log it, or count it in a test).
    /// It runs on the calling thread, before the wait.
    ///
    /// ```
    /// let b = idem_client::Client::builder("http://h", "sk").on_retry(|r| println!("{}", r.cause));
    /// # drop(b);
    /// ```
    pub fn on_retry(mut self, hook: impl Fn(&Retry<'_>) + Send + Sync + 'static) -> ClientBuilder {
        self.on_retry = Some(Arc::new(hook));
        self
    }

    /// The client, or [`Error::Config`] if the URL is not `http://` or
    /// `https://` or the policy is out of bounds.
    ///
    /// ```
    /// assert!(idem_client::Client::builder("ftp://h", "sk").build().is_err());
    /// ```
    pub fn build(self) -> Result<Client, Error> {
        let base = self.base_url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Error::Config(format!(
                "the base URL must start with http:// or https://, not {base:?}"
            )));
        }
        self.policy.validate().map_err(Error::Config)?;
        if self.secret_key.is_empty() {
            return Err(Error::Config("the secret key is empty".into()));
        }
        let agent = ureq::Agent::config_builder()
            // Statuses are answers to classify, not errors.
            .http_status_as_error(false)
            // idem never redirects; a redirect would be a misconfigured
            // proxy, and following it could repeat a POST elsewhere.
            .max_redirects(0)
            .timeout_connect(Some(self.policy.connect_timeout))
            .user_agent(concat!("idem-client/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(Client {
            inner: Arc::new(Inner {
                base,
                authorization: format!("Bearer {}", self.secret_key),
                policy: self.policy,
                agent,
                on_retry: self.on_retry,
            }),
        })
    }
}

/// A connection to one idem server as one consumer: typed calls that
/// retry by a [`RetryPolicy`], each write under one idempotency key.
///
/// Clones share the connection pool. Every write made through the client's
/// own methods ([`Client::create_charge`], …) is one intent with a fresh
/// key; use [`Client::intent`] to hold on to the key yourself.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = idem::Server::start_temporary(|_| {})?;
/// let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
/// let threads: Vec<_> = (0..4).map(|i| {
///     let client = client.clone();
///     std::thread::spawn(move || client.create_account(&idem_client::NewAccount::new("BRL").id(&format!("a{i}"))))
/// }).collect();
/// for t in threads { assert_eq!(t.join().unwrap()?.status, 201); }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    base: String,
    authorization: String,
    policy: RetryPolicy,
    agent: ureq::Agent,
    on_retry: Option<RetryHook>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret key.
        f.debug_struct("Client")
            .field("base_url", &self.inner.base)
            .field("policy", &self.inner.policy)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the server at `base_url` (`http://HOST:PORT`) with the
    /// consumer's `secret_key` (`sk_…`), retrying by
    /// [`RetryPolicy::default`].
    ///
    /// ```
    /// let client = idem_client::Client::new("http://127.0.0.1:8080", "sk_…").unwrap();
    /// assert!(!format!("{client:?}").contains("sk_"));
    /// ```
    pub fn new(base_url: &str, secret_key: &str) -> Result<Client, Error> {
        Client::builder(base_url, secret_key).build()
    }

    /// A builder, to set the [`RetryPolicy`] or a retry hook.
    ///
    /// ```
    /// let client = idem_client::Client::builder("http://127.0.0.1:8080", "sk_…").build().unwrap();
    /// # drop(client);
    /// ```
    pub fn builder(base_url: &str, secret_key: &str) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.to_string(),
            secret_key: secret_key.to_string(),
            policy: RetryPolicy::default(),
            on_retry: None,
        }
    }

    /// The policy this client retries by.
    ///
    /// ```
    /// let client = idem_client::Client::new("http://h:1", "sk").unwrap();
    /// assert_eq!(client.policy(), &idem_client::RetryPolicy::default());
    /// ```
    pub fn policy(&self) -> &RetryPolicy {
        &self.inner.policy
    }

    /// A new intent with a fresh key (a UUID v4). Call one write on it; call
    /// it again (the same write, the same body) to retry it beyond the
    /// policy's deadline — the key makes that safe.
    ///
    /// ```
    /// let client = idem_client::Client::new("http://h:1", "sk").unwrap();
    /// let (a, b) = (client.intent(), client.intent());
    /// assert_ne!(a.key(), b.key());
    /// assert_eq!(a.key().len(), 36);
    /// ```
    pub fn intent(&self) -> Intent<'_> {
        Intent {
            client: self,
            key: uuid::Uuid::new_v4().to_string(),
            simulate: None,
        }
    }

    /// An intent with a key you kept (stored with the order, say, before the
    /// first attempt, so that a process restarted mid-payment retries the
    /// same intent rather than starting a second). [`Error::InvalidKey`]
    /// unless it is 1–255 printable ASCII characters.
    ///
    /// ```
    /// let client = idem_client::Client::new("http://h:1", "sk").unwrap();
    /// let key = client.intent().key().to_string(); // persisted with the order
    /// // … the process restarts …
    /// assert_eq!(client.intent_with_key(&key).unwrap().key(), key);
    /// assert!(client.intent_with_key("with space").is_err());
    /// ```
    pub fn intent_with_key(&self, key: &str) -> Result<Intent<'_>, Error> {
        if key.is_empty() || key.len() > 255 {
            return Err(Error::InvalidKey(format!(
                "{} characters; 1 to 255 are allowed",
                key.len()
            )));
        }
        if let Some(c) = key.chars().find(|c| !('\x21'..='\x7e').contains(c)) {
            return Err(Error::InvalidKey(format!(
                "{c:?} is not printable ASCII (0x21-0x7E)"
            )));
        }
        Ok(Intent {
            client: self,
            key: key.to_string(),
            simulate: None,
        })
    }

    /// `POST /v1/accounts`, as a new intent. With an `id`, a retry is safe
    /// by the id alone; the key covers accounts without one.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// let account = client.create_account(&idem_client::NewAccount::new("BRL"))?.value;
    /// assert!(account.id.starts_with("acct_"));
    /// # Ok(()) }
    /// ```
    pub fn create_account(&self, account: &NewAccount) -> Result<Reply<Account>, Error> {
        self.intent().create_account(account)
    }

    /// `POST /v1/charges`, as a new intent: one key for this call, reused on
    /// each of its retries.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("card").allow_negative(true))?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("shop"))?;
    /// let charge = idem_client::NewCharge::new(4990, "BRL", "card", "shop");
    /// let reply = client.create_charge(&charge)?;
    /// assert_eq!((reply.status, reply.value.amount), (201, 4990));
    /// # Ok(()) }
    /// ```
    pub fn create_charge(&self, charge: &NewCharge) -> Result<Reply<Charge>, Error> {
        self.intent().create_charge(charge)
    }

    /// `POST /v1/charges/{id}/capture`, as a new intent.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("card").allow_negative(true))?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("pump"))?;
    /// use idem_client::{Capture, ChargeStatus, NewCharge};
    /// let hold = client.create_charge(&NewCharge::new(10000, "BRL", "card", "pump").capture(false))?.value;
    /// let captured = client.capture(&hold.id, &Capture::amount(7250))?.value;
    /// assert_eq!((captured.status, captured.amount_captured), (ChargeStatus::Succeeded, 7250));
    /// # Ok(()) }
    /// ```
    pub fn capture(&self, charge_id: &str, capture: &Capture) -> Result<Reply<Charge>, Error> {
        self.intent().capture(charge_id, capture)
    }

    /// `POST /v1/charges/{id}/cancel`, as a new intent.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("card").allow_negative(true))?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("hotel"))?;
    /// use idem_client::{ChargeStatus, NewCharge};
    /// let hold = client.create_charge(&NewCharge::new(30000, "BRL", "card", "hotel").capture(false))?.value;
    /// assert_eq!(client.cancel(&hold.id)?.value.status, ChargeStatus::Canceled);
    /// # Ok(()) }
    /// ```
    pub fn cancel(&self, charge_id: &str) -> Result<Reply<Charge>, Error> {
        self.intent().cancel(charge_id)
    }

    /// `POST /v1/charges/{id}/refunds`, as a new intent.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("card").allow_negative(true))?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("shop"))?;
    /// use idem_client::{NewCharge, NewRefund};
    /// let charge = client.create_charge(&NewCharge::new(4990, "BRL", "card", "shop"))?.value;
    /// assert_eq!(client.refund(&charge.id, &NewRefund::amount(990))?.value.amount, 990);
    /// assert_eq!(client.get_charge(&charge.id)?.value.amount_refunded, 990);
    /// # Ok(()) }
    /// ```
    pub fn refund(&self, charge_id: &str, refund: &NewRefund) -> Result<Reply<Refund>, Error> {
        self.intent().refund(charge_id, refund)
    }

    /// `GET /v1/accounts/{id}` (retried like any call: a read is safe).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// let e = client.get_account("nobody").unwrap_err();
    /// assert!(e.problem().unwrap().is(idem_client::slug::NOT_FOUND));
    /// # Ok(()) }
    /// ```
    pub fn get_account(&self, id: &str) -> Result<Reply<Account>, Error> {
        self.get(&format!("/v1/accounts/{}", segment(id)))
    }

    /// `GET /v1/accounts/{id}/entries`: its ledger entries, newest first.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("shop"))?;
    /// let entries = client.list_entries("shop", &idem_client::Page::default())?.value;
    /// assert!(entries.data.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn list_entries(&self, account_id: &str, page: &Page) -> Result<Reply<List<Entry>>, Error> {
        self.get(&format!(
            "/v1/accounts/{}/entries{}",
            segment(account_id),
            query(page)
        ))
    }

    /// `GET /v1/charges/{id}`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// assert_eq!(client.get_charge("ch_nope").unwrap_err().status(), Some(404));
    /// # Ok(()) }
    /// ```
    pub fn get_charge(&self, id: &str) -> Result<Reply<Charge>, Error> {
        self.get(&format!("/v1/charges/{}", segment(id)))
    }

    /// `GET /v1/charges`: one page of this consumer's charges, newest first.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// let page = idem_client::Page { limit: Some(100), ..Default::default() };
    /// assert!(client.list_charges(&page)?.value.data.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn list_charges(&self, page: &Page) -> Result<Reply<List<Charge>>, Error> {
        self.get(&format!("/v1/charges{}", query(page)))
    }

    /// Every charge of this consumer, following `has_more` page by page.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// assert_eq!(client.all_charges()?.len(), 0);
    /// # Ok(()) }
    /// ```
    pub fn all_charges(&self) -> Result<Vec<Charge>, Error> {
        let mut all: Vec<Charge> = Vec::new();
        loop {
            let page = Page {
                limit: Some(100),
                starting_after: all.last().map(|c| c.id.clone()),
            };
            let list = self.list_charges(&page)?.value;
            all.extend(list.data);
            if !list.has_more {
                return Ok(all);
            }
        }
    }

    fn get<T: DeserializeOwned>(&self, path: &str) -> Result<Reply<T>, Error> {
        self.execute(&Call {
            post: false,
            path,
            body: None,
            key: None,
            simulate: None,
        })
    }

    /// Runs `call`'s attempts until one is final or the policy gives up.
    fn execute<T: DeserializeOwned>(&self, call: &Call<'_>) -> Result<Reply<T>, Error> {
        let policy = &self.inner.policy;
        let started = Instant::now();
        let deadline = started + policy.deadline;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            let timeout = policy.per_request_timeout.min(left);
            let (cause, retry_after) = match self.attempt(call, attempt, timeout) {
                Ok((status, replayed, body)) => {
                    return decode(status, &body).map(|value| Reply {
                        value,
                        replayed,
                        status,
                        attempts: attempt,
                    });
                }
                Err(Failed::Final(e)) => return Err(e),
                Err(Failed::Retryable(e, retry_after)) => (e, retry_after),
            };
            let delay = retry_after.unwrap_or_default().max(policy.backoff(attempt));
            let give_up = attempt >= policy.attempts_max
                || Instant::now() + delay >= deadline
                // A wait the server asked for that outlasts the deadline:
                // end now rather than sleep until then.
                || retry_after.is_some_and(|r| r >= left);
            if give_up {
                return Err(Error::GaveUp {
                    attempts: attempt,
                    elapsed: started.elapsed(),
                    last: Box::new(cause),
                });
            }
            if let Some(hook) = &self.inner.on_retry {
                hook(&Retry {
                    attempt,
                    key: call.key,
                    cause: &cause,
                    delay,
                });
            }
            std::thread::sleep(delay);
        }
    }

    /// One attempt: the status, the replay flag and the body of a 2xx, or
    /// why it failed and whether a retry may help.
    fn attempt(
        &self,
        call: &Call<'_>,
        attempt: u32,
        timeout: Duration,
    ) -> Result<(u16, bool, Vec<u8>), Failed> {
        let inner = &self.inner;
        let url = format!("{}{}", inner.base, call.path);
        let connect = inner.policy.connect_timeout.min(timeout);
        let sent = if call.post {
            let mut request = inner
                .agent
                .post(&url)
                .config()
                .timeout_global(Some(timeout))
                .timeout_connect(Some(connect))
                .build()
                .header("authorization", &inner.authorization)
                .header("content-type", "application/json");
            if let Some(key) = call.key {
                request = request.header("idempotency-key", key);
            }
            if let Some((directives, attempts)) = call.simulate
                && attempt <= attempts
            {
                request = request.header(SIMULATE_HEADER, directives);
            }
            request.send(call.body.unwrap_or(b"{}"))
        } else {
            inner
                .agent
                .get(&url)
                .config()
                .timeout_global(Some(timeout))
                .timeout_connect(Some(connect))
                .build()
                .header("authorization", &inner.authorization)
                .call()
        };
        let mut response = sent.map_err(transport)?;
        let status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let replayed = header("idempotent-replayed").is_some_and(|v| v.trim() == "true");
        let retry_after = header("retry-after").and_then(|v| v.trim().parse::<u64>().ok());
        let body = response
            .body_mut()
            .with_config()
            .limit(RESPONSE_BYTES_MAX)
            .read_to_vec()
            .map_err(transport)?;
        if (200..300).contains(&status) {
            return Ok((status, replayed, body));
        }
        let mut problem = problem(status, &body);
        problem.retry_after = retry_after.map(Duration::from_secs);
        let retry_after = problem.retry_after;
        if problem.is(slug::IDEMPOTENCY_KEY_REUSED) {
            return Err(Failed::Final(Error::KeyReused(problem)));
        }
        let retryable = match status {
            409 => problem.is(slug::IDEMPOTENCY_KEY_IN_USE) || problem.is(slug::REFERENCE_IN_USE),
            429 | 500 | 502 | 503 | 504 => true,
            _ => false,
        };
        if retryable {
            Err(Failed::Retryable(Error::Problem(problem), retry_after))
        } else {
            Err(Failed::Final(Error::Problem(problem)))
        }
    }
}

/// One write under one idempotency key: the key is made when the intent is
/// ([`Client::intent`]) or given back ([`Client::intent_with_key`]), and
/// every attempt of every call on it carries it.
///
/// One intent is one operation: call one of its methods, with one body. If
/// that call ends in [`Error::GaveUp`] (the deadline passed while the server
/// was unreachable, say), call it again, later, with the same body — the
/// server answers what the first attempt did, or does it now, never twice.
/// Calling it with another body is the caller's bug that
/// [`Error::KeyReused`] reports.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = idem::Server::start_temporary(|_| {})?;
/// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
/// # client.create_account(&idem_client::NewAccount::new("BRL").id("card").allow_negative(true))?;
/// # client.create_account(&idem_client::NewAccount::new("BRL").id("shop"))?;
/// use idem_client::{Error, NewCharge};
/// let intent = client.intent();
/// intent.create_charge(&NewCharge::new(4990, "BRL", "card", "shop"))?;
/// // The same key with another amount: a bug, reported, nothing executed.
/// let e = intent.create_charge(&NewCharge::new(5990, "BRL", "card", "shop")).unwrap_err();
/// assert!(matches!(e, Error::KeyReused(_)));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Intent<'c> {
    client: &'c Client,
    key: String,
    simulate: Option<(String, u32)>,
}

impl Intent<'_> {
    /// The idempotency key (store it to resume the intent after a restart).
    ///
    /// ```
    /// let client = idem_client::Client::new("http://h:1", "sk").unwrap();
    /// assert!(uuid::Uuid::parse_str(client.intent().key()).is_ok());
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Sends `Idem-Simulate: directives` on the first attempt only, so a
    /// sandbox server (`idem serve --sandbox`) injects that fault into it
    /// and the retries run clean — e.g. `response=delay:2s` (the answer is
    /// lost to the client's timeout after the charge committed),
    /// `response=drop`, `crash=after-commit`, `acquirer=unavailable`. A
    /// server without `--sandbox` refuses the header with 400
    /// `simulation-disabled`.
    ///
    /// ```
    /// let client = idem_client::Client::new("http://h:1", "sk").unwrap();
    /// let intent = client.intent().simulate("response=drop");
    /// # drop(intent);
    /// ```
    pub fn simulate(self, directives: &str) -> Self {
        self.simulate_attempts(directives, 1)
    }

    /// Sends `Idem-Simulate: directives` on the first `attempts` attempts
    /// of each call (`u32::MAX`: on every attempt).
    ///
    /// ```
    /// let client = idem_client::Client::new("http://h:1", "sk").unwrap();
    /// let intent = client.intent().simulate_attempts("acquirer=unavailable", u32::MAX);
    /// # drop(intent);
    /// ```
    pub fn simulate_attempts(mut self, directives: &str, attempts: u32) -> Self {
        self.simulate = Some((directives.to_string(), attempts));
        self
    }

    /// `POST /v1/charges` under this intent's key.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("card"))?;
    /// # client.create_account(&idem_client::NewAccount::new("BRL").id("shop"))?;
    /// let e = client.intent().create_charge(&idem_client::NewCharge::new(1, "BRL", "card", "shop")).unwrap_err();
    /// assert!(e.problem().unwrap().is(idem_client::slug::INSUFFICIENT_FUNDS)); // final, not retried
    /// # Ok(()) }
    /// ```
    pub fn create_charge(&self, charge: &NewCharge) -> Result<Reply<Charge>, Error> {
        self.post("/v1/charges".into(), charge)
    }

    /// `POST /v1/accounts` under this intent's key.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// let intent = client.intent();
    /// let a = intent.create_account(&idem_client::NewAccount::new("BRL"))?;
    /// let b = intent.create_account(&idem_client::NewAccount::new("BRL"))?;
    /// assert_eq!((a.value.id, b.replayed), (b.value.id, true));
    /// # Ok(()) }
    /// ```
    pub fn create_account(&self, account: &NewAccount) -> Result<Reply<Account>, Error> {
        self.post("/v1/accounts".into(), account)
    }

    /// `POST /v1/charges/{id}/capture` under this intent's key.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// let e = client.intent().capture("ch_nope", &idem_client::Capture::default()).unwrap_err();
    /// assert_eq!(e.status(), Some(404));
    /// # Ok(()) }
    /// ```
    pub fn capture(&self, charge_id: &str, capture: &Capture) -> Result<Reply<Charge>, Error> {
        self.post(
            format!("/v1/charges/{}/capture", segment(charge_id)),
            capture,
        )
    }

    /// `POST /v1/charges/{id}/cancel` under this intent's key.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// assert_eq!(client.intent().cancel("ch_nope").unwrap_err().status(), Some(404));
    /// # Ok(()) }
    /// ```
    pub fn cancel(&self, charge_id: &str) -> Result<Reply<Charge>, Error> {
        self.post(
            format!("/v1/charges/{}/cancel", segment(charge_id)),
            &serde_json::Map::new(),
        )
    }

    /// `POST /v1/charges/{id}/refunds` under this intent's key.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = idem::Server::start_temporary(|_| {})?;
    /// # let client = idem_client::Client::new(server.url(), server.initial_key().unwrap())?;
    /// let e = client.intent().refund("ch_nope", &idem_client::NewRefund::default()).unwrap_err();
    /// assert_eq!(e.status(), Some(404));
    /// # Ok(()) }
    /// ```
    pub fn refund(&self, charge_id: &str, refund: &NewRefund) -> Result<Reply<Refund>, Error> {
        self.post(
            format!("/v1/charges/{}/refunds", segment(charge_id)),
            refund,
        )
    }

    fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: String,
        body: &B,
    ) -> Result<Reply<T>, Error> {
        let body = serde_json::to_vec(body).map_err(|e| Error::Decode {
            status: 0,
            message: format!("could not encode the request: {e}"),
        })?;
        self.client.execute(&Call {
            post: true,
            path: &path,
            body: Some(&body),
            key: Some(&self.key),
            simulate: self.simulate.as_ref().map(|(d, n)| (d.as_str(), *n)),
        })
    }
}

/// One call: what every attempt sends.
struct Call<'a> {
    post: bool,
    path: &'a str,
    body: Option<&'a [u8]>,
    key: Option<&'a str>,
    simulate: Option<(&'a str, u32)>,
}

/// Why an attempt failed.
enum Failed {
    /// A retry may succeed; the server's `Retry-After`, if any.
    Retryable(Error, Option<Duration>),
    /// A retry would fail the same way.
    Final(Error),
}

/// Classifies ureq's error: what may have reached the server and could
/// succeed on a retry, and what cannot.
fn transport(e: ureq::Error) -> Failed {
    let kind = match &e {
        ureq::Error::Timeout(_) => TransportKind::Timeout,
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => TransportKind::Connect,
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            TransportKind::Connect
        }
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => TransportKind::Timeout,
        ureq::Error::Io(_) | ureq::Error::BodyStalled => TransportKind::Reset,
        ureq::Error::Protocol(_) => TransportKind::Protocol,
        _ => TransportKind::Other,
    };
    let t = Transport::new(kind, e.to_string());
    if t.is_retryable() {
        Failed::Retryable(Error::Transport(t), None)
    } else {
        Failed::Final(Error::Transport(t))
    }
}

/// The problem document of a non-2xx answer, or a stand-in for a body that
/// is not one (a proxy's error page).
fn problem(status: u16, body: &[u8]) -> Problem {
    #[derive(serde::Deserialize)]
    struct Doc {
        #[serde(rename = "type")]
        kind: String,
        title: String,
        detail: Option<String>,
    }
    match serde_json::from_slice::<Doc>(body) {
        Ok(doc) => Problem {
            status,
            slug: doc
                .kind
                .strip_prefix("urn:idem:problem:")
                .unwrap_or(&doc.kind)
                .to_string(),
            title: doc.title,
            detail: doc.detail,
            retry_after: None,
        },
        Err(_) => Problem {
            status,
            slug: format!("http-{status}"),
            title: format!("HTTP {status}"),
            detail: Some(String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned()),
            retry_after: None,
        },
    }
}

fn decode<T: DeserializeOwned>(status: u16, body: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(body).map_err(|e| Error::Decode {
        status,
        message: e.to_string(),
    })
}

/// Percent-encodes one path segment (an id), so that an id with `/` or `?`
/// names a resource rather than another route.
fn segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn query(page: &Page) -> String {
    let mut parts = Vec::new();
    if let Some(limit) = page.limit {
        parts.push(format!("limit={limit}"));
    }
    if let Some(after) = &page.starting_after {
        parts.push(format!("starting_after={}", segment(after)));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_cannot_escape_their_segment() {
        assert_eq!(segment("ch_01ab-9"), "ch_01ab-9");
        assert_eq!(segment("a/b?c"), "a%2Fb%3Fc");
        assert_eq!(segment("ç"), "%C3%A7");
        let page = Page {
            limit: Some(5),
            starting_after: Some("ch_1&x".into()),
        };
        assert_eq!(query(&page), "?limit=5&starting_after=ch_1%26x");
        assert_eq!(query(&Page::default()), "");
    }

    #[test]
    fn problems_keep_the_slug_and_stand_in_for_foreign_bodies() {
        let p = problem(
            409,
            br#"{"type":"urn:idem:problem:idempotency-key-in-use","title":"In use","status":409,"detail":"later"}"#,
        );
        assert_eq!(p.slug, "idempotency-key-in-use");
        assert_eq!(p.detail.as_deref(), Some("later"));
        let p = problem(502, b"<html>Bad Gateway</html>");
        assert_eq!(p.slug, "http-502");
        assert!(p.detail.unwrap().contains("Bad Gateway"));
    }

    #[test]
    fn keys_are_checked_before_anything_is_sent() {
        let client = Client::new("http://127.0.0.1:1", "sk").unwrap();
        assert!(client.intent_with_key(&"k".repeat(255)).is_ok());
        for bad in ["", "a b", "é", &"k".repeat(256)] {
            assert!(matches!(
                client.intent_with_key(bad),
                Err(Error::InvalidKey(_))
            ));
        }
    }

    #[test]
    fn a_refused_connection_is_retried_until_the_cap() {
        // Port 1 on localhost: nothing listens, every attempt is refused.
        let retries = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&retries);
        let client = Client::builder("http://127.0.0.1:1", "sk")
            .policy(RetryPolicy {
                attempts_max: 4,
                base: Duration::from_millis(1),
                cap: Duration::from_millis(4),
                ..RetryPolicy::default()
            })
            .on_retry(move |r| {
                seen.lock()
                    .unwrap()
                    .push((r.attempt, r.key.map(str::to_string)))
            })
            .build()
            .unwrap();
        let intent = client.intent();
        let e = intent
            .create_charge(&NewCharge::new(1, "BRL", "a", "b"))
            .unwrap_err();
        let Error::GaveUp { attempts, last, .. } = e else {
            panic!("{e}")
        };
        assert_eq!(attempts, 4);
        assert!(
            matches!(*last, Error::Transport(ref t) if t.kind == TransportKind::Connect),
            "{last}"
        );
        let retries = retries.lock().unwrap();
        let key = Some(intent.key().to_string());
        assert_eq!(
            *retries,
            [(1, key.clone()), (2, key.clone()), (3, key.clone())]
        );
    }

    #[test]
    fn the_deadline_ends_the_retries() {
        let client = Client::builder("http://127.0.0.1:1", "sk")
            .policy(RetryPolicy {
                attempts_max: u32::MAX,
                base: Duration::from_millis(20),
                cap: Duration::from_millis(20),
                deadline: Duration::from_millis(300),
                ..RetryPolicy::default()
            })
            .build()
            .unwrap();
        let started = Instant::now();
        let e = client.get_charge("ch_1").unwrap_err();
        let elapsed = started.elapsed();
        assert!(
            matches!(e, Error::GaveUp { attempts, .. } if attempts > 2),
            "{e}"
        );
        assert!(elapsed < Duration::from_millis(600), "{elapsed:?}");
    }

    #[test]
    fn configuration_is_checked() {
        assert!(matches!(
            Client::new("127.0.0.1:8080", "sk"),
            Err(Error::Config(_))
        ));
        assert!(matches!(Client::new("http://h", ""), Err(Error::Config(_))));
        let c = Client::new("http://h:1/", "sk_secret").unwrap();
        assert_eq!(c.inner.base, "http://h:1");
        assert!(!format!("{c:?}").contains("sk_secret"));
    }
}
