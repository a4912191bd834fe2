//! The client's side of the rendezvous: [`Client`] and [`hello`].

use super::server::{HelloReply, HelloRequest};
use super::{AUTH_CONTEXT, Envelope, Greeting, MAX_HELLO, MAX_LINE, PROOF_CONTEXT, VERSION};
use fabric_core::metadata::{AgentInfo, RegionDescriptor, TransportKind};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use transport_tcp::auth::Nonce;

/// How long a client waits for the server's greeting.
const GREETING_WITHIN: Duration = Duration::from_secs(10);

/// How long a client waits for any other reply.
const REPLY_WITHIN: Duration = Duration::from_secs(120);

/// The longest a client waits between two tries of a hello the server asked it to repeat.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Why the rendezvous failed, client side.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server could not be reached.
    #[error("cannot reach peer {addr}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The server sent no greeting in time (not an xfer server of this protocol?).
    #[error("no greeting from {addr} within {within:?}: not an xfer server of protocol {VERSION}?")]
    NoGreeting {
        /// Where.
        addr: SocketAddr,
        /// How long it waited.
        within: Duration,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The server speaks another protocol version.
    #[error(
        "{addr} speaks protocol version {theirs} (this xfer speaks {VERSION}): use the same xfer on both ends"
    )]
    Version {
        /// Where.
        addr: SocketAddr,
        /// Its version.
        theirs: u32,
    },
    /// The server refused, saying why (and, where asking again may pass, when).
    #[error("peer refused: {reason}")]
    Refused {
        /// Its reason.
        reason: String,
        /// After how long asking again may pass.
        retry: Option<Duration>,
    },
    /// The client has a token and the server has none (its greeting says so): refused
    /// without sending it any proof (the server refuses too, and says why).
    #[error(
        "authentication failed: {addr} has no auth token and this side has one (give both the same token)"
    )]
    ServerHasNoToken {
        /// Where.
        addr: SocketAddr,
    },
    /// The server has a token and the client has none (the server refuses too).
    #[error(
        "authentication failed: {addr} has an auth token and this side has none (give both the same token)"
    )]
    NoTokenHere {
        /// Where.
        addr: SocketAddr,
    },
    /// The server refused the hello's proof of the token (the tokens differ).
    #[error("{reason} ({addr} refused the hello)")]
    AuthRefused {
        /// Where.
        addr: SocketAddr,
        /// The server's reason.
        reason: String,
    },
    /// The server's welcome does not prove the token for our nonce: a server with another
    /// token, or not the server we meant (one that relays, replays or lies).
    #[error("authentication failed: the welcome of {addr} does not prove the token")]
    ServerAuthFailed {
        /// Where.
        addr: SocketAddr,
    },
    /// The server's reply is not what the protocol says.
    #[error("malformed reply from the peer: {0}")]
    Malformed(String),
    /// The control connection failed or closed.
    #[error("control connection")]
    Io(#[from] std::io::Error),
}

impl ClientError {
    /// After how long asking again may pass, if the server said so.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Refused { retry, .. } => *retry,
            _ => None,
        }
    }
}

/// What a server answered a hello with.
#[derive(Clone, Debug)]
pub struct Welcome {
    /// The server agent, its tcp rails that listen on every interface given the address
    /// the client reached the server at (usable as they are by [`crate::Agent::connect`]).
    pub agent: AgentInfo,
    /// The transport both sides use (what [`crate::resolve`] gives both).
    pub transport: TransportKind,
    /// The regions this client may use, by name.
    pub regions: BTreeMap<String, RegionDescriptor>,
}

/// A client's control connection to a rendezvous server.
pub struct Client {
    addr: SocketAddr,
    w: TcpStream,
    r: BufReader<TcpStream>,
    nonce: Nonce,
    /// Whether the server's greeting says it has a token.
    server_token: bool,
    /// Ours, fresh for this connection: the welcome's proof answers it.
    mine: Nonce,
    token: Option<String>,
    /// The kind of the server's last refusal, if it named one.
    refusal: Option<String>,
}

impl Client {
    /// Connects within `timeout` and reads the server's greeting.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Client, ClientError> {
        let s = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|source| ClientError::Connect { addr, source })?;
        s.set_read_timeout(Some(GREETING_WITHIN))?;
        let mut r = BufReader::new(s.try_clone()?);
        let mut line = String::new();
        let n = (&mut r)
            .take(MAX_HELLO)
            .read_line(&mut line)
            .map_err(|source| ClientError::NoGreeting {
                addr,
                within: GREETING_WITHIN,
                source,
            })?;
        if n == 0 {
            return Err(ClientError::Malformed(format!(
                "{addr} closed the control connection before its greeting"
            )));
        }
        let (nonce, server_token) = match serde_json::from_str::<Greeting>(&line) {
            Ok(g) if g.op == "challenge" && g.version == VERSION => (
                Nonce::from_hex(&g.nonce)
                    .map_err(|e| ClientError::Malformed(format!("greeting: {e}")))?,
                g.auth,
            ),
            Ok(g) => {
                return Err(ClientError::Version {
                    addr,
                    theirs: g.version,
                });
            }
            Err(_) => {
                // A refusal before any greeting, or something else entirely.
                return Err(match serde_json::from_str::<Envelope<()>>(&line) {
                    Ok(Envelope {
                        error: Some(reason),
                        retry_ms,
                        ..
                    }) => ClientError::Refused {
                        reason,
                        retry: retry_ms.map(Duration::from_millis),
                    },
                    _ => ClientError::Malformed(format!(
                        "unexpected first line {:?}",
                        line.trim_end()
                    )),
                });
            }
        };
        s.set_read_timeout(Some(REPLY_WITHIN))?;
        let mine = Nonce::new()
            .map_err(|e| ClientError::Io(std::io::Error::other(format!("no nonce: {e}"))))?;
        Ok(Client {
            addr,
            w: s,
            r,
            nonce,
            server_token,
            mine,
            token: None,
            refusal: None,
        })
    }

    /// Says hello as `me` to the server's agent `worker` (the first by default), answering
    /// the greeting with `token` if there is one, and checking that the server proves it
    /// back. A token on one side only fails ([`ClientError::ServerHasNoToken`],
    /// [`ClientError::NoTokenHere`]) after the server has been told, so that it refuses
    /// and logs why too.
    pub fn hello(
        &mut self,
        me: &AgentInfo,
        worker: Option<u32>,
        token: Option<&str>,
    ) -> Result<Welcome, ClientError> {
        self.token = token.map(str::to_owned);
        let addr = self.addr;
        let mismatch = match (token.is_some(), self.server_token) {
            (true, false) => Some(ClientError::ServerHasNoToken { addr }),
            (false, true) => Some(ClientError::NoTokenHere { addr }),
            _ => None,
        };
        // A tag only for a server that says it has the token: to any other it would be a
        // tag of a nonce of its choosing, for nothing.
        let auth = token
            .filter(|_| self.server_token)
            .map(|t| hex::encode(transport_tcp::auth::tag(t, AUTH_CONTEXT, &self.nonce)));
        let reply: Result<HelloReply, ClientError> = self.call(&HelloRequest {
            op: "hello".into(),
            version: VERSION,
            agent: me.clone(),
            worker,
            auth,
            token: token.is_some(),
            nonce: Some(self.mine.to_hex()),
        });
        if let Some(e) = mismatch {
            return Err(e);
        }
        let reply = reply.map_err(|e| match e {
            ClientError::Refused { reason, .. } if self.refusal.as_deref() == Some("auth") => {
                ClientError::AuthRefused { addr, reason }
            }
            e => e,
        })?;
        // Nothing of the welcome is used before it proves the token.
        if let Some(t) = token {
            let proof = reply.proof.as_deref().and_then(|p| hex::decode(p).ok());
            if !proof.is_some_and(|p| transport_tcp::auth::verify(t, PROOF_CONTEXT, &self.mine, &p))
            {
                return Err(ClientError::ServerAuthFailed { addr });
            }
        }
        reply
            .agent
            .check()
            .map_err(|e| ClientError::Malformed(format!("the server's agent: {e}")))?;
        let mut agent = reply.agent;
        // A server listening on every interface reports 0.0.0.0: use the address it was
        // reached at.
        for t in &mut agent.transports {
            if t.kind == TransportKind::Tcp {
                for a in &mut t.rails {
                    if let Ok(sa) = transport_tcp::TcpTransport::parse_address(a)
                        && sa.ip().is_unspecified()
                    {
                        *a = format!(
                            "{}{}",
                            transport_tcp::ADDRESS_PREFIX,
                            SocketAddr::new(self.addr.ip(), sa.port())
                        )
                        .into_bytes();
                    }
                }
            }
        }
        Ok(Welcome {
            agent,
            transport: reply.transport,
            regions: reply.regions,
        })
    }

    /// Sends `req` (a JSON object with an `op`) and reads the reply into `T`.
    pub fn call<Q: Serialize, T: DeserializeOwned>(&mut self, req: &Q) -> Result<T, ClientError> {
        let mut line = serde_json::to_vec(req)
            .map_err(|e| ClientError::Malformed(format!("cannot encode the request: {e}")))?;
        line.push(b'\n');
        self.w.write_all(&line)?;
        let mut resp = String::new();
        let n = (&mut self.r).take(MAX_LINE).read_line(&mut resp)?;
        if n == 0 {
            return Err(ClientError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the peer closed the control connection",
            )));
        }
        let env: Envelope<T> =
            serde_json::from_str(&resp).map_err(|e| ClientError::Malformed(e.to_string()))?;
        self.refusal = env.refusal.clone();
        match (env.ok, env.body) {
            (true, Some(b)) => Ok(b),
            _ => Err(ClientError::Refused {
                reason: env.error.unwrap_or_else(|| "no reason given".into()),
                retry: env.retry_ms.map(Duration::from_millis),
            }),
        }
    }

    /// The shared token this client said hello with: raw streams to the server answer its
    /// nonces with it ([`raw_auth::answer`](crate::layers::raw_auth::answer)).
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The server's control address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Connects to `addr` and says hello as `me` ([`Client::hello`]), asking again on a new
/// connection while the server refuses with a time to ask again (a full server, new
/// regions past its rate) and the next try falls within `within` of the first. Tries back
/// off: each waits at least what the server asked for and grows by half each time (at most
/// two seconds), with a random quarter more, so that clients turned away together do not
/// come back together.
pub fn hello(
    addr: SocketAddr,
    timeout: Duration,
    within: Duration,
    me: &AgentInfo,
    worker: Option<u32>,
    token: Option<&str>,
) -> Result<(Client, Welcome), ClientError> {
    let until = Instant::now() + within;
    let mut backoff = Duration::ZERO;
    loop {
        let tried = Client::connect(addr, timeout).and_then(|mut c| {
            let w = c.hello(me, worker, token)?;
            Ok((c, w))
        });
        match tried {
            Ok(x) => return Ok(x),
            Err(e) => match e.retry_after() {
                Some(asked) => {
                    backoff = asked.max(backoff.mul_f64(1.5)).min(MAX_BACKOFF);
                    let after = backoff.mul_f64(1.0 + jitter() / 4.0);
                    if Instant::now() + after >= until {
                        return Err(e);
                    }
                    tracing::info!(error = %e, ?after, "asking again");
                    // A back-off the server asked for, not a synchronisation.
                    std::thread::sleep(after);
                }
                None => return Err(e),
            },
        }
    }
}

/// A number in `0..1`, different per call and per process (for back-off jitter).
fn jitter() -> f64 {
    (fabric_core::random_u64() >> 11) as f64 / (1u64 << 53) as f64
}
