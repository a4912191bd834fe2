//! `xfer demo`: a loopback transfer inside this process between two agents of the library,
//! an initiator and a target, with one pair (the default) or one pair per GPU
//! (`--per-gpu`, each pair's rails pinned near its GPU).

use crate::backend::{BackendArgs, PinArg, TransportArg, alloc, cuda};
use crate::baseline::{self, BaselineError, DeviceRegions, Measured};
use crate::setup::{
    ALLOCATING, CONNECTING, FILLING, REGISTERING, STARTING, SetUpClock, WARMING_UP,
};
use crate::workload::{self, RunReport, Workload};
use crate::{
    CliError, DemoArgs, Knobs, OpArg, Path, Summary, latency, nics_text, print_summary, progress,
    warm_up, workload_of,
};
use fabric_core::MemoryRegion;
use serde::Serialize;
use std::sync::{Arc, Barrier};
use xfer::layers::AgentLayers;
use xfer::layers::placement::{CorePin, GpuWorkerPins, WorkerPins};
use xfer::{Access, Agent, AgentOptions, Peer, Region, Role, TransportChoice, TransportKind};

/// Runs `xfer demo`.
pub fn run(a: DemoArgs) -> Result<(), CliError> {
    let w = workload_of(&a.knobs)?;
    let k = &a.knobs;
    let asked = a.backend.transport.choice();
    // What no transport can change is refused before anything is built (no libfabric or
    // GPU is needed to be told); what `auto` resolves to is checked once it has.
    let asked_kind = match asked {
        TransportChoice::Only(kind) => Some(kind),
        TransportChoice::Auto => None,
    };
    if a.baseline
        && let Some(why) = baseline::refusal(asked_kind, a.backend.memory, a.per_gpu, k.latency)
    {
        return Err(CliError::Usage(why));
    }
    a.backend.check_gpus()?;
    if a.backend.transport == TransportArg::Efa {
        let version = transport_efa::libfabric_version().ok();
        if let Some(note) = in_process_shm_note(a.backend.provider.as_deref(), version) {
            eprintln!("xfer: warning: {note}");
        }
    }
    if a.per_gpu {
        return per_gpu(&a, &w);
    }
    if k.latency {
        return latency(&a.backend, k, &w);
    }
    let clock = set_up_clock(k.rails_asked);
    let pair = Pair::build(&a.backend, k, 0, k.rails_asked, None)?;
    let kind = pair.transport()?;
    if a.baseline
        && let Some(why) = baseline::refusal(Some(kind), a.backend.memory, false, false)
    {
        return Err(CliError::Usage(why));
    }
    let path = pair.path(asked, kind);
    let nics = pair.initiator.nics(kind).map(nics_text).unwrap_or_default();
    let rails = pair.initiator.group(kind).map_or(1, |g| g.rails().len());
    let (report, verified, regions) = one_worker(pair, clock, k, &w, !k.json, None)?;
    let (measured, extra) = if a.baseline {
        let (m, extra) = run_baseline(kind, &a.backend, k, rails, &w, &report, regions)?;
        (Some(m), extra)
    } else {
        (None, Extra::default())
    };
    let mut summary = Summary::of(&path, k, &report, verified, measured).with_nics(nics);
    summary.baseline_hot_gbps = extra.hot;
    summary.ratio_hot = extra.hot.map(|h| summary.gbps / h);
    if let Some(p) = extra.pages {
        summary.ratio_pages = Some(summary.gbps / p.gbps);
        summary.baseline_pages_gbps = Some(p.gbps);
        summary.baseline_pages_kind = Some(p.kind);
    }
    print_summary(&summary, k.json);
    Ok(())
}

/// The cores of one worker's rails, where the caller placed them (`--per-gpu`).
#[derive(Clone, Debug, Default)]
pub(crate) struct WorkerPlace {
    /// One pin per rail.
    pub rails: Vec<Option<CorePin>>,
    /// Where the worker's memory should come from.
    pub home: Option<CorePin>,
}

/// One worker of the demo: an initiator agent and a target agent of this process.
struct Pair {
    initiator: Agent,
    target: Agent,
}

impl Pair {
    /// The pair of worker `slot`: with `--per-gpu` both on `--gpus[slot]`, their rails at
    /// `place` (initiator's, target's); else the initiator on the first GPU of --gpus and
    /// the target on the second (if given), placed by the library.
    fn build(
        b: &BackendArgs,
        k: &Knobs,
        slot: usize,
        rails: Option<usize>,
        place: Option<(WorkerPlace, WorkerPlace)>,
    ) -> Result<Pair, CliError> {
        let (gpus, pins) = match place {
            Some((i, t)) => ((slot, slot), (Some(i.rails), Some(t.rails))),
            None => ((0, 1), (None, None)),
        };
        // Both on loopback: NICs only where --nics names them.
        let options = |role: Role, gpu: usize| -> Result<AgentOptions, CliError> {
            Ok(AgentOptions {
                role,
                worker: slot,
                gpu: b.gpu(gpu)?,
                ..b.options(k.pin, rails)?
            })
        };
        Ok(Pair {
            initiator: Agent::with_pins(options(Role::Initiator, gpus.0)?, pins.0)?,
            target: Agent::with_pins(options(Role::Target, gpus.1)?, pins.1)?,
        })
    }

    /// The transport the initiator reaches the target by (the library's choice).
    fn transport(&self) -> Result<TransportKind, CliError> {
        Ok(xfer::resolve(self.initiator.info(), self.target.info())?)
    }

    /// The path of a run over `kind`, the transport having been `asked`.
    fn path(&self, asked: TransportChoice, kind: TransportKind) -> Path {
        Path::of(asked, self.initiator.info(), self.target.info(), kind)
    }
}

/// `--baseline` (after [`baseline::refusal`] let it through): the run's work again without
/// the engine, on the same path `kind` (see [`baseline`]), with the run's own regions where
/// it copies memory, as many threads or streams as `rails`. Returns what it measured and,
/// for tcp, the cache-hot streams' Gbps.
/// What a tcp baseline measures besides its main figure.
#[derive(Default)]
struct Extra {
    /// The streams through 1 MiB cache-hot buffers.
    hot: Option<f64>,
    /// The streams moving the run's page size as random pages ([`baseline::tcp_pages`]).
    pages: Option<Measured>,
}

fn run_baseline(
    kind: TransportKind,
    b: &BackendArgs,
    k: &Knobs,
    rails: usize,
    w: &Workload,
    report: &RunReport,
    (local, remote): Regions,
) -> Result<(Measured, Extra), CliError> {
    let failed = |e: BaselineError| CliError::because("baseline", e);
    match kind {
        TransportKind::Mem => {
            // From the region that holds the pattern to the one the bytes landed in.
            let (from, to) = if reads(k) {
                (&remote, &local)
            } else {
                (&local, &remote)
            };
            // The copy threads take the cores the initiator's rails took.
            let pins = WorkerPins::for_this_machine(k.pin.mode());
            let pins = pins.rail_pins(pins.initiator, rails, 0);
            let gbps =
                baseline::scattered_memcpy(&**from, &**to, w, rails, &pins).map_err(failed)?;
            let kind = baseline::memcpy_kind(rails);
            Ok((Measured { gbps, kind }, Extra::default()))
        }
        TransportKind::CudaIpc => {
            let cuda = cuda()?;
            let (g0, g1) = (b.gpu(0)?, b.gpu(1)?);
            let device = |g: u32| {
                cuda.device(g)
                    .map_err(|e| CliError::Usage(format!("--gpus: {e}")))
            };
            let (initiator, target) = (device(g0)?, device(g1)?);
            let r = DeviceRegions {
                initiator: &initiator,
                local: &local,
                target: &target,
                remote: &remote,
            };
            let (gbps, method) =
                baseline::scattered_device_copies(&r, w, reads(k), rails, b.cuda_copy)
                    .map_err(failed)?;
            let kind = baseline::device_copies_kind(method, rails, g0, g1);
            Ok((Measured { gbps, kind }, Extra::default()))
        }
        _ => {
            // tcp with host memory. The regions go first: the streams map as much memory.
            drop((local, remote));
            // The streams run the congestion control the rails run (like for like).
            let cc = b.congestion();
            let region = k.region_size as usize;
            let gbps = baseline::tcp_streams(report.bytes, rails, region, &cc).map_err(failed)?;
            let hot = baseline::tcp_streams(report.bytes, rails, 1 << 20, &cc).map_err(failed)?;
            let algorithm = baseline::loopback_congestion(&cc).map_err(failed)?;
            let kind = baseline::tcp_kind(rails, region, &algorithm);
            let page = w.page_size as usize;
            let pages = baseline::tcp_pages(report.bytes, rails, (region, page), w.seed, &cc)
                .map_err(failed)?
                .map(|gbps| Measured {
                    gbps,
                    kind: baseline::tcp_pages_kind(rails, page, region, &algorithm),
                });
            Ok((
                Measured { gbps, kind },
                Extra {
                    hot: Some(hot),
                    pages,
                },
            ))
        }
    }
}

/// `demo --latency`: one worker, transfers one at a time, and the raw TCP floor.
fn latency(b: &BackendArgs, k: &Knobs, w: &Workload) -> Result<(), CliError> {
    let clock = set_up_clock(k.rails_asked);
    let pair = Pair::build(b, k, 0, k.rails_asked, None)?;
    let kind = pair.transport()?;
    let rails = pair.initiator.group(kind).map_or(1, |g| g.rails().len());
    let s = set_up_worker(pair, clock, k, None)?;
    let count = latency::sample_count(w);
    let (mut times, mut imm) = latency::run_transfers(
        &s.pair.initiator,
        &s.src,
        &s.peer,
        s.dst.descriptor(),
        Some(&s.pair.target),
        w,
        count,
    )?;
    let page = (w.page_size, w.pages);
    let mut raw = latency::raw_round_trips(page, w.region_size, count, w.seed, &b.congestion())
        .map_err(|e| CliError::io("raw TCP ping-pong", e))?;
    latency::summary(
        kind.name(),
        rails,
        b.busy_poll_us,
        w,
        &mut times,
        &mut imm,
        &mut raw,
    )
    .print(k.json);
    Ok(())
}

/// A worker's regions: the initiator's, the target's.
type Regions = (Arc<dyn MemoryRegion>, Arc<dyn MemoryRegion>);

/// One worker: the run from the initiator to the target and its check where the bytes
/// landed; `home` is where its memory should come from when the caller placed it. Returns
/// the run, whether the landed bytes were checked, and the regions.
fn one_worker(
    pair: Pair,
    clock: SetUpClock,
    k: &Knobs,
    w: &Workload,
    show_progress: bool,
    placed: Option<(Option<CorePin>, &Barrier)>,
) -> Result<(RunReport, bool, Regions), CliError> {
    // Workers of a --per-gpu run start their timed work together (a worker whose set-up
    // failed still passes the barrier, then reports its error).
    let set_up = set_up_worker(pair, clock, k, placed.map(|p| p.0));
    if let Some((_, barrier)) = placed {
        barrier.wait();
    }
    // The target agent stays alive (its engines place the bytes) until the run ends.
    let s = set_up?;
    let mut progress = progress::Progress::new(!show_progress).label(k.op.direction().name());
    let report = workload::run(
        &s.pair.initiator,
        &s.src,
        &s.peer,
        s.dst.descriptor(),
        w,
        &mut progress,
    )?;
    let regions = s.regions.clone();
    // Every byte has landed: stop the rails, whose idle workers would slow the check.
    drop(s);
    let verified = if k.no_verify {
        false
    } else {
        // Where the bytes landed: the target's region (write), the initiator's (read).
        let landed = if reads(k) { &regions.0 } else { &regions.1 };
        let pages = report.written_pages();
        let (bad, first) = workload::verify_pages(&**landed, k.page_size, k.seed, &pages)?;
        if bad > 0 {
            return Err(CliError::Mismatch(format!(
                "{bad} of {} pages differ (first: page {})",
                pages.len(),
                first.unwrap_or(0)
            )));
        }
        true
    };
    Ok((report, verified, regions))
}

/// What a worker holds once set up: its agents, registrations, peer and regions.
struct WorkerSetUp {
    pair: Pair,
    src: Region,
    dst: Region,
    peer: Peer,
    regions: Regions,
}

/// The clock of a worker's set-up, from its agents' start (`rails` each, if known).
fn set_up_clock(rails: Option<usize>) -> SetUpClock {
    let what = rails.map_or("2 agents".into(), |r| format!("2 x {r} rails"));
    SetUpClock::start(what, STARTING)
}

/// Allocates and fills both regions (on the agents' memory), registers them, connects the
/// initiator to the target and warms every rail up, timed by `clock` (which timed the
/// agents' start); `home`: where the memory should come from, when the caller placed the
/// worker (else the initiator's home).
fn set_up_worker(
    pair: Pair,
    mut clock: SetUpClock,
    k: &Knobs,
    home: Option<Option<CorePin>>,
) -> Result<WorkerSetUp, CliError> {
    clock.stage(ALLOCATING);
    // Both regions are first touched by this thread: put them on the workers' node.
    if let Some(p) = home.unwrap_or(pair.initiator.home()) {
        p.prefer_memory_here("xfer-main");
    }
    let read = reads(k);
    let src = alloc(pair.initiator.info().memory, k.region_size)?;
    let dst = alloc(pair.target.info().memory, k.region_size)?;
    clock.stage(FILLING);
    // The pattern is where the bytes come from: the initiator's region for a write, the
    // target's for a read.
    workload::fill_pattern(if read { &*dst } else { &*src }, k.seed)?;
    clock.stage(REGISTERING);
    let (s, d) = if read {
        // The warm-up's zero-length writes still need REMOTE_WRITE at the target.
        (
            pair.initiator.register(src.clone(), Access::LOCAL_WRITE)?,
            pair.target
                .register(dst.clone(), Access::REMOTE_READ | Access::REMOTE_WRITE)?,
        )
    } else {
        (
            pair.initiator.register(src.clone(), Access::NONE)?,
            pair.target.register(dst.clone(), Access::REMOTE_WRITE)?,
        )
    };
    clock.stage(CONNECTING);
    let peer = pair.initiator.connect(pair.target.info())?;
    clock.stage(WARMING_UP);
    warm_up(&pair.initiator, &peer, &s, d.descriptor(), k)?;
    clock.finish();
    Ok(WorkerSetUp {
        pair,
        src: s,
        dst: d,
        peer,
        regions: (src, dst),
    })
}

/// Whether the run reads (`--op read`).
fn reads(k: &Knobs) -> bool {
    k.op == OpArg::Read
}

/// One worker's line of a `--per-gpu` summary.
#[derive(Serialize)]
pub(crate) struct WorkerSummary {
    /// Its entry of --gpus.
    gpu: u32,
    bytes: u64,
    seconds: f64,
    gbps: f64,
    verified: bool,
    /// The cores its initiator rails were pinned to (`null`: unpinned).
    cores: Vec<Option<u32>>,
}

/// The summary of a `--per-gpu` run.
#[derive(Serialize)]
pub(crate) struct PerGpuSummary {
    transport: &'static str,
    /// `write` or `read` (`--op`).
    op: &'static str,
    path: String,
    memory: &'static str,
    page_size: u64,
    rails_per_worker: usize,
    workers: Vec<WorkerSummary>,
    /// All workers' bytes.
    bytes: u64,
    /// `--bytes` as given, when it was not a whole number of pages (each worker moved it
    /// rounded up).
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_asked: Option<u64>,
    /// The slowest worker's time.
    seconds: f64,
    /// All bytes over the slowest worker's time.
    gbps: f64,
}

/// `--per-gpu`: one worker per entry of --gpus, all at once.
fn per_gpu(a: &DemoArgs, w: &Workload) -> Result<(), CliError> {
    let (b, k) = (&a.backend, &a.knobs);
    b.check_per_gpu()?;
    // One core per rail of every worker: the rails are counted before any agent is built.
    let rails = match k.rails_asked {
        Some(r) => r,
        None => {
            let o = b.options(k.pin, None)?;
            xfer::layers::lanes::nic_choice(&o, b.nic_transport())?.default_rails(1)
        }
    };
    let pins = gpu_worker_pins(&b.gpus, k.pin, rails);
    let results = run_workers(&pins, |slot, p, start| {
        let place = |rails_pins: &[Option<CorePin>]| WorkerPlace {
            rails: pad(rails_pins, rails),
            home: p.home,
        };
        let clock = set_up_clock(Some(rails));
        let set_up = Pair::build(
            b,
            k,
            slot,
            Some(rails),
            Some((place(&p.initiator), place(&p.target))),
        )
        .and_then(|pair| {
            let kind = pair.transport()?;
            Ok((pair.path(a.backend.transport.choice(), kind), pair))
        });
        let (path, pair) = match set_up {
            Ok(x) => x,
            Err(e) => {
                // The others wait for every worker at the barrier.
                start.wait();
                return Err(e);
            }
        };
        one_worker(pair, clock, k, w, false, Some((p.home, start)))
            .map(|(report, verified, _)| (path, report, verified))
    });
    let path = results
        .iter()
        .find_map(|r| r.as_ref().ok())
        .map(|r| r.0.clone());
    let results = results
        .into_iter()
        .map(|r| r.map(|(_, report, verified)| (report, verified)))
        .collect();
    let s = per_gpu_summary(path, b, k, rails, results, &pins)?;
    print_per_gpu(&s, k.json);
    Ok(())
}

/// Runs `worker(slot, pins, start)` for each entry of `pins` on a thread of its own, all at
/// once; each worker passes `start` (a barrier of them all) before its timed work. Returns
/// their results in order (a panicking worker's as a failure).
pub(crate) fn run_workers<T: Send>(
    pins: &[GpuWorkerPins],
    worker: impl Fn(usize, &GpuWorkerPins, &Barrier) -> Result<T, CliError> + Sync,
) -> Vec<Result<T, CliError>> {
    let start = Barrier::new(pins.len());
    let (start, worker) = (&start, &worker);
    std::thread::scope(|scope| {
        let handles: Vec<_> = pins
            .iter()
            .enumerate()
            .map(|(slot, p)| scope.spawn(move || worker(slot, p, start)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(CliError::failed("a worker panicked")))
            })
            .collect()
    })
}

/// Gathers the workers' results (the first failure is the answer), on `path` (the first
/// worker's), `rails` rails each.
pub(crate) fn per_gpu_summary(
    path: Option<Path>,
    b: &BackendArgs,
    k: &Knobs,
    rails: usize,
    results: Vec<Result<(RunReport, bool), CliError>>,
    pins: &[GpuWorkerPins],
) -> Result<PerGpuSummary, CliError> {
    let mut workers = Vec::new();
    for ((slot, r), p) in results.into_iter().enumerate().zip(pins) {
        let gpu = b.gpus[slot];
        let (report, verified) = r.map_err(|e| match e {
            CliError::Mismatch(m) => CliError::Mismatch(format!("GPU {gpu}: {m}")),
            CliError::Usage(m) => CliError::Usage(format!("GPU {gpu}: {m}")),
            other => CliError::because(format!("GPU {gpu}"), other),
        })?;
        workers.push(WorkerSummary {
            gpu,
            bytes: report.bytes,
            seconds: report.seconds,
            gbps: report.gbps(),
            verified,
            cores: pad(&p.initiator, rails)
                .iter()
                .map(|c| c.map(|c| c.core))
                .collect(),
        });
    }
    let path = path.ok_or_else(|| CliError::failed("no worker ran"))?;
    let bytes: u64 = workers.iter().map(|w| w.bytes).sum();
    let seconds = workers.iter().map(|w| w.seconds).fold(0.0, f64::max);
    Ok(PerGpuSummary {
        transport: path.transport.name(),
        op: k.op.direction().name(),
        path: path.why,
        memory: path.memory,
        page_size: k.page_size,
        rails_per_worker: rails,
        bytes,
        bytes_asked: crate::bytes_asked(k),
        seconds,
        gbps: if seconds > 0.0 {
            bytes as f64 * 8.0 / seconds / 1e9
        } else {
            0.0
        },
        workers,
    })
}

/// Prints a per-GPU summary: a line per worker and the total, or one JSON line.
pub(crate) fn print_per_gpu(s: &PerGpuSummary, json: bool) {
    if json {
        outln!("{}", serde_json::to_string(s).expect("summary serialises"));
        return;
    }
    for w in &s.workers {
        let cores: Vec<String> = w
            .cores
            .iter()
            .map(|c| c.map_or("-".into(), |c| c.to_string()))
            .collect();
        outln!(
            "worker GPU {}: {} in {:.3}s = {:.2} Gbps, verified: {}, initiator cores [{}]",
            w.gpu,
            crate::size::format_size(w.bytes),
            w.seconds,
            w.gbps,
            if w.verified { "yes" } else { "no" },
            cores.join(", ")
        );
    }
    outln!(
        "{} x {} workers of {} rails: {} in {:.3}s = {:.2} Gbps",
        s.transport,
        s.workers.len(),
        s.rails_per_worker,
        crate::size::format_size(s.bytes),
        s.seconds,
        s.gbps
    );
    outln!("path: {} ({})", s.transport, s.path);
    let per_worker = s.workers.first().map_or(0, |w| w.bytes);
    if let Some(note) = crate::rounding_note(s.bytes_asked, per_worker, s.page_size) {
        outln!("{note} per worker");
    }
}

/// One [`GpuWorkerPins`] per entry of `gpus` (CUDA ordinals), from the placement plan
/// (`--pin auto`) of this machine's topology.
pub(crate) fn gpu_worker_pins(gpus: &[u32], pin: PinArg, rails: usize) -> Vec<GpuWorkerPins> {
    let unpinned = || vec![GpuWorkerPins::default(); gpus.len()];
    match (pin, xfer::layers::placement::machine()) {
        (PinArg::Auto, Some(t)) => {
            let idx: Vec<_> = gpus
                .iter()
                .map(|&o| xfer::layers::placement::topology_gpu(t, o))
                .collect();
            xfer::layers::placement::per_gpu_pins(t, &t.plan(), &idx, rails)
        }
        _ => unpinned(),
    }
}

/// `pins` with exactly `n` entries (unpinned where missing).
pub(crate) fn pad(pins: &[Option<CorePin>], n: usize) -> Vec<Option<CorePin>> {
    (0..n).map(|i| pins.get(i).copied().flatten()).collect()
}

/// The warning for `demo` over shm with libfabric 2.x, where both endpoints are this process.
///
/// libfabric 2.6's shm checks that cross-memory attach (CMA, `process_vm_readv`) works only
/// when it maps a peer's region from another process: `smr_map_to_region` returns early for
/// an endpoint of the same process, before `smr_map_to_endpoint` runs the check. So between
/// two endpoints of one process shm never uses CMA and moves each write through its bounce
/// buffers (SAR), one write per peer at a time: 2.3-2.7 Gbps on the 2-core VM where the same
/// bench between two processes moves 62-72, and exactly that rate between two processes with
/// `FI_SHM_DISABLE_CMA=1`. 1.17 has no such limit. `None` where nothing applies.
fn in_process_shm_note(provider: Option<&str>, version: Option<(u32, u32)>) -> Option<String> {
    let (major, minor) = version?;
    if major < 2 || provider? != "shm" {
        return None;
    }
    Some(format!(
        "libfabric {major}.{minor}'s shm does not use cross-memory attach between endpoints of \
         one process, so this demo moves each write through its bounce buffers, one at a time \
         (a few Gbps); for shm figures run `xfer serve` and `xfer bench` as two processes"
    ))
}

#[cfg(test)]
mod shm_note_tests {
    use super::in_process_shm_note;

    #[test]
    fn warns_only_for_shm_on_libfabric_2() {
        let note = in_process_shm_note(Some("shm"), Some((2, 6))).expect("a warning");
        assert!(
            note.contains("2.6") && note.contains("xfer serve"),
            "{note}"
        );
        assert_eq!(in_process_shm_note(Some("shm"), Some((1, 17))), None);
        assert_eq!(in_process_shm_note(Some("tcp"), Some((2, 6))), None);
        assert_eq!(in_process_shm_note(None, Some((2, 6))), None);
        assert_eq!(in_process_shm_note(Some("shm"), None), None);
    }
}
