//! Notifications (peers' immediate data) through the agent: never lost however late the
//! receiver looks, one store whatever mix of calls takes from it, each naming its sender.
//! Over mem and over tcp on loopback, so these run anywhere.

use std::collections::VecDeque;
use std::time::Duration;
use xfer::{
    Access, Agent, AgentOptions, Handle, HostBuffer, Peer, Region, RegionDescriptor,
    TransportChoice, TransportKind,
};

const T: Duration = Duration::from_secs(60);
const PAGE: u64 = 4096;
const PAGES: u64 = 64;

fn agent(kind: TransportKind, name: &str) -> Agent {
    Agent::new(AgentOptions {
        name: Some(name.into()),
        transport: TransportChoice::Only(kind),
        rails: Some(1),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("an agent")
}

/// A sender connected to a receiver, each with a region of `PAGES` pages.
struct Pair {
    a: Agent,
    b: Agent,
    peer: Peer,
    src: Region,
    dst: RegionDescriptor,
}

fn pair(kind: TransportKind) -> Pair {
    let (a, b) = (agent(kind, "sender"), agent(kind, "receiver"));
    let src = a
        .register(
            HostBuffer::new_shared((PAGE * PAGES) as usize).unwrap(),
            Access::NONE,
        )
        .unwrap();
    let dst = b
        .register(
            HostBuffer::new_shared((PAGE * PAGES) as usize).unwrap(),
            Access::REMOTE_WRITE,
        )
        .unwrap();
    let peer = a.connect(b.info()).unwrap();
    Pair {
        dst: dst.descriptor().clone(),
        a,
        b,
        peer,
        src,
    }
}

impl Pair {
    /// `n` one-page writes, write `i` carrying immediate value `value(i)`, 256 in flight;
    /// returns once every one has completed at the sender.
    fn writes(&self, n: u64, value: impl Fn(u64) -> u32) {
        let mut inflight: VecDeque<Handle> = VecDeque::new();
        for i in 0..n {
            if inflight.len() == 256 {
                inflight.pop_front().unwrap().wait(T).expect("a write");
            }
            let p = i % PAGES;
            let t = xfer::Transfer::pages(&[p], PAGE, &[p], PAGE, PAGE)
                .unwrap()
                .imm(value(i));
            inflight.push_back(self.a.submit(&self.peer, &self.src, &self.dst, t).unwrap());
        }
        for h in inflight {
            h.wait(T).expect("a write");
        }
    }
}

/// 200 000 writes with 7 values to a receiver that does not look until the sender is
/// done: every value's count is complete (an engine used to keep 65 536 events and drop
/// the rest).
fn a_late_receiver_loses_nothing(kind: TransportKind) {
    const N: u64 = 200_000;
    let p = pair(kind);
    p.writes(N, |i| (i % 7) as u32);
    for v in 0..7u32 {
        let want = (0..N).filter(|i| i % 7 == v as u64).count() as u64;
        p.b.wait_imm(v, want, T)
            .unwrap_or_else(|e| panic!("value {v}: {want} arrivals: {e}"));
    }
    assert!(p.b.try_notification().is_none(), "nothing more arrived");
}

#[test]
fn a_late_receiver_loses_nothing_over_mem() {
    a_late_receiver_loses_nothing(TransportKind::Mem);
}

#[test]
fn a_late_receiver_loses_nothing_over_tcp() {
    a_late_receiver_loses_nothing(TransportKind::Tcp);
}

/// Waiting for a value, taking one at a time and draining take from one store: used
/// together they see every arrival exactly once.
fn the_calls_mix_without_loss(kind: TransportKind) {
    let p = pair(kind);
    // A last write with its own value: on one rail, once it is here all the others are.
    p.writes(3001, |i| if i == 3000 { 9 } else { (i % 3) as u32 });
    p.b.wait_imm(9, 1, T).expect("the last write");
    p.b.wait_imm(1, 600, T).expect("600 of the 1000 ones");
    let mut seen = [0u64; 3];
    for _ in 0..500 {
        let n = p.b.next_notification(T).expect("an arrival");
        assert_eq!(n.count, 1);
        seen[n.imm as usize] += 1;
    }
    for n in p.b.notifications() {
        seen[n.imm as usize] += n.count;
    }
    assert_eq!(seen, [1000, 400, 1000]);
    assert_eq!(p.b.imm_count(1), 0);
    let e = p.b.wait_imm(0, 1, Duration::from_millis(20)).unwrap_err();
    assert!(e.to_string().contains("timed out"), "{e}");
}

#[test]
fn the_calls_mix_without_loss_over_mem() {
    the_calls_mix_without_loss(TransportKind::Mem);
}

#[test]
fn the_calls_mix_without_loss_over_tcp() {
    the_calls_mix_without_loss(TransportKind::Tcp);
}

/// A notification names the agent that sent it, once the receiver knows it (it connected
/// to it, or was told of it); before, the sender is unknown, not made up.
fn a_notification_names_its_sender(kind: TransportKind) {
    let p = pair(kind);
    let c = agent(kind, "another-sender");
    let c_src = c
        .register(
            HostBuffer::new_shared((PAGE * PAGES) as usize).unwrap(),
            Access::NONE,
        )
        .unwrap();
    let c_peer = c.connect(p.b.info()).unwrap();
    p.writes(1, |_| 5);
    let one = xfer::Transfer::pages(&[0], PAGE, &[1], PAGE, PAGE)
        .unwrap()
        .imm(6);
    c.submit(&c_peer, &c_src, &p.dst, one)
        .unwrap()
        .wait(T)
        .unwrap();
    p.b.wait_imm(6, 1, T).expect("c's write landed");
    let unknown = p.b.next_notification(T).expect("a's arrival");
    assert_eq!((unknown.imm, unknown.sender), (5, None));

    p.b.know(p.a.info());
    p.b.know(c.info());
    p.writes(2, |_| 7);
    let one = xfer::Transfer::pages(&[0], PAGE, &[1], PAGE, PAGE)
        .unwrap()
        .imm(7);
    c.submit(&c_peer, &c_src, &p.dst, one)
        .unwrap()
        .wait(T)
        .unwrap();
    let mut got = Vec::new();
    while got.iter().map(|(_, n)| n).sum::<u64>() < 3 {
        let n = p.b.next_notification(T).expect("an arrival");
        assert_eq!(n.imm, 7);
        got.push((n.sender.expect("a known sender"), n.count));
    }
    got.sort();
    assert_eq!(
        got,
        vec![
            ("another-sender".to_owned(), 1),
            ("sender".to_owned(), 1),
            ("sender".to_owned(), 1)
        ]
    );
}

#[test]
fn a_notification_names_its_sender_over_mem() {
    a_notification_names_its_sender(TransportKind::Mem);
}

#[test]
fn a_notification_names_its_sender_over_tcp() {
    a_notification_names_its_sender(TransportKind::Tcp);
}

/// A transfer's message reaches the peer after its bytes, with its value and the
/// sender's name, over 4 rails (the message follows the last chunk, wherever it went);
/// messages of a READ tell the owner that its memory was read; a receiver that takes
/// them late loses none.
fn a_message_carries_its_request(kind: TransportKind) {
    let o = |name: &str| AgentOptions {
        name: Some(name.into()),
        transport: TransportChoice::Only(kind),
        rails: Some(4),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    };
    let (a, b) = (
        Agent::new(o("prefill")).unwrap(),
        Agent::new(o("decode")).unwrap(),
    );
    let len = 8 << 20;
    let src_mem = HostBuffer::new_shared(len).unwrap();
    src_mem.fill(0, len as u64, 3).unwrap();
    let src = a.register(src_mem, Access::REMOTE_READ).unwrap();
    let dst_mem = HostBuffer::new_shared(len).unwrap();
    let dst = b
        .register(dst_mem.clone(), Access::REMOTE_WRITE | Access::LOCAL_WRITE)
        .unwrap();
    let peer = a.connect(b.info()).unwrap();
    b.know(a.info());
    a.know(b.info());
    let pages: Vec<u64> = (0..(len as u64 / 65536)).collect();
    for r in 0..40u32 {
        let t = xfer::Transfer::pages(&pages, 65536, &pages, 65536, 65536)
            .unwrap()
            .imm(r % 2)
            .message(format!("request {r}"));
        a.submit(&peer, &src, dst.descriptor(), t)
            .unwrap()
            .wait(T)
            .unwrap();
    }
    // Taken late: all 40, in order, each with the bytes in place.
    for r in 0..40u32 {
        let n = b.next_notification(T).expect("a message");
        assert_eq!(n.sender.as_deref(), Some("prefill"));
        assert_eq!(n.imm, r % 2);
        assert_eq!(
            n.message.as_deref(),
            Some(format!("request {r}").as_bytes())
        );
    }
    assert!(dst_mem.to_vec(0, len).unwrap().iter().all(|&x| x == 3));
    assert!(b.try_notification().is_none());

    // Pull: b reads a's memory and tells a, naming itself.
    let back = b.connect(a.info()).unwrap();
    dst_mem.fill(0, len as u64, 0).unwrap();
    let t = xfer::Transfer::pages(&pages, 65536, &pages, 65536, 65536)
        .unwrap()
        .read()
        .message(&b"read request 7"[..]);
    b.submit(&back, &dst, src.descriptor(), t)
        .unwrap()
        .wait(T)
        .unwrap();
    assert!(dst_mem.to_vec(0, len).unwrap().iter().all(|&x| x == 3));
    let n = a.next_notification(T).expect("the reader's message");
    assert_eq!(
        (n.sender.as_deref(), n.imm, n.message.as_deref()),
        (Some("decode"), 0, Some(&b"read request 7"[..]))
    );
}

#[test]
fn a_message_carries_its_request_over_mem() {
    a_message_carries_its_request(TransportKind::Mem);
}

#[test]
fn a_message_carries_its_request_over_tcp() {
    a_message_carries_its_request(TransportKind::Tcp);
}

/// An agent told to keep no notifications (a server that never takes them) counts them
/// and keeps none, however many distinct values its peers send.
#[test]
fn an_agent_that_keeps_no_notifications_counts_them_and_holds_none() {
    let a = agent(TransportKind::Tcp, "sender");
    let mut o = AgentOptions {
        name: Some("server".into()),
        transport: TransportChoice::Only(TransportKind::Tcp),
        rails: Some(1),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    };
    o.workers.notification_keys = Some(0);
    let b = Agent::new(o).unwrap();
    let src = a
        .register(
            HostBuffer::new_shared((PAGE * PAGES) as usize).unwrap(),
            Access::NONE,
        )
        .unwrap();
    let dst = b
        .register(
            HostBuffer::new_shared((PAGE * PAGES) as usize).unwrap(),
            Access::REMOTE_WRITE,
        )
        .unwrap();
    let p = Pair {
        peer: a.connect(b.info()).unwrap(),
        dst: dst.descriptor().clone(),
        src,
        a,
        b,
    };
    p.writes(5000, |i| i as u32);
    fabric_core::testing::eventually("the server to count every arrival", T, || {
        p.b.counters().notifications == 5000
    });
    assert!(p.b.notifications().is_empty(), "none kept");
}
