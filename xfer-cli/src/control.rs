//! The control channel of `xfer serve`: JSON lines over TCP, out of band of the data path.
//!
//! ```text
//! server: {"op":"challenge","version":2,"nonce":"5f0c..."}
//! client: {"op":"hello","version":2,"transport":"tcp","auth":"<hex HMAC-SHA256 of the nonce>"}
//! server: {"ok":true,"transport":"tcp","address":"tcp://127.0.0.1:40123","region":{"addr":0,"len":1073741824,"key":...}}
//! client: {"op":"verify","seed":1,"page_size":65536,"pages":[3,17,...]}
//! server: {"ok":true,"checked":1000,"mismatches":0,"first_mismatch":null}
//! client: {"op":"echo","page_size":4096,"pages":1}
//! server: {"ok":true,"address":"127.0.0.1:40125"}
//! client: {"op":"sink","streams":4}
//! server: {"ok":true,"addresses":["10.0.0.1:40127","10.0.1.1:40129"]}
//! ```
//! `echo` (after hello) opens a raw TCP listener beside the control connection for the floor
//! of `bench --latency`: the server accepts one connection (within --hello-timeout) and, in
//! the control thread, answers each `page_size * pages` bytes that arrive with 8 bytes
//! until the client closes it (each round due within --request-timeout); then the control
//! connection takes requests again.
//! `sink` (after hello) opens the server's end of `bench --baseline`
//! ([`crate::sink`]): a raw TCP listener per distinct IP its rails serve on, in the order of
//! their first rail; the server accepts `streams` connections (at most
//! [`crate::sink::MAX_STREAMS`], within --hello-timeout), reads each to EOF and answers it
//! with the 8-byte count (each read due within --request-timeout, all bounded in bytes and
//! time); then the control connection takes requests again. A sink that fails is logged
//! and ends; the control connection stays.
//! Each control connection gets a region of its own, deregistered when it closes.
//!
//! The server greets every connection first with a fresh random nonce; a client with the
//! shared token (`--auth-token`) answers it in its hello with an HMAC of the nonce
//! ([`transport_tcp::auth`]), so a hello seen once cannot be replayed. The token, when set,
//! is checked before anything is allocated; tags are compared in constant time.
//!
//! Until its hello is complete, a connection lives in one event loop ([`crate::door`]):
//! no thread, no client's place, a short deadline, and caps per address and in all that
//! close the oldest pending connection to make room, so silent or trickling connections
//! cannot keep legitimate clients out. A client takes a place (`--max-clients`) only once its
//! hello has been judged; a full server says so with a time to ask again, which `bench`
//! honours. The server is bounded further ([`ServeLimits`]): the bytes the clients' regions
//! hold in all and the rate of new ones, a deadline for each request line once it has
//! begun, and a cap on a request's size. Every refusal is a JSON reply with the reason (and a
//! log line), then the connection closes.

use crate::backend::{BackendArgs, MemoryKind, TransportKind};
use crate::placement::CorePin;
use crate::workload;
use fabric_core::engine::{GroupRegistration, RailGroup, RemoteDescriptor};
use fabric_core::{Access, MemoryRegion};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Protocol version (2: the server greets with a nonce, the hello answers it).
pub const VERSION: u32 = 2;
/// What an authentication tag of the control port is an HMAC of, beside the nonce: a tag
/// made for another purpose (a data connection's) does not pass here.
pub const AUTH_CONTEXT: &str = "xfer control hello v2";
/// How long a client waits for the server's greeting.
const GREETING_WITHIN: Duration = Duration::from_secs(10);
/// After a refusal for a full server (`--max-clients`), the time the server tells the
/// client to wait before asking again.
const FULL_RETRY: Duration = Duration::from_millis(200);
/// Longest reply line a client accepts.
const MAX_LINE: u64 = 64 << 20;

/// How much `xfer serve` gives its clients, and how long it waits for them.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeLimits {
    /// Clients served at once; more are refused with the reason.
    #[arg(long, default_value_t = 16)]
    pub max_clients: usize,
    /// Bytes the clients' regions may hold in all (each client gets --region-size).
    #[arg(long, default_value = "32GiB", value_parser = crate::size::parse_size)]
    pub max_region_bytes: u64,
    /// Bytes of new regions allocated (and faulted in) per second, with bursts of up to a
    /// quarter second's worth (or one region, if larger): a flood of hellos past it is
    /// refused, with the time to ask again, before it costs the server page zeroing.
    /// 0: no rate.
    #[arg(long, default_value = "8GiB", value_parser = crate::size::parse_size)]
    pub region_rate: u64,
    /// Seconds a new connection has to complete its hello (it holds no client's place
    /// meanwhile).
    #[arg(long, default_value_t = 10)]
    pub hello_timeout: u64,
    /// Connections waiting for their hello, in all; past it the oldest is closed to make
    /// room.
    #[arg(long, default_value_t = 4096)]
    pub max_pending: usize,
    /// Connections of one IP address waiting for their hello; past it that address's
    /// oldest is closed to make room.
    #[arg(long, default_value_t = 256)]
    pub max_pending_per_address: usize,
    /// Seconds a request line may take once its first byte has arrived.
    #[arg(long, default_value_t = 30)]
    pub request_timeout: u64,
    /// Longest request line accepted.
    #[arg(long, default_value = "8MiB", value_parser = crate::size::parse_size)]
    pub max_request_bytes: u64,
}

/// Why `serve` refused a client (or a request of one): the label of
/// `xfer_serve_refusals_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// --max-clients reached.
    ServerFull,
    /// Closed while waiting for its hello, to make room for a newer connection
    /// (--max-pending, --max-pending-per-address).
    Evicted,
    /// --max-region-bytes reached.
    RegionBudget,
    /// New regions faster than --region-rate.
    RegionRate,
    /// No complete hello within --hello-timeout (silent or trickling clients).
    HelloTimeout,
    /// A request line not complete within --request-timeout of its first byte.
    RequestTimeout,
    /// A request line over --max-request-bytes.
    RequestTooLong,
    /// Not UTF-8, not JSON, or no known request.
    Malformed,
    /// No or wrong --auth-token.
    Auth,
    /// Another protocol version.
    Version,
    /// A request that names what the server does not offer (transport, worker, path),
    /// or comes out of order.
    BadRequest,
    /// The server could not allocate the region.
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

/// What a server counts of its clients, read by `--metrics`.
#[derive(Debug, Default)]
pub struct ServeStats {
    /// Clients served now.
    pub clients: AtomicUsize,
    /// Bytes their regions hold now.
    pub region_bytes: AtomicU64,
    /// Clients admitted so far.
    pub admitted: AtomicU64,
    /// Connections waiting for their hello now.
    pub pending: AtomicUsize,
    /// Refusals so far, by [`Refusal`] (in the order of [`Refusal::ALL`]).
    refusals: [AtomicU64; Refusal::ALL.len()],
}

impl ServeStats {
    /// Counts a refusal and logs its reason.
    fn refuse(&self, why: Refusal, from: Option<SocketAddr>, reason: &str) {
        self.refusals[why as usize].fetch_add(1, Ordering::Relaxed);
        tracing::warn!(?from, refusal = why.name(), %reason, "client refused");
    }

    /// Refusals so far for `why`.
    pub fn refusals(&self, why: Refusal) -> u64 {
        self.refusals[why as usize].load(Ordering::Relaxed)
    }
}

/// What the clients of one server hold now, against its [`ServeLimits`].
struct Budget {
    limits: ServeLimits,
    stats: Arc<ServeStats>,
    /// New region bytes allowed now, against --region-rate.
    rate: std::sync::Mutex<RegionRate>,
}

/// Seconds of `--region-rate` a full [`RegionRate`] bucket holds.
const BURST: f64 = 0.25;

/// A token bucket of region bytes: it fills at `rate` bytes a second up to [`BURST`]
/// seconds' worth, and a region may be taken while the bucket holds its bytes or is full (a
/// region larger than the bucket then leaves it in debt, to be repaid before the next
/// one). Time comes from the caller, so that the rule can be tested without clocks.
///
/// The burst is short because a flood's first burst is what a short transfer beside it
/// feels: with a bucket of one second a flood's first second took twice the rate (measured
/// in `tests/hostile_serve.rs`); legitimate clients told to wait ask again.
#[derive(Debug)]
struct RegionRate {
    /// Bytes per second (0: no limit).
    rate: u64,
    /// Bytes that may be taken now (negative: debt).
    tokens: f64,
    /// When `tokens` was last brought up to date.
    at: Instant,
}

impl RegionRate {
    /// A full bucket at `now`.
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

impl Budget {
    /// A client's place, or why there is none.
    fn admit(self: &Arc<Self>) -> Result<ClientSlot, String> {
        let max = self.limits.max_clients;
        self.stats
            .clients
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|n| format!("server full: {n} clients already (--max-clients {max})"))?;
        self.stats.admitted.fetch_add(1, Ordering::Relaxed);
        Ok(ClientSlot {
            budget: self.clone(),
            bytes: 0,
        })
    }
}

/// One admitted client: gives its place and its region's bytes back when dropped.
struct ClientSlot {
    budget: Arc<Budget>,
    bytes: u64,
}

impl ClientSlot {
    /// Reserves `bytes` for this client's region, or says why not: the bytes all regions
    /// may hold (--max-region-bytes), then the rate of new ones (--region-rate).
    fn reserve(&mut self, bytes: u64) -> Result<(), (Refusal, String, Option<Duration>)> {
        let max = self.budget.limits.max_region_bytes;
        self.budget
            .stats
            .region_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&t| t <= max)
            })
            .map_err(|held| {
                format!(
                    "server full: its clients' regions hold {} of {} (--max-region-bytes)",
                    crate::size::format_size(held),
                    crate::size::format_size(max)
                )
            })
            .map_err(|why| (Refusal::RegionBudget, why, None))?;
        let rated = self
            .budget
            .rate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(bytes, Instant::now());
        if let Err(wait) = rated {
            let stats = &self.budget.stats;
            stats.region_bytes.fetch_sub(bytes, Ordering::AcqRel);
            return Err((
                Refusal::RegionRate,
                format!(
                    "server busy: new regions past {}/s (--region-rate); retry in {} ms",
                    crate::size::format_size(self.budget.limits.region_rate),
                    wait.as_millis().max(1)
                ),
                Some(wait),
            ));
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
    #[error("request not complete within {0:?} (--hello-timeout / --request-timeout)")]
    TooSlow(Duration),
    /// The line is not UTF-8.
    #[error("request is not UTF-8")]
    NotText,
    /// The socket failed.
    #[error("control connection: {0}")]
    Io(#[from] std::io::Error),
}

impl LineError {
    /// The refusal it stands for (`None`: the client went away, or its socket failed).
    fn refusal(&self, before_hello: bool) -> Option<Refusal> {
        match self {
            LineError::TooLong(_) => Some(Refusal::RequestTooLong),
            LineError::TooSlow(_) if before_hello => Some(Refusal::HelloTimeout),
            LineError::TooSlow(_) => Some(Refusal::RequestTimeout),
            LineError::NotText => Some(Refusal::Malformed),
            LineError::Closed | LineError::Io(_) => None,
        }
    }
}

/// Reads one line of at most `max` bytes. The line must be complete by `deadline`, counted
/// from now when `deadline` is `Some`, else from its first byte (`within` later): a client
/// may stay silent between requests for as long as its transfers run, but no request may
/// trickle in.
fn read_line(
    r: &mut BufReader<TcpStream>,
    max: u64,
    deadline: Option<Instant>,
    within: Duration,
) -> Result<String, LineError> {
    let mut line = Vec::new();
    let mut by = deadline;
    loop {
        let left = by.map(|t| t.saturating_duration_since(Instant::now()));
        // Past the deadline, what has already arrived still counts (a loaded server may
        // start on a connection late): one last short read, then the line must be whole.
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

/// A client request.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Ask for a region.
    Hello {
        /// Protocol version.
        version: u32,
        /// The transport the client asks for (`auto`: the server picks).
        transport: String,
        /// The client's memory ("host" or "cuda"), for `auto`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        memory: Option<String>,
        /// The client's host (boot id), for `auto`: cuda-ipc needs the same host.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host_id: Option<String>,
        /// Which of the server's workers (`serve --per-gpu`: position in its --gpus) to
        /// write to; the first when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker: Option<u32>,
        /// The client's answer to the greeting's nonce, if it has the shared token: the
        /// HMAC-SHA256 of the nonce keyed by the token ([`AUTH_CONTEXT`]), in hex.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<String>,
    },
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

impl Request {
    /// The request's `op`, as it travels.
    fn op(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Verify { .. } => "verify",
            Request::Fill { .. } => "fill",
            Request::Echo { .. } => "echo",
            Request::Sink { .. } => "sink",
        }
    }
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

/// The answer to `hello`.
#[derive(Serialize, Deserialize, Debug)]
pub struct HelloReply {
    /// The transport both sides use (the server's pick when the client asked `auto`).
    pub transport: String,
    /// Where the server's region lives ("host" or "cuda").
    pub memory: String,
    /// The data address of each of its rails (text for tcp, `hex:` for binary addresses).
    pub addresses: Vec<String>,
    /// The region the client may write, one key per rail.
    pub region: RemoteDescriptor,
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

#[derive(Serialize, Deserialize, Debug)]
struct Envelope<T> {
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// For a refusal that passes (--region-rate): milliseconds after which asking again
    /// may succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    retry_ms: Option<u64>,
    #[serde(flatten)]
    body: Option<T>,
}

/// Parses `xfer://HOST:PORT` into a socket address.
pub fn parse_peer(s: &str) -> Result<SocketAddr, String> {
    let rest = s
        .strip_prefix("xfer://")
        .ok_or_else(|| format!("malformed peer address {s:?}: expected xfer://HOST:PORT"))?;
    let rest = rest.trim_end_matches('/');
    rest.to_socket_addrs()
        .map_err(|e| format!("malformed peer address {s:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("peer address {s:?} resolves to nothing"))
}

/// Serves clients until the process is stopped.
///
/// Connections wait for their hello in one event loop ([`crate::door`]); a hello that
/// passes (version, token, a free place) gets a thread of its own, which allocates the
/// client's region, preferring the memory node of `pin` (the serving worker's) when it is
/// set.
pub fn serve(
    listener: TcpListener,
    groups: Vec<ServedGroup>,
    region_size: u64,
    backend: BackendArgs,
    pin: Option<CorePin>,
    limits: ServeLimits,
    stats: Arc<ServeStats>,
) -> std::io::Result<()> {
    raise_fd_limit();
    let rate = std::sync::Mutex::new(RegionRate::new(limits.region_rate, Instant::now()));
    let door = crate::door::Door::new(
        listener,
        crate::door::DoorLimits {
            hello_timeout: Duration::from_secs(limits.hello_timeout),
            max_pending: limits.max_pending,
            max_pending_per_address: limits.max_pending_per_address,
            max_hello_bytes: usize::try_from(limits.max_request_bytes.min(MAX_HELLO))
                .unwrap_or(usize::MAX),
        },
    )?;
    let budget = Arc::new(Budget {
        limits,
        stats,
        rate,
    });
    let token = backend.auth_token.clone();
    let judged = budget.clone();
    let closed_stats = budget.stats.clone();
    let pending_stats = budget.stats.clone();
    door.run(
        greeting,
        |hello| judge(&judged, token.as_deref(), hello),
        move |a: crate::door::Admitted<(Request, ClientSlot)>| {
            let (hello, slot) = a.admitted;
            let groups = groups.clone();
            let backend = backend.clone();
            let from = Some(a.from);
            let spawned = std::thread::Builder::new()
                .name("xfer-control".into())
                .spawn(move || {
                    if let Some(p) = pin {
                        p.prefer_memory_here("xfer-control");
                    }
                    match client(a.conn, from, slot, hello, &groups, region_size, &backend) {
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
                crate::door::Closed::HelloTimeout => (
                    Refusal::HelloTimeout,
                    "no complete hello within --hello-timeout",
                ),
                crate::door::Closed::TooLong => (Refusal::RequestTooLong, "hello too long"),
                crate::door::Closed::Evicted => (
                    Refusal::Evicted,
                    "closed to make room for newer connections",
                ),
            };
            closed_stats.refuse(refusal, Some(from), reason);
        },
        move |n| pending_stats.pending.store(n, Ordering::Relaxed),
    )
}

/// The longest hello line (a hello is a few hundred bytes).
const MAX_HELLO: u64 = 64 << 10;

/// The server's first line on every connection: the protocol version and a fresh nonce
/// for the hello's authentication tag.
fn greeting(nonce: &transport_tcp::auth::Nonce) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Greeting {
        op: "challenge".into(),
        version: VERSION,
        nonce: nonce.to_hex(),
    })
    .unwrap_or_default();
    line.push(b'\n');
    line
}

/// The server's greeting (see the module docs).
#[derive(Serialize, Deserialize, Debug)]
struct Greeting {
    /// Always "challenge".
    op: String,
    /// The server's protocol version.
    version: u32,
    /// The nonce the hello's `auth` answers, in hex.
    nonce: String,
}

/// Judges a complete hello in the door: admitted with a client's place, or refused with
/// the reason (counted and logged).
fn judge(
    budget: &Arc<Budget>,
    token: Option<&str>,
    hello: crate::door::Hello<'_>,
) -> crate::door::Verdict<(Request, ClientSlot)> {
    let from = Some(hello.from);
    let refuse = |why: Refusal, reason: String, retry: Option<Duration>| {
        budget.stats.refuse(why, from, &reason);
        crate::door::Verdict::Refuse(envelope_line(&Envelope::<()>::refused(reason, retry)))
    };
    let req: Request = match std::str::from_utf8(hello.line)
        .map_err(|_| "request is not UTF-8".to_owned())
        .and_then(|l| serde_json::from_str(l).map_err(|e| format!("malformed request: {e}")))
    {
        Ok(r) => r,
        Err(e) => return refuse(Refusal::Malformed, e, None),
    };
    let Request::Hello { version, auth, .. } = &req else {
        return refuse(
            Refusal::BadRequest,
            format!(
                "{} before hello: a connection's first request is its hello",
                req.op()
            ),
            None,
        );
    };
    // Checked before anything else of the hello is used, and before any place is taken.
    if let Some(want) = token {
        let tag = auth.as_deref().and_then(|a| hex::decode(a).ok());
        let ok =
            tag.is_some_and(|t| transport_tcp::auth::verify(want, AUTH_CONTEXT, hello.nonce, &t));
        if !ok {
            return refuse(
                Refusal::Auth,
                "authentication failed: no or wrong --auth-token".into(),
                None,
            );
        }
    }
    if *version != VERSION {
        return refuse(
            Refusal::Version,
            format!("protocol version {version} not supported (server speaks {VERSION})"),
            None,
        );
    }
    match budget.admit() {
        Ok(slot) => crate::door::Verdict::Admit((req, slot)),
        Err(why) => refuse(Refusal::ServerFull, why, Some(FULL_RETRY)),
    }
}

/// Raises this process's soft limit of open files to its hard limit: every connection
/// waiting for its hello holds a descriptor, and the usual soft limit (1024) is below the
/// default `--max-pending`.
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

fn reply<T: Serialize>(w: &mut TcpStream, r: Result<T, String>) -> std::io::Result<()> {
    let env = match r {
        Ok(b) => Envelope {
            ok: true,
            error: None,
            retry_ms: None,
            body: Some(b),
        },
        Err(e) => Envelope::refused(e, None),
    };
    send_envelope(w, &env)
}

impl<T> Envelope<T> {
    /// A refusal for `reason`, saying when asking again may succeed (`retry`), if it may.
    fn refused(reason: String, retry: Option<Duration>) -> Envelope<T> {
        Envelope {
            ok: false,
            error: Some(reason),
            retry_ms: retry.map(|d| d.as_millis().max(1) as u64),
            body: None,
        }
    }
}

/// Writes one reply line.
fn send_envelope<T: Serialize>(w: &mut TcpStream, env: &Envelope<T>) -> std::io::Result<()> {
    w.write_all(&envelope_line(env))
}

/// One reply line, newline included.
fn envelope_line<T: Serialize>(env: &Envelope<T>) -> Vec<u8> {
    let mut line = serde_json::to_vec(env).unwrap_or_else(|e| {
        format!("{{\"ok\":false,\"error\":\"internal: cannot encode the reply: {e}\"}}")
            .into_bytes()
    });
    line.push(b'\n');
    line
}

/// The path for a client that asked `asked`, among the server's `offered` ones.
pub fn choose(
    asked: &str,
    client_memory: Option<&str>,
    same_host: bool,
    server_memory: MemoryKind,
    offered: &[TransportKind],
) -> Result<TransportKind, String> {
    let names = || {
        offered
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let want = TransportKind::from_name(asked).ok_or_else(|| {
        format!(
            "unknown transport {asked:?} (this server offers {})",
            names()
        )
    })?;
    let pick = match want {
        TransportKind::Auto => {
            let both_gpu = server_memory == MemoryKind::Cuda && client_memory == Some("cuda");
            let k = TransportKind::Auto.resolve(both_gpu, same_host);
            if offered.contains(&k) {
                k
            } else {
                TransportKind::Tcp
            }
        }
        k => k,
    };
    if offered.contains(&pick) {
        Ok(pick)
    } else {
        Err(format!(
            "this server offers {}, not {} (start it with --transport {})",
            names(),
            pick.name(),
            pick.name()
        ))
    }
}

/// One group of rails a server runs: its transport, and the worker (position in the
/// server's --gpus) whose memory it serves.
#[derive(Clone)]
pub struct ServedGroup {
    /// Its transport.
    pub kind: TransportKind,
    /// The worker: regions for clients of this group live on `--gpus[worker]`.
    pub worker: usize,
    /// The rails.
    pub group: Arc<RailGroup>,
}

/// Why a control connection was closed by the server.
#[derive(Debug, thiserror::Error)]
enum ClientError {
    /// A request could not be read (and was refused with the reason).
    #[error(transparent)]
    Line(#[from] LineError),
    /// The reply could not be written.
    #[error("writing the reply: {0}")]
    Reply(#[from] std::io::Error),
    /// The region could not be registered.
    #[error("registering the region: {0}")]
    Register(#[source] fabric_core::Error),
    /// The echo listener could not be opened.
    #[error("opening the echo listener: {0}")]
    Echo(#[source] std::io::Error),
}

/// Counts and logs a refusal of the client at `from`, and tells it why.
fn refuse(
    w: &mut TcpStream,
    stats: &ServeStats,
    from: Option<SocketAddr>,
    why: Refusal,
    reason: String,
) -> std::io::Result<()> {
    refuse_for(w, stats, from, why, reason, None)
}

/// [`refuse`], saying when asking again may succeed (`retry`), if it may.
fn refuse_for(
    w: &mut TcpStream,
    stats: &ServeStats,
    from: Option<SocketAddr>,
    why: Refusal,
    reason: String,
    retry: Option<Duration>,
) -> std::io::Result<()> {
    stats.refuse(why, from, &reason);
    send_envelope(w, &Envelope::<()>::refused(reason, retry))
}

/// Serves one admitted client, whose hello (`first`, authenticated and of this version
/// already) was read by the door; then its further requests, each line due within
/// --request-timeout of its first byte.
fn client(
    conn: TcpStream,
    from: Option<SocketAddr>,
    mut slot_budget: ClientSlot,
    first: Request,
    groups: &[ServedGroup],
    region_size: u64,
    backend: &BackendArgs,
) -> Result<(), ClientError> {
    let limits = slot_budget.budget.limits.clone();
    let stats = slot_budget.budget.stats.clone();
    let stats = &*stats;
    let workers = groups.iter().map(|g| g.worker + 1).max().unwrap_or(1);
    let mut chosen: Option<(TransportKind, usize, &RailGroup)> = None;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let mut region: Option<(Arc<dyn MemoryRegion>, GroupRegistration)> = None;
    let mut first = Some(first);
    let result = (|| loop {
        let req = match first.take() {
            Some(hello) => hello,
            None => {
                let within = Duration::from_secs(limits.request_timeout);
                let line = match read_line(&mut r, limits.max_request_bytes, None, within) {
                    Ok(l) => l,
                    Err(LineError::Closed) => return Ok(()),
                    Err(e) => {
                        match e.refusal(false) {
                            Some(why) => {
                                let _ = refuse(&mut w, stats, from, why, e.to_string());
                            }
                            None => {
                                let _ = reply::<()>(&mut w, Err(e.to_string()));
                            }
                        }
                        return Err(e.into());
                    }
                };
                match serde_json::from_str(&line) {
                    Ok(r) => r,
                    Err(e) => {
                        refuse(
                            &mut w,
                            stats,
                            from,
                            Refusal::Malformed,
                            format!("malformed request: {e}"),
                        )?;
                        return Ok(());
                    }
                }
            }
        };
        match req {
            // Version and token were checked by the door, before the place was taken.
            Request::Hello {
                transport,
                memory,
                host_id,
                worker,
                ..
            } => {
                let slot = worker.unwrap_or(0) as usize;
                if slot >= workers {
                    refuse(
                        &mut w,
                        stats,
                        from,
                        Refusal::BadRequest,
                        format!(
                            "this server runs {workers} worker(s); worker {slot} does not exist \
                             (start it with --per-gpu and more --gpus)"
                        ),
                    )?;
                    return Ok(());
                }
                let offered: Vec<TransportKind> = groups
                    .iter()
                    .filter(|g| g.worker == slot)
                    .map(|g| g.kind)
                    .collect();
                let same_host = host_id.is_some()
                    && host_id.as_deref() == transport_cuda_ipc::boot_id().ok().as_deref();
                let kind = match choose(
                    &transport,
                    memory.as_deref(),
                    same_host,
                    backend.memory,
                    &offered,
                ) {
                    Ok(k) => k,
                    Err(e) => {
                        refuse(&mut w, stats, from, Refusal::BadRequest, e)?;
                        return Ok(());
                    }
                };
                if chosen.is_some_and(|(k, s, _)| k != kind || s != slot) {
                    refuse(
                        &mut w,
                        stats,
                        from,
                        Refusal::BadRequest,
                        "a second hello asked for another path".into(),
                    )?;
                    return Ok(());
                }
                let Some(served) = groups.iter().find(|g| g.kind == kind && g.worker == slot)
                else {
                    reply::<()>(&mut w, Err("internal: chosen path not served".into()))?;
                    return Ok(());
                };
                let group = &*served.group;
                chosen = Some((kind, slot, group));
                if region.is_none() {
                    if let Err((refusal, why, retry)) = slot_budget.reserve(region_size) {
                        refuse_for(&mut w, stats, from, refusal, why, retry)?;
                        return Ok(());
                    }
                    let buf = match backend.alloc(region_size, slot) {
                        Ok(b) => b,
                        Err(e) => {
                            refuse(
                                &mut w,
                                stats,
                                from,
                                Refusal::NoMemory,
                                format!("cannot allocate the region: {e}"),
                            )?;
                            return Ok(());
                        }
                    };
                    // Clients write it (`bench`) or read it back (`bench --op read`).
                    let reg = group
                        .register(buf.clone(), Access::REMOTE_WRITE | Access::REMOTE_READ)
                        .map_err(ClientError::Register)?;
                    region = Some((buf, reg));
                }
                let reg = &region.as_ref().expect("just set").1;
                let addresses = group
                    .addresses()
                    .iter()
                    .map(|a| crate::address_to_text(a))
                    .collect();
                reply(
                    &mut w,
                    Ok(HelloReply {
                        transport: kind.name().into(),
                        memory: backend.memory.name().into(),
                        addresses,
                        region: reg.remote.clone(),
                    }),
                )?;
            }
            Request::Verify {
                seed,
                page_size,
                pages,
            } => {
                let Some((buf, _)) = &region else {
                    refuse(
                        &mut w,
                        stats,
                        from,
                        Refusal::BadRequest,
                        "verify before hello".into(),
                    )?;
                    continue;
                };
                if page_size == 0
                    || !page_size.is_multiple_of(8)
                    || pages
                        .iter()
                        .any(|p| p.saturating_add(1).saturating_mul(page_size) > region_size)
                {
                    reply::<()>(&mut w, Err("verify: page outside the region".into()))?;
                    continue;
                }
                let r2 = workload::verify_pages(&**buf, page_size, seed, &pages)
                    .map(|(mismatches, first_mismatch)| VerifyReply {
                        checked: pages.len() as u64,
                        mismatches,
                        first_mismatch,
                    })
                    .map_err(|e| e.to_string());
                reply(&mut w, r2)?;
            }
            Request::Fill { seed } => {
                let Some((buf, _)) = &region else {
                    refuse(
                        &mut w,
                        stats,
                        from,
                        Refusal::BadRequest,
                        "fill before hello".into(),
                    )?;
                    continue;
                };
                let r2 = workload::fill_pattern(&**buf, seed)
                    .map(|()| FillReply {
                        bytes: buf.len() as u64,
                    })
                    .map_err(|e| e.to_string());
                reply(&mut w, r2)?;
            }
            Request::Echo { page_size, pages } => {
                if region.is_none() {
                    refuse(
                        &mut w,
                        stats,
                        from,
                        Refusal::BadRequest,
                        "echo before hello".into(),
                    )?;
                    continue;
                }
                // No bigger than the region this client already holds.
                let per = match crate::latency::round_bytes(page_size, pages) {
                    Ok(b) if b as u64 <= region_size => b,
                    _ => {
                        reply::<()>(
                            &mut w,
                            Err(format!(
                                "echo: {pages} pages of {page_size} bytes do not fit the \
                                 {region_size}-byte region"
                            )),
                        )?;
                        continue;
                    }
                };
                let ip = w.local_addr()?.ip();
                let listener = TcpListener::bind((ip, 0)).map_err(ClientError::Echo)?;
                let address = listener.local_addr()?.to_string();
                reply(&mut w, Ok(EchoReply { address }))?;
                echo(
                    &listener,
                    per,
                    Duration::from_secs(limits.hello_timeout),
                    Duration::from_secs(limits.request_timeout),
                    backend.auth_token.as_deref(),
                );
            }
            Request::Sink { streams } => {
                let Some((_, _, group)) = chosen else {
                    refuse(
                        &mut w,
                        stats,
                        from,
                        Refusal::BadRequest,
                        "sink before hello".into(),
                    )?;
                    continue;
                };
                let max = crate::sink::MAX_STREAMS;
                if streams == 0 || streams > max {
                    reply::<()>(
                        &mut w,
                        Err(format!("sink: {streams} streams (from 1 to {max})")),
                    )?;
                    continue;
                }
                let opened = crate::sink::listen(&group.addresses(), w.local_addr()?.ip())
                    .and_then(|ls| {
                        let at = ls
                            .iter()
                            .map(|l| l.local_addr().map(|a| a.to_string()))
                            .collect::<std::io::Result<Vec<_>>>()?;
                        Ok((ls, at))
                    });
                let (listeners, addresses) = match opened {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!(error = %e, "sink: cannot listen");
                        reply::<()>(&mut w, Err(format!("sink: cannot listen: {e}")))?;
                        continue;
                    }
                };
                reply(&mut w, Ok(SinkReply { addresses }))?;
                let sink_limits = crate::sink::SinkLimits {
                    accept_within: Duration::from_secs(limits.hello_timeout),
                    stall: Duration::from_secs(limits.request_timeout),
                    total: crate::sink::MAX_DURATION,
                    max_bytes: crate::sink::MAX_BYTES,
                };
                match crate::sink::drain(
                    &listeners,
                    streams as usize,
                    sink_limits,
                    backend.auth_token.as_deref(),
                ) {
                    Ok(bytes) => tracing::info!(streams, bytes, "sink ended"),
                    Err(e) => tracing::warn!(error = %e, "sink ended"),
                }
            }
        }
    })();
    if let (Some((_, reg)), Some((_, _, group))) = (region, chosen)
        && let Err(e) = group.deregister(&reg)
    {
        tracing::warn!(error = %e, "deregister failed");
    }
    // The client's place and bytes are free again before its connection closes, so a
    // client that sees the close may connect again at once.
    drop(slot_budget);
    if matches!(result, Err(ClientError::Line(_))) {
        discard_rest(&mut r);
    }
    result
}

/// Answers one client's raw ping-pong (see the module's `echo`): accepts one connection
/// on `listener` within `accept_within`, checks its answer to a nonce against `token`
/// ([`crate::raw_auth`]), then answers rounds of `per` bytes until the client closes it, a
/// round taking at most `round_within`. Failures end the echo only.
fn echo(
    listener: &TcpListener,
    per: usize,
    accept_within: Duration,
    round_within: Duration,
    token: Option<&str>,
) {
    let conn = match crate::sink::accept_any(
        std::slice::from_ref(listener),
        Instant::now() + accept_within,
    ) {
        Ok(Some(c)) => c,
        Ok(None) => {
            tracing::warn!(?accept_within, "echo: nobody connected in time");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "echo: accept failed");
            return;
        }
    };
    let answered =
        crate::raw_auth::challenge(&conn, token, crate::raw_auth::ECHO_CONTEXT, round_within)
            .and_then(|()| conn.set_read_timeout(Some(round_within)))
            .and_then(|_| conn.set_write_timeout(Some(round_within)))
            .and_then(|_| crate::latency::echo_rounds(conn, per));
    match answered {
        Ok(rounds) => tracing::info!(rounds, "echo ended"),
        Err(e) => tracing::warn!(error = %e, "echo ended"),
    }
}

/// A client of the control channel.
pub struct ControlClient {
    w: TcpStream,
    r: BufReader<TcpStream>,
    /// The nonce the server greeted this connection with.
    nonce: transport_tcp::auth::Nonce,
    /// The shared token the hello answered the nonce with, for the raw streams beside.
    token: Option<String>,
    /// When the last refusal said asking again may succeed: after this long.
    retry: Option<Duration>,
}

/// The longest a client waits between two tries of a hello the server asked it to repeat
/// (a full server, or new regions past its rate).
const MAX_BACKOFF: Duration = Duration::from_secs(2);

impl ControlClient {
    /// Connects with a timeout and reads the server's greeting.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<ControlClient, String> {
        let s = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| format!("cannot reach peer {addr}: {e}"))?;
        s.set_read_timeout(Some(GREETING_WITHIN))
            .map_err(|e| e.to_string())?;
        let mut r = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
        let mut line = String::new();
        let n = (&mut r).take(MAX_HELLO).read_line(&mut line).map_err(|e| {
            format!(
                "no greeting from {addr} within {GREETING_WITHIN:?} ({e}): not an xfer \
                     serve of protocol {VERSION}?"
            )
        })?;
        if n == 0 {
            return Err(format!(
                "{addr} closed the control connection before its greeting"
            ));
        }
        let nonce = match serde_json::from_str::<Greeting>(&line) {
            Ok(g) if g.op == "challenge" && g.version == VERSION => {
                transport_tcp::auth::Nonce::from_hex(&g.nonce)
                    .map_err(|e| format!("malformed greeting from {addr}: {e}"))?
            }
            Ok(g) => {
                return Err(format!(
                    "{addr} speaks protocol version {} (this xfer speaks {VERSION}): use the \
                     same xfer on both ends",
                    g.version
                ));
            }
            Err(_) => {
                // A refusal before any greeting, or something else entirely.
                let why = serde_json::from_str::<Envelope<()>>(&line)
                    .ok()
                    .and_then(|e| e.error)
                    .unwrap_or_else(|| format!("unexpected first line {:?}", line.trim_end()));
                return Err(format!("peer refused: {why}"));
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .map_err(|e| e.to_string())?;
        Ok(ControlClient {
            w: s,
            r,
            nonce,
            token: None,
            retry: None,
        })
    }

    /// Connects and asks for a region like [`ControlClient::hello`], asking again on a new
    /// connection while the server refuses with a time to retry after (a full server,
    /// new regions past its --region-rate) and the next try falls within `within` of the
    /// first. Tries back off: each waits at least what the server asked for and grows by
    /// half each time (at most [`MAX_BACKOFF`]), with a random quarter more, so that
    /// clients turned away together do not come back together.
    pub fn connect_hello(
        addr: SocketAddr,
        timeout: Duration,
        within: Duration,
        hello: (&str, &str, Option<u32>, Option<&str>),
    ) -> Result<(ControlClient, HelloReply), String> {
        let (transport, memory, worker, token) = hello;
        let until = Instant::now() + within;
        let mut backoff = Duration::ZERO;
        loop {
            let mut c = ControlClient::connect(addr, timeout)?;
            match c.hello(transport, memory, worker, token) {
                Ok(h) => return Ok((c, h)),
                Err(e) => match c.retry {
                    Some(asked) => {
                        backoff = asked.max(backoff.mul_f64(1.5)).min(MAX_BACKOFF);
                        let after = backoff.mul_f64(1.0 + fastrand::f64() / 4.0);
                        if Instant::now() + after >= until {
                            return Err(e);
                        }
                        tracing::info!(%e, ?after, "asking again");
                        // A back-off the server asked for, not a synchronisation.
                        std::thread::sleep(after);
                    }
                    None => return Err(e),
                },
            }
        }
    }

    fn call<T: for<'de> Deserialize<'de>>(&mut self, req: &Request) -> Result<T, String> {
        let mut line = serde_json::to_vec(req).map_err(|e| e.to_string())?;
        line.push(b'\n');
        self.w
            .write_all(&line)
            .map_err(|e| format!("peer closed the control connection: {e}"))?;
        let mut resp = String::new();
        let n = (&mut self.r)
            .take(MAX_LINE)
            .read_line(&mut resp)
            .map_err(|e| format!("control connection: {e}"))?;
        if n == 0 {
            return Err("peer closed the control connection".into());
        }
        let env: Envelope<T> =
            serde_json::from_str(&resp).map_err(|e| format!("malformed reply from peer: {e}"))?;
        self.retry = env.retry_ms.map(Duration::from_millis);
        match (env.ok, env.body) {
            (true, Some(b)) => Ok(b),
            _ => Err(format!(
                "peer refused: {}",
                env.error.unwrap_or_else(|| "no reason given".into())
            )),
        }
    }

    /// Asks for a region.
    pub fn hello(
        &mut self,
        transport: &str,
        memory: &str,
        worker: Option<u32>,
        token: Option<&str>,
    ) -> Result<HelloReply, String> {
        self.token = token.map(str::to_owned);
        self.call(&Request::Hello {
            version: VERSION,
            transport: transport.into(),
            memory: Some(memory.into()),
            host_id: transport_cuda_ipc::boot_id().ok(),
            worker,
            auth: token
                .map(|t| hex::encode(transport_tcp::auth::tag(t, AUTH_CONTEXT, &self.nonce))),
        })
    }

    /// The shared token this client said hello with: raw streams to the server answer its
    /// nonces with it ([`crate::raw_auth::answer`]).
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Asks the server to open a raw TCP echo for rounds of `pages` pages of `page_size`;
    /// returns where to connect (an unspecified IP replaced by the control connection's).
    pub fn echo(&mut self, page_size: u64, pages: u64) -> Result<SocketAddr, String> {
        let r: EchoReply = self.call(&Request::Echo { page_size, pages })?;
        let mut at: SocketAddr = r
            .address
            .parse()
            .map_err(|e| format!("malformed echo address {:?} from peer: {e}", r.address))?;
        if at.ip().is_unspecified() {
            at.set_ip(self.w.peer_addr().map_err(|e| e.to_string())?.ip());
        }
        Ok(at)
    }

    /// Asks the server to open its end of `bench --baseline` for `streams` raw streams;
    /// returns its listeners (an unspecified IP replaced by the control connection's), one
    /// per distinct IP of its rails, in the order of their first rail.
    pub fn sink(&mut self, streams: u32) -> Result<Vec<SocketAddr>, String> {
        let r: SinkReply = self.call(&Request::Sink { streams })?;
        let peer = self.w.peer_addr().map_err(|e| e.to_string())?.ip();
        r.addresses
            .iter()
            .map(|a| {
                let mut at: SocketAddr = a
                    .parse()
                    .map_err(|e| format!("malformed sink address {a:?} from peer: {e}"))?;
                if at.ip().is_unspecified() {
                    at.set_ip(peer);
                }
                Ok(at)
            })
            .collect()
    }

    /// Asks the server to fill this client's region with the pattern of `seed`.
    pub fn fill(&mut self, seed: u64) -> Result<FillReply, String> {
        self.call(&Request::Fill { seed })
    }

    /// Asks the server to check written pages.
    pub fn verify(
        &mut self,
        seed: u64,
        page_size: u64,
        pages: Vec<u64>,
    ) -> Result<VerifyReply, String> {
        self.call(&Request::Verify {
            seed,
            page_size,
            pages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: [TransportKind; 2] = [TransportKind::Tcp, TransportKind::CudaIpc];

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
        // Refills stop at a full bucket.
        r.take(100, ms(60_000)).expect("a full bucket again");
        assert!(r.take(1, ms(60_000)).is_err());
    }

    #[test]
    fn a_region_larger_than_the_bucket_waits_for_a_full_one_and_leaves_debt() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut r = RegionRate::new(100, t0);
        r.take(300, t0)
            .expect("a full bucket takes one large region");
        // A bucket of 25: 300 taken leaves 275 of debt, repaid in 2.75 s, then 0.25 s to
        // fill for the next.
        assert!(r.take(300, ms(2_900)).is_err());
        r.take(300, ms(3_100)).expect("full again after 3 s");
        assert!(
            RegionRate::new(0, t0).take(u64::MAX, t0).is_ok(),
            "0: no rate"
        );
    }

    #[test]
    fn auto_picks_cuda_ipc_only_for_gpu_memory_on_one_host_with_cuda() {
        let cuda = gpu_mem::driver_present();
        let k = choose("auto", Some("cuda"), true, MemoryKind::Cuda, &BOTH).unwrap();
        let want = if cuda {
            TransportKind::CudaIpc
        } else {
            TransportKind::Tcp
        };
        assert_eq!(k, want);
        for (mem, same, server) in [
            (Some("host"), true, MemoryKind::Cuda),
            (Some("cuda"), false, MemoryKind::Cuda),
            (Some("cuda"), true, MemoryKind::Host),
            (None, true, MemoryKind::Cuda),
        ] {
            assert_eq!(
                choose("auto", mem, same, server, &BOTH).unwrap(),
                TransportKind::Tcp,
                "{mem:?} {same} {server:?}"
            );
        }
        // A server that offers only tcp answers auto with tcp, whatever the client holds.
        assert_eq!(
            choose(
                "auto",
                Some("cuda"),
                true,
                MemoryKind::Cuda,
                &[TransportKind::Tcp]
            )
            .unwrap(),
            TransportKind::Tcp
        );
    }

    #[test]
    fn explicit_paths_must_be_offered_and_unknown_names_are_refused() {
        assert_eq!(
            choose("cuda-ipc", None, false, MemoryKind::Cuda, &BOTH).unwrap(),
            TransportKind::CudaIpc
        );
        let e = choose("efa", None, true, MemoryKind::Host, &BOTH).unwrap_err();
        assert!(e.contains("offers tcp, cuda-ipc, not efa"), "{e}");
        let e = choose("carrier-pigeon", None, true, MemoryKind::Host, &BOTH).unwrap_err();
        assert!(e.contains("unknown transport"), "{e}");
    }
}
