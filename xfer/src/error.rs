//! [`Error`], the one error type of this crate: a variant per thing that fails, with the
//! layer's own error as its source.

use fabric_core::metadata::TransportKind;
use std::time::Duration;

/// Why a call of this crate failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An option is out of range or contradicts another (the message says which and why).
    #[error("{}: {reason}", option.name())]
    Option {
        /// The option.
        option: OptionName,
        /// What is wrong with it.
        reason: String,
    },
    /// The agent's token could not be had (its file), or an agent that requires one has
    /// none and listens beyond loopback.
    #[error(transparent)]
    AuthToken(#[from] crate::options::AuthTokenError),
    /// The transport cannot run on this machine (libfabric or CUDA missing).
    #[error("the {kind} transport cannot run here")]
    Unavailable {
        /// The transport.
        kind: TransportKind,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The agent and the peer offer no transport in common.
    #[error(
        "no transport in common with {peer}: it offers {theirs}, this agent {ours} \
         (make both with the same transport, or auto)"
    )]
    NoCommonTransport {
        /// The peer's name.
        peer: String,
        /// What the peer offers.
        theirs: String,
        /// What this agent offers.
        ours: String,
    },
    /// The peer is reached over a transport of one process (`mem`) and is not an agent of
    /// this process.
    #[error(
        "{peer} is not an agent of this process, and the {kind} transport connects agents of \
         one process only: use tcp between processes"
    )]
    NotInThisProcess {
        /// The peer's name.
        peer: String,
        /// The transport.
        kind: TransportKind,
    },
    /// The peer's region is not registered on the transport this agent reaches it by.
    #[error("the region is not registered on {0}, the transport this peer is reached by")]
    RegionNotOnTransport(TransportKind),
    /// The NICs could not be chosen.
    #[error("--nics")]
    Nics(#[from] crate::nics::NicError),
    /// CUDA is needed and cannot be used.
    #[error("CUDA")]
    Cuda(#[from] gpu_mem::GpuMemError),
    /// The engine (or a transport) failed.
    #[error(transparent)]
    Engine(#[from] fabric_core::Error),
    /// Metadata (an agent's or a region's) is malformed or of another version.
    #[error(transparent)]
    Metadata(#[from] fabric_core::metadata::MetadataError),
    /// The rendezvous with a peer failed (unreachable, refused, another protocol).
    #[error("rendezvous")]
    Rendezvous(#[from] crate::rendezvous::ClientError),
    /// The cluster directory failed (unreachable, timed out, or a record it refused).
    #[error(transparent)]
    Directory(#[from] directory::Error),
    /// A followed member did not join (was not connected) in time.
    #[error("member {name:?} of cluster {cluster:?} is not connected after {waited:?}")]
    NotJoined {
        /// The cluster.
        cluster: String,
        /// The member.
        name: String,
        /// How long it was waited for.
        waited: Duration,
    },
    /// A followed member was still connected when the wait for its leave ran out.
    #[error("member {name:?} of cluster {cluster:?} is still connected after {waited:?}")]
    NotLeft {
        /// The cluster.
        cluster: String,
        /// The member.
        name: String,
        /// How long its leave was waited for.
        waited: Duration,
    },
    /// A member offers no region of that name.
    #[error("member {member:?} offers no region named {region:?}")]
    NoSuchRegion {
        /// The member.
        member: String,
        /// The region's name.
        region: String,
    },
    /// A handle of another agent (a [`Peer`](crate::Peer) or [`Region`](crate::Region)
    /// that another agent returned) was given to this one: it means nothing here.
    #[error(
        "this {what} belongs to another agent (instance {owner:016x}), not to {agent:?}: use \
         the {what} this agent returned"
    )]
    ForeignHandle {
        /// What it was: "peer" or "region".
        what: &'static str,
        /// The instance of the agent it belongs to.
        owner: u64,
        /// This agent's name.
        agent: String,
    },
    /// The agent was closed.
    #[error("the agent is closed")]
    Closed,
    /// A transfer made no progress for its stall timeout ([`Transfer::stall_timeout`](crate::Transfer::stall_timeout)):
    /// the peer is up (its connection stands) but does not answer, as a stopped or
    /// descheduled process does. The transfer is not over: its memory may still be
    /// touched; wait on its handle again (it goes on if the peer comes back) or cancel it.
    #[error(
        "peer {peer} stalled: the transfer made no progress for {idle:?} (its stall timeout \
         is {limit:?}); the connection stands and the transfer goes on: wait again or cancel"
    )]
    PeerStalled {
        /// The peer's name.
        peer: String,
        /// How long the transfer had made no progress.
        idle: Duration,
        /// The stall timeout.
        limit: Duration,
    },
    /// A transfer ended because the connection to its peer broke (reset, link down, the
    /// peer's process gone): its source says what the transport saw. The agent connects
    /// to the peer again before the next transfer to it (see `docs/connections.md`).
    #[error(
        "the connection to peer {peer} was lost; the agent reconnects before the next \
         transfer to it"
    )]
    ConnectionLost {
        /// The peer's name.
        peer: String,
        /// What the transport reported.
        #[source]
        source: fabric_core::Error,
    },
    /// The peer's connection had broken, and connecting to it again failed (within the
    /// control timeout): the next transfer to it tries again.
    #[error("reconnecting to peer {peer} failed; the next transfer to it tries again")]
    Reconnect {
        /// The peer's name.
        peer: String,
        /// Why connecting failed.
        #[source]
        source: Box<Error>,
    },
    /// A [`Prepared`](crate::Prepared) transfer was planned on an earlier connection to
    /// its peer (the agent has connected to it again since: its connection dropped, or
    /// [`Agent::update_peer`](crate::Agent::update_peer)): prepare it again.
    #[error(
        "this prepared transfer was planned on connection {prepared} to peer {peer}, which \
         has since been replaced by connection {now}: prepare it again"
    )]
    PreparedStale {
        /// The peer's name.
        peer: String,
        /// The connection it was planned on (0: the first).
        prepared: u64,
        /// The connection now.
        now: u64,
    },
    /// A remote descriptor of another incarnation of the peer than the one this agent
    /// knows now (the peer restarted since the descriptor was made, or the descriptor is
    /// another agent's): refused before anything moves, so nothing of the peer's memory
    /// changes. Ask the peer for its regions' descriptors again.
    #[error(
        "the descriptor belongs to instance {descriptor_instance:016x}, but peer {peer} is \
         instance {peer_instance:016x} (it restarted since the descriptor was made, or the \
         descriptor is another agent's): ask it for the region again"
    )]
    StaleDescriptor {
        /// The peer's name.
        peer: String,
        /// The instance of the agent that made the descriptor.
        descriptor_instance: u64,
        /// The peer's instance as this agent knows it now.
        peer_instance: u64,
    },
    /// [`Agent::update_peer`](crate::Agent::update_peer) was given another agent's info
    /// (another name).
    #[error("peer {peer} cannot become {name:?}: update a peer with its own new info")]
    PeerRenamed {
        /// The peer's name.
        peer: String,
        /// The name of the info given.
        name: String,
    },
    /// A weight-sync plan cannot be made from the layouts given.
    /// A KV layout, request or plan is wrong (see `kv_plan::KvError`).
    #[error(transparent)]
    Kv(#[from] kv_plan::KvError),
    /// A KV request id that is empty or longer than [`kv::MAX_REQUEST_ID`](crate::kv::MAX_REQUEST_ID) bytes.
    #[error(
        "a KV request id of {len} bytes: give 1 to {} bytes",
        crate::kv::MAX_REQUEST_ID
    )]
    KvRequestId {
        /// Its length.
        len: usize,
    },
    /// A rank that the layouts given do not have.
    #[error("{side} rank {rank} does not exist: the {side} side has {ranks} ranks")]
    KvNoSuchRank {
        /// Its side.
        side: kv_plan::Side,
        /// The rank asked for.
        rank: u32,
        /// How many ranks that side has.
        ranks: usize,
    },
    /// A peer rank whose layout (or side) is not the one this rank was given for it.
    #[error(
        "{side} rank {rank} describes a cache other than the layout this rank was given for it \
         (or is not of the other side): both sides must be made from the same layouts"
    )]
    KvPeerLayout {
        /// Its side.
        side: kv_plan::Side,
        /// Its rank.
        rank: u32,
    },
    /// The plan needs a peer rank this rank is not attached to.
    #[error("{side} rank {rank} is not attached: attach its KvRankInfo first")]
    KvNotAttached {
        /// Its side.
        side: kv_plan::Side,
        /// Its rank.
        rank: u32,
    },
    /// A layout names a region that the rank did not register or describe.
    #[error("{side} rank {rank} has no region {region}")]
    KvNoSuchRegion {
        /// The side.
        side: kv_plan::Side,
        /// The rank.
        rank: u32,
        /// The region index.
        region: u32,
    },
    /// A call of the other side (a push on a decode rank, a pull on a prefill rank).
    #[error("only a {side} rank can {what}")]
    KvWrongSide {
        /// The call.
        what: &'static str,
        /// The side that can.
        side: kv_plan::Side,
    },
    /// A layer the model does not have.
    #[error("layer {layer} does not exist: the model has {layers}")]
    KvNoSuchLayer {
        /// The layer.
        layer: u32,
        /// Layers of the model.
        layers: u32,
    },
    /// A request (or one of its layers) not whole here in time.
    #[error(
        "KV request {request:?}{} has not landed after {waited:?}: {whole} of {layers} layers whole",
        layer.map_or(String::new(), |l| format!(" (layer {l})"))
    )]
    KvNotLanded {
        /// The request.
        request: String,
        /// The layer waited for, if one.
        layer: Option<u32>,
        /// Layers whole.
        whole: u32,
        /// Layers of the request.
        layers: u32,
        /// How long it was waited for.
        waited: Duration,
    },
    /// A transfer of a KV request failed (its source says why).
    #[error(
        "KV request {request:?}{}{} failed",
        layer.map_or(String::new(), |l| format!(", layer {l}")),
        peer.map_or(String::new(), |p| format!(", peer rank {p}"))
    )]
    KvRequest {
        /// The request.
        request: String,
        /// The layer, where one.
        layer: Option<u32>,
        /// The other side's rank, where one.
        peer: Option<u32>,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// A weight plan's inputs are wrong.
    #[error(transparent)]
    WeightPlan(#[from] crate::weights::PlanError),
    /// A weight-sync plan is wrong for its layouts.
    #[error(transparent)]
    WeightCheck(#[from] crate::weights::CheckError),
    /// A weight sync (a push, a pull, a wait) failed.
    #[error(transparent)]
    WeightSync(#[from] crate::weights::SyncError),
}

/// What kind of failure an [`Error`] is ([`Error::kind`]), for a program to match on:
/// fix its input, retry, or give up. The variants of [`Error`] (and of the layers' errors
/// they carry as sources) say exactly what failed; this says what to do about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller's input is wrong: an option, an argument, a range outside a region,
    /// malformed metadata, a layout. Retrying the same call fails the same way.
    InvalidInput,
    /// A handle ([`Peer`](crate::Peer), [`Region`](crate::Region)) of another agent.
    ForeignHandle,
    /// The peer refused the access: an unknown or stale key, a range outside its region,
    /// an access its region was not registered for.
    RemoteAccess,
    /// A wait or a transfer ran past its time. Retryable.
    TimedOut,
    /// The peer's connection stands but its transfer made no progress for its stall
    /// timeout (a stopped or descheduled process). Retryable: the transfer goes on.
    PeerStalled,
    /// The peer cannot be reached, or its connection broke. Retryable.
    PeerUnreachable,
    /// The peer was disconnected by this agent while the transfer was pending.
    PeerRemoved,
    /// The transfer was cancelled (its agent shut down).
    Cancelled,
    /// The agent, or one of its workers, is closed.
    Closed,
    /// This machine, build or transport cannot do it (no CUDA, no libfabric, an operation
    /// the backend lacks, no transport in common).
    Unsupported,
    /// A region is still used by unfinished transfers. Retryable once they end.
    Busy,
    /// The cluster directory failed.
    Directory,
    /// The transport, the device or the OS failed in its own way.
    Transport,
}

impl ErrorKind {
    /// Whether the same call may succeed if tried again later (a timeout, an unreachable
    /// peer, a busy region).
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::TimedOut
                | ErrorKind::PeerStalled
                | ErrorKind::PeerUnreachable
                | ErrorKind::Busy
        )
    }
}

/// The kind of an operation's failure.
fn op_kind(e: &fabric_core::OpError) -> ErrorKind {
    use fabric_core::OpError as O;
    match e {
        O::RemoteKeyInvalid(_) | O::OutOfBounds { .. } | O::PermissionDenied | O::Remote(_) => {
            ErrorKind::RemoteAccess
        }
        O::LocalKeyInvalid(_) | O::Truncated { .. } => ErrorKind::InvalidInput,
        O::PeerRemoved(_) => ErrorKind::PeerRemoved,
        O::PeerUnreachable { .. } => ErrorKind::PeerUnreachable,
        O::TimedOut => ErrorKind::TimedOut,
        O::Cancelled => ErrorKind::Cancelled,
        _ => ErrorKind::Transport,
    }
}

/// The kind of the engine's failure.
pub(crate) fn core_kind(e: &fabric_core::Error) -> ErrorKind {
    use fabric_core::Error as C;
    use fabric_core::MemoryError as M;
    match e {
        C::InvalidAddress(_) | C::InvalidArgument(_) | C::ReservedImm(_) => ErrorKind::InvalidInput,
        C::UnknownPeer(_) => ErrorKind::PeerRemoved,
        C::Op(op) => op_kind(op),
        C::Memory(M::OutOfBounds { .. }) => ErrorKind::InvalidInput,
        C::Memory(M::Unsupported(_)) | C::Unsupported(_) | C::UnsupportedOp { .. } => {
            ErrorKind::Unsupported
        }
        C::TimedOut(..) => ErrorKind::TimedOut,
        C::EngineStopped => ErrorKind::Closed,
        C::RegionInUse { .. } => ErrorKind::Busy,
        _ => ErrorKind::Transport,
    }
}

/// Which of [`AgentOptions`](crate::AgentOptions)' settings an [`Error::Option`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OptionName {
    /// [`AgentOptions::rails`](crate::AgentOptions::rails).
    Rails,
    /// [`AgentOptions::nics`](crate::AgentOptions::nics).
    Nics,
    /// [`AgentOptions::transport`](crate::AgentOptions::transport).
    Transport,
    /// [`EfaOptions::provider`](crate::EfaOptions::provider).
    Provider,
    /// [`AgentOptions::auth_token`](crate::AgentOptions::auth_token).
    AuthToken,
    /// [`TcpOptions::checksum`](crate::TcpOptions::checksum).
    Checksum,
    /// [`TcpOptions::port`](crate::TcpOptions::port).
    Port,
}

impl OptionName {
    /// Its name in snake case (`rails`, `auth_token`): the field's, and the keyword of
    /// Python's `Engine`; the `xfer` command's flag is it with dashes (`--auth-token`).
    pub fn name(self) -> &'static str {
        match self {
            OptionName::Rails => "rails",
            OptionName::Nics => "nics",
            OptionName::Transport => "transport",
            OptionName::Provider => "provider",
            OptionName::AuthToken => "auth_token",
            OptionName::Checksum => "checksum",
            OptionName::Port => "port",
        }
    }
}

impl Error {
    /// What kind of failure this is, for a program to match on (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use crate::weights::SyncError as S;
        match self {
            Error::Option { .. }
            | Error::AuthToken(_)
            | Error::NotInThisProcess { .. }
            | Error::RegionNotOnTransport(_)
            | Error::Metadata(_)
            | Error::NoSuchRegion { .. }
            | Error::WeightPlan(_)
            | Error::WeightCheck(_) => ErrorKind::InvalidInput,
            Error::Nics(
                crate::nics::NicError::Domains(_) | crate::nics::NicError::Interfaces(_),
            ) => ErrorKind::Transport,
            Error::Nics(_) => ErrorKind::InvalidInput,
            Error::Unavailable { .. } | Error::Cuda(_) | Error::NoCommonTransport { .. } => {
                ErrorKind::Unsupported
            }
            Error::Engine(e) => core_kind(e),
            Error::Rendezvous(crate::rendezvous::ClientError::Malformed(_)) => ErrorKind::Transport,
            Error::Rendezvous(_) => ErrorKind::PeerUnreachable,
            Error::Directory(_) => ErrorKind::Directory,
            Error::NotJoined { .. } | Error::NotLeft { .. } => ErrorKind::TimedOut,
            Error::ForeignHandle { .. } => ErrorKind::ForeignHandle,
            Error::Closed => ErrorKind::Closed,
            Error::PeerStalled { .. } => ErrorKind::PeerStalled,
            Error::ConnectionLost { source, .. } => core_kind(source),
            Error::Reconnect { .. } => ErrorKind::PeerUnreachable,
            Error::PreparedStale { .. }
            | Error::PeerRenamed { .. }
            | Error::StaleDescriptor { .. } => ErrorKind::InvalidInput,
            Error::Kv(_)
            | Error::KvRequestId { .. }
            | Error::KvNoSuchRank { .. }
            | Error::KvPeerLayout { .. }
            | Error::KvNotAttached { .. }
            | Error::KvNoSuchRegion { .. }
            | Error::KvWrongSide { .. }
            | Error::KvNoSuchLayer { .. } => ErrorKind::InvalidInput,
            Error::KvNotLanded { .. } => ErrorKind::TimedOut,
            Error::KvRequest { source, .. } => source.kind(),
            Error::WeightSync(s) => match s {
                S::Transfer { source, .. } => op_kind(source),
                S::Submit { source, .. } | S::Agent(source) => source.kind(),
                S::NotLanded { .. } | S::Unsettled { .. } => ErrorKind::TimedOut,
                S::Layout(_)
                | S::Plan(_)
                | S::Version { .. }
                | S::NoSuchRank { .. }
                | S::NotAttached { .. }
                | S::RegionCount { .. }
                | S::RegionTooShort { .. } => ErrorKind::InvalidInput,
                _ => ErrorKind::Transport,
            },
        }
    }

    /// An [`Error::Option`].
    pub fn option(option: OptionName, reason: impl Into<String>) -> Error {
        Error::Option {
            option,
            reason: reason.into(),
        }
    }
}

impl From<fabric_core::MemoryError> for Error {
    fn from(e: fabric_core::MemoryError) -> Error {
        Error::Engine(fabric_core::Error::Memory(e))
    }
}

/// Result of this crate's calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;
