//! `xfer`: move scattered memory to a remote node and print Gbps.
//!
//! - `xfer demo`: both ends in one process over loopback, no setup;
//! - `xfer serve`: register memory and wait for peers;
//! - `xfer bench --peer xfer://HOST:PORT`: write random pages into a server's memory;
//! - `xfer topo`: the machine's topology and where the workers go;
//! - `xfer info`: what this machine offers.
//!
//! The command is a thin layer over the `xfer` library: it parses flags into
//! `xfer::AgentOptions` ([`backend`]), builds agents, and prints what they did; the bench
//! workload (pages, patterns, verification, latency, baselines) is its own.
//!
//! Dependencies beyond the workspace's own, each in place of code we wrote by hand:
//! `bytesize` parses and prints sizes (`64KiB`, `4.3 GiB`), `indicatif` draws the progress
//! line (only on a terminal, rate-limited), `fastrand` picks the pages (small, seeded,
//! no dependencies), `hex` spells binary transport addresses, `mimalloc` is the allocator
//! (below). The `--metrics` exposition is the library's (`xfer::metrics`); [`metrics`]
//! serves it over HTTP, with `prometheus-client`'s name of its content type.
//!
//! The allocator is mimalloc: each transfer's plan and completion are allocated by the
//! submitting thread and freed by a rail's worker, and glibc's malloc pays for that hand-off
//! between its per-thread caches. Transfers of 16 pages of 64 bytes, 4 rails of efa over
//! shm on the H200: 2.40 M writes/s with glibc's, 3.00 with mimalloc (medians of 3); the
//! engine alone (`demo --transport mem`, 16 pages a transfer, 4 in flight) 2.79 against
//! 3.83. Large transfers do not notice.
//!
//! mimalloc is built with `no_thp`: it never asks for transparent huge pages for its own
//! heap, while the registered regions still do (`MADV_HUGEPAGE` in gpu-mem: their copies
//! need them). Where THP is `madvise` (Debian's default) a heap that asks for them gets a
//! fresh 2 MiB page, zeroed, the first time a rail touches any of its bytes; a run's first
//! transfers took a dozen of those on the rails' threads, and on a VM whose host backs
//! memory on first touch each cost 15-45 ms. 2-core VM, `scripts/small-pages.sh` with
//! `RUNS=5` and the binary built without `no_thp` as `XFER_B` (ratios to the raw page
//! streams of the same run, medians of 5 interleaved): 4 KiB pages at 2 rails 0.671 →
//! 0.757, at 1 rail 0.865 → 0.983, 64 KiB at 1 rail 0.972 → 1.093, each run faster than its
//! pair; H200 machine, 7 runs: 64 KiB at 1 rail 1.001 → 1.106, 4 KiB at 8 rails 1.051 →
//! 1.046.

/// `println!` for the command's output: where stdout is a pipe whose reader has gone
/// (`xfer info --json | head -c 100`), the command ends quietly with status 141, as a
/// program killed by SIGPIPE would, instead of panicking. (SIGPIPE itself stays ignored:
/// the transports write to sockets whose peers may vanish.)
macro_rules! outln {
    () => {
        crate::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        crate::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` for the command's output, as [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => {
        crate::write_out(format_args!($($arg)*))
    };
}

mod backend;
mod baseline;
mod control;
mod demo;
mod info;
mod kv_bench;
mod latency;
mod members;
mod metrics;
mod progress;
mod remote;
mod served;
mod setup;
mod sink;
mod size;
mod topo;
mod workload;

use backend::{BackendArgs, PinArg};
use clap::{Args, Parser, Subcommand};
use fabric_core::engine::Direction;
use fabric_core::error::report;
use serde::Serialize;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;
use workload::Workload;
use xfer::layers::nics::NicChoice;
use xfer::{Agent, AgentInfo, Peer, Region, RegionDescriptor, TransportChoice, TransportKind};

/// See the crate docs: transfers allocate on one thread and free on another.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "xfer",
    version = env!("XFER_VERSION"),
    about = "Move scattered memory between machines at line rate"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Register a region and serve peers that write into it (until stopped).
    Serve(ServeArgs),
    /// Write random pages into a served region and report the throughput.
    Bench(BenchArgs),
    /// Both ends in one process over loopback: the quickest way to see it work.
    Demo(DemoArgs),
    /// Show the topology (NUMA nodes, GPUs, NICs, PCIe switches) and the placement plan.
    Topo(topo::TopoArgs),
    /// List a cluster's members from the directory, or watch them join and leave.
    Members(members::MembersArgs),
    /// A request's KV cache from prefill ranks into decode ranks of another shape, each
    /// rank a process on this host, against a plain paged write of the same bytes.
    KvBench(kv_bench::KvBenchArgs),
    /// Show the transports, memory, CUDA devices and topology this machine offers.
    Info {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `--page-size` of bench and demo when not given.
pub(crate) const DEFAULT_PAGE_SIZE: &str = "64KiB";
/// `--pages` of bench and demo when not given.
pub(crate) const DEFAULT_PAGES: u64 = 1000;

#[derive(Args, Clone)]
struct Knobs {
    /// Bytes per page (e.g. 4KiB, 64KiB).
    #[arg(long, default_value = DEFAULT_PAGE_SIZE, value_parser = size::parse_size)]
    page_size: u64,
    /// Pages per transfer, chosen at random from the region.
    #[arg(long, default_value_t = DEFAULT_PAGES)]
    pages: u64,
    /// Bytes to move in all.
    #[arg(long, default_value = "8GiB", value_parser = size::parse_size)]
    bytes: u64,
    /// Rails: engines (worker threads, each with its own connection or NIC) that share
    /// every transfer; at most 256. Default: one per NIC of --nics (bench: at least one per
    /// NIC of the server), else 1.
    #[arg(long = "rails", value_name = "N")]
    rails_asked: Option<usize>,
    /// Size of the source region (and of the target region in demo).
    #[arg(long, default_value = "1GiB", value_parser = size::parse_size)]
    region_size: u64,
    /// Transfers in flight at once. Default: 4, and 2 per rail where that is more (a
    /// transfer ends only when every rail's share of it has landed, so with more rails each
    /// needs more in flight to ride out a stall of one of them).
    #[arg(long)]
    depth: Option<usize>,
    /// Seed of the page choice and the data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Skip checking the target's bytes after the run.
    #[arg(long)]
    no_verify: bool,
    /// Skip the warm-up (a zero-length write on every rail before the timed work).
    #[arg(long)]
    no_warmup: bool,
    /// Print one JSON object at the end instead of text.
    #[arg(long)]
    json: bool,
    /// Pin the engine workers to the placement plan's cores (auto), or not (off).
    #[arg(long, value_enum, default_value = "auto")]
    pin: PinArg,
    /// Measure latency instead of throughput: transfers one at a time (depth 1), each
    /// carrying immediate data, as many as --bytes holds (at most 200000); prints
    /// p50/p90/p99/max per transfer, a raw TCP ping-pong of the same pages (the floor;
    /// bench plays it against an echo the server opens) and (demo only) the time from
    /// submit to the target's immediate-data event.
    #[arg(long)]
    latency: bool,
    /// What the transfers do: `write` the pages into the peer's region (the default), or
    /// `read` them from it (one-sided READ: the peer's application does nothing; its
    /// region holds the pattern, and the check is of this side's region after the run).
    #[arg(long, value_enum, default_value = "write")]
    op: OpArg,
}

/// `--op`: which way the pages move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OpArg {
    /// WRITE into the peer's region.
    Write,
    /// READ from the peer's region.
    Read,
}

impl OpArg {
    /// The engine's direction.
    pub(crate) fn direction(self) -> Direction {
        match self {
            OpArg::Write => Direction::Write,
            OpArg::Read => Direction::Read,
        }
    }
}

impl Knobs {
    /// Refuses what `--op read` cannot do (immediate data, hence `--latency`).
    pub(crate) fn check_op(&self) -> Result<(), CliError> {
        if self.op == OpArg::Read && self.latency {
            return Err(CliError::Usage(
                "--latency times transfers by their immediate data, which a READ has not: \
                 leave out --op read or --latency"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[derive(Args)]
struct ServeArgs {
    /// Control address peers connect to (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7471")]
    listen: SocketAddr,
    /// IP address the rails' transports listen on (each picks a free port); defaults to
    /// the control IP.
    #[arg(long)]
    data_listen: Option<IpAddr>,
    /// Size of the region each client gets.
    #[arg(long, default_value = "1GiB", value_parser = size::parse_size)]
    region_size: u64,
    /// Rails (engines, each a worker thread with its own listening transport); clients'
    /// rails are spread over them; at most 256. Default: one per NIC of --nics, else 4.
    #[arg(long = "rails", value_name = "N")]
    rails_asked: Option<usize>,
    #[command(flatten)]
    backend: BackendArgs,
    /// Pin the engine worker to the placement plan's core (auto), or not (off).
    #[arg(long, value_enum, default_value = "auto")]
    pin: PinArg,
    /// One worker per entry of --gpus, each with its own rails pinned near its GPU and its
    /// clients' regions on its GPU; `bench --per-gpu` writes to all of them at once.
    #[arg(long)]
    per_gpu: bool,
    #[command(flatten)]
    limits: served::ServeLimitsArgs,
    #[command(flatten)]
    publish: members::PublishArgs,
    /// Serve Prometheus metrics (text exposition) at http://ADDR/metrics: per-rail bytes,
    /// operations, re-posts, errors and operations in flight, bytes peers wrote here, peers'
    /// state and last error, transfer latency, registered bytes, clients and refusals by
    /// reason. Port 0 picks one; the address is printed on stderr.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
}

#[derive(Args, Clone)]
struct BenchArgs {
    /// The server, as printed by `xfer serve` (xfer://HOST:PORT).
    #[arg(long)]
    peer: Option<String>,
    /// The server by its name in the cluster directory (with --directory).
    #[arg(long, value_name = "NAME")]
    peer_name: Option<String>,
    /// `all`: write to every member of the cluster in turn, for --duration seconds,
    /// following members as they join and leave (with --directory).
    #[arg(long, value_name = "all", value_parser = ["all"])]
    peers: Option<String>,
    /// With --peers all: how long to keep going, in seconds.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    #[command(flatten)]
    dir: members::DirectoryArgs,
    /// The server's control address (from --peer or --peer-name).
    #[arg(skip)]
    target: String,
    #[command(flatten)]
    knobs: Knobs,
    #[command(flatten)]
    backend: BackendArgs,
    /// One worker per entry of --gpus, all at once, each writing to the server's worker of
    /// the same position (start the server with `serve --per-gpu`).
    #[arg(long)]
    per_gpu: bool,
    /// After the run, plain TCP streams to the server with the same bytes, one per rail
    /// on its NIC toward the server rail it writes to, and report the ratio (tcp and efa;
    /// not with --per-gpu or --latency).
    #[arg(long)]
    baseline: bool,
    /// Serve Prometheus metrics of this run's rails at http://ADDR/metrics while it runs
    /// (as `serve --metrics`); the address is printed on stderr.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// What `--metrics` reports (set once it listens).
    #[arg(skip)]
    metrics_sources: Option<std::sync::Arc<metrics::Sources>>,
}

#[derive(Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    knobs: Knobs,
    #[command(flatten)]
    backend: BackendArgs,
    /// After the run, the same work without the engine on the same path, and the ratio:
    /// tcp (host memory): raw TCP streams over loopback, as many as rails, same bytes;
    /// mem: a memcpy of the same pages on as many threads as rails; cuda-ipc: the same
    /// pages copied device to device with batched copies, as many streams as rails. Not
    /// with efa or GPU memory over tcp (no like-for-like run in one process).
    #[arg(long)]
    baseline: bool,
    /// One worker per entry of --gpus, all at once: each with its own rails (pinned to
    /// cores of its GPU's NUMA node, from the placement plan) and its own source and target
    /// regions on its GPU (host memory: on the GPU's node).
    #[arg(long)]
    per_gpu: bool,
}

/// The path a run took: the transport both sides use, why (`as asked`, or what `auto`
/// resolved and the library's reason), and where the memory lives.
#[derive(Clone, Debug)]
pub(crate) struct Path {
    transport: TransportKind,
    why: String,
    memory: &'static str,
}

impl Path {
    /// The path from `ours` to `theirs` over `kind`, the transports having been `asked`.
    pub(crate) fn of(
        asked: TransportChoice,
        ours: &AgentInfo,
        theirs: &AgentInfo,
        kind: TransportKind,
    ) -> Path {
        let why = match asked {
            TransportChoice::Only(_) => "as asked".to_owned(),
            TransportChoice::Auto => format!("auto: {}", xfer::resolve_reason(ours, theirs, kind)),
        };
        Path {
            transport: kind,
            why,
            memory: backend::memory_name(ours.memory),
        }
    }
}

/// The JSON summary of a run.
#[derive(Serialize)]
pub(crate) struct Summary {
    transport: &'static str,
    /// `write` or `read` (`--op`).
    op: &'static str,
    /// Why that transport (`as asked`, or what `auto` saw).
    path: String,
    /// What the baseline was, in words (e.g. "raw TCP streams, 2, loopback (cubic), 1.0 GiB
    /// buffers"; "scattered memcpy of the same pages, 1 thread").
    baseline_kind: Option<String>,
    /// TCP only: the same streams from and into 1 MiB buffers (cache-hot).
    baseline_hot_gbps: Option<f64>,
    /// `gbps / baseline_hot_gbps`.
    ratio_hot: Option<f64>,
    /// TCP only: the streams moving the run's page size as random pages, 16 per `writev`,
    /// placed by `readv` into the same pages (absent when the region holds too few pages).
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline_pages_gbps: Option<f64>,
    /// What that baseline was, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline_pages_kind: Option<String>,
    /// `gbps / baseline_pages_gbps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    ratio_pages: Option<f64>,
    memory: &'static str,
    page_size: u64,
    pages: u64,
    rails: usize,
    bytes: u64,
    /// `--bytes` as given, when it was not a whole number of pages (`bytes` is it rounded
    /// up: only whole pages move).
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_asked: Option<u64>,
    seconds: f64,
    gbps: f64,
    mops: f64,
    verified: bool,
    baseline_gbps: Option<f64>,
    ratio: Option<f64>,
    /// How the rails' NICs were chosen (`--nics`, the plan, or the fallback and why).
    nics: String,
    /// What each rail carried: its NIC, bytes, operations, re-posts, errors and Gbps.
    per_rail: Vec<workload::RailFigures>,
}

impl Summary {
    pub(crate) fn of(
        path: &Path,
        k: &Knobs,
        report: &workload::RunReport,
        verified: bool,
        baseline: Option<baseline::Measured>,
    ) -> Summary {
        let gbps = report.gbps();
        let (baseline_gbps, baseline_kind) = baseline.map(|m| (m.gbps, m.kind)).unzip();
        Summary {
            transport: path.transport.name(),
            op: k.op.direction().name(),
            path: path.why.clone(),
            baseline_kind,
            baseline_hot_gbps: None,
            ratio_hot: None,
            baseline_pages_gbps: None,
            baseline_pages_kind: None,
            ratio_pages: None,
            memory: path.memory,
            page_size: k.page_size,
            pages: k.pages,
            rails: report.rails.len().max(1),
            bytes: report.bytes,
            bytes_asked: bytes_asked(k),
            seconds: report.seconds,
            gbps,
            mops: report.mops(),
            verified,
            baseline_gbps,
            ratio: baseline_gbps.map(|base| gbps / base),
            nics: String::new(),
            per_rail: report.rails.clone(),
        }
    }

    /// With how the NICs were chosen ([`nics_text`]).
    pub(crate) fn with_nics(mut self, nics: String) -> Summary {
        self.nics = nics;
        self
    }
}

/// How a transport's NICs were chosen, as summaries say it: `names (reason)`.
pub(crate) fn nics_text(c: &NicChoice) -> String {
    format!("{} ({})", c.names(), c.reason)
}

/// Why the command failed: one line on stderr (the error and its causes), and the exit
/// code of its class: 2 for a command line that asks for what cannot be, 3 for bytes that
/// landed wrong, 1 for everything else that failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// The command line asks for what cannot be (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The library refused an option (a NIC that is not there, a layout) (exit 2).
    #[error(transparent)]
    Option(xfer::Error),
    /// The library refused a setting of the agent (out of range, contradicting another),
    /// said with the command's flag (exit 2).
    #[error("--{flag}: {reason}")]
    Flag {
        /// The flag, without its dashes (`rails`, `auth-token`).
        flag: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The library failed: the agent, the engine, the rendezvous, the directory (exit 1).
    #[error(transparent)]
    Failed(xfer::Error),
    /// Something of the command's own failed, with its cause where there is one (exit 1).
    #[error("{what}")]
    Other {
        /// What failed.
        what: String,
        /// Why.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The bytes that landed differ from what was sent (exit 3).
    #[error("verification failed: {0}")]
    Mismatch(String),
}

impl CliError {
    /// A failure with no cause beyond its words.
    pub(crate) fn failed(what: impl Into<String>) -> CliError {
        CliError::Other {
            what: what.into(),
            source: None,
        }
    }

    /// A failure of `what`, caused by `source`.
    pub(crate) fn because(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> CliError {
        CliError::Other {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// An I/O failure of `what`.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> CliError {
        CliError::because(what, source)
    }

    /// The exit code of its class.
    fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Option(_) | CliError::Flag { .. } => 2,
            CliError::Mismatch(_) => 3,
            CliError::Failed(_) | CliError::Other { .. } => 1,
        }
    }
}

impl From<xfer::Error> for CliError {
    /// Options the library refused are the command line's fault; the rest failed.
    fn from(e: xfer::Error) -> Self {
        use xfer::layers::nics::NicError;
        match &e {
            // The agent's setting, spelled as the command's flag (`auth_token`: `--auth-token`).
            xfer::Error::Option { option, reason } => CliError::Flag {
                flag: option.name().replace('_', "-"),
                reason: reason.clone(),
            },
            xfer::Error::Nics(n)
                if !matches!(n, NicError::Interfaces(_) | NicError::Domains(_)) =>
            {
                CliError::Option(e)
            }
            _ => CliError::Failed(e),
        }
    }
}

impl From<fabric_core::Error> for CliError {
    fn from(e: fabric_core::Error) -> Self {
        CliError::Failed(e.into())
    }
}

impl From<fabric_core::MemoryError> for CliError {
    fn from(e: fabric_core::MemoryError) -> Self {
        CliError::Failed(e.into())
    }
}

impl From<xfer::rendezvous::ClientError> for CliError {
    fn from(e: xfer::rendezvous::ClientError) -> Self {
        CliError::Failed(e.into())
    }
}

impl From<directory::Error> for CliError {
    fn from(e: directory::Error) -> Self {
        CliError::Failed(e.into())
    }
}

/// Text form of a transport address: itself if printable, else `hex:...`.
pub(crate) fn address_to_text(a: &[u8]) -> String {
    match std::str::from_utf8(a) {
        Ok(s) if s.chars().all(|c| c.is_ascii_graphic()) => s.to_string(),
        _ => format!("hex:{}", hex::encode(a)),
    }
}

pub(crate) fn workload_of(k: &Knobs) -> Result<Workload, CliError> {
    let w = Workload {
        page_size: k.page_size,
        pages: k.pages,
        bytes: k.bytes,
        region_size: k.region_size,
        depth: k.depth,
        seed: k.seed,
        transfer_timeout: Duration::from_secs(60),
        direction: k.op.direction(),
    };
    w.validate().map_err(CliError::Usage)?;
    k.check_op()?;
    let w = w.whole_pages();
    if let Some(r) = k.rails_asked {
        xfer::layers::lanes::check_rails(r)?;
    }
    if k.region_size > usize::MAX as u64 {
        return Err(CliError::Usage(
            "--region-size does not fit this machine's address space".into(),
        ));
    }
    Ok(w)
}

/// `--bytes` when it is not a whole number of pages (the run moves it rounded up).
pub(crate) fn bytes_asked(k: &Knobs) -> Option<u64> {
    (k.page_size > 0 && !k.bytes.is_multiple_of(k.page_size)).then_some(k.bytes)
}

/// The summary's line about `--bytes` rounded up to whole pages, if it was.
pub(crate) fn rounding_note(asked: Option<u64>, moved: u64, page_size: u64) -> Option<String> {
    asked.map(|a| {
        format!(
            "note: --bytes {a} is not a whole number of {} pages: moved {moved} bytes (rounded up to whole pages)",
            size::format_size(page_size)
        )
    })
}

pub(crate) fn print_summary(s: &Summary, json: bool) {
    if json {
        outln!("{}", serde_json::to_string(s).expect("summary serialises"));
        return;
    }
    outln!(
        "{} {} {} pages of {} x {} rails: {} in {:.3}s = {:.2} Gbps, {:.3} Mpps, verified: {}",
        s.transport,
        s.op,
        s.pages,
        size::format_size(s.page_size),
        s.rails,
        size::format_size(s.bytes),
        s.seconds,
        s.gbps,
        s.mops,
        if s.verified { "yes" } else { "no" }
    );
    outln!("path: {} ({})", s.transport, s.path);
    if !s.nics.is_empty() {
        outln!("nics: {}", s.nics);
    }
    if s.per_rail.len() > 1 {
        for r in &s.per_rail {
            outln!(
                "  rail {} on {}: {}, {} ops, {} re-posts, {} errors, {:.2} Gbps",
                r.rail,
                r.nic.as_deref().unwrap_or("-"),
                size::format_size(r.bytes),
                r.ops,
                r.reposts,
                r.errors,
                r.gbps
            );
        }
    }
    if let Some(note) = rounding_note(s.bytes_asked, s.bytes, s.page_size) {
        outln!("{note}");
    }
    if let (Some(b), Some(r), Some(kind)) = (s.baseline_gbps, s.ratio, &s.baseline_kind) {
        outln!("baseline: {kind}: {b:.2} Gbps; ratio {r:.3}");
    }
    if let (Some(b), Some(r)) = (s.baseline_hot_gbps, s.ratio_hot) {
        outln!(
            "baseline, cache-hot (the same streams through 1 MiB buffers): {b:.2} Gbps; ratio {r:.3}"
        );
    }
    if let (Some(b), Some(r), Some(kind)) =
        (s.baseline_pages_gbps, s.ratio_pages, &s.baseline_pages_kind)
    {
        outln!("baseline, pages: {kind}: {b:.2} Gbps; ratio {r:.3}");
    }
}

/// Connects and exercises every rail before the timed work (zero-length writes; `--no-warmup`
/// skips it, so the first transfers also pay for connection set-up).
pub(crate) fn warm_up(
    agent: &Agent,
    peer: &Peer,
    src: &Region,
    dst: &RegionDescriptor,
    k: &Knobs,
) -> Result<(), CliError> {
    if k.no_warmup {
        return Ok(());
    }
    agent.warm_up(peer, src, dst, Duration::from_secs(30))?;
    Ok(())
}

/// Writes the command's output ([`out!`], [`outln!`]) and flushes it; a failed write ends
/// the command: quietly with status 141 where the reader has gone, else with the cause on
/// stderr and status 1.
fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut o = std::io::stdout().lock();
    let Err(e) = o.write_fmt(args).and_then(|()| o.flush()) else {
        return;
    };
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
    eprintln!("xfer: writing the output: {e}");
    std::process::exit(1);
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(a) => remote::serve(a),
        Cmd::Bench(a) => remote::bench(a),
        Cmd::Members(a) => members::members(a),
        Cmd::Demo(a) => demo::run(a),
        Cmd::Topo(a) => topo::run(a),
        Cmd::Info { json } => info::run(json),
        Cmd::KvBench(a) => kv_bench::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xfer: error: {}", report(&e));
            ExitCode::from(e.exit_code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_text_or_hex() {
        assert_eq!(address_to_text(b"tcp://127.0.0.1:1"), "tcp://127.0.0.1:1");
        assert_eq!(address_to_text(&[0, 1, 2, 255]), "hex:000102ff");
    }

    #[test]
    fn the_path_says_as_asked_or_what_auto_resolved_and_why() {
        use fabric_core::MemoryLocation;
        use fabric_core::metadata::TransportInfo;
        let gpu = |boot: &str| AgentInfo {
            transports: vec![
                TransportInfo::new(TransportKind::CudaIpc, vec![b"ipc".to_vec()]),
                TransportInfo::new(TransportKind::Tcp, vec![b"tcp".to_vec()]),
            ],
            ..AgentInfo::new("a", boot, MemoryLocation::Cuda { device: 0 })
        };
        let (a, b) = (gpu("boot-1"), gpu("boot-1"));
        let p = Path::of(TransportChoice::Auto, &a, &b, TransportKind::CudaIpc);
        assert_eq!(p.why, "auto: GPU memory on both sides of one host");
        assert_eq!((p.transport, p.memory), (TransportKind::CudaIpc, "cuda"));
        let other = gpu("boot-2");
        let p = Path::of(TransportChoice::Auto, &a, &other, TransportKind::Tcp);
        assert_eq!(p.why, "auto: not GPU memory on one host");
        let asked = TransportChoice::Only(TransportKind::Tcp);
        assert_eq!(Path::of(asked, &a, &b, TransportKind::Tcp).why, "as asked");
    }

    /// `AnonHugePages` (kB) of the mapping of this process that holds `addr`.
    fn huge_kb_at(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((lo, hi)) = range.split_once('-')
                && let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
            } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
                return kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .expect("a number");
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn the_heap_takes_no_transparent_huge_pages_and_regions_do() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        // The mode in use is the bracketed one.
        let madvise = mode.contains("[madvise]");
        let never = mode.is_empty() || mode.contains("[never]");
        // Written through, so that every page of both is faulted in.
        let mut heap = vec![1u8; 64 << 20];
        heap.iter_mut().step_by(4096).for_each(|b| *b = 2);
        let region = gpu_mem::HostMemory::new(64 << 20).expect("a region");
        let region_at = fabric_core::MemoryRegion::host_ptr(&region)
            .expect("host memory")
            .as_ptr();
        let (heap_kb, region_kb) = (
            huge_kb_at(heap.as_ptr() as usize),
            huge_kb_at(region_at as usize),
        );
        if never {
            assert_eq!((heap_kb, region_kb), (0, 0));
            return;
        }
        // Regions ask for huge pages (MADV_HUGEPAGE): their copies need them.
        assert!(region_kb > 0, "a 64 MiB region has no huge pages ({mode})");
        if madvise {
            // mimalloc's `no_thp`: its heap never asks, so with THP on `madvise` it has none.
            assert_eq!(heap_kb, 0, "the heap took huge pages ({mode})");
        }
    }

    #[test]
    fn refused_options_are_usage_errors_and_failures_are_not() {
        let e = CliError::from(xfer::layers::lanes::check_rails(0).unwrap_err());
        assert_eq!(e.exit_code(), 2, "{e}");
        let e = CliError::from(fabric_core::Error::from(fabric_core::Invalid::NoRails));
        assert_eq!(e.exit_code(), 1, "{e}");
        let e = CliError::because("baseline", std::io::Error::other("the cause"));
        assert_eq!(report(&e), "baseline: the cause");
    }
}
