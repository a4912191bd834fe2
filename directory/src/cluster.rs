//! Membership driving connections: a [`Cluster`] follows a [`Watch`] and keeps what a
//! [`Peers`] connects (a [`RailGroup`]'s peers here; an `xfer::Agent`'s in the `xfer`
//! crate) equal to the cluster's members.

use crate::record::Record;
use crate::{Event, Watch};
use crossbeam_channel::{Receiver, Sender};
use fabric_core::engine::{GroupPeer, RailGroup};
use fabric_core::metadata::TransportKind;
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a [`Cluster`] drives: something that connects to a member from its record and
/// disconnects it again. A [`Cluster`] calls it on its own thread, one call at a time.
pub trait Peers: Send + Sync + 'static {
    /// A connected member, as the caller uses it (a rail group's peer, an agent's).
    type Peer: Clone + Send + 'static;
    /// Why connecting or disconnecting failed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Connects to the member `record` describes (`record.agent`'s transports).
    fn connect(&self, record: &Record) -> Result<Self::Peer, Refusal<Self::Error>>;

    /// Disconnects a member connected by [`connect`](Peers::connect): its transfers
    /// still in flight fail, others' are not touched.
    fn disconnect(&self, peer: &Self::Peer) -> Result<(), Self::Error>;
}

impl<T: Peers> Peers for Arc<T> {
    type Peer = T::Peer;
    type Error = T::Error;

    fn connect(&self, record: &Record) -> Result<T::Peer, Refusal<T::Error>> {
        (**self).connect(record)
    }

    fn disconnect(&self, peer: &T::Peer) -> Result<(), T::Error> {
        (**self).disconnect(peer)
    }
}

/// Why [`Peers::connect`] did not connect a member.
#[derive(Debug)]
#[non_exhaustive]
pub enum Refusal<E> {
    /// The member offers no transport this side speaks: nothing will change that until
    /// one of them restarts with other transports.
    Incompatible {
        /// What the member offers.
        theirs: Vec<TransportKind>,
        /// What this side offers.
        ours: Vec<TransportKind>,
    },
    /// Connecting failed (the member is unreachable, or its addresses are refused).
    Failed(E),
}

/// A rail group connects members over its one transport (its rails' backend): a member
/// that does not offer it is [`Refusal::Incompatible`].
impl Peers for RailGroup {
    type Peer = GroupPeer;
    type Error = fabric_core::Error;

    fn connect(&self, record: &Record) -> Result<GroupPeer, Refusal<fabric_core::Error>> {
        let ours = self
            .rails()
            .first()
            .and_then(|e| TransportKind::from_name(e.backend()));
        let theirs = ours.and_then(|k| record.agent.transport(k));
        match theirs {
            Some(t) => self.add_peer(&t.rails).map_err(Refusal::Failed),
            None => Err(Refusal::Incompatible {
                theirs: record.agent.transports.iter().map(|t| t.kind).collect(),
                ours: ours.into_iter().collect(),
            }),
        }
    }

    fn disconnect(&self, peer: &GroupPeer) -> Result<(), fabric_core::Error> {
        self.remove_peer(peer)
    }
}

/// A member that is connected: its record and its peer.
#[derive(Clone, Debug)]
pub struct ClusterPeer<P> {
    /// What the member published (its regions among it); the latest record of the same
    /// instance.
    pub record: Record,
    /// The member as connected by the [`Peers`].
    pub peer: P,
}

/// What a [`Cluster`] did with a membership change.
#[derive(Debug)]
#[non_exhaustive]
pub enum ClusterEvent<E> {
    /// The member was connected.
    Joined(String),
    /// The member's record changed in place (its regions, say); the peer is the same.
    Updated(String),
    /// The member left and was disconnected: its transfers still in flight failed with
    /// `PeerRemoved`; other members' transfers are not touched.
    Left(String),
    /// The member could not be connected (its transfers cannot start).
    Unreachable {
        /// The member.
        name: String,
        /// Why connecting failed.
        error: E,
    },
    /// The member offers no transport this side speaks.
    Incompatible {
        /// The member.
        name: String,
        /// What it offers.
        theirs: Vec<TransportKind>,
        /// What this side offers.
        ours: Vec<TransportKind>,
    },
}

struct Shared<P> {
    peers: Mutex<BTreeMap<String, ClusterPeer<P>>>,
    changed: Condvar,
}

impl<P> Shared<P> {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, ClusterPeer<P>>> {
        // A panic elsewhere while holding this map leaves it consistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Keeps what a [`Peers`] connects equal to a cluster's members: [`Event::Joined`] becomes
/// [`Peers::connect`], [`Event::Left`] [`Peers::disconnect`], and a member restarted under
/// its name (a new [`AgentInfo::instance`](fabric_core::metadata::AgentInfo::instance), or
/// changed transports or rails) is disconnected and connected again. Connecting happens on
/// the cluster's own thread, never on an engine worker. Dropping the `Cluster` stops
/// following; the members it connected stay connected.
pub struct Cluster<P: Peers> {
    shared: Arc<Shared<P::Peer>>,
    events: Receiver<ClusterEvent<P::Error>>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl<P: Peers> Cluster<P> {
    /// Follows `watch` for `peers`, skipping the member named `me` (this process).
    pub fn start(peers: P, watch: Watch, me: Option<&str>) -> Cluster<P> {
        let shared = Arc::new(Shared {
            peers: Mutex::new(BTreeMap::new()),
            changed: Condvar::new(),
        });
        let (etx, erx) = crossbeam_channel::unbounded();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let me = me.map(str::to_string);
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("xfer-cluster".into())
            .spawn(move || follow(peers, watch, me, s, etx, stop_rx))
            .ok();
        Cluster {
            shared,
            events: erx,
            stop: Some(stop_tx),
            thread,
        }
    }

    /// The member `name`, if it is connected now.
    pub fn peer(&self, name: &str) -> Option<ClusterPeer<P::Peer>> {
        self.shared.lock().get(name).cloned()
    }

    /// Every member connected now, by name.
    pub fn peers(&self) -> Vec<(String, ClusterPeer<P::Peer>)> {
        self.shared
            .lock()
            .iter()
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    /// Waits up to `timeout` for `name` to be connected.
    pub fn wait_for(&self, name: &str, timeout: Duration) -> Option<ClusterPeer<P::Peer>> {
        self.wait_until(timeout, |peers| peers.get(name).cloned())
    }

    /// Waits up to `timeout` for `name` not to be connected (it left, or never joined).
    /// Returns whether it is gone.
    pub fn wait_gone(&self, name: &str, timeout: Duration) -> bool {
        self.wait_until(timeout, |peers| (!peers.contains_key(name)).then_some(()))
            .is_some()
    }

    /// Waits up to `timeout` for `done` to say yes about the connected members.
    fn wait_until<T>(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&BTreeMap<String, ClusterPeer<P::Peer>>) -> Option<T>,
    ) -> Option<T> {
        let until = Instant::now() + timeout;
        let mut peers = self.shared.lock();
        loop {
            if let Some(v) = done(&peers) {
                return Some(v);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            peers = self
                .shared
                .changed
                .wait_timeout(peers, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// What the cluster did, in order (joins, updates, leaves, failures to connect).
    pub fn events(&self) -> &Receiver<ClusterEvent<P::Error>> {
        &self.events
    }
}

impl<P: Peers> Drop for Cluster<P> {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl<P: Peers> std::fmt::Debug for Cluster<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("peers", &self.shared.lock().keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Whether the member restarted (or re-bound its rails) between `old` and `new`: its
/// connection must be made again.
fn restarted(old: &Record, new: &Record) -> bool {
    old.agent.instance != new.agent.instance || old.agent.transports != new.agent.transports
}

/// The cluster's thread: events in, members connected and disconnected.
fn follow<P: Peers>(
    peers: P,
    watch: Watch,
    me: Option<String>,
    shared: Arc<Shared<P::Peer>>,
    events: Sender<ClusterEvent<P::Error>>,
    stop: Receiver<()>,
) {
    let say = |e: ClusterEvent<P::Error>| {
        let _ = events.send(e);
    };
    let add = |r: Record| {
        let name = r.agent.name.clone();
        match peers.connect(&r) {
            Ok(peer) => {
                shared
                    .lock()
                    .insert(name.clone(), ClusterPeer { record: r, peer });
                shared.changed.notify_all();
                say(ClusterEvent::Joined(name));
            }
            Err(Refusal::Incompatible { theirs, ours }) => {
                tracing::warn!(member = %name, ?theirs, ?ours, "member offers no transport of ours; not connected");
                say(ClusterEvent::Incompatible { name, theirs, ours });
            }
            Err(Refusal::Failed(error)) => {
                tracing::warn!(member = %name, %error, "member could not be connected");
                say(ClusterEvent::Unreachable { name, error });
            }
        }
    };
    let remove = |name: &str| {
        let gone = shared.lock().remove(name);
        if let Some(p) = gone {
            if let Err(e) = peers.disconnect(&p.peer) {
                tracing::warn!(member = %name, error = %e, "disconnecting a departed member failed");
            }
            // Waiters learn it is gone once it is disconnected.
            shared.changed.notify_all();
            say(ClusterEvent::Left(name.to_string()));
        }
    };
    loop {
        if !matches!(stop.try_recv(), Err(crossbeam_channel::TryRecvError::Empty)) {
            return;
        }
        let ev = match watch.next(Duration::from_millis(50)) {
            Ok(Some(ev)) => ev,
            Ok(None) => continue,
            Err(_) => return,
        };
        let is_me = |r: &Record| me.as_deref() == Some(r.name());
        match ev {
            Event::Joined(m) if !is_me(&m.record) => add(m.record),
            Event::Updated { old, new } if !is_me(&new.record) => {
                let name = new.record.agent.name.clone();
                let known = shared.lock().contains_key(&name);
                if restarted(&old.record, &new.record) || !known {
                    remove(&name);
                    add(new.record);
                } else {
                    if let Some(p) = shared.lock().get_mut(&name) {
                        p.record = new.record;
                    }
                    shared.changed.notify_all();
                    say(ClusterEvent::Updated(name));
                }
            }
            Event::Left(m) => remove(m.record.name()),
            _ => {}
        }
    }
}
