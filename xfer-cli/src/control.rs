//! The bench's requests on the rendezvous's control connection (JSON lines, after the
//! library's hello: see [`xfer::rendezvous`]), and the calls that make them
//! ([`BenchClient`]); [`crate::served`] answers them.
//!
//! ```text
//! client: {"op":"verify","seed":1,"page_size":65536,"pages":[3,17,...]}
//! server: {"ok":true,"checked":1000,"mismatches":0,"first_mismatch":null}
//! client: {"op":"fill","seed":1}
//! server: {"ok":true,"bytes":1073741824}
//! client: {"op":"echo","page_size":4096,"pages":1}
//! server: {"ok":true,"address":"127.0.0.1:40125"}
//! client: {"op":"sink","streams":4}
//! server: {"ok":true,"addresses":["10.0.0.1:40127","10.0.1.1:40129"]}
//! ```
//! `verify` checks written pages of the client's region against the pattern; `fill` fills
//! it with the pattern (for `bench --op read`). `echo` opens a raw TCP listener beside the
//! control connection for the floor of `bench --latency`: the server accepts one connection
//! (within --hello-timeout) and, in the control thread, answers each `page_size * pages`
//! bytes that arrive with 8 bytes until the client closes it (each round due within
//! --request-timeout); then the control connection takes requests again. `sink` opens the
//! server's end of `bench --baseline` ([`crate::sink`]): a raw TCP listener per distinct IP
//! its rails serve on, in the order of their first rail; the server accepts `streams`
//! connections (at most [`crate::sink::MAX_STREAMS`], within --hello-timeout), reads each
//! to EOF and answers it with the 8-byte count; then the control connection takes requests
//! again. Raw streams answer the server's nonce first
//! ([`xfer::layers::raw_auth`]).

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use xfer::rendezvous::{Client, ClientError};

/// The name under which `serve` gives each client its region (in the hello's regions).
pub const REGION: &str = "region";

/// A request of the bench (after the hello).
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Check written pages against the pattern.
    Verify {
        /// Pattern seed.
        seed: u64,
        /// Page size.
        page_size: u64,
        /// Written pages.
        pages: Vec<u64>,
    },
    /// Fill the client's region with the pattern of `seed`, for `bench --op read` (the
    /// client reads it and checks its own copy).
    Fill {
        /// Pattern seed.
        seed: u64,
    },
    /// Open a raw TCP echo for the latency floor: rounds of `page_size * pages` bytes,
    /// each answered with 8 bytes.
    Echo {
        /// Page size.
        page_size: u64,
        /// Pages per round.
        pages: u64,
    },
    /// Open raw TCP listeners for `bench --baseline`: `streams` connections, each read to
    /// EOF and answered with its byte count.
    Sink {
        /// Connections the client will open (1 to [`crate::sink::MAX_STREAMS`]).
        streams: u32,
    },
}

/// The answer to `sink`.
#[derive(Serialize, Deserialize, Debug)]
pub struct SinkReply {
    /// The listeners (`IP:PORT`), one per distinct IP of the server's rails, in the order
    /// of their first rail.
    pub addresses: Vec<String>,
}

/// The answer to `echo`.
#[derive(Serialize, Deserialize, Debug)]
pub struct EchoReply {
    /// Where to connect (`IP:PORT`, the IP the control connection reached).
    pub address: String,
}

/// The answer to `fill`.
#[derive(Serialize, Deserialize, Debug)]
pub struct FillReply {
    /// Bytes filled (the whole region).
    pub bytes: u64,
}

/// The answer to `verify`.
#[derive(Serialize, Deserialize, Debug)]
pub struct VerifyReply {
    /// Pages checked.
    pub checked: u64,
    /// Pages that differ.
    pub mismatches: u64,
    /// The first page that differs.
    pub first_mismatch: Option<u64>,
}

/// Parses `xfer://HOST:PORT` into a socket address.
pub fn parse_peer(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let rest = s
        .strip_prefix("xfer://")
        .ok_or_else(|| format!("malformed peer address {s:?}: expected xfer://HOST:PORT"))?;
    let rest = rest.trim_end_matches('/');
    rest.to_socket_addrs()
        .map_err(|e| format!("malformed peer address {s:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("peer address {s:?} resolves to nothing"))
}

/// The bench's side of a control connection that has said hello.
pub struct BenchClient(pub Client);

impl BenchClient {
    /// Asks the server to open a raw TCP echo for rounds of `pages` pages of `page_size`;
    /// returns where to connect (an unspecified IP replaced by the control connection's).
    pub fn echo(&mut self, page_size: u64, pages: u64) -> Result<SocketAddr, ClientError> {
        let r: EchoReply = self.0.call(&Request::Echo { page_size, pages })?;
        self.address(&r.address)
    }

    /// Asks the server to open its end of `bench --baseline` for `streams` raw streams;
    /// returns its listeners (an unspecified IP replaced by the control connection's), one
    /// per distinct IP of its rails, in the order of their first rail.
    pub fn sink(&mut self, streams: u32) -> Result<Vec<SocketAddr>, ClientError> {
        let r: SinkReply = self.0.call(&Request::Sink { streams })?;
        r.addresses.iter().map(|a| self.address(a)).collect()
    }

    /// Asks the server to fill this client's region with the pattern of `seed`.
    pub fn fill(&mut self, seed: u64) -> Result<FillReply, ClientError> {
        self.0.call(&Request::Fill { seed })
    }

    /// Asks the server to check written pages.
    pub fn verify(
        &mut self,
        seed: u64,
        page_size: u64,
        pages: Vec<u64>,
    ) -> Result<VerifyReply, ClientError> {
        self.0.call(&Request::Verify {
            seed,
            page_size,
            pages,
        })
    }

    /// The shared token the hello answered the server's nonce with: raw streams answer
    /// theirs with it.
    pub fn token(&self) -> Option<&str> {
        self.0.token()
    }

    /// `IP:PORT` the server sent, an unspecified IP replaced by the one it was reached at.
    fn address(&self, a: &str) -> Result<SocketAddr, ClientError> {
        let mut at: SocketAddr = a
            .parse()
            .map_err(|e| ClientError::Malformed(format!("address {a:?} from the peer: {e}")))?;
        if at.ip().is_unspecified() {
            at.set_ip(self.0.addr().ip());
        }
        Ok(at)
    }
}
