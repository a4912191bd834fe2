//! Prepared transfers: planned once, posted many times with no planning and no growth of
//! the process's memory; owned by their agent; refused once their region is gone. Over
//! mem, so these run anywhere.

use std::collections::VecDeque;
use std::time::Duration;
use xfer::{
    Access, Agent, AgentOptions, ErrorKind, Handle, HostBuffer, Transfer, TransportChoice,
    TransportKind,
};

const T: Duration = Duration::from_secs(30);
const PAGE: u64 = 4096;

fn agent() -> Agent {
    Agent::new(AgentOptions {
        transport: TransportChoice::Only(TransportKind::Mem),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("a mem agent")
}

/// This process's resident memory, in bytes (Linux: /proc/self/statm).
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn a_prepared_transfer_posted_a_million_times_moves_its_pages_and_holds_its_memory() {
    let (a, b) = (agent(), agent());
    let src = HostBuffer::new_shared(16 * PAGE as usize).unwrap();
    for p in 0..16 {
        src.fill(p * PAGE, PAGE, p as u8 + 1).unwrap();
    }
    let dst = HostBuffer::new_shared(16 * PAGE as usize).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.connect(b.info()).unwrap();
    // Pages 3 and 4 are adjacent on both sides: coalesced into one write, once.
    let t = Transfer::pages(&[3, 4, 9], PAGE, &[0, 1, 15], PAGE, PAGE)
        .unwrap()
        .imm(7);
    let prepared = a.prepare(&peer, &s, d.descriptor(), t).unwrap();
    assert_eq!((prepared.bytes(), prepared.ops()), (3 * PAGE, 2));

    const POSTS: u64 = 1_000_000;
    const WARM: u64 = 20_000;
    let mut inflight: VecDeque<Handle> = VecDeque::new();
    let mut before = 0;
    for i in 0..POSTS {
        if i == WARM {
            for h in inflight.drain(..) {
                h.wait(T).unwrap();
            }
            b.wait_imm(7, WARM, T).unwrap();
            before = resident();
        }
        if inflight.len() == 256 {
            inflight.pop_front().unwrap().wait(T).unwrap();
        }
        inflight.push_back(a.post(&prepared).unwrap());
    }
    for h in inflight {
        h.wait(T).unwrap();
    }
    b.wait_imm(7, POSTS - WARM, T).unwrap();
    let grown = resident().saturating_sub(before);
    assert!(
        grown < 8 << 20,
        "resident memory grew by {grown} bytes over {} posts",
        POSTS - WARM
    );
    for (to, from) in [(0, 3u8), (1, 4), (15, 9)] {
        let got = dst.to_vec(to * PAGE, PAGE as usize).unwrap();
        assert_eq!(got, vec![from + 1; PAGE as usize], "page {to}");
    }
}

#[test]
fn a_prepared_transfer_belongs_to_its_agent_and_fails_once_its_region_is_gone() {
    let (a, b, c) = (agent(), agent(), agent());
    let s = a
        .register(HostBuffer::new_shared(PAGE as usize).unwrap(), Access::NONE)
        .unwrap();
    let d = b
        .register(
            HostBuffer::new_shared(PAGE as usize).unwrap(),
            Access::REMOTE_WRITE,
        )
        .unwrap();
    let peer = a.connect(b.info()).unwrap();
    let p = a
        .prepare(
            &peer,
            &s,
            d.descriptor(),
            Transfer::segments(vec![(0, 0, PAGE)]),
        )
        .unwrap();
    let e = c.post(&p).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ForeignHandle, "{e}");
    a.post(&p).unwrap().wait(T).unwrap();
    a.deregister(&s).unwrap();
    let e = a.post(&p).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    // Bad segments fail when prepared, before anything is posted.
    let e = a
        .prepare(
            &peer,
            &s,
            d.descriptor(),
            Transfer::segments(vec![(0, 0, 2 * PAGE)]),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
}

/// Work that never finishes: a transfer waiting for it moves nothing until cancelled.
#[derive(Debug)]
struct Never;

impl xfer::Fence for Never {
    fn is_done(&self) -> Result<bool, fabric_core::MemoryError> {
        Ok(false)
    }
}

/// A transfer cancelled before it moved anything ends with `Cancelled`, moves nothing,
/// and leaves its region free; on one rail (one chunk) and on two (chunks on each rail).
#[test]
fn a_cancelled_transfer_ends_cancelled_and_moves_nothing() {
    for rails in [1, 2] {
        let mem = |rails| {
            Agent::new(AgentOptions {
                transport: TransportChoice::Only(TransportKind::Mem),
                pin: xfer::PinMode::Off,
                rails: Some(rails),
                ..AgentOptions::default()
            })
            .expect("a mem agent")
        };
        let (a, b) = (mem(rails), mem(rails));
        let len = 16 << 20;
        let src = HostBuffer::new_shared(len as usize).unwrap();
        src.fill(0, len, 5).unwrap();
        let dst = HostBuffer::new_shared(len as usize).unwrap();
        let s = a.register(src, Access::NONE).unwrap();
        let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
        let peer = a.connect(b.info()).unwrap();
        let t = Transfer::segments(vec![(0, 0, len)])
            .imm(3)
            .after(std::sync::Arc::new(Never));
        let h = a.submit(&peer, &s, d.descriptor(), t).unwrap();
        assert!(
            !h.finished_within(Duration::from_millis(20)),
            "{rails} rails"
        );
        h.cancel();
        let e = h.wait(T).expect_err("cancelled");
        assert_eq!(e.kind(), ErrorKind::Cancelled, "{rails} rails: {e}");
        assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![0; 4096], "{rails} rails");
        assert!(
            b.wait_imm(3, 1, Duration::from_millis(50)).is_err(),
            "no imm"
        );
        h.cancel(); // a second cancel, of a finished transfer, does nothing
        // The region is free again: it deregisters, and another transfer works.
        let again = a
            .submit(
                &peer,
                &s,
                d.descriptor(),
                Transfer::segments(vec![(0, 0, len)]),
            )
            .unwrap();
        again.wait(T).unwrap();
        assert_eq!(dst.to_vec(len - 4096, 4096).unwrap(), vec![5; 4096]);
        a.deregister(&s).unwrap();
    }
}
