//! Plans a weight sync of a Kimi-K2-shaped model (about 1.0 T parameters, BF16) from 256
//! FSDP training ranks to 128 inference ranks, checks it, and prints the figures.
//!
//! ```text
//! cargo run --release -p xfer --example weights_plan [-- [layers=N] [sources=fsdp|hsdp] [check=no]]
//! ```
//!
//! - Model: 61 layers (the first dense, 60 MoE), hidden 7168, dense intermediate 18432,
//!   384 routed experts + 1 shared per MoE layer (intermediate 2048, gate/up/down each), MLA
//!   attention with 64 heads (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64,
//!   v 128), vocab 163840 (embedding and lm_head), HF names and `[out, in]` shapes.
//! - Sources: 256 ranks; each holds shard `s` of every tensor's flat element range split
//!   evenly over the 256 (cut mid-row), packed in model order in one region. `sources=hsdp`
//!   makes it 2 replicas of 128 shards (every element on 2 sources: the planner chooses).
//! - Destinations: 128 ranks, 16 tensor-parallel groups of 8: attention split by heads
//!   (q_b/kv_b along rows, o_proj along columns), dense and shared-expert MLPs along the
//!   intermediate dimension (gate/up rows, down columns), embedding and lm_head
//!   vocab-parallel over the group, norms, q_a/kv_a and the router replicated; routed
//!   experts expert-parallel over all 128 (3 per rank per layer).

use std::sync::Arc;
use std::time::Instant;
use xfer::weights::{Holding, Layout, Limit, Piece, Plan, RegionSpec, TensorSpec, check};

const HIDDEN: u64 = 7168;
const DENSE_INTER: u64 = 18432;
const EXPERTS: u64 = 384;
const MOE_INTER: u64 = 2048;
const HEADS: u64 = 64;
const Q_LORA: u64 = 1536;
const KV_LORA: u64 = 512;
const NOPE: u64 = 128;
const ROPE: u64 = 64;
const V_HEAD: u64 = 128;
const VOCAB: u64 = 163_840;
const BF16: u32 = 2;
const TP: u64 = 8;
const DST: u64 = 128;

/// How a destination rank holds a tensor.
#[derive(Clone, Copy)]
enum Dst {
    /// Every rank holds it whole.
    Replicated,
    /// Split over the tensor-parallel group along this dimension.
    Tp(usize),
    /// Routed expert `e`: whole on rank `e / (EXPERTS / DST)`.
    Expert(u64),
}

fn model(layers: u64) -> Vec<(TensorSpec, Dst)> {
    let mut t = Vec::new();
    let mut add =
        |name: String, shape: Vec<u64>, d: Dst| t.push((TensorSpec::new(name, shape, BF16), d));
    add(
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        Dst::Tp(0),
    );
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(
            format!("{p}.input_layernorm.weight"),
            vec![HIDDEN],
            Dst::Replicated,
        );
        add(
            format!("{p}.self_attn.q_a_proj.weight"),
            vec![Q_LORA, HIDDEN],
            Dst::Replicated,
        );
        add(
            format!("{p}.self_attn.q_a_layernorm.weight"),
            vec![Q_LORA],
            Dst::Replicated,
        );
        add(
            format!("{p}.self_attn.q_b_proj.weight"),
            vec![HEADS * (NOPE + ROPE), Q_LORA],
            Dst::Tp(0),
        );
        add(
            format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
            vec![KV_LORA + ROPE, HIDDEN],
            Dst::Replicated,
        );
        add(
            format!("{p}.self_attn.kv_a_layernorm.weight"),
            vec![KV_LORA],
            Dst::Replicated,
        );
        add(
            format!("{p}.self_attn.kv_b_proj.weight"),
            vec![HEADS * (NOPE + V_HEAD), KV_LORA],
            Dst::Tp(0),
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![HIDDEN, HEADS * V_HEAD],
            Dst::Tp(1),
        );
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            Dst::Replicated,
        );
        if l == 0 {
            add(
                format!("{p}.mlp.gate_proj.weight"),
                vec![DENSE_INTER, HIDDEN],
                Dst::Tp(0),
            );
            add(
                format!("{p}.mlp.up_proj.weight"),
                vec![DENSE_INTER, HIDDEN],
                Dst::Tp(0),
            );
            add(
                format!("{p}.mlp.down_proj.weight"),
                vec![HIDDEN, DENSE_INTER],
                Dst::Tp(1),
            );
            continue;
        }
        add(
            format!("{p}.mlp.gate.weight"),
            vec![EXPERTS, HIDDEN],
            Dst::Replicated,
        );
        add(
            format!("{p}.mlp.gate.e_score_correction_bias"),
            vec![EXPERTS],
            Dst::Replicated,
        );
        for e in 0..EXPERTS {
            let q = format!("{p}.mlp.experts.{e}");
            add(
                format!("{q}.gate_proj.weight"),
                vec![MOE_INTER, HIDDEN],
                Dst::Expert(e),
            );
            add(
                format!("{q}.up_proj.weight"),
                vec![MOE_INTER, HIDDEN],
                Dst::Expert(e),
            );
            add(
                format!("{q}.down_proj.weight"),
                vec![HIDDEN, MOE_INTER],
                Dst::Expert(e),
            );
        }
        let q = format!("{p}.mlp.shared_experts");
        add(
            format!("{q}.gate_proj.weight"),
            vec![MOE_INTER, HIDDEN],
            Dst::Tp(0),
        );
        add(
            format!("{q}.up_proj.weight"),
            vec![MOE_INTER, HIDDEN],
            Dst::Tp(0),
        );
        add(
            format!("{q}.down_proj.weight"),
            vec![HIDDEN, MOE_INTER],
            Dst::Tp(1),
        );
    }
    add("model.norm.weight".into(), vec![HIDDEN], Dst::Replicated);
    add("lm_head.weight".into(), vec![VOCAB, HIDDEN], Dst::Tp(0));
    t
}

/// A layout with one region holding `pieces` packed in order.
fn packed(tensors: &Arc<[TensorSpec]>, pieces: impl Iterator<Item = (u32, Holding)>) -> Layout {
    let mut at = 0u64;
    let pieces: Vec<Piece> = pieces
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

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut layers = 61;
    let mut hsdp = false;
    let mut run_check = true;
    for a in std::env::args().skip(1) {
        match a.split_once('=') {
            Some(("layers", n)) => layers = n.parse()?,
            Some(("sources", "fsdp")) => hsdp = false,
            Some(("sources", "hsdp")) => hsdp = true,
            Some(("check", "no")) => run_check = false,
            _ => return Err(format!("unknown argument {a:?}").into()),
        }
    }
    let t0 = Instant::now();
    let m = model(layers);
    let params: u64 = m.iter().map(|(s, _)| s.elements().unwrap()).sum();
    let tensors: Arc<[TensorSpec]> =
        Arc::from(m.iter().map(|(s, _)| s.clone()).collect::<Vec<_>>());
    let (sources, shards) = if hsdp { (256u64, 128u64) } else { (256, 256) };
    let src: Vec<Layout> = (0..sources)
        .map(|s| {
            packed(
                &tensors,
                (0..tensors.len() as u32).map(|t| {
                    (
                        t,
                        Holding::flat_shard(
                            tensors[t as usize].elements().unwrap(),
                            shards,
                            s % shards,
                        ),
                    )
                }),
            )
        })
        .collect();
    let per_rank = EXPERTS / DST;
    let dst: Vec<Layout> = (0..DST)
        .map(|d| {
            let held = m.iter().enumerate().filter_map(|(t, (spec, how))| {
                let h = match *how {
                    Dst::Replicated => Holding::whole(&spec.shape),
                    Dst::Tp(dim) => Holding::split(&spec.shape, dim, TP, d % TP).unwrap(),
                    Dst::Expert(e) if e / per_rank == d => Holding::whole(&spec.shape),
                    Dst::Expert(_) => return None,
                };
                Some((t as u32, h))
            });
            packed(&tensors, held)
        })
        .collect();
    let src_bytes: u64 = src.iter().map(|l| l.regions[0].len).sum();
    let dst_bytes: u64 = dst.iter().map(|l| l.regions[0].len).sum();
    println!(
        "model: {layers} layers, {} tensors, {:.3} T parameters, {:.1} GB in BF16 (layouts built in {:.1} s)",
        tensors.len(),
        params as f64 / 1e12,
        gb(params * 2),
        t0.elapsed().as_secs_f64()
    );
    println!(
        "sources: {sources} ranks, {} ({} pieces, {:.1} GB); destinations: {DST} ranks in {} TP groups of {TP} + EP {DST} ({} pieces, {:.1} GB)",
        if hsdp {
            "HSDP: 2 replicas of 128 flat shards"
        } else {
            "FSDP flat shards cut mid-row"
        },
        src.iter().map(|l| l.pieces.len()).sum::<usize>(),
        gb(src_bytes),
        DST / TP,
        dst.iter().map(|l| l.pieces.len()).sum::<usize>(),
        gb(dst_bytes),
    );

    let t = Instant::now();
    let plan = Plan::new(&src, &dst)?;
    let planning = t.elapsed().as_secs_f64();
    let wire = postcard::to_allocvec(&plan)?;
    println!(
        "plan: {planning:.2} s on one core; {} region pairs, {} runs ({} strided), {} segments, {:.1} GB moved; {:.1} MB serialised (postcard)",
        plan.pairs().len(),
        plan.run_count(),
        plan.pairs()
            .iter()
            .flat_map(|p| &p.runs)
            .filter(|r| r.count > 1)
            .count(),
        plan.segment_count(),
        gb(plan.bytes()),
        wire.len() as f64 / 1e6,
    );
    drop(wire);

    // Replay: every pair's segments, as each source's agent would build its transfers.
    let mut segs: Vec<(u64, u64, u64)> = Vec::new();
    let mut n = 0usize;
    let mut worst = 0f64;
    let t = Instant::now();
    for s in 0..plan.sources() {
        let ts = Instant::now();
        for pair in plan.pairs_from(s) {
            segs.clear();
            pair.write_segments(&mut segs);
            n += segs.len();
        }
        worst = worst.max(ts.elapsed().as_secs_f64());
    }
    let replay = t.elapsed().as_secs_f64();
    println!(
        "replay: {replay:.3} s for all {n} segments on one core; the slowest source's own pairs {:.1} ms",
        worst * 1e3
    );

    let timing = plan.timing(400.0);
    println!(
        "at 400 Gbps per GPU: predicted {:.3} s (busiest: {} {}, {:.2} GB), lower bound {:.3} s ({}): ratio {:.4}",
        timing.predicted_s,
        timing.busiest.side,
        timing.busiest.rank,
        gb(timing.busiest.bytes),
        timing.bound_s,
        match &plan.bound().limit {
            Limit::Destination { rank } => format!("destination {rank} must receive its bytes"),
            Limit::Sources { ranks } =>
                format!("sources {ranks:?} alone hold bytes they must send"),
            _ => "all bytes over all sources".into(),
        },
        timing.predicted_s / timing.bound_s,
    );
    let sent = plan.source_bytes();
    println!(
        "sources: busiest sends {:.2} GB, mean {:.2} GB (ratio {:.4})",
        gb(*sent.iter().max().unwrap_or(&0)),
        gb(sent.iter().sum::<u64>() / sent.len().max(1) as u64),
        *sent.iter().max().unwrap_or(&0) as f64
            / (sent.iter().sum::<u64>() as f64 / sent.len().max(1) as f64),
    );
    if run_check {
        let t = Instant::now();
        let verdict = check(&src, &dst, &plan);
        let secs = t.elapsed().as_secs_f64();
        match verdict {
            Ok(r) => println!(
                "check: every destination byte written exactly once from the same element: {} pieces, {:.1} GB, {} segments ({secs:.1} s)",
                r.pieces,
                gb(r.bytes),
                r.segments
            ),
            Err(e) => {
                println!("check: FAILED: {e} ({secs:.1} s)");
                std::process::exit(1);
            }
        }
    }
    Ok(())
}
