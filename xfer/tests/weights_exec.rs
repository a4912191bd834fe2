//! Weight sync executed over agents of one process (the `mem` transport): random layouts
//! pushed and pulled, every destination region compared byte for byte with slicing the full
//! tensors; a failed destination failing alone and redone; the prepare hook; joiners planned
//! in without re-planning the others.

mod common;

use common::layouts::{Case, buffers, build, cases};
use proptest::prelude::*;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use xfer::weights::exec::{Destination, Source, SourceInfo, SyncError, SyncOptions};
use xfer::weights::{Holding, Layout, Plan, Side, TensorSpec, check};
use xfer::{
    Access, Agent, AgentOptions, Fence, HostBuffer, Peer, Region, TransportChoice, TransportKind,
};

const T: Duration = Duration::from_secs(20);

fn mem_agent() -> Agent {
    agent_of(TransportKind::Mem)
}

/// An agent of one transport, one rail.
fn agent_of(kind: TransportKind) -> Agent {
    Agent::new(AgentOptions {
        transport: TransportChoice::Only(kind),
        rails: Some(1),
        ..AgentOptions::default()
    })
    .expect("an agent")
}

/// Agents made once for every case (8 sources, 8 destinations) and their peers both ways:
/// a case registers its own regions and syncs.
struct Pool {
    src: Vec<Agent>,
    dst: Vec<Agent>,
    /// `to_dst[s][d]`: destination `d` as a peer of source `s`.
    to_dst: Vec<Vec<Peer>>,
    /// `to_src[d][s]`: source `s` as a peer of destination `d`.
    to_src: Vec<Vec<Peer>>,
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let src: Vec<Agent> = (0..8).map(|_| mem_agent()).collect();
        let dst: Vec<Agent> = (0..8).map(|_| mem_agent()).collect();
        let to_dst = (src.iter())
            .map(|s| dst.iter().map(|d| s.connect(d.info()).unwrap()).collect())
            .collect();
        let to_src = (dst.iter())
            .map(|d| src.iter().map(|s| d.connect(s.info()).unwrap()).collect())
            .collect();
        Mutex::new(Pool {
            src,
            dst,
            to_dst,
            to_src,
        })
    })
}

/// A version no earlier case used (destinations' agents are shared).
fn fresh_version() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Registers a host buffer per region of `l` on `agent`, filled with `bytes`.
fn register(
    agent: &Agent,
    l: &Layout,
    bytes: &[Vec<u8>],
    access: Access,
) -> (Vec<Region>, Vec<Arc<HostBuffer>>) {
    let mut regions = Vec::new();
    let mut bufs = Vec::new();
    for (spec, b) in l.regions.iter().zip(bytes) {
        let buf = HostBuffer::new_shared((spec.len as usize).max(1)).unwrap();
        buf.write(0, b).unwrap();
        regions.push(agent.register(buf.clone(), access).unwrap());
        bufs.push(buf);
    }
    (regions, bufs)
}

/// Every region of every destination as it should be (the pattern at each piece, 0xEE
/// around) and as it is.
fn assert_landed(dst: &[Layout], bufs: &[Vec<Arc<HostBuffer>>], what: &str) {
    let want = buffers(dst, true);
    for (d, (w, got)) in want.iter().zip(bufs).enumerate() {
        for (r, (w, b)) in w.iter().zip(got).enumerate() {
            let have = b.to_vec(0, w.len()).unwrap();
            if let Some(i) = (0..w.len()).find(|&i| have[i] != w[i]) {
                panic!(
                    "{what}: destination {d} region {r} byte {i} is {:#x}, want {:#x}",
                    have[i], w[i]
                );
            }
        }
    }
}

/// One random case over the pool: every destination by push, then again (cleared) by pull.
fn push_then_pull(c: &Case, opts: SyncOptions) {
    let (_, src, dst) = build(c);
    let plan = Plan::new(&src, &dst).expect("sources cover every tensor");
    check(&src, &dst, &plan).unwrap();
    let pool = pool().lock().unwrap_or_else(|p| p.into_inner());
    let src_bytes = buffers(&src, true);
    let blank = buffers(&dst, false);
    let mut senders = Vec::new();
    let mut src_regions = Vec::new();
    for (s, l) in src.iter().enumerate() {
        let (regions, _bufs) = register(&pool.src[s], l, &src_bytes[s], Access::REMOTE_READ);
        src_regions.push(regions.clone());
        let sync = Source::new(&pool.src[s], &plan, s as u32, l.clone(), regions)
            .unwrap()
            .with_options(opts.clone());
        senders.push(sync);
    }
    let mut receivers = Vec::new();
    let mut dst_bufs = Vec::new();
    for (d, l) in dst.iter().enumerate() {
        let access = Access::REMOTE_WRITE | Access::LOCAL_WRITE;
        let (regions, bufs) = register(&pool.dst[d], l, &blank[d], access);
        dst_bufs.push(bufs);
        let r = Destination::new(
            &pool.dst[d],
            l.clone(),
            regions,
            src.len() as u32,
            Some(d as u32),
        )
        .unwrap()
        .with_options(opts.clone());
        for s in &mut senders {
            let to = pool.to_dst[s.rank() as usize][d].clone();
            s.attach(d as u32, to, r.descriptors()).unwrap();
        }
        receivers.push(r);
    }
    // Push, every source in a thread of its own.
    let v = fresh_version();
    let n = dst.len();
    std::thread::scope(|scope| {
        for s in &senders {
            scope.spawn(move || {
                let report = s.push(v).unwrap();
                assert!(report.is_ok(), "{report:?}");
                assert_eq!(report.destinations.len(), n);
                // Waiting for completions is part of the push's time, never more.
                assert!(report.waited <= report.elapsed, "{report:?}");
            });
        }
    });
    for r in &receivers {
        r.wait(v, T).unwrap();
    }
    assert_landed(&dst, &dst_bufs, "push");
    // Pull into cleared regions.
    for (bufs, blank) in dst_bufs.iter().zip(&blank) {
        for (b, x) in bufs.iter().zip(blank) {
            b.write(0, x).unwrap();
        }
    }
    for (d, r) in receivers.iter_mut().enumerate() {
        for (s, l) in src.iter().enumerate() {
            let info = SourceInfo {
                peer: pool.to_src[d][s].clone(),
                layout: l.clone(),
                regions: src_regions[s]
                    .iter()
                    .map(|r| r.descriptor().clone())
                    .collect(),
                record: senders[s].record().descriptor().clone(),
            };
            r.attach_source(s as u32, info).unwrap();
        }
        let report = r.pull(Some(v), T).unwrap();
        assert_eq!(report.version, v);
    }
    assert_landed(&dst, &dst_bufs, "pull");
    drop(receivers);
    drop(senders);
    for (s, regions) in src_regions.iter().enumerate() {
        for r in regions {
            pool.src[s].deregister(r).unwrap();
        }
    }
}

fn options() -> impl Strategy<Value = SyncOptions> {
    (1u64..64, 1usize..8, 1u64..256, 1usize..6).prop_map(|(chunk, segs, bytes, n)| {
        SyncOptions::default()
            .chunk_bytes(chunk)
            .chunk_segments(segs)
            .max_inflight_bytes(bytes)
            .max_inflight_transfers(n)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Random layouts (tensor-parallel boxes, flat shards, replicas; 1 to 8 sources and
    /// destinations) pushed in small chunks with few in flight, then pulled: every
    /// destination region ends as slicing the full tensors would make it.
    #[test]
    fn pushes_and_pulls_land_every_destination_byte(c in cases(), opts in options()) {
        push_then_pull(&c, opts);
    }
}

/// Two sources, row halves of a 8 x 16 tensor of 4-byte elements (`t0`) and a bias (`t1`)
/// each; destinations hold column halves and bias halves.
fn small() -> (Vec<Layout>, Vec<Layout>) {
    let shape = vec![8u64, 16];
    let t: Arc<[TensorSpec]> = Arc::from(vec![
        TensorSpec::new("t0", shape.clone(), 4),
        TensorSpec::new("t1", vec![16], 4),
    ]);
    let src = (0..2)
        .map(|i| {
            Layout::pack(
                t.clone(),
                "s",
                [
                    (0, Holding::split(&shape, 0, 2, i).unwrap()),
                    (1, Holding::whole(&[16])),
                ],
            )
            .unwrap()
        })
        .collect();
    let dst = (0..2)
        .map(|i| {
            Layout::pack(
                t.clone(),
                "d",
                [
                    (0, Holding::split(&shape, 1, 2, i).unwrap()),
                    (1, Holding::split(&[16], 0, 2, i).unwrap()),
                ],
            )
            .unwrap()
        })
        .collect();
    (src, dst)
}

/// Sources and destinations of `small()` on fresh agents, attached.
struct Small {
    src: Vec<Layout>,
    dst: Vec<Layout>,
    senders: Vec<Source>,
    receivers: Vec<Destination>,
    src_bufs: Vec<Vec<Arc<HostBuffer>>>,
    dst_bufs: Vec<Vec<Arc<HostBuffer>>>,
}

fn small_sync(opts: SyncOptions, fill_sources: bool) -> Small {
    small_sync_on(TransportKind::Mem, opts, fill_sources)
}

/// [`small_sync`] over agents of transport `kind`.
fn small_sync_on(kind: TransportKind, opts: SyncOptions, fill_sources: bool) -> Small {
    let (src, dst) = small();
    let plan = Plan::new(&src, &dst).unwrap();
    let src_bytes = buffers(&src, fill_sources);
    let blank = buffers(&dst, false);
    let mut senders = Vec::new();
    let mut src_bufs = Vec::new();
    for (s, l) in src.iter().enumerate() {
        let a = agent_of(kind);
        let (regions, bufs) = register(&a, l, &src_bytes[s], Access::REMOTE_READ);
        src_bufs.push(bufs);
        let sync = Source::new(&a, &plan, s as u32, l.clone(), regions).unwrap();
        senders.push(sync.with_options(opts.clone()));
    }
    let mut receivers = Vec::new();
    let mut dst_bufs = Vec::new();
    for (d, l) in dst.iter().enumerate() {
        let a = agent_of(kind);
        let access = Access::REMOTE_WRITE | Access::LOCAL_WRITE;
        let (regions, bufs) = register(&a, l, &blank[d], access);
        dst_bufs.push(bufs);
        let r = Destination::new(&a, l.clone(), regions, 2, Some(d as u32)).unwrap();
        for s in &mut senders {
            let peer = s.agent().connect(a.info()).unwrap();
            s.attach(d as u32, peer, r.descriptors()).unwrap();
        }
        receivers.push(r);
    }
    Small {
        src,
        dst,
        senders,
        receivers,
        src_bufs,
        dst_bufs,
    }
}

#[test]
fn a_destination_that_fails_fails_alone_and_is_redone_alone() {
    let opts = SyncOptions::default()
        .chunk_bytes(64)
        .max_inflight_transfers(2);
    let mut s = small_sync(opts, true);
    // Destination 1 is attached with descriptors of a region it no longer has: every
    // transfer to it is refused there, as if its process had gone.
    let good = s.receivers[1].descriptors();
    let a1 = s.receivers[1].agent().clone();
    let gone = a1
        .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let stale = vec![gone.descriptor().clone()];
    a1.deregister(&gone).unwrap();
    let peer = s.senders[0].agent().connect(a1.info()).unwrap();
    s.senders[0].attach(1, peer.clone(), stale).unwrap();
    let v = 41;
    let bad = s.senders[0].push(v).unwrap();
    assert!(bad.destinations[&0].is_ok(), "{bad:?}");
    let e = bad.destinations[&1].as_ref().unwrap_err();
    assert!(
        matches!(
            e,
            SyncError::Transfer {
                side: Some(Side::Destination),
                rank: Some(1),
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(bad.failed(), vec![1]);
    let ok = s.senders[1].push(v).unwrap();
    assert!(ok.is_ok(), "{ok:?}");
    s.receivers[0].wait(v, T).unwrap();
    // Destination 1 heard source 1 only: its wait names source 0.
    let e = s.receivers[1]
        .wait(v, Duration::from_millis(50))
        .unwrap_err();
    assert!(
        matches!(&e, SyncError::NotLanded { missing, .. } if missing == &[0]),
        "{e:?}"
    );
    // Redone alone: source 0 attaches it properly and pushes to it only.
    s.senders[0].attach(1, peer, good).unwrap();
    let redo = s.senders[0].push_to(v, &[1]).unwrap();
    assert_eq!(redo.destinations.keys().copied().collect::<Vec<_>>(), [1]);
    assert!(redo.is_ok(), "{redo:?}");
    s.receivers[1].wait(v, T).unwrap();
    assert_landed(&s.dst, &s.dst_bufs, "after the redo");
    // A rank not attached or not planned fails its own part.
    s.senders[0].detach(0);
    let r = s.senders[0].push_to(v + 1, &[0, 9]).unwrap();
    assert!(matches!(
        r.destinations[&0],
        Err(SyncError::NotAttached { rank: 0, .. })
    ));
    assert!(matches!(
        r.destinations[&9],
        Err(SyncError::NoSuchRank { rank: 9, .. })
    ));
}

#[test]
fn versions_that_cannot_be_signalled_are_refused() {
    let s = small_sync(SyncOptions::default(), true);
    let e = s.senders[0].push(u32::MAX).unwrap_err();
    assert!(matches!(e, SyncError::Version { sources: 2, .. }), "{e:?}");
    assert!(s.senders[0].push((1 << 31) - 1).is_err());
    // The error converts into the crate's.
    let e: xfer::Error = e.into();
    assert!(matches!(
        e,
        xfer::Error::WeightSync(SyncError::Version { .. })
    ));
}

/// A fence done once the hook's work "ran": after a few looks, counted.
#[derive(Debug)]
struct AfterPolls {
    left: AtomicUsize,
    looked: Arc<AtomicUsize>,
}

impl Fence for AfterPolls {
    fn is_done(&self) -> Result<bool, fabric_core::MemoryError> {
        self.looked.fetch_add(1, Ordering::Relaxed);
        Ok(self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_err())
    }
}

#[test]
fn the_prepare_hook_writes_each_piece_before_it_is_sent() {
    // The sources' regions start empty: the hook writes each piece (as a dtype conversion
    // would) and the chunks that read it wait for its fence.
    let opts = SyncOptions::default()
        .chunk_bytes(40)
        .max_inflight_transfers(3);
    let s = small_sync(opts, false);
    let full = buffers(&s.src, true);
    let looked = Arc::new(AtomicUsize::new(0));
    let v = 3;
    for (i, sender) in s.senders.iter().enumerate() {
        let mut seen = Vec::new();
        let bufs = &s.src_bufs[i];
        let report = sender
            .push_with(v, None, |p| {
                seen.push(p.index);
                let spec = &sender.layout().tensors[p.piece.tensor as usize];
                let n =
                    p.piece.holding.elements(spec.shape.len()).unwrap() * u64::from(spec.elem_size);
                let at = p.piece.offset as usize;
                let region = p.piece.region as usize;
                bufs[region]
                    .write(p.piece.offset, &full[i][region][at..at + n as usize])
                    .unwrap();
                Ok(Some(Arc::new(AfterPolls {
                    left: AtomicUsize::new(2),
                    looked: looked.clone(),
                })))
            })
            .unwrap();
        assert!(report.is_ok(), "{report:?}");
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1], "each piece prepared once");
    }
    for r in &s.receivers {
        r.wait(v, T).unwrap();
    }
    assert_landed(&s.dst, &s.dst_bufs, "prepared pieces");
    assert!(looked.load(Ordering::Relaxed) > 0, "the fences were asked");
    // A hook that fails fails the destinations that need its piece, with its error.
    let r = s.senders[0]
        .push_with(v + 1, None, |p| {
            if p.index == 1 {
                Err("no such dtype".into())
            } else {
                Ok(None)
            }
        })
        .unwrap();
    let bias_at = s.senders[0].layout().pieces[1].offset;
    let mut failed = 0;
    for d in [0, 1] {
        let needs = (s.senders[0].pairs_to(d).unwrap().iter())
            .any(|p| p.segments().any(|seg| seg.src_offset >= bias_at));
        match &r.destinations[&d] {
            Err(SyncError::Prepare {
                piece: 1, tensor, ..
            }) if needs && tensor == "t1" => failed += 1,
            Ok(_) if !needs => {}
            other => panic!("destination {d} (needs the piece: {needs}): {other:?}"),
        }
    }
    assert!(failed > 0, "some destination needs the bias from source 0");
}

#[test]
fn a_joiner_is_planned_in_without_replanning_the_others_and_a_leaver_dropped() {
    let (src, dst) = small();
    let mut plan = Plan::new(&src, &dst).unwrap();
    let before = plan.pairs().to_vec();
    // The joiner holds the whole weight as one flat range and the bias whole.
    let t = src[0].tensors.clone();
    let joiner = Layout::pack(
        t,
        "j",
        [(0, Holding::Flat(0..128)), (1, Holding::whole(&[16]))],
    )
    .unwrap();
    let rank = plan.add_destination(&src, &joiner).unwrap();
    assert_eq!(rank, 2);
    let kept: Vec<_> = (plan.pairs().iter())
        .filter(|p| p.dst.rank < 2)
        .cloned()
        .collect();
    assert_eq!(kept, before, "the others' pairs are untouched");
    let mut all = dst.clone();
    all.push(joiner.clone());
    check(&src, &all, &plan).unwrap();
    // A source plans it in the same way from the layouts alone.
    let mut s = small_sync(SyncOptions::default(), true);
    let r = s.senders[0].add_destination(&src, &joiner).unwrap();
    assert_eq!(r, 2);
    let mine: Vec<_> = plan
        .pairs_from(0)
        .iter()
        .filter(|p| p.dst.rank == 2)
        .cloned()
        .collect();
    assert_eq!(s.senders[0].pairs_to(2).unwrap(), &mine[..]);
    s.senders[1].add_destination(&src, &joiner).unwrap();
    let a = mem_agent();
    let access = Access::REMOTE_WRITE | Access::LOCAL_WRITE;
    let (regions, bufs) = register(
        &a,
        &joiner,
        &buffers(std::slice::from_ref(&joiner), false)[0],
        access,
    );
    let j = Destination::new(&a, joiner.clone(), regions, 2, None).unwrap();
    for sender in &mut s.senders {
        let peer = sender.agent().connect(a.info()).unwrap();
        sender.attach(2, peer, j.descriptors()).unwrap();
    }
    for sender in &s.senders {
        assert!(sender.push(9).unwrap().is_ok());
    }
    j.wait(9, T).unwrap();
    for r in &s.receivers {
        r.wait(9, T).unwrap();
    }
    assert_landed(std::slice::from_ref(&joiner), &[bufs], "joiner");
    assert_landed(&s.dst, &s.dst_bufs, "the others");
    // It leaves: dropped, and the next push goes to the others only.
    for sender in &mut s.senders {
        assert!(sender.remove_destination(2).is_some());
        assert_eq!(sender.destinations(), vec![0, 1]);
    }
    let r = s.senders[0].push(10).unwrap();
    assert_eq!(r.destinations.keys().copied().collect::<Vec<_>>(), [0, 1]);
    assert!(plan.remove_destination(2));
    assert_eq!(plan.pairs(), &before[..]);
}

/// The port of an agent's first tcp rail (`tcp://127.0.0.1:PORT`).
fn tcp_port(a: &Agent) -> u16 {
    let rail = &a.info().transport(TransportKind::Tcp).unwrap().rails[0];
    let rail = std::str::from_utf8(rail).unwrap();
    rail.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn a_destination_whose_connection_broke_is_redone_over_a_new_one_without_a_call() {
    let mut s = small_sync_on(TransportKind::Tcp, SyncOptions::default(), true);
    let r = s.senders[0].push(11).unwrap();
    assert!(r.is_ok(), "{r:?}");
    assert!(s.senders[1].push(11).unwrap().is_ok());
    for d in &mut s.receivers {
        d.wait(11, T).unwrap();
    }
    // The connections to destination 1 are cut under both ends (its process lives on).
    let port = tcp_port(s.receivers[1].agent());
    if !common::kill_loopback_connections_to(port) {
        assert!(
            std::env::var("CI").is_err(),
            "CI runs as root: connections can be killed there"
        );
        eprintln!("skipped: killing a connection needs root (ss -K)");
        return;
    }
    // Both sources' connections to it (both in this process) are gone: each fails it
    // alone, and the other destination lands.
    for sender in &s.senders {
        let r = sender.push(12).unwrap();
        assert_eq!(r.failed(), vec![1], "{r:?}");
        let e = r.destinations[&1].as_ref().unwrap_err();
        assert!(
            matches!(
                e.op_error(),
                Some(fabric_core::OpError::PeerUnreachable { .. })
            ),
            "{e:?}"
        );
    }
    s.receivers[0].wait(12, T).unwrap();
    // Redone alone: each agent connects again by itself (same rails, same token).
    for sender in &s.senders {
        assert!(sender.push_to(12, &[1]).unwrap().is_ok());
    }
    s.receivers[1].wait(12, T).unwrap();
    assert_landed(&s.dst, &s.dst_bufs, "after the connection came back");
    for sender in &s.senders {
        let m = sender.agent().metrics();
        assert!(m.contains("xfer_reconnects_total 1"), "{m}");
    }
}

/// Trace output of this thread, collected for a test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_push_traces_each_chunk_it_submits_and_each_that_lands() {
    let opts = SyncOptions::default()
        .chunk_bytes(64)
        .max_inflight_transfers(2);
    let s = small_sync(opts, true);
    let out = Captured::default();
    let w = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("xfer::weights::timeline=trace")
        .with_ansi(false)
        .with_writer(move || w.clone())
        .finish();
    let v = fresh_version();
    let report = tracing::subscriber::with_default(subscriber, || s.senders[0].push(v)).unwrap();
    assert!(report.is_ok(), "{report:?}");
    let transfers: u64 = (report.destinations.values())
        .map(|r| r.as_ref().unwrap().transfers)
        .sum();
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let count = |what: &str| {
        text.lines()
            .filter(|l| l.contains("xfer::weights::timeline") && l.contains(what))
            .count() as u64
    };
    // Chunks of 64 bytes: several per destination, each traced once each way; `transfers`
    // counts the signal to each destination too, which lands with no bytes.
    assert!(transfers > 4, "{report:?}");
    assert_eq!(count(": chunk"), transfers - 2, "{text}");
    assert_eq!(count(": landed"), transfers, "{text}");
    assert_eq!(count(" bytes=0 "), 2, "{text}");
}
