//! Errors: [`Error`] for calls that fail at once, [`OpError`] for operations that fail later
//! (delivered in a [`Completion`](crate::Completion)).

use crate::types::{LocalKey, PeerId, RemoteKey};
use std::sync::Arc;

/// Why an operation failed, as reported in its completion (cheap to clone).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpError {
    /// The target knows no region with this key (never registered, or deregistered).
    #[error("remote key {0:?} is not valid at the target")]
    RemoteKeyInvalid(RemoteKey),
    /// The range falls outside the region.
    #[error("range {offset}+{len} is outside the region of {region_len} bytes")]
    OutOfBounds {
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The region was not registered with the access this operation needs.
    #[error("the region does not allow this access")]
    PermissionDenied,
    /// The local key names no registered region.
    #[error("local key {0:?} is not registered")]
    LocalKeyInvalid(LocalKey),
    /// The peer was removed while the operation was pending.
    #[error("{0} was removed")]
    PeerRemoved(PeerId),
    /// The peer does not answer or its connection broke.
    #[error("{peer} is unreachable: {reason}")]
    PeerUnreachable {
        /// The peer.
        peer: PeerId,
        /// What was observed.
        reason: String,
    },
    /// The operation did not complete in time. Reported only once the transport no longer
    /// touches the operation's memory (the engine stops posting a timed-out transfer and
    /// waits until every operation it had posted has completed or failed), so the source
    /// is the caller's again and resubmitting does not race the NIC.
    #[error("timed out")]
    TimedOut,
    /// A received message was longer than the posted receive buffer.
    #[error("message of {len} bytes does not fit the {capacity}-byte receive buffer")]
    Truncated {
        /// Length of the message.
        len: u64,
        /// Size of the posted buffer.
        capacity: u64,
    },
    /// The operation was cancelled (transport shut down, receive withdrawn).
    #[error("cancelled")]
    Cancelled,
    /// The target found the payload's checksum wrong (the bytes were corrupted on their
    /// way) and placed none of them. Only transports that carry checksums report it (TCP
    /// with `TcpConfig::checksum`); resubmitting is safe.
    #[error("the target found the payload corrupted (checksum mismatch) and placed nothing")]
    ChecksumMismatch,
    /// The peer reported an error that has no variant here.
    #[error("remote error: {0}")]
    Remote(String),
    /// A failure inside the transport, with its cause (reachable through
    /// [`std::error::Error::source`] and [`TransportError::downcast_ref`]).
    #[error(transparent)]
    Transport(TransportError),
}

impl OpError {
    /// A [`Transport`](OpError::Transport) failure caused by `cause` (a transport's own
    /// error type, a [`MemoryError`], an [`Error`], or a plain message).
    pub fn transport(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> OpError {
        OpError::Transport(TransportError::new(cause))
    }

    /// A [`Transport`](OpError::Transport) failure described by `context` ("device copy
    /// failed"), caused by `source`.
    pub fn transport_with(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> OpError {
        OpError::Transport(TransportError::with_context(context, source))
    }

    /// Whether retrying the same operation later may succeed (peer trouble, time-outs).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            OpError::PeerUnreachable { .. } | OpError::TimedOut | OpError::Cancelled
        )
    }
}

/// The cause of an [`OpError::Transport`]: a transport's own error, kept whole so that
/// callers can walk its [`source`](std::error::Error::source) chain or downcast it, and
/// shared so that the completion stays cheap to clone.
///
/// Two are equal when they read the same (completions are compared in tests; error types
/// of other crates need not implement `PartialEq`).
///
/// ```
/// use fabric_core::OpError;
/// let io = std::io::Error::other("link down");
/// let e = OpError::transport_with("device copy failed", io);
/// assert_eq!(e.to_string(), "transport error: device copy failed");
/// let source = std::error::Error::source(&e).unwrap();
/// assert_eq!(source.to_string(), "link down");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct TransportError(Shared);

impl TransportError {
    /// Wraps `cause`.
    pub fn new(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> TransportError {
        TransportError(Shared::new(cause))
    }

    /// `context` ("device copy failed"), caused by `source`.
    pub fn with_context(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> TransportError {
        TransportError::new(Contextual {
            context: context.into(),
            source: source.into(),
        })
    }

    /// The transport's error itself.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0.0
    }

    /// The transport's error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.0.downcast_ref::<E>()
    }
}

impl std::fmt::Display for TransportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "transport error: {}", self.0.0)
    }
}

impl std::fmt::Debug for TransportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0.0, f)
    }
}

impl std::error::Error for TransportError {
    // The wrapped error's own cause: its text is already this one's (see Display).
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.0.source()
    }
}

/// The cause of a [`MemoryError::Device`]: the memory layer's own error (gpu-mem's
/// `GpuMemError`, whose source is the CUDA driver's error with its code), kept whole so
/// that a caller can tell a sticky device fault from a transient failure by downcasting
/// it, and shared so that the error stays cheap to clone.
///
/// ```
/// use fabric_core::MemoryError;
/// let e = MemoryError::device(std::io::Error::other("uncorrectable ECC error"));
/// let MemoryError::Device(cause) = &e else { unreachable!() };
/// assert!(cause.downcast_ref::<std::io::Error>().is_some());
/// assert_eq!(e.to_string(), "device error: uncorrectable ECC error");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct DeviceError(Shared);

impl DeviceError {
    /// Wraps `cause`.
    pub fn new(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> DeviceError {
        DeviceError(Shared::new(cause))
    }

    /// The memory layer's error itself.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0.0
    }

    /// The memory layer's error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.0.downcast_ref::<E>()
    }
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0.0, f)
    }
}

impl std::fmt::Debug for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0.0, f)
    }
}

impl std::error::Error for DeviceError {
    // The wrapped error's own cause: its text is already this one's (see Display).
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.0.source()
    }
}

/// An error of another layer, shared: what [`TransportError`] and [`DeviceError`] hold.
/// Two are equal when they are the same or read the same.
#[derive(Clone)]
struct Shared(Arc<dyn std::error::Error + Send + Sync>);

impl Shared {
    fn new(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Shared {
        Shared(Arc::from(cause.into()))
    }
}

impl PartialEq for Shared {
    fn eq(&self, other: &Shared) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for Shared {}

/// A message with the error that caused it (see [`TransportError::with_context`]).
#[derive(Debug)]
struct Contextual {
    context: String,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl std::fmt::Display for Contextual {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.context)
    }
}

impl std::error::Error for Contextual {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// Which argument of a call was refused, and the values that made it so: the typed cause
/// of an [`Error::InvalidArgument`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    /// Lists of pages that must pair up have different lengths.
    #[error("{local} source pages but {remote} destination pages")]
    PageCounts {
        /// Pages on the source side.
        local: usize,
        /// Pages on the destination side.
        remote: usize,
    },
    /// A page is longer than the distance between pages (they would overlap).
    #[error("a page of {len} bytes is longer than the {stride}-byte stride")]
    PageExceedsStride {
        /// The page length.
        len: u64,
        /// The distance between pages.
        stride: u64,
    },
    /// A strided write's rows are malformed.
    #[error(
        "strided write of {count} rows of {len} bytes (source stride {src_stride}, destination stride {dst_stride}): {why}"
    )]
    Rows {
        /// Rows asked for.
        count: u64,
        /// A row's length.
        len: u64,
        /// Source stride.
        src_stride: u64,
        /// Destination stride.
        dst_stride: u64,
        /// What is wrong.
        why: String,
    },
    /// A page index times its stride does not fit in 64 bits.
    #[error("{side} page {page} overflows its offset")]
    PageOverflow {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// The page index.
        page: u64,
    },
    /// A segment's offset plus length, or the sum of a transfer's lengths, does not fit in
    /// 64 bits.
    #[error("{what} overflows")]
    Overflow {
        /// What overflowed ("segment 3: local range", "the sum of segment lengths").
        what: String,
    },
    /// A local range lies (partly) outside its region.
    #[error("{what}: local range {offset}+{len} is outside the {region_len}-byte region")]
    LocalOutOfRange {
        /// Which range ("segment 3", "SEND").
        what: String,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// A segment's remote range lies (partly) outside the remote region.
    #[error(
        "segment {segment}: {role} {offset}+{len} is outside the remote region of {region_len} bytes"
    )]
    RemoteOutOfRange {
        /// The segment's index in its transfer.
        segment: usize,
        /// What the range is to the operation ("destination" of a WRITE, "source" of a
        /// READ).
        role: &'static str,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The remote region's length.
        region_len: u64,
    },
    /// Two segments write the same bytes (the remote ones of a WRITE, the local ones of a
    /// READ), so what lands would depend on timing.
    #[error(
        "segments {first} and {second} overlap at the destination ({}+{} and {}+{})",
        first_range.0, first_range.1, second_range.0, second_range.1
    )]
    Overlap {
        /// The earlier segment.
        first: usize,
        /// The later segment.
        second: usize,
        /// The earlier one's destination range (offset, length).
        first_range: (u64, u64),
        /// The later one's destination range (offset, length).
        second_range: (u64, u64),
    },
    /// The two sides of a WRITE or READ differ in length.
    #[error("{op} of {from} bytes into {into} bytes: the lengths must be equal")]
    LengthMismatch {
        /// `"write"` or `"read"`.
        op: &'static str,
        /// Bytes at the source.
        from: u64,
        /// Bytes at the destination.
        into: u64,
    },
    /// An operation is longer than the transport carries in one message.
    #[error("a {len}-byte {op} exceeds the {limit}-byte limit ({setting})")]
    TooLarge {
        /// The operation ("WRITE", "READ", "SEND").
        op: &'static str,
        /// Its length.
        len: u64,
        /// The limit.
        limit: u64,
        /// The setting or property that sets the limit.
        setting: &'static str,
    },
    /// Memory that an operation writes into was registered without `LOCAL_WRITE`.
    #[error("{what} lands in a region registered without LOCAL_WRITE")]
    NotLocallyWritable {
        /// What would write into it ("a READ", "a received message").
        what: String,
    },
    /// Immediate data is carried by a transfer's first segment, and it has none.
    #[error("immediate data needs at least one segment (its region carries it)")]
    ImmWithoutSegment,
    /// A READ cannot carry immediate data: the region's owner hears nothing of it.
    #[error("a READ carries no immediate data (the owner hears nothing of it)")]
    ImmOnRead,
    /// A message size limit of 0 was asked for.
    #[error("max_msg_size is 0")]
    ZeroMessageSize,
    /// A rail group, or a transport's connection, with no rails.
    #[error("at least one rail is needed")]
    NoRails,
    /// A registration or peer of one rail group was used with another.
    #[error("registration or peer belongs to another rail group")]
    ForeignHandle,
    /// A remote descriptor lacks the rail a transfer would use.
    #[error("the remote descriptor has no rail {rail}")]
    NoSuchRail {
        /// The rail's index.
        rail: usize,
    },
    /// A text handed to a C library contains a NUL byte.
    #[error("{text:?} contains a NUL byte")]
    Nul {
        /// The text.
        text: String,
    },
}

/// Errors of calls into a transport or the engine that fail at once.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer address could not be parsed or belongs to another transport.
    #[error("invalid peer address: {0}")]
    InvalidAddress(String),
    /// The peer is not (or no longer) known.
    #[error("unknown peer {0}")]
    UnknownPeer(PeerId),
    /// An argument is out of range or contradicts another (a length, an offset, a count);
    /// [`Invalid`] says which, with the values.
    #[error("invalid argument: {0}")]
    InvalidArgument(Invalid),
    /// An operation was posted that could fail only one way; kept as a typed cause.
    #[error(transparent)]
    Op(#[from] OpError),
    /// A memory region could not be used.
    #[error("memory error: {0}")]
    Memory(#[from] MemoryError),
    /// An operating system call failed.
    #[error("{call} failed")]
    Io {
        /// The call that failed.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The backend failed in its own way (provider error and its text).
    #[error("{call} failed: {message}")]
    Backend {
        /// The call that failed.
        call: &'static str,
        /// The provider's description.
        message: String,
        /// The provider's error, where it has one.
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
    /// A wait ran out of time.
    #[error("timed out after {0:?} waiting for {1}")]
    TimedOut(std::time::Duration, &'static str),
    /// The engine's worker is gone (shut down or panicked).
    #[error("the engine worker has stopped")]
    EngineStopped,
    /// The feature is not supported by this backend.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The backend does not implement this operation (READ, on a backend that offers only
    /// WRITE and SEND).
    #[error("the {backend} backend does not support {op}")]
    UnsupportedOp {
        /// The backend's name ([`Transport::name`](crate::Transport::name)).
        backend: &'static str,
        /// The operation ("READ").
        op: &'static str,
    },
    /// The immediate value is reserved (a rail group's warm-up writes carry it, and rail
    /// groups never report it to the application): use any other value.
    #[error("immediate value {0:#x} is reserved for warm-up writes: use another value")]
    ReservedImm(u32),
    /// The region cannot be deregistered: transfers that use it have not finished. Their
    /// handles say when they have (a timed-out transfer, too, only once the transport has
    /// stopped touching its memory); deregister then.
    #[error("region {key:?} is in use by {transfers} unfinished transfer(s)")]
    RegionInUse {
        /// The region.
        key: crate::LocalKey,
        /// Transfers (and SENDs) that use it.
        transfers: usize,
    },
}

impl From<Invalid> for Error {
    fn from(i: Invalid) -> Error {
        Error::InvalidArgument(i)
    }
}

impl Error {
    /// Shorthand for an [`Error::Io`].
    pub fn io(call: &'static str, source: std::io::Error) -> Error {
        Error::Io { call, source }
    }

    /// Whether retrying later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Op(e) => e.is_retryable(),
            // A wait ran out, but what it waited for may still run: wait again, never
            // resubmit (the first could still be moving the same bytes).
            Error::TimedOut(..) => false,
            Error::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::WouldBlock
                    | std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::TimedOut
            ),
            _ => false,
        }
    }
}

/// Errors of the memory layer (allocation, copies, device access).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The range falls outside the buffer.
    #[error("range {offset}+{len} is outside the {size}-byte buffer")]
    OutOfBounds {
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Size of the buffer.
        size: u64,
    },
    /// Allocation failed.
    #[error("cannot allocate {0} bytes")]
    Alloc(u64),
    /// A device call failed; its cause is the memory layer's own error (with the driver's
    /// code), reachable through [`DeviceError::downcast_ref`] and
    /// [`source`](std::error::Error::source).
    #[error("device error: {0}")]
    Device(#[source] DeviceError),
    /// The memory cannot be used this way (e.g. device memory with no copy path).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl MemoryError {
    /// A [`Device`](MemoryError::Device) error caused by `cause` (the memory layer's own
    /// error, or a plain message).
    pub fn device(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> MemoryError {
        MemoryError::Device(DeviceError::new(cause))
    }
}

/// Result alias for fallible calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `e`'s message followed by those of its sources, each once (an error whose message
/// already carries its source's text does not repeat it): one line for a person to read.
pub fn report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        src = s.source();
    }
    msg
}
