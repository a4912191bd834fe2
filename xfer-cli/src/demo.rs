//! `xfer demo`: a loopback transfer inside this process, with one worker (the default) or
//! one worker per GPU (`--per-gpu`).

use crate::backend::{BackendArgs, TransportKind};
use crate::baseline::{self, BaselineError, DeviceRegions, Measured};
use crate::latency;
use crate::nics::{self, RailNic};
use crate::placement::{self, CorePin, GpuWorkerPins, PinMode, WorkerPins};
use crate::setup::{CONNECTING, MEMORY, REGISTERING, STARTING, SetUpClock, WARMING_UP};
use crate::workload::{self, RunReport, Workload};
use crate::{CliError, DemoArgs, Knobs, Summary, print_summary, progress, warm_up, workload_of};
use fabric_core::engine::{GroupPeer, GroupRegistration, RailGroup};
use fabric_core::{Access, MemoryRegion};
use serde::Serialize;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Barrier};

/// Runs `xfer demo`.
pub fn run(mut a: DemoArgs) -> Result<(), CliError> {
    let w = workload_of(&a.knobs)?;
    // Both endpoints are this process: same host, same kind of memory.
    let b = a.backend.resolved(true, true);
    if a.baseline
        && let Some(why) = baseline::refusal(&b, a.per_gpu, a.knobs.latency)
    {
        return Err(CliError::Usage(why));
    }
    a.backend.check_available()?;
    // Both ends are on loopback: NICs only where --nics names them.
    let choice = nics::choose(
        &b.nics,
        b.transport,
        b.provider.as_deref(),
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        0,
    )
    .map_err(CliError::Usage)?;
    a.knobs.rails = a.knobs.rails_asked.unwrap_or(choice.default_rails(1));
    crate::setup::check_rails(a.knobs.rails).map_err(CliError::Usage)?;
    let k = &a.knobs;
    if b.transport == crate::TransportKind::Efa {
        let version = transport_efa::libfabric_version().ok();
        if let Some(note) = in_process_shm_note(b.provider.as_deref(), version) {
            eprintln!("xfer: warning: {note}");
        }
    }
    let rail_nics = choice.per_rail(k.rails);
    if a.per_gpu {
        return per_gpu(&a, &b, &w, &rail_nics);
    }
    if k.latency {
        return latency(&b, k, &w, &rail_nics);
    }
    let pins = WorkerPins::for_this_machine(k.pin);
    let worker = WorkerRails {
        initiator: pins.rail_pins(pins.initiator, k.rails, 0),
        target: pins.rail_pins(pins.target, k.rails, k.rails),
        home: pins.initiator,
        nics: rail_nics,
    };
    let initiator_pins = worker.initiator.clone();
    let (report, verified, regions) = one_worker(&b, k, &w, worker, (0, 1), !k.json, None)?;
    let (measured, hot) = if a.baseline {
        let (m, hot) = run_baseline(&b, k, &w, &report, regions, &initiator_pins)?;
        (Some(m), hot)
    } else {
        (None, None)
    };
    let mut summary =
        Summary::of(&b, a.backend.transport, k, &report, verified, measured).with_nics(&choice);
    summary.baseline_hot_gbps = hot;
    summary.ratio_hot = hot.map(|h| summary.gbps / h);
    print_summary(&summary, k.json);
    Ok(())
}

/// `--baseline` (after [`baseline::refusal`] let it through): the run's work again without
/// the engine, on the same path (see [`baseline`]), with the run's own regions where it
/// copies memory; `pins` are the initiator rails' cores. Returns what it measured and, for
/// tcp, the cache-hot streams' Gbps.
fn run_baseline(
    b: &BackendArgs,
    k: &Knobs,
    w: &Workload,
    report: &RunReport,
    (local, remote): Regions,
    pins: &[Option<CorePin>],
) -> Result<(Measured, Option<f64>), CliError> {
    let failed = |e: BaselineError| CliError::Failed(format!("baseline: {e}"));
    match b.transport {
        TransportKind::Mem => {
            // From the region that holds the pattern to the one the bytes landed in.
            let (from, to) = if w_reads(k) {
                (&remote, &local)
            } else {
                (&local, &remote)
            };
            let gbps =
                baseline::scattered_memcpy(&**from, &**to, w, k.rails, pins).map_err(failed)?;
            let kind = baseline::memcpy_kind(k.rails);
            Ok((Measured { gbps, kind }, None))
        }
        TransportKind::CudaIpc => {
            let cuda = b.cuda()?;
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
                baseline::scattered_device_copies(&r, w, w_reads(k), k.rails, b.cuda_copy)
                    .map_err(failed)?;
            let kind = baseline::device_copies_kind(method, k.rails, g0, g1);
            Ok((Measured { gbps, kind }, None))
        }
        _ => {
            // tcp with host memory. The regions go first: the streams map as much memory.
            drop((local, remote));
            let gbps = baseline::tcp_streams(report.bytes, k.rails, k.region_size as usize)
                .map_err(failed)?;
            let hot = baseline::tcp_streams(report.bytes, k.rails, 1 << 20).map_err(failed)?;
            let kind = baseline::tcp_kind(k.rails, k.region_size as usize);
            Ok((Measured { gbps, kind }, Some(hot)))
        }
    }
}

/// `demo --latency`: one worker, transfers one at a time, and the raw TCP floor.
fn latency(b: &BackendArgs, k: &Knobs, w: &Workload, nics: &[RailNic]) -> Result<(), CliError> {
    let pins = WorkerPins::for_this_machine(k.pin);
    let rails = WorkerRails {
        initiator: pins.rail_pins(pins.initiator, k.rails, 0),
        target: pins.rail_pins(pins.target, k.rails, k.rails),
        home: pins.initiator,
        nics: nics.to_vec(),
    };
    let (src_group, dst_group, s, d, peer, _dst) = set_up_worker(b, k, rails, (0, 1))?;
    let count = latency::sample_count(w);
    let (mut times, mut imm) =
        latency::run_transfers(&src_group, &s, &peer, &d.remote, Some(&dst_group), w, count)?;
    let mut raw = latency::raw_round_trips(w.page_size, w.pages, w.region_size, count, w.seed)
        .map_err(|e| CliError::Failed(format!("raw TCP ping-pong: {e}")))?;
    latency::summary(
        b.transport.name(),
        k.rails,
        b.busy_poll_us,
        w,
        &mut times,
        &mut imm,
        &mut raw,
    )
    .print(k.json);
    Ok(())
}

/// The cores of one worker's rails.
struct WorkerRails {
    initiator: Vec<Option<CorePin>>,
    target: Vec<Option<CorePin>>,
    /// Where its regions' memory should come from.
    home: Option<CorePin>,
    /// The NIC of each rail (both groups), or none.
    nics: Vec<RailNic>,
}

/// A worker's regions: the initiator's, the target's.
type Regions = (Arc<dyn MemoryRegion>, Arc<dyn MemoryRegion>);

/// One worker: an initiator group and a target group on loopback; the source region on the
/// GPU at position `slots.0` of --gpus, the target region at `slots.1`. Returns the run,
/// whether the landed bytes were checked, and the regions.
fn one_worker(
    b: &BackendArgs,
    k: &Knobs,
    w: &Workload,
    rails: WorkerRails,
    slots: (usize, usize),
    show_progress: bool,
    start: Option<&Barrier>,
) -> Result<(RunReport, bool, Regions), CliError> {
    // Workers of a --per-gpu run start their timed work together (a worker whose set-up
    // failed still passes the barrier, then reports its error).
    let set_up = set_up_worker(b, k, rails, slots);
    if let Some(barrier) = start {
        barrier.wait();
    }
    // The target group stays alive (its engines place the bytes) until the run ends.
    let (src_group, target_group, s, d, peer, regions) = set_up?;
    let mut progress = progress::Progress::new(!show_progress).label(k.op.direction().name());
    let report = workload::run(&src_group, &s, &peer, &d.remote, w, &mut progress)?;
    // Every byte has landed: stop the rails, whose idle workers would slow the check.
    drop((src_group, target_group));
    let verified = if k.no_verify {
        false
    } else {
        // Where the bytes landed: the target's region (write), the initiator's (read).
        let landed = if w_reads(k) { &regions.0 } else { &regions.1 };
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

/// What a worker holds once set up: its groups, registrations, peer and regions.
type WorkerSetUp = (
    RailGroup,
    RailGroup,
    GroupRegistration,
    GroupRegistration,
    GroupPeer,
    Regions,
);

fn set_up_worker(
    b: &BackendArgs,
    k: &Knobs,
    rails: WorkerRails,
    slots: (usize, usize),
) -> Result<WorkerSetUp, CliError> {
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let name = |role: &str| format!("xfer-{role}-{}", slots.0);
    let mut clock = SetUpClock::start(format!("2 x {} rails", k.rails), MEMORY);
    // Both regions are first touched by this thread: put them on the workers' node. They
    // are filled before the rails start, whose idle workers would take CPU from the fill.
    if let Some(p) = rails.home {
        p.prefer_memory_here(&name("main"));
    }
    let read = w_reads(k);
    let src = b.alloc(k.region_size, slots.0)?;
    let dst = b.alloc(k.region_size, slots.1)?;
    // The pattern is where the bytes come from: the initiator's region for a write, the
    // target's for a read.
    workload::fill_pattern(if read { &*dst } else { &*src }, k.seed)?;
    clock.stage(STARTING);
    let src_group = b.spawn_group(
        lo,
        k.rails,
        &name("initiator"),
        rails.initiator,
        slots.0,
        &rails.nics,
    )?;
    let dst_group = b.spawn_group(
        lo,
        k.rails,
        &name("target"),
        rails.target,
        slots.1,
        &rails.nics,
    )?;
    clock.stage(REGISTERING);
    let (s, d) = if read {
        // The warm-up's zero-length writes still need REMOTE_WRITE at the target.
        (
            src_group.register(src.clone(), Access::LOCAL_WRITE)?,
            dst_group.register(dst.clone(), Access::REMOTE_READ | Access::REMOTE_WRITE)?,
        )
    } else {
        (
            src_group.register(src.clone(), Access::NONE)?,
            dst_group.register(dst.clone(), Access::REMOTE_WRITE)?,
        )
    };
    clock.stage(CONNECTING);
    let peer = src_group.add_peer(&dst_group.addresses())?;
    clock.stage(WARMING_UP);
    warm_up(&src_group, &s, &peer, &d.remote, k)?;
    clock.finish();
    Ok((src_group, dst_group, s, d, peer, (src, dst)))
}

/// Whether the run reads (`--op read`).
fn w_reads(k: &Knobs) -> bool {
    k.op == crate::OpArg::Read
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
    path: &'static str,
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
fn per_gpu(a: &DemoArgs, b: &BackendArgs, w: &Workload, nics: &[RailNic]) -> Result<(), CliError> {
    let k = &a.knobs;
    check_per_gpu(b)?;
    let pins = gpu_worker_pins(b, k.pin, k.rails);
    let results = run_workers(&pins, |slot, p, start| {
        let rails = WorkerRails {
            initiator: pad(&p.initiator, k.rails),
            target: pad(&p.target, k.rails),
            home: p.home,
            nics: nics.to_vec(),
        };
        one_worker(b, k, w, rails, (slot, slot), false, Some(start))
            .map(|(report, verified, _)| (report, verified))
    });
    let s = per_gpu_summary(b, a.backend.transport, k, results, &pins)?;
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
                    .unwrap_or_else(|_| Err(CliError::Failed("a worker panicked".into())))
            })
            .collect()
    })
}

/// Gathers the workers' results (the first failure is the answer).
pub(crate) fn per_gpu_summary(
    b: &BackendArgs,
    asked: crate::backend::TransportKind,
    k: &Knobs,
    results: Vec<Result<(RunReport, bool), CliError>>,
    pins: &[GpuWorkerPins],
) -> Result<PerGpuSummary, CliError> {
    let mut workers = Vec::new();
    for ((slot, r), p) in results.into_iter().enumerate().zip(pins) {
        let (report, verified) = r.map_err(|e| match e {
            CliError::Failed(m) => CliError::Failed(format!("GPU {}: {m}", b.gpus[slot])),
            CliError::Mismatch(m) => CliError::Mismatch(format!("GPU {}: {m}", b.gpus[slot])),
            other => other,
        })?;
        workers.push(WorkerSummary {
            gpu: b.gpus[slot],
            bytes: report.bytes,
            seconds: report.seconds,
            gbps: report.gbps(),
            verified,
            cores: pad(&p.initiator, k.rails)
                .iter()
                .map(|c| c.map(|c| c.core))
                .collect(),
        });
    }
    let bytes: u64 = workers.iter().map(|w| w.bytes).sum();
    let seconds = workers.iter().map(|w| w.seconds).fold(0.0, f64::max);
    Ok(PerGpuSummary {
        transport: b.transport.name(),
        op: k.op.direction().name(),
        path: b.transport.why(asked),
        memory: b.memory.name(),
        page_size: k.page_size,
        rails_per_worker: k.rails,
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
        println!("{}", serde_json::to_string(s).expect("summary serialises"));
        return;
    }
    for w in &s.workers {
        let cores: Vec<String> = w
            .cores
            .iter()
            .map(|c| c.map_or("-".into(), |c| c.to_string()))
            .collect();
        println!(
            "worker GPU {}: {} in {:.3}s = {:.2} Gbps, verified: {}, initiator cores [{}]",
            w.gpu,
            crate::size::format_size(w.bytes),
            w.seconds,
            w.gbps,
            if w.verified { "yes" } else { "no" },
            cores.join(", ")
        );
    }
    println!(
        "{} x {} workers of {} rails: {} in {:.3}s = {:.2} Gbps",
        s.transport,
        s.workers.len(),
        s.rails_per_worker,
        crate::size::format_size(s.bytes),
        s.seconds,
        s.gbps
    );
    println!("path: {} ({})", s.transport, s.path);
    let per_worker = s.workers.first().map_or(0, |w| w.bytes);
    if let Some(note) = crate::rounding_note(s.bytes_asked, per_worker, s.page_size) {
        println!("{note} per worker");
    }
}

/// One [`GpuWorkerPins`] per entry of --gpus, from the placement plan (`--pin auto`).
pub(crate) fn gpu_worker_pins(b: &BackendArgs, pin: PinMode, rails: usize) -> Vec<GpuWorkerPins> {
    match pin {
        PinMode::Off => vec![GpuWorkerPins::default(); b.gpus.len()],
        PinMode::Auto => match topology::Topology::discover() {
            Ok(t) => {
                let idx: Vec<_> = b
                    .gpus
                    .iter()
                    .map(|&o| placement::topology_gpu(&t, o))
                    .collect();
                placement::per_gpu_pins(&t, &t.plan(), &idx, rails)
            }
            Err(e) => {
                tracing::warn!(error = %crate::topo::error_chain(&e), "topology discovery failed; workers run unpinned");
                vec![GpuWorkerPins::default(); b.gpus.len()]
            }
        },
    }
}

/// Checks --gpus for a per-GPU run: not empty, no GPU twice.
pub(crate) fn check_per_gpu(b: &BackendArgs) -> Result<(), CliError> {
    if b.gpus.is_empty() {
        return Err(CliError::Usage("--gpus lists no device".into()));
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(g) = b.gpus.iter().find(|g| !seen.insert(**g)) {
        return Err(CliError::Usage(format!(
            "--per-gpu: GPU {g} is listed twice in --gpus"
        )));
    }
    Ok(())
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
