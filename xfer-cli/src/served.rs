//! What `xfer serve` does for each client, plugged into the library's rendezvous server
//! ([`xfer::rendezvous::serve`]) as its [`Service`]: at the hello, a region of
//! `--region-size` of its own (reserved against the server's limits, allocated where the
//! worker's memory lives, registered for the client to write or read), handed out under the
//! name [`REGION`]; then the bench's requests ([`crate::control`]); at goodbye, the region
//! deregistered.

use crate::backend::alloc;
use crate::control::{EchoReply, FillReply, REGION, Request, SinkReply, VerifyReply};
use fabric_core::MemoryRegion;
use fabric_core::error::report;
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};
use xfer::layers::raw_auth;
use xfer::rendezvous::{Given, Refusal, Refused, ServeLimits, Service, ServiceClient, Verdict};
use xfer::{Access, Agent, Region};

/// How much `xfer serve` gives its clients, and how long it waits for them: the flags of
/// the library's [`xfer::rendezvous::ServeLimits`].
#[derive(clap::Args, Clone, Debug)]
pub struct ServeLimitsArgs {
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

impl ServeLimitsArgs {
    /// The library's limits.
    pub fn limits(&self) -> ServeLimits {
        ServeLimits {
            max_clients: self.max_clients,
            max_region_bytes: self.max_region_bytes,
            region_rate: self.region_rate,
            hello_timeout: Duration::from_secs(self.hello_timeout),
            max_pending: self.max_pending,
            max_pending_per_address: self.max_pending_per_address,
            request_timeout: Duration::from_secs(self.request_timeout),
            max_request_bytes: self.max_request_bytes,
        }
    }
}

/// `serve`'s part of the server: every client gets a region of `region_size` bytes.
pub struct Served {
    /// Bytes of each client's region.
    pub region_size: u64,
}

/// What a client holds: its region (the memory, and its registration with the agent).
pub struct ClientRegion {
    mem: Arc<dyn MemoryRegion>,
    region: Region,
}

impl Service for Served {
    type Client = ClientRegion;

    fn hello(
        &self,
        c: &mut ServiceClient<'_>,
        agent: &Agent,
    ) -> Result<Given<ClientRegion>, Refused> {
        c.slot().reserve(self.region_size)?;
        // This thread prefers the worker's memory node (the library set it): host memory
        // lands there; GPU memory goes to the worker's GPU.
        let mem = alloc(agent.info().memory, self.region_size).map_err(|e| {
            Refused::new(
                Refusal::NoMemory,
                format!("cannot allocate the region: {}", report(&e)),
            )
        })?;
        // Clients write it (`bench`) or read it back (`bench --op read`).
        let region = agent
            .register(mem.clone(), Access::REMOTE_WRITE | Access::REMOTE_READ)
            .map_err(|e| {
                Refused::new(
                    Refusal::NoMemory,
                    format!("cannot register the region: {}", report(&e)),
                )
            })?;
        let given = BTreeMap::from([(REGION.to_owned(), region.descriptor().clone())]);
        Ok((ClientRegion { mem, region }, given))
    }

    fn request(
        &self,
        c: &mut ServiceClient<'_>,
        agent: &Agent,
        held: &mut ClientRegion,
        op: &str,
        mut req: serde_json::Value,
    ) -> Verdict {
        req["op"] = op.into();
        let req: Request = match serde_json::from_value(req) {
            Ok(r) => r,
            Err(e) => {
                return Verdict::Refuse(Refused::new(
                    Refusal::Malformed,
                    format!("malformed request {op:?}: {e}"),
                ));
            }
        };
        let region_size = held.mem.len() as u64;
        let answered = match req {
            Request::Verify {
                seed,
                page_size,
                pages,
            } => {
                if page_size == 0
                    || !page_size.is_multiple_of(8)
                    || pages
                        .iter()
                        .any(|p| p.saturating_add(1).saturating_mul(page_size) > region_size)
                {
                    c.fail("verify: page outside the region".into())
                } else {
                    let checked = pages.len() as u64;
                    answer(
                        c,
                        crate::workload::verify_pages(&*held.mem, page_size, seed, &pages).map(
                            |(mismatches, first_mismatch)| VerifyReply {
                                checked,
                                mismatches,
                                first_mismatch,
                            },
                        ),
                    )
                }
            }
            Request::Fill { seed } => answer(
                c,
                crate::workload::fill_pattern(&*held.mem, seed)
                    .map(|()| FillReply { bytes: region_size }),
            ),
            Request::Echo { page_size, pages } => echo(c, page_size, pages, region_size),
            Request::Sink { streams } => sink(c, agent, streams),
        };
        if let Err(e) = answered {
            // The connection is gone: the next read ends it.
            tracing::warn!(error = %e, op, "cannot answer the request");
        }
        Verdict::Continue
    }

    fn goodbye(&self, agent: &Agent, held: ClientRegion) {
        if let Err(e) = agent.deregister(&held.region) {
            tracing::warn!(error = %report(&e), "deregister failed");
        }
    }
}

/// Answers with `body`, or with the failure that does not end the connection.
fn answer<T: Serialize>(
    c: &mut ServiceClient<'_>,
    r: Result<T, impl std::error::Error + 'static>,
) -> std::io::Result<()> {
    match r {
        Ok(body) => c.reply(body),
        Err(e) => c.fail(report(&e)),
    }
}

/// `echo`: a raw TCP listener beside the control connection, for rounds no bigger than the
/// client's region (see [`crate::control`]).
fn echo(
    c: &mut ServiceClient<'_>,
    page_size: u64,
    pages: u64,
    region_size: u64,
) -> std::io::Result<()> {
    let per = match crate::latency::round_bytes(page_size, pages) {
        Ok(b) if b as u64 <= region_size => b,
        _ => {
            return c.fail(format!(
                "echo: {pages} pages of {page_size} bytes do not fit the {region_size}-byte \
                 region"
            ));
        }
    };
    let listener = match TcpListener::bind((c.local_ip()?, 0)) {
        Ok(l) => l,
        Err(e) => return c.fail(format!("echo: cannot listen: {e}")),
    };
    let address = listener.local_addr()?.to_string();
    c.reply(EchoReply { address })?;
    let limits = c.limits().clone();
    echo_rounds(
        &listener,
        per,
        limits.hello_timeout,
        limits.request_timeout,
        c.token(),
    );
    Ok(())
}

/// Answers one client's raw ping-pong: accepts one connection on `listener` within
/// `accept_within`, checks its answer to a nonce against `token` ([`raw_auth`]), then
/// answers rounds of `per` bytes until the client closes it, a round taking at most
/// `round_within`. Failures end the echo only.
fn echo_rounds(
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
    let answered = raw_auth::challenge(&conn, token, raw_auth::ECHO_CONTEXT, round_within)
        .and_then(|()| conn.set_read_timeout(Some(round_within)))
        .and_then(|_| conn.set_write_timeout(Some(round_within)))
        .and_then(|_| crate::latency::echo_rounds(conn, per));
    match answered {
        Ok(rounds) => tracing::info!(rounds, "echo ended"),
        Err(e) => tracing::warn!(error = %e, "echo ended"),
    }
}

/// `sink`: the server's end of `bench --baseline`, a listener per distinct IP of the rails
/// of the transport this client uses (see [`crate::sink`]).
fn sink(c: &mut ServiceClient<'_>, agent: &Agent, streams: u32) -> std::io::Result<()> {
    let max = crate::sink::MAX_STREAMS;
    if streams == 0 || streams > max {
        return c.fail(format!("sink: {streams} streams (from 1 to {max})"));
    }
    let rails = agent
        .info()
        .transport(c.transport())
        .map(|t| t.rails.clone())
        .unwrap_or_default();
    let opened = crate::sink::listen(&rails, c.local_ip()?).and_then(|ls| {
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
            return c.fail(format!("sink: cannot listen: {e}"));
        }
    };
    c.reply(SinkReply { addresses })?;
    let limits = c.limits();
    let sink_limits = crate::sink::SinkLimits {
        accept_within: limits.hello_timeout,
        stall: limits.request_timeout,
        total: crate::sink::MAX_DURATION,
        max_bytes: crate::sink::MAX_BYTES,
    };
    match crate::sink::drain(&listeners, streams as usize, sink_limits, c.token()) {
        Ok(bytes) => tracing::info!(streams, bytes, "sink ended"),
        Err(e) => tracing::warn!(error = %e, "sink ended"),
    }
    Ok(())
}
