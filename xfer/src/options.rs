//! [`AgentOptions`]: everything an [`Agent`](crate::Agent) is built from, in one struct.
//!
//! The defaults are what a newcomer wants: `auto` transport (chosen per peer), NICs from
//! the placement plan, workers pinned near their GPU, one rail per NIC, host memory.
//! Every knob the `xfer` command has is a field here (the command only parses flags into
//! it), grouped by the transport it tunes.

use crate::nics::Nics;
use crate::placement::PinMode;
use fabric_core::metadata::TransportKind;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use transport_tcp::Congestion;

/// Which transports an agent offers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// Every transport that can work here, the best chosen per peer from what both sides
    /// offer: cuda-ipc between GPU memory of one host (same boot id), efa where the
    /// placement plan has EFA NICs, tcp otherwise (see [`crate::resolve`]).
    #[default]
    Auto,
    /// This one only.
    Only(TransportKind),
}

impl TransportChoice {
    /// `auto`, or a transport's name.
    pub fn from_name(name: &str) -> Option<TransportChoice> {
        if name == "auto" {
            return Some(TransportChoice::Auto);
        }
        TransportKind::from_name(name).map(TransportChoice::Only)
    }

    /// Its name (`auto`, `tcp`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Only(k) => k.name(),
        }
    }
}

/// Where the memory an agent registers lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory.
    #[default]
    Host,
    /// Memory of the agent's CUDA device ([`AgentOptions::gpu`]).
    Cuda,
}

impl MemoryKind {
    /// Its name (`host`, `cuda`).
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "cuda",
        }
    }
}

/// Which cores of the placement plan an agent's workers take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// The plan's first cores: an agent that initiates transfers.
    #[default]
    Initiator,
    /// The cores after the initiator's: an agent that mostly receives (a server), so that
    /// an initiator and a target on one host never share a core.
    Target,
}

/// Knobs of the tcp transport.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TcpOptions {
    /// WRITEs from host memory carry a CRC32C that the target checks before placing any
    /// byte (WRITEs are then at most 4 MiB). Targets check sums that come either way. With
    /// [`TransportChoice::Auto`] it applies to the tcp rails; asking for another transport
    /// only, with it, is refused.
    pub checksum: bool,
    /// With GPU memory: how long a rail naps between polls while its device copies run.
    pub copy_nap: Duration,
    /// The connections' congestion control. The default takes loopback connections off
    /// BBR (its pacing halves a stream between processes of one host) and leaves those
    /// between hosts to the system; see [`Congestion`].
    pub congestion: Congestion,
    /// The port rail 0 listens on, rail `i` on the next `i` (a firewall's or a container's
    /// fixed ports; a process restarted with the same ports is found where it was). `None`
    /// (the default): ports the system picks.
    pub port: Option<u16>,
}

/// Knobs of the efa (libfabric) transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EfaOptions {
    /// The libfabric provider (`efa` by default; `tcp`, `sockets`, `shm` elsewhere).
    pub provider: Option<String>,
    /// How long an idle rail sleeps between CQ reads where the provider gives no
    /// descriptor to sleep on (`None`: the transport's default).
    pub idle_nap: Option<Duration>,
    /// READs or bulk WRITEs of host memory gathered into one provider call (`None`: the
    /// transport's default).
    pub gather: Option<usize>,
    /// With GPU memory: register it with FI_HMEM_DEVICE_ONLY.
    pub device_only: bool,
}

impl Default for EfaOptions {
    fn default() -> Self {
        EfaOptions {
            provider: None,
            idle_nap: None,
            gather: None,
            device_only: true,
        }
    }
}

/// Knobs of the cuda-ipc transport.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaIpcOptions {
    /// How batches of copies are issued (`None`: the best that works here).
    pub copy_method: Option<gpu_mem::CopyMethod>,
}

/// Knobs of every engine worker (see `fabric_core::engine::EngineConfig`; `None` keeps its
/// default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerOptions {
    /// Busy polling after the last progress before sleeping (zero: sleep at once).
    pub busy_poll: Duration,
    /// How long a wait for a transfer spins before it sleeps.
    pub wait_spin: Option<Duration>,
    /// How long a worker keeps polling after a completion before it sleeps.
    pub linger: Option<Duration>,
    /// Limit of control calls (add a peer, register) and of setting up a tcp connection.
    pub control_timeout: Option<Duration>,
    /// How long a peer's connection may go unanswered (the peer stopped, descheduled,
    /// partitioned) before it is declared dead and its transfers fail with
    /// `PeerUnreachable` (tcp: `transport_tcp::TcpConfig::liveness_timeout`; `None`: its
    /// default, 30 s). A shorter stall is reported per transfer instead
    /// ([`stall_timeout`](Self::stall_timeout)), and the connection stays.
    pub liveness_timeout: Option<Duration>,
    /// The most distinct (sender, value) pairs of notifications each rail keeps until they
    /// are taken (`fabric_core::engine::EngineConfig::notification_keys`; `None`: its
    /// default, 2^20). `Some(0)` keeps none: for a server that never takes them.
    pub notification_keys: Option<usize>,
    /// Receives each rail keeps posted for peers' messages ([`Transfer::message`](crate::Transfer::message)),
    /// 4 KiB each (`None`: [`DEFAULT_MESSAGES`]; `Some(0)` or `notification_keys` 0: none,
    /// and peers' messages wait).
    pub messages: Option<usize>,
    /// How long a transfer may make no progress before a wait on it reports
    /// [`PeerStalled`](crate::Error::PeerStalled) (the transfer goes on); `None`: never.
    /// [`Transfer::stall_timeout`](crate::Transfer::stall_timeout) sets it per transfer.
    pub stall_timeout: Option<Duration>,
}

/// Receives each rail of an agent keeps posted for peers' messages, by default.
pub const DEFAULT_MESSAGES: usize = 16;

/// How transfers spread over several rails (see `fabric_core::engine::Balance`; `None`
/// keeps its default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BalanceOptions {
    /// The window a rail's rate is measured over (and twice the largest chunk a rail takes,
    /// in time at that rate).
    pub horizon: Option<Duration>,
    /// What a rail holds in flight beyond its `in_flight` chunks, in time at its measured
    /// rate; the rest waits for the first rail with room.
    pub lead: Option<Duration>,
    /// Chunks per rail a large transfer is cut into.
    pub chunks_per_rail: Option<u64>,
    /// The largest first chunk.
    pub max_chunk: Option<u64>,
    /// Chunks a rail may always hold in flight.
    pub in_flight: Option<usize>,
}

/// Everything an agent is built from: defaults that suit a newcomer (`auto` transport,
/// NICs from the placement plan, pinned workers, one rail per NIC, host memory), and every
/// knob of the `xfer` command, grouped by the transport it tunes.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// The agent's name (in its metadata and the cluster directory). Default:
    /// `xfer-PID-N`.
    pub name: Option<String>,
    /// The transports it offers.
    pub transport: TransportChoice,
    /// Where the memory it registers lives.
    pub memory: MemoryKind,
    /// Its CUDA device (with [`MemoryKind::Cuda`]; also its place in the placement plan).
    pub gpu: u32,
    /// The agent's position among the agents of its process (a worker per GPU): which
    /// worker of the placement plan it is.
    pub worker: usize,
    /// Rails (worker threads, each with its own connection or NIC) of each transport.
    /// `None`: one per NIC chosen, else 1.
    pub rails: Option<usize>,
    /// The NICs its tcp and efa rails run on.
    pub nics: Nics,
    /// Where its tcp rails listen (a NIC's address replaces it where a NIC is chosen).
    pub listen: IpAddr,
    /// The address of the peers it will talk to, if known: `auto` NICs for tcp take the
    /// route toward it, and none toward loopback. `None`: as for `listen`.
    pub toward: Option<IpAddr>,
    /// Whether its workers are pinned to the plan's cores.
    pub pin: PinMode,
    /// Which of the plan's cores its workers take.
    pub role: Role,
    /// A shared secret both ends of every tcp and cuda-ipc connection prove (never sent):
    /// peers without it, and peers we connect to that cannot prove it back, are refused
    /// (see `docs/security.md`). With [`TransportChoice::Auto`] it guards the agent's tcp
    /// rails and cuda-ipc lanes, not its efa lanes (libfabric has no such check); asking
    /// for efa only, with a token, is refused. See also
    /// [`auth_token_file`](Self::auth_token_file).
    pub auth_token: Option<String>,
    /// Where this agent's rendezvous listens (`HOST:PORT`, the address peers reach), if it
    /// serves one: its [`AgentInfo::control`](fabric_core::metadata::AgentInfo::control),
    /// so that members who find it in the directory know where to say hello.
    pub control: Option<String>,
    /// tcp knobs.
    pub tcp: TcpOptions,
    /// efa knobs.
    pub efa: EfaOptions,
    /// cuda-ipc knobs.
    pub cuda_ipc: CudaIpcOptions,
    /// Worker knobs.
    pub workers: WorkerOptions,
    /// Rail balance knobs.
    pub balance: BalanceOptions,
    /// A file holding [`auth_token`](Self::auth_token) (read at [`Agent::new`](crate::Agent::new),
    /// one final newline trimmed): a token in a file is not in the process's arguments or
    /// environment for every local user to read in `/proc`. Unreadable or empty is
    /// refused, as is giving both a token and a file ([`AuthTokenError`]).
    pub auth_token_file: Option<PathBuf>,
    /// Refuse to start when a listener of the agent (its tcp rails, its
    /// [`control`](Self::control) address) is on an address other than loopback and there
    /// is no token ([`AuthTokenError::Required`]). Without it such an agent starts, and
    /// says so in a warning.
    pub require_auth: bool,
}

impl Default for AgentOptions {
    fn default() -> Self {
        AgentOptions {
            name: None,
            transport: TransportChoice::Auto,
            memory: MemoryKind::Host,
            gpu: 0,
            worker: 0,
            rails: None,
            nics: Nics::Auto,
            listen: IpAddr::from([127, 0, 0, 1]),
            toward: None,
            pin: PinMode::Auto,
            role: Role::Initiator,
            auth_token: None,
            control: None,
            tcp: TcpOptions::default(),
            efa: EfaOptions::default(),
            cuda_ipc: CudaIpcOptions::default(),
            workers: WorkerOptions::default(),
            balance: BalanceOptions::default(),
            auth_token_file: None,
            require_auth: false,
        }
    }
}

/// Why an agent's token could not be had, or why an agent without one may not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthTokenError {
    /// The token file could not be read.
    #[error("cannot read the auth token file {path}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The token file holds nothing (or only a newline).
    #[error("the auth token file {path} is empty")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The token file is not UTF-8.
    #[error("the auth token file {path} is not UTF-8")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
    },
    /// Both a token and a token file were given.
    #[error("auth_token and auth_token_file both given: give one")]
    Both,
    /// [`AgentOptions::require_auth`] with no token, and a listener other than loopback.
    #[error(
        "no auth token, and {what} listens on {address}, which is not loopback: set a token \
         (auth_token, auth_token_file, --auth-token-file, XFER_AUTH_TOKEN_FILE) or listen on \
         loopback"
    )]
    Required {
        /// What listens (`tcp rail 0`, `the rendezvous`).
        what: String,
        /// Where.
        address: String,
    },
}

/// Reads a token from `path`: its contents, one final newline (`\n` or `\r\n`) trimmed;
/// refused when unreadable, not UTF-8 or empty.
pub fn read_token_file(path: &Path) -> Result<String, AuthTokenError> {
    let bytes = std::fs::read(path).map_err(|source| AuthTokenError::Unreadable {
        path: path.to_path_buf(),
        source,
    })?;
    let mut token = String::from_utf8(bytes).map_err(|_| AuthTokenError::NotUtf8 {
        path: path.to_path_buf(),
    })?;
    if token.ends_with('\n') {
        token.pop();
        if token.ends_with('\r') {
            token.pop();
        }
    }
    if token.is_empty() {
        return Err(AuthTokenError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(token)
}

impl AgentOptions {
    /// The agent's token: [`auth_token`](Self::auth_token), or what
    /// [`auth_token_file`](Self::auth_token_file) holds ([`read_token_file`]); both given
    /// is refused.
    pub fn token(&self) -> Result<Option<String>, AuthTokenError> {
        match (&self.auth_token, &self.auth_token_file) {
            (Some(_), Some(_)) => Err(AuthTokenError::Both),
            (Some(t), None) => Ok(Some(t.clone())),
            (None, Some(path)) => read_token_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

/// The most rails one transport of an agent may have: a rail is a worker thread with its
/// own connection or NIC; the largest hosts have 32 NICs, so this leaves room for
/// experiments with many TCP connections while keeping threads and sockets bounded.
pub const MAX_RAILS: usize = 256;
