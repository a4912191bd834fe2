//! Membership through the cluster directory: sources attach the destinations that joined
//! and drop those that left ([`Source::refresh`]); destinations attach the sources
//! ([`Destination::refresh`]). A member of a weight sync offers its record under
//! [`RECORD_REGION`] and its layout's regions under their names (`offer`, then
//! [`Agent::publish`](crate::Agent::publish)); members that offer no record are someone
//! else's and are left alone.

use super::SyncError;
use super::destination::{Destination, SourceInfo};
use super::record::{RECORD_REGION, RankRecord, read_record};
use super::source::{MemberId, Source};
use crate::agent::Agent;
use crate::discovery::{Connected, Following};
use crate::weights::{Layout, Side};
use fabric_core::metadata::RegionDescriptor;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a refresh changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Ranks attached, with their members' names (a destination that joined gets a new
    /// rank).
    pub attached: Vec<(u32, String)>,
    /// Ranks dropped because their member left or restarted (a restarted one is attached
    /// again by the same refresh, with its new regions).
    pub dropped: Vec<(u32, String)>,
    /// Members that cannot be attached yet, and why (its record unreadable, its regions
    /// not offered yet, a joiner while the sources' layouts are not all known): a later
    /// refresh tries again.
    pub waiting: Vec<(String, String)>,
}

impl Changes {
    /// Adds a later refresh's changes to these: its attached and dropped ranks after
    /// these, and its members still waiting instead of these (the latest word on them).
    pub fn merge(&mut self, later: Changes) {
        self.attached.extend(later.attached);
        self.dropped.extend(later.dropped);
        self.waiting = later.waiting;
    }
}

/// How long reading a member's record may take.
const RECORD_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads the records of the connected members that offer one and were not read for their
/// current instance; notes in `waiting` those that cannot be read now.
fn read_records(
    agent: &Agent,
    peers: &[Connected],
    seen: &mut HashMap<String, (u64, RankRecord)>,
    waiting: &mut Vec<(String, String)>,
) {
    for c in peers {
        let instance = c.peer.info().instance;
        if seen.get(c.name()).is_some_and(|s| s.0 == instance) {
            continue;
        }
        let Some(desc) = c.member.regions.get(RECORD_REGION) else {
            continue;
        };
        match read_record(agent, &c.peer, desc, RECORD_TIMEOUT) {
            Ok((rec, _)) => {
                seen.insert(c.name().to_owned(), (instance, rec));
            }
            Err(e) => waiting.push((c.name().to_owned(), e.to_string())),
        }
    }
    seen.retain(|name, _| peers.iter().any(|c| c.name() == name));
}

/// Why a member's regions cannot be attached yet (a later refresh tries again).
#[derive(Debug, thiserror::Error)]
enum NotOffered {
    /// A region of its layout is not among those it offers.
    #[error("region {0:?} is not offered (yet)")]
    Region(String),
}

/// The descriptors of `layout`'s regions among those `c` offers, by region index.
fn descriptors(c: &Connected, layout: &Layout) -> Result<Vec<RegionDescriptor>, NotOffered> {
    layout
        .regions
        .iter()
        .map(|spec| {
            c.member
                .regions
                .get(&spec.name)
                .cloned()
                .ok_or_else(|| NotOffered::Region(spec.name.clone()))
        })
        .collect()
}

/// The member `c` as attached now.
fn id(c: &Connected) -> MemberId {
    MemberId {
        name: c.name().to_owned(),
        instance: c.peer.info().instance,
    }
}

impl Source {
    /// Brings the destinations in line with the cluster `following` follows: every
    /// destination member (one that offers a [`RankRecord`] of side destination) is
    /// attached, under its rank if it was planned, or planned in first
    /// ([`add_destination`](Self::add_destination), against the sources' layouts read from
    /// their records) if it joined; every attached one that left (or restarted under its
    /// name) is dropped ([`remove_destination`](Self::remove_destination)). Members that
    /// cannot be attached yet are listed in [`Changes::waiting`]; a planned rank claimed by
    /// a second member too is one of them.
    pub fn refresh(&mut self, following: &Following) -> Result<Changes, SyncError> {
        let peers = following.peers();
        let mut changes = Changes::default();
        let agent = self.agent.clone();
        read_records(&agent, &peers, &mut self.seen, &mut changes.waiting);
        // Those gone, or restarted.
        let gone: Vec<(u32, String)> = (self.dests.iter())
            .filter_map(|(&r, d)| {
                let m = d.member.as_ref()?;
                let here = peers.iter().any(|c| id(c) == *m);
                (!here).then(|| (r, m.name.clone()))
            })
            .collect();
        for (r, name) in gone {
            self.remove_destination(r);
            changes.dropped.push((r, name));
        }
        for c in &peers {
            let Some((_, rec)) = self.seen.get(c.name()) else {
                continue;
            };
            if rec.side != Side::Destination {
                continue;
            }
            let me = id(c);
            if self.dests.values().any(|d| d.member.as_ref() == Some(&me)) {
                continue;
            }
            let rec = rec.clone();
            let wait = |changes: &mut Changes, why: String| {
                changes.waiting.push((me.name.clone(), why));
            };
            let regions = match descriptors(c, &rec.layout) {
                Ok(r) => r,
                Err(why) => {
                    wait(&mut changes, why.to_string());
                    continue;
                }
            };
            let rank = match rec.rank {
                Some(r) if r < self.planned => {
                    if self.dests.get(&r).is_some_and(|d| d.member.is_some()) {
                        wait(
                            &mut changes,
                            format!("rank {r} is attached to another member"),
                        );
                        continue;
                    }
                    r
                }
                Some(r) => {
                    let why = format!("rank {r} is outside the plan's {}", self.planned);
                    wait(&mut changes, why);
                    continue;
                }
                None => {
                    let Some(layouts) = self.known_sources() else {
                        wait(
                            &mut changes,
                            "the sources' layouts are not all known yet".into(),
                        );
                        continue;
                    };
                    match self.add_destination(&layouts, &rec.layout) {
                        Ok(r) => r,
                        Err(e) => {
                            wait(&mut changes, format!("cannot be planned in: {e}"));
                            continue;
                        }
                    }
                }
            };
            match self.attach(rank, c.peer.clone(), regions) {
                Ok(()) => {
                    if let Some(d) = self.dests.get_mut(&rank) {
                        d.member = Some(me.clone());
                    }
                    changes.attached.push((rank, me.name.clone()));
                }
                Err(e) => {
                    if rec.rank.is_none() {
                        self.dests.remove(&rank);
                    }
                    wait(&mut changes, e.to_string());
                }
            }
        }
        Ok(changes)
    }

    /// Refreshes ([`refresh`](Self::refresh)) until `count` destinations are attached, each
    /// change of the cluster waking it; fails with [`SyncError::NotAttached`] (naming a
    /// planned rank still missing, if any) after `timeout`.
    pub fn wait_attached(
        &mut self,
        following: &Following,
        count: usize,
        timeout: Duration,
    ) -> Result<Changes, SyncError> {
        let deadline = Instant::now() + timeout;
        let mut all = Changes::default();
        loop {
            let c = self.refresh(following)?;
            all.merge(c);
            if self.attached().len() >= count {
                return Ok(all);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..self.planned)
                    .find(|r| !self.attached().contains(r))
                    .unwrap_or(self.next_rank);
                return Err(SyncError::NotAttached {
                    side: Side::Destination,
                    rank: missing,
                });
            }
            // A member's record may become readable without a change in the directory:
            // look again at least every 100 ms.
            let _ = following.next_event((deadline - now).min(Duration::from_millis(100)));
        }
    }

    /// Every source's layout in rank order, if all are known (this one's own, the others'
    /// from their records).
    fn known_sources(&mut self) -> Option<Vec<Layout>> {
        let mut v: Vec<Option<Layout>> = vec![None; self.sources as usize];
        v[self.rank as usize] = Some(self.layout.clone());
        for (_, rec) in self.seen.values() {
            if rec.side == Side::Source
                && rec.sources == self.sources
                && let Some(r) = rec.rank
                && let Some(slot) = v.get_mut(r as usize)
            {
                *slot = Some(rec.layout.clone());
            }
        }
        let all: Option<Vec<Layout>> = v.into_iter().collect();
        if let Some(l) = &all {
            self.source_layouts = Some(l.clone());
        }
        all.or_else(|| self.source_layouts.clone())
    }
}

impl Destination {
    /// Attaches the sources of the cluster `following` follows (members that offer a
    /// [`RankRecord`] of side source) for pulls, each again when it restarted; detaches
    /// those that left.
    pub fn refresh(&mut self, following: &Following) -> Result<Changes, SyncError> {
        let peers = following.peers();
        let mut changes = Changes::default();
        let agent = self.agent.clone();
        read_records(&agent, &peers, &mut self.seen, &mut changes.waiting);
        let gone: Vec<(u32, String)> = (self.members.iter())
            .filter(|(_, m)| !peers.iter().any(|c| id(c) == **m))
            .map(|(&r, m)| (r, m.name.clone()))
            .collect();
        for (r, name) in gone {
            self.members.remove(&r);
            self.detach_source(r);
            changes.dropped.push((r, name));
        }
        for c in &peers {
            let Some((_, rec)) = self.seen.get(c.name()) else {
                continue;
            };
            let (Side::Source, Some(rank)) = (rec.side, rec.rank) else {
                continue;
            };
            let me = id(c);
            if self.members.get(&rank) == Some(&me) {
                continue;
            }
            if rec.sources != self.sources {
                let why = format!(
                    "it is a source of {} sources, this destination expects {}",
                    rec.sources, self.sources
                );
                changes.waiting.push((me.name.clone(), why));
                continue;
            }
            let rec = rec.clone();
            let regions = match descriptors(c, &rec.layout) {
                Ok(r) => r,
                Err(why) => {
                    changes.waiting.push((me.name.clone(), why.to_string()));
                    continue;
                }
            };
            let Some(record) = c.member.regions.get(RECORD_REGION).cloned() else {
                continue;
            };
            let info = SourceInfo {
                peer: c.peer.clone(),
                layout: rec.layout,
                regions,
                record,
            };
            match self.attach_source(rank, info) {
                Ok(()) => {
                    self.members.insert(rank, me.clone());
                    changes.attached.push((rank, me.name));
                }
                Err(e) => changes.waiting.push((me.name, e.to_string())),
            }
        }
        Ok(changes)
    }

    /// Refreshes ([`refresh`](Self::refresh)) until every source is attached, each change
    /// of the cluster waking it; fails with [`SyncError::NotAttached`] naming a missing
    /// source after `timeout`.
    pub fn wait_sources(
        &mut self,
        following: &Following,
        timeout: Duration,
    ) -> Result<Changes, SyncError> {
        let deadline = Instant::now() + timeout;
        let mut all = Changes::default();
        loop {
            let c = self.refresh(following)?;
            all.merge(c);
            let missing = (0..self.sources).find(|s| !self.links.contains_key(s));
            let Some(missing) = missing else {
                return Ok(all);
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(SyncError::NotAttached {
                    side: Side::Source,
                    rank: missing,
                });
            }
            let _ = following.next_event((deadline - now).min(Duration::from_millis(100)));
        }
    }
}
