//! Signed member records: an HMAC-SHA256 over a record's canonical bytes, keyed by the
//! cluster's token, so that a reader with the token acts only on records that a holder of
//! the token wrote.
//!
//! The canonical bytes are a fixed context string, then the record's JSON as this crate
//! writes it with no signature ([`Record::canonical_bytes`]). The tag travels in the record
//! as [`Record::signature`] (lowercase hex). A reader decodes a record, writes it again
//! without its signature and checks the tag in constant time: a record with any field
//! changed fails (a field this build does not know is dropped unread, so it is not acted
//! on either).
//!
//! The rule a reader applies:
//!
//! | reader | unsigned record | signed, right token | signed, wrong token |
//! |---|---|---|---|
//! | with a token | refused ([`RecordError::Unsigned`]) | accepted | refused ([`RecordError::BadSignature`]) |
//! | without a token | accepted (the directory is open) | refused ([`RecordError::CannotCheck`]) | refused ([`RecordError::CannotCheck`]) |
//!
//! Every refusal is counted (see [`Directory::refused_records`](crate::Directory::refused_records))
//! and logged at `warn` (target `directory::signing`), and the record is skipped as any
//! invalid record is: a watch reports [`Event::Skipped`](crate::Event::Skipped) (and
//! [`Event::Left`](crate::Event::Left) if it replaced a valid one), so that nobody
//! connects to its member.

use crate::record::{Record, RecordError};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What the tag of a record is computed over first: the record format and what it is.
const CONTEXT: &[u8] = b"xfer directory member record v2\0";

/// Length of a tag in bytes (HMAC-SHA256).
pub const SIGNATURE_LEN: usize = 32;

/// A cluster's token: signs the records a member publishes and checks those it reads. The
/// token itself never enters a record. Its `Debug` does not show it.
#[derive(Clone)]
pub struct ClusterToken(Arc<[u8]>);

impl ClusterToken {
    /// The token `token` (any bytes; give the same to every member of the cluster).
    pub fn new(token: impl AsRef<[u8]>) -> ClusterToken {
        ClusterToken(Arc::from(token.as_ref()))
    }

    fn mac(&self, record: &Record) -> Result<Hmac<Sha256>, RecordError> {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(CONTEXT);
        mac.update(&record.canonical_bytes()?);
        Ok(mac)
    }

    /// The tag of `record` (its signature ignored).
    pub fn sign(&self, record: &Record) -> Result<[u8; SIGNATURE_LEN], RecordError> {
        Ok(self.mac(record)?.finalize().into_bytes().into())
    }

    /// Whether `record` carries a valid tag by this token (compared in constant time).
    pub fn verify(&self, record: &Record) -> Result<(), RecordError> {
        let Some(sig) = &record.signature else {
            return Err(RecordError::Unsigned);
        };
        let tag = hex::decode(sig).map_err(|_| RecordError::BadSignature)?;
        self.mac(record)?
            .verify_slice(&tag)
            .map_err(|_| RecordError::BadSignature)
    }
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(..)")
    }
}

/// What a directory does about signatures: the token it signs and checks with, whether it
/// publishes regions in unsigned records, and how many records it refused. Clones share
/// the count.
#[derive(Clone, Debug)]
pub(crate) struct Signing {
    token: Option<ClusterToken>,
    unsigned_regions: bool,
    refused: Arc<AtomicU64>,
}

impl Default for Signing {
    /// An open directory, as before records were signed: no token, regions published.
    fn default() -> Signing {
        Signing::new(None, true)
    }
}

impl Signing {
    pub(crate) fn new(token: Option<ClusterToken>, unsigned_regions: bool) -> Signing {
        Signing {
            token,
            unsigned_regions,
            refused: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Whether records are signed and checked.
    pub(crate) fn signed(&self) -> bool {
        self.token.is_some()
    }

    /// Records refused so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Makes `record` ready to publish: signed with the token, or, without one, unsigned
    /// and refused if it offers regions while unsigned regions are not allowed.
    pub(crate) fn seal(&self, record: &mut Record) -> crate::Result<()> {
        record.signature = None;
        match &self.token {
            Some(t) => record.signature = Some(hex::encode(t.sign(record)?)),
            None if record.regions.is_empty() => {}
            None if self.unsigned_regions => {
                tracing::warn!(
                    target: "directory::signing",
                    member = record.name(),
                    cluster = %record.cluster,
                    regions = record.regions.len(),
                    "publishing region keys in an unsigned record: whoever reaches the \
                     directory reads them, and records are not checked (set a cluster token)"
                );
            }
            None => {
                return Err(crate::Error::UnsignedRegions {
                    cluster: record.cluster.clone(),
                    member: record.name().to_string(),
                    regions: record.regions.keys().cloned().collect(),
                });
            }
        }
        Ok(())
    }

    /// Checks the signature of `record`, read under `key`, by the rule of this module;
    /// a refusal is counted and logged.
    pub(crate) fn check(&self, key: &str, record: &Record) -> Result<(), RecordError> {
        let r = match (&self.token, &record.signature) {
            (Some(t), _) => t.verify(record),
            (None, Some(_)) => Err(RecordError::CannotCheck),
            (None, None) => Ok(()),
        };
        if let Err(e) = &r {
            let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::warn!(
                target: "directory::signing",
                key,
                member = record.name(),
                error = %e,
                refused,
                "ignoring a member record whose signature does not hold"
            );
        }
        r
    }

    /// [`Record::decode`], then [`Signing::check`].
    pub(crate) fn decode(
        &self,
        cluster: &str,
        key: &str,
        value: &[u8],
    ) -> Result<Record, RecordError> {
        let r = Record::decode(cluster, key, value)?;
        self.check(key, &r)?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::MemoryLocation;
    use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};

    fn record() -> Record {
        let mut a = AgentInfo::new("node-0", "boot", MemoryLocation::Host);
        a.transports = vec![TransportInfo::new(TransportKind::Tcp, vec![vec![1]])];
        Record::new("c1", a)
    }

    fn encoded(s: &Signing, mut r: Record) -> Vec<u8> {
        s.seal(&mut r).unwrap();
        r.encode().unwrap()
    }

    #[test]
    fn the_rule_of_each_reader() {
        let key = record().key();
        let ours = Signing::new(Some(ClusterToken::new("s3cret")), false);
        let theirs = Signing::new(Some(ClusterToken::new("other")), false);
        let open = Signing::default();
        let signed = encoded(&ours, record());
        let unsigned = encoded(&open, record());

        assert!(
            ours.decode("c1", &key, &signed)
                .unwrap()
                .signature
                .is_some()
        );
        assert!(open.decode("c1", &key, &unsigned).is_ok());
        assert!(matches!(
            ours.decode("c1", &key, &unsigned),
            Err(RecordError::Unsigned)
        ));
        assert!(matches!(
            theirs.decode("c1", &key, &signed),
            Err(RecordError::BadSignature)
        ));
        assert!(matches!(
            open.decode("c1", &key, &signed),
            Err(RecordError::CannotCheck)
        ));
        assert_eq!(
            (ours.refused(), theirs.refused(), open.refused()),
            (1, 1, 1)
        );
    }

    #[test]
    fn any_changed_byte_breaks_the_signature() {
        let ours = Signing::new(Some(ClusterToken::new("s3cret")), false);
        let mut r = record();
        ours.seal(&mut r).unwrap();
        let key = r.key();
        // Another address for the same member, under its valid signature.
        let mut moved = r.clone();
        moved.agent.transports[0].rails = vec![vec![6, 6, 6]];
        let e = ours
            .decode("c1", &key, &moved.encode().unwrap())
            .unwrap_err();
        assert!(matches!(e, RecordError::BadSignature), "{e}");
        // A signature that is not hex, or of another length.
        for bad in ["zz", "00", ""] {
            let mut b = r.clone();
            b.signature = Some(bad.into());
            assert!(matches!(
                ours.decode("c1", &key, &b.encode().unwrap()),
                Err(RecordError::BadSignature)
            ));
        }
        // A field this build does not know is dropped unread: what the signature covers is
        // all that is acted on.
        let mut v = serde_json::to_value(&r).unwrap();
        v["extra"] = 1.into();
        assert_eq!(
            ours.decode("c1", &key, &serde_json::to_vec(&v).unwrap())
                .unwrap(),
            r
        );
        assert!(ours.decode("c1", &key, &r.encode().unwrap()).is_ok());
    }

    #[test]
    fn regions_in_unsigned_records_only_when_allowed() {
        let mut r = record();
        r.regions.insert(
            "kv".into(),
            fabric_core::metadata::RegionDescriptor {
                version: fabric_core::metadata::METADATA_VERSION,
                owner: r.agent.instance,
                len: 8,
                memory: MemoryLocation::Host,
                access: fabric_core::Access::REMOTE_WRITE,
                transports: vec![(
                    TransportKind::Tcp,
                    fabric_core::engine::RemoteDescriptor {
                        rails: vec![fabric_core::RemoteRegion {
                            addr: 0,
                            len: 8,
                            key: fabric_core::RemoteKey(7),
                        }],
                    },
                )],
            },
        );
        let e = Signing::new(None, false).seal(&mut r.clone()).unwrap_err();
        assert!(
            matches!(&e, crate::Error::UnsignedRegions { regions, .. } if regions == &["kv"]),
            "{e}"
        );
        assert!(Signing::new(None, true).seal(&mut r.clone()).is_ok());
        let mut signed = r.clone();
        Signing::new(Some(ClusterToken::new("t")), false)
            .seal(&mut signed)
            .unwrap();
        assert_eq!(signed.signature.as_ref().map(String::len), Some(64));
    }
}
