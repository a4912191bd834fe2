//! A dropped connection comes back without any call of the application: the peer's tcp
//! connection is killed (`ss -K`, the peer process staying), then the peer process is
//! killed and started again on the same address; each time the transfer that meets the
//! dead connection ends with `ConnectionLost` naming the peer, and the next one reconnects
//! (with the same token) and lands. A transfer prepared before a reconnect is refused with
//! `PreparedStale`, and prepared again it works. A descriptor of the peer's previous
//! incarnation is refused with `StaleDescriptor` once the agent knows the new one, and
//! nothing of the new process's memory changes.
//!
//! Its own harness (`harness = false`): run with `XFER_RECONNECT_PEER=1`, this binary is
//! the peer (an agent on `127.0.0.1:$XFER_RECONNECT_PORT` with one region, its metadata on
//! stdout, checking its memory on request).

mod common;

use common::child::{self, Child, pattern};
use fabric_core::MemoryLocation;
use fabric_core::engine::{EngineConfig, RailGroup};
use std::net::SocketAddr;
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};
use xfer::layers::AgentLayers;
use xfer::{
    Access, Agent, AgentInfo, Error, ErrorKind, HostBuffer, RegionDescriptor, Transfer,
    TransportKind,
};

const LEN: usize = 1 << 20;
const T: Duration = Duration::from_secs(30);
const TOKEN: &str = "reconnect-test-token";

/// An agent made by `Agent::new` (its tcp rail announces its incarnation in handshakes)
/// whose one tcp rail listens on `127.0.0.1:port`, with the token.
fn announcing_agent(name: &str, port: u16) -> Agent {
    let mut o = xfer::AgentOptions {
        name: Some(name.into()),
        transport: xfer::TransportChoice::Only(TransportKind::Tcp),
        rails: Some(1),
        auth_token: Some(TOKEN.into()),
        pin: xfer::PinMode::Off,
        ..xfer::AgentOptions::default()
    };
    o.tcp.port = Some(port);
    Agent::new(o).expect("an agent")
}

/// An agent whose one tcp rail listens on `127.0.0.1:port` (0: any), with the token.
fn agent(name: &str, port: u16) -> Agent {
    let cfg = TcpConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], port)),
        auth_token: Some(TOKEN.into()),
        ..TcpConfig::default()
    };
    let group = RailGroup::spawn(
        1,
        move |_| TcpTransport::new(cfg.clone()),
        EngineConfig::default(),
    )
    .expect("a tcp rail");
    Agent::from_groups(
        name,
        MemoryLocation::Host,
        vec![(TransportKind::Tcp, group)],
    )
    .expect("an agent")
}

/// The peer: announces its agent's and region's metadata, then answers each line
/// `check N` with `ok` when its region holds round N's pattern (round 0: all zero), `bad`
/// otherwise.
fn peer() {
    let port: u16 = std::env::var("XFER_RECONNECT_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let b = if std::env::var_os("XFER_RECONNECT_ANNOUNCE").is_some() {
        announcing_agent("restarting-peer", port)
    } else {
        agent("restarting-peer", port)
    };
    child::serve_region(&b, LEN, |mem, round| {
        if round == 0 {
            mem.to_vec(0, LEN).unwrap() == vec![0; LEN]
        } else {
            child::holds_pattern(mem, round)
        }
    });
}

/// The peer process on `port`: one whose agent announces its incarnation in the tcp
/// handshake (`announce`), or one made from its rail group (which announces nothing).
fn start_peer(port: u16, announce: bool) -> (Child, AgentInfo, RegionDescriptor) {
    let mut cmd = Child::this_binary("XFER_RECONNECT_PEER", "1");
    cmd.env("XFER_RECONNECT_PORT", port.to_string());
    if announce {
        cmd.env("XFER_RECONNECT_ANNOUNCE", "1");
    }
    Child::spawn(cmd)
}

/// The port of the peer's tcp rail (`tcp://127.0.0.1:PORT`).
fn port_of(info: &AgentInfo) -> u16 {
    let addr = &info.transport(TransportKind::Tcp).unwrap().rails[0];
    let addr = std::str::from_utf8(addr).unwrap();
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// The agent's count of reconnects, read from its metrics.
fn reconnects(a: &Agent) -> u64 {
    let m = a.metrics();
    m.lines()
        .find_map(|l| l.strip_prefix("xfer_reconnects_total "))
        .unwrap_or_else(|| panic!("no reconnect counter in\n{m}"))
        .trim()
        .parse()
        .unwrap()
}

/// The transfer that meets a dead connection: it fails (at submit or in its wait) with
/// `ConnectionLost` naming the peer, never hangs, never succeeds.
fn meets_dead_connection(r: xfer::Result<xfer::Handle>) {
    let e = match r {
        Ok(h) => h.wait(T).expect_err("the connection is dead"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    assert!(
        matches!(&e, Error::ConnectionLost { peer, .. } if peer == "restarting-peer"),
        "{e:?}"
    );
    assert!(std::error::Error::source(&e).is_some(), "with its cause");
}

fn main() {
    if std::env::var_os("XFER_RECONNECT_PEER").is_some() {
        peer();
        return;
    }
    let (mut p, info, desc) = start_peer(0, false);
    let port = port_of(&info);
    let a = agent("initiator", 0);
    let mem = HostBuffer::new_shared(LEN).unwrap();
    let src = a.register(mem.clone(), Access::NONE).unwrap();
    let peer = a.connect(&info).unwrap();
    let whole = || Transfer::segments(vec![(0, 0, LEN as u64)]);
    let write = |peer: &xfer::Peer, desc: &RegionDescriptor, round: u8| {
        mem.fill_with(pattern(round));
        a.submit(peer, &src, desc, whole())
    };

    write(&peer, &desc, 1)
        .unwrap()
        .wait(T)
        .expect("a first write");
    assert!(p.holds(1));
    let prepared = a.prepare(&peer, &src, &desc, whole()).unwrap();
    mem.fill_with(pattern(2));
    a.post(&prepared).unwrap().wait(T).expect("a post");
    assert!(p.holds(2));
    assert_eq!(reconnects(&a), 0);

    // 1. The connection killed under both processes (ss -K on ours).
    assert!(
        common::kill_loopback_connections_to(port),
        "ss -K on port {port} (needs root)"
    );
    meets_dead_connection(write(&peer, &desc, 3));
    // The next one reconnects, with no call of ours, and lands.
    let clone = peer.clone();
    write(&clone, &desc, 4)
        .expect("reconnected")
        .wait(T)
        .expect("the write after the reconnect");
    assert!(p.holds(4), "every byte landed");
    assert_eq!(reconnects(&a), 1);
    assert_eq!(peer.reconnects(), 1, "every clone of the peer sees it");
    // A plan of the old connection is refused, and works prepared again.
    let e = a
        .post(&prepared)
        .expect_err("planned on the dead connection");
    assert!(
        matches!(
            e,
            Error::PreparedStale {
                prepared: 0,
                now: 1,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let prepared = a.prepare(&peer, &src, &desc, whole()).unwrap();
    mem.fill_with(pattern(5));
    a.post(&prepared).unwrap().wait(T).expect("prepared again");
    assert!(p.holds(5));

    // 2. The peer process killed and started again on the same address. The transfer that
    // meets the dead connection fails; the next one reconnects. Until the agent learns the
    // new incarnation, it knows no other than the old one: a descriptor of the new process
    // is refused, named as such.
    p.kill();
    let (mut p, info2, desc2) = start_peer(port, false);
    assert_eq!(port_of(&info2), port);
    assert_ne!(info2.instance, info.instance, "a new incarnation");
    assert_eq!(desc.owner, info.instance);
    assert_eq!(desc2.owner, info2.instance);
    meets_dead_connection(write(&peer, &desc, 6));
    let e = write(&peer, &desc2, 7).expect_err("the agent knows the old incarnation only");
    assert!(
        matches!(e, Error::StaleDescriptor { descriptor_instance, peer_instance, .. }
            if descriptor_instance == info2.instance && peer_instance == info.instance),
        "{e:?}"
    );
    // Told of the new incarnation (as the directory's follow or a rendezvous would tell
    // it), the agent takes it: the old process's descriptor is refused before anything
    // moves, and nothing of the new process's memory changes.
    a.update_peer(&peer, &info2).unwrap();
    assert_eq!(a.peer_info(&peer).instance, info2.instance);
    let e = write(&peer, &desc, 8).expect_err("a descriptor of the previous incarnation");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(
        matches!(e, Error::StaleDescriptor { ref peer, descriptor_instance, peer_instance }
            if peer == "restarting-peer"
                && descriptor_instance == info.instance
                && peer_instance == info2.instance),
        "{e:?}"
    );
    let e = a
        .prepare(&peer, &src, &desc, whole())
        .expect_err("prepared through it neither");
    assert!(matches!(e, Error::StaleDescriptor { .. }), "{e:?}");
    assert!(p.holds(0), "nothing of the new process's memory changed");
    write(&peer, &desc2, 9)
        .expect("the new process's descriptor")
        .wait(T)
        .expect("the write after the restart");
    assert!(p.holds(9), "every byte landed in the new process");
    let e = a
        .post(&prepared)
        .expect_err("planned on the old process's connection");
    assert!(matches!(e, Error::PreparedStale { .. }), "{e:?}");
    let m = a.metrics();
    assert!(m.contains("xfer_stale_descriptors_total 3"), "{m}");
    // 1 (ss -K), then the restarted process: the reconnect at 7's submit, and
    // update_peer's to the new incarnation.
    assert_eq!(reconnects(&a), 3);

    p.kill();
    drop(a);

    // 3. A peer whose handshake announces its incarnation (an agent of AgentOptions),
    // restarted on its port: the reconnect learns the new incarnation by itself. With no
    // call of the application, the old descriptor is refused before anything moves and
    // the new process's descriptor is taken.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let (p, info, desc) = start_peer(port, true);
    assert_eq!(port_of(&info), port, "the fixed port (TcpOptions::port)");
    let a = agent("initiator-2", 0);
    let src = a.register(mem.clone(), Access::NONE).unwrap();
    let peer = a.connect(&info).unwrap();
    let write = |desc: &RegionDescriptor, round: u8| {
        mem.fill_with(pattern(round));
        a.submit(&peer, &src, desc, whole())
    };
    write(&desc, 10).unwrap().wait(T).expect("a first write");
    p.kill();
    let (mut p, info2, desc2) = start_peer(port, true);
    assert_ne!(info2.instance, info.instance);
    meets_dead_connection(write(&desc, 11));
    let e = write(&desc, 12).expect_err("the restarted peer announced its new incarnation");
    assert!(
        matches!(e, Error::StaleDescriptor { descriptor_instance, peer_instance, .. }
            if descriptor_instance == info.instance && peer_instance == info2.instance),
        "{e:?}"
    );
    assert_eq!(
        a.peer_info(&peer).instance,
        info2.instance,
        "learned by the reconnect"
    );
    assert!(p.holds(0), "nothing of the new process's memory changed");
    write(&desc2, 13)
        .expect("the new process's descriptor, with no call of the application")
        .wait(T)
        .expect("the write after the restart");
    assert!(p.holds(13), "every byte landed in the new process");

    println!(
        "reconnect: a killed connection and a restarted peer reconnected; stale descriptors \
         refused, and a restarted peer's new incarnation learned from its handshake"
    );
}
