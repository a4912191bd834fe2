//! The etcd backend against a real etcd (Debian's etcd-server, started per test on free
//! loopback ports; `XFER_REQUIRE_ETCD` makes its absence a failure).

use directory::testing::Etcd;
use directory::{Directory, Error, EtcdDirectory, EtcdOptions, Event, Record, RecordError, Watch};
use fabric_core::MemoryLocation;
use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};
use fabric_core::testing::eventually;
use std::time::{Duration, Instant};

const CLUSTER: &str = "test";
const TTL: Duration = Duration::from_secs(2);

fn connect(e: &Etcd) -> EtcdDirectory {
    EtcdDirectory::connect(&[e.endpoint()], EtcdOptions::default()).expect("connecting to etcd")
}

fn agent(name: &str) -> AgentInfo {
    let mut a = AgentInfo::new(name, "boot-of-this-test", MemoryLocation::Host);
    a.transports = vec![TransportInfo::new(
        TransportKind::Tcp,
        vec![format!("addr-of-{name}").into_bytes()],
    )];
    a
}

fn record(name: &str) -> Record {
    Record::new(CLUSTER, agent(name))
}

/// The next event within `within`, or a panic naming what was awaited.
fn next(w: &Watch, within: Duration, what: &str) -> Event {
    match w.next(within) {
        Ok(Some(e)) => e,
        Ok(None) => panic!("no event within {within:?} while waiting for {what}"),
        Err(e) => panic!("watch failed while waiting for {what}: {e}"),
    }
}

/// Events until `within` passes with none.
fn drain(w: &Watch, within: Duration) -> Vec<Event> {
    let mut out = Vec::new();
    while let Ok(Some(e)) = w.next(within) {
        out.push(e);
    }
    out
}

fn name(e: &Event) -> String {
    match e {
        Event::Joined(m) | Event::Left(m) => m.record.name().to_string(),
        Event::Updated { new, .. } => new.record.name().to_string(),
        Event::Skipped { key, .. } => key.clone(),
        _ => String::new(),
    }
}

#[test]
fn publish_lookup_list_and_watch_in_order() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    let d = connect(&e);
    let a = d.publish(record("a"), TTL).unwrap();
    let w = d.watch(CLUSTER).unwrap();
    // Members present when the watch began come first, as joins.
    assert!(matches!(next(&w, TTL, "a's join"), Event::Joined(m) if m.record.name() == "a"));
    let mut b = d.publish(record("b"), TTL).unwrap();
    assert!(matches!(next(&w, TTL, "b's join"), Event::Joined(m) if m.record.name() == "b"));

    let found = d.lookup(CLUSTER, "b").unwrap().expect("b is published");
    assert_eq!(
        found
            .record
            .agent
            .transport(TransportKind::Tcp)
            .unwrap()
            .rails,
        vec![b"addr-of-b".to_vec()]
    );
    assert_eq!(found.record.agent.boot_id, "boot-of-this-test");
    assert_eq!(found.record.ttl_ms, 2000);
    assert!(d.lookup(CLUSTER, "nobody").unwrap().is_none());
    let names: Vec<String> = d
        .members(CLUSTER)
        .unwrap()
        .members
        .iter()
        .map(|m| m.record.name().to_string())
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert!(d.members("other").unwrap().members.is_empty());

    let mut changed = found.record.clone();
    changed.agent.transports[0].nics = vec!["eth1".into()];
    b.update(&changed).unwrap();
    match next(&w, TTL, "b's update") {
        Event::Updated { old, new } => {
            assert!(old.record.agent.transports[0].nics.is_empty());
            assert_eq!(new.record.agent.transports[0].nics, ["eth1"]);
            assert_eq!(new.record.instance(), old.record.instance());
            assert!(new.revision > old.revision);
        }
        other => panic!("expected b's update, got {other:?}"),
    }
    b.withdraw().unwrap();
    assert!(matches!(next(&w, TTL, "b's leave"), Event::Left(m) if m.record.name() == "b"));
    drop(a);
    assert!(matches!(next(&w, TTL, "a's leave"), Event::Left(m) if m.record.name() == "a"));
    assert!(d.members(CLUSTER).unwrap().members.is_empty());
}

#[test]
fn a_member_that_stops_renewing_is_gone_within_its_ttl() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    let d = connect(&e);
    let w = d.watch(CLUSTER).unwrap();
    let p = d.publish(record("crashed"), TTL).unwrap();
    assert!(matches!(next(&w, TTL, "the join"), Event::Joined(_)));
    // Renewals go on while it lives: twice its TTL later it is still there.
    assert!(drain(&w, TTL * 2).is_empty());
    assert!(d.lookup(CLUSTER, "crashed").unwrap().is_some());
    let died = Instant::now();
    p.abandon();
    match next(&w, TTL * 3, "the expiry") {
        Event::Left(m) => assert_eq!(m.record.name(), "crashed"),
        other => panic!("expected a leave, got {other:?}"),
    }
    let after = died.elapsed();
    // etcd checks expiry every 500 ms; the lease was renewed up to a third of a TTL ago.
    assert!(
        after <= TTL + Duration::from_secs(1),
        "gone after {after:?}"
    );
    assert!(d.lookup(CLUSTER, "crashed").unwrap().is_none());
}

#[test]
fn hostile_records_are_skipped_with_their_key() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    let d = connect(&e);
    let good = d.publish(record("good"), TTL).unwrap();
    let prefix = directory::record::members_prefix(CLUSTER);
    let mut wrong_version = serde_json::to_value(record("v99")).unwrap();
    wrong_version["version"] = 99.into();
    let theirs = Record::new("other", agent("theirs"));
    // A record of the format before this one (version 1), as an older build wrote it.
    let v1 = serde_json::json!({
        "version": 1, "cluster": CLUSTER, "name": "old", "instance": 5, "host": "pod-a",
        "transport": "tcp", "addresses": ["010203"], "memory": "host",
        "regions": {}, "started_ms": 1, "ttl_ms": 2000
    });
    // A record whose agent metadata is unusable (a transport without rails).
    let mut no_rails = serde_json::to_value(record("norails")).unwrap();
    no_rails["agent"]["transports"][0]["rails"] = serde_json::json!([]);
    let hostile: Vec<(String, Vec<u8>)> = vec![
        (format!("{prefix}garbage"), b"\xff\x00not json".to_vec()),
        (format!("{prefix}huge"), vec![b'['; 1 << 20]),
        (
            format!("{prefix}v99"),
            serde_json::to_vec(&wrong_version).unwrap(),
        ),
        (format!("{prefix}old"), serde_json::to_vec(&v1).unwrap()),
        (
            format!("{prefix}norails"),
            serde_json::to_vec(&no_rails).unwrap(),
        ),
        (
            format!("{prefix}theirs"),
            serde_json::to_vec(&theirs).unwrap(),
        ),
        (format!("{prefix}a/b"), record("a").encode().unwrap()),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let put = |k: &str, v: &[u8]| {
        rt.block_on(async {
            let mut c = etcd_client::Client::connect([e.endpoint()], None).await?;
            c.put(k, v, None).await.map(|_| ())
        })
        .unwrap()
    };
    for (k, v) in &hostile[..5] {
        put(k, v);
    }
    let listing = d.members(CLUSTER).unwrap();
    assert_eq!(listing.members.len(), 1);
    assert_eq!(listing.members[0].record.name(), "good");
    let mut why: Vec<(String, String)> = listing
        .skipped
        .iter()
        .map(|(k, e)| (k.trim_start_matches(&prefix).to_string(), e.to_string()))
        .collect();
    why.sort();
    assert_eq!(why.len(), 5, "{why:?}");
    assert!(why[0].1.contains("not a record"), "{why:?}");
    assert!(why[1].1.contains("more than the 65536 allowed"), "{why:?}");
    assert!(why[2].1.contains("0 rails"), "{why:?}");
    assert!(
        why[3].1.contains("version 1, this build reads version 2"),
        "{why:?}"
    );
    assert!(why[4].1.contains("version 99"), "{why:?}");
    assert!(matches!(
        d.lookup(CLUSTER, "v99"),
        Err(Error::Record(RecordError::Version(99)))
    ));
    assert!(matches!(
        d.lookup(CLUSTER, "old"),
        Err(Error::Record(RecordError::Version(1)))
    ));
    assert!(matches!(
        d.lookup(CLUSTER, "norails"),
        Err(Error::Record(RecordError::Agent(_)))
    ));

    // Arriving during a watch: each is an event naming its key; the good member stays.
    let w = d.watch(CLUSTER).unwrap();
    let first = drain(&w, Duration::from_millis(500));
    assert_eq!(first.len(), 6, "{first:?}");
    for (k, v) in &hostile[5..] {
        put(k, v);
    }
    let later = drain(&w, Duration::from_millis(500));
    let keys: Vec<String> = later.iter().map(name).collect();
    assert_eq!(keys, [format!("{prefix}theirs"), format!("{prefix}a/b")]);
    assert!(later.iter().all(|e| matches!(e, Event::Skipped { .. })));
    assert!(d.lookup(CLUSTER, "good").unwrap().is_some());
    drop(good);
}

#[test]
fn an_unreachable_etcd_is_one_clear_error_in_bounded_time() {
    // A port nobody listens on (bound, then closed).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let opts = EtcdOptions {
        connect_timeout: Duration::from_secs(1),
        ..EtcdOptions::default()
    };
    let t = Instant::now();
    let err = EtcdDirectory::connect(std::slice::from_ref(&endpoint), opts)
        .err()
        .expect("nothing listens there");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    let msg = err.to_string();
    assert!(matches!(err, Error::Unreachable { .. }), "{msg}");
    assert!(msg.contains(&endpoint), "{msg}");
    assert!(matches!(directory::open("etcd://"), Err(Error::Url { .. })));
    assert!(matches!(
        directory::open("http://x"),
        Err(Error::Url { .. })
    ));
}

#[test]
fn calls_time_out_while_etcd_is_away_and_work_again_when_it_returns() {
    let Some(mut e) = Etcd::start_or_skip() else {
        return;
    };
    let opts = EtcdOptions {
        call_timeout: Duration::from_secs(1),
        ..EtcdOptions::default()
    };
    let d = EtcdDirectory::connect(&[e.endpoint()], opts).unwrap();
    e.kill();
    let t = Instant::now();
    let err = d.lookup(CLUSTER, "a").expect_err("etcd is down");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert!(err.to_string().contains(&e.endpoint()), "{err}");
    e.restart(false);
    // The client reconnects by itself.
    eventually(
        "an answer after etcd came back",
        Duration::from_secs(10),
        || d.lookup(CLUSTER, "a").is_ok(),
    );
}

/// etcd restarted under live members: with its data or without, they stay (re-published
/// where etcd lost them), no leave is reported for them, and the watch goes on.
fn survive_restart(wipe: bool) {
    let Some(mut e) = Etcd::start_or_skip() else {
        return;
    };
    let d = connect(&e);
    let _a = d.publish(record("a"), TTL).unwrap();
    let _b = d.publish(record("b"), TTL).unwrap();
    let w = d.watch(CLUSTER).unwrap();
    assert_eq!(drain(&w, Duration::from_millis(300)).len(), 2);
    e.restart(wipe);
    // Both are back (or never left) within a few seconds.
    eventually(
        "both members back after the restart",
        Duration::from_secs(10),
        || d.members(CLUSTER).map(|l| l.members.len()).unwrap_or(0) == 2,
    );
    // The watch follows the new etcd: a new member is seen, and nobody left.
    let _c = d.publish(record("c"), TTL).unwrap();
    let mut events = drain(&w, TTL * 2);
    events.retain(|e| !matches!(e, Event::Updated { .. }));
    let seen: Vec<String> = events
        .iter()
        .map(|e| {
            format!(
                "{} {}",
                if matches!(e, Event::Joined(_)) {
                    "joined"
                } else {
                    "other"
                },
                name(e)
            )
        })
        .collect();
    assert_eq!(seen, ["joined c"], "{events:?}");
}

#[test]
fn members_survive_an_etcd_restart() {
    survive_restart(false);
}

#[test]
fn members_republish_into_an_etcd_that_lost_its_data() {
    survive_restart(true);
}

/// The harness restarts etcd on its own ports even when one is taken for a while (as any
/// process's outgoing connection may take it while etcd is down): the start that fails
/// with the port in use is tried again once the port is free.
#[test]
fn a_restart_waits_for_its_port_to_be_free_again() {
    let Some(mut e) = Etcd::start_or_skip() else {
        return;
    };
    e.kill();
    let port: u16 = (e.endpoint().rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("the endpoint's port");
    let squatter = std::net::TcpListener::bind(("127.0.0.1", port)).expect("taking etcd's port");
    let log = e.dir().join("etcd.log");
    let before = std::fs::read_to_string(&log).unwrap_or_default().len();
    std::thread::scope(|s| {
        let restarted = s.spawn(|| e.restart(false));
        // Free the port once etcd has failed on it at least once.
        eventually(
            "etcd to find its port taken",
            Duration::from_secs(15),
            || {
                std::fs::read_to_string(&log)
                    .unwrap_or_default()
                    .get(before..)
                    .is_some_and(|l| l.contains("address already in use"))
            },
        );
        drop(squatter);
        restarted.join().expect("the restart");
    });
    let d = connect(&e);
    d.publish(record("after-the-squatter"), TTL)
        .expect("publishing after the restart");
}
