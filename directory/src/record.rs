//! What a member publishes about itself: a small, versioned, serde record that carries the
//! one metadata format of xfer ([`AgentInfo`] for the member, [`RegionDescriptor`] for each
//! region it offers by name), and the checks a record read from the directory must pass
//! before anyone acts on it.
//!
//! A record in JSON (byte strings as lowercase hex, as [`fabric_core::metadata`] writes
//! them):
//!
//! ```json
//! {"version": 2, "cluster": "c1",
//!  "agent": {"version": 2, "name": "node-0", "instance": 8047515007836987947,
//!            "boot_id": "5b0e...", "hostname": "pod-a", "memory": "Host",
//!            "transports": [{"kind": "tcp", "provider": null, "rails": ["010203", "ff"],
//!                            "nics": []}],
//!            "control": null},
//!  "regions": {"kv": {"version": 2, "owner": 8047515007836987947, "len": 4096, "memory": "Host", "access": 2,
//!                     "transports": [["tcp", {"rails": [{"addr": 0, "len": 4096, "key": 7}]}]]}},
//!  "started_ms": 1796195435794, "ttl_ms": 2000}
//! ```

use fabric_core::metadata::{AgentInfo, MetadataError, RegionDescriptor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The record format this crate writes, and the only one it reads. Version 1 (a transport
/// name, a hex address list, the hostname as `host`, raw per-rail region keys) is gone:
/// such a record is skipped with [`RecordError::Version`].
pub const RECORD_VERSION: u32 = 2;

/// Largest record accepted, encoded, in bytes. A record holds addresses and a few region
/// descriptors (one key per rail each): a few KiB at 32 rails. A larger value under a
/// member key is someone else's data or an attack, and is skipped unread.
pub const MAX_RECORD_BYTES: usize = 64 << 10;

/// Longest cluster or member name. Names are also path elements of the directory's keys.
pub const MAX_NAME_LEN: usize = 253;

/// The prefix of every key this crate writes in etcd (the key layout's version, not the
/// record's: a record of another format under these keys is named and skipped).
pub const KEY_ROOT: &str = "/xfer/v1/clusters/";

/// A member's record: who it is and how to reach it (its [`AgentInfo`]), what it offers
/// (named [`RegionDescriptor`]s), and the directory's own bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The record format ([`RECORD_VERSION`]).
    pub version: u32,
    /// The cluster the member belongs to; it must match the cluster of its key.
    pub cluster: String,
    /// The member, in the metadata format: its name (the member's name, unique in its
    /// cluster, and the last element of its key), its instance (new at every start: a
    /// member restarted under its name must be reconnected), its host's boot id (what
    /// "same host" means), its memory, and its transports with their rails and NICs.
    pub agent: AgentInfo,
    /// Regions peers may write into (or read from), by name.
    #[serde(default)]
    pub regions: BTreeMap<String, RegionDescriptor>,
    /// When the member started, in milliseconds since the Unix epoch (for its age).
    pub started_ms: u64,
    /// The time to live it was published with, in milliseconds: a member that stops
    /// renewing disappears after it; watchers also use it as the grace period after a
    /// reconnect before declaring an unlisted member gone.
    pub ttl_ms: u64,
    /// The record's HMAC-SHA256 by the cluster's token, in lowercase hex, over its
    /// [canonical bytes](Record::canonical_bytes); absent in an unsigned record. A
    /// directory with a token sets it when it publishes and checks it when it reads (see
    /// [`crate::sign`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl Record {
    /// A record of `agent` (whose name is the member's name) in `cluster`, started now,
    /// offering no region yet.
    pub fn new(cluster: &str, agent: AgentInfo) -> Record {
        Record {
            version: RECORD_VERSION,
            cluster: cluster.to_string(),
            agent,
            regions: BTreeMap::new(),
            started_ms: now_ms(),
            ttl_ms: 0,
            signature: None,
        }
    }

    /// The member's name ([`AgentInfo::name`]).
    pub fn name(&self) -> &str {
        &self.agent.name
    }

    /// The member's instance ([`AgentInfo::instance`]): a new one means it restarted.
    pub fn instance(&self) -> u64 {
        self.agent.instance
    }

    /// How long ago the member started (zero if its clock is ahead of ours).
    pub fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.started_ms))
    }

    /// The record's key in etcd.
    pub fn key(&self) -> String {
        member_key(&self.cluster, self.name())
    }

    /// Checks what a reader must be able to rely on, short of the key: the version, names
    /// that can be path elements, and metadata that passes [`AgentInfo::check`] and
    /// [`RegionDescriptor::check`].
    pub fn check(&self) -> Result<(), RecordError> {
        if self.version != RECORD_VERSION {
            return Err(RecordError::Version(self.version));
        }
        check_name("cluster", &self.cluster)?;
        check_name("member", self.name())?;
        self.agent.check().map_err(RecordError::Agent)?;
        for (name, d) in &self.regions {
            d.check().map_err(|source| RecordError::Region {
                name: name.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// What a signature covers: the record as this crate writes it, with no signature.
    pub fn canonical_bytes(&self) -> Result<Vec<u8>, RecordError> {
        let unsigned = Record {
            signature: None,
            ..self.clone()
        };
        serde_json::to_vec(&unsigned).map_err(RecordError::Json)
    }

    /// The record as stored: JSON, checked ([`Record::check`]) and against
    /// [`MAX_RECORD_BYTES`].
    pub fn encode(&self) -> Result<Vec<u8>, RecordError> {
        self.check()?;
        let bytes = serde_json::to_vec(self).map_err(RecordError::Json)?;
        if bytes.len() > MAX_RECORD_BYTES {
            return Err(RecordError::TooLarge(bytes.len()));
        }
        Ok(bytes)
    }

    /// Reads the value stored under `key`, a member key of `cluster`: it must be small,
    /// JSON, of [`RECORD_VERSION`], name the same cluster and member (`agent.name`) as its
    /// key, and pass [`Record::check`].
    pub fn decode(cluster: &str, key: &str, value: &[u8]) -> Result<Record, RecordError> {
        if value.len() > MAX_RECORD_BYTES {
            return Err(RecordError::TooLarge(value.len()));
        }
        let name = key
            .strip_prefix(&members_prefix(cluster))
            .ok_or_else(|| RecordError::Key(key.to_string()))?;
        // Read the version on its own first, so that another format is named as such
        // rather than reported as whatever field it changed.
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let v: Versioned = serde_json::from_slice(value).map_err(RecordError::Json)?;
        if v.version != RECORD_VERSION {
            return Err(RecordError::Version(v.version));
        }
        let r: Record = serde_json::from_slice(value).map_err(RecordError::Json)?;
        if r.cluster != cluster {
            return Err(RecordError::OtherCluster(r.cluster));
        }
        if r.agent.name != name {
            return Err(RecordError::OtherName(r.agent.name));
        }
        r.check()?;
        Ok(r)
    }
}

/// Why a record was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Not a JSON record of this format.
    #[error("not a record: {0}")]
    Json(#[source] serde_json::Error),
    /// Larger than [`MAX_RECORD_BYTES`].
    #[error("record of {0} bytes, more than the {MAX_RECORD_BYTES} allowed")]
    TooLarge(usize),
    /// A record format this build does not read (version 1: written by an xfer from before
    /// the metadata format; its member must run this build to be seen).
    #[error(
        "record version {0}, this build reads version {RECORD_VERSION} only \
         (the member runs another xfer; it is skipped)"
    )]
    Version(u32),
    /// The record names another cluster than its key.
    #[error("record of cluster {0:?} under this cluster's key")]
    OtherCluster(String),
    /// The record names another member than its key.
    #[error("record of member {0:?} under another member's key")]
    OtherName(String),
    /// The key is not a member key of the cluster.
    #[error("key {0:?} is not a member key of this cluster")]
    Key(String),
    /// A cluster or member name that cannot be a key's path element.
    #[error("{what} name {name:?}: {why}")]
    Name {
        /// `cluster` or `member`.
        what: &'static str,
        /// The name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The member's metadata is unusable ([`AgentInfo::check`] failed).
    #[error("the member's agent metadata: {0}")]
    Agent(#[source] MetadataError),
    /// This reader has the cluster's token and the record carries no signature: anyone
    /// who can write to the directory may have written it.
    #[error("the record is unsigned, and this cluster's records must be signed with its token")]
    Unsigned,
    /// The record's signature is not the cluster token's over this record: it was forged,
    /// changed, or signed with another token.
    #[error(
        "the record's signature does not hold for this cluster's token (forged, changed, or another token)"
    )]
    BadSignature,
    /// The record is signed and this reader has no token to check it with.
    #[error("the record is signed, and this reader has no cluster token to check it with")]
    CannotCheck,
    /// A region's descriptor is unusable ([`RegionDescriptor::check`] failed).
    #[error("region {name:?}: {source}")]
    Region {
        /// The region's name in the record.
        name: String,
        /// Why its descriptor was refused.
        #[source]
        source: MetadataError,
    },
}

/// Checks that `name` can be a path element of a key: 1 to [`MAX_NAME_LEN`] characters of
/// letters, digits, `-`, `_` and `.` (the characters of Kubernetes pod names and more).
pub fn check_name(what: &'static str, name: &str) -> Result<(), RecordError> {
    let why = if name.is_empty() {
        Some("empty")
    } else if name.len() > MAX_NAME_LEN {
        Some("longer than 253 bytes")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        Some("only letters, digits, '-', '_' and '.' are allowed")
    } else if name == "." || name == ".." {
        Some("not a name")
    } else {
        None
    };
    match why {
        Some(why) => Err(RecordError::Name {
            what,
            name: name.to_string(),
            why,
        }),
        None => Ok(()),
    }
}

/// The prefix under which a cluster's members are stored.
pub fn members_prefix(cluster: &str) -> String {
    format!("{KEY_ROOT}{cluster}/members/")
}

/// The key of one member.
pub fn member_key(cluster: &str, name: &str) -> String {
    format!("{}{name}", members_prefix(cluster))
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::engine::RemoteDescriptor;
    use fabric_core::metadata::{METADATA_VERSION, TransportInfo, TransportKind};
    use fabric_core::{Access, MemoryLocation, RemoteKey, RemoteRegion};

    fn agent(name: &str) -> AgentInfo {
        let mut a = AgentInfo::new(name, "boot-1", MemoryLocation::Host);
        a.hostname = "pod-a".into();
        a.transports = vec![TransportInfo::new(
            TransportKind::Tcp,
            vec![vec![1, 2, 3], vec![0xff]],
        )];
        a
    }

    fn region(len: u64) -> RegionDescriptor {
        RegionDescriptor {
            version: METADATA_VERSION,
            owner: 1,
            len,
            memory: MemoryLocation::Host,
            access: Access::REMOTE_WRITE,
            transports: vec![(
                TransportKind::Tcp,
                RemoteDescriptor {
                    rails: vec![RemoteRegion {
                        addr: 0,
                        len,
                        key: RemoteKey(7),
                    }],
                },
            )],
        }
    }

    fn sample() -> Record {
        let mut r = Record::new("c1", agent("node-0"));
        r.regions.insert("kv".into(), region(4096));
        r.ttl_ms = 2000;
        r
    }

    #[test]
    fn round_trip() {
        let r = sample();
        let bytes = r.encode().unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("\"010203\""), "{text}");
        assert!(text.contains("\"boot_id\":\"boot-1\""), "{text}");
        assert_eq!(Record::decode("c1", &r.key(), &bytes).unwrap(), r);
        assert_eq!(r.key(), "/xfer/v1/clusters/c1/members/node-0");
    }

    #[test]
    fn a_version_1_record_is_skipped_by_name() {
        // What a build before the metadata format wrote.
        let v1 = serde_json::json!({
            "version": 1, "cluster": "c1", "name": "node-0", "instance": 5, "host": "pod-a",
            "transport": "tcp", "addresses": ["010203"], "memory": "host",
            "regions": {}, "started_ms": 1, "ttl_ms": 2000
        });
        let e = Record::decode(
            "c1",
            &member_key("c1", "node-0"),
            &serde_json::to_vec(&v1).unwrap(),
        )
        .unwrap_err();
        assert!(matches!(e, RecordError::Version(1)), "{e}");
        assert!(
            e.to_string()
                .contains("version 1, this build reads version 2"),
            "{e}"
        );
    }

    #[test]
    fn hostile_records_are_refused_with_the_reason() {
        let r = sample();
        let key = r.key();
        let json = |v: &serde_json::Value| serde_json::to_vec(v).unwrap();
        assert!(matches!(
            Record::decode("c1", &key, b"\x00garbage"),
            Err(RecordError::Json(_))
        ));
        let huge = vec![b' '; MAX_RECORD_BYTES + 1];
        assert!(matches!(
            Record::decode("c1", &key, &huge),
            Err(RecordError::TooLarge(_))
        ));
        let mut v = serde_json::to_value(&r).unwrap();
        v["version"] = 99.into();
        // The version is read first: the rest of the value may be anything.
        v["agent"] = 3.into();
        assert!(matches!(
            Record::decode("c1", &key, &json(&v)),
            Err(RecordError::Version(99))
        ));
        let other = Record::new("c2", agent("node-0"));
        assert!(matches!(
            Record::decode("c1", &key, &serde_json::to_vec(&other).unwrap()),
            Err(RecordError::OtherCluster(_))
        ));
        let renamed = Record::new("c1", agent("node-1"));
        assert!(matches!(
            Record::decode("c1", &key, &serde_json::to_vec(&renamed).unwrap()),
            Err(RecordError::OtherName(n)) if n == "node-1"
        ));
        let mut bad_hex = serde_json::to_value(&r).unwrap();
        bad_hex["agent"]["transports"][0]["rails"] = serde_json::json!(["zz"]);
        assert!(matches!(
            Record::decode("c1", &key, &json(&bad_hex)),
            Err(RecordError::Json(_))
        ));
        assert!(matches!(
            Record::decode("c1", "/elsewhere/node-0", &r.encode().unwrap()),
            Err(RecordError::Key(_))
        ));
        // Metadata that decodes but cannot be used: no rails, another metadata version, a
        // region whose rails disagree with its length.
        let mut no_rails = serde_json::to_value(&r).unwrap();
        no_rails["agent"]["transports"][0]["rails"] = serde_json::json!([]);
        let e = Record::decode("c1", &key, &json(&no_rails)).unwrap_err();
        assert!(matches!(e, RecordError::Agent(_)), "{e}");
        assert!(e.to_string().contains("0 rails"), "{e}");
        let mut meta_v9 = serde_json::to_value(&r).unwrap();
        meta_v9["agent"]["version"] = 9.into();
        assert!(matches!(
            Record::decode("c1", &key, &json(&meta_v9)),
            Err(RecordError::Agent(MetadataError::Version { found: 9 }))
        ));
        let mut bad_region = r.clone();
        bad_region.regions.get_mut("kv").unwrap().len = 1;
        let e = Record::decode("c1", &key, &serde_json::to_vec(&bad_region).unwrap()).unwrap_err();
        assert!(
            matches!(&e, RecordError::Region { name, .. } if name == "kv"),
            "{e}"
        );
        assert!(
            bad_region.encode().is_err(),
            "what cannot be read is not written"
        );
    }

    #[test]
    fn names_are_path_elements() {
        assert!(check_name("member", "xfer-serve-7d9f-0.a_b").is_ok());
        for bad in ["", "a/b", "..", "a b", &"x".repeat(254)] {
            assert!(check_name("member", bad).is_err(), "{bad:?}");
        }
        let r = Record::new("c1", agent("a/b"));
        assert!(matches!(r.encode(), Err(RecordError::Name { .. })));
    }

    #[test]
    fn a_record_too_large_is_not_published() {
        let mut r = sample();
        r.agent.transports[0].rails = vec![vec![0; MAX_RECORD_BYTES]];
        assert!(matches!(r.encode(), Err(RecordError::TooLarge(_))));
    }
}
