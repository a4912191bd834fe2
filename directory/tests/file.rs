//! The static-file backend: the same records and events as etcd, from one JSON file.

use directory::{Directory, Error, Event, FileDirectory, Record};
use std::path::PathBuf;
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

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
    let mut r = Record::new("c", "n1", "tcp");
    r.addresses = vec![vec![9; 4]];
    let mut pub1 = d.publish(r.clone(), Duration::from_secs(7)).unwrap();
    // Another cluster in the same file is not this cluster's member.
    let _other = d.publish(Record::new("elsewhere", "n1", "tcp"), T).unwrap();
    match w.next(T).unwrap() {
        Some(Event::Joined(m)) => {
            assert_eq!(m.record.addresses, vec![vec![9; 4]]);
            assert_eq!(m.record.ttl_ms, 7000);
        }
        other => panic!("expected a join, got {other:?}"),
    }
    assert_eq!(d.lookup("c", "n1").unwrap().unwrap().record.name, "n1");
    r.nics = vec!["eth0".into()];
    pub1.update(&r).unwrap();
    assert!(matches!(w.next(T).unwrap(), Some(Event::Updated { .. })));
    let mut wrong = r.clone();
    wrong.name = "n2".into();
    assert!(pub1.update(&wrong).is_err(), "a publication keeps its name");
    pub1.withdraw().unwrap();
    assert!(matches!(w.next(T).unwrap(), Some(Event::Left(m)) if m.record.name == "n1"));
    assert_eq!(d.members("elsewhere").unwrap().members.len(), 1);
    let _ = std::fs::remove_file(&p);
}

#[test]
fn a_hand_written_file_with_bad_entries_lists_the_good_ones() {
    let p = path("hostile");
    let good = Record::new("c", "ok", "tcp");
    let mut v99 = serde_json::to_value(Record::new("c", "v99", "tcp")).unwrap();
    v99["version"] = 99.into();
    let text = serde_json::json!({
        "members": [good, v99, {"cluster": "c", "name": "junk"}, "not an object"]
    });
    std::fs::write(&p, serde_json::to_vec(&text).unwrap()).unwrap();
    let d = FileDirectory::open(&p);
    let l = d.members("c").unwrap();
    assert_eq!(l.members.len(), 1);
    assert_eq!(l.skipped.len(), 2, "{:?}", l.skipped);
    assert!(l.skipped[0].0.ends_with("[1]"), "{:?}", l.skipped);
    std::fs::write(&p, b"{\"members\": 3}").unwrap();
    assert!(matches!(d.members("c"), Err(Error::FileFormat { .. })));
    let _ = std::fs::remove_file(&p);
}
