//! The flags that say how an agent is built, shared by serve, bench and demo
//! (`--transport`, `--provider`, `--memory`, `--gpus`, `--nics`, every per-transport knob),
//! and the one function that turns them into [`xfer::AgentOptions`]: the library builds the
//! transports, chooses the NICs and pins the workers. The memory a run moves is allocated
//! here ([`alloc`]), where the agent's memory lives.

use crate::CliError;
use clap::{Args, ValueEnum};
use fabric_core::{MemoryLocation, MemoryRegion};
use std::sync::Arc;
use std::time::Duration;
use xfer::Nics;
use xfer::{
    AgentOptions, BalanceOptions, Congestion, CudaIpcOptions, EfaOptions, MemoryKind, PinMode,
    TcpOptions, TransportChoice, TransportKind, WorkerOptions,
};

/// `--transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// Every transport that can work here, the best chosen per peer: cuda-ipc between GPU
    /// memory of one host, efa where the placement plan has EFA NICs, tcp otherwise.
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

impl TransportArg {
    /// What the agent offers.
    pub fn choice(self) -> TransportChoice {
        match self {
            TransportArg::Auto => TransportChoice::Auto,
            TransportArg::Tcp => TransportChoice::Only(TransportKind::Tcp),
            TransportArg::CudaIpc => TransportChoice::Only(TransportKind::CudaIpc),
            TransportArg::Efa => TransportChoice::Only(TransportKind::Efa),
            TransportArg::Mem => TransportChoice::Only(TransportKind::Mem),
        }
    }
}

/// `--memory`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MemoryArg {
    /// Host memory.
    Host,
    /// CUDA device memory (see --gpus).
    Cuda,
}

impl MemoryArg {
    /// The library's kind.
    pub fn kind(self) -> MemoryKind {
        match self {
            MemoryArg::Host => MemoryKind::Host,
            MemoryArg::Cuda => MemoryKind::Cuda,
        }
    }
}

/// `--pin`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum PinArg {
    /// Pin each worker to the placement plan's core (unpinned if discovery fails).
    #[default]
    Auto,
    /// Leave the threads where the OS puts them.
    Off,
}

impl PinArg {
    /// The library's mode.
    pub fn mode(self) -> PinMode {
        match self {
            PinArg::Auto => PinMode::Auto,
            PinArg::Off => PinMode::Off,
        }
    }
}

/// Backend and memory flags shared by serve, bench and demo.
#[derive(Args, Clone, Debug)]
pub struct BackendArgs {
    /// Transport. `auto` offers every transport that can work here and picks per peer:
    /// cuda-ipc between GPU memory of one host, efa on EFA NICs, tcp otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: TransportArg,
    /// libfabric provider for --transport efa (efa, tcp, sockets, shm, ...); FI_PROVIDER
    /// also works. Default: efa.
    #[arg(long)]
    pub provider: Option<String>,
    /// Where the registered regions live.
    #[arg(long, value_enum, default_value = "host")]
    pub memory: MemoryArg,
    /// CUDA devices to use with --memory cuda, e.g. `0` or `0,1` (demo: source on the
    /// first, target on the second if given).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub gpus: Vec<u32>,
    /// Shared secret (tcp and cuda-ipc; not efa): peers without it are refused before they
    /// touch memory, and peers we connect to must prove it back. Also
    /// read from XFER_AUTH_TOKEN; never printed or logged.
    #[arg(long, env = "XFER_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// A file holding the shared secret (one final newline trimmed): unlike --auth-token
    /// and XFER_AUTH_TOKEN, not readable by every local user in /proc. Also read from
    /// XFER_AUTH_TOKEN_FILE; not with --auth-token.
    #[arg(
        long,
        env = "XFER_AUTH_TOKEN_FILE",
        value_name = "PATH",
        conflicts_with = "auth_token"
    )]
    pub auth_token_file: Option<std::path::PathBuf>,
    /// Refuse to start without a token when a listener (tcp rails, the control port) is on
    /// an address other than loopback (without it: a warning).
    #[arg(long)]
    pub require_auth: bool,
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
    /// tcp: the connections' congestion control. `auto` takes loopback connections off BBR
    /// (its pacing halves a stream between processes of one host) and leaves the rest to
    /// the system; `system` never changes it; a name (`cubic`, `reno`, `bbr`) sets it on
    /// every connection (unprivileged: those in net.ipv4.tcp_allowed_congestion_control).
    /// demo's and bench's raw streams (--baseline) run the same
    #[arg(long = "tcp-congestion", value_name = "auto|system|NAME", default_value = "auto", value_parser = Congestion::parse)]
    pub tcp_congestion: Congestion,
    /// cuda-ipc: force how batches of copies are issued (kernel, kernel-rows, batch or
    /// memcpy), for comparisons; the default is the best that works here (the copy kernel
    /// first).
    #[arg(long = "cuda-copy", value_name = "METHOD", value_parser = parse_copy_method)]
    pub cuda_copy: Option<gpu_mem::CopyMethod>,
    /// The NICs the rails run on: `auto` (the placement plan's NICs for the worker's GPU;
    /// nothing toward loopback) or names, e.g. `veth0,veth1` (tcp: interfaces; efa: libfabric
    /// domains). Rail i runs on NIC i mod N; --rails defaults to N.
    #[arg(long, value_name = "auto|NAME,...", default_value = "auto", value_parser = parse_nics)]
    pub nics: Nics,
    /// Several rails: each measures its rate over windows of this many microseconds and
    /// takes chunks of up to half that much of its work (the library's `Balance::horizon`).
    #[arg(long = "rail-horizon", value_name = "US")]
    pub rail_horizon_us: Option<u64>,
    /// Several rails: each holds in flight what it moves in this many microseconds at its
    /// measured rate (at least --rail-in-flight chunks); the rest waits for the first rail
    /// with room (`Balance::lead`). Larger keeps fast pipes fuller; smaller lets fast rails
    /// take more of each transfer and ends a slow NIC's tail sooner.
    #[arg(long = "rail-lead", value_name = "US")]
    pub rail_lead_us: Option<u64>,
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
    /// How long a peer's connection may go unanswered (the peer stopped, descheduled or
    /// partitioned) before it is declared dead, in seconds (tcp; default 30).
    #[arg(long = "liveness-timeout", value_name = "SECONDS")]
    pub liveness_timeout_s: Option<u64>,
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
pub(crate) fn parse_copy_method(s: &str) -> Result<gpu_mem::CopyMethod, String> {
    gpu_mem::CopyMethod::from_name(s)
        .ok_or_else(|| format!("{s:?}: expected kernel, kernel-rows, batch or memcpy"))
}

/// `--nics`'s value.
fn parse_nics(s: &str) -> Result<Nics, String> {
    s.parse()
        .map_err(|e: xfer::layers::nics::NicError| e.to_string())
}

impl BackendArgs {
    /// The shared secret: --auth-token's, or what --auth-token-file holds.
    pub fn token(&self) -> Result<Option<String>, CliError> {
        let o = AgentOptions {
            auth_token: self.auth_token.clone(),
            auth_token_file: self.auth_token_file.clone(),
            ..AgentOptions::default()
        };
        o.token().map_err(|e| CliError::from(xfer::Error::from(e)))
    }

    /// The tcp connections' congestion control (`--tcp-congestion`): the rails' and the raw
    /// streams' of `--baseline`.
    pub fn congestion(&self) -> Congestion {
        self.tcp_congestion.clone()
    }

    /// The options of an agent built from these flags, pinned by `pin`, with `rails` rails
    /// per transport (`None`: the library's default, one per NIC it chooses, else 1). The
    /// caller sets what differs between its agents: role, worker, GPU, listen address, the
    /// peer's address.
    pub fn options(&self, pin: PinArg, rails: Option<usize>) -> Result<AgentOptions, CliError> {
        if self.transport == TransportArg::CudaIpc && self.memory != MemoryArg::Cuda {
            return Err(CliError::Usage(
                "--transport cuda-ipc moves GPU memory: add --memory cuda (or use tcp)".into(),
            ));
        }
        let us = Duration::from_micros;
        Ok(AgentOptions {
            transport: self.transport.choice(),
            memory: self.memory.kind(),
            gpu: self.gpu(0)?,
            rails,
            nics: self.nics.clone(),
            pin: pin.mode(),
            auth_token: self.token()?,
            require_auth: self.require_auth,
            tcp: TcpOptions {
                checksum: self.checksum,
                copy_nap: us(self.tcp_copy_nap_us),
                congestion: self.congestion(),
                ..TcpOptions::default()
            },
            efa: EfaOptions {
                provider: self.provider.clone(),
                idle_nap: self.efa_idle_nap_us.map(us),
                gather: self.efa_gather,
                device_only: self.efa_device_only,
            },
            cuda_ipc: CudaIpcOptions {
                copy_method: self.cuda_copy,
            },
            workers: WorkerOptions {
                busy_poll: us(self.busy_poll_us),
                wait_spin: self.wait_spin_us.map(us),
                linger: self.linger_us.map(us),
                control_timeout: None,
                liveness_timeout: self.liveness_timeout_s.map(Duration::from_secs),
                notification_keys: None,
                messages: None,
                stall_timeout: None,
            },
            balance: BalanceOptions {
                horizon: self.rail_horizon_us.map(us),
                lead: self.rail_lead_us.map(us),
                chunks_per_rail: self.rail_chunks,
                max_chunk: self.rail_max_chunk,
                in_flight: self.rail_in_flight,
            },
            ..AgentOptions::default()
        })
    }

    /// The transport whose NICs decide `--rails` by default: efa when asked for, else tcp
    /// (`auto` runs its network rails on tcp unless the plan has EFA NICs, and cuda-ipc
    /// runs on none).
    pub fn nic_transport(&self) -> TransportKind {
        match self.transport {
            TransportArg::Efa => TransportKind::Efa,
            _ => TransportKind::Tcp,
        }
    }

    /// Checks `--memory cuda` and `--gpus` before anything is built: CUDA is here and every
    /// GPU listed exists (a GPU that is not there is a usage error naming it).
    pub fn check_gpus(&self) -> Result<(), CliError> {
        if self.gpus.is_empty() {
            return Err(CliError::Usage("--gpus lists no device".into()));
        }
        if self.memory != MemoryArg::Cuda {
            return Ok(());
        }
        let cuda = cuda()?;
        for &g in &self.gpus {
            cuda.device(g)
                .map_err(|e| CliError::Usage(format!("--gpus: {e}")))?;
        }
        Ok(())
    }

    /// The GPU ordinal at position `slot` of --gpus (wrapping around).
    pub fn gpu(&self, slot: usize) -> Result<u32, CliError> {
        if self.gpus.is_empty() {
            return Err(CliError::Usage("--gpus lists no device".into()));
        }
        Ok(self.gpus[slot % self.gpus.len()])
    }

    /// Checks --gpus for a per-GPU run: not empty, no GPU twice.
    pub fn check_per_gpu(&self) -> Result<(), CliError> {
        if self.gpus.is_empty() {
            return Err(CliError::Usage("--gpus lists no device".into()));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(g) = self.gpus.iter().find(|g| !seen.insert(**g)) {
            return Err(CliError::Usage(format!(
                "--per-gpu: GPU {g} is listed twice in --gpus"
            )));
        }
        Ok(())
    }
}

/// The CUDA driver, or the one-line reason there is none.
pub fn cuda() -> Result<gpu_mem::Cuda, CliError> {
    gpu_mem::Cuda::probe()
        .map_err(|e| CliError::because("--memory cuda", e))?
        .ok_or_else(|| {
            CliError::failed("--memory cuda: no CUDA driver on this machine (use --memory host)")
        })
}

/// A region of `size` bytes where `memory` says (an agent's memory: host memory, or on its
/// GPU), zeroed. Host memory is first touched by the calling thread: call it from a thread
/// that prefers the agent's NUMA node ([`AgentLayers::home`](xfer::layers::AgentLayers::home)).
pub fn alloc(memory: MemoryLocation, size: u64) -> Result<Arc<dyn MemoryRegion>, CliError> {
    let len = usize::try_from(size)
        .map_err(|_| CliError::Usage(format!("{size} bytes do not fit this address space")))?;
    match memory {
        MemoryLocation::Host => {
            Ok(Arc::new(gpu_mem::HostMemory::new(len).map_err(|e| {
                CliError::because(format!("cannot allocate {size} bytes"), e)
            })?))
        }
        MemoryLocation::Cuda { device } => {
            let dev = cuda()?
                .device(device)
                .map_err(|e| CliError::Usage(format!("--gpus: {e}")))?;
            let buf = dev.alloc_zeroed(len).map_err(|e| {
                CliError::because(format!("cannot allocate {size} bytes on GPU {device}"), e)
            })?;
            Ok(Arc::new(buf))
        }
    }
}

/// Where memory lives, as summaries name it (`host`, `cuda`).
pub fn memory_name(m: MemoryLocation) -> &'static str {
    match m {
        MemoryLocation::Host => "host",
        MemoryLocation::Cuda { .. } => "cuda",
    }
}
