//! The exception hierarchy: `xfer.Error` and one subclass per kind of the library's errors
//! ([`xfer::Error`], and the engine's [`fabric_core::Error`] and [`fabric_core::OpError`]
//! under it), each raised with the Rust message.

use fabric_core::error::report;
use fabric_core::{Error, MemoryError, OpError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    xfer,
    XferError,
    PyException,
    "Base class of every error xfer raises."
);
create_exception!(
    xfer,
    TimedOut,
    XferError,
    "A wait or a transfer ran out of time. A wait that timed out ends only the wait: the transfer goes on."
);
create_exception!(
    xfer,
    PeerStalled,
    TimedOut,
    "A transfer made no progress for the agent's stall_timeout while its peer's connection stands (a stopped or descheduled process): the transfer goes on; wait again or cancel."
);
create_exception!(
    xfer,
    PeerUnreachable,
    XferError,
    "The peer does not answer or its connection broke (retryable)."
);
create_exception!(
    xfer,
    PeerRemoved,
    XferError,
    "The peer was removed while the transfer was pending."
);
create_exception!(
    xfer,
    RemoteKeyInvalid,
    XferError,
    "The target knows no region with this descriptor's key (never registered, or closed)."
);
create_exception!(
    xfer,
    OutOfBounds,
    XferError,
    "A range falls outside the target's region."
);
create_exception!(
    xfer,
    PermissionDenied,
    XferError,
    "The target region was not registered with remote_write=True."
);
create_exception!(
    xfer,
    InvalidArgument,
    XferError,
    "An argument is wrong (bad bytes, a range outside the local region, memory of the wrong kind, ...); the message names the fix."
);
create_exception!(
    xfer,
    ForeignHandle,
    InvalidArgument,
    "A Peer or Region of another agent was given to this one."
);
create_exception!(
    xfer,
    RegionInvalidated,
    InvalidArgument,
    "The registered tensor's storage was resized or replaced after registration (torch's resize_ reallocates it), so the memory registered may have been freed: register the tensor again. Raised by the next local use of the registration (a transfer, a push or pull, close)."
);
create_exception!(
    xfer,
    Cancelled,
    XferError,
    "The transfer was cancelled (the agent shut down)."
);
create_exception!(
    xfer,
    AgentClosed,
    XferError,
    "The agent is closed (or its workers stopped). `xfer.EngineClosed` is its old name, deprecated."
);
create_exception!(
    xfer,
    RegionInUse,
    XferError,
    "The registration cannot be closed yet: transfers that use it have not finished."
);
create_exception!(
    xfer,
    Unsupported,
    XferError,
    "This build, transport or machine cannot do what was asked."
);
create_exception!(
    xfer,
    TransportFailed,
    XferError,
    "The transport failed in its own way (OS, provider or device error)."
);
create_exception!(
    xfer,
    DirectoryError,
    XferError,
    "The cluster directory failed: etcd unreachable or too slow, a bad URL, a record refused."
);

/// Registers the exception classes in the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<XferError>())?;
    m.add("TimedOut", py.get_type::<TimedOut>())?;
    m.add("PeerStalled", py.get_type::<PeerStalled>())?;
    m.add("PeerUnreachable", py.get_type::<PeerUnreachable>())?;
    m.add("PeerRemoved", py.get_type::<PeerRemoved>())?;
    m.add("RemoteKeyInvalid", py.get_type::<RemoteKeyInvalid>())?;
    m.add("OutOfBounds", py.get_type::<OutOfBounds>())?;
    m.add("PermissionDenied", py.get_type::<PermissionDenied>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("ForeignHandle", py.get_type::<ForeignHandle>())?;
    m.add("RegionInvalidated", py.get_type::<RegionInvalidated>())?;
    m.add("Cancelled", py.get_type::<Cancelled>())?;
    m.add("AgentClosed", py.get_type::<AgentClosed>())?;
    m.add("RegionInUse", py.get_type::<RegionInUse>())?;
    m.add("Unsupported", py.get_type::<Unsupported>())?;
    m.add("TransportFailed", py.get_type::<TransportFailed>())?;
    m.add("DirectoryError", py.get_type::<DirectoryError>())?;
    Ok(())
}

/// The exception for an operation's failure.
pub fn op_error(e: &OpError) -> PyErr {
    let msg = e.to_string();
    match e {
        OpError::RemoteKeyInvalid(_) => RemoteKeyInvalid::new_err(msg),
        OpError::OutOfBounds { .. } => OutOfBounds::new_err(msg),
        OpError::PermissionDenied => PermissionDenied::new_err(msg),
        OpError::LocalKeyInvalid(_) => InvalidArgument::new_err(msg),
        OpError::PeerRemoved(_) => PeerRemoved::new_err(msg),
        OpError::PeerUnreachable { .. } => PeerUnreachable::new_err(msg),
        OpError::TimedOut => TimedOut::new_err(msg),
        OpError::Cancelled => Cancelled::new_err(msg),
        _ => TransportFailed::new_err(msg),
    }
}

/// The exception for an engine call's failure.
pub fn engine_error(e: &Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Op(op) => op_error(op),
        Error::InvalidAddress(_) | Error::UnknownPeer(_) | Error::InvalidArgument(_) => {
            InvalidArgument::new_err(msg)
        }
        Error::Memory(MemoryError::OutOfBounds { .. }) => InvalidArgument::new_err(msg),
        Error::Memory(MemoryError::Unsupported(_)) | Error::Unsupported(_) => {
            Unsupported::new_err(msg)
        }
        Error::TimedOut(..) => TimedOut::new_err(msg),
        Error::EngineStopped => AgentClosed::new_err(msg),
        Error::RegionInUse { .. } => RegionInUse::new_err(msg),
        _ => TransportFailed::new_err(msg),
    }
}

/// The exception for a failed call of the agent (building it included): option mistakes
/// (a token file unreadable or empty, a token and a file both, require_auth unmet),
/// bad metadata and peers that cannot be reached over any common transport are
/// `InvalidArgument`, a transport this machine cannot run is `Unsupported`, the directory's
/// errors map as [`directory_error`] says and the engine's as [`engine_error`] says. KV
/// errors: bad layouts, requests, ranks, layers and ids are `InvalidArgument`, a request
/// (or layer) not landed in time is `TimedOut`, and a failed transfer of a request is
/// raised as its cause's class with a message that names the request, layer and peer rank.
pub fn agent_error(e: &xfer::Error) -> PyErr {
    use xfer::Error as X;
    match e {
        X::Option { .. } => InvalidArgument::new_err(e.to_string()),
        // A token file unreadable, empty or given with a token, or require_auth without a
        // token beyond loopback: the arguments' fault (the chain names the file's OS error).
        X::AuthToken(_) => InvalidArgument::new_err(report(e)),
        X::Nics(
            n @ (xfer::layers::nics::NicError::Domains(_)
            | xfer::layers::nics::NicError::Interfaces(_)),
        ) => TransportFailed::new_err(report(n)),
        X::Nics(n) => InvalidArgument::new_err(format!("nics: {}", report(n))),
        X::Unavailable { .. } => Unsupported::new_err(report(e)),
        X::Cuda(c) => Unsupported::new_err(format!("CUDA: {}", report(c))),
        X::NoCommonTransport { .. } | X::RegionNotOnTransport(_) | X::NotInThisProcess { .. } => {
            InvalidArgument::new_err(e.to_string())
        }
        X::Metadata(m) => metadata_error("metadata", m),
        X::Directory(d) => directory_error(d),
        X::NoSuchRegion { .. } => InvalidArgument::new_err(e.to_string()),
        X::ForeignHandle { what, .. } => ForeignHandle::new_err(format!(
            "this {what} belongs to another agent: use the one this agent returned ({e})"
        )),
        X::NotJoined { .. } | X::NotLeft { .. } => TimedOut::new_err(e.to_string()),
        X::Engine(inner) => engine_error(inner),
        X::Closed => AgentClosed::new_err(e.to_string()),
        X::PeerStalled { .. } => PeerStalled::new_err(e.to_string()),
        // A transfer on a connection that broke, or connecting again failed: the agent
        // tries again at the next transfer.
        X::ConnectionLost { .. } | X::Reconnect { .. } => PeerUnreachable::new_err(report(e)),
        // A descriptor of a peer's previous life, a plan of an earlier connection, another
        // agent's info: the caller asks again (for the region, prepares again).
        X::StaleDescriptor { .. } | X::PreparedStale { .. } | X::PeerRenamed { .. } => {
            InvalidArgument::new_err(e.to_string())
        }
        X::WeightSync(s) => sync_error(s),
        X::WeightPlan(_) | X::WeightCheck(_) => InvalidArgument::new_err(report(e)),
        X::Kv(_)
        | X::KvRequestId { .. }
        | X::KvNoSuchRank { .. }
        | X::KvPeerLayout { .. }
        | X::KvNotAttached { .. }
        | X::KvNoSuchRegion { .. }
        | X::KvWrongSide { .. }
        | X::KvNoSuchLayer { .. } => InvalidArgument::new_err(report(e)),
        X::KvNotLanded { .. } => TimedOut::new_err(report(e)),
        X::KvRequest { source, .. } => {
            // The class of what failed (PeerUnreachable, TimedOut, ...), the message naming
            // the request, the layer and the peer rank first.
            let typed = agent_error(source);
            Python::attach(|py| PyErr::from_type(typed.get_type(py), report(e)))
        }
        _ => TransportFailed::new_err(report(e)),
    }
}

/// The exception for a weight sync's failure ([`xfer::weights::SyncError`]), with the
/// whole chain in its message (it names the destination or source concerned): a failed
/// transfer is raised as its engine error's class (`PeerUnreachable`, `PeerRemoved`,
/// `TimedOut`, ...), an update that did not land or sources that did not settle in time as
/// `TimedOut`, the agent's own failures as [`agent_error`] says, and what the caller gave
/// wrong (a version, a rank, regions, layouts) as `InvalidArgument`.
pub fn sync_error(e: &xfer::weights::SyncError) -> PyErr {
    use xfer::weights::SyncError as S;
    let msg = report(e);
    match e {
        S::Transfer { source, .. } => {
            let typed = op_error(source);
            Python::attach(|py| {
                let ty = typed.get_type(py);
                PyErr::from_type(ty, msg)
            })
        }
        S::Submit { source, .. } => {
            let typed = agent_error(source);
            Python::attach(|py| PyErr::from_type(typed.get_type(py), msg))
        }
        S::NotLanded { .. } | S::Unsettled { .. } | S::Torn { .. } => TimedOut::new_err(msg),
        S::Agent(a) => agent_error(a),
        _ => InvalidArgument::new_err(msg),
    }
}

/// The exception of a weight-sync wait for members (`wait_attached`, `wait_sources`): one
/// that ran out of time (`NotAttached`) is `TimedOut`, the rest as [`sync_error`].
pub fn member_wait_error(e: &xfer::weights::SyncError) -> PyErr {
    match e {
        xfer::weights::SyncError::NotAttached { .. } => TimedOut::new_err(report(e)),
        _ => sync_error(e),
    }
}

/// The exception for bytes (`what`: an address, a descriptor) that are not valid
/// metadata: `InvalidArgument` naming the metadata error.
pub fn metadata_error(what: &str, e: &fabric_core::metadata::MetadataError) -> PyErr {
    InvalidArgument::new_err(format!("{what}: {}", report(e)))
}

/// `InvalidArgument(msg)`.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidArgument::new_err(msg.into())
}

/// A directory error as Python sees it: a timeout is `TimedOut`, the rest `DirectoryError`;
/// the message carries every source.
pub fn directory_error(e: &directory::Error) -> PyErr {
    let msg = fabric_core::error::report(e);
    match e {
        directory::Error::TimedOut { .. } => TimedOut::new_err(msg),
        _ => DirectoryError::new_err(msg),
    }
}
