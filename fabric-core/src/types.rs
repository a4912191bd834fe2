//! Small identifier and descriptor types shared by every layer.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A peer known to one transport (or engine). Assigned locally; meaningless elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PeerId(pub u64);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer#{}", self.0)
    }
}

/// The caller's tag for one posted operation; returned in its completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkRequestId(pub u64);

/// The key a peer presents to write into a registered region.
///
/// Backends choose how keys are made: the TCP backend draws them at random (64 bits),
/// libfabric providers may assign them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteKey(pub u64);

impl RemoteKey {
    /// A fresh unguessable key: 64 random bits, never 0, and not one that `taken` reports
    /// in use.
    pub fn random(taken: impl Fn(u64) -> bool) -> RemoteKey {
        loop {
            let k = random_u64();
            if k != 0 && !taken(k) {
                return RemoteKey(k);
            }
        }
    }
}

/// 64 random bits from the operating system (for keys, instance ids, socket names).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // getrandom fails only without an entropy source; fall back to address-space entropy.
    if getrandom::fill(&mut b).is_err() {
        let x = &b as *const _ as u64 ^ std::process::id() as u64;
        return x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    u64::from_le_bytes(b)
}

impl fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RemoteKey({:#018x})", self.0)
    }
}

/// The local handle of a registered region, valid on the transport that registered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalKey(pub u64);

/// What a registration allows. Combine with `|`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Access(u8);

impl Access {
    /// No access beyond being the source of local operations (SEND, WRITE source).
    pub const NONE: Access = Access(0);
    /// The region may be the target of local receives.
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may WRITE into the region.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may READ from the region.
    pub const REMOTE_READ: Access = Access(4);
    /// Everything.
    pub const ALL: Access = Access(7);

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// Builds an access set from raw bits; unknown bits are dropped.
    pub fn from_bits_truncate(bits: u8) -> Access {
        Access(bits & Self::ALL.0)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.contains(Access::LOCAL_WRITE) {
            parts.push("LOCAL_WRITE");
        }
        if self.contains(Access::REMOTE_WRITE) {
            parts.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_READ) {
            parts.push("REMOTE_READ");
        }
        if parts.is_empty() {
            parts.push("NONE");
        }
        write!(f, "Access({})", parts.join(" | "))
    }
}

/// What a peer needs to WRITE into a registered region: ship it out of band (it is serde).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Base address on the wire: the virtual address for providers that address memory
    /// virtually, 0 for offset-addressed backends. Transports add offsets to it.
    pub addr: u64,
    /// Length of the region in bytes.
    pub len: u64,
    /// The key that authorises access.
    pub key: RemoteKey,
}

/// The result of a registration: the local handle and the descriptor for peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Local handle, for posting operations on this transport.
    pub local: LocalKey,
    /// Descriptor to hand to peers.
    pub remote: RemoteRegion,
}

/// A byte range of a locally registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalSlice {
    /// The registered region.
    pub key: LocalKey,
    /// Offset into the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A byte range of a peer's registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSlice {
    /// The peer's region, as it was shipped.
    pub region: RemoteRegion,
    /// Offset into the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Rows of a strided WRITE: `count` rows of the slices' length, row `i` read at the source
/// slice's offset plus `i * src_stride` and written at the destination slice's offset plus
/// `i * dst_stride` (see [`Transport::post_write_rows`](crate::Transport::post_write_rows)).
/// The rows of a tensor's tensor-parallel piece are one such write, where plain writes
/// would need one per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// Rows, two or more.
    pub count: u64,
    /// From one row's source start to the next's, at least the row's length.
    pub src_stride: u64,
    /// From one row's destination start to the next's, at least the row's length (rows
    /// never overlap).
    pub dst_stride: u64,
}

impl Rows {
    /// Checks a strided WRITE whose rows are `len` bytes long: two rows or more, strides
    /// no shorter than a row, and the ranges it spans expressible in 64 bits. Returns the
    /// span of its rows on each side (first row's start to last row's end) and the
    /// bytes it moves: `(src_span, dst_span, bytes)`.
    pub fn check(&self, len: u64) -> crate::Result<(u64, u64, u64)> {
        let bad = |why: &str| -> crate::Error {
            crate::Invalid::Rows {
                count: self.count,
                len,
                src_stride: self.src_stride,
                dst_stride: self.dst_stride,
                why: why.into(),
            }
            .into()
        };
        if self.count < 2 {
            return Err(bad("a strided write has two rows or more"));
        }
        if self.src_stride < len || self.dst_stride < len {
            return Err(bad("a stride is shorter than a row"));
        }
        let span = |stride: u64| {
            (self.count - 1)
                .checked_mul(stride)
                .and_then(|v| v.checked_add(len))
        };
        match (
            span(self.src_stride),
            span(self.dst_stride),
            self.count.checked_mul(len),
        ) {
            (Some(s), Some(d), Some(b)) => Ok((s, d, b)),
            _ => Err(bad("the rows span more than 64 bits of offsets")),
        }
    }
}

/// Checks that a WRITE's source and destination have the same length, as
/// [`Transport::post_write`](crate::Transport::post_write) requires of every backend.
pub fn check_write_lengths(src: &LocalSlice, dst: &RemoteSlice) -> crate::Result<()> {
    if src.len == dst.len {
        Ok(())
    } else {
        Err(crate::Invalid::LengthMismatch {
            op: "write",
            from: src.len,
            into: dst.len,
        }
        .into())
    }
}

/// Checks that a READ's destination and source have the same length, as
/// [`Transport::post_read`](crate::Transport::post_read) requires of every backend.
pub fn check_read_lengths(dst: &LocalSlice, src: &RemoteSlice) -> crate::Result<()> {
    if dst.len == src.len {
        Ok(())
    } else {
        Err(crate::Invalid::LengthMismatch {
            op: "read",
            from: src.len,
            into: dst.len,
        }
        .into())
    }
}
