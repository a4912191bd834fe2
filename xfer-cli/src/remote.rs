//! `xfer serve` and `xfer bench`: the two ends of a transfer between processes (or hosts).
//! Both are agents of the library; they meet through its rendezvous (`serve` runs
//! [`xfer::rendezvous::serve`] with [`Served`], `bench` says hello with
//! [`xfer::rendezvous::hello`]) and then move data over the transport both offer. With
//! `--per-gpu` both run one agent per entry of their `--gpus`, and bench worker *i* writes
//! to server worker *i*.

use crate::backend::TransportArg;
use crate::control::{self, BenchClient, REGION};
use crate::demo::{WorkerPlace, gpu_worker_pins, pad, run_workers};
use crate::served::Served;
use crate::setup::{
    ALLOCATING, ASKING, CONNECTING, FILLING, REGISTERING, STARTING, SetUpClock, WARMING_UP,
};
use crate::workload::{self, RunReport, Workload};
use crate::{
    BenchArgs, CliError, OpArg, ServeArgs, Summary, latency, metrics, print_summary, progress,
    size, warm_up, workload_of,
};
use fabric_core::MemoryRegion;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::{Arc, Barrier};
use std::time::Duration;
use xfer::layers::AgentLayers;
use xfer::layers::raw_auth;
use xfer::rendezvous::{self, Welcome};
use xfer::{
    Access, Agent, AgentOptions, Peer, Region, RegionDescriptor, Role, TransportChoice,
    TransportKind,
};

/// Runs `xfer bench`.
pub fn bench(mut a: BenchArgs) -> Result<(), CliError> {
    if a.peers.is_some() {
        return crate::members::bench_all(a);
    }
    a.target = crate::members::resolve_peer(&a)?;
    let w = workload_of(&a.knobs)?;
    if a.backend.transport == TransportArg::Mem {
        return Err(CliError::Usage(
            "--transport mem works only inside one process: use xfer demo".into(),
        ));
    }
    let ctl_addr = control::parse_peer(&a.target).map_err(CliError::Usage)?;
    let k = &a.knobs;
    if a.baseline {
        let why = if a.per_gpu {
            Some("--baseline runs one worker: leave out --per-gpu")
        } else if k.latency {
            Some("--baseline measures throughput: leave out --latency")
        } else if a.backend.transport == TransportArg::CudaIpc {
            Some("--baseline compares with TCP streams; cuda-ipc is not a network path")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(CliError::Usage(why.into()));
        }
    }
    if k.latency && a.per_gpu {
        return Err(CliError::Usage(
            "--latency runs one worker: leave out --per-gpu".into(),
        ));
    }
    a.backend.check_gpus()?;
    if let Some(addr) = a.metrics {
        let sources = Arc::new(metrics::Sources::default());
        let at = metrics::spawn(addr, sources.clone())
            .map_err(|e| CliError::io(format!("cannot serve metrics on {addr}"), e))?;
        eprintln!("xfer: metrics on http://{at}/metrics");
        a.metrics_sources = Some(sources);
    }
    let a = a;
    let k = &a.knobs;
    if k.latency {
        return bench_latency(&a, ctl_addr, &w);
    }
    if !a.per_gpu {
        let r = bench_worker(&a, ctl_addr, &w, None, None, None)?;
        let summary = Summary::of(&r.path, k, &r.report, r.verified, r.baseline);
        print_summary(&summary.with_nics(r.nics), k.json);
        return Ok(());
    }
    a.backend.check_per_gpu()?;
    // One core per rail of every worker: the rails are counted before any agent is built.
    let rails = match k.rails_asked {
        Some(r) => r,
        None => {
            let o = bench_options(&a, ctl_addr, 0, None)?;
            xfer::layers::lanes::nic_choice(&o, a.backend.nic_transport())?.default_rails(1)
        }
    };
    let pins = gpu_worker_pins(&a.backend.gpus, k.pin, rails);
    let results = run_workers(&pins, |slot, p, start| {
        let place = WorkerPlace {
            rails: pad(&p.initiator, rails),
            home: p.home,
        };
        bench_worker(&a, ctl_addr, &w, Some(slot), Some(place), Some(start))
    });
    // Every worker took the server's path for its memory; report the first one's.
    let path = results
        .iter()
        .find_map(|r| r.as_ref().ok())
        .map(|r| r.path.clone());
    let results = results
        .into_iter()
        .map(|r| r.map(|r| (r.report, r.verified)))
        .collect();
    let s = crate::demo::per_gpu_summary(path, &a.backend, k, rails, results, &pins)?;
    crate::demo::print_per_gpu(&s, k.json);
    Ok(())
}

/// The options of bench worker `slot`'s agent, toward the server at `ctl_addr`: it listens
/// on every interface (on loopback only toward a server on loopback: nothing else need
/// reach it) and chooses its NICs toward the server.
fn bench_options(
    a: &BenchArgs,
    ctl_addr: SocketAddr,
    slot: usize,
    rails: Option<usize>,
) -> Result<AgentOptions, CliError> {
    Ok(AgentOptions {
        role: Role::Initiator,
        worker: slot,
        gpu: a.backend.gpu(slot)?,
        listen: if ctl_addr.ip().is_loopback() {
            ctl_addr.ip()
        } else {
            unspecified(ctl_addr)
        },
        toward: Some(ctl_addr.ip()),
        ..a.backend
            .options(a.knobs.pin, rails.or(a.knobs.rails_asked))?
    })
}

/// The unspecified address of `addr`'s family.
fn unspecified(addr: SocketAddr) -> IpAddr {
    if addr.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    }
}

/// `bench --latency`: transfers one at a time to the server's region, then the raw TCP
/// ping-pong against the echo the server opens (the same path's floor).
fn bench_latency(a: &BenchArgs, ctl_addr: SocketAddr, w: &Workload) -> Result<(), CliError> {
    let k = &a.knobs;
    let mut s = set_up_bench_worker(a, ctl_addr, None, None)?;
    let count = latency::sample_count(w);
    let (mut times, mut imm) =
        latency::run_transfers(&s.agent, &s.src, &s.peer, &s.remote, None, w, count)?;
    let echo = s.ctl.echo(w.page_size, w.pages)?;
    let congestion = a.backend.congestion();
    let raw = congestion
        .connect(echo, Some(Duration::from_secs(5)))
        .and_then(|mut c| {
            c.set_read_timeout(Some(Duration::from_secs(30)))?;
            raw_auth::answer(&c, s.ctl.token(), raw_auth::ECHO_CONTEXT)?;
            latency::ping_pong(&mut c, w.page_size, w.pages, w.region_size, count, w.seed)
        });
    let mut raw = raw.map_err(|e| CliError::io(format!("raw TCP ping-pong with {echo}"), e))?;
    let kind = s.peer.transport();
    latency::summary(
        kind.name(),
        rails_of(&s.agent, kind),
        a.backend.busy_poll_us,
        w,
        &mut times,
        &mut imm,
        &mut raw,
    )
    .at_peer(&a.target)
    .print(k.json);
    Ok(())
}

/// The rails of `agent`'s transport `kind`.
fn rails_of(agent: &Agent, kind: TransportKind) -> usize {
    agent.group(kind).map_or(0, |g| g.rails().len())
}

/// What a bench worker measured: the path it took (transport, why, memory), how its NICs
/// were chosen, the run, whether the bytes were checked, and with `--baseline` the raw
/// streams' Gbps and what they were.
pub(crate) struct BenchResult {
    pub path: crate::Path,
    pub nics: String,
    pub report: RunReport,
    pub verified: bool,
    pub baseline: Option<crate::baseline::Measured>,
}

/// One bench worker: its own agent and control connection (to server worker `worker`),
/// source region, run and verification, then with `--baseline` (one worker only) the raw
/// streams ([`baseline_streams`]). `place`: its rails' cores when the caller placed them
/// (`--per-gpu`); `start`: a barrier of all workers before the timed work.
pub(crate) fn bench_worker(
    a: &BenchArgs,
    ctl_addr: SocketAddr,
    w: &Workload,
    worker: Option<usize>,
    place: Option<WorkerPlace>,
    start: Option<&Barrier>,
) -> Result<BenchResult, CliError> {
    let k = &a.knobs;
    let set_up = set_up_bench_worker(a, ctl_addr, worker, place);
    if let Some(barrier) = start {
        barrier.wait();
    }
    let s = set_up?;
    let kind = s.peer.transport();
    if a.baseline && kind == TransportKind::CudaIpc {
        return Err(CliError::Usage(
            "--baseline compares with TCP streams, and the server chose cuda-ipc (not a \
             network path): ask for --transport tcp, or leave out --baseline"
                .into(),
        ));
    }
    let path = crate::Path::of(
        a.backend.transport.choice(),
        s.agent.info(),
        &s.welcome.agent,
        kind,
    );
    let nic_choice = s.agent.nics(kind).cloned();
    let nics = nic_choice
        .as_ref()
        .map(crate::nics_text)
        .unwrap_or_default();
    let mut progress =
        progress::Progress::new(k.json || worker.is_some()).label(k.op.direction().name());
    let report = workload::run(&s.agent, &s.src, &s.peer, &s.remote, w, &mut progress)?;
    let BenchSetUp {
        agent,
        mut ctl,
        welcome,
        peer,
        src,
        local,
        ..
    } = s;
    let verified = check(k, &mut ctl, &*local, &report)?;
    let baseline = if a.baseline {
        let rails = rails_of(&agent, kind);
        // Rails on tcp NICs leave on them; efa NICs are no sockets, so its streams leave
        // unbound, toward the server's control address (where its sink listens).
        let (rail_nics, what) = match kind {
            TransportKind::Tcp => (
                nic_choice.map(|c| c.per_rail(rails)).unwrap_or_default(),
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
        let server_rails = welcome
            .agent
            .transport(kind)
            .map(|t| t.rails.clone())
            .unwrap_or_default();
        // The engine's rails stop first: their workers take no CPU from the streams, and
        // the source region's memory is free for the streams' buffers.
        drop((peer, src, local, agent));
        let congestion = a.backend.congestion();
        let to = (&server_rails[..], &rail_nics[..]);
        let gbps = baseline_streams(&mut ctl, to, rails, report.bytes, k, &congestion)?;
        Some(crate::baseline::Measured { gbps, kind: what })
    } else {
        None
    };
    Ok(BenchResult {
        path,
        nics,
        report,
        verified,
        baseline,
    })
}

/// Checks the pages of `report` where they landed: here in `local` (`--op read`), or at
/// the server (its `verify`); returns whether they were checked (not with --no-verify).
pub(crate) fn check(
    k: &crate::Knobs,
    ctl: &mut BenchClient,
    local: &dyn MemoryRegion,
    report: &RunReport,
) -> Result<bool, CliError> {
    if k.no_verify {
        return Ok(false);
    }
    let pages = report.written_pages();
    if k.op == OpArg::Read {
        let (bad, first) = workload::verify_pages(local, k.page_size, k.seed, &pages)?;
        if bad > 0 {
            return Err(CliError::Mismatch(format!(
                "{bad} of {} pages read differ from the peer's pattern (first: page {})",
                pages.len(),
                first.unwrap_or(0)
            )));
        }
    } else {
        let v = ctl.verify(k.seed, k.page_size, pages)?;
        if v.mismatches > 0 {
            return Err(CliError::Mismatch(format!(
                "{} of {} pages differ at the peer (first: page {})",
                v.mismatches,
                v.checked,
                v.first_mismatch.unwrap_or(0)
            )));
        }
    }
    Ok(true)
}

/// `bench --baseline`: one raw TCP stream per rail (rail `i` on `rail_nics[i]`, unbound
/// when empty) to the server's sink listener on the IP of server rail `i mod N`, together
/// moving `bytes` (less what does not divide among the streams); returns their Gbps.
fn baseline_streams(
    ctl: &mut BenchClient,
    (server_rails, rail_nics): (&[Vec<u8>], &[xfer::layers::nics::RailNic]),
    rails: usize,
    bytes: u64,
    k: &crate::Knobs,
    congestion: &xfer::Congestion,
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
        .map_err(|e| CliError::because("baseline", e))?;
    let streams = crate::sink::pair(server_rails, &sinks, rails, rail_nics)
        .map_err(|e| CliError::failed(format!("baseline: {e}")))?;
    let sent = crate::sink::send(&streams, per_stream, k.region_size, ctl.token(), congestion)
        .map_err(|e| CliError::because("baseline", e))?;
    Ok(sent.gbps())
}

/// What a bench worker holds once connected.
struct BenchSetUp {
    agent: Agent,
    ctl: BenchClient,
    /// What the server said at the hello (its agent, with addresses as reached).
    welcome: Welcome,
    peer: Peer,
    /// The local region, registered.
    src: Region,
    /// Its memory (where a READ's bytes land).
    local: Arc<dyn MemoryRegion>,
    /// The server's region for this client.
    remote: RegionDescriptor,
}

fn set_up_bench_worker(
    a: &BenchArgs,
    ctl_addr: SocketAddr,
    worker: Option<usize>,
    place: Option<WorkerPlace>,
) -> Result<BenchSetUp, CliError> {
    let k = &a.knobs;
    let slot = worker.unwrap_or(0);
    let asked = place.as_ref().map(|p| p.rails.len()).or(k.rails_asked);
    let build = |rails: Option<usize>| -> Result<Agent, CliError> {
        let o = bench_options(a, ctl_addr, slot, rails)?;
        let pins = place.as_ref().map(|p| pad(&p.rails, rails.unwrap_or(1)));
        Ok(Agent::with_pins(o, pins)?)
    };
    let what = asked.map_or("the rails".into(), |r| format!("{r} rails"));
    let mut clock = SetUpClock::start(what, STARTING);
    let mut agent = build(asked)?;
    clock.stage(ASKING);
    let (mut client, mut welcome) = say_hello(a, &agent, ctl_addr, worker)?;
    // Without --rails, rails on NICs reach every NIC of the server: at least one rail per
    // distinct address it serves on (rail i goes to its rail i mod N). The agent is built
    // again with as many, and says hello again.
    let kind = welcome.transport;
    let on_nics = agent.nics(kind).is_some_and(|c| !c.nics.is_empty());
    if k.rails_asked.is_none() && on_nics {
        let ips = server_ips(&welcome, kind);
        if ips > rails_of(&agent, kind) {
            xfer::layers::lanes::check_rails(ips)?;
            drop((client, agent));
            clock.stage(STARTING);
            agent = build(Some(ips))?;
            clock.stage(ASKING);
            (client, welcome) = say_hello(a, &agent, ctl_addr, worker)?;
        }
    }
    let mut ctl = BenchClient(client);
    let kind = welcome.transport;
    let remote = region_of(&welcome, k)?;
    if let (Some(sources), Some(g)) = (&a.metrics_sources, agent.group(kind)) {
        sources.add_group(format!("bench-{slot}"), g);
    }
    clock.stage(ALLOCATING);
    if let Some(p) = place.as_ref().map_or(agent.home(), |p| p.home) {
        p.prefer_memory_here(&format!("xfer-main-{slot}"));
    }
    let read = k.op == OpArg::Read;
    let local = crate::backend::alloc(agent.info().memory, k.region_size)?;
    clock.stage(FILLING);
    if read {
        // The peer's region holds the pattern; ours receives it.
        ctl.fill(k.seed)?;
    } else {
        workload::fill_pattern(&*local, k.seed)?;
    }
    clock.stage(REGISTERING);
    let access = if read {
        Access::LOCAL_WRITE
    } else {
        Access::NONE
    };
    let src = agent.register(local.clone(), access)?;
    clock.stage(CONNECTING);
    let peer = agent.connect(&welcome.agent)?;
    clock.stage(WARMING_UP);
    warm_up(&agent, &peer, &src, &remote, k)?;
    clock.finish();
    Ok(BenchSetUp {
        agent,
        ctl,
        welcome,
        peer,
        src,
        local,
        remote,
    })
}

/// Says hello as `agent` to the server at `ctl_addr` (its worker `worker`), with the token
/// of --auth-token. A server past its --region-rate, or full, says when to ask again: for up
/// to 30 s, bench does.
pub(crate) fn say_hello(
    a: &BenchArgs,
    agent: &Agent,
    ctl_addr: SocketAddr,
    worker: Option<usize>,
) -> Result<(rendezvous::Client, Welcome), CliError> {
    Ok(rendezvous::hello(
        ctl_addr,
        Duration::from_secs(5),
        Duration::from_secs(30),
        agent.info(),
        worker.map(|w| w as u32),
        a.backend.token()?.as_deref(),
    )?)
}

/// The region the server gave this client at its hello, at least --region-size.
pub(crate) fn region_of(welcome: &Welcome, k: &crate::Knobs) -> Result<RegionDescriptor, CliError> {
    let remote = welcome
        .regions
        .get(REGION)
        .cloned()
        .ok_or_else(|| CliError::failed(format!("the peer offers no region {REGION:?}")))?;
    if remote.len < k.region_size {
        return Err(CliError::Usage(format!(
            "the peer's region is {} but --region-size is {}: lower --region-size",
            size::format_size(remote.len),
            size::format_size(k.region_size)
        )));
    }
    Ok(remote)
}

/// The distinct IPs the server's `kind` rails serve on (none for rails that are not TCP).
fn server_ips(welcome: &Welcome, kind: TransportKind) -> usize {
    let mut ips: Vec<IpAddr> = welcome
        .agent
        .transport(kind)
        .map(|t| t.rails.as_slice())
        .unwrap_or_default()
        .iter()
        .filter_map(|a| transport_tcp::TcpTransport::parse_address(a).ok())
        .map(|s| s.ip())
        .collect();
    ips.sort();
    ips.dedup();
    ips.len()
}

/// Runs `xfer serve` until the process is stopped.
pub fn serve(a: ServeArgs) -> Result<(), CliError> {
    if a.backend.transport == TransportArg::Mem {
        return Err(CliError::Usage(
            "--transport mem works only inside one process: use xfer demo".into(),
        ));
    }
    if let Some(r) = a.rails_asked {
        xfer::layers::lanes::check_rails(r)?;
    }
    a.backend.check_gpus()?;
    let workers = if a.per_gpu {
        a.backend.check_per_gpu()?;
        a.backend.gpus.len()
    } else {
        1
    };
    let listener = TcpListener::bind(a.listen)
        .map_err(|e| CliError::io(format!("cannot listen on {}", a.listen), e))?;
    let ctl = listener
        .local_addr()
        .map_err(|e| CliError::io("the control address", e))?;
    // Where peers reach the control port, for the directory (checked before anything is
    // built).
    let publish = crate::members::Publishing::of(&a.publish, ctl)?;
    let data_ip = a.data_listen.unwrap_or(ctl.ip());
    // A server is the target of its clients' transfers: its agents take the target's cores,
    // as `demo`'s target does (a `bench` on the same host pins its own workers to the
    // initiator's, and two busy workers pinned to one core share it: shm, whose workers both
    // poll, moved 25-31 Gbps instead of 62-65 on a 2-core VM). Its transports share those
    // cores: a client uses one at a time.
    let options = |slot: usize, rails: Option<usize>| -> Result<AgentOptions, CliError> {
        let mut o = a.backend.options(a.pin, rails)?;
        // A server never takes its clients' notifications: its rails count them (metrics)
        // and keep none, so that no client can make them hold memory.
        o.workers.notification_keys = Some(0);
        Ok(AgentOptions {
            name: (slot == 0)
                .then(|| publish.as_ref().map(|p| p.name.clone()))
                .flatten(),
            role: Role::Target,
            worker: slot,
            gpu: a.backend.gpu(slot)?,
            listen: data_ip,
            control: publish.as_ref().map(|p| p.control.to_string()),
            ..o
        })
    };
    // Rails: --rails, else one per NIC the first worker's network rails choose, else 4
    // (clients' rails are spread over them).
    let rails = match a.rails_asked {
        Some(r) => r,
        None => xfer::layers::lanes::nic_choice(&options(0, None)?, a.backend.nic_transport())?
            .default_rails(4),
    };
    let pins = a
        .per_gpu
        .then(|| gpu_worker_pins(&a.backend.gpus, a.pin, rails));
    let clock = SetUpClock::start(
        format!("{rails} rails for each of {workers} worker(s)"),
        STARTING,
    );
    let mut agents = Vec::with_capacity(workers);
    for slot in 0..workers {
        let o = options(slot, Some(rails))?;
        let p = pins.as_ref().map(|p| pad(&p[slot].target, rails));
        agents.push(Agent::with_pins(o, p)?);
    }
    clock.finish();
    let stats = Arc::new(rendezvous::ServeStats::default());
    if let Some(addr) = a.metrics {
        let sources = Arc::new(metrics::Sources::default());
        for (slot, agent) in agents.iter().enumerate() {
            for kind in agent.transports() {
                if let Some(g) = agent.group(kind) {
                    sources.add_group(format!("{}-{slot}", kind.name()), g);
                }
            }
        }
        sources.set_serve(stats.clone());
        let at = metrics::spawn(addr, sources)
            .map_err(|e| CliError::io(format!("cannot serve metrics on {addr}"), e))?;
        eprintln!("xfer: metrics on http://{at}/metrics");
    }
    for (slot, agent) in agents.iter().enumerate() {
        for kind in agent.transports() {
            let Some(c) = agent.nics(kind).filter(|c| !c.nics.is_empty()) else {
                continue;
            };
            let nics: Vec<String> = c
                .nics
                .iter()
                .map(|n| match n.ip {
                    Some(ip) => format!("{} ({ip})", n.name),
                    None => n.name.clone(),
                })
                .collect();
            eprintln!(
                "xfer: worker {slot}: {kind} rails on NICs {}; {}",
                nics.join(", "),
                c.reason
            );
        }
    }
    let kinds = agents[0].transports();
    eprintln!(
        "xfer: serving {} on {rails} rails{}",
        kinds
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(" and "),
        if a.per_gpu {
            format!(" for each of {workers} GPU workers")
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
    let token = a.backend.token()?;
    if token.is_some() {
        eprintln!("xfer: clients need the same --auth-token (or XFER_AUTH_TOKEN)");
    } else if a.backend.require_auth && !ctl.ip().is_loopback() {
        let required = xfer::AuthTokenError::Required {
            what: "the control port".into(),
            address: ctl.to_string(),
        };
        return Err(xfer::Error::from(required).into());
    } else if !ctl.ip().is_loopback() {
        eprintln!(
            "xfer: warning: serving {ctl} without --auth-token: anyone who reaches it can write \
             the regions it hands out"
        );
    }
    // Published before the bench line is printed: whoever read that line finds the record.
    let _publication = match &publish {
        Some(p) => Some(p.publish(&agents[0])?),
        None => None,
    };
    outln!("{}", bench_line(ctl, &a, rails));
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let served = Arc::new(Served {
        region_size: a.region_size,
    });
    rendezvous::serve(listener, agents, a.limits.limits(), stats, token, served)
        .map_err(|e| CliError::io("serving", e))
}

/// The `xfer bench` command that uses what this server offers: all its `rails`, its region
/// size (and pages that fit in it), its transport where `auto` would not pick it, and its
/// workers with `--per-gpu`. Never the token.
fn bench_line(ctl: SocketAddr, a: &ServeArgs, rails: usize) -> String {
    let mut line = format!(
        "xfer bench --peer xfer://{ctl} --rails {rails} --region-size {}",
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
    match a.backend.transport.choice() {
        // auto on both sides picks what both offer: cuda-ipc for GPU memory on this host.
        TransportChoice::Auto => {
            if a.backend.memory == crate::backend::MemoryArg::Cuda {
                line.push_str(" --memory cuda");
            }
        }
        TransportChoice::Only(TransportKind::Tcp) => {}
        TransportChoice::Only(TransportKind::CudaIpc) => {
            line.push_str(" --transport cuda-ipc --memory cuda")
        }
        TransportChoice::Only(k) => {
            line.push_str(&format!(" --transport {}", k.name()));
            if let Some(p) = &a.backend.provider {
                line.push_str(&format!(" --provider {p}"));
            }
        }
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

    fn line_of(args: &[&str]) -> String {
        let cli = crate::Cli::try_parse_from(["xfer", "serve"].iter().chain(args)).unwrap();
        let crate::Cmd::Serve(a) = cli.cmd else {
            panic!("not serve")
        };
        // What serve makes of --rails on loopback (no NIC chosen).
        let rails = a.rails_asked.unwrap_or(4);
        bench_line("127.0.0.1:7471".parse().unwrap(), &a, rails)
    }

    #[test]
    fn the_bench_line_names_what_the_server_offers() {
        assert_eq!(
            line_of(&[]),
            "xfer bench --peer xfer://127.0.0.1:7471 --rails 4 --region-size 1GiB"
        );
        assert_eq!(
            line_of(&["--region-size", "32KiB", "--rails", "2"]),
            "xfer bench --peer xfer://127.0.0.1:7471 --rails 2 --region-size 32KiB \
             --page-size 32KiB --pages 1"
        );
        let efa = line_of(&[
            "--transport",
            "efa",
            "--provider",
            "tcp",
            "--auth-token",
            "s3cret",
        ]);
        assert!(efa.ends_with(" --transport efa --provider tcp"), "{efa}");
        assert!(!efa.contains("s3cret"), "{efa}");
        let gpus = line_of(&["--per-gpu", "--memory", "cuda", "--gpus", "0,1"]);
        assert!(
            gpus.ends_with(" --memory cuda --per-gpu --gpus 0,1"),
            "{gpus}"
        );
        let ipc = line_of(&["--transport", "cuda-ipc", "--memory", "cuda"]);
        assert!(
            ipc.ends_with(" --transport cuda-ipc --memory cuda"),
            "{ipc}"
        );
        // A region that no unit states exactly travels in bytes.
        assert!(line_of(&["--region-size", "1000000"]).contains("--region-size 1000000 "));
    }
}
