//! The engine over cuda-ipc (loopback link: host memory, no GPU) turns a tensor-parallel
//! piece's rows, one segment each, into strided writes, and both a single engine and a
//! rail group land every row.

use fabric_core::engine::{Engine, EngineConfig, GroupTransfer, RailGroup, Transfer};
use fabric_core::plan::Segment;
use fabric_core::{Access, HostBuffer};
use std::time::Duration;
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, LoopbackLink};

const T: Duration = Duration::from_secs(20);
const ROWS: u64 = 3000;
const ROW: u64 = 1536;
const SRC_STRIDE: u64 = 4096;

fn ipc() -> fabric_core::Result<CudaIpcTransport<LoopbackLink>> {
    CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default())
}

fn data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + (i >> 11)) as u8).collect()
}

/// What the destination holds once the rows landed: row `i` of the source (at
/// `128 + i * SRC_STRIDE`) packed at `i * ROW`.
fn expected(src: &[u8], dst_len: usize) -> Vec<u8> {
    let mut want = vec![0u8; dst_len];
    for i in 0..ROWS as usize {
        let from = 128 + i * SRC_STRIDE as usize;
        want[i * ROW as usize..(i + 1) * ROW as usize]
            .copy_from_slice(&src[from..from + ROW as usize]);
    }
    want
}

#[test]
fn an_engine_sends_rows_as_strided_writes() {
    let a = Engine::spawn(ipc, EngineConfig::default()).unwrap();
    let b = Engine::spawn(ipc, EngineConfig::default()).unwrap();
    let src_len = (ROWS * SRC_STRIDE + 4096) as usize;
    let dst_len = (ROWS * ROW + 4096) as usize;
    let src = HostBuffer::new_shared(src_len).unwrap();
    let bytes = data(src_len);
    src.write(0, &bytes).unwrap();
    let dst = HostBuffer::new_shared(dst_len).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let mut t = Transfer::new(peer).timeout(T);
    t.segments = (0..ROWS)
        .map(|i| Segment {
            src: s.local,
            src_offset: 128 + i * SRC_STRIDE,
            dst: d.remote,
            dst_offset: i * ROW,
            len: ROW,
        })
        .collect();
    t.imm = Some(9);
    let stats = a.submit(t).unwrap().wait(T).unwrap();
    assert_eq!(stats.bytes, ROWS * ROW);
    // 4.6 MB of rows in one strided write (the transport's largest is 1 GiB), and the
    // immediate data on it: far fewer operations than rows.
    assert!(stats.ops <= 2, "{} operations for {ROWS} rows", stats.ops);
    assert_eq!(b.next_event(T).unwrap().imm(), Some(9));
    assert!(dst.to_vec(0, dst_len).unwrap() == expected(&bytes, dst_len));
}

#[test]
fn a_rail_group_sends_rows_as_strided_writes_on_every_rail() {
    let cfg = EngineConfig::default();
    let a = RailGroup::spawn(3, |_| ipc(), cfg.clone()).unwrap();
    let b = RailGroup::spawn(2, |_| ipc(), cfg).unwrap();
    let src_len = (ROWS * SRC_STRIDE + 4096) as usize;
    let dst_len = (ROWS * ROW + 4096) as usize;
    let src = HostBuffer::new_shared(src_len).unwrap();
    let bytes = data(src_len);
    src.write(0, &bytes).unwrap();
    let dst = HostBuffer::new_shared(dst_len).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    let t = GroupTransfer {
        src: s,
        dst: d.remote,
        segments: (0..ROWS)
            .map(|i| (128 + i * SRC_STRIDE, i * ROW, ROW))
            .collect(),
        runs: Vec::new(),
        imm: Some(4),
        message: None,
        timeout: Some(T),
        direction: Default::default(),
        after: None,
    };
    let stats = a.submit(&peer, t).unwrap().wait(T).unwrap();
    assert_eq!(stats.bytes, ROWS * ROW);
    // Chunks of at most 1 MiB, each a strided write or a few: not one operation per row.
    assert!(
        stats.ops < ROWS / 50,
        "{} operations for {ROWS} rows",
        stats.ops
    );
    b.wait_imm(4, 1, T).unwrap();
    assert!(dst.to_vec(0, dst_len).unwrap() == expected(&bytes, dst_len));
    let per_rail = a.rail_counters();
    assert!(
        per_rail.iter().all(|c| c.bytes > 0),
        "every rail carried rows: {per_rail:?}"
    );
}
