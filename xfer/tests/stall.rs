//! A stalled peer is told apart from a dead one: a peer process stopped with SIGSTOP (its
//! connection stands, the kernel keeps it up) makes a wait report `PeerStalled` within
//! the transfer's stall timeout, and the transfer goes on once the peer continues; with a
//! stall timeout longer than the stop, the wait only times out and the transfer completes.
//!
//! Its own harness (`harness = false`): run with `XFER_STALL_PEER=1`, this binary is the
//! peer (an agent with a region, its metadata on stdout, checking its memory on request).

mod common;

use common::child::{self, Child, pattern};
use std::time::{Duration, Instant};
use xfer::{Access, Agent, AgentOptions, ErrorKind, HostBuffer, TransportChoice, TransportKind};

const LEN: usize = 64 << 20;
const T: Duration = Duration::from_secs(60);

fn options(name: &str) -> AgentOptions {
    AgentOptions {
        name: Some(name.into()),
        transport: TransportChoice::Only(TransportKind::Tcp),
        rails: Some(1),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    }
}

/// The peer: announces its agent's and region's metadata, then answers each line
/// `check N` with `ok` when its region holds round N's pattern, `bad` otherwise.
fn peer() {
    let b = Agent::new(options("stopped-peer")).expect("the peer's agent");
    child::serve_region(&b, LEN, child::holds_pattern);
}

fn main() {
    if std::env::var_os("XFER_STALL_PEER").is_some() {
        peer();
        return;
    }
    let (mut p, info, desc) = Child::spawn(Child::this_binary("XFER_STALL_PEER", "1"));
    let a = Agent::new(options("initiator")).unwrap();
    let mem = HostBuffer::new_shared(LEN).unwrap();
    let src = a.register(mem.clone(), Access::NONE).unwrap();
    let peer = a.connect(&info).unwrap();
    let whole = || xfer::Transfer::segments(vec![(0, 0, LEN as u64)]);

    // A stall timeout shorter than the stop: PeerStalled, then it completes on SIGCONT.
    mem.fill_with(pattern(1));
    p.signal(libc::SIGSTOP);
    let started = Instant::now();
    let stall = Duration::from_millis(300);
    let h = a
        .submit(&peer, &src, &desc, whole().stall_timeout(stall))
        .unwrap();
    let e = h.wait(T).expect_err("the peer is stopped");
    let took = started.elapsed();
    assert_eq!(e.kind(), ErrorKind::PeerStalled, "{e}");
    assert!(e.kind().is_retryable());
    assert!(
        took >= stall && took < Duration::from_secs(10),
        "reported after {took:?}"
    );
    assert!(!h.is_finished(), "a stall ends the wait, not the transfer");
    p.signal(libc::SIGCONT);
    // The connection stood: the transfer goes on. A peer slow to resume (a loaded machine)
    // may still read as stalled for a wait or two; only a real end counts.
    let until = Instant::now() + T;
    loop {
        match h.wait(T) {
            Ok(_) => break,
            Err(e) if e.kind() == ErrorKind::PeerStalled && Instant::now() < until => continue,
            Err(e) => panic!("the transfer goes on once the peer does: {e}"),
        }
    }
    assert!(p.holds(1), "every byte landed");

    // A stall timeout longer than the stop: the wait only runs out; the transfer completes.
    mem.fill_with(pattern(2));
    p.signal(libc::SIGSTOP);
    let h = a
        .submit(
            &peer,
            &src,
            &desc,
            whole().stall_timeout(Duration::from_secs(120)),
        )
        .unwrap();
    let e = h
        .wait(Duration::from_millis(500))
        .expect_err("the peer is stopped");
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    p.signal(libc::SIGCONT);
    h.wait(T).expect("completes after SIGCONT");
    assert!(p.holds(2), "every byte landed");
    println!("stall: 2 cases passed (PeerStalled after {took:?} with a 300 ms stall timeout)");
}
