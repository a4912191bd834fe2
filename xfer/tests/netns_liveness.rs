//! Faults between hosts, each host a network namespace (veth pair, see
//! `transport-tcp/tests/netns/mod.rs`), the target a process of its own:
//!
//! 1. the target stopped (SIGSTOP) for 20 s in the middle of a 4 GiB WRITE, then continued:
//!    a wait with a stall timeout reports `PeerStalled` meanwhile, the transfer completes
//!    and verifies, and the connections are the very ones of before (no reconnect);
//! 2. the link cut both ways (nftables drops every packet) for 5 s in the middle of a 1 GiB
//!    WRITE, then restored: the transfer completes and verifies, and the next one too,
//!    without any call of the application;
//! 3. the target killed and started again on the same addresses under the same name: the
//!    transfer that meets the dead connection fails typed, a WRITE through a descriptor of
//!    the previous process is refused (by the new process's transport, `RemoteKeyInvalid`,
//!    until the agent learns the new incarnation; then before anything moves,
//!    `StaleDescriptor`), and nothing of the new process's memory changes.
//!
//! All with the tcp transport's default liveness timeout (30 s): slowness is not death.
//! Its own harness (`harness = false`); needs root for the namespaces (CI runs as root; where
//! they cannot be made it prints `skipped:` and passes, unless `XFER_REQUIRE_NETNS=1`). Run
//! with `XFER_NETNS_TARGET=ADDR,PORT,PORT`, this binary is the target (an agent whose rails
//! listen there, one region, its metadata on stdout, checking its memory on request).

mod common;
#[path = "../../transport-tcp/tests/netns/mod.rs"]
mod netns;
mod netns_target;

use netns::{NetPair, Side};
use netns_target::{RAILS, Target, agent, connections, cut, metric, ports_of};
use std::net::IpAddr;
use std::time::{Duration, Instant};
use xfer::{Access, Error, ErrorKind, HostBuffer, RegionDescriptor, Transfer};

/// The target's region (and the largest transfer).
const LEN: u64 = 4 << 30;
/// The unit of the pattern: each chunk holds one byte value, different from its neighbours'.
const CHUNK: u64 = 64 << 10;
/// Far beyond what any transfer here needs, so that nothing passes by timing out.
const T: Duration = Duration::from_secs(300);
const TARGET_ENV: &str = "XFER_NETNS_TARGET";

/// The byte of chunk `i` in round `round` (never 0: round 0 is the untouched region).
fn byte(round: u8, i: u64) -> u8 {
    ((i * 7 + round as u64 * 13) % 251) as u8 + 1
}

/// Fills `[0, len)` of `mem` with round `round`'s pattern.
fn fill(mem: &HostBuffer, round: u8, len: u64) {
    for i in 0..len / CHUNK {
        mem.fill(i * CHUNK, CHUNK, byte(round, i)).unwrap();
    }
}

/// Whether `[0, len)` of `mem` holds round `round`'s pattern (round 0: all zero).
fn holds(mem: &HostBuffer, round: u8, len: u64) -> bool {
    (0..len / CHUNK).all(|i| {
        let want = if round == 0 { 0 } else { byte(round, i) };
        mem.to_vec(i * CHUNK, CHUNK as usize).unwrap() == vec![want; CHUNK as usize]
    })
}

/// The target process (`XFER_NETNS_TARGET` set): announces its agent and region, then
/// answers each line `check ROUND LEN` with `ok` when its region holds that round's pattern
/// over `[0, LEN)` (round 0: zeros), `bad` otherwise.
fn target(spec: &str) {
    let (ip, ports) = netns_target::parse_spec(spec);
    let b = agent("liveness-target", ip, &ports, None);
    let mem = HostBuffer::new_shared(LEN as usize).expect("memory");
    let r = b
        .register(mem.clone(), Access::REMOTE_WRITE)
        .expect("a region");
    netns_target::announce(b.info(), r.descriptor());
    common::child::serve(|line| {
        let mut w = line.split_whitespace().skip(1);
        let round: u8 = w.next().unwrap().parse().expect("check ROUND LEN");
        let len: u64 = w.next().unwrap().parse().expect("check ROUND LEN");
        if holds(&mem, round, len) { "ok" } else { "bad" }.into()
    });
}

/// Whether the target's region holds round `round` over `[0, len)`.
fn target_holds(p: &mut Target, round: u8, len: u64) -> bool {
    p.ask(&format!("check {round} {len}")) == "ok"
}

/// Waits until namespace A has sent `bytes` more on its veth than `from` (the transfer is
/// that far along), within `T`.
fn sent_beyond(net: &NetPair, from: u64, bytes: u64) {
    let deadline = Instant::now() + T;
    while net.tx_bytes(Side::A, net.dev(Side::A)).unwrap() < from + bytes {
        assert!(Instant::now() < deadline, "the transfer never got that far");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn main() {
    if let Ok(spec) = std::env::var(TARGET_ENV) {
        target(&spec);
        return;
    }
    let Some(net) = NetPair::new() else { return };
    if !NetPair::has_tool("nft") || !NetPair::has_tool("ss") {
        netns::skip("`nft` or `ss` is not installed (Debian packages nftables, iproute2)");
        return;
    }
    // This process is host A: its threads (the agent's rails) inherit the namespace.
    netns::enter(net.name(Side::A)).expect("enter namespace A");
    let (mut p, info, desc) = netns_target::start(&net, TARGET_ENV, &[0; RAILS]);
    let a = agent(
        "liveness-initiator",
        IpAddr::V4(net.ip(Side::A)),
        &[0; RAILS],
        None,
    );
    let mem = HostBuffer::new_shared(LEN as usize).unwrap();
    let src = a.register(mem.clone(), Access::NONE).unwrap();
    let peer = a.connect(&info).unwrap();
    let whole = |len: u64| Transfer::segments(vec![(0, 0, len)]);
    let write = |desc: &RegionDescriptor, round: u8, len: u64| {
        fill(&mem, round, len);
        a.submit(&peer, &src, desc, whole(len))
    };
    write(&desc, 1, 1 << 20)
        .unwrap()
        .wait(T)
        .expect("a first write");
    assert!(target_holds(&mut p, 1, 1 << 20));
    let before = connections();
    assert_eq!(before.len(), RAILS, "one connection per rail: {before:?}");

    // 1. SIGSTOP for 20 s in the middle of 4 GiB.
    fill(&mem, 2, LEN);
    let stall = Duration::from_secs(3);
    let t0 = Instant::now();
    let tx = net.tx_bytes(Side::A, net.dev(Side::A)).unwrap();
    let h = a
        .submit(&peer, &src, &desc, whole(LEN).stall_timeout(stall))
        .unwrap();
    sent_beyond(&net, tx, LEN / 4);
    p.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    assert!(
        !h.is_finished(),
        "4 GiB moved before a quarter was seen sent"
    );
    // A wait with the stall timeout tells the stall apart: PeerStalled, the transfer on.
    let e = h.wait(T).expect_err("the target is stopped");
    assert_eq!(e.kind(), ErrorKind::PeerStalled, "{e}");
    assert!(matches!(e, Error::PeerStalled { .. }), "{e:?}");
    let stalled_after = stopped.elapsed();
    assert_eq!(metric(&a, "xfer_stalls_total"), 1, "the stall is counted");
    // The stop lasts 20 s (the fault itself, not a synchronisation).
    std::thread::sleep(Duration::from_secs(20).saturating_sub(stopped.elapsed()));
    assert!(
        h.try_result().is_none(),
        "the transfer ended while its target was stopped: {:?}",
        h.try_result()
    );
    assert_eq!(
        connections(),
        before,
        "a connection changed during the stop"
    );
    p.signal(libc::SIGCONT);
    let resumed = Instant::now();
    h.wait(T)
        .expect("the transfer completes once the target goes on");
    let done = resumed.elapsed();
    assert!(
        target_holds(&mut p, 2, LEN),
        "every byte of the 4 GiB landed"
    );
    assert_eq!(
        connections(),
        before,
        "the connections are those of before the stop"
    );
    assert_eq!(metric(&a, "xfer_reconnects_total"), 0);
    println!(
        "SIGSTOP 20 s in a 4 GiB WRITE: PeerStalled {stalled_after:.2?} into the stop, \
         completed {done:.2?} after SIGCONT ({:.2?} in all), verified, no connection dropped",
        t0.elapsed()
    );

    // 2. The link cut both ways for 5 s in the middle of 1 GiB.
    let len = 1 << 30;
    fill(&mem, 3, len);
    let tx = net.tx_bytes(Side::A, net.dev(Side::A)).unwrap();
    let h = a.submit(&peer, &src, &desc, whole(len)).unwrap();
    sent_beyond(&net, tx, len / 4);
    cut(&net, true);
    let t_cut = Instant::now();
    // The cut lasts 5 s (the fault itself).
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        h.try_result().is_none(),
        "the transfer ended during the cut: {:?}",
        h.try_result()
    );
    cut(&net, false);
    let restored = Instant::now();
    h.wait(T)
        .expect("the transfer in flight completes once the link is back");
    let done = restored.elapsed();
    assert!(
        target_holds(&mut p, 3, len),
        "every byte of the 1 GiB landed"
    );
    write(&desc, 4, 1 << 20)
        .expect("the next transfer, with no call of the application")
        .wait(T)
        .expect("the next transfer");
    assert!(target_holds(&mut p, 4, 1 << 20));
    assert_eq!(connections(), before, "the connections outlived the cut");
    assert_eq!(metric(&a, "xfer_reconnects_total"), 0);
    println!(
        "link cut 5 s in a 1 GiB WRITE: completed {done:.2?} after the link came back \
         ({:.2?} after the cut), the next transfer verified, no connection dropped",
        t_cut.elapsed()
    );

    // 3. The target killed and started again on the same addresses, under the same name.
    let ports = ports_of(&info);
    p.kill();
    let (mut p, info2, desc2) = netns_target::start(&net, TARGET_ENV, &ports);
    assert_eq!(ports_of(&info2), ports);
    assert_ne!(info2.instance, info.instance, "a new incarnation");
    // The transfer that meets the dead connection fails typed, naming the peer.
    let e = match write(&desc, 5, 1 << 20) {
        Ok(h) => h.wait(T).expect_err("the connection is dead"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    assert!(
        matches!(&e, Error::ConnectionLost { peer, .. } if peer == "liveness-target"),
        "{e:?}"
    );
    // The next reconnects by itself; the agent knows no other incarnation yet, so the old
    // descriptor goes out and the new process's transport refuses its key.
    let e = match write(&desc, 6, 1 << 20) {
        Ok(h) => h.wait(T).expect_err("a key of the previous process"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::RemoteAccess, "{e:?}");
    assert!(
        target_holds(&mut p, 0, LEN),
        "nothing of the new process's memory changed"
    );
    // Told of the new incarnation (the directory's follow, a rendezvous), the agent refuses
    // the old descriptor before anything moves.
    a.update_peer(&peer, &info2).unwrap();
    let e = write(&desc, 7, 1 << 20).expect_err("a descriptor of the previous incarnation");
    assert!(
        matches!(e, Error::StaleDescriptor { descriptor_instance, peer_instance, .. }
            if descriptor_instance == info.instance && peer_instance == info2.instance),
        "{e:?}"
    );
    assert!(
        target_holds(&mut p, 0, LEN),
        "nothing of the new process's memory changed"
    );
    write(&desc2, 8, 1 << 20)
        .unwrap()
        .wait(T)
        .expect("a write through the new process's descriptor");
    assert!(
        target_holds(&mut p, 8, 1 << 20),
        "it landed in the new process"
    );
    println!(
        "target killed and restarted on the same addresses: the dead connection failed \
         typed, the old descriptor refused (RemoteKeyInvalid by the new process, then \
         StaleDescriptor once the agent knew), the new process's memory untouched"
    );
}
