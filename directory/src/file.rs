//! The static-file backend: every record in one JSON file, `{"members": [RECORD, ...]}`,
//! for tests and fixed setups. There are no leases: a record stays until it is withdrawn
//! or removed by hand, and TTLs are ignored. Writers take an exclusive lock on `PATH.lock`
//! and replace the file by a rename, so readers never see half a file.

use crate::record::{MAX_RECORD_BYTES, Record, member_key};
use crate::sign::{ClusterToken, Signing};
use crate::track::Tracker;
use crate::{Directory, Error, Listing, Member, Publication, Published, Result, Watch};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Largest directory file read: this many records of the largest size.
const MAX_FILE_BYTES: u64 = 1024 * MAX_RECORD_BYTES as u64;

/// A directory in one JSON file.
#[derive(Clone, Debug)]
pub struct FileDirectory {
    path: PathBuf,
    poll: Duration,
    signing: Signing,
}

impl FileDirectory {
    /// The directory in `path` (a missing file is an empty directory). Watches read the
    /// file again every 100 ms.
    pub fn open(path: impl AsRef<Path>) -> FileDirectory {
        FileDirectory {
            path: path.as_ref().to_path_buf(),
            poll: Duration::from_millis(100),
            signing: Signing::default(),
        }
    }

    /// Signs the records it publishes with `token` and reads only records signed with it
    /// (see [`crate::sign`]). Without it the file is an open directory.
    pub fn with_token(self, token: ClusterToken) -> FileDirectory {
        self.with_signing(Signing::new(Some(token), false))
    }

    pub(crate) fn with_signing(mut self, signing: Signing) -> FileDirectory {
        self.signing = signing;
        self
    }

    /// How often watches read the file again.
    pub fn with_poll(mut self, poll: Duration) -> FileDirectory {
        self.poll = poll;
        self
    }

    fn io(&self, source: std::io::Error) -> Error {
        Error::File {
            path: self.path.clone(),
            source,
        }
    }

    /// The file's records as JSON values (unchecked); none if it does not exist.
    fn read_values(&self) -> Result<Vec<serde_json::Value>> {
        let text = match std::fs::File::open(&self.path) {
            Ok(f) => {
                let mut buf = Vec::new();
                use std::io::Read;
                f.take(MAX_FILE_BYTES + 1)
                    .read_to_end(&mut buf)
                    .map_err(|e| self.io(e))?;
                if buf.len() as u64 > MAX_FILE_BYTES {
                    return Err(self.io(std::io::Error::other(format!(
                        "larger than {MAX_FILE_BYTES} bytes"
                    ))));
                }
                buf
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(self.io(e)),
        };
        #[derive(serde::Deserialize)]
        struct File {
            members: Vec<serde_json::Value>,
        }
        let f: File = serde_json::from_slice(&text).map_err(|source| Error::FileFormat {
            path: self.path.clone(),
            source,
        })?;
        Ok(f.members)
    }

    fn list(&self, cluster: &str) -> Result<Listing> {
        let mut listing = Listing::default();
        for (i, v) in self.read_values()?.into_iter().enumerate() {
            // Records of other clusters share the file; they are not this cluster's.
            if v.get("cluster").and_then(|c| c.as_str()) != Some(cluster) {
                continue;
            }
            let name = member_name(&v).unwrap_or("");
            let at = format!("{}[{i}]", self.path.display());
            let bytes = serde_json::to_vec(&v).unwrap_or_default();
            match self
                .signing
                .decode(cluster, &member_key(cluster, name), &bytes)
            {
                Ok(record) => listing.members.push(Member {
                    record,
                    revision: 0,
                }),
                Err(e) => listing.skipped.push((at, e)),
            }
        }
        listing
            .members
            .sort_by(|a, b| a.record.name().cmp(b.record.name()));
        Ok(listing)
    }

    /// Rewrites the file under its lock: `f` edits the list of records.
    fn edit(&self, f: impl FnOnce(&mut Vec<serde_json::Value>)) -> Result<()> {
        let lock_path = self.path.with_extension("lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| self.io(e))?;
        // SAFETY: flock on a file descriptor this function owns for the call's duration.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(self.io(std::io::Error::last_os_error()));
        }
        let mut values = self.read_values()?;
        f(&mut values);
        let text = serde_json::to_vec_pretty(&serde_json::json!({ "members": values }))
            .map_err(|e| self.io(std::io::Error::other(e)))?;
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, text).map_err(|e| self.io(e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| self.io(e))?;
        drop(lock);
        Ok(())
    }

    fn put(&self, record: &Record) -> Result<()> {
        let mut record = record.clone();
        self.signing.seal(&mut record)?;
        record.encode()?;
        let value = serde_json::to_value(&record).map_err(|e| self.io(std::io::Error::other(e)))?;
        self.edit(|values| {
            values.retain(|v| !same_member(v, &record.cluster, record.name()));
            values.push(value);
        })
    }
}

/// The member name of a record in the file (unchecked): its agent's name, or for a record
/// of version 1 its top-level `name`, so that publishing a member replaces whatever record
/// of an older build held its name, as a put under its key does in etcd.
fn member_name(v: &serde_json::Value) -> Option<&str> {
    v.pointer("/agent/name")
        .or_else(|| v.get("name"))
        .and_then(|n| n.as_str())
}

/// Whether `v` is the record of `name` in `cluster`.
fn same_member(v: &serde_json::Value, cluster: &str, name: &str) -> bool {
    v.get("cluster").and_then(|c| c.as_str()) == Some(cluster) && member_name(v) == Some(name)
}

impl Directory for FileDirectory {
    fn publish(&self, mut record: Record, ttl: Duration) -> Result<Publication> {
        record.ttl_ms = ttl.as_millis() as u64;
        self.put(&record)?;
        Ok(Publication::new(
            format!(
                "{}#{}/{}",
                self.path.display(),
                record.cluster,
                record.name()
            ),
            Box::new(FilePublished {
                dir: self.clone(),
                name: record.agent.name,
                cluster: record.cluster,
            }),
        ))
    }

    fn lookup(&self, cluster: &str, name: &str) -> Result<Option<Member>> {
        Ok(self
            .list(cluster)?
            .members
            .into_iter()
            .find(|m| m.record.name() == name))
    }

    fn members(&self, cluster: &str) -> Result<Listing> {
        self.list(cluster)
    }

    fn watch(&self, cluster: &str) -> Result<Watch> {
        let first = self.list(cluster)?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let dir = self.clone();
        let cluster = cluster.to_string();
        std::thread::Builder::new()
            .name("xfer-dir-file".into())
            .spawn(move || {
                let mut t = Tracker::new(dir.signing.clone());
                let mut last = t.listing(first, false, Instant::now());
                loop {
                    for e in last.drain(..) {
                        if tx.send(e).is_err() {
                            return;
                        }
                    }
                    match stop_rx.recv_timeout(dir.poll) {
                        Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    match dir.list(&cluster) {
                        Ok(l) => last = t.listing(l, false, Instant::now()),
                        // Between a writer's truncate and rename there is no torn file (it
                        // renames), but a hand edit may be half done: try again next time.
                        Err(e) => tracing::debug!(error = %e, "reading the directory file failed"),
                    }
                }
            })
            .map_err(|e| self.io(e))?;
        Ok(Watch::new(rx, Box::new(stop_tx)))
    }

    fn endpoint(&self) -> String {
        format!("file://{}", self.path.display())
    }

    fn signed(&self) -> bool {
        self.signing.signed()
    }

    fn refused_records(&self) -> u64 {
        self.signing.refused()
    }
}

/// A record in a directory file.
struct FilePublished {
    dir: FileDirectory,
    cluster: String,
    name: String,
}

impl Published for FilePublished {
    fn update(&mut self, record: &Record) -> Result<()> {
        if record.cluster != self.cluster || record.name() != self.name {
            return Err(Error::Record(crate::RecordError::OtherName(
                record.agent.name.clone(),
            )));
        }
        self.dir.put(record)
    }

    fn withdraw(&mut self) -> Result<()> {
        let (c, n) = (self.cluster.clone(), self.name.clone());
        self.dir
            .edit(|values| values.retain(|v| !same_member(v, &c, &n)))
    }

    fn abandon(&mut self) {}
}
