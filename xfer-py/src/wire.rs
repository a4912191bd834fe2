//! The byte forms Python code ships to peers: an engine's [`EngineAddress`] and a
//! registration's [`RemoteDescriptor`]. Both are small, versioned and little-endian, so
//! that they travel through any channel (a socket, a queue, a file) as `bytes`.
//!
//! Decoding reads untrusted input: every malformed input is a typed [`WireError`], never a
//! panic, and no length taken from the input allocates before it is checked against the
//! input's own size.
//!
//! ```text
//! address:    "XFA" 1 | process id: u32 | transport name: u8 len + bytes | rails: u16 |
//!             per rail: u32 len + bytes
//! descriptor: "XFD" 1 | rails: u16 | per rail: addr u64, len u64, key u64
//! ```

use fabric_core::engine::RemoteDescriptor;
use fabric_core::{RemoteKey, RemoteRegion};

/// The first bytes of an encoded address (magic and version).
const ADDRESS_MAGIC: &[u8; 4] = b"XFA\x01";
/// The first bytes of an encoded descriptor (magic and version).
const DESCRIPTOR_MAGIC: &[u8; 4] = b"XFD\x01";
/// Most rails an address or descriptor may name (far above any real engine).
pub const MAX_RAILS: usize = 1024;
/// Bytes of one rail of a descriptor.
const RAIL_BYTES: usize = 24;

/// Why bytes are not a valid address or descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The input does not start with the expected magic (another kind of bytes, or a
    /// version this build does not read).
    #[error(
        "not an xfer {what} (or a version this build cannot read): expected it to start with {expected:?}"
    )]
    BadMagic {
        /// "address" or "descriptor".
        what: &'static str,
        /// The expected first bytes.
        expected: &'static [u8],
    },
    /// The input ends early.
    #[error("truncated {what}: needs {need} more bytes at offset {at}")]
    Truncated {
        /// "address" or "descriptor".
        what: &'static str,
        /// Where the missing bytes start.
        at: usize,
        /// How many are missing.
        need: usize,
    },
    /// Bytes follow the last field.
    #[error("{extra} unexpected bytes after the {what}")]
    Trailing {
        /// "address" or "descriptor".
        what: &'static str,
        /// How many.
        extra: usize,
    },
    /// A count is zero or too large.
    #[error("{what} names {rails} rails (must be 1..={MAX_RAILS})")]
    RailCount {
        /// "address" or "descriptor".
        what: &'static str,
        /// The count read.
        rails: usize,
    },
    /// The transport name is not UTF-8.
    #[error("the address's transport name is not UTF-8")]
    BadName,
    /// The rails of a descriptor disagree on the region's length.
    #[error("the descriptor's rails disagree on the region's length")]
    InconsistentLength,
}

/// An engine's address as peers receive it: its transport and one address per rail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineAddress {
    /// The id of the process that made it (the in-process `mem` transport connects
    /// engines of one process only, and says so instead of reaching another engine).
    pub process: u32,
    /// The transport's name ("tcp", "mem", "cuda-ipc").
    pub transport: String,
    /// The transport address of each rail.
    pub rails: Vec<Vec<u8>>,
}

impl EngineAddress {
    /// The byte form.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            8 + self.transport.len() + self.rails.iter().map(|r| 4 + r.len()).sum::<usize>(),
        );
        out.extend_from_slice(ADDRESS_MAGIC);
        out.extend_from_slice(&self.process.to_le_bytes());
        let name = &self.transport.as_bytes()[..self.transport.len().min(255)];
        out.push(name.len() as u8);
        out.extend_from_slice(name);
        out.extend_from_slice(&(self.rails.len().min(u16::MAX as usize) as u16).to_le_bytes());
        for r in &self.rails {
            out.extend_from_slice(&(r.len().min(u32::MAX as usize) as u32).to_le_bytes());
            out.extend_from_slice(r);
        }
        out
    }

    /// Reads the byte form (untrusted).
    pub fn decode(bytes: &[u8]) -> Result<EngineAddress, WireError> {
        let mut r = Reader::new(bytes, "address");
        r.magic(ADDRESS_MAGIC)?;
        let process = r.u32()?;
        let name_len = r.u8()? as usize;
        let transport = std::str::from_utf8(r.take(name_len)?)
            .map_err(|_| WireError::BadName)?
            .to_string();
        let n = r.u16()? as usize;
        if n == 0 || n > MAX_RAILS {
            return Err(WireError::RailCount {
                what: "address",
                rails: n,
            });
        }
        let mut rails = Vec::with_capacity(n);
        for _ in 0..n {
            let len = r.u32()? as usize;
            rails.push(r.take(len)?.to_vec());
        }
        r.finish()?;
        Ok(EngineAddress {
            process,
            transport,
            rails,
        })
    }
}

/// The byte form of a registration's descriptor.
pub fn encode_descriptor(d: &RemoteDescriptor) -> Vec<u8> {
    let n = d.rails.len().min(u16::MAX as usize);
    let mut out = Vec::with_capacity(6 + n * RAIL_BYTES);
    out.extend_from_slice(DESCRIPTOR_MAGIC);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    for r in &d.rails[..n] {
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.extend_from_slice(&r.key.0.to_le_bytes());
    }
    out
}

/// Reads a descriptor's byte form (untrusted).
pub fn decode_descriptor(bytes: &[u8]) -> Result<RemoteDescriptor, WireError> {
    let mut r = Reader::new(bytes, "descriptor");
    r.magic(DESCRIPTOR_MAGIC)?;
    let n = r.u16()? as usize;
    if n == 0 || n > MAX_RAILS {
        return Err(WireError::RailCount {
            what: "descriptor",
            rails: n,
        });
    }
    let mut rails = Vec::with_capacity(n);
    for _ in 0..n {
        let addr = r.u64()?;
        let len = r.u64()?;
        let key = RemoteKey(r.u64()?);
        rails.push(RemoteRegion { addr, len, key });
    }
    r.finish()?;
    if rails.iter().any(|x| x.len != rails[0].len) {
        return Err(WireError::InconsistentLength);
    }
    Ok(RemoteDescriptor { rails })
}

/// A cursor over untrusted bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { bytes, at: 0, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let left = self.bytes.len() - self.at;
        if n > left {
            return Err(WireError::Truncated {
                what: self.what,
                at: self.at,
                need: n - left,
            });
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn magic(&mut self, m: &'static [u8; 4]) -> Result<(), WireError> {
        match self.bytes.get(..4) {
            Some(head) if head == m => {
                self.at = 4;
                Ok(())
            }
            _ => Err(WireError::BadMagic {
                what: self.what,
                expected: m,
            }),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn finish(self) -> Result<(), WireError> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            extra => Err(WireError::Trailing {
                what: self.what,
                extra,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(n: usize) -> RemoteDescriptor {
        RemoteDescriptor {
            rails: (0..n as u64)
                .map(|i| RemoteRegion {
                    addr: 0x1000 * i,
                    len: 1 << 20,
                    key: RemoteKey(0xdead_beef_0000 + i),
                })
                .collect(),
        }
    }

    #[test]
    fn addresses_round_trip() {
        let a = EngineAddress {
            process: 4242,
            transport: "tcp".into(),
            rails: vec![b"127.0.0.1:4000".to_vec(), b"127.0.0.1:4001".to_vec()],
        };
        assert_eq!(EngineAddress::decode(&a.encode()).unwrap(), a);
    }

    #[test]
    fn descriptors_round_trip() {
        for n in [1, 2, 8] {
            let d = descriptor(n);
            assert_eq!(decode_descriptor(&encode_descriptor(&d)).unwrap(), d);
        }
    }

    #[test]
    fn every_truncation_of_a_descriptor_is_a_typed_error() {
        let bytes = encode_descriptor(&descriptor(3));
        for cut in 0..bytes.len() {
            let e = decode_descriptor(&bytes[..cut]).unwrap_err();
            assert!(
                matches!(e, WireError::Truncated { .. } | WireError::BadMagic { .. }),
                "cut at {cut}: {e:?}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(
            decode_descriptor(&long),
            Err(WireError::Trailing {
                what: "descriptor",
                extra: 1
            })
        );
    }

    #[test]
    fn every_truncation_of_an_address_is_a_typed_error() {
        let bytes = EngineAddress {
            process: 1,
            transport: "mem".into(),
            rails: vec![vec![1, 2, 3]],
        }
        .encode();
        for cut in 0..bytes.len() {
            assert!(
                EngineAddress::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn one_kind_is_not_taken_for_the_other() {
        let d = encode_descriptor(&descriptor(1));
        assert!(matches!(
            EngineAddress::decode(&d),
            Err(WireError::BadMagic { .. })
        ));
        let a = EngineAddress {
            process: 1,
            transport: "tcp".into(),
            rails: vec![vec![0; 24]],
        }
        .encode();
        assert!(matches!(
            decode_descriptor(&a),
            Err(WireError::BadMagic { .. })
        ));
    }

    #[test]
    fn huge_counts_and_lengths_are_refused_without_allocating() {
        let mut d = DESCRIPTOR_MAGIC.to_vec();
        d.extend_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            decode_descriptor(&d),
            Err(WireError::RailCount { .. })
        ));
        let mut a = ADDRESS_MAGIC.to_vec();
        a.extend_from_slice(&7u32.to_le_bytes());
        a.extend_from_slice(&[3, b't', b'c', b'p', 1, 0]);
        a.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            EngineAddress::decode(&a),
            Err(WireError::Truncated { .. })
        ));
        let mut zero = DESCRIPTOR_MAGIC.to_vec();
        zero.extend_from_slice(&0u16.to_le_bytes());
        assert!(matches!(
            decode_descriptor(&zero),
            Err(WireError::RailCount { rails: 0, .. })
        ));
    }

    #[test]
    fn rails_that_disagree_on_the_length_are_refused() {
        let mut d = descriptor(2);
        d.rails[1].len += 1;
        assert_eq!(
            decode_descriptor(&encode_descriptor(&d)),
            Err(WireError::InconsistentLength)
        );
    }
}
