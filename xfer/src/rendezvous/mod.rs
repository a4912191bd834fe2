//! The direct rendezvous: agents find each other at a control address, exchange their
//! metadata and named regions, and then talk over their transports.
//!
//! A server ([`serve`]) listens for clients on a TCP port; a client ([`Client`]) connects,
//! says hello with its [`AgentInfo`](crate::AgentInfo) and gets the server agent's `AgentInfo`, the transport
//! both will use ([`crate::resolve`], which both sides compute alike) and the regions the
//! server offers by name, plus any region a [`Service`] hands this client. Then the client
//! [`connect`](crate::Agent::connect)s and moves data. The control connection stays open:
//! a [`Service`] may answer further requests on it (the `xfer` command's bench asks the
//! server to verify what it wrote), and what the service gave the client is taken back when
//! it closes.
//!
//! The wire is JSON lines, out of band of the data path:
//!
//! ```text
//! server: {"op":"challenge","version":3,"nonce":"5f0c...","auth":true}
//! client: {"op":"hello","version":3,"agent":{...AgentInfo...},"worker":0,"token":true,
//!          "auth":"<hex tag>","nonce":"9a1e..."}
//! server: {"ok":true,"agent":{...},"transport":"tcp","regions":{"kv":{...RegionDescriptor...}},
//!          "proof":"<hex tag>"}
//! client: {"op":"verify",...}                    (a request the service answers)
//! server: {"ok":true,...}
//! ```
//!
//! Both sides prove the shared token. The server greets every connection first with a
//! fresh random nonce, saying whether it has a token (`auth`); a client with the token
//! answers it in its hello with an HMAC of the nonce ([`transport_tcp::auth`],
//! [`AUTH_CONTEXT`]) and a fresh nonce of its own, and the server's welcome carries the
//! HMAC of that one ([`PROOF_CONTEXT`]), which the client checks before it uses anything
//! of the welcome: a hello or a welcome seen once cannot be replayed, and a server without
//! the token cannot pass as one with it. A token on one side only is refused by both: the
//! server refuses the hello ([`Refusal::Auth`], saying which side lacks the token), and
//! the client fails with [`ClientError::ServerHasNoToken`] or
//! [`ClientError::NoTokenHere`] (it sends no tag to a server without a token).
//! Until its hello is complete a connection lives in one event loop (the door): no thread,
//! no client's place, a short deadline, and caps per address and in all that close the
//! oldest pending connection to make room, so silent or trickling connections cannot keep
//! legitimate clients out. A client takes a place ([`ServeLimits::max_clients`]) only once
//! its hello has been judged; a full server says so with a time to ask again, which
//! [`hello`] honours with back-off. Every refusal is a reply with the reason (and a log
//! line), then the connection closes.
//!
//! Raw TCP streams a service opens beside a control connection authenticate the same way
//! ([`raw_auth`](crate::layers::raw_auth)).

mod client;
mod door;
mod server;

pub use client::{Client, ClientError, Welcome, hello};
pub use server::{
    ClientSlot, Given, NoService, Refusal, Refused, ServeLimits, ServeStats, Server, Service,
    ServiceClient, Verdict, serve,
};

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Protocol version (3: the welcome proves the server's token too; 2: the server greets
/// with a nonce, the hello answers it and carries the client's `AgentInfo`).
pub const VERSION: u32 = 3;

/// What a hello's authentication tag is an HMAC of, beside the server's nonce: a tag made
/// for another purpose (a data connection's, the other direction's) does not pass here.
pub const AUTH_CONTEXT: &str = "xfer control hello v3: client to server";

/// What a welcome's proof is an HMAC of, beside the client's nonce.
pub const PROOF_CONTEXT: &str = "xfer control welcome v3: server to client";

/// The longest reply line a client reads.
pub const MAX_LINE: u64 = 64 << 20;

/// The longest hello line a server reads (a hello is a few KiB).
pub const MAX_HELLO: u64 = 64 << 10;

/// After a refusal for a full server, the time the server tells the client to wait before
/// asking again.
pub const FULL_RETRY: Duration = Duration::from_millis(200);

/// The server's first line on every connection.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct Greeting {
    /// Always "challenge".
    pub op: String,
    /// The server's protocol version.
    pub version: u32,
    /// The nonce the hello's `auth` answers, in hex.
    pub nonce: String,
    /// Whether the server has a token (and so asks for the hello's tag, and proves it).
    #[serde(default)]
    pub auth: bool,
}

/// A reply: `ok`, or the reason the server refused (and when asking again may succeed);
/// the body's fields sit beside these.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct Envelope<T> {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// For a refusal that passes: milliseconds after which asking again may succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_ms: Option<u64>,
    /// For a refusal: its kind ([`Refusal::name`]), so that a client can tell an
    /// authentication refusal from others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    #[serde(flatten)]
    pub body: Option<T>,
}

impl<T: Serialize> Envelope<T> {
    /// A refusal for `reason`, saying when asking again may succeed (`retry`), if it may.
    pub fn refused(reason: String, retry: Option<Duration>) -> Envelope<T> {
        Envelope {
            ok: false,
            error: Some(reason),
            retry_ms: retry.map(|d| d.as_millis().max(1) as u64),
            refusal: None,
            body: None,
        }
    }

    /// An answer carrying `body`.
    pub fn ok(body: T) -> Envelope<T> {
        Envelope {
            ok: true,
            error: None,
            retry_ms: None,
            refusal: None,
            body: Some(body),
        }
    }

    /// The reply as one line, newline included.
    pub fn line(&self) -> Vec<u8> {
        let mut line = serde_json::to_vec(self).unwrap_or_else(|e| {
            format!("{{\"ok\":false,\"error\":\"internal: cannot encode the reply: {e}\"}}")
                .into_bytes()
        });
        line.push(b'\n');
        line
    }
}
