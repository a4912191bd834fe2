//! What the in-memory transport promises beyond the conformance suite: writes posted
//! together land together in the next poll, in posting order, and before anything that
//! could observe them (a SEND, a deregistration, the transport's drop).

use fabric_core::mem::MemTransport;
use fabric_core::{
    Access, Completion, HostBuffer, LocalSlice, OpError, OpKind, PeerId, PostOutcome, Registration,
    RemoteSlice, Transport, WorkRequestId,
};
use std::sync::Arc;

fn region(t: &mut MemTransport, len: usize, access: Access) -> (Arc<HostBuffer>, Registration) {
    let buf = HostBuffer::new_shared(len).unwrap();
    let reg = t.register(buf.clone(), access).unwrap();
    (buf, reg)
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

fn local(r: &Registration, offset: u64, len: u64) -> LocalSlice {
    LocalSlice {
        key: r.local,
        offset,
        len,
    }
}

fn remote(r: &Registration, offset: u64, len: u64) -> RemoteSlice {
    RemoteSlice {
        region: r.remote,
        offset,
        len,
    }
}

fn write(
    t: &mut MemTransport,
    peer: PeerId,
    wr: u64,
    src: LocalSlice,
    dst: RemoteSlice,
    imm: Option<u32>,
) {
    let r = t.post_write(peer, WorkRequestId(wr), src, dst, imm);
    assert_eq!(r.unwrap(), PostOutcome::Posted);
}

fn poll(t: &mut MemTransport) -> Vec<Completion> {
    let mut out = Vec::new();
    t.poll(&mut out).unwrap();
    out
}

#[test]
fn writes_of_many_runs_land_in_posting_order_with_their_imm() {
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let n = 600u64; // more writes and more bytes than one run under the target's lock
    let (src, s) = region(&mut a, (n * 4096) as usize, Access::NONE);
    src.write(0, &pattern((n * 4096) as usize)).unwrap();
    let (dst, d) = region(&mut b, 16 * 4096, Access::REMOTE_WRITE);
    for i in 0..n {
        // Write i goes to page i % 16: the last writer of each page must win.
        let imm = (i == n - 1).then_some(9);
        let dst_slice = remote(&d, (i % 16) * 4096, 4096);
        write(&mut a, peer, i, local(&s, i * 4096, 4096), dst_slice, imm);
    }
    let done = poll(&mut a);
    let ids: Vec<u64> = done.iter().map(|c| c.wr_id.0).collect();
    assert_eq!(ids, (0..n).collect::<Vec<_>>());
    assert!(
        done.iter()
            .all(|c| c.op == OpKind::Write && c.result == Ok(4096))
    );
    for page in 0..16 {
        let last = (n - 16..n).find(|i| i % 16 == page).unwrap();
        assert_eq!(
            dst.to_vec(page * 4096, 4096).unwrap(),
            src.to_vec(last * 4096, 4096).unwrap(),
            "page {page}"
        );
    }
    let events = poll(&mut b);
    assert_eq!(events.len(), 1);
    assert_eq!(
        (events[0].op, events[0].imm),
        (OpKind::RemoteWrite, Some(9))
    );
}

#[test]
fn a_send_arrives_after_the_writes_posted_before_it() {
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let (src, s) = region(&mut a, 1 << 16, Access::NONE);
    src.write(0, &pattern(1 << 16)).unwrap();
    let (dst, d) = region(&mut b, 1 << 16, Access::REMOTE_WRITE | Access::LOCAL_WRITE);
    let (_, inbox) = region(&mut b, 64, Access::LOCAL_WRITE);
    assert_eq!(
        b.post_recv(WorkRequestId(1), local(&inbox, 0, 64)).unwrap(),
        PostOutcome::Posted
    );
    for i in 0..256 {
        write(
            &mut a,
            peer,
            i,
            local(&s, i * 256, 256),
            remote(&d, i * 256, 256),
            None,
        );
    }
    let send = a.post_send(peer, WorkRequestId(999), local(&s, 0, 8), Some(1));
    assert_eq!(send.unwrap(), PostOutcome::Posted);
    let got = poll(&mut b);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].op, got[0].result.clone()), (OpKind::Recv, Ok(8)));
    assert_eq!(dst.to_vec(0, 1 << 16).unwrap(), pattern(1 << 16));
    let done = poll(&mut a);
    assert_eq!(done.len(), 257);
    assert_eq!(done[256].wr_id, WorkRequestId(999));
}

#[test]
fn deregistering_the_source_lands_pending_writes_first() {
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let (src, s) = region(&mut a, 4096, Access::NONE);
    src.write(0, &pattern(4096)).unwrap();
    let (dst, d) = region(&mut b, 4096, Access::REMOTE_WRITE);
    write(
        &mut a,
        peer,
        5,
        local(&s, 0, 4096),
        remote(&d, 0, 4096),
        None,
    );
    a.deregister(s.local).unwrap();
    let done = poll(&mut a);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result, Ok(4096));
    assert_eq!(dst.to_vec(0, 4096).unwrap(), pattern(4096));
}

#[test]
fn dropping_a_transport_lands_its_posted_writes() {
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let (src, s) = region(&mut a, 4096, Access::NONE);
    src.write(0, &pattern(4096)).unwrap();
    let (dst, d) = region(&mut b, 4096, Access::REMOTE_WRITE);
    write(
        &mut a,
        peer,
        5,
        local(&s, 0, 4096),
        remote(&d, 0, 4096),
        Some(3),
    );
    drop(a);
    assert_eq!(dst.to_vec(0, 4096).unwrap(), pattern(4096));
    let events = poll(&mut b);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].imm, Some(3));
}

/// A write still pending when its target goes away fails, as it would on a network (the
/// transport used to copy at post time, so such a write had landed already).
#[test]
fn a_peer_dropped_before_its_writes_run_fails_them() {
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let (_, s) = region(&mut a, 4096, Access::NONE);
    let (_, d) = region(&mut b, 4096, Access::REMOTE_WRITE);
    write(&mut a, peer, 5, local(&s, 0, 64), remote(&d, 0, 64), None);
    drop(b);
    let done = poll(&mut a);
    assert_eq!(done.len(), 1);
    assert!(
        matches!(&done[0].result, Err(OpError::PeerUnreachable { peer: p, .. }) if *p == peer),
        "{done:?}"
    );
    assert!(
        a.post_write(
            peer,
            WorkRequestId(6),
            local(&s, 0, 64),
            remote(&d, 0, 64),
            None
        )
        .is_err(),
        "posts to a dropped endpoint fail at once"
    );
}

#[test]
fn posts_check_the_source_every_time() {
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let (_, s) = region(&mut a, 4096, Access::NONE);
    let (_, d) = region(&mut b, 4096, Access::REMOTE_WRITE);
    write(&mut a, peer, 1, local(&s, 0, 64), remote(&d, 0, 64), None);
    let oob = a.post_write(
        peer,
        WorkRequestId(2),
        local(&s, 4090, 8),
        remote(&d, 0, 8),
        None,
    );
    assert!(oob.is_err(), "local range beyond the region");
    a.deregister(s.local).unwrap();
    let gone = a.post_write(
        peer,
        WorkRequestId(3),
        local(&s, 0, 64),
        remote(&d, 0, 64),
        None,
    );
    assert!(gone.is_err(), "deregistered source");
    let (_, s2) = region(&mut a, 4096, Access::NONE);
    write(&mut a, peer, 4, local(&s2, 0, 64), remote(&d, 0, 64), None);
    let done = poll(&mut a);
    let ids: Vec<u64> = done.iter().map(|c| c.wr_id.0).collect();
    assert_eq!(ids, vec![1, 4]);
    assert!(done.iter().all(|c| c.result == Ok(64)));
}

/// Memory the CPU cannot address directly (as a GPU's): copies go through
/// `read_to_host`/`write_from_host`.
struct DeviceLike(std::sync::Mutex<Vec<u8>>);

// SAFETY: `host_ptr` is `None`, so there is no pointer to keep valid; `device_addr` is a
// constant.
unsafe impl fabric_core::MemoryRegion for DeviceLike {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn location(&self) -> fabric_core::MemoryLocation {
        fabric_core::MemoryLocation::Cuda { device: 0 }
    }
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        0x1000
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), fabric_core::MemoryError> {
        let v = self.0.lock().unwrap();
        dst.copy_from_slice(&v[offset as usize..offset as usize + dst.len()]);
        Ok(())
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), fabric_core::MemoryError> {
        let mut v = self.0.lock().unwrap();
        v[offset as usize..offset as usize + src.len()].copy_from_slice(src);
        Ok(())
    }
}

#[test]
fn writes_between_host_and_device_like_memory_land() {
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let (src, s) = region(&mut a, 4096, Access::NONE);
    src.write(0, &pattern(4096)).unwrap();
    let dev = Arc::new(DeviceLike(std::sync::Mutex::new(vec![0; 4096])));
    let d = b.register(dev.clone(), Access::REMOTE_WRITE).unwrap();
    let (host_dst, h) = region(&mut b, 4096, Access::REMOTE_WRITE);
    write(
        &mut a,
        peer,
        1,
        local(&s, 0, 1000),
        remote(&d, 96, 1000),
        None,
    );
    write(
        &mut a,
        peer,
        2,
        local(&s, 0, 64),
        remote(&d, 4090, 64),
        None,
    );
    write(&mut a, peer, 3, local(&s, 8, 500), remote(&h, 0, 500), None);
    let done = poll(&mut a);
    assert_eq!(done[0].result, Ok(1000));
    assert!(matches!(done[1].result, Err(OpError::OutOfBounds { .. })));
    assert_eq!(done[2].result, Ok(500));
    assert_eq!(dev.0.lock().unwrap()[96..1096], pattern(4096)[..1000]);
    assert_eq!(host_dst.to_vec(0, 500).unwrap(), pattern(4096)[8..508]);
}

/// The target's wake-up for a write's immediate data is left for the initiator's next
/// `poll` (or `wait`), after the initiator has its own completion; it still comes: a target
/// asleep in `wait` is woken by it.
#[test]
fn a_sleeping_target_is_woken_by_the_initiators_next_poll() {
    use std::time::{Duration, Instant};
    let (mut a, mut b) = (MemTransport::new(), MemTransport::new());
    let peer = a.add_peer(&b.address()).unwrap();
    let (_src, s) = region(&mut a, 4096, Access::NONE);
    let (_dst, d) = region(&mut b, 4096, Access::REMOTE_WRITE);
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let (woke_tx, woke) = std::sync::mpsc::channel();
    let target = std::thread::spawn(move || {
        ready_tx.send(()).unwrap();
        let t0 = Instant::now();
        b.wait(Duration::from_secs(60)).unwrap();
        woke_tx.send(t0.elapsed()).unwrap();
        poll(&mut b)
    });
    ready.recv().unwrap();
    write(
        &mut a,
        peer,
        1,
        local(&s, 0, 4096),
        remote(&d, 0, 4096),
        Some(9),
    );
    let done = poll(&mut a);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result, Ok(4096));
    // Nothing more to do: this poll only hands out the wake-up.
    assert!(poll(&mut a).is_empty());
    let took = woke
        .recv_timeout(Duration::from_secs(30))
        .expect("the target woke long before its 60 s wait ended");
    assert!(took < Duration::from_secs(30), "{took:?}");
    let events = target.join().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].op, OpKind::RemoteWrite);
    assert_eq!(events[0].imm, Some(9));
}
