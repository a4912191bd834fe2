//! The static-file backend: the same records and events as etcd, from one JSON file.

use directory::{Directory, Error, Event, FileDirectory, Record, RecordError};
use fabric_core::MemoryLocation;
use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};
use std::path::PathBuf;
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

fn record(cluster: &str, name: &str) -> Record {
    let mut a = AgentInfo::new(name, "boot-of-this-test", MemoryLocation::Host);
    a.transports = vec![TransportInfo::new(TransportKind::Tcp, vec![vec![9; 4]])];
    Record::new(cluster, a)
}

fn path(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("xfer-dir-{tag}-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

#[test]
fn publish_lookup_watch_and_withdraw_through_a_file() {
    let p = path("basic");
    let d = FileDirectory::open(&p).with_poll(Duration::from_millis(20));
    assert!(
        d.members("c").unwrap().members.is_empty(),
        "no file is an empty directory"
    );
    let w = d.watch("c").unwrap();
    let mut r = record("c", "n1");
    let mut pub1 = d.publish(r.clone(), Duration::from_secs(7)).unwrap();
    // Another cluster in the same file is not this cluster's member.
    let _other = d.publish(record("elsewhere", "n1"), T).unwrap();
    match w.next(T).unwrap() {
        Some(Event::Joined(m)) => {
            assert_eq!(m.record.agent.transports[0].rails, vec![vec![9; 4]]);
            assert_eq!(m.record.ttl_ms, 7000);
        }
        other => panic!("expected a join, got {other:?}"),
    }
    assert_eq!(d.lookup("c", "n1").unwrap().unwrap().record.name(), "n1");
    r.agent.transports[0].nics = vec!["eth0".into()];
    pub1.update(&r).unwrap();
    assert!(matches!(w.next(T).unwrap(), Some(Event::Updated { .. })));
    let mut wrong = r.clone();
    wrong.agent.name = "n2".into();
    assert!(pub1.update(&wrong).is_err(), "a publication keeps its name");
    pub1.withdraw().unwrap();
    assert!(matches!(w.next(T).unwrap(), Some(Event::Left(m)) if m.record.name() == "n1"));
    assert_eq!(d.members("elsewhere").unwrap().members.len(), 1);
    let _ = std::fs::remove_file(&p);
}

#[test]
fn a_hand_written_file_with_bad_entries_lists_the_good_ones() {
    let p = path("hostile");
    let good = record("c", "ok");
    let mut v99 = serde_json::to_value(record("c", "v99")).unwrap();
    v99["version"] = 99.into();
    // What a build before the metadata format wrote (record version 1).
    let v1 = serde_json::json!({
        "version": 1, "cluster": "c", "name": "old", "instance": 5, "host": "pod-a",
        "transport": "tcp", "addresses": ["010203"], "memory": "host",
        "regions": {}, "started_ms": 1, "ttl_ms": 2000
    });
    let text = serde_json::json!({
        "members": [good, v99, {"cluster": "c", "agent": {"name": "junk"}}, "not an object", v1]
    });
    std::fs::write(&p, serde_json::to_vec(&text).unwrap()).unwrap();
    let d = FileDirectory::open(&p);
    let l = d.members("c").unwrap();
    assert_eq!(l.members.len(), 1);
    assert_eq!(l.skipped.len(), 3, "{:?}", l.skipped);
    assert!(l.skipped[0].0.ends_with("[1]"), "{:?}", l.skipped);
    assert!(
        l.skipped[2].0.ends_with("[4]") && matches!(l.skipped[2].1, RecordError::Version(1)),
        "{:?}",
        l.skipped
    );
    // Publishing a member replaces the old build's record of its name.
    let p2 = d.publish(record("c", "old"), T).unwrap();
    let l = d.members("c").unwrap();
    assert_eq!(l.members.len(), 2, "{:?}", l.members);
    assert_eq!(l.skipped.len(), 2, "{:?}", l.skipped);
    drop(p2);
    std::fs::write(&p, b"{\"members\": 3}").unwrap();
    assert!(matches!(d.members("c"), Err(Error::FileFormat { .. })));
    let _ = std::fs::remove_file(&p);
}
