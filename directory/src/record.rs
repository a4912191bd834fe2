//! What a member publishes about itself: a small, versioned, serde record, and the checks a
//! record read from the directory must pass before anyone acts on it.

use fabric_core::engine::RemoteDescriptor;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The record format this crate writes, and the only one it reads.
pub const RECORD_VERSION: u32 = 1;

/// Largest record accepted, encoded, in bytes. A record holds addresses and a few region
/// descriptors (one key per rail each): a few KiB at 32 rails. A larger value under a
/// member key is someone else's data or an attack, and is skipped unread.
pub const MAX_RECORD_BYTES: usize = 64 << 10;

/// Longest cluster or member name. Names are also path elements of the directory's keys.
pub const MAX_NAME_LEN: usize = 253;

/// The prefix of every key this crate writes in etcd.
pub const KEY_ROOT: &str = "/xfer/v1/clusters/";

/// A member's record: how to reach it and what it offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The record format ([`RECORD_VERSION`]).
    pub version: u32,
    /// The cluster the member belongs to; it must match the cluster of its key.
    pub cluster: String,
    /// The member's name, unique in its cluster (a Kubernetes pod name, say).
    pub name: String,
    /// Random per process start: a member restarted under the same name is a new instance,
    /// and its peers must reconnect rather than trust the old addresses.
    pub instance: u64,
    /// The host it runs on (a hostname or machine id), so peers can tell local from remote.
    pub host: String,
    /// The transport its rails speak (`tcp`, `efa`, `cuda-ipc`, ...).
    pub transport: String,
    /// The transport address of each rail, as `Engine::address` returns it (hex in JSON).
    #[serde(with = "hex_list")]
    pub addresses: Vec<Vec<u8>>,
    /// Where the member's control service listens (`xfer serve`'s control port), if any.
    #[serde(default)]
    pub control: Option<String>,
    /// The memory its regions are in (`host`, `cuda`).
    pub memory: String,
    /// The GPU its regions are on, if device memory.
    #[serde(default)]
    pub gpu: Option<u32>,
    /// The NICs its rails run on, in rail order (empty: unbound).
    #[serde(default)]
    pub nics: Vec<String>,
    /// Regions peers may write into (or read from), by name.
    #[serde(default)]
    pub regions: BTreeMap<String, RemoteDescriptor>,
    /// When the member started, in milliseconds since the Unix epoch (for its age).
    pub started_ms: u64,
    /// The time to live it was published with, in milliseconds: a member that stops
    /// renewing disappears after it; watchers also use it as the grace period after a
    /// reconnect before declaring an unlisted member gone.
    pub ttl_ms: u64,
}

impl Record {
    /// A record for `name` in `cluster` with a fresh instance id, started now; the caller
    /// fills in what it offers.
    pub fn new(cluster: &str, name: &str, transport: &str) -> Record {
        Record {
            version: RECORD_VERSION,
            cluster: cluster.to_string(),
            name: name.to_string(),
            instance: fresh_instance(),
            host: host_id(),
            transport: transport.to_string(),
            addresses: Vec::new(),
            control: None,
            memory: "host".into(),
            gpu: None,
            nics: Vec::new(),
            regions: BTreeMap::new(),
            started_ms: now_ms(),
            ttl_ms: 0,
        }
    }

    /// How long ago the member started (zero if its clock is ahead of ours).
    pub fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.started_ms))
    }

    /// The record's key in etcd.
    pub fn key(&self) -> String {
        member_key(&self.cluster, &self.name)
    }

    /// The record as stored: JSON, checked against [`MAX_RECORD_BYTES`].
    pub fn encode(&self) -> Result<Vec<u8>, RecordError> {
        check_name("cluster", &self.cluster)?;
        check_name("member", &self.name)?;
        let bytes = serde_json::to_vec(self).map_err(RecordError::Json)?;
        if bytes.len() > MAX_RECORD_BYTES {
            return Err(RecordError::TooLarge(bytes.len()));
        }
        Ok(bytes)
    }

    /// Reads the value stored under `key`, a member key of `cluster`: it must be small,
    /// JSON, of [`RECORD_VERSION`], and name the same cluster and member as its key.
    pub fn decode(cluster: &str, key: &str, value: &[u8]) -> Result<Record, RecordError> {
        if value.len() > MAX_RECORD_BYTES {
            return Err(RecordError::TooLarge(value.len()));
        }
        let name = key
            .strip_prefix(&members_prefix(cluster))
            .ok_or_else(|| RecordError::Key(key.to_string()))?;
        // Read the version on its own first, so that a newer format is named as such
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
        if r.name != name {
            return Err(RecordError::OtherName(r.name));
        }
        check_name("member", &r.name)?;
        Ok(r)
    }
}

/// Why a record was refused.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Not a JSON record of this format.
    #[error("not a record: {0}")]
    Json(#[source] serde_json::Error),
    /// Larger than [`MAX_RECORD_BYTES`].
    #[error("record of {0} bytes, more than the {MAX_RECORD_BYTES} allowed")]
    TooLarge(usize),
    /// A record format this build does not read.
    #[error("record version {0}, this build reads version {RECORD_VERSION}")]
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

/// A random instance id (the time, if the system has no randomness to give).
fn fresh_instance() -> u64 {
    let mut b = [0u8; 8];
    match getrandom::fill(&mut b) {
        Ok(()) => u64::from_le_bytes(b),
        Err(_) => now_ms() ^ u64::from(std::process::id()) << 40,
    }
}

/// This host's id: its hostname (`/proc/sys/kernel/hostname`), else `unknown`.
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Serde for a list of byte strings as hex strings.
mod hex_list {
    use serde::{Deserialize, Deserializer, Serializer, de::Error, ser::SerializeSeq};

    pub fn serialize<S: Serializer>(v: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(v.len()))?;
        for a in v {
            seq.serialize_element(&hex::encode(a))?;
        }
        seq.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        let v: Vec<String> = Vec::deserialize(d)?;
        v.iter()
            .map(|s| hex::decode(s).map_err(D::Error::custom))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        let mut r = Record::new("c1", "node-0", "tcp");
        r.addresses = vec![vec![1, 2, 3], vec![0xff]];
        r.ttl_ms = 2000;
        r
    }

    #[test]
    fn round_trip() {
        let r = sample();
        let bytes = r.encode().unwrap();
        assert!(String::from_utf8_lossy(&bytes).contains("\"010203\""));
        assert_eq!(Record::decode("c1", &r.key(), &bytes).unwrap(), r);
    }

    #[test]
    fn hostile_records_are_refused_with_the_reason() {
        let r = sample();
        let key = r.key();
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
        assert!(matches!(
            Record::decode("c1", &key, &serde_json::to_vec(&v).unwrap()),
            Err(RecordError::Version(99))
        ));
        let other = Record::new("c2", "node-0", "tcp");
        assert!(matches!(
            Record::decode("c1", &key, &serde_json::to_vec(&other).unwrap()),
            Err(RecordError::OtherCluster(_))
        ));
        let renamed = Record::new("c1", "node-1", "tcp");
        assert!(matches!(
            Record::decode("c1", &key, &serde_json::to_vec(&renamed).unwrap()),
            Err(RecordError::OtherName(_))
        ));
        let mut bad_hex = serde_json::to_value(&r).unwrap();
        bad_hex["addresses"] = serde_json::json!(["zz"]);
        assert!(matches!(
            Record::decode("c1", &key, &serde_json::to_vec(&bad_hex).unwrap()),
            Err(RecordError::Json(_))
        ));
        assert!(matches!(
            Record::decode("c1", "/elsewhere/node-0", &r.encode().unwrap()),
            Err(RecordError::Key(_))
        ));
    }

    #[test]
    fn names_are_path_elements() {
        assert!(check_name("member", "xfer-serve-7d9f-0.a_b").is_ok());
        for bad in ["", "a/b", "..", "a b", &"x".repeat(254)] {
            assert!(check_name("member", bad).is_err(), "{bad:?}");
        }
        let mut r = sample();
        r.name = "a/b".into();
        assert!(matches!(r.encode(), Err(RecordError::Name { .. })));
    }

    #[test]
    fn a_record_too_large_is_not_published() {
        let mut r = sample();
        r.addresses = vec![vec![0; MAX_RECORD_BYTES]];
        assert!(matches!(r.encode(), Err(RecordError::TooLarge(_))));
    }
}
