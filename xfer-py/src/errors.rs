//! The exception hierarchy: `xfer.Error` and one subclass per kind of the engine's errors
//! ([`fabric_core::Error`], [`fabric_core::OpError`]), each raised with the Rust message.

use crate::backend::BuildError;
use crate::wire::WireError;
use fabric_core::{Error, MemoryError, OpError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    xfer,
    XferError,
    PyException,
    "Base class of every error the xfer engine raises."
);
create_exception!(
    xfer,
    TimedOut,
    XferError,
    "A wait or a transfer ran out of time. A wait that timed out ends only the wait: the transfer goes on."
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
    Cancelled,
    XferError,
    "The transfer was cancelled (the engine shut down)."
);
create_exception!(
    xfer,
    EngineClosed,
    XferError,
    "The engine is closed (or its worker stopped)."
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
    m.add("PeerUnreachable", py.get_type::<PeerUnreachable>())?;
    m.add("PeerRemoved", py.get_type::<PeerRemoved>())?;
    m.add("RemoteKeyInvalid", py.get_type::<RemoteKeyInvalid>())?;
    m.add("OutOfBounds", py.get_type::<OutOfBounds>())?;
    m.add("PermissionDenied", py.get_type::<PermissionDenied>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("Cancelled", py.get_type::<Cancelled>())?;
    m.add("EngineClosed", py.get_type::<EngineClosed>())?;
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
        Error::EngineStopped => EngineClosed::new_err(msg),
        Error::RegionInUse { .. } => RegionInUse::new_err(msg),
        _ => TransportFailed::new_err(msg),
    }
}

/// The exception for an engine that could not be built.
pub fn build_error(e: &BuildError) -> PyErr {
    match e {
        BuildError::Usage(m) => InvalidArgument::new_err(m.clone()),
        BuildError::Unsupported(_) | BuildError::Cuda(_) => Unsupported::new_err(e.to_string()),
        BuildError::Engine(inner) => engine_error(inner),
    }
}

/// The exception for bytes that are not an address or descriptor.
pub fn wire_error(e: &WireError) -> PyErr {
    InvalidArgument::new_err(e.to_string())
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
