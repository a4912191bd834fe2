//! Membership driving an engine: a [`Cluster`] follows a [`Watch`] and keeps a
//! [`RailGroup`]'s peers equal to the cluster's members.

use crate::record::Record;
use crate::{Event, Watch};
use crossbeam_channel::{Receiver, Sender};
use fabric_core::engine::{GroupPeer, RailGroup};
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A member the engine can reach: its record and its peer in the rail group.
#[derive(Clone, Debug)]
pub struct ClusterPeer {
    /// What the member published (its regions among it).
    pub record: Record,
    /// The member as a peer of the rail group.
    pub peer: GroupPeer,
}

/// What a [`Cluster`] did with a membership change.
#[derive(Debug)]
#[non_exhaustive]
pub enum ClusterEvent {
    /// The member was added as a peer.
    Joined(String),
    /// The member's record changed in place (its regions, say); the peer is the same.
    Updated(String),
    /// The member left and its peer was removed: its transfers still in flight failed
    /// with `PeerRemoved`; other peers' transfers are not touched.
    Left(String),
    /// The member could not be added (its transfers cannot start).
    Unreachable {
        /// The member.
        name: String,
        /// Why `add_peer` failed.
        error: fabric_core::Error,
    },
    /// The member speaks another transport than this engine.
    Incompatible {
        /// The member.
        name: String,
        /// Its transport.
        transport: String,
        /// This engine's.
        ours: String,
    },
}

struct Shared {
    peers: Mutex<BTreeMap<String, ClusterPeer>>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, ClusterPeer>> {
        // A panic elsewhere while holding this map leaves it consistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Keeps a rail group's peers equal to a cluster's members: [`Event::Joined`] becomes
/// `add_peer`, [`Event::Left`] `remove_peer`, and a member restarted under its name (a new
/// [`Record::instance`] or new addresses) is removed and added again. Adding a peer happens
/// on the cluster's own thread, never on an engine worker. Dropping the `Cluster` stops
/// following; the peers it added stay in the group.
pub struct Cluster {
    shared: Arc<Shared>,
    events: Receiver<ClusterEvent>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Cluster {
    /// Follows `watch` for `group`, skipping the member named `me` (this process).
    pub fn start(group: Arc<RailGroup>, watch: Watch, me: Option<&str>) -> Cluster {
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
            .spawn(move || follow(group, watch, me, s, etx, stop_rx))
            .ok();
        Cluster {
            shared,
            events: erx,
            stop: Some(stop_tx),
            thread,
        }
    }

    /// The member `name`, if it is a peer now.
    pub fn peer(&self, name: &str) -> Option<ClusterPeer> {
        self.shared.lock().get(name).cloned()
    }

    /// Every member that is a peer now, by name.
    pub fn peers(&self) -> Vec<(String, ClusterPeer)> {
        self.shared
            .lock()
            .iter()
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    /// Waits up to `timeout` for `name` to be a peer.
    pub fn wait_for(&self, name: &str, timeout: Duration) -> Option<ClusterPeer> {
        let until = Instant::now() + timeout;
        let mut peers = self.shared.lock();
        loop {
            if let Some(p) = peers.get(name) {
                return Some(p.clone());
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

    /// What the cluster did, in order (joins, leaves, failures to add).
    pub fn events(&self) -> &Receiver<ClusterEvent> {
        &self.events
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("peers", &self.shared.lock().keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The cluster's thread: events in, peers added and removed.
fn follow(
    group: Arc<RailGroup>,
    watch: Watch,
    me: Option<String>,
    shared: Arc<Shared>,
    events: Sender<ClusterEvent>,
    stop: Receiver<()>,
) {
    let ours = group
        .rails()
        .first()
        .map_or("", |e| e.backend())
        .to_string();
    let say = |e: ClusterEvent| {
        let _ = events.send(e);
    };
    let add = |r: Record| {
        let name = r.name.clone();
        if r.transport != ours {
            tracing::warn!(member = %name, transport = %r.transport, ours = %ours, "member speaks another transport; not added");
            say(ClusterEvent::Incompatible {
                name,
                transport: r.transport,
                ours: ours.clone(),
            });
            return;
        }
        match group.add_peer(&r.addresses) {
            Ok(peer) => {
                shared
                    .lock()
                    .insert(name.clone(), ClusterPeer { record: r, peer });
                shared.changed.notify_all();
                say(ClusterEvent::Joined(name));
            }
            Err(error) => {
                tracing::warn!(member = %name, %error, "member could not be added as a peer");
                say(ClusterEvent::Unreachable { name, error });
            }
        }
    };
    let remove = |name: &str, announce: bool| {
        let gone = shared.lock().remove(name);
        if let Some(p) = gone {
            shared.changed.notify_all();
            if let Err(e) = group.remove_peer(&p.peer) {
                tracing::warn!(member = %name, error = %e, "removing a departed member's peer failed");
            }
            if announce {
                say(ClusterEvent::Left(name.to_string()));
            }
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
        let is_me = |r: &Record| me.as_deref() == Some(r.name.as_str());
        match ev {
            Event::Joined(m) if !is_me(&m.record) => add(m.record),
            Event::Updated { old, new } if !is_me(&new.record) => {
                let restarted = old.record.instance != new.record.instance
                    || old.record.addresses != new.record.addresses
                    || old.record.transport != new.record.transport;
                let known = shared.lock().contains_key(&new.record.name);
                if restarted || !known {
                    remove(&new.record.name, true);
                    add(new.record.clone());
                } else {
                    let name = new.record.name.clone();
                    if let Some(p) = shared.lock().get_mut(&name) {
                        p.record = new.record.clone();
                    }
                    say(ClusterEvent::Updated(name));
                }
            }
            Event::Left(m) => remove(&m.record.name, true),
            _ => {}
        }
    }
}
