//! A target that only calls `wait` and `poll` (as an idle engine does) keeps the provider
//! progressing: with manual progress (tcp) bytes move only while the target reads its CQ,
//! and `wait` must wake when they arrive rather than sleep out its time-out.

mod common;

use fabric_core::{
    Access, Completion, HostBuffer, LocalSlice, OpKind, PostOutcome, RemoteRegion, RemoteSlice,
    Transport, WorkRequestId,
};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const WRITES: u64 = 64;
const LEN: u64 = 256 << 10;
/// Each `wait` of the target may last this long. A target that slept out its time-out
/// instead of waking for incoming bytes would make the 16 MiB below take at least that
/// long (writes complete only once the target has read them); when it wakes, they take
/// milliseconds.
const WAIT: Duration = Duration::from_secs(4);

fn target_that_waits(provider: &'static str) {
    let Some(make) = common::maker(provider) else {
        return;
    };
    let (tx, rx) = mpsc::channel();
    let target = std::thread::spawn(move || {
        // Opened in the thread that polls it.
        let mut b = make();
        let dst = HostBuffer::new_shared((WRITES * LEN) as usize).unwrap();
        let reg = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
        tx.send((b.address(), reg.remote)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut imms, mut waits) = (Vec::new(), 0u32);
        let mut done: Vec<Completion> = Vec::new();
        while (imms.len() as u64) < WRITES && Instant::now() < deadline {
            b.wait(WAIT).unwrap();
            waits += 1;
            b.poll(&mut done).unwrap();
            for c in done.drain(..) {
                assert_eq!(c.op, OpKind::RemoteWrite, "{c:?}");
                assert!(c.result.is_ok(), "{c:?}");
                imms.push(c.imm.expect("imm"));
            }
        }
        // Keep progressing until the initiator is done (its last completions need us).
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until {
            b.wait(Duration::from_millis(1)).unwrap();
            b.poll(&mut done).unwrap();
        }
        (imms, waits, dst)
    });
    let (addr, remote): (Vec<u8>, RemoteRegion) = rx.recv().unwrap();

    let mut a = common::maker(provider).unwrap()();
    let peer = a.add_peer(&addr).unwrap();
    let src = HostBuffer::new_shared((WRITES * LEN) as usize).unwrap();
    let data: Vec<u8> = (0..WRITES * LEN).map(|i| (i * 7 % 251) as u8).collect();
    src.write(0, &data).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let start = Instant::now();
    let (mut posted, mut completed) = (0u64, 0u64);
    let mut done = Vec::new();
    while completed < WRITES {
        while posted < WRITES {
            let local = LocalSlice {
                key: s.local,
                offset: posted * LEN,
                len: LEN,
            };
            let dst = RemoteSlice {
                region: remote,
                offset: posted * LEN,
                len: LEN,
            };
            let imm = Some(posted as u32);
            match a.post_write(peer, WorkRequestId(posted), local, dst, imm) {
                Ok(PostOutcome::Posted) => posted += 1,
                Ok(PostOutcome::NoRoom) => break,
                Err(e) => panic!("post_write: {e}"),
            }
        }
        a.poll(&mut done).unwrap();
        for c in done.drain(..) {
            assert!(c.result.is_ok(), "{c:?}");
            completed += 1;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{completed} of {WRITES} writes completed"
        );
    }
    let elapsed = start.elapsed();
    let (mut imms, waits, dst) = target.join().unwrap();
    imms.sort_unstable();
    assert_eq!(imms, (0..WRITES as u32).collect::<Vec<_>>());
    assert!(dst.to_vec(0, (WRITES * LEN) as usize).unwrap() == data);
    assert!(
        elapsed < WAIT / 2,
        "{provider}: {WRITES} writes of {LEN} bytes took {elapsed:?} with a target that \
         waits (up to {WAIT:?} per wait, {waits} waits)"
    );
}

#[test]
fn tcp_target_that_waits() {
    target_that_waits("tcp");
}

#[test]
fn sockets_target_that_waits() {
    target_that_waits("sockets");
}

#[test]
fn shm_target_that_waits() {
    target_that_waits("shm");
}

#[test]
fn wait_returns_at_its_timeout_when_idle() {
    let Some(make) = common::maker("tcp") else {
        return;
    };
    let mut t = make();
    let start = Instant::now();
    t.wait(Duration::from_millis(20)).unwrap();
    t.wait(Duration::ZERO).unwrap();
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "two idle waits took {took:?}"
    );
    let mut out = Vec::new();
    assert_eq!(t.poll(&mut out).unwrap(), 0);
}

/// The engine's waker ends a `wait` at once, from another thread, whether or not the CQ
/// has a wait descriptor: a submit never waits for the worker's sleep to run out.
fn waker_ends_a_long_wait(provider: &'static str) {
    let Some(make) = common::maker(provider) else {
        return;
    };
    let mut t = make();
    let waker = t.waker();
    let long = Duration::from_secs(30);
    for _ in 0..3 {
        let w = waker.clone();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let poker = std::thread::spawn(move || {
            go_rx.recv().unwrap();
            std::thread::sleep(Duration::from_millis(20));
            w.wake();
        });
        go_tx.send(()).unwrap();
        let start = Instant::now();
        // A provider whose CQ has no descriptor naps briefly instead; either way the wait
        // must end long before its 30 s.
        while start.elapsed() < Duration::from_millis(20) {
            t.wait(long).unwrap();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "wait ran {:?} despite the wake-up",
            start.elapsed()
        );
        poker.join().unwrap();
    }
}

#[test]
fn tcp_waker_ends_a_long_wait() {
    waker_ends_a_long_wait("tcp");
}

#[test]
fn sockets_waker_ends_a_long_wait() {
    waker_ends_a_long_wait("sockets");
}
