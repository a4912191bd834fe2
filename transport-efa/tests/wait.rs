//! A target that only calls `wait` and `poll` (as an idle engine does) keeps the provider
//! progressing: with manual progress (tcp) bytes move only while the target reads its CQ,
//! and `wait` must wake when they arrive rather than sleep out its time-out. And the
//! engine's waker ends a long `wait` early, whatever that `wait` sleeps on.

mod common;

use fabric_core::testing::eventually;
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

/// How long the waits that a wake-up must end are asked to last (and, where the CQ has no
/// descriptor, how long the transport naps): a `wait` the waker does not end runs this long.
const LONG: Duration = Duration::from_secs(10);
/// A wait that nothing ends lasts at least its time-out: checked with this one, so that a
/// woken wait that ends early was ended by its wake-up, not by a `wait` that never sleeps.
const QUIET: Duration = Duration::from_millis(200);

/// This thread's id, to find it in `/proc/self/task`.
fn this_thread() -> libc::pid_t {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

/// Whether thread `tid` of this process sits in `ppoll` now (the first field of its
/// `/proc/self/task/TID/syscall` is the number of the call it is blocked in).
fn in_ppoll(tid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<libc::c_long>().ok())
        == Some(libc::SYS_ppoll)
}

/// Asserts that `wait(QUIET)` with nothing to end it lasts its time.
fn quiet_wait_lasts(t: &mut transport_efa::EfaTransport, provider: &str, when: &str) {
    let start = Instant::now();
    t.wait(QUIET).unwrap();
    let took = start.elapsed();
    assert!(
        took >= QUIET,
        "{provider}: a wait of {QUIET:?} with nothing to end it returned after {took:?} {when}"
    );
}

/// The engine's waker ends a `wait` from another thread long before its time-out, whatever
/// `wait` sleeps on: the CQ's descriptor with the wake-up descriptor (tcp), the wake-up
/// descriptor alone where the CQ has none (sockets; the nap is made as long as the wait, so
/// that only a wake-up ends it early), or nothing, reading the CQ without sleeping (a
/// manual-progress provider with `idle_nap` zero: shm). Where `wait` sleeps, the wake-up
/// comes once the waiting thread is blocked in `ppoll`; a wake-up is also kept for a `wait`
/// not yet begun, and consumed by the wait it ends.
fn waker_ends_a_long_wait(provider: &'static str, nap: Duration) {
    if common::maker(provider).is_none() {
        return;
    }
    let mut t = transport_efa::EfaTransport::new(&common::config(provider).idle_nap(nap))
        .expect("open endpoint");
    let waker = t.waker();
    quiet_wait_lasts(&mut t, provider, "before any wake-up");
    let sleeps = !nap.is_zero();
    for round in 0..3 {
        // While the wait runs (once it sleeps in ppoll, where it sleeps), from another thread.
        let (w, me) = (waker.clone(), this_thread());
        let poker = std::thread::spawn(move || {
            if sleeps {
                eventually("the waiting thread sleeps in ppoll", LONG / 2, || {
                    in_ppoll(me)
                });
            }
            w.wake();
        });
        let start = Instant::now();
        t.wait(LONG).unwrap();
        let took = start.elapsed();
        poker.join().unwrap();
        assert!(
            took < LONG / 2,
            "{provider}, round {round}: a wait of {LONG:?} woken from another thread ran {took:?}"
        );
        quiet_wait_lasts(
            &mut t,
            provider,
            "after a woken one (the wake-up was not consumed)",
        );
    }
    // Before the wait: kept for it.
    waker.wake();
    let start = Instant::now();
    t.wait(LONG).unwrap();
    let took = start.elapsed();
    assert!(
        took < LONG / 2,
        "{provider}: a wait of {LONG:?} after a wake-up ran {took:?}"
    );
    quiet_wait_lasts(&mut t, provider, "after the kept wake-up");
}

#[test]
fn tcp_waker_ends_a_long_wait() {
    waker_ends_a_long_wait("tcp", LONG);
}

#[test]
fn sockets_waker_ends_a_long_wait() {
    waker_ends_a_long_wait("sockets", LONG);
}

#[test]
fn shm_waker_ends_a_long_spinning_wait() {
    waker_ends_a_long_wait("shm", Duration::ZERO);
}
