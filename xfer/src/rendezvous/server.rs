//! The server's side of the rendezvous: [`serve`], its limits, what it counts, and the
//! [`Service`] an application plugs into it.

use super::door::{self, Door, DoorLimits};
use super::{AUTH_CONTEXT, Envelope, FULL_RETRY, Greeting, MAX_HELLO, PROOF_CONTEXT, VERSION};
use crate::layers::AgentLayers;
use crate::{Agent, resolve};
use fabric_core::metadata::{AgentInfo, RegionDescriptor, TransportKind};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use transport_tcp::auth::Nonce;

/// How much a server gives its clients, and how long it waits for them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeLimits {
    /// Clients served at once (a client takes a place once its hello passed); more are
    /// refused with the reason and a time to ask again.
    pub max_clients: usize,
    /// Bytes the regions a [`Service`] reserves for its clients may hold in all
    /// ([`ClientSlot::reserve`]).
    pub max_region_bytes: u64,
    /// Bytes of new client regions per second, with bursts of up to a quarter second's
    /// worth (or one region, if larger); 0: no rate.
    pub region_rate: u64,
    /// A new connection's hello must be complete within this (it holds no place meanwhile).
    pub hello_timeout: Duration,
    /// Connections waiting for their hello, in all; past it the oldest is closed.
    pub max_pending: usize,
    /// Connections of one IP address waiting for their hello; past it that address's
    /// oldest is closed.
    pub max_pending_per_address: usize,
    /// A request line must be complete within this of its first byte.
    pub request_timeout: Duration,
    /// The longest request line.
    pub max_request_bytes: u64,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_clients: 16,
            max_region_bytes: 32 << 30,
            region_rate: 8 << 30,
            hello_timeout: Duration::from_secs(10),
            max_pending: 4096,
            max_pending_per_address: 256,
            request_timeout: Duration::from_secs(30),
            max_request_bytes: 8 << 20,
        }
    }
}

/// Why a server refused a client (or a request of one): the label of
/// `xfer_serve_refusals_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// [`ServeLimits::max_clients`] reached.
    ServerFull,
    /// Closed while waiting for its hello, to make room for a newer connection.
    Evicted,
    /// [`ServeLimits::max_region_bytes`] reached.
    RegionBudget,
    /// New regions faster than [`ServeLimits::region_rate`].
    RegionRate,
    /// No complete hello within [`ServeLimits::hello_timeout`].
    HelloTimeout,
    /// A request line not complete within [`ServeLimits::request_timeout`].
    RequestTimeout,
    /// A request line over [`ServeLimits::max_request_bytes`].
    RequestTooLong,
    /// Not UTF-8, not JSON, or no known request.
    Malformed,
    /// No or wrong token.
    Auth,
    /// Another protocol version.
    Version,
    /// A request that names what the server does not offer (transport, worker), or comes
    /// out of order.
    BadRequest,
    /// The server could not allocate what the client asked for.
    NoMemory,
}

impl Refusal {
    /// Every reason, in label order.
    pub const ALL: [Refusal; 12] = [
        Refusal::ServerFull,
        Refusal::Evicted,
        Refusal::RegionBudget,
        Refusal::RegionRate,
        Refusal::HelloTimeout,
        Refusal::RequestTimeout,
        Refusal::RequestTooLong,
        Refusal::Malformed,
        Refusal::Auth,
        Refusal::Version,
        Refusal::BadRequest,
        Refusal::NoMemory,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::ServerFull => "server_full",
            Refusal::Evicted => "evicted",
            Refusal::RegionBudget => "region_budget",
            Refusal::RegionRate => "region_rate",
            Refusal::HelloTimeout => "hello_timeout",
            Refusal::RequestTimeout => "request_timeout",
            Refusal::RequestTooLong => "request_too_long",
            Refusal::Malformed => "malformed",
            Refusal::Auth => "auth",
            Refusal::Version => "version",
            Refusal::BadRequest => "bad_request",
            Refusal::NoMemory => "no_memory",
        }
    }
}

/// What a server counts of its clients (for metrics).
#[derive(Debug, Default)]
pub struct ServeStats {
    /// Clients served now.
    pub clients: AtomicUsize,
    /// Bytes their reserved regions hold now.
    pub region_bytes: AtomicU64,
    /// Clients admitted so far.
    pub admitted: AtomicU64,
    /// Connections waiting for their hello now.
    pub pending: AtomicUsize,
    refusals: [AtomicU64; Refusal::ALL.len()],
}

impl ServeStats {
    /// Counts a refusal and logs its reason.
    pub fn refuse(&self, why: Refusal, from: Option<SocketAddr>, reason: &str) {
        self.refusals[why as usize].fetch_add(1, Ordering::Relaxed);
        tracing::warn!(?from, refusal = why.name(), %reason, "client refused");
    }

    /// Refusals so far for `why`.
    pub fn refusals(&self, why: Refusal) -> u64 {
        self.refusals[why as usize].load(Ordering::Relaxed)
    }
}

/// What the clients of one server hold now, against its limits.
struct Budget {
    limits: ServeLimits,
    stats: Arc<ServeStats>,
    rate: std::sync::Mutex<RegionRate>,
}

/// Seconds of the region rate a full [`RegionRate`] bucket holds.
const BURST: f64 = 0.25;

/// A token bucket of region bytes: it fills at `rate` bytes a second up to [`BURST`]
/// seconds' worth, and a region may be taken while the bucket holds its bytes or is full (a
/// region larger than the bucket then leaves it in debt, to be repaid before the next
/// one). Time comes from the caller, so that the rule can be tested without clocks.
///
/// The burst is short because a flood's first burst is what a short transfer beside it
/// feels: with a bucket of one second a flood's first second took twice the rate.
#[derive(Debug)]
struct RegionRate {
    rate: u64,
    tokens: f64,
    at: Instant,
}

impl RegionRate {
    fn new(rate: u64, now: Instant) -> RegionRate {
        RegionRate {
            rate,
            tokens: rate as f64 * BURST,
            at: now,
        }
    }

    /// Takes `bytes` at `now`, or says how long until they could be taken.
    fn take(&mut self, bytes: u64, now: Instant) -> Result<(), Duration> {
        if self.rate == 0 {
            return Ok(());
        }
        let rate = self.rate as f64;
        let cap = rate * BURST;
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(cap);
        self.at = now;
        let need = (bytes as f64).min(cap);
        if self.tokens >= need {
            self.tokens -= bytes as f64;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((need - self.tokens) / rate))
        }
    }
}

/// Why a client whose hello passed gets no place.
#[derive(Debug, thiserror::Error)]
enum AdmitError {
    /// [`ServeLimits::max_clients`] clients are served already.
    #[error("server full: {clients} clients already (--max-clients {max})")]
    Full {
        /// Clients served when it asked.
        clients: usize,
        /// The limit.
        max: usize,
    },
}

impl Budget {
    /// A client's place, or why there is none.
    fn admit(self: &Arc<Self>) -> Result<ClientSlot, AdmitError> {
        let max = self.limits.max_clients;
        self.stats
            .clients
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|clients| AdmitError::Full { clients, max })?;
        self.stats.admitted.fetch_add(1, Ordering::Relaxed);
        Ok(ClientSlot {
            budget: self.clone(),
            bytes: 0,
        })
    }
}

/// A refusal a server sends: why (its metrics label), the reason in words, and when asking
/// again may pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The label.
    pub why: Refusal,
    /// What the client is told.
    pub reason: String,
    /// After how long asking again may pass, if it may.
    pub retry: Option<Duration>,
}

impl Refused {
    /// A refusal for `why`, told as `reason`, not to be asked again.
    pub fn new(why: Refusal, reason: impl Into<String>) -> Refused {
        Refused {
            why,
            reason: reason.into(),
            retry: None,
        }
    }
}

/// What a [`Service`] gives a client at its hello: what it keeps for the client, and the
/// regions the client may use, by name.
pub type Given<C> = (C, BTreeMap<String, RegionDescriptor>);

/// An admitted client's place, and the region bytes reserved for it: both given back when
/// it is dropped (when the client leaves).
pub struct ClientSlot {
    budget: Arc<Budget>,
    bytes: u64,
}

impl ClientSlot {
    /// Reserves `bytes` of region for this client, or says why not: the bytes all
    /// clients' regions may hold ([`ServeLimits::max_region_bytes`]), then the rate of new
    /// ones ([`ServeLimits::region_rate`]), with the time after which asking again may pass.
    pub fn reserve(&mut self, bytes: u64) -> Result<(), Refused> {
        let max = self.budget.limits.max_region_bytes;
        self.budget
            .stats
            .region_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&t| t <= max)
            })
            .map_err(|held| {
                Refused::new(
                    Refusal::RegionBudget,
                    format!(
                        "server full: its clients' regions hold {held} of {max} bytes \
                         (--max-region-bytes)"
                    ),
                )
            })?;
        let rated = self
            .budget
            .rate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(bytes, Instant::now());
        if let Err(wait) = rated {
            self.budget
                .stats
                .region_bytes
                .fetch_sub(bytes, Ordering::AcqRel);
            return Err(Refused {
                why: Refusal::RegionRate,
                reason: format!(
                    "server busy: new regions past {} bytes/s (--region-rate); retry in {} ms",
                    self.budget.limits.region_rate,
                    wait.as_millis().max(1)
                ),
                retry: Some(wait),
            });
        }
        self.bytes += bytes;
        Ok(())
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let stats = &self.budget.stats;
        stats.region_bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        stats.clients.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A client's hello.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct HelloRequest {
    /// Always "hello".
    pub op: String,
    /// Protocol version.
    pub version: u32,
    /// Who the client is.
    pub agent: AgentInfo,
    /// Which of the server's agents it talks to (position; the first when absent).
    #[serde(default)]
    pub worker: Option<u32>,
    /// Its answer to the greeting's nonce, if it has the token (hex).
    #[serde(default)]
    pub auth: Option<String>,
    /// Whether it has a token (a tag is sent only to a server that has one too).
    #[serde(default)]
    pub token: bool,
    /// Its nonce (hex), which the welcome's proof answers.
    #[serde(default)]
    pub nonce: Option<String>,
}

/// The server's answer to a hello.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct HelloReply {
    /// Who the server agent is.
    pub agent: AgentInfo,
    /// The transport both use ([`resolve`]).
    pub transport: TransportKind,
    /// The regions the client may use, by name: the agent's offered ones and what the
    /// service gave this client.
    pub regions: BTreeMap<String, RegionDescriptor>,
    /// The server's answer to the hello's nonce, if it has the token (hex).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<String>,
}

/// What a service answers.
pub enum Verdict {
    /// Go on with the client (the service wrote its reply, if the request wanted one).
    Continue,
    /// Refuse with a reason (and when asking again may pass); the connection closes.
    Refuse(Refused),
}

/// An application's part of a server: what each client gets at its hello (a region of its
/// own, say), and the requests beyond the hello. The `xfer` command's `serve` is one (it
/// hands every client a fresh region and verifies what the client wrote).
pub trait Service: Send + Sync + 'static {
    /// What the service keeps per client, given back at [`goodbye`](Self::goodbye).
    type Client: Send + 'static;

    /// A client was admitted on `agent` (its hello passed, its place taken): the regions it
    /// gets beside the agent's offered ones (reserve their bytes with `c.slot()` first), and
    /// what to keep for it; or a refusal.
    fn hello(
        &self,
        c: &mut ServiceClient<'_>,
        agent: &Agent,
    ) -> Result<Given<Self::Client>, Refused>;

    /// A request `op` (the line's other fields in `req`) of a client: answer it with
    /// [`ServiceClient::reply`] (or refuse). An op the service does not know is refused with
    /// [`Refusal::Malformed`] by returning [`Verdict::Refuse`].
    fn request(
        &self,
        c: &mut ServiceClient<'_>,
        agent: &Agent,
        state: &mut Self::Client,
        op: &str,
        req: serde_json::Value,
    ) -> Verdict;

    /// The client left: give back what [`hello`](Self::hello) gave it.
    fn goodbye(&self, agent: &Agent, state: Self::Client);
}

/// A service that gives clients nothing beyond the agent's offered regions and knows no
/// request: a plain rendezvous.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoService;

impl Service for NoService {
    type Client = ();

    fn hello(&self, _: &mut ServiceClient<'_>, _: &Agent) -> Result<Given<()>, Refused> {
        Ok(((), BTreeMap::new()))
    }

    fn request(
        &self,
        _: &mut ServiceClient<'_>,
        _: &Agent,
        _: &mut (),
        op: &str,
        _: serde_json::Value,
    ) -> Verdict {
        Verdict::Refuse(Refused::new(
            Refusal::Malformed,
            format!("unknown request {op:?}"),
        ))
    }

    fn goodbye(&self, _: &Agent, _: ()) {}
}

/// One client, as a [`Service`] sees it.
pub struct ServiceClient<'a> {
    w: &'a mut TcpStream,
    from: Option<SocketAddr>,
    peer: &'a AgentInfo,
    transport: TransportKind,
    slot: &'a mut ClientSlot,
    limits: &'a ServeLimits,
    token: Option<&'a str>,
}

impl ServiceClient<'_> {
    /// Where the client connected from.
    pub fn from(&self) -> Option<SocketAddr> {
        self.from
    }

    /// Who the client is.
    pub fn peer(&self) -> &AgentInfo {
        self.peer
    }

    /// The transport it uses with this server.
    pub fn transport(&self) -> TransportKind {
        self.transport
    }

    /// Its place and region bytes.
    pub fn slot(&mut self) -> &mut ClientSlot {
        self.slot
    }

    /// The server's limits.
    pub fn limits(&self) -> &ServeLimits {
        self.limits
    }

    /// The shared token, for raw streams the service opens beside (see
    /// [`raw_auth`](crate::layers::raw_auth)).
    pub fn token(&self) -> Option<&str> {
        self.token
    }

    /// The address the client reached the server at (for listeners opened beside).
    pub fn local_ip(&self) -> std::io::Result<IpAddr> {
        Ok(self.w.local_addr()?.ip())
    }

    /// Answers the current request with `body`.
    pub fn reply<T: Serialize>(&mut self, body: T) -> std::io::Result<()> {
        self.w.write_all(&Envelope::ok(body).line())
    }

    /// Answers the current request with a failure that does not end the connection (a bad
    /// argument of the request).
    pub fn fail(&mut self, reason: String) -> std::io::Result<()> {
        self.w
            .write_all(&Envelope::<()>::refused(reason, None).line())
    }
}

/// Serves clients for `agents` (the hello's `worker` picks one, the first by default) on
/// `listener`, with `service`, until the process ends or the listener fails. Connections
/// wait for their hello in one event loop (the door); a hello that passes (version, token
/// `token`, a free place) gets a thread of its own.
pub fn serve<S: Service>(
    listener: TcpListener,
    agents: Vec<Agent>,
    limits: ServeLimits,
    stats: Arc<ServeStats>,
    token: Option<String>,
    service: Arc<S>,
) -> std::io::Result<()> {
    warn_if_open(&listener, token.as_deref());
    let door = door_for(listener, &limits)?;
    run_door(door, agents, limits, stats, token, service)
}

/// Says loudly that a server without a token listens beyond loopback: whoever reaches it
/// gets the offered regions' descriptors (and, through the agents' rails, their bytes).
fn warn_if_open(listener: &TcpListener, token: Option<&str>) {
    if token.is_some() {
        return;
    }
    if let Ok(at) = listener.local_addr()
        && !at.ip().is_loopback()
    {
        tracing::warn!(
            %at,
            "rendezvous listening beyond loopback without an auth token: whoever reaches it \
             gets the offered regions"
        );
    }
}

/// A rendezvous server on a thread of its own (what [`serve`] does, until
/// [`stop`](Server::stop) or until it is dropped).
pub struct Server {
    addr: SocketAddr,
    stop: door::Stop,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    /// Serves clients for `agents` on `listener` as [`serve`] does, on a new thread.
    pub fn start<S: Service>(
        listener: TcpListener,
        agents: Vec<Agent>,
        limits: ServeLimits,
        stats: Arc<ServeStats>,
        token: Option<String>,
        service: Arc<S>,
    ) -> std::io::Result<Server> {
        let addr = listener.local_addr()?;
        warn_if_open(&listener, token.as_deref());
        let door = door_for(listener, &limits)?;
        let stop = door.stopper();
        let thread = std::thread::Builder::new()
            .name("xfer-rendezvous-door".into())
            .spawn(move || run_door(door, agents, limits, stats, token, service))?;
        Ok(Server {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting: the listener and every connection still waiting for its hello
    /// close; connections already admitted run to their end (each holds its agent until
    /// its client says goodbye or goes). Returns the loop's error, if it had one.
    pub fn stop(mut self) -> std::io::Result<()> {
        self.stop_now()
    }

    fn stop_now(&mut self) -> std::io::Result<()> {
        self.stop.stop();
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(std::io::Error::other("the rendezvous loop panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = self.stop_now() {
            tracing::warn!(error = %e, "the rendezvous server had failed");
        }
    }
}

/// The door of a server on `listener`, bounded by `limits`.
fn door_for(listener: TcpListener, limits: &ServeLimits) -> std::io::Result<Door> {
    raise_fd_limit();
    Door::new(
        listener,
        DoorLimits {
            hello_timeout: limits.hello_timeout,
            max_pending: limits.max_pending,
            max_pending_per_address: limits.max_pending_per_address,
            max_hello_bytes: usize::try_from(limits.max_request_bytes.min(MAX_HELLO))
                .unwrap_or(usize::MAX),
        },
    )
}

/// Runs `door` for `agents` until it stops or fails (see [`serve`]).
fn run_door<S: Service>(
    door: Door,
    agents: Vec<Agent>,
    limits: ServeLimits,
    stats: Arc<ServeStats>,
    token: Option<String>,
    service: Arc<S>,
) -> std::io::Result<()> {
    let budget = Arc::new(Budget {
        rate: std::sync::Mutex::new(RegionRate::new(limits.region_rate, Instant::now())),
        limits,
        stats,
    });
    let agents = Arc::new(agents);
    let judged = budget.clone();
    let closed_stats = budget.stats.clone();
    let pending_stats = budget.stats.clone();
    let judge_token = token.clone();
    let judge_agents = agents.clone();
    let has_token = token.is_some();
    door.run(
        move |nonce: &Nonce| greeting(nonce, has_token),
        |hello| judge(&judged, judge_token.as_deref(), &judge_agents, hello),
        move |a: door::Admitted<(HelloRequest, ClientSlot)>| {
            let (hello, slot) = a.admitted;
            let (agents, service, token) = (agents.clone(), service.clone(), token.clone());
            let budget = budget.clone();
            let from = Some(a.from);
            let spawned = std::thread::Builder::new()
                .name("xfer-rendezvous".into())
                .spawn(move || {
                    let agent = &agents[hello.worker.unwrap_or(0) as usize];
                    if let Some(p) = agent.home() {
                        p.prefer_memory_here("xfer-rendezvous");
                    }
                    let c = Conn {
                        from,
                        limits: &budget.limits,
                        stats: &budget.stats,
                        token: token.as_deref(),
                    };
                    match c.run(a.conn, slot, hello, agent, &*service) {
                        Ok(()) => tracing::info!(?from, "control connection ended"),
                        Err(e) => tracing::warn!(?from, reason = %e, "control connection closed"),
                    }
                });
            if let Err(e) = spawned {
                // The slot went with the closure: the place is free again.
                tracing::warn!(?from, error = %e, "no thread for a client");
            }
        },
        move |from, why| {
            let (refusal, reason) = match why {
                door::Closed::HelloTimeout => (
                    Refusal::HelloTimeout,
                    "no complete hello within --hello-timeout",
                ),
                door::Closed::TooLong => (Refusal::RequestTooLong, "hello too long"),
                door::Closed::Evicted => (
                    Refusal::Evicted,
                    "closed to make room for newer connections",
                ),
            };
            closed_stats.refuse(refusal, Some(from), reason);
        },
        move |n| pending_stats.pending.store(n, Ordering::Relaxed),
    )
}

/// The server's first line on every connection.
fn greeting(nonce: &Nonce, auth: bool) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Greeting {
        op: "challenge".into(),
        version: VERSION,
        nonce: nonce.to_hex(),
        auth,
    })
    .unwrap_or_default();
    line.push(b'\n');
    line
}

/// The `op` of a request line that is not a hello, for the refusal (at most 32 bytes).
fn op_of(line: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Op {
        op: String,
    }
    serde_json::from_slice::<Op>(line)
        .map(|o| o.op.chars().take(32).collect())
        .unwrap_or_else(|_| "a request".into())
}

/// Judges a complete hello in the door: admitted with a client's place, or refused with
/// the reason (counted and logged).
fn judge(
    budget: &Arc<Budget>,
    token: Option<&str>,
    agents: &[Agent],
    hello: door::Hello<'_>,
) -> door::Verdict<(HelloRequest, ClientSlot)> {
    let from = Some(hello.from);
    let refuse = |why: Refusal, reason: String, retry: Option<Duration>| {
        budget.stats.refuse(why, from, &reason);
        let mut env = Envelope::<()>::refused(reason, retry);
        env.refusal = Some(why.name().into());
        door::Verdict::Refuse(env.line())
    };
    let Ok(line) = std::str::from_utf8(hello.line) else {
        return refuse(Refusal::Malformed, "request is not UTF-8".into(), None);
    };
    #[derive(Deserialize)]
    struct Head {
        op: String,
        #[serde(default)]
        version: Option<u32>,
        #[serde(default)]
        auth: Option<String>,
        #[serde(default)]
        token: bool,
        #[serde(default)]
        nonce: Option<String>,
    }
    let head: Head = match serde_json::from_str(line) {
        Ok(h) => h,
        Err(e) => return refuse(Refusal::Malformed, format!("malformed request: {e}"), None),
    };
    if head.op != "hello" {
        return refuse(
            Refusal::BadRequest,
            format!(
                "{} before hello: a connection's first request is its hello",
                op_of(hello.line)
            ),
            None,
        );
    }
    // The version first: an older client names no token and proves nothing back.
    if head.version != Some(VERSION) {
        return refuse(
            Refusal::Version,
            format!(
                "protocol version {} not supported (server speaks {VERSION}): use the same xfer \
                 on both ends",
                head.version.map_or("none".into(), |v| v.to_string())
            ),
            None,
        );
    }
    // Checked before anything else of the hello is used, and before any place is taken:
    // both sides have the token (the hello proves it, and carries the nonce the welcome's
    // proof answers), or neither has.
    let refused = match (token, head.token) {
        (Some(want), true) => {
            let tag = head.auth.as_deref().and_then(|a| hex::decode(a).ok());
            let nonce = head.nonce.as_deref().map(Nonce::from_hex);
            if !matches!(nonce, Some(Ok(_))) {
                Some("authentication failed: the hello carries no nonce for the server's proof")
            } else if !tag
                .is_some_and(|t| transport_tcp::auth::verify(want, AUTH_CONTEXT, hello.nonce, &t))
            {
                Some("authentication failed: the hello does not prove this server's --auth-token")
            } else {
                None
            }
        }
        (Some(_), false) => Some(
            "authentication failed: this server has an --auth-token and the client has none \
             (give both the same token)",
        ),
        (None, true) => Some(
            "authentication failed: the client has an --auth-token and this server has none \
             (give both the same token)",
        ),
        (None, false) => None,
    };
    if let Some(reason) = refused {
        return refuse(Refusal::Auth, reason.into(), None);
    }
    let req: HelloRequest = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return refuse(Refusal::Malformed, format!("malformed hello: {e}"), None),
    };
    if let Err(e) = req.agent.check() {
        return refuse(Refusal::Malformed, format!("the hello's agent: {e}"), None);
    }
    let worker = req.worker.unwrap_or(0) as usize;
    if worker >= agents.len() {
        return refuse(
            Refusal::BadRequest,
            format!(
                "this server runs {} worker(s); worker {worker} does not exist (start it with \
                 --per-gpu and more --gpus)",
                agents.len()
            ),
            None,
        );
    }
    match resolve(agents[worker].info(), &req.agent) {
        Ok(_) => {}
        // Told from the server's side: what it offers, and what the client asked for.
        Err(crate::Error::NoCommonTransport { theirs, ours, .. }) => {
            let why = format!(
                "no transport in common: this server offers {ours}, not {theirs} (make both \
                 with the same transport, or auto)"
            );
            return refuse(Refusal::BadRequest, why, None);
        }
        Err(e) => return refuse(Refusal::BadRequest, e.to_string(), None),
    }
    match budget.admit() {
        Ok(slot) => door::Verdict::Admit((req, slot)),
        Err(e @ AdmitError::Full { .. }) => {
            refuse(Refusal::ServerFull, e.to_string(), Some(FULL_RETRY))
        }
    }
}

/// Raises this process's soft limit of open files to its hard limit: every connection
/// waiting for its hello holds a descriptor, and the usual soft limit (1024) is below the
/// default [`ServeLimits::max_pending`].
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid, exclusively borrowed `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads the valid rlimit `lim`; raising the soft limit up to the
        // hard limit needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            tracing::debug!("could not raise the open-file limit");
        }
    }
}

/// Why a control connection was closed by the server.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    /// A request could not be read (and was refused with the reason).
    #[error(transparent)]
    Line(#[from] LineError),
    /// A reply could not be written.
    #[error("writing the reply: {0}")]
    Reply(#[from] std::io::Error),
}

/// A served client's connection.
struct Conn<'a> {
    from: Option<SocketAddr>,
    limits: &'a ServeLimits,
    stats: &'a ServeStats,
    token: Option<&'a str>,
}

impl Conn<'_> {
    /// Answers the admitted `hello`, then the client's requests until it leaves.
    /// The welcome's proof of our token for the nonce of the client's (admitted) hello.
    fn proof(&self, hello: &HelloRequest) -> Option<String> {
        let token = self.token?;
        let nonce = Nonce::from_hex(hello.nonce.as_deref()?).ok()?;
        Some(hex::encode(transport_tcp::auth::tag(
            token,
            PROOF_CONTEXT,
            &nonce,
        )))
    }

    fn run<S: Service>(
        &self,
        conn: TcpStream,
        mut slot: ClientSlot,
        hello: HelloRequest,
        agent: &Agent,
        service: &S,
    ) -> Result<(), ConnError> {
        let mut w = conn.try_clone()?;
        let mut r = BufReader::new(conn);
        let transport = match resolve(agent.info(), &hello.agent) {
            Ok(k) => k,
            Err(e) => {
                self.refuse(&mut w, Refusal::BadRequest, e.to_string(), None)?;
                return Ok(());
            }
        };
        let mut sc = ServiceClient {
            w: &mut w,
            from: self.from,
            peer: &hello.agent,
            transport,
            slot: &mut slot,
            limits: self.limits,
            token: self.token,
        };
        let (mut state, given) = match service.hello(&mut sc, agent) {
            Ok(x) => x,
            Err(r) => {
                self.refuse(&mut w, r.why, r.reason, r.retry)?;
                return Ok(());
            }
        };
        // Its notifications name it while it is a client.
        agent.know(&hello.agent);
        let mut regions = agent.offered();
        regions.extend(given);
        let proof = self.proof(&hello);
        let replied = w.write_all(
            &Envelope::ok(HelloReply {
                agent: agent.info().clone(),
                transport,
                regions,
                proof,
            })
            .line(),
        );
        let result = replied.map_err(ConnError::from).and_then(|()| {
            self.requests(
                &mut r, &mut w, &hello, transport, &mut slot, agent, service, &mut state,
            )
        });
        service.goodbye(agent, state);
        agent.forget(&hello.agent);
        // The place and bytes are free again before the connection closes, so a client
        // that sees the close may connect again at once.
        drop(slot);
        if matches!(result, Err(ConnError::Line(_))) {
            discard_rest(&mut r);
        }
        result
    }

    /// The client's requests after its hello, each line due within the request timeout of
    /// its first byte.
    #[allow(clippy::too_many_arguments)]
    fn requests<S: Service>(
        &self,
        r: &mut BufReader<TcpStream>,
        w: &mut TcpStream,
        hello: &HelloRequest,
        transport: TransportKind,
        slot: &mut ClientSlot,
        agent: &Agent,
        service: &S,
        state: &mut S::Client,
    ) -> Result<(), ConnError> {
        loop {
            let line = match read_line(
                r,
                self.limits.max_request_bytes,
                self.limits.request_timeout,
            ) {
                Ok(l) => l,
                Err(LineError::Closed) => return Ok(()),
                Err(e) => {
                    let why = e.refusal();
                    let _ = self.refuse(w, why, e.to_string(), None);
                    return Err(e.into());
                }
            };
            let mut req: serde_json::Map<String, serde_json::Value> =
                match serde_json::from_str(&line) {
                    Ok(v) => v,
                    Err(e) => {
                        self.refuse(
                            w,
                            Refusal::Malformed,
                            format!("malformed request: {e}"),
                            None,
                        )?;
                        return Ok(());
                    }
                };
            let op = match req.remove("op") {
                Some(serde_json::Value::String(op)) => op,
                _ => {
                    self.refuse(
                        w,
                        Refusal::Malformed,
                        "a request without an op".into(),
                        None,
                    )?;
                    return Ok(());
                }
            };
            if op == "hello" {
                // A second hello on a served connection changes nothing: answer as before.
                w.write_all(
                    &Envelope::ok(HelloReply {
                        agent: agent.info().clone(),
                        transport,
                        regions: agent.offered(),
                        proof: self.proof(hello),
                    })
                    .line(),
                )?;
                continue;
            }
            let mut sc = ServiceClient {
                w,
                from: self.from,
                peer: &hello.agent,
                transport,
                slot,
                limits: self.limits,
                token: self.token,
            };
            match service.request(&mut sc, agent, state, &op, serde_json::Value::Object(req)) {
                Verdict::Continue => {}
                Verdict::Refuse(r) => {
                    self.refuse(w, r.why, r.reason, r.retry)?;
                    return Ok(());
                }
            }
        }
    }

    /// Counts and logs a refusal, and tells the client why.
    fn refuse(
        &self,
        w: &mut TcpStream,
        why: Refusal,
        reason: String,
        retry: Option<Duration>,
    ) -> std::io::Result<()> {
        self.stats.refuse(why, self.from, &reason);
        w.write_all(&Envelope::<()>::refused(reason, retry).line())
    }
}

/// Reads and drops what a refused client is still sending (at most 1 MiB, for at most
/// 200 ms): closing a socket with unread bytes resets it, and the reset can overtake the
/// reply that says why.
fn discard_rest(r: &mut BufReader<TcpStream>) {
    let _ = r.get_ref().shutdown(std::net::Shutdown::Write);
    let _ = r
        .get_ref()
        .set_read_timeout(Some(Duration::from_millis(200)));
    let _ = std::io::copy(&mut r.take(1 << 20), &mut std::io::sink());
}

/// Why a request line could not be read.
#[derive(Debug, thiserror::Error)]
enum LineError {
    /// The peer closed the connection between requests.
    #[error("the client closed the connection")]
    Closed,
    /// The line did not end within its cap.
    #[error("request longer than {0} bytes (--max-request-bytes)")]
    TooLong(u64),
    /// The line did not end within its deadline.
    #[error("request not complete within {0:?} (--request-timeout)")]
    TooSlow(Duration),
    /// The line is not UTF-8.
    #[error("request is not UTF-8")]
    NotText,
    /// The socket failed.
    #[error("control connection: {0}")]
    Io(#[from] std::io::Error),
}

impl LineError {
    /// The refusal it stands for.
    fn refusal(&self) -> Refusal {
        match self {
            LineError::TooLong(_) => Refusal::RequestTooLong,
            LineError::TooSlow(_) => Refusal::RequestTimeout,
            LineError::NotText => Refusal::Malformed,
            LineError::Closed | LineError::Io(_) => Refusal::BadRequest,
        }
    }
}

/// Reads one line of at most `max` bytes, complete within `within` of its first byte: a
/// client may stay silent between requests for as long as its transfers run, but no request
/// may trickle in.
fn read_line(
    r: &mut BufReader<TcpStream>,
    max: u64,
    within: Duration,
) -> Result<String, LineError> {
    let mut line = Vec::new();
    let mut by: Option<Instant> = None;
    loop {
        let left = by.map(|t| t.saturating_duration_since(Instant::now()));
        let expired = left.is_some_and(|l| l.is_zero());
        r.get_ref()
            .set_read_timeout(left.map(|l| l.max(Duration::from_millis(1))))?;
        let chunk = match r.fill_buf() {
            Ok(c) => c,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(LineError::TooSlow(within));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if chunk.is_empty() {
            return Err(if line.is_empty() {
                LineError::Closed
            } else {
                LineError::Io(std::io::ErrorKind::UnexpectedEof.into())
            });
        }
        by.get_or_insert_with(|| Instant::now() + within);
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(at) => (at + 1, true),
            None => (chunk.len(), false),
        };
        if (line.len() + take) as u64 > max {
            return Err(LineError::TooLong(max));
        }
        line.extend_from_slice(&chunk[..take]);
        r.consume(take);
        if done {
            return String::from_utf8(line).map_err(|_| LineError::NotText);
        }
        if expired {
            return Err(LineError::TooSlow(within));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_region_rate_allows_a_burst_of_regions_then_refills_at_its_rate() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // 400 bytes a second: a bucket of 100.
        let mut r = RegionRate::new(400, t0);
        for _ in 0..2 {
            r.take(50, t0).expect("a quarter second's worth at once");
        }
        let wait = r.take(100, t0).expect_err("the third is past the rate");
        assert_eq!(wait, Duration::from_millis(250));
        assert!(r.take(100, ms(200)).is_err(), "80 bytes back after 200 ms");
        r.take(100, ms(260)).expect("100 bytes back after 250 ms");
        r.take(100, ms(60_000)).expect("a full bucket again");
        assert!(r.take(1, ms(60_000)).is_err());
    }

    #[test]
    fn a_full_server_says_how_many_it_serves_and_a_leaving_client_frees_its_place() {
        let budget = Arc::new(Budget {
            limits: ServeLimits {
                max_clients: 1,
                ..ServeLimits::default()
            },
            stats: Arc::default(),
            rate: std::sync::Mutex::new(RegionRate::new(0, Instant::now())),
        });
        let slot = budget.admit().expect("a place for the first client");
        let Err(e) = budget.admit() else {
            panic!("a place for a second client beyond --max-clients 1");
        };
        assert!(
            matches!(e, AdmitError::Full { clients: 1, max: 1 }),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "server full: 1 clients already (--max-clients 1)"
        );
        drop(slot);
        budget.admit().expect("the place is free again");
    }

    #[test]
    fn a_region_larger_than_the_bucket_waits_for_a_full_one_and_leaves_debt() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut r = RegionRate::new(100, t0);
        r.take(300, t0)
            .expect("a full bucket takes one large region");
        assert!(r.take(300, ms(2_900)).is_err());
        r.take(300, ms(3_100)).expect("full again after 3 s");
        assert!(
            RegionRate::new(0, t0).take(u64::MAX, t0).is_ok(),
            "0: no rate"
        );
    }
}
