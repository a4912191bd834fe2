//! Weight sync between processes, timed against a plain paged write of the same bytes by
//! the same agents: 2 source processes (trainers, FSDP flat shards of a Llama-3-8B-shaped
//! model) push to 2 destination processes (inference ranks, tensor-parallel 2 with vLLM's
//! fused `qkv_proj` and `gate_up_proj`), found by name through a `file://` directory.
//!
//! ```text
//! cargo run --release -p xfer --example weights_sync -- [transport=tcp|cuda-ipc|auto]
//!     [rails=N] [memory=host|cuda] [layers=N | bytes=BYTES] [rounds=N] [page=BYTES]
//!     [chunk=BYTES] [inflight=BYTES] [json=PATH]
//! ```
//!
//! Defaults: tcp, 2 rails, host memory, 32 layers (the real model: 16.06 GB of BF16 weights,
//! 8.03 GB per process; `bytes=16GiB` takes as many layers as make at least that much: 35,
//! 16.2 GiB), 3 rounds after a warm-up round, 64 KiB pages. Each round is a
//! baseline, then a sync: in the baseline each source writes, to each destination, as many
//! bytes as the sync sends it, as one transfer of contiguous pages (both sources and both
//! destinations at once); in the sync each source pushes its plan with
//! `Source::push`. Rates are the bytes of both sources over the slower source's time;
//! every destination checks every byte of what the sync wrote, every round (the baseline
//! writes over it). The figures: the median of the rounds' rates, and their ratio.
//!
//! The process given no `role=` is the coordinator: it starts the four others (this
//! program again) and drives them over their stdin and stdout, one line a command.
//!
//! With `XFER_TRACE_DIR=DIR` each of the four writes its trace events (`RUST_LOG`'s
//! filter, by default the cuda-ipc transport's and the sync's timelines) to
//! `DIR/source0.log` and so on, microseconds since the process started, with a line
//! where each baseline and each push begins and ends.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use xfer::discovery;
use xfer::weights::exec::{Destination, Source, SyncOptions};
use xfer::weights::{Holding, Layout, Piece, Plan, RegionSpec, TensorSpec};
use xfer::{
    Access, Agent, AgentOptions, HostBuffer, MemoryKind, MemoryRegion, Transfer, TransportChoice,
};

const HIDDEN: u64 = 4096;
const INTER: u64 = 14336;
const HEADS: u64 = 32;
const KV_HEADS: u64 = 8;
const HEAD_DIM: u64 = 128;
const VOCAB: u64 = 128_256;
const BF16: u32 = 2;
const T: Duration = Duration::from_secs(600);
/// Immediate values of the baseline writes (the sync's are far below).
const BASE_IMM: u32 = 0x4000_0000;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Options, `key=value` each.
#[derive(Clone, Debug)]
struct Opts {
    transport: String,
    rails: usize,
    memory: String,
    layers: u64,
    rounds: usize,
    page: u64,
    chunk: u64,
    inflight: u64,
    json: Option<String>,
    rest: BTreeMap<String, String>,
}

fn parse_bytes(s: &str) -> Res<u64> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix("GiB") {
        (n, 1u64 << 30)
    } else if let Some(n) = s.strip_suffix("MiB") {
        (n, 1 << 20)
    } else if let Some(n) = s.strip_suffix("KiB") {
        (n, 1 << 10)
    } else {
        (s, 1)
    };
    Ok(num.parse::<u64>()? * mul)
}

impl Opts {
    fn parse(args: impl Iterator<Item = String>) -> Res<Opts> {
        let mut o = Opts {
            transport: "tcp".into(),
            rails: 2,
            memory: "host".into(),
            layers: 32,
            rounds: 3,
            page: 64 << 10,
            chunk: SyncOptions::default().chunk_bytes,
            inflight: SyncOptions::default().max_inflight_bytes,
            json: None,
            rest: BTreeMap::new(),
        };
        for a in args {
            let (k, v) = a
                .split_once('=')
                .ok_or(format!("expected key=value, got {a}"))?;
            match k {
                "transport" => o.transport = v.into(),
                "rails" => o.rails = v.parse()?,
                "memory" => o.memory = v.into(),
                "layers" => o.layers = v.parse()?,
                "bytes" => o.layers = layers_for(parse_bytes(v)?),
                "rounds" => o.rounds = v.parse()?,
                "page" => o.page = parse_bytes(v)?,
                "chunk" => o.chunk = parse_bytes(v)?,
                "inflight" => o.inflight = parse_bytes(v)?,
                "json" => o.json = Some(v.into()),
                _ => {
                    o.rest.insert(k.into(), v.into());
                }
            }
        }
        Ok(o)
    }

    fn args(&self) -> Vec<String> {
        let mut v = vec![
            format!("transport={}", self.transport),
            format!("rails={}", self.rails),
            format!("memory={}", self.memory),
            format!("layers={}", self.layers),
            format!("page={}", self.page),
            format!("chunk={}", self.chunk),
            format!("inflight={}", self.inflight),
        ];
        for (k, val) in &self.rest {
            v.push(format!("{k}={val}"));
        }
        v
    }

    fn get(&self, k: &str) -> Res<&str> {
        Ok(self.rest.get(k).ok_or(format!("missing {k}="))?)
    }
}

/// The model's tensors, HF names and `[out, in]` shapes, with how the destinations split
/// each: `Some(dim)` tensor-parallel along `dim`, `None` replicated.
fn model(layers: u64) -> Vec<(TensorSpec, Option<usize>)> {
    let mut t = Vec::new();
    let mut add =
        |name: String, shape: Vec<u64>, d| t.push((TensorSpec::new(name, shape, BF16), d));
    add(
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        Some(0),
    );
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![HIDDEN], None);
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![HEADS * HEAD_DIM, HIDDEN],
            Some(0),
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            Some(0),
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            Some(0),
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![HIDDEN, HEADS * HEAD_DIM],
            Some(1),
        );
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            None,
        );
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![INTER, HIDDEN],
            Some(0),
        );
        add(
            format!("{p}.mlp.up_proj.weight"),
            vec![INTER, HIDDEN],
            Some(0),
        );
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![HIDDEN, INTER],
            Some(1),
        );
    }
    add("model.norm.weight".into(), vec![HIDDEN], None);
    add("lm_head.weight".into(), vec![VOCAB, HIDDEN], Some(0));
    t
}

/// The fewest layers whose model holds at least `bytes`.
fn layers_for(bytes: u64) -> u64 {
    let size = |l: u64| -> u64 { (model(l).iter()).map(|(t, _)| t.bytes().unwrap_or(0)).sum() };
    let (fixed, per) = (size(0), size(1) - size(0));
    bytes.saturating_sub(fixed).div_ceil(per.max(1))
}

/// One region `weights` holding `pieces` packed in order.
fn packed(tensors: &Arc<[TensorSpec]>, pieces: Vec<(u32, Holding)>) -> Layout {
    let mut at = 0u64;
    let pieces: Vec<Piece> = pieces
        .into_iter()
        .map(|(tensor, holding)| {
            let spec = &tensors[tensor as usize];
            let bytes = holding.elements(spec.shape.len()).unwrap() * u64::from(spec.elem_size);
            let offset = at;
            at += bytes;
            Piece {
                tensor,
                holding,
                region: 0,
                offset,
            }
        })
        .collect();
    Layout {
        regions: vec![RegionSpec {
            name: "weights".into(),
            len: at,
        }],
        tensors: tensors.clone(),
        pieces,
    }
}

/// Sources: FSDP flat shard `rank` of 2 of every tensor. Destinations: tensor-parallel
/// rank `rank` of 2, vLLM style: each layer's q, k and v parts packed one after the other
/// (its `qkv_proj`), gate and up likewise (`gate_up_proj`).
fn layouts(layers: u64) -> (Vec<Layout>, Vec<Layout>) {
    let m = model(layers);
    let table: Arc<[TensorSpec]> = m.iter().map(|x| x.0.clone()).collect();
    let src = (0..2)
        .map(|r| {
            let pieces = (m.iter().enumerate())
                .map(|(i, (t, _))| (i as u32, Holding::flat_shard(t.elements().unwrap(), 2, r)))
                .collect();
            packed(&table, pieces)
        })
        .collect();
    let dst = (0..2)
        .map(|r| {
            let pieces = (m.iter().enumerate())
                .map(|(i, (t, d))| {
                    let h = match d {
                        Some(d) => Holding::split(&t.shape, *d, 2, r).unwrap(),
                        None => Holding::whole(&t.shape),
                    };
                    (i as u32, h)
                })
                .collect();
            packed(&table, pieces)
        })
        .collect();
    (src, dst)
}

/// Element `g` of tensor `name` as 8 bytes (splitmix64 of the pair); an element of `e`
/// bytes is the first `e`.
fn element(tensor: u64, g: u64) -> [u8; 8] {
    let mut z =
        (tensor ^ g.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)).to_le_bytes()
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Writes piece `p`'s elements (the pattern) into `out` (its bytes).
fn fill_piece(l: &Layout, p: &Piece, out: &mut [u8]) {
    let spec = &l.tensors[p.tensor as usize];
    let t = name_hash(&spec.name);
    let e = spec.elem_size as usize;
    let mut put = |i: usize, g: u64| out[i * e..(i + 1) * e].copy_from_slice(&element(t, g)[..e]);
    match &p.holding {
        Holding::Flat(r) => {
            for (i, g) in r.clone().enumerate() {
                put(i, g);
            }
        }
        Holding::Box(b) => {
            // Rows of the last dimension, odometer over the others.
            let nd = b.len();
            if nd == 0 {
                put(0, 0);
                return;
            }
            let mut idx: Vec<u64> = b.iter().map(|r| r.start).collect();
            let mut i = 0usize;
            if b.iter().any(|r| r.is_empty()) {
                return;
            }
            loop {
                // The flat index of the row's first element (column 0 of the last dimension).
                let g0 = (idx.iter().zip(&spec.shape))
                    .enumerate()
                    .fold(0u64, |g, (d, (&i, &n))| {
                        g * n + if d + 1 == nd { 0 } else { i }
                    });
                for c in b[nd - 1].clone() {
                    put(i, g0 + c);
                    i += 1;
                }
                let mut d = nd - 1;
                loop {
                    if d == 0 {
                        return;
                    }
                    d -= 1;
                    idx[d] += 1;
                    if idx[d] < b[d].end {
                        break;
                    }
                    idx[d] = b[d].start;
                }
            }
        }
    }
}

/// The region's bytes as the layout says (pieces in order, packed), generated on every core.
fn contents(l: &Layout) -> Vec<u8> {
    let mut buf = vec![0u8; l.regions[0].len as usize];
    let mut parts: Vec<(&Piece, &mut [u8])> = Vec::new();
    let mut rest: &mut [u8] = &mut buf;
    let mut at = 0u64;
    for p in &l.pieces {
        let spec = &l.tensors[p.tensor as usize];
        let n = p.holding.elements(spec.shape.len()).unwrap() * u64::from(spec.elem_size);
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((p.offset - at) as usize);
        let (mine, tail) = tail.split_at_mut(n as usize);
        rest = tail;
        at = p.offset + n;
        parts.push((p, mine));
    }
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let queue = std::sync::Mutex::new(parts);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let Some((p, out)) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    fill_piece(l, p, out);
                }
            });
        }
    });
    buf
}

fn agent(o: &Opts, name: &str) -> Res<Agent> {
    let transport = TransportChoice::from_name(&o.transport).ok_or("transport=")?;
    let memory = if o.memory == "cuda" {
        MemoryKind::Cuda
    } else {
        MemoryKind::Host
    };
    Ok(Agent::new(AgentOptions {
        name: Some(name.into()),
        transport,
        memory,
        rails: Some(o.rails),
        ..AgentOptions::default()
    })?)
}

/// Memory of `len` bytes of the agent's kind.
fn alloc(o: &Opts, len: u64) -> Res<Arc<dyn MemoryRegion>> {
    if o.memory == "cuda" {
        let cuda = gpu_mem::Cuda::probe()?.ok_or("no CUDA driver")?;
        Ok(Arc::new(cuda.device(0)?.alloc_zeroed(len as usize)?))
    } else {
        Ok(HostBuffer::new_shared(len as usize)?)
    }
}

fn say(v: serde_json::Value) {
    println!("{v}");
    let _ = std::io::stdout().flush();
}

/// With `XFER_TRACE_DIR` set, sends this process's trace events to `DIR/{role}{rank}.log`.
fn trace_to_file(o: &Opts) -> Res<()> {
    let (Some(dir), Some(role)) = (std::env::var_os("XFER_TRACE_DIR"), o.rest.get("role")) else {
        return Ok(());
    };
    let rank = o.rest.get("rank").map_or("", String::as_str);
    let file = std::fs::File::create(std::path::Path::new(&dir).join(format!("{role}{rank}.log")))?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        "transport_cuda_ipc::timeline=trace,xfer::weights::timeline=trace,weights_sync=trace".into()
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_timer(tracing_subscriber::fmt::time::uptime())
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .init();
    Ok(())
}

fn main() -> Res<()> {
    let o = Opts::parse(std::env::args().skip(1))?;
    trace_to_file(&o)?;
    match o.rest.get("role").map(String::as_str) {
        Some("source") => source(&o),
        Some("destination") => destination(&o),
        _ => coordinator(&o),
    }
}

fn options(o: &Opts) -> SyncOptions {
    SyncOptions::default()
        .chunk_bytes(o.chunk)
        .max_inflight_bytes(o.inflight)
        .transfer_timeout(T)
}

/// A destination process: `wait V` (waits for the sync's version and checks every byte),
/// `base K` (waits for both sources' baseline writes), `exit`.
fn destination(o: &Opts) -> Res<()> {
    let rank: u32 = o.get("rank")?.parse()?;
    let (_, dst) = layouts(o.layers);
    let l = dst[rank as usize].clone();
    let a = agent(o, &format!("dst{rank}"))?;
    let mem = alloc(o, l.regions[0].len)?;
    let region = a.register(mem.clone(), Access::REMOTE_WRITE | Access::LOCAL_WRITE)?;
    let sync =
        Destination::new(&a, l.clone(), vec![region], 2, Some(rank))?.with_options(options(o));
    sync.offer()?;
    let dir = discovery::open(o.get("dir")?)?;
    let _p = a.publish(&*dir, "weights", Duration::from_secs(600))?;
    let want = contents(&l);
    say(serde_json::json!({"ready": rank, "bytes": l.regions[0].len}));
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let mut w = line.split(' ');
        match (w.next(), w.next()) {
            (Some("wait"), Some(v)) => {
                sync.wait(v.parse()?, T)?;
                let t = Instant::now();
                let mut got = vec![0u8; want.len()];
                mem.read_to_host(0, &mut got)?;
                let bad = got.iter().zip(&want).position(|(a, b)| a != b);
                say(
                    serde_json::json!({"checked": v, "ok": bad.is_none(), "first_bad": bad,
                    "check_s": t.elapsed().as_secs_f64()}),
                );
            }
            (Some("base"), Some(k)) => {
                a.wait_imm(BASE_IMM + k.parse::<u32>()?, 2, T)?;
                say(serde_json::json!({"base": k}));
            }
            _ => break,
        }
    }
    Ok(())
}

/// A source process: `push V`, `base K` (the baseline: to each destination, as many bytes
/// as the sync sends it, as contiguous pages, all at once), `exit`.
fn source(o: &Opts) -> Res<()> {
    let rank: u32 = o.get("rank")?.parse()?;
    let (src, dst) = layouts(o.layers);
    let plan = Plan::new(&src, &dst)?;
    let l = src[rank as usize].clone();
    let a = agent(o, &format!("src{rank}"))?;
    let mem = alloc(o, l.regions[0].len)?;
    mem.write_from_host(0, &contents(&l))?;
    let region = a.register(mem, Access::REMOTE_READ)?;
    let mut sync = Source::new(&a, &plan, rank, l, vec![region.clone()])?.with_options(options(o));
    sync.offer()?;
    let dir = discovery::open(o.get("dir")?)?;
    let _p = a.publish(&*dir, "weights", Duration::from_secs(600))?;
    let following = a.follow(&*dir, "weights")?;
    sync.wait_attached(&following, 2, Duration::from_secs(120))?;
    // Warm every rail toward both destinations.
    let peers: Vec<_> = (0..2)
        .map(|d| following.wait_for(&format!("dst{d}"), Duration::from_secs(60)))
        .collect::<Result<_, _>>()?;
    for p in &peers {
        a.warm_up(
            &p.peer,
            &region,
            p.region("weights")?,
            Duration::from_secs(60),
        )?;
    }
    let sent: Vec<u64> = (0..2u32)
        .map(|d| {
            sync.pairs_to(d)
                .unwrap_or(&[])
                .iter()
                .map(|p| p.bytes())
                .sum()
        })
        .collect();
    let segs: Vec<u64> = (0..2u32)
        .map(|d| {
            sync.pairs_to(d)
                .unwrap_or(&[])
                .iter()
                .map(|p| p.segment_count())
                .sum()
        })
        .collect();
    say(serde_json::json!({"ready": rank, "bytes": sent, "segments": segs}));
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let mut w = line.split(' ');
        match (w.next(), w.next()) {
            (Some("push"), Some(v)) => {
                tracing::trace!(version = v, "push begins");
                let t = Instant::now();
                let r = sync.push(v.parse()?)?;
                let s = t.elapsed().as_secs_f64();
                tracing::trace!(version = v, "push ends");
                let failed: Vec<String> = (r.destinations.iter())
                    .filter_map(|(d, x)| x.as_ref().err().map(|e| format!("{d}: {e}")))
                    .collect();
                say(
                    serde_json::json!({"pushed": v, "s": s, "bytes": r.bytes(), "failed": failed,
                    "waited_s": r.waited.as_secs_f64()}),
                );
            }
            (Some("base"), Some(k)) => {
                let k: u32 = k.parse()?;
                tracing::trace!(round = k, "baseline begins");
                let t = Instant::now();
                let mut handles = Vec::new();
                for (d, p) in peers.iter().enumerate() {
                    let n = sent[d] / o.page;
                    // Each source writes its own part of the destination's region.
                    let first = if rank == 0 {
                        0
                    } else {
                        sent_by_other(&plan, d as u32) / o.page
                    };
                    let local: Vec<u64> = (0..n).collect();
                    let remote: Vec<u64> = (first..first + n).collect();
                    let t = if n == 0 {
                        // Less than a page: the immediate value alone.
                        Transfer::segments(vec![(0, 0, 0)])
                    } else {
                        Transfer::pages(&local, o.page, &remote, o.page, o.page)?
                    };
                    let t = t.imm(BASE_IMM + k).timeout(T);
                    handles.push(a.submit(&p.peer, &region, p.region("weights")?, t)?);
                }
                let mut bytes = 0;
                for h in handles {
                    bytes += h.wait(T)?.bytes;
                }
                tracing::trace!(round = k, "baseline ends");
                say(
                    serde_json::json!({"based": k, "s": t.elapsed().as_secs_f64(), "bytes": bytes}),
                );
            }
            _ => break,
        }
    }
    Ok(())
}

/// Bytes source 0 sends destination `d` (source 1's baseline pages go after them).
fn sent_by_other(plan: &Plan, d: u32) -> u64 {
    plan.pairs_from(0)
        .iter()
        .filter(|p| p.dst.rank == d)
        .map(|p| p.bytes())
        .sum()
}

/// A child process and its lines.
struct Proc {
    child: Child,
    input: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Proc {
    fn send(&mut self, cmd: &str) -> Res<()> {
        writeln!(self.input, "{cmd}")?;
        Ok(self.input.flush()?)
    }
    fn recv(&mut self) -> Res<serde_json::Value> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line)? == 0 {
                return Err("a child exited".into());
            }
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line.trim()) {
                return Ok(v);
            }
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn coordinator(o: &Opts) -> Res<()> {
    let file = std::env::temp_dir().join(format!("xfer-weights-sync-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let url = format!("file://{}", file.display());
    let exe = std::env::current_exe()?;
    let (src, dst) = layouts(o.layers);
    let t0 = Instant::now();
    let plan = Plan::new(&src, &dst)?;
    let plan_s = t0.elapsed().as_secs_f64();
    let spawn = |role: &str, rank: u32| -> Res<Proc> {
        let mut child = Command::new(&exe)
            .args(o.args())
            .arg(format!("role={role}"))
            .arg(format!("rank={rank}"))
            .arg(format!("dir={url}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let input = child.stdin.take().ok_or("stdin")?;
        let out = BufReader::new(child.stdout.take().ok_or("stdout")?);
        Ok(Proc { child, input, out })
    };
    let mut dsts = vec![spawn("destination", 0)?, spawn("destination", 1)?];
    for d in &mut dsts {
        d.recv()?;
    }
    let mut srcs = vec![spawn("source", 0)?, spawn("source", 1)?];
    let mut info = Vec::new();
    for s in &mut srcs {
        info.push(s.recv()?);
    }
    let total = plan.bytes();
    eprintln!(
        "{} layers, {:.2} GB moved ({} segments, planned in {plan_s:.2} s); transport {} x{} rails, {} memory",
        o.layers,
        total as f64 / 1e9,
        plan.segment_count(),
        o.transport,
        o.rails,
        o.memory
    );
    let mut base = Vec::new();
    let mut sync = Vec::new();
    let mut ok = true;
    for round in 0..=o.rounds {
        // Baseline.
        for s in &mut srcs {
            s.send(&format!("base {round}"))?;
        }
        let mut slowest = 0f64;
        let mut bytes = 0u64;
        for s in &mut srcs {
            let r = s.recv()?;
            slowest = slowest.max(r["s"].as_f64().unwrap_or(f64::NAN));
            bytes += r["bytes"].as_u64().unwrap_or(0);
        }
        for d in &mut dsts {
            d.send(&format!("base {round}"))?;
            d.recv()?;
        }
        let b = bytes as f64 * 8.0 / slowest / 1e9;
        // Sync.
        let v = round as u32 + 1;
        for d in &mut dsts {
            d.send(&format!("wait {v}"))?;
        }
        for s in &mut srcs {
            s.send(&format!("push {v}"))?;
        }
        let mut slowest = 0f64;
        let mut bytes = 0u64;
        let mut busy = Vec::new();
        for s in &mut srcs {
            let r = s.recv()?;
            let (took, waited) = (r["s"].as_f64(), r["waited_s"].as_f64());
            busy.push(format!(
                "{:.1}/{:.1} ms",
                (took.unwrap_or(0.0) - waited.unwrap_or(0.0)) * 1e3,
                took.unwrap_or(0.0) * 1e3
            ));
            if !r["failed"].as_array().is_none_or(|a| a.is_empty()) {
                ok = false;
                eprintln!("push failed: {r}");
            }
            slowest = slowest.max(r["s"].as_f64().unwrap_or(f64::NAN));
            bytes += r["bytes"].as_u64().unwrap_or(0);
        }
        for d in &mut dsts {
            let r = d.recv()?;
            if r["ok"] != serde_json::json!(true) {
                ok = false;
                eprintln!("check failed: {r}");
            }
        }
        let s = bytes as f64 * 8.0 / slowest / 1e9;
        eprintln!(
            "round {round}{}: paged write {b:.2} Gbps, sync {s:.2} Gbps ({:.3} s; each source's thread busy {}), every byte checked: {ok}",
            if round == 0 { " (warm-up)" } else { "" },
            slowest,
            busy.join(", ")
        );
        if round > 0 {
            base.push(b);
            sync.push(s);
        }
    }
    for p in srcs.iter_mut().chain(dsts.iter_mut()) {
        let _ = p.send("exit");
    }
    for mut p in srcs.into_iter().chain(dsts) {
        let _ = p.child.wait();
    }
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(file.with_extension("lock"));
    let (b, s) = (median(base.clone()), median(sync.clone()));
    let summary = serde_json::json!({
        "transport": o.transport, "rails": o.rails, "memory": o.memory, "layers": o.layers,
        "bytes": total, "segments": plan.segment_count(), "page": o.page, "chunk": o.chunk,
        "paged_gbps": base, "sync_gbps": sync, "paged_median_gbps": b, "sync_median_gbps": s,
        "ratio": s / b, "verified": ok, "sources": info,
    });
    eprintln!(
        "median of {}: paged write {b:.2} Gbps, sync {s:.2} Gbps, ratio {:.3}",
        o.rounds,
        s / b
    );
    println!("{summary}");
    if let Some(p) = &o.json {
        std::fs::write(p, summary.to_string())?;
    }
    if !ok {
        return Err("a push failed or a destination's bytes are wrong".into());
    }
    Ok(())
}
