//! Agents finding each other by name through the cluster directory: a real etcd (Debian's
//! etcd-server, started per test on free loopback ports; `XFER_REQUIRE_ETCD` makes its
//! absence a failure) and the `file://` directory. Every agent of these tests lives in this
//! process and moves its bytes over TCP on loopback.

use directory::testing::Etcd;
use fabric_core::OpError;
use fabric_core::testing::pattern;
use std::sync::Arc;
use std::time::Duration;
use xfer::discovery::{self, Directory, FollowEvent};
use xfer::{Access, Agent, AgentOptions, Error, HostBuffer, Region, Transfer};

const T: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(2);
const LEN: usize = 1 << 20;

/// An agent named `name` with a source region full of `seed`'s pattern and an inbox
/// offered as `inbox`.
struct Node {
    agent: Agent,
    src: Region,
    data: Vec<u8>,
    inbox: Arc<HostBuffer>,
}

fn node(name: &str, seed: u64) -> Node {
    let agent = Agent::new(AgentOptions {
        name: Some(name.into()),
        ..AgentOptions::default()
    })
    .unwrap();
    let data = pattern(seed, LEN);
    let src = HostBuffer::new_shared(LEN).unwrap();
    src.write(0, &data).unwrap();
    let src = agent.register(src, Access::NONE).unwrap();
    let inbox = HostBuffer::new_shared(LEN).unwrap();
    let r = agent.register(inbox.clone(), Access::REMOTE_WRITE).unwrap();
    agent.offer("inbox", &r).unwrap();
    Node {
        agent,
        src,
        data,
        inbox,
    }
}

/// `from` looks `to` up by name in `cluster`, connects, and writes its source into `to`'s
/// inbox with immediate value `imm`; `to` is told, and holds `from`'s bytes.
fn write_by_name(dir: &dyn Directory, cluster: &str, from: &Node, to: &Node, imm: u32) {
    let m = from
        .agent
        .lookup(dir, cluster, to.agent.name())
        .unwrap()
        .expect("the member is published");
    assert_eq!(
        &m.info,
        to.agent.info(),
        "the record is the agent's metadata"
    );
    assert_eq!(m.regions, to.agent.offered());
    let peer = from.agent.connect(&m.info).unwrap();
    let t = Transfer::segments(vec![(0, 0, LEN as u64)]).imm(imm);
    let st = from
        .agent
        .submit(&peer, &from.src, m.region("inbox").unwrap(), t)
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(st.bytes, LEN as u64);
    to.agent.wait_imm(imm, 1, T).unwrap();
    assert!(to.inbox.to_vec(0, LEN).unwrap() == from.data);
}

/// Two agents publish themselves in `cluster`, find each other by name, and each writes
/// into the other's named region with immediate data.
fn two_agents_by_name(dir: &dyn Directory, cluster: &str) {
    let a = node("a", 1);
    let b = node("b", 2);
    assert!(
        a.agent.lookup(dir, cluster, "b").unwrap().is_none(),
        "nobody is published yet"
    );
    let _pa = a.agent.publish(dir, cluster, TTL).unwrap();
    let _pb = b.agent.publish(dir, cluster, TTL).unwrap();
    write_by_name(dir, cluster, &a, &b, 0xa0b);
    write_by_name(dir, cluster, &b, &a, 0xb0a);
    let m = a.agent.lookup(dir, cluster, "b").unwrap().unwrap();
    assert!(matches!(
        m.region("nothing"),
        Err(Error::NoSuchRegion { member, region }) if member == "b" && region == "nothing"
    ));
    assert!(a.agent.lookup(dir, cluster, "nobody").unwrap().is_none());
}

fn etcd(e: &Etcd) -> Box<dyn Directory> {
    discovery::open(&e.url()).expect("connecting to etcd")
}

/// A `file://` directory in a fresh temporary file, removed when dropped.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(tag: &str) -> TempFile {
        let p =
            std::env::temp_dir().join(format!("xfer-discovery-{tag}-{}.json", std::process::id()));
        let _ = std::fs::remove_file(&p);
        TempFile(p)
    }

    fn directory(&self) -> Box<dyn Directory> {
        discovery::open(&format!("file://{}", self.0.display())).unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(self.0.with_extension("lock"));
    }
}

#[test]
fn two_agents_find_each_other_by_name_through_etcd() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    two_agents_by_name(&*etcd(&e), "by-name");
}

#[test]
fn two_agents_find_each_other_by_name_through_a_file() {
    let f = TempFile::new("by-name");
    two_agents_by_name(&*f.directory(), "by-name");
}

#[test]
fn a_publication_is_the_agent_and_its_offers_and_can_be_updated() {
    let f = TempFile::new("update");
    let dir = f.directory();
    let b = node("b", 3);
    let mut p = b.agent.publish(&*dir, "c", TTL).unwrap();
    let more = b
        .agent
        .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_READ)
        .unwrap();
    b.agent.offer("more", &more).unwrap();
    let before = b.agent.lookup(&*dir, "c", "b").unwrap().unwrap();
    assert!(before.region("more").is_err(), "offered after publishing");
    p.update().unwrap();
    let after = b.agent.lookup(&*dir, "c", "b").unwrap().unwrap();
    assert_eq!(after.region("more").unwrap(), more.descriptor());
    assert_eq!(after.info, before.info);
    p.withdraw().unwrap();
    assert!(b.agent.lookup(&*dir, "c", "b").unwrap().is_none());
    // A name that cannot be a member's is refused before anything is written.
    let bad = Agent::new(AgentOptions {
        name: Some("a/b".into()),
        ..AgentOptions::default()
    })
    .unwrap();
    assert!(matches!(
        bad.publish(&*dir, "c", TTL),
        Err(Error::Directory(directory::Error::Record(
            directory::RecordError::Name { .. }
        )))
    ));
}

fn said(e: Option<FollowEvent>) -> String {
    match e {
        Some(FollowEvent::Joined(n)) => format!("joined {n}"),
        Some(FollowEvent::Updated(n)) => format!("updated {n}"),
        Some(FollowEvent::Left(n)) => format!("left {n}"),
        other => format!("{other:?}"),
    }
}

/// A follows the cluster: b (there before) and c (joining later) become connected peers by
/// name, c's new offer reaches a in place, and c withdrawing disconnects it while b stays.
fn follow(dir: &dyn Directory) {
    let a = node("a", 4);
    let b = node("b", 5);
    let _pa = a.agent.publish(dir, "f", TTL).unwrap();
    let _pb = b.agent.publish(dir, "f", TTL).unwrap();
    let following = a.agent.follow(dir, "f").unwrap();
    assert_eq!(said(following.next_event(T)), "joined b");
    let to_b = following.wait_for("b", T).unwrap();
    assert!(
        following.peer("a").is_none(),
        "an agent is not its own peer"
    );

    let c = node("c", 6);
    assert!(matches!(
        following.wait_for("c", Duration::ZERO),
        Err(Error::NotJoined { .. })
    ));
    let mut pc = c.agent.publish(dir, "f", TTL).unwrap();
    assert_eq!(said(following.next_event(T)), "joined c");
    let to_c = following.wait_for("c", T).unwrap();
    assert_eq!(to_c.peer.info(), c.agent.info());
    let write = |to: &discovery::Connected, region: &str, imm: u32| {
        let t = Transfer::segments(vec![(0, 0, LEN as u64)]).imm(imm);
        a.agent
            .submit(&to.peer, &a.src, to.region(region).unwrap(), t)
            .and_then(|h| h.wait(T))
    };
    write(&to_c, "inbox", 0xc).unwrap();
    c.agent.wait_imm(0xc, 1, T).unwrap();
    assert!(c.inbox.to_vec(0, LEN).unwrap() == a.data);

    // c offers one more region: a sees it on the same peer.
    let more_mem = HostBuffer::new_shared(LEN).unwrap();
    let more = c
        .agent
        .register(more_mem.clone(), Access::REMOTE_WRITE)
        .unwrap();
    c.agent.offer("more", &more).unwrap();
    pc.update().unwrap();
    assert_eq!(said(following.next_event(T)), "updated c");
    let to_c2 = following.peer("c").unwrap();
    assert_eq!(to_c2.region("more").unwrap(), more.descriptor());
    write(&to_c2, "more", 0xc2).unwrap();
    c.agent.wait_imm(0xc2, 1, T).unwrap();
    assert!(more_mem.to_vec(0, LEN).unwrap() == a.data);

    // c leaves: it is disconnected (its peer gone); b is not touched.
    pc.withdraw().unwrap();
    assert_eq!(said(following.next_event(T)), "left c");
    following.wait_gone("c", T).unwrap();
    assert!(following.peer("c").is_none());
    let gone = write(&to_c, "inbox", 0xdead);
    assert!(
        matches!(
            gone,
            Err(Error::Engine(fabric_core::Error::Op(OpError::PeerRemoved(
                _
            ))))
        ),
        "c's peer was removed from a's transport: {gone:?}"
    );
    let names: Vec<String> = following
        .peers()
        .iter()
        .map(|p| p.name().to_owned())
        .collect();
    assert_eq!(names, ["b"]);
    write(&to_b, "inbox", 0xb).unwrap();
    b.agent.wait_imm(0xb, 1, T).unwrap();
    assert!(b.inbox.to_vec(0, LEN).unwrap() == a.data);
    assert!(
        following.try_event().is_none(),
        "{:?}",
        following.try_event()
    );
}

#[test]
fn a_follower_connects_joiners_and_disconnects_leavers_through_etcd() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    follow(&*etcd(&e));
}

#[test]
fn a_follower_connects_joiners_and_disconnects_leavers_through_a_file() {
    let f = TempFile::new("follow");
    follow(&*f.directory());
}
