//! A cluster where only records signed with its token are accepted: a forged record (signed
//! with another token, or unsigned) is skipped, logged and counted, and a follower never
//! connects to its member; a record signed with the token is accepted. Through a file and
//! through a real etcd (Debian's etcd-server on free loopback ports; `XFER_REQUIRE_ETCD`
//! makes its absence a failure).

use directory::testing::Etcd;
use directory::{
    Cluster, ClusterEvent, Directory, DirectoryConfig, Error, Event, Peers, Record, RecordError,
    Refusal,
};
use fabric_core::MemoryLocation;
use fabric_core::metadata::{
    AgentInfo, METADATA_VERSION, RegionDescriptor, TransportInfo, TransportKind,
};
use fabric_core::{Access, RemoteKey, RemoteRegion};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const CLUSTER: &str = "signed";
const TTL: Duration = Duration::from_secs(10);
const T: Duration = Duration::from_secs(20);
const TOKEN: &str = "the cluster's token";

fn record(name: &str) -> Record {
    let mut a = AgentInfo::new(name, "boot-of-this-test", MemoryLocation::Host);
    a.transports = vec![TransportInfo::new(
        TransportKind::Tcp,
        vec![format!("addr-of-{name}").into_bytes()],
    )];
    let mut r = Record::new(CLUSTER, a);
    r.regions.insert(
        "kv".into(),
        RegionDescriptor {
            version: METADATA_VERSION,
            owner: r.agent.instance,
            len: 64,
            memory: MemoryLocation::Host,
            access: Access::REMOTE_WRITE,
            transports: vec![(
                TransportKind::Tcp,
                fabric_core::engine::RemoteDescriptor {
                    rails: vec![RemoteRegion {
                        addr: 0,
                        len: 64,
                        key: RemoteKey(7),
                    }],
                },
            )],
        },
    );
    r
}

fn config(token: Option<&str>) -> DirectoryConfig {
    DirectoryConfig {
        token: token.map(str::to_string),
        // The forger's side publishes regions unsigned on purpose.
        unsigned_regions: true,
        ..DirectoryConfig::default()
    }
}

/// Records every member it is asked to connect.
#[derive(Default)]
struct Recorder {
    connected: Mutex<Vec<String>>,
}

impl Peers for Recorder {
    type Peer = String;
    type Error = std::io::Error;

    fn connect(&self, record: &Record) -> Result<String, Refusal<std::io::Error>> {
        let name = record.name().to_string();
        self.connected.lock().unwrap().push(name.clone());
        Ok(name)
    }

    fn disconnect(&self, _: &String) -> Result<(), std::io::Error> {
        Ok(())
    }
}

/// What `tracing` writes while `f` runs on this thread.
fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let s = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || s.clone())
        .with_ansi(false)
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&sink.0.lock().unwrap()).into_owned();
    (out, text)
}

/// `open(config)` opens the same directory with another configuration. b publishes with
/// the cluster's token, m1 with another token, m2 with none; a follower with the token
/// connects b only, and skips, logs and counts m1 and m2.
fn only_signed_records_are_accepted(open: &dyn Fn(DirectoryConfig) -> Box<dyn Directory>) {
    let honest = open(config(Some(TOKEN)));
    let forger = open(config(Some("a guess")));
    let open_dir = open(config(None));
    assert!(honest.signed() && !open_dir.signed());
    let _b = honest.publish(record("b"), TTL).unwrap();
    let _m1 = forger.publish(record("m1"), TTL).unwrap();
    let _m2 = open_dir.publish(record("m2"), TTL).unwrap();

    let follower = open(config(Some(TOKEN)));
    // A listing: b only, m1 and m2 skipped with the reason, each refusal logged with the
    // count.
    let (listing, log) = logged(|| follower.members(CLUSTER).unwrap());
    let names: Vec<&str> = listing.members.iter().map(|m| m.record.name()).collect();
    assert_eq!(names, ["b"]);
    assert!(listing.members[0].record.signature.is_some());
    let mut skipped: Vec<String> = listing
        .skipped
        .iter()
        .map(|(k, e)| format!("{}: {e:?}", k.rsplit(['/', '[']).next().unwrap_or(k)))
        .collect();
    skipped.sort();
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(
        listing
            .skipped
            .iter()
            .any(|(_, e)| matches!(e, RecordError::BadSignature))
            && listing
                .skipped
                .iter()
                .any(|(_, e)| matches!(e, RecordError::Unsigned)),
        "{skipped:?}"
    );
    assert_eq!(follower.refused_records(), 2);
    assert_eq!(
        log.matches("ignoring a member record whose signature does not hold")
            .count(),
        2,
        "{log}"
    );
    assert!(
        log.contains("member=\"m1\"") && log.contains("refused=2"),
        "{log}"
    );
    // etcd names the refusal; a file lists only valid records.
    assert!(
        matches!(
            follower.lookup(CLUSTER, "m1"),
            Err(Error::Record(RecordError::BadSignature)) | Ok(None)
        ),
        "a lookup does not return a forged member"
    );

    // Following: b is connected; m1 and m2 never are. The first listing holds all three,
    // and a watch reports its skipped records before its members, so once b is connected
    // the forged records have been seen.
    let peers = Arc::new(Recorder::default());
    let watch = follower.watch(CLUSTER).unwrap();
    let cluster = Cluster::start(peers.clone(), watch, Some("me"));
    assert!(cluster.wait_for("b", T).is_some(), "b was not connected");
    assert_eq!(*peers.connected.lock().unwrap(), ["b"]);
    // The event follows the peer's insertion: wait for the first, then take what else came.
    let first = cluster.events().recv_timeout(T).expect("b's join event");
    let events: Vec<String> = std::iter::once(first)
        .chain(cluster.events().try_iter())
        .map(|e| match e {
            ClusterEvent::Joined(n) => format!("joined {n}"),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(events, ["joined b"]);
    assert!(cluster.peer("m1").is_none() && cluster.peer("m2").is_none());
    // The watch counted its own reads of the forged records too.
    assert!(follower.refused_records() >= 4);

    // A reader without a token reads only the unsigned record: it cannot check the others.
    let unchecked = open_dir.members(CLUSTER).unwrap();
    let names: Vec<&str> = unchecked.members.iter().map(|m| m.record.name()).collect();
    assert_eq!(names, ["m2"]);
    assert!(
        unchecked
            .skipped
            .iter()
            .all(|(_, e)| matches!(e, RecordError::CannotCheck))
    );
}

/// The watch of a signed directory: a signed member whose record is replaced by a forged
/// one (here: the same member published with another token) leaves, and the forged record
/// is skipped.
fn a_forged_record_over_a_signed_one_is_a_leave(
    open: &dyn Fn(DirectoryConfig) -> Box<dyn Directory>,
) {
    let honest = open(config(Some(TOKEN)));
    let forger = open(config(Some("a guess")));
    let _c = honest.publish(record("c"), TTL).unwrap();
    let w = honest.watch(CLUSTER).unwrap();
    match w.next(T).unwrap() {
        Some(Event::Joined(m)) if m.record.name() == "c" => {}
        other => panic!("expected c to join, got {other:?}"),
    }
    let _forged = forger.publish(record("c"), TTL).unwrap();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match w.next(T).unwrap() {
            Some(Event::Left(m)) => seen.push(format!("left {}", m.record.name())),
            Some(Event::Skipped { error, .. }) => seen.push(format!("skipped {error:?}")),
            Some(other) => panic!("unexpected {other:?}"),
            None => panic!("no event within {T:?}; saw {seen:?}"),
        }
    }
    // etcd reports the leave first, a file's listing its skipped keys first.
    seen.sort();
    assert_eq!(seen, ["left c", "skipped BadSignature"]);
}

/// Without a token and without allowing it, a directory refuses to publish regions.
fn regions_are_not_published_unsigned(open: &dyn Fn(DirectoryConfig) -> Box<dyn Directory>) {
    let strict = open(DirectoryConfig::default());
    let e = strict.publish(record("r"), TTL).unwrap_err();
    assert!(
        matches!(&e, Error::UnsignedRegions { member, regions, .. } if member == "r" && regions == &["kv"]),
        "{e}"
    );
    assert!(strict.members(CLUSTER).unwrap().members.is_empty());
    // A record with no region is published unsigned.
    let mut bare = record("r");
    bare.regions.clear();
    let _p = strict.publish(bare, TTL).unwrap();
    assert_eq!(strict.members(CLUSTER).unwrap().members.len(), 1);
}

struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(tag: &str) -> TempFile {
        let p = std::env::temp_dir().join(format!("xfer-signed-{tag}-{}.json", std::process::id()));
        let _ = std::fs::remove_file(&p);
        TempFile(p)
    }

    fn open(&self) -> impl Fn(DirectoryConfig) -> Box<dyn Directory> + '_ {
        move |c| directory::open_with(&format!("file://{}", self.0.display()), &c).unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(self.0.with_extension("lock"));
    }
}

fn etcd_open(e: &Etcd) -> impl Fn(DirectoryConfig) -> Box<dyn Directory> + '_ {
    move |c| directory::open_with(&e.url(), &c).unwrap()
}

#[test]
fn only_signed_records_are_accepted_through_a_file() {
    let f = TempFile::new("only");
    only_signed_records_are_accepted(&f.open());
}

#[test]
fn only_signed_records_are_accepted_through_etcd() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    only_signed_records_are_accepted(&etcd_open(&e));
}

#[test]
fn a_forged_record_over_a_signed_one_is_a_leave_through_a_file() {
    let f = TempFile::new("over");
    a_forged_record_over_a_signed_one_is_a_leave(&f.open());
}

#[test]
fn a_forged_record_over_a_signed_one_is_a_leave_through_etcd() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    a_forged_record_over_a_signed_one_is_a_leave(&etcd_open(&e));
}

#[test]
fn regions_are_not_published_unsigned_through_a_file() {
    let f = TempFile::new("regions");
    regions_are_not_published_unsigned(&f.open());
}

#[test]
fn regions_are_not_published_unsigned_through_etcd() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    regions_are_not_published_unsigned(&etcd_open(&e));
}

#[test]
fn an_empty_token_is_refused() {
    let f = TempFile::new("empty");
    let e = directory::open_with(
        &format!("file://{}", f.0.display()),
        &DirectoryConfig {
            token: Some(String::new()),
            ..DirectoryConfig::default()
        },
    )
    .err()
    .expect("an empty token is refused");
    assert!(matches!(e, Error::Config(_)), "{e}");
}
