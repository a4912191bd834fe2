//! Removing a peer whose operations the provider already holds (the conformance case
//! removes it while they still wait for the connection): each completes exactly once,
//! late completions from the provider are dropped, and the peer can be added again.

mod common;

use fabric_core::{
    Access, HostBuffer, LocalSlice, OpError, OpKind, PostOutcome, RemoteSlice, Transport,
    WorkRequestId,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use transport_efa::EfaTransport;

fn poll_both(a: &mut EfaTransport, b: &mut EfaTransport, done: &mut Vec<fabric_core::Completion>) {
    a.poll(done).unwrap();
    b.poll(&mut Vec::new()).unwrap();
}

fn remove_with_posted_ops(provider: &'static str) {
    let Some(make) = common::maker(provider) else {
        return;
    };
    let mut a = make();
    let mut b = make();
    let peer = a.add_peer(&b.address()).unwrap();
    let src = a
        .register(HostBuffer::new_shared(1 << 20).unwrap(), Access::NONE)
        .unwrap();
    let dst = b
        .register(
            HostBuffer::new_shared(1 << 20).unwrap(),
            Access::REMOTE_WRITE,
        )
        .unwrap();
    let write = |a: &mut EfaTransport, id: u64, len: u64| {
        a.post_write(
            peer,
            WorkRequestId(id),
            LocalSlice {
                key: src.local,
                offset: 0,
                len,
            },
            RemoteSlice {
                region: dst.remote,
                offset: 0,
                len,
            },
            None,
        )
        .unwrap()
    };
    // Connect first, so that what follows is held by the provider, not our backlog.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    assert_eq!(write(&mut a, 1, 64), PostOutcome::Posted);
    while done.is_empty() {
        poll_both(&mut a, &mut b, &mut done);
        assert!(Instant::now() < deadline, "no first completion");
    }
    assert_eq!(done.remove(0).result, Ok(64));

    let mut posted = 0;
    for id in 100..164 {
        match write(&mut a, id, 1 << 20) {
            PostOutcome::Posted => posted += 1,
            PostOutcome::NoRoom => break,
        }
    }
    assert!(posted > 0);
    a.remove_peer(peer).unwrap();
    // Poll long enough for the provider to hand back whatever it still had.
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        poll_both(&mut a, &mut b, &mut done);
    }
    let mut count: HashMap<u64, usize> = HashMap::new();
    for c in &done {
        assert_eq!(c.op, OpKind::Write);
        assert!(
            matches!(c.result, Ok(_) | Err(OpError::PeerRemoved(_))),
            "{c:?}"
        );
        *count.entry(c.wr_id.0).or_default() += 1;
    }
    assert_eq!(count.len(), posted, "every write completes: {done:?}");
    assert!(count.values().all(|&n| n == 1), "twice: {count:?}");

    // The address can be added again, and works.
    let again = a.add_peer(&b.address()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    let local = LocalSlice {
        key: src.local,
        offset: 0,
        len: 100,
    };
    let remote = RemoteSlice {
        region: dst.remote,
        offset: 0,
        len: 100,
    };
    while a
        .post_write(again, WorkRequestId(7), local, remote, None)
        .unwrap()
        == PostOutcome::NoRoom
    {
        poll_both(&mut a, &mut b, &mut done);
    }
    while !done.iter().any(|c| c.wr_id == WorkRequestId(7)) {
        poll_both(&mut a, &mut b, &mut done);
        assert!(Instant::now() < deadline, "no completion after re-adding");
    }
    let c = done.iter().find(|c| c.wr_id == WorkRequestId(7)).unwrap();
    assert_eq!(c.result, Ok(100));
}

#[test]
fn tcp_remove_peer_with_posted_ops() {
    remove_with_posted_ops("tcp");
}

#[test]
fn sockets_remove_peer_with_posted_ops() {
    remove_with_posted_ops("sockets");
}

#[test]
fn shm_remove_peer_with_posted_ops() {
    remove_with_posted_ops("shm");
}
