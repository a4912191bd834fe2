//! `xfer kv-bench`: a request's KV cache from prefill ranks into decode ranks of another
//! shape, each rank its own process on this host, against a plain paged write of the same
//! bytes between the same processes.
//!
//! The driver starts `--prefill-tp` + `--decode-tp` copies of this command (`--role`),
//! which print their rank's `KvRankInfo` as a JSON line, attach to the other side's ranks,
//! and then follow the driver's orders one JSON line at a time (`{"go": ...}`): the
//! prefill ranks push a request (the layers' plan is every rank's own, from the same
//! layouts and block tables), the decode ranks wait for its notes and answer when it has
//! landed. The driver times each request from its order to the last decode rank's answer.
//! A request is Llama-3-8B-shaped by default: 32 layers of 8 KV heads × 128 BF16, blocks
//! of 16 tokens, 4096 tokens (512 MiB), vLLM's per-layer caches (FlashAttention's NHD, or
//! FlashInfer's HND with `--order hnd`), random block tables.
//!
//! With `--layer-us U`, each request's layers are "computed" first, one after the other on
//! a CUDA stream by a kernel that runs `U` µs and then writes the layer, and each layer is
//! pushed as soon as its kernel is done (the transfer waits on a CUDA event): the figure is
//! then the time from the last layer's save to the decode ranks' notes.

use crate::CliError;
use clap::Args;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use xfer::kv::{HeadOrder, KvLayout, KvModel, KvRank, KvRankInfo, KvRequest, Regions, Side};
use xfer::{
    Agent, AgentOptions, MemoryKind, MemoryRegion, Region, Transfer, TransportChoice, TransportKind,
};

/// `xfer kv-bench`'s arguments.
#[derive(Args, Clone, Debug)]
pub struct KvBenchArgs {
    /// Prefill ranks (processes).
    #[arg(long, default_value_t = 2)]
    prefill_tp: u32,
    /// Decode ranks (processes).
    #[arg(long, default_value_t = 4)]
    decode_tp: u32,
    /// Tokens per request.
    #[arg(long, default_value_t = 4096)]
    tokens: u32,
    /// Requests timed (after one untimed).
    #[arg(long, default_value_t = 5)]
    requests: u32,
    /// The caches' layout: nhd (vLLM FlashAttention) or hnd (FlashInfer HND).
    #[arg(long, default_value = "nhd")]
    order: String,
    /// Transport between the ranks: cuda-ipc or tcp.
    #[arg(long, default_value = "cuda-ipc")]
    transport: String,
    /// Rails per rank.
    #[arg(long, default_value_t = 1)]
    rails: usize,
    /// Where the caches live: cuda (GPU 0) or host.
    #[arg(long, default_value = "cuda")]
    memory: String,
    /// Each layer computed by a kernel of this many µs before it is pushed (CUDA only);
    /// 0: the caches are filled once and requests pushed whole.
    #[arg(long, default_value_t = 0)]
    layer_us: u64,
    /// cuda-ipc: how batches of copies are issued (kernel, kernel-rows, batch or memcpy);
    /// the default is the best that works here. `kernel-rows` moves each strided run as
    /// one entry of the rows kernel.
    #[arg(long = "cuda-copy", value_name = "METHOD", value_parser = crate::backend::parse_copy_method)]
    cuda_copy: Option<gpu_mem::CopyMethod>,
    /// Skip the plain paged write of the same bytes.
    #[arg(long)]
    no_baseline: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// This process's part (set by the driver).
    #[arg(long, hide = true)]
    role: Option<String>,
    /// This process's rank (set by the driver).
    #[arg(long, hide = true)]
    rank: Option<u32>,
}

const BLOCK: u32 = 16;

fn other(what: impl Into<String>) -> CliError {
    CliError::Other {
        what: what.into(),
        source: None,
    }
}

fn lib(e: xfer::Error) -> CliError {
    CliError::Failed(e)
}

fn model() -> KvModel {
    KvModel::new(32, 8, 128, 2)
}

fn blocks(a: &KvBenchArgs) -> u32 {
    a.tokens.div_ceil(BLOCK) + 8
}

fn layouts(a: &KvBenchArgs, tp: u32) -> Result<Vec<KvLayout>, CliError> {
    let m = model();
    let hnd = match a.order.as_str() {
        "nhd" => false,
        "hnd" => true,
        o => return Err(CliError::Usage(format!("--order {o}: nhd or hnd"))),
    };
    (0..tp)
        .map(|r| {
            let heads = xfer::kv::heads_for_rank(8, tp, r)?;
            if hnd {
                KvLayout::vllm_flashinfer(
                    &m,
                    heads,
                    blocks(a),
                    BLOCK,
                    HeadOrder::Hnd,
                    Regions::PerTensor,
                )
            } else {
                KvLayout::vllm_flash_attn(&m, heads, blocks(a), BLOCK, Regions::PerTensor)
            }
        })
        .collect::<Result<_, _>>()
        .map_err(|e| lib(e.into()))
}

/// A shuffled table of `n` of `of` blocks (`n` at most `of`).
fn table(n: u32, of: u32, seed: u64) -> Vec<u32> {
    let mut t: Vec<u32> = (0..of).collect();
    let mut s = seed | 1;
    for i in (1..t.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        t.swap(i, (s % (i as u64 + 1)) as usize);
    }
    t.truncate(n as usize);
    t
}

fn request(a: &KvBenchArgs) -> KvRequest {
    let n = a.tokens.div_ceil(BLOCK);
    KvRequest::new(
        u64::from(a.tokens),
        table(n, blocks(a), 7),
        table(n, blocks(a), 13),
    )
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The driver's orders and the ranks' answers.
#[derive(Serialize, Deserialize, Debug)]
enum Msg {
    /// The other side's ranks.
    Attach(Vec<KvRankInfo>),
    Ready,
    /// Move request `id` (`baseline`: as a plain paged write).
    Go {
        id: u32,
        baseline: bool,
    },
    /// Decode: landed (at this wall-clock µs). Prefill: pushed, its kernels queued at `us`.
    Done {
        id: u32,
        us: u64,
    },
    Failed(String),
}

fn send(to: &mut impl Write, m: &Msg) -> Result<(), CliError> {
    let line = serde_json::to_string(m).map_err(|e| other(format!("encoding: {e}")))?;
    writeln!(to, "{line}")
        .and_then(|_| to.flush())
        .map_err(|e| other(format!("writing to a rank: {e}")))
}

fn recv<T: for<'de> Deserialize<'de>>(from: &mut impl BufRead) -> Result<T, CliError> {
    let mut l = String::new();
    from.read_line(&mut l)
        .map_err(|e| other(format!("reading from a rank: {e}")))?;
    if l.is_empty() {
        return Err(other("a rank exited (see its error above)"));
    }
    serde_json::from_str(&l).map_err(|e| other(format!("a rank said {l:?}: {e}")))
}

/// Runs `xfer kv-bench`: the driver, or one rank when `--role` is set.
pub fn run(a: KvBenchArgs) -> Result<(), CliError> {
    match (a.role.as_deref(), a.rank) {
        (Some("prefill"), Some(r)) => rank(&a, Side::Prefill, r),
        (Some("decode"), Some(r)) => rank(&a, Side::Decode, r),
        (None, _) => drive(&a),
        _ => Err(CliError::Usage(
            "--role needs prefill or decode, and --rank".into(),
        )),
    }
}

struct Child1 {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Drop for Child1 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(a: &KvBenchArgs, role: &str, r: u32) -> Result<Child1, CliError> {
    let exe = std::env::current_exe().map_err(|e| other(format!("this command's path: {e}")))?;
    let mut c = Command::new(exe);
    c.args(["kv-bench", "--role", role, "--rank", &r.to_string()])
        .args(["--prefill-tp", &a.prefill_tp.to_string()])
        .args(["--decode-tp", &a.decode_tp.to_string()])
        .args(["--tokens", &a.tokens.to_string()])
        .args(["--order", &a.order, "--transport", &a.transport])
        .args(["--rails", &a.rails.to_string(), "--memory", &a.memory])
        .args(["--layer-us", &a.layer_us.to_string()]);
    if let Some(m) = a.cuda_copy {
        c.args(["--cuda-copy", m.name()]);
    }
    c.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = c
        .spawn()
        .map_err(|e| other(format!("starting a {role} rank: {e}")))?;
    let stdin = child.stdin.take().ok_or_else(|| other("no stdin"))?;
    let stdout = BufReader::new(child.stdout.take().ok_or_else(|| other("no stdout"))?);
    Ok(Child1 {
        child,
        stdin,
        stdout,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn drive(a: &KvBenchArgs) -> Result<(), CliError> {
    let (pl, dl) = (layouts(a, a.prefill_tp)?, layouts(a, a.decode_tp)?);
    let req = request(a);
    let plan = xfer::kv::plan(&pl, &dl, &req).map_err(|e| lib(e.into()))?;
    let stats = plan.stats();
    let mut prefill: Vec<Child1> = (0..a.prefill_tp)
        .map(|r| spawn(a, "prefill", r))
        .collect::<Result<_, _>>()?;
    let mut decode: Vec<Child1> = (0..a.decode_tp)
        .map(|r| spawn(a, "decode", r))
        .collect::<Result<_, _>>()?;
    let p_infos: Vec<KvRankInfo> = prefill
        .iter_mut()
        .map(|c| recv(&mut c.stdout))
        .collect::<Result<_, _>>()?;
    let d_infos: Vec<KvRankInfo> = decode
        .iter_mut()
        .map(|c| recv(&mut c.stdout))
        .collect::<Result<_, _>>()?;
    for c in &mut prefill {
        send(&mut c.stdin, &Msg::Attach(d_infos.clone()))?;
    }
    for c in &mut decode {
        send(&mut c.stdin, &Msg::Attach(p_infos.clone()))?;
    }
    for c in prefill.iter_mut().chain(decode.iter_mut()) {
        match recv::<Msg>(&mut c.stdout)? {
            Msg::Ready => {}
            m => return Err(other(format!("a rank did not attach: {m:?}"))),
        }
    }
    let mut one = |id: u32, baseline: bool| -> Result<(f64, u64, u64), CliError> {
        for c in decode.iter_mut().chain(prefill.iter_mut()) {
            send(&mut c.stdin, &Msg::Go { id, baseline })?;
        }
        let t0 = Instant::now();
        let mut queued = 0;
        for c in &mut prefill {
            match recv::<Msg>(&mut c.stdout)? {
                Msg::Done { us, .. } => queued = queued.max(us),
                m => return Err(other(format!("a prefill rank: {m:?}"))),
            }
        }
        let mut landed = 0;
        for c in &mut decode {
            match recv::<Msg>(&mut c.stdout)? {
                Msg::Done { us, .. } => landed = landed.max(us),
                m => return Err(other(format!("a decode rank: {m:?}"))),
            }
        }
        Ok((t0.elapsed().as_secs_f64(), queued, landed))
    };
    let bytes = stats.request_bytes as f64;
    let mut runs = |baseline: bool| -> Result<(Vec<f64>, Vec<f64>), CliError> {
        one(0, baseline)?; // untimed
        let (mut secs, mut after) = (Vec::new(), Vec::new());
        for id in 1..=a.requests {
            let (s, queued, landed) = one(id, baseline)?;
            secs.push(s);
            let compute = u64::from(model().num_layers) * a.layer_us;
            after.push(landed.saturating_sub(queued + compute) as f64);
        }
        Ok((secs, after))
    };
    let (kv, after) = runs(false)?;
    let base = if a.no_baseline || a.layer_us > 0 {
        None
    } else {
        Some(runs(true)?.0)
    };
    let gbps = |s: f64| bytes * 8.0 / s / 1e9;
    let kv_s = median(kv.clone());
    let layer_ms = kv_s * 1e3 / f64::from(model().num_layers);
    let out = serde_json::json!({
        "shape": format!("Llama-3-8B {} TP{} -> TP{}, {} tokens", a.order, a.prefill_tp, a.decode_tp, a.tokens),
        "transport": a.transport, "rails": a.rails, "memory": a.memory,
        "request_bytes": stats.request_bytes,
        "transfers_per_request": stats.transfers,
        "runs_per_layer_component": stats.runs,
        "per_block_head": stats.per_block_head,
        "requests": a.requests,
        "kv_ms_median": kv_s * 1e3,
        "kv_gbps_median": gbps(kv_s),
        "kv_ms_all": kv.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        "baseline_ms_median": base.as_ref().map(|b| median(b.clone()) * 1e3),
        "baseline_gbps_median": base.as_ref().map(|b| gbps(median(b.clone()))),
        "ratio": base.as_ref().map(|b| median(b.clone()) / kv_s),
        "layer_us": a.layer_us,
        "after_last_save_us_median": (a.layer_us > 0).then(|| median(after.clone())),
        "one_layer_ms_at_this_rate": layer_ms,
    });
    if a.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    }
    Ok(())
}

/// The memory of one rank's cache: a buffer per region, and their layer fills.
enum Cache {
    Host(Vec<Arc<xfer::HostBuffer>>),
    Cuda(Vec<Arc<xfer::cuda::DeviceBuffer>>, xfer::cuda::Device),
}

fn rank(a: &KvBenchArgs, side: Side, r: u32) -> Result<(), CliError> {
    let (pl, dl) = (layouts(a, a.prefill_tp)?, layouts(a, a.decode_tp)?);
    let mine = match side {
        Side::Prefill => &pl[r as usize],
        Side::Decode => &dl[r as usize],
    };
    let lens: Vec<usize> = (0..mine.num_layers)
        .map(|l| mine.extent(l, mine.components - 1).map(|e| e as usize))
        .collect::<Result<_, _>>()
        .map_err(|e| lib(e.into()))?;
    let cuda = a.memory == "cuda";
    let transport = match a.transport.as_str() {
        "cuda-ipc" => TransportKind::CudaIpc,
        "tcp" => TransportKind::Tcp,
        t => return Err(CliError::Usage(format!("--transport {t}: cuda-ipc or tcp"))),
    };
    let agent = Agent::new(AgentOptions {
        name: Some(format!("kv-{side}-{r}")),
        transport: TransportChoice::Only(transport),
        memory: if cuda {
            MemoryKind::Cuda
        } else {
            MemoryKind::Host
        },
        rails: Some(a.rails),
        pin: xfer::PinMode::Off,
        cuda_ipc: xfer::CudaIpcOptions {
            copy_method: a.cuda_copy,
        },
        ..AgentOptions::default()
    })
    .map_err(lib)?;
    let cache = if cuda {
        let dev = xfer::cuda::Cuda::probe()
            .map_err(|e| lib(e.into()))?
            .ok_or_else(|| other("no CUDA device"))?
            .device(0)
            .map_err(|e| lib(e.into()))?;
        let bufs = lens
            .iter()
            .map(|&n| dev.alloc_zeroed(n).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| lib(e.into()))?;
        Cache::Cuda(bufs, dev)
    } else {
        let bufs = lens
            .iter()
            .map(|&n| xfer::HostBuffer::new_shared(n))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| other(format!("host memory: {e}")))?;
        Cache::Host(bufs)
    };
    let mems: Vec<Arc<dyn MemoryRegion>> = match &cache {
        Cache::Host(b) => b
            .iter()
            .map(|b| b.clone() as Arc<dyn MemoryRegion>)
            .collect(),
        Cache::Cuda(b, _) => b
            .iter()
            .map(|b| b.clone() as Arc<dyn MemoryRegion>)
            .collect(),
    };
    let regions: Vec<Region> = mems
        .iter()
        .map(|m| agent.register(m.clone(), xfer::Access::ALL))
        .collect::<Result<_, _>>()
        .map_err(lib)?;
    let kv = KvRank::new(agent.clone(), side, r, regions.clone(), pl, dl).map_err(lib)?;
    let mut out = std::io::stdout().lock();
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let info = serde_json::to_string(&kv.info()).map_err(|e| other(format!("{e}")))?;
    writeln!(out, "{info}").map_err(|e| other(format!("{e}")))?;
    out.flush().map_err(|e| other(format!("{e}")))?;
    let Msg::Attach(peers) = recv(&mut input)? else {
        return Err(other("expected the other side's ranks"));
    };
    for p in &peers {
        kv.attach(p).map_err(lib)?;
    }
    let req = request(a);
    let plan = kv.plan(&req).map_err(lib)?;
    // The plain paged write's connections (beside the KV rank's own).
    let base_peers: Vec<Option<xfer::Peer>> = peers
        .iter()
        .map(|p| {
            let ours = side == Side::Prefill && plan.pair(r, p.rank).is_some();
            ours.then(|| agent.connect(&p.agent)).transpose()
        })
        .collect::<Result<_, _>>()
        .map_err(lib)?;
    // Fill the prefill cache once (layer l's bytes = l + 1), for requests without compute.
    if side == Side::Prefill {
        for (l, m) in mems.iter().enumerate() {
            match &cache {
                Cache::Host(b) => b[l]
                    .fill(0, m.len() as u64, l as u8 + 1)
                    .map_err(|e| other(format!("filling the cache: {e}")))?,
                Cache::Cuda(b, _) => b[l]
                    .fill(0, m.len() as u64, l as u8 + 1)
                    .map_err(|e| other(format!("filling the cache: {e}")))?,
            }
        }
    }
    send(&mut out, &Msg::Ready)?;
    let t = Duration::from_secs(120);
    // The plain paged write: per (prefill, decode) pair, as many pages of decode's block
    // share as the request's runs fill, from the same regions, with immediate data.
    loop {
        let msg: Msg = match recv(&mut input) {
            Ok(m) => m,
            Err(_) => return Ok(()), // the driver is done
        };
        let Msg::Go { id, baseline } = msg else {
            continue;
        };
        let name = format!("{}{id}", if baseline { "b" } else { "r" });
        let res = match (side, baseline) {
            (Side::Prefill, false) => {
                let queued = now_us();
                let mut all = None::<xfer::kv::KvTransfers>;
                for layer in 0..kv.layers() {
                    let fence: Option<Arc<dyn xfer::Fence>> = match (&cache, a.layer_us) {
                        (Cache::Cuda(b, dev), us) if us > 0 => {
                            let s = xfer::cuda::StreamRef::LEGACY;
                            gpu_mem::testing::late_fill(
                                &b[layer as usize],
                                layer as u8 + 1,
                                Duration::from_micros(us),
                                s,
                            )
                            .map_err(|e| lib(e.into()))?;
                            Some(Arc::new(dev.fence_on(s).map_err(|e| lib(e.into()))?))
                        }
                        _ => None,
                    };
                    let t = kv
                        .push_layer(name.as_bytes(), &plan, layer, fence)
                        .map_err(lib)?;
                    match &mut all {
                        Some(x) => x.extend(t),
                        None => all = Some(t),
                    }
                }
                send(&mut out, &Msg::Done { id, us: queued })?;
                all.map_or(Ok(()), |x| x.wait(t)).map(|_| 0)
            }
            (Side::Decode, false) => kv.wait(name.as_bytes(), t).map(|_| {
                kv.forget(name.as_bytes());
                now_us()
            }),
            (Side::Prefill, true) => {
                let queued = now_us();
                let mut hs = Vec::new();
                for pair in plan.pairs_from(r) {
                    let d = &peers[pair.decode as usize];
                    let dpage = u64::from(BLOCK)
                        * u64::from(d.layout.heads.end - d.layout.heads.start)
                        * d.layout.head_bytes;
                    let count = pair.runs.iter().map(|x| x.count * x.len).sum::<u64>() / dpage;
                    let n = (count * u64::from(d.layout.components)) as u32;
                    let Some(peer) = &base_peers[pair.decode as usize] else {
                        continue;
                    };
                    // Regions are layers here (per-layer tensors). Pages at random places on
                    // both sides, as a paged cache's are: in order they would coalesce into
                    // one contiguous write.
                    for (l, (local, remote)) in regions.iter().zip(&d.regions).enumerate() {
                        let slots = |len: u64| (len / dpage) as u32;
                        let seed = u64::from(id) * 64 + l as u64;
                        let src: Vec<u64> = table(n, slots(local.len()), seed)
                            .into_iter()
                            .map(u64::from)
                            .collect();
                        let dst: Vec<u64> = table(n, slots(remote.len), seed + 7)
                            .into_iter()
                            .map(u64::from)
                            .collect();
                        let tr = Transfer::pages(&src, dpage, &dst, dpage, dpage)
                            .map_err(lib)?
                            .imm(0x6b62_0000 | id);
                        hs.push(agent.submit(peer, local, remote, tr).map_err(lib)?);
                    }
                }
                send(&mut out, &Msg::Done { id, us: queued })?;
                hs.iter().try_for_each(|h| h.wait(t).map(|_| ())).map(|_| 0)
            }
            (Side::Decode, true) => {
                let n: u64 = plan.pairs_to(r).count() as u64 * u64::from(kv.layers());
                agent.wait_imm(0x6b62_0000 | id, n, t).map(|_| now_us())
            }
        };
        match res {
            Ok(us) if side == Side::Decode => send(&mut out, &Msg::Done { id, us })?,
            Ok(_) => {}
            Err(e) => {
                send(&mut out, &Msg::Failed(e.to_string()))?;
                return Err(lib(e));
            }
        }
    }
}
