//! The edge where the command picks a backend and a kind of memory: `--transport`,
//! `--provider`, `--memory`, `--gpus`. Everything past this module is generic.

use crate::CliError;
use crate::nics::RailNic;
use crate::placement::{self, CorePin};
use clap::{Args, ValueEnum};
use fabric_core::MemoryRegion;
use fabric_core::engine::{EngineConfig, RailGroup};
use fabric_core::mem::MemTransport;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport};
use transport_efa::{EfaConfig, EfaTransport};
use transport_tcp::{TcpConfig, TcpTransport};

/// `--transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// cuda-ipc when both sides hold GPU memory on the same host, tcp otherwise.
    Auto,
    /// RDMA semantics over TCP sockets.
    Tcp,
    /// Device-to-device copies through CUDA IPC (NVLink), for peers on the same host.
    #[value(name = "cuda-ipc")]
    CudaIpc,
    /// libfabric FI_EP_RDM: EFA on AWS, or the provider named by --provider.
    Efa,
    /// In-process memory copies (demo only): measures the engine itself.
    Mem,
}

impl TransportKind {
    /// The backend's name, as engines report it.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::CudaIpc => "cuda-ipc",
            TransportKind::Efa => "efa",
            TransportKind::Mem => "mem",
        }
    }

    /// The kind named `name` (as [`name`](Self::name) spells it).
    pub fn from_name(name: &str) -> Option<TransportKind> {
        [
            TransportKind::Auto,
            TransportKind::Tcp,
            TransportKind::CudaIpc,
            TransportKind::Efa,
            TransportKind::Mem,
        ]
        .into_iter()
        .find(|k| k.name() == name)
    }

    /// What `auto` means between two endpoints: cuda-ipc when both hold GPU memory on the
    /// same host and CUDA is here, tcp otherwise. Other kinds stay as they are.
    pub fn resolve(self, both_gpu: bool, same_host: bool) -> TransportKind {
        match self {
            TransportKind::Auto if both_gpu && same_host && gpu_mem::driver_present() => {
                TransportKind::CudaIpc
            }
            TransportKind::Auto => TransportKind::Tcp,
            k => k,
        }
    }

    /// Why this path was taken, for the summary.
    pub fn why(self, asked: TransportKind) -> &'static str {
        match (asked, self) {
            (TransportKind::Auto, TransportKind::CudaIpc) => {
                "auto: GPU memory on both sides of one host"
            }
            (TransportKind::Auto, _) => "auto: not GPU memory on one host",
            _ => "as asked",
        }
    }
}

/// `--memory`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MemoryKind {
    /// Host memory.
    Host,
    /// CUDA device memory (see --gpus).
    Cuda,
}

impl MemoryKind {
    /// Its name in summaries.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "cuda",
        }
    }
}

/// Backend and memory flags shared by serve, bench and demo.
#[derive(Args, Clone, Debug)]
pub struct BackendArgs {
    /// Transport. `auto` picks cuda-ipc between GPU memory of one host, tcp otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: TransportKind,
    /// libfabric provider for --transport efa (efa, tcp, sockets, shm, ...); FI_PROVIDER
    /// also works. Default: efa.
    #[arg(long)]
    pub provider: Option<String>,
    /// Where the registered regions live.
    #[arg(long, value_enum, default_value = "host")]
    pub memory: MemoryKind,
    /// CUDA devices to use with --memory cuda, e.g. `0` or `0,1` (demo: source on the
    /// first, target on the second if given).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub gpus: Vec<u32>,
    /// Shared secret (tcp): peers without it are refused before they touch memory. Also
    /// read from XFER_AUTH_TOKEN; never printed or logged.
    #[arg(long, env = "XFER_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// tcp: this side's WRITEs from host memory carry a CRC32C that the target checks
    /// before placing any byte (a corrupted payload is refused, not written); WRITEs are
    /// then at most 4 MiB. Targets check sums that come whether or not they have it.
    #[arg(long)]
    pub checksum: bool,
    /// Busy polling: each engine worker keeps polling for this many microseconds after its
    /// last progress before it sleeps (lower latency, a busier core). `--busy-poll` alone
    /// means 1000; the default, 0, sleeps at once.
    #[arg(long = "busy-poll", value_name = "US", num_args = 0..=1, default_missing_value = "1000", default_value_t = 0)]
    pub busy_poll_us: u64,
    /// tcp with GPU memory: how long a rail naps between polls while its device copies
    /// run, in microseconds (0: polls again at once). Was XFER_TCP_COPY_NAP_US.
    #[arg(long = "tcp-copy-nap", value_name = "US", default_value_t = 0)]
    pub tcp_copy_nap_us: u64,
    /// cuda-ipc: force how batches of copies are issued (kernel, batch or memcpy), for
    /// comparisons; the default is the best that works here (the copy kernel first).
    #[arg(long = "cuda-copy", value_name = "METHOD", value_parser = parse_copy_method)]
    pub cuda_copy: Option<gpu_mem::CopyMethod>,
    /// The NICs the rails run on: `auto` (the placement plan's NICs for the worker's GPU;
    /// nothing toward loopback) or names, e.g. `veth0,veth1` (tcp: interfaces; efa: libfabric
    /// domains). Rail i runs on NIC i mod N; --rails defaults to N.
    #[arg(long, value_name = "auto|NAME,...", default_value = "auto", value_parser = crate::nics::parse_nics)]
    pub nics: crate::nics::NicsArg,
    /// Several rails: each holds in flight what it moves in this many microseconds at its
    /// measured rate (at least 2 chunks), and takes chunks of half that (see the library's
    /// `Balance`). Larger keeps fast pipes fuller; smaller ends a slow NIC's tail sooner.
    #[arg(long = "rail-horizon", value_name = "US")]
    pub rail_horizon_us: Option<u64>,
    /// Several rails: chunks per rail a large transfer is cut into at first (the library's
    /// `Balance::chunks_per_rail`, default 16); 1 gives each rail its fair share at once.
    #[arg(long = "rail-chunks", value_name = "N")]
    pub rail_chunks: Option<u64>,
    /// Several rails: the largest first chunk (`Balance::max_chunk`, default 1MiB).
    #[arg(long = "rail-max-chunk", value_name = "SIZE", value_parser = crate::size::parse_size)]
    pub rail_max_chunk: Option<u64>,
    /// Several rails: chunks a rail may always hold in flight (`Balance::in_flight`,
    /// default 2).
    #[arg(long = "rail-in-flight", value_name = "N")]
    pub rail_in_flight: Option<usize>,
    /// How long a wait for a transfer spins before it sleeps, in microseconds (the
    /// engine's `wait_spin`; default 200).
    #[arg(long = "wait-spin", value_name = "US")]
    pub wait_spin_us: Option<u64>,
    /// How long an engine worker keeps polling after a completion before it sleeps, in
    /// microseconds (the engine's `linger`; default 50).
    #[arg(long = "linger", value_name = "US")]
    pub linger_us: Option<u64>,
    /// efa: how long an idle rail sleeps between CQ reads where the provider gives no
    /// descriptor to sleep on, in microseconds (default 50); 0 reads the CQ of a
    /// manual-progress provider (shm) without sleeping, which one process needs for speed.
    #[arg(long = "efa-idle-nap", value_name = "US", env = "XFER_EFA_IDLE_NAP_US")]
    pub efa_idle_nap_us: Option<u64>,
    /// efa: at most this many READs or bulk WRITEs of host memory share one provider call,
    /// one iovec each (capped at 4 and at the provider's iovec limits: efa takes one, tcp
    /// and shm four); 1 sends each alone. Default 4.
    #[arg(long = "efa-gather", value_name = "OPS", env = "XFER_EFA_GATHER")]
    pub efa_gather: Option<usize>,
    /// efa with --memory cuda: register GPU memory with FI_HMEM_DEVICE_ONLY (shm then copies
    /// it with CUDA IPC); `false` leaves the flag out.
    #[arg(
        long = "efa-device-only",
        value_name = "BOOL",
        env = "XFER_EFA_DEVICE_ONLY",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub efa_device_only: bool,
}

/// `--cuda-copy`'s value.
fn parse_copy_method(s: &str) -> Result<gpu_mem::CopyMethod, String> {
    gpu_mem::CopyMethod::from_name(s)
        .ok_or_else(|| format!("{s:?}: expected kernel, batch or memcpy"))
}

impl BackendArgs {
    /// Fails at once, before any memory is allocated, when the chosen transport cannot run
    /// here at all: `--transport efa` without a loadable libfabric (the error names where
    /// it was looked for and how to install it).
    pub fn check_available(&self) -> Result<(), CliError> {
        if self.transport == TransportKind::Efa {
            transport_efa::library().map_err(CliError::from)?;
        }
        Ok(())
    }

    /// This with `--transport auto` resolved for two endpoints (see
    /// [`TransportKind::resolve`]).
    pub fn resolved(&self, peer_gpu: bool, same_host: bool) -> BackendArgs {
        let mut b = self.clone();
        b.transport = self
            .transport
            .resolve(self.memory == MemoryKind::Cuda && peer_gpu, same_host);
        b
    }

    /// Starts `rails` engines of the chosen transport, listening on `ip` (TCP); cuda-ipc
    /// engines copy from the GPU at position `gpu_slot` of --gpus. `nics`, when not empty,
    /// holds each rail's NIC (see [`crate::nics`]): a tcp rail listens on its address and
    /// binds to it, an efa rail opens it as its domain.
    pub fn spawn_group(
        &self,
        ip: IpAddr,
        rails: usize,
        name: &str,
        pins: Vec<Option<CorePin>>,
        gpu_slot: usize,
        nics: &[RailNic],
    ) -> Result<RailGroup, CliError> {
        crate::setup::check_rails(rails).map_err(CliError::Usage)?;
        if !nics.is_empty() && nics.len() != rails {
            return Err(CliError::Failed(format!(
                "internal: {} NICs for {rails} rails",
                nics.len()
            )));
        }
        let nics: Arc<Vec<RailNic>> = Arc::new(nics.to_vec());
        let names: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();

        if self.auth_token.is_some() && self.transport != TransportKind::Tcp {
            return Err(CliError::Usage(
                "--auth-token applies to --transport tcp only".into(),
            ));
        }
        if self.checksum && self.transport != TransportKind::Tcp {
            return Err(CliError::Usage(
                "--checksum applies to --transport tcp only".into(),
            ));
        }
        let auth_token = self.auth_token.clone();
        let checksum = self.checksum;
        let copy_nap = std::time::Duration::from_micros(self.tcp_copy_nap_us);
        let pins = Arc::new(pins);
        let d = EngineConfig::default();
        let us = std::time::Duration::from_micros;
        let cfg = EngineConfig {
            name: name.into(),
            busy_poll: us(self.busy_poll_us),
            wait_spin: self.wait_spin_us.map_or(d.wait_spin, us),
            linger: self.linger_us.map_or(d.linger, us),
            ..d
        };
        let worker = name.to_string();
        let g = match self.transport {
            TransportKind::Tcp => {
                let make = move |i: usize| {
                    placement::pin_worker(pins.get(i).copied().flatten(), &format!("{worker}-{i}"));
                    let nic = nics.get(i);
                    TcpTransport::new(TcpConfig {
                        listen: SocketAddr::new(nic.and_then(|n| n.ip).unwrap_or(ip), 0),
                        interface: nic.map(|n| n.name.clone()),
                        auth_token: auth_token.clone(),
                        copy_nap,
                        checksum,
                        ..TcpConfig::default()
                    })
                };
                spawn_rails(rails, names, make, cfg)
            }
            TransportKind::Auto => {
                return Err(CliError::Failed(
                    "internal: --transport auto reached spawn_group unresolved".into(),
                ));
            }
            TransportKind::CudaIpc => {
                if self.memory != MemoryKind::Cuda {
                    return Err(CliError::Usage(
                        "--transport cuda-ipc moves GPU memory: add --memory cuda (or use tcp)"
                            .into(),
                    ));
                }
                let cuda = self.cuda()?;
                let device = self.gpu(gpu_slot)?;
                let cuda_copy = self.cuda_copy;
                RailGroup::spawn(
                    rails,
                    move |i| {
                        placement::pin_worker(
                            pins.get(i).copied().flatten(),
                            &format!("{worker}-{i}"),
                        );
                        CudaIpcTransport::new(
                            &cuda,
                            CudaIpcConfig {
                                device,
                                copy_method: cuda_copy,
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
                    placement::pin_worker(pins.get(i).copied().flatten(), &format!("{worker}-{i}"));
                    Ok(MemTransport::new())
                },
                cfg,
            ),
            TransportKind::Efa => {
                let mut ec = match &self.provider {
                    Some(p) => EfaConfig::with_provider(p.clone()),
                    None => EfaConfig::default(),
                };
                ec = ec
                    .hmem(self.memory == MemoryKind::Cuda)
                    .hmem_device_only(self.efa_device_only);
                if let Some(us) = self.efa_idle_nap_us {
                    ec = ec.idle_nap(std::time::Duration::from_micros(us));
                }
                if let Some(ops) = self.efa_gather {
                    ec = ec.max_gather(ops);
                }
                let make = move |i: usize| {
                    placement::pin_worker(pins.get(i).copied().flatten(), &format!("{worker}-{i}"));
                    match nics.get(i) {
                        Some(n) => EfaTransport::new(&ec.clone().domain(n.name.clone())),
                        None => EfaTransport::new(&ec),
                    }
                };
                spawn_rails(rails, names, make, cfg)
            }
        };
        let g = g.map_err(CliError::from)?;
        let mut b = g.balance();
        if let Some(us) = self.rail_horizon_us {
            b.horizon = std::time::Duration::from_micros(us);
        }
        if let Some(n) = self.rail_chunks {
            b.chunks_per_rail = n.max(1);
        }
        if let Some(m) = self.rail_max_chunk {
            b.max_chunk = m.max(1);
        }
        if let Some(n) = self.rail_in_flight {
            b.in_flight = n.max(1);
        }
        g.set_balance(b);
        Ok(g)
    }

    /// The CUDA driver, or the one-line reason there is none.
    pub fn cuda(&self) -> Result<gpu_mem::Cuda, CliError> {
        gpu_mem::Cuda::probe()
            .map_err(|e| CliError::Failed(format!("--memory cuda: {e}")))?
            .ok_or_else(|| {
                CliError::Failed(
                    "--memory cuda: no CUDA driver on this machine (use --memory host)".into(),
                )
            })
    }

    /// The GPU ordinal at position `slot` of --gpus (wrapping around).
    pub fn gpu(&self, slot: usize) -> Result<u32, CliError> {
        if self.gpus.is_empty() {
            return Err(CliError::Usage("--gpus lists no device".into()));
        }
        Ok(self.gpus[slot % self.gpus.len()])
    }

    /// Allocates a region of `size` bytes: host memory, or device memory on the GPU at
    /// position `slot` of --gpus (wrapping around).
    pub fn alloc(&self, size: u64, slot: usize) -> Result<Arc<dyn MemoryRegion>, CliError> {
        match self.memory {
            MemoryKind::Host => Ok(Arc::new(gpu_mem::HostMemory::new(size as usize)?)),
            MemoryKind::Cuda => {
                let cuda = self.cuda()?;
                let ordinal = self.gpu(slot)?;
                let dev = cuda
                    .device(ordinal)
                    .map_err(|e| CliError::Usage(format!("--gpus: {e}")))?;
                let buf = dev.alloc_zeroed(size as usize).map_err(|e| {
                    CliError::Failed(format!(
                        "cannot allocate {size} bytes on GPU {ordinal}: {e}"
                    ))
                })?;
                Ok(Arc::new(buf))
            }
        }
    }
}

/// `rails` rails made by `make`: on the NICs `names` (one per rail) when there are any
/// ([`RailGroup::spawn_on`]), else unnamed.
fn spawn_rails<T, F>(
    rails: usize,
    names: Vec<String>,
    make: F,
    cfg: EngineConfig,
) -> Result<RailGroup, fabric_core::Error>
where
    T: fabric_core::Transport,
    F: Fn(usize) -> Result<T, fabric_core::Error> + Send + Sync + 'static,
{
    if names.is_empty() {
        RailGroup::spawn(rails, make, cfg)
    } else {
        RailGroup::spawn_on(names, move |i, _| make(i), cfg)
    }
}
