//! The one metadata format of xfer: what an agent says about itself ([`AgentInfo`]) and what
//! a peer needs to reach one of its registered regions ([`RegionDescriptor`]).
//!
//! Both are plain serde types. They travel in two forms of the same values:
//! - **JSON** (any serde human-readable format): in the cluster directory's records and on
//!   the rendezvous's control connection, readable by people and tools; byte strings
//!   (transport addresses) appear as lowercase hex there;
//! - **bytes** ([`AgentInfo::to_bytes`], [`RegionDescriptor::to_bytes`]): a four-byte magic
//!   (`XFAG` for an agent, `XFRD` for a region) followed by the value in postcard's compact
//!   encoding, for programs that ship metadata themselves (Python's `bytes`, a queue, a
//!   file).
//!
//! Every field is written in both forms (none is skipped when empty: the byte form has no
//! field names, so a skipped field would shift the others). Every value carries
//! [`METADATA_VERSION`]; a reader refuses another version by name
//! rather than misreading it. Decoding reads untrusted input: every malformed input is a
//! typed [`MetadataError`], never a panic, and inputs are bounded in size
//! ([`MAX_METADATA_BYTES`]) before anything is allocated from them.
//!
//! ```
//! use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};
//! use fabric_core::MemoryLocation;
//! let me = AgentInfo {
//!     transports: vec![TransportInfo::new(TransportKind::Tcp, vec![b"tcp://10.0.0.5:4000".to_vec()])],
//!     ..AgentInfo::new("prefill-0", "boot-id-of-this-host", MemoryLocation::Cuda { device: 0 })
//! };
//! let bytes = me.to_bytes().unwrap();
//! assert_eq!(AgentInfo::from_bytes(&bytes).unwrap(), me);
//! let json = serde_json::to_string(&me).unwrap();
//! assert!(json.contains("\"kind\":\"tcp\""), "{json}");
//! assert!(AgentInfo::from_bytes(&bytes[..10]).is_err());
//! ```

use crate::engine::RemoteDescriptor;
use crate::memory::MemoryLocation;
use crate::types::Access;
use serde::{Deserialize, Serialize};

/// The metadata format this build writes, and the only one it reads. Version 2 added
/// [`RegionDescriptor::owner`] (version 1's descriptors cannot be told apart between their
/// owner's lives, and are refused by name).
pub const METADATA_VERSION: u32 = 2;

/// The largest encoded agent or region metadata accepted (a few KiB at 32 rails).
pub const MAX_METADATA_BYTES: usize = 1 << 20;

/// The most rails one transport of an agent (or one region) may list.
pub const MAX_RAILS: usize = 1024;

/// First bytes of an agent's byte form.
const AGENT_MAGIC: &[u8; 4] = b"XFAG";
/// First bytes of a region descriptor's byte form.
const REGION_MAGIC: &[u8; 4] = b"XFRD";

/// The transports of xfer, by the name they travel under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransportKind {
    /// RDMA semantics over TCP sockets (`transport-tcp`).
    Tcp,
    /// Device-to-device copies through CUDA IPC between processes of one host
    /// (`transport-cuda-ipc`).
    CudaIpc,
    /// libfabric FI_EP_RDM: EFA on AWS, or another provider (`transport-efa`).
    Efa,
    /// In-process copies between engines of one process (`fabric_core::mem`).
    Mem,
}

impl TransportKind {
    /// Every kind, in the order a peer is offered them.
    pub const ALL: [TransportKind; 4] = [
        TransportKind::CudaIpc,
        TransportKind::Efa,
        TransportKind::Tcp,
        TransportKind::Mem,
    ];

    /// The name it travels under (`tcp`, `cuda-ipc`, `efa`, `mem`).
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::CudaIpc => "cuda-ipc",
            TransportKind::Efa => "efa",
            TransportKind::Mem => "mem",
        }
    }

    /// The kind named `name` (as [`name`](Self::name) spells it).
    pub fn from_name(name: &str) -> Option<TransportKind> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One transport an agent offers: its rails' addresses (what peers pass to `add_peer`) and
/// the NICs they run on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportInfo {
    /// Which transport.
    pub kind: TransportKind,
    /// The libfabric provider, for [`TransportKind::Efa`] (`efa`, `tcp`, `shm`, ...).
    #[serde(default)]
    pub provider: Option<String>,
    /// The transport address of each rail, in rail order.
    #[serde(with = "byte_strings")]
    pub rails: Vec<Vec<u8>>,
    /// The NIC each rail runs on, in rail order (empty: not bound to NICs).
    #[serde(default)]
    pub nics: Vec<String>,
}

impl TransportInfo {
    /// A transport of `kind` with these rail addresses, no provider and no NICs named.
    pub fn new(kind: TransportKind, rails: Vec<Vec<u8>>) -> TransportInfo {
        TransportInfo {
            kind,
            provider: None,
            rails,
            nics: Vec::new(),
        }
    }
}

/// What an agent says about itself: who it is, where it runs, which memory it moves and
/// how to reach it over each transport it offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// The format ([`METADATA_VERSION`]).
    pub version: u32,
    /// The agent's name (unique in its cluster when it publishes itself).
    pub name: String,
    /// Random per agent: an agent restarted under the same name is a new instance, and
    /// peers must reconnect rather than trust the old addresses.
    pub instance: u64,
    /// The host's boot id (`/proc/sys/kernel/random/boot_id`): two agents with the same
    /// boot id run on one host (two pods of one node share it; their hostnames differ),
    /// which is what CUDA IPC needs.
    pub boot_id: String,
    /// The host's name, for people.
    #[serde(default)]
    pub hostname: String,
    /// The network namespace it runs in (`/proc/self/ns/net`'s target, e.g.
    /// `net:[4026531840]`; empty if unknown). CUDA IPC's control sockets are abstract Unix
    /// sockets, which only processes of one network namespace reach: two pods of one node
    /// share the boot id but not, as a rule, the namespace.
    #[serde(default)]
    pub net_namespace: String,
    /// Where the memory it registers lives (host, or a CUDA device).
    pub memory: MemoryLocation,
    /// The transports it offers, each with its rails.
    pub transports: Vec<TransportInfo>,
    /// Where its rendezvous listens (`HOST:PORT`), if it serves one.
    #[serde(default)]
    pub control: Option<String>,
}

impl AgentInfo {
    /// An agent named `name` on the host of `boot_id`, with a fresh instance id and no
    /// transport yet.
    pub fn new(name: &str, boot_id: &str, memory: MemoryLocation) -> AgentInfo {
        AgentInfo {
            version: METADATA_VERSION,
            name: name.to_owned(),
            instance: crate::types::random_u64(),
            boot_id: boot_id.to_owned(),
            hostname: String::new(),
            net_namespace: String::new(),
            memory,
            transports: Vec::new(),
            control: None,
        }
    }

    /// The transport of `kind` it offers, if any.
    pub fn transport(&self, kind: TransportKind) -> Option<&TransportInfo> {
        self.transports.iter().find(|t| t.kind == kind)
    }

    /// Whether it runs on the same host as `other` (the same boot id).
    pub fn same_host(&self, other: &AgentInfo) -> bool {
        !self.boot_id.is_empty() && self.boot_id == other.boot_id
    }

    /// Whether it runs in the same network namespace of the same host as `other`: what a
    /// transport over abstract Unix sockets (cuda-ipc) needs.
    pub fn same_net_namespace(&self, other: &AgentInfo) -> bool {
        self.same_host(other)
            && !self.net_namespace.is_empty()
            && self.net_namespace == other.net_namespace
    }

    /// Its byte form (see the [module docs](self)).
    pub fn to_bytes(&self) -> Result<Vec<u8>, MetadataError> {
        self.check()?;
        encode(AGENT_MAGIC, self)
    }

    /// Reads the byte form, checking magic, size, version and contents.
    pub fn from_bytes(bytes: &[u8]) -> Result<AgentInfo, MetadataError> {
        let a: AgentInfo = decode(AGENT_MAGIC, "agent", bytes)?;
        a.check()?;
        Ok(a)
    }

    /// Checks what a reader must be able to rely on: the version, a name, and rails that
    /// are there and within bounds.
    pub fn check(&self) -> Result<(), MetadataError> {
        check_version(self.version)?;
        if self.name.is_empty() {
            return Err(MetadataError::Invalid("an agent without a name".into()));
        }
        for t in &self.transports {
            if t.rails.is_empty() || t.rails.len() > MAX_RAILS {
                return Err(MetadataError::Invalid(format!(
                    "transport {} lists {} rails (must be 1..={MAX_RAILS})",
                    t.kind,
                    t.rails.len()
                )));
            }
            if !t.nics.is_empty() && t.nics.len() != t.rails.len() {
                return Err(MetadataError::Invalid(format!(
                    "transport {} names {} NICs for {} rails",
                    t.kind,
                    t.nics.len(),
                    t.rails.len()
                )));
            }
        }
        let mut kinds: Vec<TransportKind> = self.transports.iter().map(|t| t.kind).collect();
        kinds.sort();
        if kinds.windows(2).any(|w| w[0] == w[1]) {
            return Err(MetadataError::Invalid("a transport is listed twice".into()));
        }
        Ok(())
    }
}

/// What a peer needs to reach a registered region: its length, where it lives, what it
/// allows, and its keys on every transport its owner registered it on (one key per rail).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// The format ([`METADATA_VERSION`]).
    pub version: u32,
    /// The instance ([`AgentInfo::instance`]) of the agent that registered it: a peer
    /// refuses the descriptor once that agent has been replaced by another instance (a
    /// restart under the same name and address), whose keys may name other memory.
    pub owner: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Where its bytes live.
    pub memory: MemoryLocation,
    /// What peers may do with it ([`Access::REMOTE_WRITE`], [`Access::REMOTE_READ`]).
    pub access: Access,
    /// The region as registered on each transport of its owner.
    pub transports: Vec<(TransportKind, RemoteDescriptor)>,
}

impl RegionDescriptor {
    /// The region's keys on transport `kind`, if its owner registered it there.
    pub fn on(&self, kind: TransportKind) -> Option<&RemoteDescriptor> {
        self.transports
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, d)| d)
    }

    /// Its byte form (see the [module docs](self)).
    pub fn to_bytes(&self) -> Result<Vec<u8>, MetadataError> {
        self.check()?;
        encode(REGION_MAGIC, self)
    }

    /// Reads the byte form, checking magic, size, version and contents.
    pub fn from_bytes(bytes: &[u8]) -> Result<RegionDescriptor, MetadataError> {
        let r: RegionDescriptor = decode(REGION_MAGIC, "region descriptor", bytes)?;
        r.check()?;
        Ok(r)
    }

    /// Checks the version and that every transport's rails describe a region of `len`
    /// bytes.
    pub fn check(&self) -> Result<(), MetadataError> {
        check_version(self.version)?;
        if self.transports.is_empty() {
            return Err(MetadataError::Invalid(
                "a region descriptor without any transport".into(),
            ));
        }
        for (kind, d) in &self.transports {
            if d.rails.is_empty() || d.rails.len() > MAX_RAILS {
                return Err(MetadataError::Invalid(format!(
                    "the region lists {} rails on {kind} (must be 1..={MAX_RAILS})",
                    d.rails.len()
                )));
            }
            if d.rails.iter().any(|r| r.len != self.len) {
                return Err(MetadataError::Invalid(format!(
                    "the region's rails on {kind} disagree with its length of {} bytes",
                    self.len
                )));
            }
        }
        Ok(())
    }
}

/// Why metadata could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// The bytes are not metadata of the expected kind.
    #[error("not an xfer {what}: it does not start with {expected:?}")]
    BadMagic {
        /// "agent" or "region descriptor".
        what: &'static str,
        /// The magic expected.
        expected: &'static str,
    },
    /// Larger than [`MAX_METADATA_BYTES`].
    #[error("metadata of {0} bytes is larger than the {MAX_METADATA_BYTES} accepted")]
    TooLarge(usize),
    /// Written by a build of another metadata version.
    #[error("metadata version {found} (this build reads version {METADATA_VERSION})")]
    Version {
        /// The version read.
        found: u32,
    },
    /// The bytes after the magic do not decode.
    #[error("malformed {what}")]
    Malformed {
        /// "agent" or "region descriptor".
        what: &'static str,
        /// postcard's error.
        #[source]
        source: postcard::Error,
    },
    /// The value decodes but is not usable (no rails, lengths that disagree, ...).
    #[error("invalid metadata: {0}")]
    Invalid(String),
}

fn check_version(found: u32) -> Result<(), MetadataError> {
    if found == METADATA_VERSION {
        Ok(())
    } else {
        Err(MetadataError::Version { found })
    }
}

fn encode<T: Serialize>(magic: &[u8; 4], value: &T) -> Result<Vec<u8>, MetadataError> {
    let mut out = magic.to_vec();
    let body = postcard::to_allocvec(value).map_err(|source| MetadataError::Malformed {
        what: "metadata",
        source,
    })?;
    out.extend_from_slice(&body);
    if out.len() > MAX_METADATA_BYTES {
        return Err(MetadataError::TooLarge(out.len()));
    }
    Ok(out)
}

fn decode<T: for<'de> Deserialize<'de>>(
    magic: &'static [u8; 4],
    what: &'static str,
    bytes: &[u8],
) -> Result<T, MetadataError> {
    if bytes.len() > MAX_METADATA_BYTES {
        return Err(MetadataError::TooLarge(bytes.len()));
    }
    let body = bytes
        .strip_prefix(magic.as_slice())
        .ok_or(MetadataError::BadMagic {
            what,
            expected: std::str::from_utf8(magic).unwrap_or("?"),
        })?;
    // The version is the first field of both types: read it alone first, so that another
    // version is named as such rather than reported as whatever field it changed.
    let (version, _) = postcard::take_from_bytes::<u32>(body)
        .map_err(|source| MetadataError::Malformed { what, source })?;
    check_version(version)?;
    let (value, rest) = postcard::take_from_bytes::<T>(body)
        .map_err(|source| MetadataError::Malformed { what, source })?;
    if !rest.is_empty() {
        return Err(MetadataError::Invalid(format!(
            "{} bytes after the {what}",
            rest.len()
        )));
    }
    Ok(value)
}

/// Byte strings as lowercase hex in human-readable formats (JSON), as bytes otherwise.
mod byte_strings {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            v.iter().map(hex::encode).collect::<Vec<_>>().serialize(s)
        } else {
            v.serialize(s)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        if d.is_human_readable() {
            Vec::<String>::deserialize(d)?
                .iter()
                .map(|h| hex::decode(h).map_err(serde::de::Error::custom))
                .collect()
        } else {
            Vec::<Vec<u8>>::deserialize(d)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{RemoteKey, RemoteRegion};

    fn agent() -> AgentInfo {
        AgentInfo {
            hostname: "node-7".into(),
            transports: vec![
                TransportInfo {
                    kind: TransportKind::Efa,
                    provider: Some("efa".into()),
                    rails: vec![vec![1; 32], vec![2; 32]],
                    nics: vec!["rdmap79s0".into(), "rdmap80s0".into()],
                },
                TransportInfo::new(TransportKind::Tcp, vec![b"tcp://10.0.0.1:4000".to_vec()]),
            ],
            control: Some("10.0.0.1:7471".into()),
            ..AgentInfo::new("decode-3", "0f3c", MemoryLocation::Cuda { device: 2 })
        }
    }

    fn region() -> RegionDescriptor {
        let rail = |k| RemoteRegion {
            addr: 0,
            len: 1 << 20,
            key: RemoteKey(k),
        };
        RegionDescriptor {
            version: METADATA_VERSION,
            owner: 0x1234_5678_9abc_def0,
            len: 1 << 20,
            memory: MemoryLocation::Host,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            transports: vec![
                (
                    TransportKind::Tcp,
                    RemoteDescriptor {
                        rails: vec![rail(7), rail(8)],
                    },
                ),
                (
                    TransportKind::Mem,
                    RemoteDescriptor {
                        rails: vec![rail(9)],
                    },
                ),
            ],
        }
    }

    #[test]
    fn both_forms_round_trip() {
        let a = agent();
        assert_eq!(AgentInfo::from_bytes(&a.to_bytes().unwrap()).unwrap(), a);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<AgentInfo>(&json).unwrap(), a);
        assert!(
            json.contains(&hex::encode(b"tcp://10.0.0.1:4000")),
            "{json}"
        );
        let r = region();
        assert_eq!(
            RegionDescriptor::from_bytes(&r.to_bytes().unwrap()).unwrap(),
            r
        );
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RegionDescriptor>(&json).unwrap(), r);
        assert_eq!(r.on(TransportKind::Mem).unwrap().rails[0].key, RemoteKey(9));
        assert!(json.contains("\"owner\":1311768467463790320"), "{json}");
        assert!(r.on(TransportKind::Efa).is_none());
    }

    #[test]
    fn bad_bytes_are_named_errors() {
        let a = agent().to_bytes().unwrap();
        let r = region().to_bytes().unwrap();
        assert!(matches!(
            AgentInfo::from_bytes(&r),
            Err(MetadataError::BadMagic { what: "agent", .. })
        ));
        for cut in [0, 3, 4, 5, a.len() / 2, a.len() - 1] {
            assert!(AgentInfo::from_bytes(&a[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = a.clone();
        longer.push(0);
        assert!(matches!(
            AgentInfo::from_bytes(&longer),
            Err(MetadataError::Invalid(_))
        ));
        assert!(matches!(
            AgentInfo::from_bytes(&vec![0; MAX_METADATA_BYTES + 1]),
            Err(MetadataError::TooLarge(_))
        ));
        let mut next = agent();
        next.version = METADATA_VERSION + 1;
        let bytes = encode(AGENT_MAGIC, &next).unwrap();
        let e = AgentInfo::from_bytes(&bytes).unwrap_err();
        assert!(
            matches!(e, MetadataError::Version { found } if found == METADATA_VERSION + 1),
            "{e}"
        );
        // A descriptor that says version 1 (written before the owner was added) is refused
        // by its version, not misread.
        let mut v1 = REGION_MAGIC.to_vec();
        v1.extend(postcard::to_allocvec(&1u32).unwrap());
        v1.extend_from_slice(&r[5..]);
        let e = RegionDescriptor::from_bytes(&v1).unwrap_err();
        assert!(matches!(e, MetadataError::Version { found: 1 }), "{e}");
        assert!(e.to_string().contains("version 1"), "{e}");
    }

    #[test]
    fn unusable_metadata_is_refused_with_the_reason() {
        let mut no_rails = agent();
        no_rails.transports[1].rails.clear();
        assert!(
            no_rails
                .to_bytes()
                .unwrap_err()
                .to_string()
                .contains("0 rails")
        );
        let mut twice = agent();
        twice.transports.push(twice.transports[0].clone());
        assert!(twice.check().unwrap_err().to_string().contains("twice"));
        let mut nics = agent();
        nics.transports[0].nics.pop();
        assert!(nics.check().is_err());
        let mut lengths = region();
        lengths.transports[0].1.rails[1].len = 4096;
        assert!(
            lengths
                .check()
                .unwrap_err()
                .to_string()
                .contains("disagree")
        );
        let mut none = region();
        none.transports.clear();
        assert!(none.check().is_err());
    }

    #[test]
    fn one_namespace_needs_one_host_and_the_same_namespace() {
        let mut a = agent();
        a.net_namespace = "net:[4026531840]".into();
        let mut b = a.clone();
        assert!(a.same_net_namespace(&b));
        b.net_namespace = "net:[4026532999]".into();
        assert!(
            a.same_host(&b) && !a.same_net_namespace(&b),
            "two pods of one node"
        );
        b.net_namespace = a.net_namespace.clone();
        b.boot_id = "another".into();
        assert!(
            !a.same_net_namespace(&b),
            "the same inode on another host is another one"
        );
        let unknown = agent();
        assert!(!unknown.same_net_namespace(&unknown.clone()));
    }

    #[test]
    fn same_host_is_the_boot_id() {
        let a = agent();
        let mut b = agent();
        b.hostname = "another-pod".into();
        assert!(a.same_host(&b), "pods of one node share the boot id");
        b.boot_id = "another".into();
        assert!(!a.same_host(&b));
        let mut unknown = agent();
        unknown.boot_id.clear();
        assert!(
            !unknown.same_host(&unknown.clone()),
            "an unknown host is never the same"
        );
    }

    proptest::proptest! {
        /// Arbitrary bytes after a valid magic (and mutations of a valid value) decode to
        /// an error or a checked value, never a panic or an allocation past the input.
        #[test]
        fn random_bytes_never_panic(
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            flip in 0usize..4096,
        ) {
            let mut a = AGENT_MAGIC.to_vec();
            a.extend_from_slice(&tail);
            if let Ok(v) = AgentInfo::from_bytes(&a) {
                proptest::prop_assert!(v.check().is_ok());
            }
            let mut r = REGION_MAGIC.to_vec();
            r.extend_from_slice(&tail);
            if let Ok(v) = RegionDescriptor::from_bytes(&r) {
                proptest::prop_assert!(v.check().is_ok());
            }
            let mut good = agent().to_bytes().unwrap();
            let at = flip % good.len();
            good[at] ^= 0x5a;
            let _ = AgentInfo::from_bytes(&good);
        }
    }

    #[test]
    fn names_round_trip() {
        for k in TransportKind::ALL {
            assert_eq!(TransportKind::from_name(k.name()), Some(k));
        }
        assert_eq!(TransportKind::from_name("auto"), None);
    }
}
