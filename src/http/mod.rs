//! The HTTP front end: the only code that knows the HTTP library.
//!
//! `server.rs` runs the connection engine (hyper on a small tokio runtime)
//! and hands each complete request, as a plain [`Request`], to a pool of
//! synchronous worker threads; `router.rs` turns it into a call on the
//! application and returns a plain [`crate::api::Reply`]. Swapping the engine
//! touches `server.rs` alone.

pub mod router;
pub mod server;

/// A request as the engine read it, body included.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    /// Lower-case names, in arrival order.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// The body was over the limit (declared or actual) and was not kept.
    pub body_too_large: bool,
}

impl Request {
    /// All values of header `name` (lower-case).
    pub fn headers<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    pub fn header<'a>(&'a self, name: &'a str) -> Option<&'a [u8]> {
        self.headers(name).next()
    }
}
