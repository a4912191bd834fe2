//! Transfers that wait for the application's own work (a [`Fence`]): nothing of them moves
//! until the fence reports done, a failed fence fails the transfer with nothing moved, and
//! a deadline still holds. Over the in-memory transport, with a fence the test opens by
//! hand where a real one is a CUDA event.

use fabric_core::engine::{
    Engine, EngineConfig, GroupTransfer, RailGroup, Transfer, TransferHandle,
};
use fabric_core::mem::MemTransport;
use fabric_core::plan::Segment;
use fabric_core::testing::eventually;
use fabric_core::{Access, Error, Fence, HostBuffer, MemoryError, OpError};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
const LEN: usize = 1 << 20;

/// A fence the test opens (or breaks), counting how often the engine asked it.
#[derive(Debug, Default)]
struct Gate {
    open: AtomicBool,
    broken: AtomicBool,
    asked: AtomicU64,
}

impl Fence for Gate {
    fn is_done(&self) -> Result<bool, MemoryError> {
        self.asked.fetch_add(1, Ordering::Relaxed);
        if self.broken.load(Ordering::Acquire) {
            return Err(MemoryError::device(
                "illegal address in the producing kernel",
            ));
        }
        Ok(self.open.load(Ordering::Acquire))
    }
}

impl Gate {
    /// Waits until the engine has asked at least twice: it holds the transfer and keeps
    /// looking (an engine that ignores fences never asks).
    fn wait_held(&self) {
        eventually("the engine to ask the fence again", T, || {
            self.asked.load(Ordering::Relaxed) >= 2
        });
    }
}

struct Ends {
    a: Engine,
    b: Engine,
    src: Arc<HostBuffer>,
    dst: Arc<HostBuffer>,
    seg: Segment,
    peer: fabric_core::PeerId,
}

fn ends() -> Ends {
    let a = Engine::spawn(|| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let b = Engine::spawn(|| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let src = HostBuffer::new_shared(LEN).unwrap();
    src.fill(0, LEN as u64, 1).unwrap();
    let dst = HostBuffer::new_shared(LEN).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let seg = Segment {
        src: s.local,
        src_offset: 0,
        dst: d.remote,
        dst_offset: 0,
        len: LEN as u64,
    };
    Ends {
        a,
        b,
        src,
        dst,
        seg,
        peer,
    }
}

/// Submits a transfer of the whole source behind `gate`, with immediate data 5.
fn submit_behind(e: &Ends, gate: &Arc<Gate>) -> TransferHandle {
    let t = Transfer::new(e.peer)
        .segment(e.seg)
        .imm(5)
        .after(gate.clone());
    e.a.submit(t).unwrap()
}

#[test]
fn a_fenced_transfer_moves_the_bytes_written_before_its_fence_opens() {
    let e = ends();
    let gate = Arc::new(Gate::default());
    let h = submit_behind(&e, &gate);
    gate.wait_held();
    assert!(!h.is_finished(), "held while the fence is closed");
    // The "kernel" writes the source after submit, before its work is done.
    e.src.fill(0, LEN as u64, 7).unwrap();
    gate.open.store(true, Ordering::Release);
    assert_eq!(h.wait(T).unwrap().bytes, LEN as u64);
    assert_eq!(e.b.next_event(T).unwrap().imm(), Some(5));
    assert!(
        e.dst.to_vec(0, LEN).unwrap().iter().all(|&b| b == 7),
        "the target holds what the work wrote, not what was there at submit"
    );
}

#[test]
fn a_failed_fence_fails_the_transfer_and_moves_nothing() {
    let e = ends();
    let gate = Arc::new(Gate::default());
    let h = submit_behind(&e, &gate);
    gate.wait_held();
    gate.broken.store(true, Ordering::Release);
    let err = h.wait(T).unwrap_err();
    let Error::Op(OpError::Transport(cause)) = &err else {
        panic!("a transport error with the fence's cause, got {err:?}");
    };
    let report = fabric_core::error::report(&err);
    assert!(report.contains("fence"), "{report}");
    assert!(report.contains("illegal address"), "{report}");
    assert!(
        cause.to_string().contains("fence"),
        "the cause names the fence: {cause}"
    );
    assert!(
        e.dst.to_vec(0, LEN).unwrap().iter().all(|&b| b == 0),
        "nothing moved"
    );
    assert!(
        e.b.next_event(Duration::from_millis(50)).is_err(),
        "no immediate data for a failed transfer"
    );
}

#[test]
fn a_fenced_transfer_still_times_out_and_moves_nothing() {
    let e = ends();
    let gate = Arc::new(Gate::default());
    let t = Transfer::new(e.peer)
        .segment(e.seg)
        .after(gate.clone())
        .timeout(Duration::from_millis(20));
    let err = e.a.submit(t).unwrap().wait(T).unwrap_err();
    assert!(
        matches!(err, Error::Op(OpError::TimedOut)),
        "timed out, got {err:?}"
    );
    // Opening the fence afterwards starts nothing.
    gate.open.store(true, Ordering::Release);
    let later = Transfer::new(e.peer).segment(Segment { len: 4096, ..e.seg });
    e.a.submit(later).unwrap().wait(T).unwrap();
    assert!(
        e.dst
            .to_vec(4096, LEN - 4096)
            .unwrap()
            .iter()
            .all(|&b| b == 0),
        "the timed-out transfer moved nothing"
    );
}

#[test]
fn every_rail_of_a_group_waits_for_the_fence() {
    let a = RailGroup::spawn(4, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let b = RailGroup::spawn(2, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let len = 8 << 20;
    let src = HostBuffer::new_shared(len).unwrap();
    src.fill(0, len as u64, 1).unwrap();
    let dst = HostBuffer::new_shared(len).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    let pages: Vec<u64> = (0..(len as u64 / 65536)).collect();
    let gate = Arc::new(Gate::default());
    let mut t = GroupTransfer::same_pages(s, d.remote, &pages, 65536).after(gate.clone());
    t.imm = Some(9);
    let h = a.submit(&peer, t).unwrap();
    gate.wait_held();
    src.fill(0, len as u64, 3).unwrap();
    gate.open.store(true, Ordering::Release);
    assert_eq!(h.wait(T).unwrap().bytes, len as u64);
    b.wait_imm(9, 1, T).unwrap();
    assert!(
        dst.to_vec(0, len).unwrap().iter().all(|&v| v == 3),
        "every chunk, on every rail, moved what the work wrote"
    );
}

#[test]
fn a_group_refuses_the_reserved_immediate_value() {
    let a = RailGroup::spawn(1, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let b = RailGroup::spawn(1, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let src = HostBuffer::new_shared(4096).unwrap();
    let dst = HostBuffer::new_shared(4096).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst, Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    let mut t = GroupTransfer::same_pages(s, d.remote, &[0], 4096);
    t.imm = Some(fabric_core::engine::WARM_UP_IMM);
    let Err(err) = a.submit(&peer, t) else {
        panic!("a transfer with the warm-up's immediate value was accepted");
    };
    assert!(
        matches!(err, Error::ReservedImm(v) if v == u32::MAX),
        "refused as reserved, got {err:?}"
    );
    assert!(err.to_string().contains("reserved"), "{err}");
}
