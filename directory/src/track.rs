//! What a watcher knows of a cluster, and the events that changes to it make: shared by the
//! etcd watch (live events, and listings after a reconnect) and the file watch (listings).

use crate::record::{RecordError, members_prefix};
use crate::sign::Signing;
use crate::{Event, Listing, Member};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The shortest grace a member missing from a listing after a reconnect gets.
const MIN_GRACE: Duration = Duration::from_secs(1);

/// The longest: a TTL is whatever a record says (input from the network), and a deadline
/// past what the clock can hold would panic the watcher.
const MAX_GRACE: Duration = Duration::from_secs(24 * 3600);

/// The members a watcher has reported, and those missing since a reconnect.
#[derive(Default)]
pub(crate) struct Tracker {
    known: BTreeMap<String, Member>,
    /// Members absent from the listing taken after a reconnect, with when they are
    /// declared gone unless they reappear: their publishers may be re-publishing into an
    /// etcd that lost its data.
    missing: BTreeMap<String, Instant>,
    /// How records' signatures are checked.
    signing: Signing,
}

impl Tracker {
    /// A tracker that checks records' signatures with `signing`.
    pub(crate) fn new(signing: Signing) -> Tracker {
        Tracker {
            signing,
            ..Tracker::default()
        }
    }

    /// A record was written under `key` at `revision`.
    pub(crate) fn put(
        &mut self,
        cluster: &str,
        key: &str,
        value: &[u8],
        revision: i64,
    ) -> Vec<Event> {
        match self.signing.decode(cluster, key, value) {
            Ok(record) => self.valid(Member { record, revision }),
            Err(error) => {
                let mut out = Vec::new();
                skipped(key, &error);
                // The member's record is unusable now: it is gone as far as anyone can act.
                if let Some(name) = name_of(cluster, key)
                    && let Some(old) = self.known.remove(name)
                {
                    self.missing.remove(name);
                    out.push(Event::Left(old));
                }
                out.push(Event::Skipped {
                    key: key.to_string(),
                    error,
                });
                out
            }
        }
    }

    /// The record under `key` was deleted (withdrawn or expired).
    pub(crate) fn delete(&mut self, cluster: &str, key: &str) -> Vec<Event> {
        let Some(name) = name_of(cluster, key) else {
            return Vec::new();
        };
        self.missing.remove(name);
        self.known
            .remove(name)
            .map(Event::Left)
            .into_iter()
            .collect()
    }

    /// A whole listing: the first (everyone joins), or one after a reconnect (`grace`:
    /// members not listed are given their TTL to reappear before they are declared gone)
    /// or a file's (no grace).
    pub(crate) fn listing(&mut self, listing: Listing, grace: bool, now: Instant) -> Vec<Event> {
        let mut out = Vec::new();
        let mut listed = BTreeMap::new();
        for (key, error) in listing.skipped {
            skipped(&key, &error);
            out.push(Event::Skipped { key, error });
        }
        for m in listing.members {
            listed.insert(m.record.agent.name.clone(), ());
            out.extend(self.valid(m));
        }
        let absent: Vec<String> = self
            .known
            .keys()
            .filter(|n| !listed.contains_key(*n))
            .cloned()
            .collect();
        for name in absent {
            if grace {
                let ttl = self.known[&name].record.ttl_ms;
                let due = now + Duration::from_millis(ttl).clamp(MIN_GRACE, MAX_GRACE);
                self.missing.entry(name).or_insert(due);
            } else if let Some(old) = self.known.remove(&name) {
                out.push(Event::Left(old));
            }
        }
        out
    }

    /// Members missing since a reconnect whose grace has run out.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<Event> {
        let due: Vec<String> = self
            .missing
            .iter()
            .filter(|(_, t)| **t <= now)
            .map(|(n, _)| n.clone())
            .collect();
        let mut out = Vec::new();
        for name in due {
            self.missing.remove(&name);
            if let Some(old) = self.known.remove(&name) {
                out.push(Event::Left(old));
            }
        }
        out
    }

    /// Whether members are waiting out their grace.
    #[cfg(test)]
    pub(crate) fn has_missing(&self) -> bool {
        !self.missing.is_empty()
    }

    fn valid(&mut self, m: Member) -> Vec<Event> {
        let name = m.record.agent.name.clone();
        self.missing.remove(&name);
        match self.known.insert(name, m.clone()) {
            None => vec![Event::Joined(m)],
            // The same record written again (a re-publish): nothing changed for anyone.
            Some(old) if old.record == m.record => Vec::new(),
            Some(old) => vec![Event::Updated {
                old: Box::new(old),
                new: Box::new(m),
            }],
        }
    }
}

/// The member name of a key of `cluster`.
fn name_of<'k>(cluster: &str, key: &'k str) -> Option<&'k str> {
    key.strip_prefix(&members_prefix(cluster))
}

fn skipped(key: &str, error: &RecordError) {
    if matches!(
        error,
        RecordError::Unsigned | RecordError::BadSignature | RecordError::CannotCheck
    ) {
        // Logged, with the count, where it was refused.
        return;
    }
    tracing::warn!(key, %error, "skipping a member key that holds no valid record");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Record, member_key};
    use fabric_core::MemoryLocation;
    use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};

    fn rec(name: &str, instance: u64) -> Vec<u8> {
        rec_ttl(name, instance, 2000)
    }

    fn rec_ttl(name: &str, instance: u64, ttl_ms: u64) -> Vec<u8> {
        let mut agent = AgentInfo::new(name, "boot", MemoryLocation::Host);
        agent.instance = instance;
        agent.transports = vec![TransportInfo::new(TransportKind::Tcp, vec![vec![1]])];
        let mut r = Record::new("c", agent);
        r.started_ms = 1;
        r.ttl_ms = ttl_ms;
        r.encode().unwrap()
    }

    fn kinds(evs: &[Event]) -> Vec<String> {
        evs.iter()
            .map(|e| match e {
                Event::Joined(m) => format!("joined {}", m.record.name()),
                Event::Updated { new, .. } => format!("updated {}", new.record.name()),
                Event::Left(m) => format!("left {}", m.record.name()),
                Event::Skipped { key, .. } => format!("skipped {key}"),
            })
            .collect()
    }

    #[test]
    fn puts_and_deletes_make_joins_updates_and_leaves() {
        let mut t = Tracker::default();
        let k = member_key("c", "a");
        assert_eq!(kinds(&t.put("c", &k, &rec("a", 1), 5)), ["joined a"]);
        assert!(
            t.put("c", &k, &rec("a", 1), 6).is_empty(),
            "a re-publish is no event"
        );
        assert_eq!(kinds(&t.put("c", &k, &rec("a", 2), 7)), ["updated a"]);
        assert_eq!(kinds(&t.delete("c", &k)), ["left a"]);
        assert!(t.delete("c", &k).is_empty());
    }

    #[test]
    fn a_broken_record_over_a_good_one_is_a_leave_and_a_skip() {
        let mut t = Tracker::default();
        let k = member_key("c", "a");
        t.put("c", &k, &rec("a", 1), 5);
        assert_eq!(
            kinds(&t.put("c", &k, b"{not json", 6)),
            ["left a", format!("skipped {k}").as_str()]
        );
    }

    #[test]
    fn after_a_reconnect_unlisted_members_get_their_ttl() {
        let mut t = Tracker::default();
        let now = Instant::now();
        let first = Listing {
            members: ["a", "b"]
                .iter()
                .map(|n| Member {
                    record: Record::decode("c", &member_key("c", n), &rec(n, 1)).unwrap(),
                    revision: 1,
                })
                .collect(),
            ..Listing::default()
        };
        assert_eq!(
            kinds(&t.listing(first, false, now)),
            ["joined a", "joined b"]
        );
        let only_a = Listing {
            members: vec![Member {
                record: Record::decode("c", &member_key("c", "a"), &rec("a", 1)).unwrap(),
                revision: 9,
            }],
            ..Listing::default()
        };
        assert!(t.listing(only_a, true, now).is_empty());
        assert!(t.has_missing());
        assert!(t.expire(now + Duration::from_millis(1999)).is_empty());
        // b re-published in time: nothing to report.
        assert!(
            t.put("c", &member_key("c", "b"), &rec("b", 1), 10)
                .is_empty()
        );
        assert!(!t.has_missing());
        // Without a reappearance the grace runs out.
        t.listing(Listing::default(), true, now);
        assert_eq!(
            kinds(&t.expire(now + Duration::from_secs(2))),
            ["left a", "left b"]
        );
    }

    #[test]
    fn a_huge_ttl_from_a_record_is_bounded_not_a_panic() {
        let mut t = Tracker::default();
        let now = Instant::now();
        let k = member_key("c", "a");
        t.put("c", &k, &rec_ttl("a", 1, u64::MAX), 1);
        assert!(t.listing(Listing::default(), true, now).is_empty());
        assert!(t.expire(now + Duration::from_secs(3600)).is_empty());
        assert_eq!(kinds(&t.expire(now + MAX_GRACE)), ["left a"]);
    }
}
