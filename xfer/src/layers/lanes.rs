//! A lane: one transport of an agent, as a rail group of that backend, its rails on NICs and
//! its workers pinned. The one place where backends are built from options.

use crate::error::{Error, OptionName, Result};
use crate::nics::{self, NicChoice, RailNic};
use crate::options::{AgentOptions, AuthTokenError, MAX_RAILS, MemoryKind, Role, TransportChoice};
use crate::placement::{self, CorePin};
use fabric_core::engine::{EngineConfig, RailGroup};
use fabric_core::mem::MemTransport;
use fabric_core::metadata::TransportKind;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport};
use transport_efa::{EfaConfig, EfaTransport};
use transport_tcp::{TcpConfig, TcpTransport};

/// One transport of an agent.
pub struct Lane {
    /// Which transport.
    pub kind: TransportKind,
    /// Its rails.
    pub group: Arc<RailGroup>,
    /// The NICs its rails run on, and why.
    pub nics: NicChoice,
}

/// Checks a rail count against 1 and [`MAX_RAILS`].
pub fn check_rails(rails: usize) -> Result<()> {
    match rails {
        0 => Err(Error::option(OptionName::Rails, "must be at least 1")),
        n if n > MAX_RAILS => Err(Error::option(
            OptionName::Rails,
            format!(
                "{n} is above the limit of {MAX_RAILS} (each rail is a worker thread with its \
                 own connection or NIC)"
            ),
        )),
        _ => Ok(()),
    }
}

/// The CUDA driver, or why there is none.
pub fn cuda() -> Result<gpu_mem::Cuda> {
    gpu_mem::Cuda::probe()?.ok_or_else(|| Error::Unavailable {
        kind: TransportKind::CudaIpc,
        source: "no CUDA driver on this machine (libcuda.so.1 not found): use host memory".into(),
    })
}

/// Fails at once when `kind` cannot run here at all (efa without a loadable libfabric: the
/// error names where it was looked for and how to install it).
pub fn check_available(kind: TransportKind) -> Result<()> {
    if kind == TransportKind::Efa {
        transport_efa::library().map_err(|e| Error::Unavailable {
            kind,
            source: Box::new(e),
        })?;
    }
    Ok(())
}

/// The engine settings of `o`'s workers, named `name`.
pub fn engine_config(o: &AgentOptions, name: &str) -> EngineConfig {
    let d = EngineConfig::default();
    EngineConfig {
        name: name.into(),
        busy_poll: o.workers.busy_poll,
        wait_spin: o.workers.wait_spin.unwrap_or(d.wait_spin),
        linger: o.workers.linger.unwrap_or(d.linger),
        control_timeout: o.workers.control_timeout.unwrap_or(d.control_timeout),
        notification_keys: o.workers.notification_keys.unwrap_or(d.notification_keys),
        messages: o
            .workers
            .messages
            .unwrap_or(crate::options::DEFAULT_MESSAGES),
        ..d
    }
}

/// Starts `rails` rails of `kind` for `o`, named `name`; `nics` (empty: unbound) holds each
/// rail's NIC (a tcp rail listens on its address and binds to it, an efa rail opens it as
/// its domain), `pins` each rail's core; `instance` is the agent's incarnation, which tcp
/// rails announce to the peers that connect to them.
pub fn spawn(
    kind: TransportKind,
    o: &AgentOptions,
    rails: usize,
    nics: &[RailNic],
    pins: Vec<Option<CorePin>>,
    name: &str,
    instance: u64,
) -> Result<RailGroup> {
    check_rails(rails)?;
    if kind == TransportKind::Tcp
        && let Some(p) = o.tcp.port
        && usize::from(p) + rails > usize::from(u16::MAX) + 1
    {
        return Err(Error::option(
            OptionName::Port,
            format!("{rails} rails from port {p} go past port 65535"),
        ));
    }
    if !nics.is_empty() && nics.len() != rails {
        return Err(Error::option(
            OptionName::Nics,
            format!("{} NICs for {rails} rails", nics.len()),
        ));
    }
    // Asked for another transport only, a token or checksums would silently do nothing.
    // A token guards the tcp and cuda-ipc lanes (both ends of every tcp connection and
    // every cuda-ipc control connection prove it); with `auto` the efa lane goes without
    // (its data path has no per-connection check), as it would have been chosen without
    // it. Checksums are tcp's only.
    if let TransportChoice::Only(only) = o.transport
        && only != TransportKind::Tcp
    {
        if o.auth_token.is_some() && only != TransportKind::CudaIpc {
            return Err(Error::option(
                OptionName::AuthToken,
                format!("applies to the tcp and cuda-ipc transports only, not {only}"),
            ));
        }
        if o.tcp.checksum {
            return Err(Error::option(
                OptionName::Checksum,
                format!("applies to the tcp transport only, not {only}"),
            ));
        }
    }
    let names: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();
    let nics: Arc<Vec<RailNic>> = Arc::new(nics.to_vec());
    let pins = Arc::new(pins);
    let cfg = engine_config(o, name);
    let worker = name.to_string();
    let pin = move |i: usize| {
        placement::pin_worker(pins.get(i).copied().flatten(), &format!("{worker}-{i}"));
    };
    let g = match kind {
        TransportKind::Tcp => {
            let (token, checksum, copy_nap) =
                (o.auth_token.clone(), o.tcp.checksum, o.tcp.copy_nap);
            let congestion = o.tcp.congestion.clone();
            let timeout = o.workers.control_timeout;
            let liveness = o.workers.liveness_timeout;
            let first_port = o.tcp.port;
            let port_of = move |i: usize| {
                first_port.map_or(0, |p| {
                    p.saturating_add(u16::try_from(i).unwrap_or(u16::MAX))
                })
            };
            let ip = o.listen;
            let make = move |i: usize| {
                pin(i);
                let nic = nics.get(i);
                let d = TcpConfig::default();
                TcpTransport::new(TcpConfig {
                    listen: SocketAddr::new(nic.and_then(|n| n.ip).unwrap_or(ip), port_of(i)),
                    interface: nic.map(|n| n.name.clone()),
                    auth_token: token.clone(),
                    copy_nap,
                    checksum,
                    congestion: congestion.clone(),
                    peer_timeout: timeout.unwrap_or(d.peer_timeout),
                    liveness_timeout: liveness.unwrap_or(d.liveness_timeout),
                    announce: Some(instance),
                    ..d
                })
            };
            spawn_on(rails, names, make, cfg)
        }
        TransportKind::CudaIpc => {
            if o.memory != MemoryKind::Cuda {
                return Err(Error::option(
                    OptionName::Transport,
                    "cuda-ipc moves GPU memory: use cuda memory (or the tcp transport)",
                ));
            }
            let cuda = cuda()?;
            let (device, copy_method) = (o.gpu, o.cuda_ipc.copy_method);
            // The agent's token: both ends of every control connection prove it.
            let token = o.auth_token.clone();
            RailGroup::spawn(
                rails,
                move |i| {
                    pin(i);
                    CudaIpcTransport::new(
                        &cuda,
                        CudaIpcConfig {
                            device,
                            copy_method,
                            auth_token: token.clone(),
                            ..CudaIpcConfig::default()
                        },
                    )
                },
                cfg,
            )
        }
        TransportKind::Mem => RailGroup::spawn(
            rails,
            move |i| {
                pin(i);
                Ok(MemTransport::new())
            },
            cfg,
        ),
        TransportKind::Efa => {
            check_available(kind)?;
            let mut ec = match &o.efa.provider {
                Some(p) => EfaConfig::with_provider(p.clone()),
                None => EfaConfig::default(),
            };
            ec = ec
                .hmem(o.memory == MemoryKind::Cuda)
                .hmem_device_only(o.efa.device_only);
            if let Some(nap) = o.efa.idle_nap {
                ec = ec.idle_nap(nap);
            }
            if let Some(ops) = o.efa.gather {
                ec = ec.max_gather(ops);
            }
            let make = move |i: usize| {
                pin(i);
                match nics.get(i) {
                    Some(n) => EfaTransport::new(&ec.clone().domain(n.name.clone())),
                    None => EfaTransport::new(&ec),
                }
            };
            spawn_on(rails, names, make, cfg)
        }
    };
    let g = g?;
    let mut b = g.balance();
    if let Some(h) = o.balance.horizon {
        b.horizon = h;
    }
    if let Some(l) = o.balance.lead {
        b.lead = l;
    }
    if let Some(n) = o.balance.chunks_per_rail {
        b.chunks_per_rail = n.max(1);
    }
    if let Some(m) = o.balance.max_chunk {
        b.max_chunk = m.max(1);
    }
    if let Some(n) = o.balance.in_flight {
        b.in_flight = n.max(1);
    }
    g.set_balance(b);
    Ok(g)
}

/// `rails` rails made by `make`: on the NICs `names` (one per rail) when there are any,
/// else unnamed.
fn spawn_on<T, F>(
    rails: usize,
    names: Vec<String>,
    make: F,
    cfg: EngineConfig,
) -> std::result::Result<RailGroup, fabric_core::Error>
where
    T: fabric_core::Transport,
    F: Fn(usize) -> fabric_core::Result<T> + Send + Sync + 'static,
{
    if names.is_empty() {
        RailGroup::spawn(rails, make, cfg)
    } else {
        RailGroup::spawn_on(names, move |i, _| make(i), cfg)
    }
}

/// The address NIC choice looks toward: the peers' (`toward`), else where the agent listens.
pub fn toward(o: &AgentOptions) -> IpAddr {
    o.toward.unwrap_or(o.listen)
}

/// The NICs an agent of `o` runs its `kind` rails on, and why: `o.nics` for tcp and efa
/// (toward [`toward`], as a server for [`Role::Target`]), none for the transports that run
/// on no NIC. [`Agent::new`](crate::Agent::new) chooses with it; a caller that needs the
/// rail count before the agent is built (one core per rail of several agents placed
/// together) asks it first: `--rails` defaults to one per NIC.
pub fn nic_choice(o: &AgentOptions, kind: TransportKind) -> Result<NicChoice> {
    Ok(match kind {
        TransportKind::Tcp | TransportKind::Efa => {
            let provider = o.efa.provider.as_deref();
            // The plan's worker of the agent's GPU (for GPU memory), else its position.
            let slot = placement::plan_slot(o.memory == MemoryKind::Cuda, o.gpu, o.worker);
            match o.role {
                Role::Target => nics::choose_to_serve(&o.nics, kind, provider, toward(o), slot)?,
                Role::Initiator => nics::choose(&o.nics, kind, provider, toward(o), slot)?,
            }
        }
        _ => NicChoice::unbound(format!("{kind} does not run on a NIC")),
    })
}

/// An agent without a token whose listeners reach beyond loopback (its tcp `lanes`' rails,
/// its rendezvous address `o.control`): refused with [`AgentOptions::require_auth`], else
/// said loudly, once (at the agent's start). Whoever reaches such an address can read and
/// write the regions the agent registers for remote access.
pub(crate) fn check_exposure(o: &AgentOptions, lanes: &[Lane], agent: &str) -> Result<()> {
    if o.auth_token.is_some() {
        return Ok(());
    }
    let mut exposed: Vec<(String, String)> = Vec::new();
    for l in lanes.iter().filter(|l| l.kind == TransportKind::Tcp) {
        for (i, a) in l.group.addresses().iter().enumerate() {
            if let Ok(sa) = TcpTransport::parse_address(a)
                && !sa.ip().is_loopback()
            {
                exposed.push((format!("tcp rail {i}"), sa.to_string()));
            }
        }
    }
    if let Some(c) = &o.control
        && !control_is_loopback(c)
    {
        exposed.push(("the rendezvous".into(), c.clone()));
    }
    let Some((what, address)) = exposed.first().cloned() else {
        return Ok(());
    };
    if o.require_auth {
        return Err(AuthTokenError::Required { what, address }.into());
    }
    let listeners: Vec<String> = exposed.iter().map(|(w, a)| format!("{w} {a}")).collect();
    tracing::warn!(
        agent,
        listeners = %listeners.join(", "),
        "listening beyond loopback without an auth token: whoever reaches these addresses can \
         read and write the regions this agent registers for remote access (set auth_token or \
         auth_token_file; require_auth refuses to start so)"
    );
    Ok(())
}

/// Whether a rendezvous address (`HOST:PORT`) is on loopback.
fn control_is_loopback(c: &str) -> bool {
    match c.parse::<SocketAddr>() {
        Ok(a) => a.ip().is_loopback(),
        Err(_) => c
            .rsplit_once(':')
            .is_some_and(|(host, _)| host.eq_ignore_ascii_case("localhost")),
    }
}
