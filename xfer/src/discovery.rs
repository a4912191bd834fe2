//! Finding peers through the cluster directory (etcd with leases, or a file): an agent
//! [publishes](Agent::publish) itself (its [`AgentInfo`] and the regions it
//! [offers](Agent::offer) by name) under its name in a cluster, [looks up](Agent::lookup)
//! another member by name, or [follows](Agent::follow) the cluster, so that members become
//! connected [`Peer`]s as they join and are disconnected as they leave.
//!
//! The record is the one metadata format of xfer (the directory's
//! [`directory::Record`]): what a member publishes is exactly what
//! [`Agent::connect`] takes, and its regions are the [`RegionDescriptor`]s that
//! [`Agent::submit`] writes into.
//!
//! ## A cluster that accepts only signed records
//! Open the directory with a cluster token ([`open_with`], [`config_for`] to take the
//! agent's token): every record published is signed with it (HMAC-SHA256), and every
//! record read must carry its signature; a forged or unsigned record is skipped, logged and
//! counted ([`Directory::refused_records`]), and [`Agent::follow`] never connects to its
//! member. Without a token the directory is open: [`open`] publishes regions (with their
//! keys) in unsigned records as before, while [`open_with`] refuses to unless
//! [`DirectoryConfig::unsigned_regions`] allows it. etcd is reached over TLS with a client
//! certificate, and as a user, through [`EtcdOptions::tls`] and [`EtcdOptions::user`].
//! `docs/security.md` says what each protects.
//!
//! ```
//! use std::time::Duration;
//! use xfer::{Access, Agent, AgentOptions, HostBuffer, Transfer, discovery};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let file = std::env::temp_dir().join(format!("xfer-doc-{}.json", std::process::id()));
//! // `etcd://HOST:PORT` in a real cluster; a file here.
//! let dir = discovery::open(&format!("file://{}", file.display()))?;
//! let t = Duration::from_secs(10);
//!
//! // b offers a region named "inbox" and publishes itself as a member of "demo".
//! let b = Agent::new(AgentOptions { name: Some("b".into()), ..AgentOptions::default() })?;
//! let inbox = HostBuffer::new_shared(4096)?;
//! b.offer("inbox", &b.register(inbox.clone(), Access::REMOTE_WRITE)?)?;
//! let _published = b.publish(&*dir, "demo", Duration::from_secs(5))?;
//!
//! // a follows the cluster: b is connected by name, with its regions.
//! let a = Agent::new(AgentOptions { name: Some("a".into()), ..AgentOptions::default() })?;
//! let src = HostBuffer::new_shared(4096)?;
//! src.fill(0, 4096, 7)?;
//! let src = a.register(src, Access::NONE)?;
//! let cluster = a.follow(&*dir, "demo")?;
//! let to_b = cluster.wait_for("b", t)?;
//! let write = Transfer::segments(vec![(0, 0, 4096)]).imm(1);
//! a.submit(&to_b.peer, &src, to_b.region("inbox")?, write)?.wait(t)?;
//! b.wait_imm(1, 1, t)?;
//! assert_eq!(inbox.to_vec(0, 4096)?, vec![7; 4096]);
//! # drop(_published);
//! # let _ = std::fs::remove_file(&file);
//! # Ok(())
//! # }
//! ```

use crate::agent::{Agent, Peer};
use crate::error::{Error, Result};
use directory::{Cluster, Record, Refusal};
use fabric_core::metadata::{AgentInfo, RegionDescriptor};
use std::collections::BTreeMap;
use std::time::Duration;

pub use directory::{
    ClusterToken, Directory, DirectoryConfig, EtcdDirectory, EtcdOptions, EtcdTls, EtcdUser,
    FileDirectory, open, open_with,
};

/// `config` for the directory of an agent built from `opts`: its cluster token, where
/// `config` has none, is the agent's ([`AgentOptions::token`](crate::AgentOptions::token):
/// its `auth_token`, or what its `auth_token_file` holds), so that a fleet with one token
/// signs its records with it too. Pass the result to [`open_with`].
pub fn config_for(
    opts: &crate::AgentOptions,
    mut config: DirectoryConfig,
) -> Result<DirectoryConfig> {
    if config.token.is_none() {
        config.token = opts.token()?;
    }
    Ok(config)
}

/// What a [`Following`] did with a membership change: a member connected
/// ([`Joined`](directory::ClusterEvent::Joined)), its record changed in place
/// ([`Updated`](directory::ClusterEvent::Updated): new regions, say), it left and was
/// disconnected ([`Left`](directory::ClusterEvent::Left)), or it could not be connected
/// ([`Unreachable`](directory::ClusterEvent::Unreachable) with this crate's [`Error`],
/// [`Incompatible`](directory::ClusterEvent::Incompatible): no transport in common).
pub type FollowEvent = directory::ClusterEvent<Error>;

/// A member of a cluster as the directory has it: who it is and the regions it offers by
/// name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// What it says about itself: pass it to [`Agent::connect`].
    pub info: AgentInfo,
    /// The regions it offers, by name.
    pub regions: BTreeMap<String, RegionDescriptor>,
}

impl Member {
    /// Its name in the cluster.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Its region `name`, or [`Error::NoSuchRegion`].
    pub fn region(&self, name: &str) -> Result<&RegionDescriptor> {
        self.regions.get(name).ok_or_else(|| Error::NoSuchRegion {
            member: self.info.name.clone(),
            region: name.to_owned(),
        })
    }
}

impl From<Record> for Member {
    fn from(r: Record) -> Member {
        Member {
            info: r.agent,
            regions: r.regions,
        }
    }
}

/// A followed member that is connected: the peer to submit to, and what it published.
#[derive(Clone, Debug)]
pub struct Connected {
    /// The member as a peer of the following agent.
    pub peer: Peer,
    /// Its latest record (its regions change in place when it offers more).
    pub member: Member,
}

impl Connected {
    /// Its name in the cluster.
    pub fn name(&self) -> &str {
        self.member.name()
    }

    /// Its region `name`, or [`Error::NoSuchRegion`].
    pub fn region(&self, name: &str) -> Result<&RegionDescriptor> {
        self.member.region(name)
    }
}

impl From<directory::ClusterPeer<Peer>> for Connected {
    fn from(p: directory::ClusterPeer<Peer>) -> Connected {
        Connected {
            peer: p.peer,
            member: p.record.into(),
        }
    }
}

/// An agent published in a cluster: its record stays in the directory while this lives
/// (renewed within its TTL by the directory); [`withdraw`](Publication::withdraw) or
/// dropping it removes it. It holds a handle of its agent, which lives as long.
pub struct Publication {
    inner: directory::Publication,
    agent: Agent,
    cluster: String,
    ttl: Duration,
}

impl Publication {
    /// The directory key the record lives under.
    pub fn key(&self) -> &str {
        self.inner.key()
    }

    /// The cluster it is published in.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// Publishes the agent's record again as it is now (the regions offered since, or
    /// withdrawn by deregistering them); members following the cluster see the new
    /// regions without reconnecting. Nothing changes for them if nothing changed.
    pub fn update(&mut self) -> Result<()> {
        let record = record_of(&self.agent, &self.cluster, self.ttl);
        Ok(self.inner.update(&record)?)
    }

    /// Removes the record now: followers disconnect this agent.
    pub fn withdraw(self) -> Result<()> {
        Ok(self.inner.withdraw()?)
    }
}

impl std::fmt::Debug for Publication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publication")
            .field("key", &self.inner.key())
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// An agent following a cluster: every other member becomes a connected peer as it joins
/// (over the best transport both offer), is connected again when it restarts under its
/// name, and is disconnected when it leaves (withdrawn, or its lease expired); its
/// transfers still in flight then fail with `PeerRemoved`. Connecting happens on the
/// following's own thread, which holds a handle of the agent. Dropping it stops
/// following; the peers it connected stay connected.
pub struct Following {
    cluster: Cluster<Agent>,
    name: String,
}

impl Following {
    /// The cluster followed.
    pub fn cluster(&self) -> &str {
        &self.name
    }

    /// The member `name`, if it is connected now.
    pub fn peer(&self, name: &str) -> Option<Connected> {
        self.cluster.peer(name).map(Connected::from)
    }

    /// Every member connected now, by name.
    pub fn peers(&self) -> Vec<Connected> {
        self.cluster
            .peers()
            .into_iter()
            .map(|(_, p)| p.into())
            .collect()
    }

    /// Waits up to `timeout` for `name` to be connected, or fails with
    /// [`Error::NotJoined`].
    pub fn wait_for(&self, name: &str, timeout: Duration) -> Result<Connected> {
        self.cluster
            .wait_for(name, timeout)
            .map(Connected::from)
            .ok_or_else(|| Error::NotJoined {
                cluster: self.name.clone(),
                name: name.to_owned(),
                waited: timeout,
            })
    }

    /// Waits up to `timeout` for `name` not to be connected (it left and was
    /// disconnected, or never joined), or fails with [`Error::NotLeft`].
    pub fn wait_gone(&self, name: &str, timeout: Duration) -> Result<()> {
        if self.cluster.wait_gone(name, timeout) {
            Ok(())
        } else {
            Err(Error::NotLeft {
                cluster: self.name.clone(),
                name: name.to_owned(),
                waited: timeout,
            })
        }
    }

    /// The next thing the following did, waiting at most `timeout` (`None`: nothing
    /// happened, or it stopped).
    pub fn next_event(&self, timeout: Duration) -> Option<FollowEvent> {
        self.cluster.events().recv_timeout(timeout).ok()
    }

    /// The next thing the following did, if one is waiting.
    pub fn try_event(&self) -> Option<FollowEvent> {
        self.cluster.events().try_recv().ok()
    }
}

impl std::fmt::Debug for Following {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Following")
            .field("cluster", &self.name)
            .field("peers", &self.cluster)
            .finish()
    }
}

/// An agent connects members from their records: over the best transport both offer
/// ([`resolve`](crate::resolve)); a member with none in common is
/// [`Refusal::Incompatible`].
impl directory::Peers for Agent {
    type Peer = Peer;
    type Error = Error;

    fn connect(&self, record: &Record) -> std::result::Result<Peer, Refusal<Error>> {
        match Agent::connect(self, &record.agent) {
            Ok(p) => Ok(p),
            Err(Error::NoCommonTransport { .. }) => Err(Refusal::Incompatible {
                theirs: record.agent.transports.iter().map(|t| t.kind).collect(),
                ours: self.transports(),
            }),
            Err(e) => Err(Refusal::Failed(e)),
        }
    }

    fn disconnect(&self, peer: &Peer) -> Result<()> {
        Agent::disconnect(self, peer)
    }
}

/// The member `name` of `cluster` in `dir`, if it is published there with a valid record:
/// who it is (its [`AgentInfo`], with where its rendezvous listens) and the regions it
/// offers. Finding a member needs no agent of one's own: a program may look its peer up
/// first, then build its agent toward the peer's address (its NICs face that way).
pub fn lookup(dir: &dyn Directory, cluster: &str, name: &str) -> Result<Option<Member>> {
    Ok(dir.lookup(cluster, name)?.map(|m| m.record.into()))
}

/// The record of `agent` in `cluster` now.
fn record_of(agent: &Agent, cluster: &str, ttl: Duration) -> Record {
    let mut r = Record::new(cluster, agent.info().clone());
    r.regions = agent.offered();
    r.started_ms = agent.started_ms();
    r.ttl_ms = ttl.as_millis().try_into().unwrap_or(u64::MAX);
    r
}

impl Agent {
    /// Publishes this agent in `cluster` of `dir` under its name: its [`AgentInfo`] and
    /// the regions it [offers](Agent::offer) now, to live `ttl` past this process's last
    /// renewal (a process that dies leaves the cluster after it). Offer more later and
    /// call [`Publication::update`]. The name must be a valid member name (letters,
    /// digits, `-`, `_`, `.`).
    pub fn publish(
        &self,
        dir: &dyn Directory,
        cluster: &str,
        ttl: Duration,
    ) -> Result<Publication> {
        let record = record_of(self, cluster, ttl);
        let inner = dir.publish(record, ttl)?;
        Ok(Publication {
            inner,
            agent: self.clone(),
            cluster: cluster.to_owned(),
            ttl,
        })
    }

    /// The member `name` of `cluster`, if it is published there with a valid record; pass
    /// its [`info`](Member::info) to [`Agent::connect`]. As [`lookup`], which needs no agent.
    pub fn lookup(&self, dir: &dyn Directory, cluster: &str, name: &str) -> Result<Option<Member>> {
        lookup(dir, cluster, name)
    }

    /// Follows `cluster` of `dir`: every member but this agent (by name) is connected as it
    /// joins and disconnected as it leaves; see [`Following`]. The members there now are
    /// connected first.
    pub fn follow(&self, dir: &dyn Directory, cluster: &str) -> Result<Following> {
        let watch = dir.watch(cluster)?;
        Ok(Following {
            cluster: Cluster::start(self.clone(), watch, Some(self.name())),
            name: cluster.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Access, AgentOptions, HostBuffer};

    const T: Duration = Duration::from_secs(20);
    const TTL: Duration = Duration::from_secs(30);

    fn agent(name: &str) -> Agent {
        Agent::new(AgentOptions {
            name: Some(name.into()),
            ..AgentOptions::default()
        })
        .unwrap()
    }

    struct TempFile(std::path::PathBuf);

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
            let _ = std::fs::remove_file(self.0.with_extension("lock"));
        }
    }

    /// A follower with the cluster's token connects the member that signed with it, and
    /// never the ones that published with another token or none (real agents, each
    /// offering a region).
    #[test]
    fn a_follower_connects_only_members_signed_with_the_cluster_token() {
        let file = TempFile(
            std::env::temp_dir().join(format!("xfer-discovery-signed-{}.json", std::process::id())),
        );
        let url = format!("file://{}", file.0.display());
        let with = |token: Option<&str>| {
            let config = DirectoryConfig {
                token: token.map(str::to_string),
                unsigned_regions: true,
                ..DirectoryConfig::default()
            };
            open_with(&url, &config).unwrap()
        };
        let signed = with(Some("cluster token"));
        let forger = with(Some("a guess"));
        let open_dir = with(None);

        let mut publications = Vec::new();
        let mut agents = Vec::new();
        for (name, dir) in [("b", &signed), ("m1", &forger), ("m2", &open_dir)] {
            let a = agent(name);
            let inbox = HostBuffer::new_shared(4096).unwrap();
            a.offer("inbox", &a.register(inbox, Access::REMOTE_WRITE).unwrap())
                .unwrap();
            publications.push(a.publish(&**dir, "c", TTL).unwrap());
            agents.push(a);
        }

        let a = agent("a");
        let following = a.follow(&*signed, "c").unwrap();
        let b = following.wait_for("b", T).unwrap();
        assert!(b.region("inbox").is_ok());
        // The first listing held all three, its skipped records reported before its
        // members: once b joined, m1 and m2 were seen and refused.
        // The join is said after b is connected: wait for it, then take what else came.
        let mut said = vec![format!("{:?}", following.next_event(T))];
        while let Some(e) = following.try_event() {
            said.push(format!("{e:?}"));
        }
        assert_eq!(said, [r#"Some(Joined("b"))"#]);
        assert!(following.peer("m1").is_none() && following.peer("m2").is_none());
        assert!(signed.refused_records() >= 2);
        // A lookup through the signed directory does not find them either.
        assert_eq!(lookup(&*signed, "c", "m1").unwrap(), None);
        assert!(lookup(&*signed, "c", "b").unwrap().is_some());
        drop(publications);
    }

    #[test]
    fn the_directory_token_defaults_to_the_agents() {
        let opts = AgentOptions {
            auth_token: Some("fleet".into()),
            ..AgentOptions::default()
        };
        let c = config_for(&opts, DirectoryConfig::default()).unwrap();
        assert_eq!(c.token.as_deref(), Some("fleet"));
        let own = DirectoryConfig {
            token: Some("its own".into()),
            ..DirectoryConfig::default()
        };
        assert_eq!(
            config_for(&opts, own).unwrap().token.as_deref(),
            Some("its own")
        );
        let both = AgentOptions {
            auth_token_file: Some("/nonexistent".into()),
            ..opts
        };
        assert!(matches!(
            config_for(&both, DirectoryConfig::default()),
            Err(Error::AuthToken(_))
        ));
    }
}
