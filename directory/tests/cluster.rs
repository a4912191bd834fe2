//! Membership driving an engine, over a real etcd and TCP rails in one process: members
//! that join become peers, a member that leaves fails only its own transfers (with
//! `PeerRemoved`), and a member restarted under its name is written to again.

use directory::testing::Etcd;
use directory::{Cluster, ClusterEvent, Directory, EtcdDirectory, EtcdOptions, Record};
use fabric_core::engine::{EngineConfig, GroupPeer, GroupRegistration, GroupTransfer, RailGroup};
use fabric_core::metadata::{
    AgentInfo, METADATA_VERSION, RegionDescriptor, TransportInfo, TransportKind,
};
use fabric_core::testing::pattern;
use fabric_core::{Access, Error as CoreError, HostBuffer, MemoryLocation, OpError};
use std::sync::Arc;
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};

const T: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(2);
const LEN: u64 = 16 << 20;

fn group(rails: usize) -> RailGroup {
    RailGroup::spawn(
        rails,
        |_| TcpTransport::new(TcpConfig::default()),
        EngineConfig::default(),
    )
    .unwrap()
}

/// A member's metadata: one transport with these rails.
fn agent(name: &str, kind: TransportKind, rails: Vec<Vec<u8>>) -> AgentInfo {
    let mut a = AgentInfo::new(name, "boot-of-this-test", MemoryLocation::Host);
    a.transports = vec![TransportInfo::new(kind, rails)];
    a
}

/// A target member: its rails, its region (named `kv` in its record) and the memory.
struct Target {
    group: RailGroup,
    mem: Arc<HostBuffer>,
    _reg: GroupRegistration,
    record: Record,
}

fn target(name: &str) -> Target {
    let group = group(2);
    let mem = HostBuffer::new_shared(LEN as usize).unwrap();
    let reg = group.register(mem.clone(), Access::REMOTE_WRITE).unwrap();
    let mut record = Record::new("c1", agent(name, TransportKind::Tcp, group.addresses()));
    record.regions.insert(
        "kv".into(),
        RegionDescriptor {
            version: METADATA_VERSION,
            owner: record.agent.instance,
            len: LEN,
            memory: MemoryLocation::Host,
            access: Access::REMOTE_WRITE,
            transports: vec![(TransportKind::Tcp, reg.remote.clone())],
        },
    );
    Target {
        group,
        mem,
        _reg: reg,
        record,
    }
}

fn events(c: &Cluster<Arc<RailGroup>>) -> Vec<String> {
    c.events()
        .try_iter()
        .map(|e| match e {
            ClusterEvent::Joined(n) => format!("joined {n}"),
            ClusterEvent::Left(n) => format!("left {n}"),
            ClusterEvent::Updated(n) => format!("updated {n}"),
            other => format!("{other:?}"),
        })
        .collect()
}

#[test]
fn joins_become_peers_and_a_leave_fails_only_that_members_transfers() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    let d = EtcdDirectory::connect(&[e.endpoint()], EtcdOptions::default()).unwrap();
    let b = target("b");
    let c = target("c");
    let _pb = d.publish(b.record.clone(), TTL).unwrap();
    let pc = d.publish(c.record.clone(), TTL).unwrap();

    let a = Arc::new(group(2));
    let src = HostBuffer::new_shared(LEN as usize).unwrap();
    let data = pattern(5, LEN as usize);
    src.write(0, &data).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let me = Record::new("c1", agent("a", TransportKind::Tcp, a.addresses()));
    let _pa = d.publish(me, TTL).unwrap();
    let cluster = Cluster::start(a.clone(), d.watch("c1").unwrap(), Some("a"));
    let pb = cluster.wait_for("b", T).expect("b joins");
    let pc_peer = cluster.wait_for("c", T).expect("c joins");
    assert!(cluster.peer("a").is_none(), "a process is not its own peer");

    let pages: Vec<u64> = (0..LEN / 65536).collect();
    let write = |p: &directory::ClusterPeer<GroupPeer>| {
        let kv = p.record.regions["kv"].on(TransportKind::Tcp).unwrap();
        let t = GroupTransfer::same_pages(s.clone(), kv.clone(), &pages, 65536);
        a.submit(&p.peer, t).unwrap()
    };
    // A queue to c long enough to be in flight when it leaves, and some to b.
    let to_c: Vec<_> = (0..64).map(|_| write(&pc_peer)).collect();
    let to_b: Vec<_> = (0..4).map(|_| write(&pb)).collect();
    pc.withdraw().unwrap();
    let mut removed = 0;
    for h in to_c {
        match h.wait(T) {
            Ok(st) => assert_eq!(st.bytes, LEN),
            Err(CoreError::Op(OpError::PeerRemoved(_))) => removed += 1,
            Err(other) => panic!("a transfer to c failed with {other}, not PeerRemoved"),
        }
    }
    assert!(
        removed > 0,
        "c left with its queue done: nothing was in flight"
    );
    for h in to_b {
        assert_eq!(
            h.wait(T).unwrap().bytes,
            LEN,
            "b's transfers do not notice c leaving"
        );
    }
    assert!(b.mem.to_vec(0, LEN as usize).unwrap() == data);
    assert!(cluster.wait_gone("c", T), "c's peer is removed");
    assert!(cluster.peer("c").is_none());
    // b is still written to after c left.
    assert_eq!(write(&pb).wait(T).unwrap().bytes, LEN);

    // c restarted under its name (a new process: new rails, new instance) is a peer again.
    let c2 = target("c");
    assert_ne!(c2.record.instance(), c.record.instance());
    let _pc2 = d.publish(c2.record.clone(), TTL).unwrap();
    let until = std::time::Instant::now() + T;
    let back = loop {
        if let Some(p) = cluster.peer("c")
            && p.record.instance() == c2.record.instance()
        {
            break p;
        }
        assert!(std::time::Instant::now() < until, "c not back");
        let _ = cluster.wait_for("c", Duration::from_millis(100));
    };
    assert_eq!(write(&back).wait(T).unwrap().bytes, LEN);
    assert!(c2.mem.to_vec(0, LEN as usize).unwrap() == data);
    let seen = events(&cluster);
    assert_eq!(
        seen,
        ["joined b", "joined c", "left c", "joined c"],
        "{seen:?}"
    );
    drop(c.group);
    drop(b.group);
}

#[test]
fn a_member_of_another_transport_is_refused_not_added() {
    let dir = std::env::temp_dir().join(format!("xfer-cluster-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let d = directory::FileDirectory::open(&dir);
    let r = Record::new(
        "c1",
        agent("gpu-box", TransportKind::CudaIpc, vec![vec![1, 2, 3]]),
    );
    let _p = d.publish(r, TTL).unwrap();
    let a = Arc::new(group(1));
    let cluster = Cluster::start(a, d.watch("c1").unwrap(), None);
    match cluster.events().recv_timeout(T) {
        Ok(ClusterEvent::Incompatible { name, theirs, ours }) => {
            assert_eq!(name, "gpu-box");
            assert_eq!(theirs, [TransportKind::CudaIpc]);
            assert_eq!(ours, [TransportKind::Tcp]);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(cluster.peers().is_empty());
    let _ = std::fs::remove_file(&dir);
}
