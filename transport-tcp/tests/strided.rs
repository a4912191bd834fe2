//! Strided WRITEs over tcp: rows that land back to back go as one gathered WRITE, rows at
//! a stride on both sides as a WRITE each of which only the last completes the write (with
//! the immediate data, after every row) and reports any row's failure.

mod common;

use common::{Deadline, Node};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{Access, OpError, OpKind, PostOutcome, Rows, Transport, WorkRequestId};
use transport_tcp::TcpConfig;

fn step(a: &mut Node, b: &mut Node) {
    a.step();
    b.step();
}

#[test]
fn rows_at_a_stride_on_both_sides_land_and_complete_once_with_their_imm() {
    let (mut a, mut b) = (
        Node::new(TcpConfig::default()),
        Node::new(TcpConfig::default()),
    );
    let src = Canaried::new(&mut a.t, 1 << 20, Access::NONE, 0);
    let data = pattern(5, 1 << 20);
    src.write(0, &data);
    let dst = Canaried::new(&mut b.t, 1 << 20, Access::REMOTE_WRITE, 0);
    let peer = a.t.add_peer(&b.t.address()).unwrap();
    // 50 rows of 512 bytes, every 4 KiB of the source into every 2 KiB of the target.
    let (len, count) = (512u64, 50u64);
    let rows = Rows {
        count,
        src_stride: 4096,
        dst_stride: 2048,
    };
    let wr = WorkRequestId(7);
    let r =
        a.t.post_write_rows(
            peer,
            wr,
            src.local(100, len),
            dst.remote(300, len),
            rows,
            Some(9),
        )
        .unwrap();
    assert_eq!(r, PostOutcome::Posted);
    let d = Deadline::new("the strided write");
    while !a.done.iter().any(|c| c.wr_id == wr) {
        step(&mut a, &mut b);
        d.check();
    }
    let mine: Vec<_> = a.done.iter().filter(|c| c.wr_id == wr).collect();
    assert_eq!(
        mine.len(),
        1,
        "one completion for the whole write: {mine:?}"
    );
    assert_eq!(
        (mine[0].op, &mine[0].result),
        (OpKind::Write, &Ok(len * count))
    );
    let d = Deadline::new("the target's completion");
    while b.remote_writes().is_empty() {
        step(&mut a, &mut b);
        d.check();
    }
    assert_eq!(
        b.remote_writes().len(),
        1,
        "the imm comes once, with the last row"
    );
    assert_eq!(b.remote_writes()[0].imm, Some(9));
    let got = dst.read(0, 1 << 20);
    for i in 0..count as usize {
        let (s, t) = (100 + i * 4096, 300 + i * 2048);
        assert_eq!(got[t..t + 512], data[s..s + 512], "row {i}");
        assert!(
            got[t + 512..t + 2048].iter().all(|&x| x == 0),
            "between rows {i}"
        );
    }
    dst.assert_canaries();
}

#[test]
fn a_row_the_target_refuses_fails_the_whole_write_once() {
    let (mut a, mut b) = (
        Node::new(TcpConfig::default()),
        Node::new(TcpConfig::default()),
    );
    let src = Canaried::new(&mut a.t, 1 << 20, Access::NONE, 0);
    let dst = Canaried::new(&mut b.t, 1 << 20, Access::REMOTE_WRITE, 0);
    let peer = a.t.add_peer(&b.t.address()).unwrap();
    // A descriptor that claims twice the region: the rows past the real end are refused by
    // the target, and the write reports it once, at its end.
    let mut lying = dst.remote(0, 1024);
    lying.region.len *= 2;
    let rows = Rows {
        count: 8,
        src_stride: 1024,
        dst_stride: 256 << 10,
    };
    let wr = WorkRequestId(8);
    let r =
        a.t.post_write_rows(peer, wr, src.local(0, 1024), lying, rows, None)
            .unwrap();
    assert_eq!(r, PostOutcome::Posted);
    let d = Deadline::new("the refused write");
    while !a.done.iter().any(|c| c.wr_id == wr) {
        step(&mut a, &mut b);
        d.check();
    }
    let mine: Vec<_> = a.done.iter().filter(|c| c.wr_id == wr).collect();
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert!(
        matches!(mine[0].result, Err(OpError::OutOfBounds { .. })),
        "{:?}",
        mine[0].result
    );
    // The next write on the connection is not blamed for it.
    let ok = WorkRequestId(9);
    let r =
        a.t.post_write(peer, ok, src.local(0, 64), dst.remote(0, 64), None);
    assert_eq!(r.unwrap(), PostOutcome::Posted);
    let d = Deadline::new("the next write");
    while !a.done.iter().any(|c| c.wr_id == ok) {
        step(&mut a, &mut b);
        d.check();
    }
    let next = a.done.iter().find(|c| c.wr_id == ok).unwrap();
    assert_eq!(next.result, Ok(64));
    dst.assert_canaries();
}
