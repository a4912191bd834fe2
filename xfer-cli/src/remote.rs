//! `xfer serve` and `xfer bench`: the two ends of a transfer between processes (or hosts),
//! joined by the control channel ([`crate::control`]). With `--per-gpu` both run one worker
//! per entry of their `--gpus`, and bench worker *i* writes to server worker *i*.

use crate::backend::{BackendArgs, MemoryKind, TransportKind};
use crate::control::{self, ServedGroup};
use crate::demo::{self, check_per_gpu, gpu_worker_pins, pad};
use crate::latency;
use crate::metrics;
use crate::nics::{self, NicChoice};
use crate::placement::{CorePin, GpuWorkerPins, WorkerPins};
use crate::setup::{ASKING, CONNECTING, MEMORY, REGISTERING, STARTING, SetUpClock, WARMING_UP};
use crate::workload::{self, RunReport, Workload};
use crate::{
    BenchArgs, CliError, ServeArgs, Summary, address_from_text, print_summary, progress, size,
    warm_up, workload_of,
};
use fabric_core::Access;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::Duration;
use transport_tcp::TcpTransport;

/// Runs `xfer bench`.
pub fn bench(mut a: BenchArgs) -> Result<(), CliError> {
    if a.peers.is_some() {
        return crate::members::bench_all(a);
    }
    a.target = crate::members::resolve_peer(&a)?;
    let w = workload_of(&a.knobs)?;
    if a.backend.transport == TransportKind::Mem {
        return Err(CliError::Usage(
            "--transport mem works only inside one process: use xfer demo".into(),
        ));
    }
    let ctl_addr = control::parse_peer(&a.target).map_err(CliError::Usage)?;
    a.backend.check_available()?;
    if let Some(addr) = a.metrics {
        let sources = Arc::new(metrics::Sources::default());
        let at = metrics::spawn(addr, sources.clone())
            .map_err(|e| CliError::Failed(format!("cannot serve metrics on {addr}: {e}")))?;
        eprintln!("xfer: metrics on http://{at}/metrics");
        a.metrics_sources = Some(sources);
    }
    // The NICs of each worker's rails (auto resolves to tcp unless the server picks
    // cuda-ipc, which runs on no NIC).
    let choices =
        nics::per_worker(&a.backend, a.per_gpu, ctl_addr.ip(), false).map_err(CliError::Usage)?;
    let first = choices
        .first()
        .cloned()
        .unwrap_or_else(|| NicChoice::unbound(""));
    a.knobs.rails = a.knobs.rails_asked.unwrap_or(first.default_rails(1));
    crate::setup::check_rails(a.knobs.rails).map_err(CliError::Usage)?;
    let a = a;
    let k = &a.knobs;
    if a.baseline {
        let why = if a.per_gpu {
            Some("--baseline runs one worker: leave out --per-gpu")
        } else if k.latency {
            Some("--baseline measures throughput: leave out --latency")
        } else if a.backend.transport == TransportKind::CudaIpc {
            Some("--baseline compares with TCP streams; cuda-ipc is not a network path")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(CliError::Usage(why.into()));
        }
    }
    if k.latency {
        if a.per_gpu {
            return Err(CliError::Usage(
                "--latency runs one worker: leave out --per-gpu".into(),
            ));
        }
        return bench_latency(&a, ctl_addr, &w, &first);
    }
    if !a.per_gpu {
        let pins = WorkerPins::for_this_machine(k.pin);
        let rails = (pins.rail_pins(pins.initiator, k.rails, 0), pins.initiator);
        let (b, report, verified, baseline) =
            bench_worker(&a, ctl_addr, &w, None, rails, None, &first)?;
        let summary =
            Summary::of(&b, a.backend.transport, k, &report, verified, baseline).with_nics(&first);
        print_summary(&summary, k.json);
        return Ok(());
    }
    check_per_gpu(&a.backend)?;
    let pins = gpu_worker_pins(&a.backend, k.pin, k.rails);
    let results = demo::run_workers(&pins, |slot, p, start| {
        let rails = (pad(&p.initiator, k.rails), p.home);
        bench_worker(
            &a,
            ctl_addr,
            &w,
            Some(slot),
            rails,
            Some(start),
            &choices[slot],
        )
    });
    // Every worker took the server's path for its memory; report the first one's.
    let b = match results.iter().find_map(|r| r.as_ref().ok()) {
        Some((b, _, _, _)) => b.clone(),
        None => a.backend.clone(),
    };
    let results = results
        .into_iter()
        .map(|r| r.map(|(_, report, verified, _)| (report, verified)))
        .collect();
    let s = demo::per_gpu_summary(&b, a.backend.transport, k, results, &pins)?;
    demo::print_per_gpu(&s, k.json);
    Ok(())
}

/// `bench --latency`: transfers one at a time to the server's region, then the raw TCP
/// ping-pong against the echo the server opens (the same path's floor).
fn bench_latency(
    a: &BenchArgs,
    ctl_addr: SocketAddr,
    w: &Workload,
    nics: &NicChoice,
) -> Result<(), CliError> {
    let k = &a.knobs;
    let pins = WorkerPins::for_this_machine(k.pin);
    let rail_pins = pins.rail_pins(pins.initiator, k.rails, 0);
    let (b, mut ctl, group, s, peer, region, _, _) =
        set_up_bench_worker(a, ctl_addr, None, rail_pins, pins.initiator, nics)?;
    let count = latency::sample_count(w);
    let (mut times, mut imm) = latency::run_transfers(&group, &s, &peer, &region, None, w, count)?;
    let echo = ctl.echo(w.page_size, w.pages).map_err(CliError::Failed)?;
    let raw = TcpStream::connect_timeout(&echo, Duration::from_secs(5)).and_then(|mut c| {
        c.set_read_timeout(Some(Duration::from_secs(30)))?;
        crate::raw_auth::answer(&c, ctl.token(), crate::raw_auth::ECHO_CONTEXT)?;
        latency::ping_pong(&mut c, w.page_size, w.pages, w.region_size, count, w.seed)
    });
    let mut raw =
        raw.map_err(|e| CliError::Failed(format!("raw TCP ping-pong with {echo}: {e}")))?;
    latency::summary(
        b.transport.name(),
        group.rails().len(),
        b.busy_poll_us,
        w,
        &mut times,
        &mut imm,
        &mut raw,
    )
    .at_peer(&a.target)
    .print(k.json);
    Ok(())
}

/// What a bench worker measured: the backend as the server resolved it, the run, whether
/// the peer checked the bytes, and with `--baseline` the raw streams' Gbps and what they
/// were.
type BenchResult = (
    BackendArgs,
    RunReport,
    bool,
    Option<crate::baseline::Measured>,
);

/// One bench worker: its own control connection (to server worker `worker`), rails, source
/// region (on `--gpus[worker]`, or the first), run and verification, then with
/// `--baseline` (one worker only) the raw streams ([`baseline_streams`]).
pub(crate) fn bench_worker(
    a: &BenchArgs,
    ctl_addr: SocketAddr,
    w: &Workload,
    worker: Option<usize>,
    (rail_pins, home): (Vec<Option<CorePin>>, Option<CorePin>),
    start: Option<&Barrier>,
    nics: &NicChoice,
) -> Result<BenchResult, CliError> {
    let k = &a.knobs;
    let set_up = set_up_bench_worker(a, ctl_addr, worker, rail_pins, home, nics);
    if let Some(barrier) = start {
        barrier.wait();
    }
    let (b, mut ctl, group, s, peer, region, server_rails, local) = set_up?;
    if a.baseline && b.transport == TransportKind::CudaIpc {
        return Err(CliError::Usage(
            "--baseline compares with TCP streams, and the server chose cuda-ipc (not a \
             network path): ask for --transport tcp, or leave out --baseline"
                .into(),
        ));
    }
    let mut progress =
        progress::Progress::new(k.json || worker.is_some()).label(k.op.direction().name());
    let report = workload::run(&group, &s, &peer, &region, w, &mut progress)?;
    let verified = if k.no_verify {
        false
    } else if k.op == crate::OpArg::Read {
        // Read: the bytes landed here.
        let pages = report.written_pages();
        let (bad, first) = workload::verify_pages(&*local, k.page_size, k.seed, &pages)?;
        if bad > 0 {
            return Err(CliError::Mismatch(format!(
                "{bad} of {} pages read differ from the peer's pattern (first: page {})",
                pages.len(),
                first.unwrap_or(0)
            )));
        }
        true
    } else {
        let pages = report.written_pages();
        let v = ctl
            .verify(k.seed, k.page_size, pages)
            .map_err(CliError::Failed)?;
        if v.mismatches > 0 {
            return Err(CliError::Mismatch(format!(
                "{} of {} pages differ at the peer (first: page {})",
                v.mismatches,
                v.checked,
                v.first_mismatch.unwrap_or(0)
            )));
        }
        true
    };
    let baseline = if a.baseline {
        let rails = group.rails().len();
        // Rails on tcp NICs leave on them; efa NICs are no sockets, so its streams leave
        // unbound, toward the server's control address (where its sink listens).
        let (rail_nics, kind) = match b.transport {
            TransportKind::Tcp => (
                nics.per_rail(rails),
                format!(
                    "raw TCP streams, {rails}, one per rail on its NIC, to the server, same bytes"
                ),
            ),
            _ => (
                Vec::new(),
                format!(
                    "raw TCP streams, {rails}, one per rail (unbound: its NICs are not \
                     sockets), to the server, same bytes"
                ),
            ),
        };
        // The engine's rails stop first: their workers take no CPU from the streams, and
        // the source region's memory is free for the streams' buffers.
        drop(peer);
        drop(s);
        drop(group);
        let gbps = baseline_streams(&mut ctl, &server_rails, &rail_nics, rails, report.bytes, k)?;
        Some(crate::baseline::Measured { gbps, kind })
    } else {
        None
    };
    Ok((b, report, verified, baseline))
}

/// `bench --baseline`: one raw TCP stream per rail (rail `i` on `rail_nics[i]`, unbound
/// when empty) to the server's sink listener on the IP of server rail `i mod N`, together
/// moving `bytes` (less what does not divide among the streams); returns their Gbps.
fn baseline_streams(
    ctl: &mut control::ControlClient,
    server_rails: &[Vec<u8>],
    rail_nics: &[nics::RailNic],
    rails: usize,
    bytes: u64,
    k: &crate::Knobs,
) -> Result<f64, CliError> {
    let rails = rails.max(1);
    let per_stream = bytes / rails as u64;
    if per_stream == 0 {
        return Err(CliError::Usage(format!(
            "--baseline: {bytes} bytes do not make a byte for each of {rails} streams"
        )));
    }
    let sinks = ctl
        .sink(rails as u32)
        .map_err(|e| CliError::Failed(format!("baseline: {e}")))?;
    let streams = crate::sink::pair(server_rails, &sinks, rails, rail_nics)
        .map_err(|e| CliError::Failed(format!("baseline: {e}")))?;
    let sent = crate::sink::send(&streams, per_stream, k.region_size, ctl.token())
        .map_err(|e| CliError::Failed(format!("baseline: {e}")))?;
    Ok(sent.gbps())
}

/// What a bench worker holds once connected (last: the server's rail addresses as its
/// hello gave them).
type BenchSetUp = (
    BackendArgs,
    control::ControlClient,
    Arc<fabric_core::engine::RailGroup>,
    fabric_core::engine::GroupRegistration,
    fabric_core::engine::GroupPeer,
    fabric_core::engine::RemoteDescriptor,
    Vec<Vec<u8>>,
    // The local region (where a READ's bytes land).
    std::sync::Arc<dyn fabric_core::MemoryRegion>,
);

fn set_up_bench_worker(
    a: &BenchArgs,
    ctl_addr: SocketAddr,
    worker: Option<usize>,
    rail_pins: Vec<Option<CorePin>>,
    home: Option<CorePin>,
    nics: &NicChoice,
) -> Result<BenchSetUp, CliError> {
    let k = &a.knobs;
    let slot = worker.unwrap_or(0);
    let mut rails = k.rails;
    let mut clock = SetUpClock::start(format!("{rails} rails"), ASKING);
    // A server past its --region-rate says when to ask again: for up to 30 s, bench does.
    let (mut ctl, hello) = control::ControlClient::connect_hello(
        ctl_addr,
        Duration::from_secs(5),
        Duration::from_secs(30),
        (
            a.backend.transport.name(),
            a.backend.memory.name(),
            worker.map(|w| w as u32),
            a.backend.auth_token.as_deref(),
        ),
    )
    .map_err(CliError::Failed)?;
    // The server resolved `auto`; its answer is the path both sides use.
    let mut b = a.backend.clone();
    b.transport = TransportKind::from_name(&hello.transport)
        .filter(|k| *k != TransportKind::Auto)
        .ok_or_else(|| {
            CliError::Failed(format!(
                "the peer chose an unknown transport {:?}",
                hello.transport
            ))
        })?;
    if hello.region.len() < k.region_size {
        return Err(CliError::Usage(format!(
            "the peer's region is {} but --region-size is {}: lower --region-size",
            size::format_size(hello.region.len()),
            size::format_size(k.region_size)
        )));
    }
    let mut addresses = Vec::with_capacity(hello.addresses.len());
    let mut server_rails = Vec::with_capacity(hello.addresses.len());
    for text in &hello.addresses {
        let mut a = address_from_text(text).map_err(CliError::Failed)?;
        server_rails.push(a.clone());
        // A server listening on every interface reports 0.0.0.0: use the control address.
        if let Ok(sa) = TcpTransport::parse_address(&a)
            && sa.ip().is_unspecified()
        {
            a = format!(
                "{}{}",
                transport_tcp::ADDRESS_PREFIX,
                SocketAddr::new(ctl_addr.ip(), sa.port())
            )
            .into_bytes();
        }
        addresses.push(a);
    }
    // Without --rails, rails on NICs reach every NIC of the server: at least one rail per
    // distinct address it serves on (rail i goes to its rail i mod N).
    if k.rails_asked.is_none() && !nics.nics.is_empty() {
        let mut ips: Vec<IpAddr> = addresses
            .iter()
            .filter_map(|a| TcpTransport::parse_address(a).ok().map(|s| s.ip()))
            .collect();
        ips.sort();
        ips.dedup();
        rails = rails.max(ips.len());
        crate::setup::check_rails(rails).map_err(CliError::Usage)?;
    }
    let rail_pins = pad(&rail_pins, rails);
    let rail_nics = match b.transport {
        TransportKind::Tcp | TransportKind::Efa => nics.per_rail(rails),
        _ => Vec::new(),
    };
    let local_ip = if ctl_addr.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    // The region is filled before the rails start, whose idle workers would take CPU from
    // the fill.
    clock.stage(MEMORY);
    if let Some(p) = home {
        p.prefer_memory_here(&format!("xfer-main-{slot}"));
    }
    let read = k.op == crate::OpArg::Read;
    let src = b.alloc(k.region_size, slot)?;
    if read {
        // The peer's region holds the pattern; ours receives it.
        ctl.fill(k.seed).map_err(CliError::Failed)?;
    } else {
        workload::fill_pattern(&*src, k.seed)?;
    }
    clock.stage(STARTING);
    let group = b.spawn_group(
        local_ip,
        rails,
        &format!("xfer-initiator-{slot}"),
        rail_pins,
        slot,
        &rail_nics,
    )?;
    let group = Arc::new(group);
    if let Some(sources) = &a.metrics_sources {
        sources.add_group(format!("bench-{slot}"), &group);
    }
    clock.stage(REGISTERING);
    let access = if read {
        Access::LOCAL_WRITE
    } else {
        Access::NONE
    };
    let s = group.register(src.clone(), access)?;
    clock.stage(CONNECTING);
    let peer = group.add_peer(&addresses)?;
    clock.stage(WARMING_UP);
    warm_up(&group, &s, &peer, &hello.region, k)?;
    clock.finish();
    Ok((b, ctl, group, s, peer, hello.region, server_rails, src))
}

/// A serving worker: its position in --gpus, the pins of its rails (the same for each of its
/// groups, one per path), and the core whose node its memory should come from.
type ServeWorker = (usize, Vec<Option<CorePin>>, Option<CorePin>);

/// Runs `xfer serve` until the process is stopped.
pub fn serve(mut a: ServeArgs) -> Result<(), CliError> {
    if a.backend.transport == TransportKind::Mem {
        return Err(CliError::Usage(
            "--transport mem works only inside one process: use xfer demo".into(),
        ));
    }
    if let Some(r) = a.rails_asked {
        crate::setup::check_rails(r).map_err(CliError::Usage)?;
    }
    a.backend.check_available()?;
    let listener = TcpListener::bind(a.listen)
        .map_err(|e| CliError::Failed(format!("cannot listen on {}: {e}", a.listen)))?;
    let ctl = listener
        .local_addr()
        .map_err(|e| CliError::Failed(e.to_string()))?;
    let data_ip = a.data_listen.unwrap_or(ctl.ip());
    // The NICs of each worker's tcp or efa rails (cuda-ipc runs on none).
    let choices =
        nics::per_worker(&a.backend, a.per_gpu, data_ip, true).map_err(CliError::Usage)?;
    let first = choices
        .first()
        .cloned()
        .unwrap_or_else(|| NicChoice::unbound(""));
    a.rails = a.rails_asked.unwrap_or(first.default_rails(4));
    crate::setup::check_rails(a.rails).map_err(CliError::Usage)?;
    let a = a;
    // The paths this server offers: `auto` serves tcp to everyone and, with GPU memory,
    // cuda-ipc to clients on this host that hold GPU memory too.
    let kinds = match a.backend.transport {
        TransportKind::Auto
            if a.backend.memory == MemoryKind::Cuda && gpu_mem::driver_present() =>
        {
            vec![TransportKind::Tcp, TransportKind::CudaIpc]
        }
        TransportKind::Auto => vec![TransportKind::Tcp],
        k => vec![k],
    };
    // Rails per worker: one worker, or one per GPU (pinned near it), each running a group
    // per path. A server is the target of its clients' transfers, so its groups take the
    // target's cores, as `demo`'s target does: the initiator's cores are the ones a `bench`
    // on the same host pins its own workers to, and two busy workers pinned to one core
    // share it (shm, whose workers both poll, moved 25-31 Gbps instead of 62-65 on a 2-core
    // VM). Its paths share those cores: a client uses one path at a time.
    let plans: Vec<ServeWorker> = if a.per_gpu {
        check_per_gpu(&a.backend)?;
        gpu_worker_pins(&a.backend, a.pin, a.rails)
            .into_iter()
            .enumerate()
            .map(|(slot, p): (usize, GpuWorkerPins)| (slot, pad(&p.target, a.rails), p.home))
            .collect()
    } else {
        let pins = WorkerPins::for_this_machine(a.pin);
        vec![(0, pins.serve_pins(a.rails), pins.initiator)]
    };
    let stats = Arc::new(control::ServeStats::default());
    let clock = SetUpClock::start(
        format!(
            "{} rails for each of {} group(s)",
            a.rails,
            plans.len() * kinds.len()
        ),
        STARTING,
    );
    let mut groups = Vec::new();
    for (slot, rail_pins, _) in &plans {
        for kind in &kinds {
            let mut b = a.backend.clone();
            b.transport = *kind;
            let rail_nics = match kind {
                TransportKind::Tcp | TransportKind::Efa => choices[*slot].per_rail(a.rails),
                _ => Vec::new(),
            };
            let g = b.spawn_group(
                data_ip,
                a.rails,
                &format!("xfer-serve-{}-{slot}", kind.name()),
                rail_pins.clone(),
                *slot,
                &rail_nics,
            )?;
            groups.push(ServedGroup {
                kind: *kind,
                worker: *slot,
                group: Arc::new(g),
            });
        }
    }
    clock.finish();
    if let Some(addr) = a.metrics {
        let sources = Arc::new(metrics::Sources::default());
        for g in &groups {
            sources.add_group(format!("{}-{}", g.kind.name(), g.worker), &g.group);
        }
        sources.set_serve(stats.clone());
        let at = metrics::spawn(addr, sources)
            .map_err(|e| CliError::Failed(format!("cannot serve metrics on {addr}: {e}")))?;
        eprintln!("xfer: metrics on http://{at}/metrics");
    }
    for (slot, c) in choices.iter().enumerate() {
        if !c.nics.is_empty() {
            let nics: Vec<String> = c
                .nics
                .iter()
                .map(|n| match n.ip {
                    Some(ip) => format!("{} ({ip})", n.name),
                    None => n.name.clone(),
                })
                .collect();
            eprintln!(
                "xfer: worker {slot}: rails on NICs {}; {}",
                nics.join(", "),
                c.reason
            );
        }
    }
    eprintln!(
        "xfer: serving {} on {} rails{}",
        kinds
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(" and "),
        a.rails,
        if a.per_gpu {
            format!(" for each of {} GPU workers", plans.len())
        } else {
            String::new()
        }
    );
    if ctl.ip().is_unspecified() {
        eprintln!(
            "xfer: listening on every interface; peers use this machine's address in place of {}",
            ctl.ip()
        );
    }
    if a.backend.auth_token.is_some() {
        eprintln!("xfer: clients need the same --auth-token (or XFER_AUTH_TOKEN)");
    } else if !ctl.ip().is_loopback() {
        eprintln!(
            "xfer: warning: serving {} without --auth-token: anyone who reaches it can write \
             the regions it hands out",
            ctl
        );
    }
    // Published before the bench line is printed: whoever read that line finds the record.
    let _publication = crate::members::publish(
        &a.publish,
        crate::members::Offer {
            ctl,
            transport: kinds[0].name(),
            addresses: groups
                .first()
                .map(|g| g.group.addresses())
                .unwrap_or_default(),
            memory: a.backend.memory,
            gpu: (a.backend.memory == MemoryKind::Cuda)
                .then(|| a.backend.gpus.first().copied())
                .flatten(),
            nics: &first,
        },
    )?;
    println!("{}", bench_line(ctl, &a, &kinds));
    use std::io::Write;
    let _ = std::io::stdout().flush();
    control::serve(
        listener,
        groups,
        a.region_size,
        a.backend.clone(),
        plans.first().and_then(|p| p.2),
        a.limits.clone(),
        stats,
    )
    .map_err(|e| CliError::Failed(e.to_string()))
}

/// The `xfer bench` command that uses what this server offers: all its rails, its region
/// size (and pages that fit in it), its transport where `auto` would not pick it, and its
/// workers with `--per-gpu`. Never the token.
fn bench_line(ctl: SocketAddr, a: &ServeArgs, kinds: &[TransportKind]) -> String {
    let mut line = format!(
        "xfer bench --peer xfer://{ctl} --rails {} --region-size {}",
        a.rails,
        size::exact(a.region_size)
    );
    let mut page = size::parse_size(crate::DEFAULT_PAGE_SIZE).expect("the default parses");
    if a.region_size < page {
        page = (a.region_size / 8 * 8).max(8);
        line.push_str(&format!(" --page-size {}", size::exact(page)));
    }
    let fit = a.region_size / page;
    if fit < crate::DEFAULT_PAGES {
        line.push_str(&format!(" --pages {}", fit.max(1)));
    }
    match kinds {
        [TransportKind::Tcp] => {}
        // Both: auto picks cuda-ipc for GPU memory on this host, tcp elsewhere.
        [TransportKind::Tcp, TransportKind::CudaIpc] => line.push_str(" --memory cuda"),
        [TransportKind::CudaIpc] => line.push_str(" --transport cuda-ipc --memory cuda"),
        [k] => {
            line.push_str(&format!(" --transport {}", k.name()));
            if let Some(p) = &a.backend.provider {
                line.push_str(&format!(" --provider {p}"));
            }
        }
        _ => {}
    }
    if a.per_gpu {
        let gpus: Vec<String> = a.backend.gpus.iter().map(u32::to_string).collect();
        line.push_str(&format!(" --per-gpu --gpus {}", gpus.join(",")));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn line_of(args: &[&str], kinds: &[TransportKind]) -> String {
        let cli = crate::Cli::try_parse_from(["xfer", "serve"].iter().chain(args)).unwrap();
        let crate::Cmd::Serve(mut a) = cli.cmd else {
            panic!("not serve")
        };
        // What serve makes of --rails on loopback (no NIC chosen).
        a.rails = a.rails_asked.unwrap_or(4);
        bench_line("127.0.0.1:7471".parse().unwrap(), &a, kinds)
    }

    #[test]
    fn the_bench_line_names_what_the_server_offers() {
        let tcp = [TransportKind::Tcp];
        assert_eq!(
            line_of(&[], &tcp),
            "xfer bench --peer xfer://127.0.0.1:7471 --rails 4 --region-size 1GiB"
        );
        assert_eq!(
            line_of(&["--region-size", "32KiB", "--rails", "2"], &tcp),
            "xfer bench --peer xfer://127.0.0.1:7471 --rails 2 --region-size 32KiB \
             --page-size 32KiB --pages 1"
        );
        let efa = line_of(
            &[
                "--transport",
                "efa",
                "--provider",
                "tcp",
                "--auth-token",
                "s3cret",
            ],
            &[TransportKind::Efa],
        );
        assert!(efa.ends_with(" --transport efa --provider tcp"), "{efa}");
        assert!(!efa.contains("s3cret"), "{efa}");
        let gpus = line_of(
            &["--per-gpu", "--memory", "cuda", "--gpus", "0,1"],
            &[TransportKind::Tcp, TransportKind::CudaIpc],
        );
        assert!(
            gpus.ends_with(" --memory cuda --per-gpu --gpus 0,1"),
            "{gpus}"
        );
        // A region that no unit states exactly travels in bytes.
        assert!(line_of(&["--region-size", "1000000"], &tcp).contains("--region-size 1000000 "));
    }
}
