//! Shared workloads for the `xfer` benches.
//!
//! The transport benches run the demo workload of `xfer demo`: pages chosen at random from
//! a registered region, written to the same page indices of a peer's region through the
//! [`Engine`], a few transfers in flight at once. The same code drives every backend, so
//! the figures compare backends and nothing else.
//!
//! "Rails" come in two forms: connections inside one transport (`TcpConfig::rails`, one
//! worker thread), measured by [`Pair`]; and a [`RailGroup`] of one engine (worker thread
//! and transport) per rail with transfers sharded over them by bytes, measured by
//! [`GroupPair`]. Both write into the same kind of target, one engine (one worker thread,
//! one transport) that takes every connection, so that the two differ only in the
//! initiator they claim to compare.
//!
//! ```
//! use xfer_benches::{Backend, PageLayout, Pair};
//! let pair = Pair::new(&Backend::Mem, 1 << 20).unwrap();
//! let layout = PageLayout::dense(4096, 1 << 20);
//! let transfers = pair.transfers(&layout, 16, 4, 1);
//! let elapsed = xfer_benches::run(&pair.initiator, &transfers, 8, 2).unwrap();
//! assert!(elapsed.as_nanos() > 0);
//! ```
//!
//! Dependencies: `fastrand` picks the pages (a small, seeded, well-known generator, in place
//! of one written by hand here and again in `xfer-cli`).
#![warn(missing_docs)]

use fabric_core::engine::rails::{
    GroupHandle, GroupPeer, GroupRegistration, GroupTransfer, RailGroup, RemoteDescriptor,
};
use fabric_core::engine::{Engine, EngineConfig, Transfer, TransferHandle};
use fabric_core::mem::MemTransport;
use fabric_core::plan::Segment;
use fabric_core::{Access, HostBuffer, LocalKey, PeerId, RemoteRegion, Result};
use std::collections::VecDeque;

/// The seeded generator that picks pages, so that runs pick the same ones.
pub use fastrand::Rng;
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, LoopbackLink};
use transport_tcp::{TcpConfig, TcpTransport};

/// Size of the source and target regions of the transport benches (the demo uses 1 GiB;
/// 256 MiB keeps two of them comfortable on small CI-like machines).
pub const REGION_SIZE: u64 = 256 << 20;

/// Pages per transfer in the transport benches.
pub const PAGES_PER_TRANSFER: usize = 256;

/// Transfers in flight at once (as `xfer demo --depth`).
pub const DEPTH: usize = 4;

/// A transfer that takes longer than this fails the bench.
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(60);

/// A backend the benches can drive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// [`MemTransport`]: in-process copies, no I/O; measures the engine and a memcpy.
    /// It has no notion of rails.
    Mem,
    /// [`TcpTransport`] on loopback with `rails` connections to the peer.
    Tcp {
        /// Connections per peer.
        rails: usize,
    },
    /// `transport_efa::EfaTransport` (libfabric FI_EP_RDM) with the given provider, on the
    /// loopback domain for the socket providers. One endpoint: one rail.
    #[cfg(feature = "efa")]
    Efa {
        /// The libfabric provider, e.g. `tcp`.
        provider: &'static str,
    },
    /// `transport_cuda_ipc::CudaIpcTransport` over its loopback link: the whole cuda-ipc
    /// protocol (reservations, grants, completions, DONE frames over the control socket)
    /// with host memory copied by the CPU. With small pages it measures what the protocol
    /// costs per page, which a GPU run hides behind nothing else. One transport: one rail.
    CudaIpcLoopback,
}

impl Backend {
    /// A short name for bench ids: `mem`, `tcp`, `efa-tcp`.
    pub fn name(&self) -> String {
        match self {
            Backend::Mem => "mem".into(),
            Backend::Tcp { .. } => "tcp".into(),
            #[cfg(feature = "efa")]
            Backend::Efa { provider } => format!("efa-{provider}"),
            Backend::CudaIpcLoopback => "cuda-ipc-loopback".into(),
        }
    }

    /// Rails the initiator uses.
    pub fn rails(&self) -> usize {
        match self {
            Backend::Tcp { rails } => *rails,
            _ => 1,
        }
    }

    fn engine(&self, rails: usize, name: &str) -> Result<Engine> {
        match self {
            Backend::Mem => Engine::spawn(|| Ok(MemTransport::new()), engine_cfg(name)),
            Backend::Tcp { .. } => {
                let tcp = TcpConfig {
                    rails,
                    ..TcpConfig::default()
                };
                Engine::spawn(move || TcpTransport::new(tcp), engine_cfg(name))
            }
            #[cfg(feature = "efa")]
            Backend::Efa { provider } => {
                let efa = efa_config(provider);
                Engine::spawn(
                    move || transport_efa::EfaTransport::new(&efa),
                    engine_cfg(name),
                )
            }
            Backend::CudaIpcLoopback => Engine::spawn(ipc_loopback, engine_cfg(name)),
        }
    }

    /// `n` rails, each an engine whose transport is this backend with one connection.
    fn group(&self, n: usize, name: &str) -> Result<RailGroup> {
        match self {
            Backend::Mem => RailGroup::spawn(n, |_| Ok(MemTransport::new()), engine_cfg(name)),
            Backend::Tcp { .. } => RailGroup::spawn(
                n,
                |_| TcpTransport::new(TcpConfig::default()),
                engine_cfg(name),
            ),
            #[cfg(feature = "efa")]
            Backend::Efa { provider } => {
                let efa = efa_config(provider);
                RailGroup::spawn(
                    n,
                    move |_| transport_efa::EfaTransport::new(&efa),
                    engine_cfg(name),
                )
            }
            Backend::CudaIpcLoopback => RailGroup::spawn(n, |_| ipc_loopback(), engine_cfg(name)),
        }
    }
}

fn ipc_loopback() -> Result<CudaIpcTransport<LoopbackLink>> {
    CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default())
}

fn engine_cfg(name: &str) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        ..EngineConfig::default()
    }
}

#[cfg(feature = "efa")]
fn efa_config(provider: &str) -> transport_efa::EfaConfig {
    let efa = transport_efa::EfaConfig::with_provider(provider);
    if matches!(provider, "tcp" | "sockets") {
        efa.domain("lo")
    } else {
        efa
    }
}

/// A source region filled with a pattern and a zeroed target region, both touched once so
/// that page faults stay out of the measurement.
fn regions(region_size: u64) -> Result<(Arc<HostBuffer>, Arc<HostBuffer>)> {
    let src = HostBuffer::new_shared(region_size as usize)?;
    src.fill_with(|off, chunk| {
        for (i, b) in chunk.iter_mut().enumerate() {
            *b = (off as usize + i) as u8 ^ 0x5a;
        }
    });
    let dst = HostBuffer::new_shared(region_size as usize)?;
    dst.fill(0, region_size, 0)?;
    Ok((src, dst))
}

/// Two engines of one backend in this process, the initiator connected to the target,
/// with a source region registered on one side and a writable target region on the other.
pub struct Pair {
    /// Posts the writes.
    pub initiator: Engine,
    /// Owns the target region; its worker drives the receiving side.
    pub target: Engine,
    /// The target as a peer of the initiator.
    pub peer: PeerId,
    /// The source region at the initiator.
    pub src: LocalKey,
    /// The target region, as the initiator sees it.
    pub dst: RemoteRegion,
    /// The source bytes (filled with a pattern).
    pub src_buf: Arc<HostBuffer>,
    /// The target bytes.
    pub dst_buf: Arc<HostBuffer>,
}

impl Pair {
    /// Starts both engines, registers `region_size` bytes on each side (touched once, so
    /// that page faults stay out of the measurement) and connects the initiator.
    pub fn new(backend: &Backend, region_size: u64) -> Result<Pair> {
        let initiator = backend.engine(backend.rails(), "bench-initiator")?;
        let target = backend.engine(1, "bench-target")?;
        let (src_buf, dst_buf) = regions(region_size)?;
        let src = initiator.register(src_buf.clone(), Access::NONE)?.local;
        let dst = target
            .register(dst_buf.clone(), Access::REMOTE_WRITE)?
            .remote;
        let peer = initiator.add_peer(&target.address())?;
        Ok(Pair {
            initiator,
            target,
            peer,
            src,
            dst,
            src_buf,
            dst_buf,
        })
    }

    /// `count` transfers of `pages` pages of `layout` each, from the source region to the
    /// same offsets of the target region, pages drawn at random with `seed`.
    pub fn transfers(
        &self,
        layout: &PageLayout,
        pages: usize,
        count: usize,
        seed: u64,
    ) -> Vec<Transfer> {
        let mut rng = Rng::with_seed(seed);
        (0..count)
            .map(|_| {
                let mut t = Transfer::new(self.peer).timeout(TRANSFER_TIMEOUT);
                t.segments = layout.segments(self.src, self.dst, pages, &mut rng);
                t
            })
            .collect()
    }
}

/// A [`RailGroup`] of `rails` engines writing into a target of one engine, as [`Pair`]'s
/// target is: every initiator rail connects to it (`RailGroup::add_peer` pairs local rail
/// `i` with remote rail `i` modulo the remote's rails, here always its only one), so its one
/// worker takes `rails` connections, as it takes the `rails` connections of one TCP
/// transport in [`Pair`]. The source region is registered on every initiator rail, the
/// target region once.
pub struct GroupPair {
    /// Posts the writes, sharded over its rails.
    pub initiator: RailGroup,
    /// Owns the target region: a group of one engine.
    pub target: RailGroup,
    /// The target as a peer of the initiator.
    pub peer: GroupPeer,
    /// The source region, registered on every initiator rail.
    pub src: GroupRegistration,
    /// The target region, as the initiator sees it.
    pub dst: RemoteDescriptor,
    /// The source bytes (filled with a pattern).
    pub src_buf: Arc<HostBuffer>,
    /// The target bytes.
    pub dst_buf: Arc<HostBuffer>,
}

impl GroupPair {
    /// Starts an initiator group of `rails` rails and a target of one, registers
    /// `region_size` bytes on each side and connects every initiator rail to the target.
    pub fn new(backend: &Backend, rails: usize, region_size: u64) -> Result<GroupPair> {
        let initiator = backend.group(rails, "bench-initiator")?;
        let target = backend.group(1, "bench-target")?;
        let (src_buf, dst_buf) = regions(region_size)?;
        let src = initiator.register(src_buf.clone(), Access::NONE)?;
        let dst = target
            .register(dst_buf.clone(), Access::REMOTE_WRITE)?
            .remote;
        let peer = initiator.add_peer(&target.addresses())?;
        Ok(GroupPair {
            initiator,
            target,
            peer,
            src,
            dst,
            src_buf,
            dst_buf,
        })
    }

    /// Rails of the initiator.
    pub fn rails(&self) -> usize {
        self.initiator.rails().len()
    }

    /// As [`Pair::transfers`], for the group.
    pub fn transfers(
        &self,
        layout: &PageLayout,
        pages: usize,
        count: usize,
        seed: u64,
    ) -> Vec<GroupTransfer> {
        let mut rng = Rng::with_seed(seed);
        (0..count)
            .map(|_| GroupTransfer {
                src: self.src.clone(),
                dst: self.dst.clone(),
                segments: layout
                    .pick(pages, &mut rng)
                    .into_iter()
                    .map(|slot| (slot * layout.stride, slot * layout.stride, layout.page_size))
                    .collect(),
                runs: Vec::new(),
                imm: None,
                message: None,
                timeout: Some(TRANSFER_TIMEOUT),
                direction: Default::default(),
                after: None,
            })
            .collect()
    }

    /// As [`run`], through the group.
    pub fn run(&self, transfers: &[GroupTransfer], iters: u64, depth: usize) -> Result<Duration> {
        assert!(!transfers.is_empty(), "no transfers to run");
        let depth = depth.max(1);
        let mut inflight: VecDeque<GroupHandle> = VecDeque::with_capacity(depth);
        let mut next = transfers.iter().cycle();
        let start = Instant::now();
        for _ in 0..iters {
            if inflight.len() == depth
                && let Some(h) = inflight.pop_front()
            {
                h.wait(TRANSFER_TIMEOUT)?;
            }
            let t = next.next().expect("cycle of a non-empty slice").clone();
            inflight.push_back(self.initiator.submit(&self.peer, t)?);
        }
        for h in inflight {
            h.wait(TRANSFER_TIMEOUT)?;
        }
        Ok(start.elapsed())
    }
}

/// Where pages may sit in a region: page `i` starts at `i * stride`.
///
/// A stride equal to the page size packs pages (two random picks may then be adjacent and
/// coalesce, as in the demo); a larger stride guarantees that no two pages touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLayout {
    /// Bytes per page.
    pub page_size: u64,
    /// Distance between the starts of consecutive page slots (≥ `page_size`).
    pub stride: u64,
    /// Bytes of the region.
    pub region_size: u64,
}

impl PageLayout {
    /// Pages packed end to end.
    pub fn dense(page_size: u64, region_size: u64) -> PageLayout {
        PageLayout {
            page_size,
            stride: page_size,
            region_size,
        }
    }

    /// Pages with a gap of one page between slots: no two pages are ever adjacent.
    pub fn sparse(page_size: u64, region_size: u64) -> PageLayout {
        PageLayout {
            page_size,
            stride: 2 * page_size,
            region_size,
        }
    }

    /// Number of page slots in the region.
    pub fn slots(&self) -> u64 {
        if self.region_size < self.page_size {
            return 0;
        }
        (self.region_size - self.page_size) / self.stride + 1
    }

    /// `n` distinct slots drawn at random, in random order (partial Fisher-Yates).
    ///
    /// # Panics
    /// If `n` exceeds [`slots`](PageLayout::slots).
    pub fn pick(&self, n: usize, rng: &mut Rng) -> Vec<u64> {
        let slots = self.slots();
        assert!(
            n as u64 <= slots,
            "{n} pages asked of a region with {slots} slots"
        );
        // Sparse swaps over a virtual identity permutation: no allocation of `slots`.
        let mut swapped = std::collections::HashMap::with_capacity(2 * n);
        let mut out = Vec::with_capacity(n);
        for i in 0..n as u64 {
            let j = rng.u64(i..slots);
            let vi = *swapped.get(&i).unwrap_or(&i);
            let vj = *swapped.get(&j).unwrap_or(&j);
            swapped.insert(j, vi);
            out.push(vj);
        }
        out
    }

    /// `n` random pages as segments from `src` to the same offsets of `dst`.
    pub fn segments(
        &self,
        src: LocalKey,
        dst: RemoteRegion,
        n: usize,
        rng: &mut Rng,
    ) -> Vec<Segment> {
        self.pick(n, rng)
            .into_iter()
            .map(|slot| Segment {
                src,
                src_offset: slot * self.stride,
                dst,
                dst_offset: slot * self.stride,
                len: self.page_size,
            })
            .collect()
    }
}

/// Submits `iters` transfers through `engine`, cycling over `transfers`, with at most
/// `depth` in flight, and returns the wall time from the first submission to the last
/// completion. Made for criterion's `iter_custom`.
pub fn run(engine: &Engine, transfers: &[Transfer], iters: u64, depth: usize) -> Result<Duration> {
    assert!(!transfers.is_empty(), "no transfers to run");
    let depth = depth.max(1);
    let mut inflight: VecDeque<TransferHandle> = VecDeque::with_capacity(depth);
    let mut next = transfers.iter().cycle();
    let start = Instant::now();
    for _ in 0..iters {
        if inflight.len() == depth
            && let Some(h) = inflight.pop_front()
        {
            h.wait(TRANSFER_TIMEOUT)?;
        }
        let t = next.next().expect("cycle of a non-empty slice").clone();
        inflight.push_back(engine.submit(t)?);
    }
    for h in inflight {
        h.wait(TRANSFER_TIMEOUT)?;
    }
    Ok(start.elapsed())
}

/// Human form of a size for bench ids: `64KiB`, `4KiB`, `64B`.
///
/// Kept by hand rather than through `bytesize`: its display is `64.0 KiB`, with a
/// space, a decimal and rounding where a size is not a whole unit (`1536` would read
/// `1.5 KiB`), so it would rename every criterion group, and with it the saved
/// baselines, for a function no shorter than these lines.
pub fn size_label(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{name}", bytes / unit);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_are_distinct_and_in_range() {
        let l = PageLayout::sparse(64, 1 << 16);
        assert_eq!(l.slots(), 512);
        let mut rng = Rng::with_seed(3);
        let mut p = l.pick(512, &mut rng);
        p.sort_unstable();
        assert_eq!(p, (0..512).collect::<Vec<u64>>());
    }

    #[test]
    fn sparse_segments_never_coalesce() {
        let l = PageLayout::sparse(4096, 64 << 20);
        let dst = RemoteRegion {
            addr: 0,
            len: 64 << 20,
            key: fabric_core::RemoteKey(1),
        };
        let segs = l.segments(LocalKey(1), dst, 1000, &mut Rng::with_seed(1));
        let plan = fabric_core::plan::plan_transfer(&segs, 1 << 20).unwrap();
        assert_eq!(plan.writes.len(), 1000);
        assert_eq!(plan.bytes, 1000 * 4096);
    }

    #[test]
    fn a_mem_pair_moves_the_right_bytes() {
        let pair = Pair::new(&Backend::Mem, 1 << 20).unwrap();
        let layout = PageLayout::dense(4096, 1 << 20);
        let ts = pair.transfers(&layout, 32, 3, 9);
        run(&pair.initiator, &ts, 3, 2).unwrap();
        for s in ts.iter().flat_map(|t| &t.segments) {
            let want = pair.src_buf.to_vec(s.src_offset, s.len as usize).unwrap();
            let got = pair.dst_buf.to_vec(s.dst_offset, s.len as usize).unwrap();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn a_mem_rail_group_moves_the_right_bytes() {
        // 1 MiB transfers: several chunks each, so every rail takes some (a transfer of
        // one chunk goes whole to one rail).
        let pair = GroupPair::new(&Backend::Mem, 3, 1 << 20).unwrap();
        let layout = PageLayout::dense(4096, 1 << 20);
        let ts = pair.transfers(&layout, 256, 3, 9);
        pair.run(&ts, 3, 2).unwrap();
        for &(so, d_o, len) in ts.iter().flat_map(|t| &t.segments) {
            let want = pair.src_buf.to_vec(so, len as usize).unwrap();
            assert_eq!(pair.dst_buf.to_vec(d_o, len as usize).unwrap(), want);
        }
        let per_rail = pair.initiator.rail_counters();
        assert_eq!(per_rail.len(), 3);
        assert!(per_rail.iter().all(|c| c.bytes > 0), "{per_rail:?}");
    }

    /// Bytes the target's transport placed and the connections it holds from initiators.
    fn target_side(target: &Engine) -> (u64, usize) {
        let t = target
            .stats()
            .transport
            .expect("tcp keeps transport figures");
        let conns = t.peers.iter().filter(|p| p.passive).map(|p| p.connections);
        (t.received_bytes, conns.sum())
    }

    /// `4rail-conns` and `4rail-group` write into the same target: one engine (one worker)
    /// holding the 4 connections, which places every byte.
    #[test]
    fn both_four_rail_setups_write_into_one_target_worker() {
        let layout = PageLayout::dense(64 << 10, 8 << 20);
        let conns = Pair::new(&Backend::Tcp { rails: 4 }, 8 << 20).unwrap();
        let ts = conns.transfers(&layout, 64, 2, 5);
        run(&conns.initiator, &ts, 2, 2).unwrap();
        assert_eq!(target_side(&conns.target), (2 * 64 * (64 << 10), 4));

        let group = GroupPair::new(&Backend::Tcp { rails: 1 }, 4, 8 << 20).unwrap();
        assert_eq!(group.rails(), 4);
        assert_eq!(group.target.rails().len(), 1, "one target worker");
        let ts = group.transfers(&layout, 64, 2, 5);
        group.run(&ts, 2, 2).unwrap();
        assert_eq!(
            target_side(&group.target.rails()[0]),
            (2 * 64 * (64 << 10), 4)
        );
        for &(so, d_o, len) in ts.iter().flat_map(|t| &t.segments) {
            let want = group.src_buf.to_vec(so, len as usize).unwrap();
            assert_eq!(group.dst_buf.to_vec(d_o, len as usize).unwrap(), want);
        }
    }

    #[test]
    fn labels() {
        assert_eq!(size_label(64 << 10), "64KiB");
        assert_eq!(size_label(4096), "4KiB");
        assert_eq!(size_label(64), "64B");
        assert_eq!(size_label(256 << 20), "256MiB");
        // Not a whole unit: exact bytes, never a rounded `1.5KiB`.
        assert_eq!(size_label(1536), "1536B");
        assert_eq!(size_label(3 << 10), "3KiB");
    }
}
