//! [`Error`], the one error type of this crate: a variant per thing that fails, with the
//! layer's own error as its source.

use fabric_core::metadata::TransportKind;
use std::time::Duration;

/// Why a call of this crate failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An option is out of range or contradicts another (the message says which and why).
    #[error("{option}: {reason}")]
    Option {
        /// The option (as the `xfer` command spells it, e.g. `--rails`).
        option: &'static str,
        /// What is wrong with it.
        reason: String,
    },
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
    /// A weight-sync plan cannot be made from the layouts given.
    #[error(transparent)]
    WeightPlan(#[from] crate::weights::PlanError),
    /// A weight-sync plan is wrong for its layouts.
    #[error(transparent)]
    WeightCheck(#[from] crate::weights::CheckError),
    /// A weight sync (a push, a pull, a wait) failed.
    #[error(transparent)]
    WeightSync(#[from] crate::weights::SyncError),
}

impl Error {
    /// An [`Error::Option`].
    pub fn option(option: &'static str, reason: impl Into<String>) -> Error {
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
