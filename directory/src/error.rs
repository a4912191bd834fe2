//! The directory's errors.

use crate::record::RecordError;
use std::path::PathBuf;
use std::time::Duration;

/// Why a directory call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The directory URL is not one this crate opens.
    #[error("directory {url:?}: {why}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// etcd did not answer at all.
    #[error("etcd at {endpoint} is unreachable (no answer within {after:?}): {source}")]
    Unreachable {
        /// The endpoints tried.
        endpoint: String,
        /// How long it was given.
        after: Duration,
        /// What the client saw.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A call did not complete within its timeout.
    #[error("etcd at {endpoint}: {what} did not complete within {after:?}")]
    TimedOut {
        /// The endpoints.
        endpoint: String,
        /// The call.
        what: &'static str,
        /// Its timeout.
        after: Duration,
    },
    /// etcd refused or failed a call (an authentication refusal is [`Error::Auth`]).
    #[error("etcd at {endpoint}: {what}: {source}")]
    Etcd {
        /// The endpoints.
        endpoint: String,
        /// The call.
        what: &'static str,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// etcd refused the call for want of authentication or permission: its `auth enable` is
    /// on and no user was given ([`EtcdOptions::user`](crate::EtcdOptions::user)), the
    /// user's name or password is wrong, or the user's roles do not give it this key range.
    #[error(
        "etcd at {endpoint}: {what}: authentication required or refused ({}; check the etcd \
         user, its password and its role's permissions on the directory's keys): {source}",
        as_user(.user)
    )]
    Auth {
        /// The endpoints.
        endpoint: String,
        /// The call (`authenticating` at connect).
        what: &'static str,
        /// The user the call was made as (`None`: no user given); never its password.
        user: Option<String>,
        /// The client's error (etcd's gRPC status).
        #[source]
        source: etcd_client::Error,
    },
    /// A record that cannot be published (or read back).
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The directory file could not be read or written.
    #[error("directory file {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The directory file is not a JSON object with a `members` list.
    #[error("directory file {path}: not a members file: {source}")]
    FileFormat {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
    /// The async runtime the etcd client needs could not start.
    #[error("starting the etcd client's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A record offering regions was to be published unsigned (the directory has no cluster
    /// token) in a directory that does not allow it: their keys would be readable, and the
    /// record forgeable, by whoever reaches the directory. Set a token, or allow unsigned
    /// regions ([`DirectoryConfig::unsigned_regions`](crate::DirectoryConfig::unsigned_regions)).
    #[error(
        "member {member} of cluster {cluster} offers regions {regions:?}, and the directory \
         has no cluster token: their keys are not published in an unsigned record (set a \
         token, or allow unsigned regions)"
    )]
    UnsignedRegions {
        /// The cluster.
        cluster: String,
        /// The member.
        member: String,
        /// The regions it offers.
        regions: Vec<String>,
    },
    /// A file the directory's configuration names (a certificate, a key) could not be read.
    #[error("directory configuration: {what} {path}: {source}")]
    ConfigFile {
        /// What the file is (`CA certificate`, `client certificate`, `client key`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The directory's configuration does not hold together.
    #[error("directory configuration: {0}")]
    Config(&'static str),
    /// The publication was withdrawn already.
    #[error("{0}: withdrawn already")]
    Withdrawn(String),
    /// The watch's backend stopped.
    #[error("the directory watch ended")]
    WatchEnded,
}

/// Who an [`Error::Auth`] call was made as, for its message.
fn as_user(user: &Option<String>) -> String {
    match user {
        Some(name) => format!("as etcd user {name:?}"),
        None => "no etcd user given".to_string(),
    }
}
