//! The cluster directory of xfer: which members a cluster has, how to reach each one and
//! which regions it offers, so that nodes join and leave without anyone restarting or
//! carrying addresses by hand.
//!
//! A member [publishes](Directory::publish) a small versioned [`Record`] under
//! `/xfer/v1/clusters/CLUSTER/members/NAME`: its
//! [`AgentInfo`](fabric_core::metadata::AgentInfo) (name, instance, boot id, memory,
//! transports with their rails and NICs, control address) and the
//! [`RegionDescriptor`](fabric_core::metadata::RegionDescriptor)s it offers by name, the
//! one metadata format of xfer. Others [look it up](Directory::lookup), [list the
//! cluster](Directory::members) or [watch it](Directory::watch) and receive
//! [`Event::Joined`], [`Event::Updated`] and [`Event::Left`] in order. [`Cluster`] turns
//! those events into [`Peers::connect`] / [`Peers::disconnect`]: on a
//! [`RailGroup`](fabric_core::engine::RailGroup) here, on an agent in the `xfer` crate
//! (which is where an application finds its peers: `Agent::publish`, `Agent::follow`).
//!
//! Two backends, chosen by URL in [`open`]:
//! - **etcd** (`etcd://HOST:PORT[,HOST:PORT...]`, [`EtcdDirectory`]): each record lives under
//!   a lease with the publisher's time to live, renewed by keep-alives, so a process that
//!   dies disappears from the directory after its TTL with nobody having to notice; a
//!   watch starts at the revision of the listing it began with, so no event is missed, and
//!   after etcd restarts publishers re-publish and watchers re-list.
//! - **a static file** (`file:///path/members.json`, [`FileDirectory`]), for tests and fixed
//!   setups: the same records in one JSON file, without leases.
//!
//! ## Signed records and a protected etcd
//! A directory opened with a cluster token ([`DirectoryConfig::token`]) signs every record
//! it publishes (HMAC-SHA256 over the record, [`sign`]) and refuses, logs and counts
//! ([`Directory::refused_records`]) every record it reads whose signature does not hold:
//! a forged member is skipped as an invalid record is, and nobody connects to it. Without
//! a token a directory accepts only unsigned records, and publishes regions (whose keys
//! reach every reader) only where [`DirectoryConfig::unsigned_regions`] allows it. etcd can
//! be reached over TLS with a client certificate, and with a user and password
//! ([`EtcdOptions::tls`], [`EtcdOptions::user`]). `docs/security.md` says what each
//! protects.
//!
//! Everything here is blocking, with a timeout on every call; the async runtime is an
//! implementation detail of the etcd backend.
//!
//! ## Dependencies
//! - `etcd-client`: the maintained etcd v3 gRPC client for Rust (tonic-based, leases,
//!   keep-alive streams and watches, tracked against etcd's protos); its build compiles
//!   etcd's `.proto` files and so needs `protoc` (Debian's `protobuf-compiler`).
//! - `tokio`: the runtime etcd-client runs on. This is the only crate of the workspace with
//!   an async runtime; it lives on its own worker thread behind a blocking API, so the
//!   engine's threads never run async code.

#![warn(missing_docs)]

mod cluster;
mod error;
mod etcd;
mod file;
pub mod record;
pub mod sign;
#[cfg(feature = "testing")]
pub mod testing;
mod track;

pub use cluster::{Cluster, ClusterEvent, ClusterPeer, Peers, Refusal};
pub use error::Error;
pub use etcd::{EtcdDirectory, EtcdOptions, EtcdTls, EtcdUser};
pub use file::FileDirectory;
pub use record::{RECORD_VERSION, Record, RecordError};
pub use sign::ClusterToken;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// Result of this crate's calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A member as read from the directory: its record and the revision it was written at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// What the member published.
    pub record: Record,
    /// The directory's revision of the record (etcd's `mod_revision`; 0 for a file).
    pub revision: i64,
}

/// A cluster's members at one revision.
#[derive(Debug, Default)]
pub struct Listing {
    /// The valid members, by name.
    pub members: Vec<Member>,
    /// Keys under the cluster that hold no valid record, with the reason.
    pub skipped: Vec<(String, RecordError)>,
    /// The revision the listing was taken at (etcd; 0 for a file).
    pub revision: i64,
}

/// A change in a cluster's membership, as [`Watch`] reports it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event {
    /// A member appeared (every member present when the watch began is reported first).
    Joined(Member),
    /// A member's record changed; a new [`Record::instance`] means it restarted.
    Updated {
        /// The record before.
        old: Box<Member>,
        /// The record now.
        new: Box<Member>,
    },
    /// A member is gone: withdrawn, its lease expired, or its record became invalid.
    /// Carries the last valid record.
    Left(Member),
    /// A key under the cluster holds no valid record; it was skipped (and logged).
    Skipped {
        /// The key (for a file: `PATH[INDEX]`).
        key: String,
        /// Why it was refused.
        error: RecordError,
    },
}

/// A cluster's membership changes, in order, from the moment [`Directory::watch`] was
/// called. Dropping it stops the watch.
pub struct Watch {
    events: Receiver<Event>,
    /// Stops the backend's watcher when dropped.
    _stop: Box<dyn Send>,
}

impl Watch {
    pub(crate) fn new(events: Receiver<Event>, stop: Box<dyn Send>) -> Watch {
        Watch {
            events,
            _stop: stop,
        }
    }

    /// The next event, waiting at most `timeout`: `Ok(None)` if none came.
    pub fn next(&self, timeout: Duration) -> Result<Option<Event>> {
        match self.events.recv_timeout(timeout) {
            Ok(e) => Ok(Some(e)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(Error::WatchEnded),
        }
    }

    /// The next event if one is waiting.
    pub fn try_next(&self) -> Option<Event> {
        self.events.try_recv().ok()
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("waiting", &self.events.len())
            .finish()
    }
}

/// What a backend does for a [`Publication`].
pub(crate) trait Published: Send {
    /// Replaces the record.
    fn update(&mut self, record: &Record) -> Result<()>;
    /// Removes the record now.
    fn withdraw(&mut self) -> Result<()>;
    /// Stops renewing without removing: the record goes when its TTL runs out.
    fn abandon(&mut self);
}

/// A published record. It stays in the directory while this lives (renewed within its
/// TTL); [`Publication::withdraw`] or dropping it removes it.
pub struct Publication {
    inner: Option<Box<dyn Published>>,
    key: String,
}

impl Publication {
    pub(crate) fn new(key: String, inner: Box<dyn Published>) -> Publication {
        Publication {
            inner: Some(inner),
            key,
        }
    }

    /// The key the record lives under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Replaces the published record (same cluster and name); watchers see
    /// [`Event::Updated`].
    pub fn update(&mut self, record: &Record) -> Result<()> {
        match &mut self.inner {
            Some(p) => p.update(record),
            None => Err(Error::Withdrawn(self.key.clone())),
        }
    }

    /// Removes the record now; watchers see [`Event::Left`].
    pub fn withdraw(mut self) -> Result<()> {
        match self.inner.take() {
            Some(mut p) => p.withdraw(),
            None => Ok(()),
        }
    }

    /// Stops renewing the record without removing it, as a process that died would: it
    /// disappears when its TTL runs out (for a file, never). For tests and benchmarks.
    pub fn abandon(mut self) {
        if let Some(mut p) = self.inner.take() {
            p.abandon();
        }
    }
}

impl Drop for Publication {
    fn drop(&mut self) {
        if let Some(mut p) = self.inner.take()
            && let Err(e) = p.withdraw()
        {
            tracing::warn!(key = %self.key, error = %e, "withdrawing a dropped publication failed; it expires with its TTL");
        }
    }
}

impl std::fmt::Debug for Publication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publication")
            .field("key", &self.key)
            .finish()
    }
}

/// A cluster directory: where members publish themselves and find each other.
pub trait Directory: Send + Sync {
    /// Publishes `record` (keyed by its cluster and name), replacing any record of that
    /// name, to live `ttl` past this process's last renewal (etcd rounds it up to whole
    /// seconds, at least its minimum; a file ignores it).
    fn publish(&self, record: Record, ttl: Duration) -> Result<Publication>;
    /// The member `name` of `cluster`, if it is there with a valid record.
    fn lookup(&self, cluster: &str, name: &str) -> Result<Option<Member>>;
    /// Every member of `cluster` now.
    fn members(&self, cluster: &str) -> Result<Listing>;
    /// Watches `cluster`: [`Event::Joined`] for every member now, then every change.
    fn watch(&self, cluster: &str) -> Result<Watch>;
    /// Where the directory is, for messages (`etcd://...`, `file://...`).
    fn endpoint(&self) -> String;
    /// Whether records are signed with a cluster token here (and only records that carry
    /// its signature are read).
    fn signed(&self) -> bool {
        false
    }
    /// How many records read so far were refused for their signature (missing, wrong, or
    /// one this directory has no token to check), counting each read of one: each is
    /// also logged at `warn`, target `directory::signing`. See [`sign`].
    fn refused_records(&self) -> u64 {
        0
    }
}

/// How to open a directory ([`open_with`]): the cluster token its records are signed and
/// checked with, whether regions may be published in unsigned records, and for etcd how to
/// reach it (timeouts, TLS, user). Its `Debug` shows no secret.
#[derive(Clone, Default)]
pub struct DirectoryConfig {
    /// The cluster's token: records published are signed with it, and records read must
    /// carry its signature. `None`: records are published unsigned and only unsigned
    /// records are read (the directory is open; a warning says so). An empty token is
    /// refused.
    pub token: Option<String>,
    /// Without a token: publish records that offer regions anyway, their descriptors with
    /// their keys readable by whoever reaches the directory (a warning says so at each
    /// publication). Off by default: such a publication fails with
    /// [`Error::UnsignedRegions`]. Ignored with a token.
    pub unsigned_regions: bool,
    /// How to reach etcd (ignored for a file).
    pub etcd: EtcdOptions,
}

impl DirectoryConfig {
    /// An open directory, as [`open`] makes: no token, regions published unsigned.
    pub fn open() -> DirectoryConfig {
        DirectoryConfig {
            unsigned_regions: true,
            ..DirectoryConfig::default()
        }
    }

    fn signing(&self) -> Result<sign::Signing> {
        let token = match self.token.as_deref() {
            Some("") => return Err(Error::Config("the cluster token is empty")),
            Some(t) => Some(ClusterToken::new(t)),
            None => None,
        };
        Ok(sign::Signing::new(token, self.unsigned_regions))
    }
}

impl std::fmt::Debug for DirectoryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectoryConfig")
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("unsigned_regions", &self.unsigned_regions)
            .field("etcd", &self.etcd)
            .finish()
    }
}

/// Opens the directory at `url`: `etcd://HOST:PORT[,HOST:PORT...]` (see [`EtcdOptions`]
/// for its timeouts) or `file://PATH`, open: with no token, publishing regions in unsigned
/// records ([`DirectoryConfig::open`]). [`open_with`] takes a token and etcd's TLS and user.
pub fn open(url: &str) -> Result<Box<dyn Directory>> {
    open_with(url, &DirectoryConfig::open())
}

/// Opens the directory at `url` (as [`open`]) with `config`: its cluster token, and for
/// etcd its TLS (the endpoints are then reached over `https`) and user.
pub fn open_with(url: &str, config: &DirectoryConfig) -> Result<Box<dyn Directory>> {
    let signing = config.signing()?;
    if let Some(rest) = url.strip_prefix("etcd://") {
        let scheme = if config.etcd.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let endpoints: Vec<String> = rest
            .trim_end_matches('/')
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| format!("{scheme}://{s}"))
            .collect();
        if endpoints.is_empty() {
            return Err(Error::Url {
                url: url.into(),
                why: "no HOST:PORT after etcd://",
            });
        }
        let d = EtcdDirectory::connect(&endpoints, config.etcd.clone())?.with_signing(signing);
        if !d.signed() {
            tracing::warn!(
                target: "directory::signing",
                endpoint = %d.endpoint(),
                "the directory is open: no cluster token, so member records are neither signed \
                 nor checked, and whoever can write to etcd can add members"
            );
        }
        Ok(Box::new(d))
    } else if let Some(path) = url.strip_prefix("file://") {
        if path.is_empty() {
            return Err(Error::Url {
                url: url.into(),
                why: "no path after file://",
            });
        }
        Ok(Box::new(FileDirectory::open(path).with_signing(signing)))
    } else {
        Err(Error::Url {
            url: url.into(),
            why: "expected etcd://HOST:PORT or file://PATH",
        })
    }
}
