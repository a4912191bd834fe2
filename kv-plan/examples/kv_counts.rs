//! Prints, for the shapes, what a 4096-token request costs: runs per rank pair,
//! strided transfers per request against a per-block-per-head path, and how long planning
//! takes. `cargo run --release -p kv-plan --example kv_counts`.

use std::time::Instant;

use kv_plan::{HeadOrder, KvLayout, KvModel, KvRequest, Regions, check, heads_for_rank, plan};

type Build = dyn Fn(&KvModel, std::ops::Range<u32>, u32, u32) -> Result<KvLayout, kv_plan::KvError>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let llama = KvModel::new(32, 8, 128, 2);
    let deepseek = KvModel::mla(61, 576, 2);
    let nhd: &Build = &|m, h, nb, bs| KvLayout::vllm_flash_attn(m, h, nb, bs, Regions::PerTensor);
    let hnd: &Build =
        &|m, h, nb, bs| KvLayout::vllm_flashinfer(m, h, nb, bs, HeadOrder::Hnd, Regions::PerTensor);
    let mla: &Build = &|m, _, nb, bs| KvLayout::vllm_mla(m, nb, bs, Regions::PerTensor);
    let cases: [(&str, &KvModel, &Build, &Build, u32, u32, u32); 10] = [
        ("llama NHD", &llama, nhd, nhd, 2, 4, 16),
        ("llama HND", &llama, hnd, hnd, 2, 4, 16),
        ("llama NHD->HND", &llama, nhd, hnd, 2, 4, 16),
        ("llama NHD", &llama, nhd, nhd, 4, 1, 16),
        ("llama HND", &llama, hnd, hnd, 4, 1, 16),
        ("llama NHD->HND", &llama, nhd, hnd, 4, 1, 16),
        ("llama NHD", &llama, nhd, nhd, 16, 2, 16),
        ("deepseek MLA", &deepseek, mla, mla, 2, 4, 64),
        ("deepseek MLA", &deepseek, mla, mla, 4, 1, 64),
        ("deepseek MLA", &deepseek, mla, mla, 8, 4, 64),
    ];
    let tokens = 4096u64;
    println!(
        "{:<16} {:>6} {:>7}  {:>5} {:>9} {:>8} {:>9} {:>10} {:>8} {:>8}",
        "shape",
        "tp",
        "tables",
        "pairs",
        "runs/pair",
        "runs/lyr",
        "transfers",
        "per-blk-hd",
        "plan us",
        "check ms"
    );
    for (name, model, p_build, d_build, p_tp, d_tp, bs) in cases {
        let blocks = tokens.div_ceil(u64::from(bs)) as u32;
        let nb = 4 * blocks;
        let side = |tp: u32, build: &Build| -> Result<Vec<KvLayout>, kv_plan::KvError> {
            (0..tp)
                .map(|r| build(model, heads_for_rank(model.kv_heads, tp, r)?, nb, bs))
                .collect()
        };
        let (prefill, decode) = (side(p_tp, p_build)?, side(d_tp, d_build)?);
        let mut rng = fastrand::Rng::with_seed(7);
        for tables in ["consec", "random"] {
            let table = |rng: &mut fastrand::Rng| -> Vec<u32> {
                if tables == "consec" {
                    (blocks..2 * blocks).collect()
                } else {
                    let mut ids: Vec<u32> = (0..nb).collect();
                    rng.shuffle(&mut ids);
                    ids.truncate(blocks as usize);
                    ids
                }
            };
            let req = KvRequest::new(tokens, table(&mut rng), table(&mut rng));
            let p = plan(&prefill, &decode, &req)?;
            let mut times: Vec<f64> = (0..51)
                .map(|_| {
                    let t = Instant::now();
                    let q = plan(&prefill, &decode, &req);
                    let e = t.elapsed().as_secs_f64() * 1e6;
                    assert!(q.is_ok());
                    e
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let t = Instant::now();
            check(&prefill, &decode, &req, &p)?;
            let check_ms = t.elapsed().as_secs_f64() * 1e3;
            let s = p.stats();
            let per_pair: Vec<u64> = s.pairs.iter().map(|x| x.runs).collect();
            let (lo, hi) = (
                per_pair.iter().min().unwrap_or(&0),
                per_pair.iter().max().unwrap_or(&0),
            );
            println!(
                "{:<16} {:>6} {:>7}  {:>5} {:>9} {:>8} {:>9} {:>10} {:>8.1} {:>8.2}",
                name,
                format!("{p_tp}->{d_tp}"),
                tables,
                s.pairs.len(),
                if lo == hi {
                    format!("{lo}")
                } else {
                    format!("{lo}-{hi}")
                },
                s.runs,
                s.transfers,
                s.per_block_head,
                times[times.len() / 2],
                check_ms
            );
        }
    }
    Ok(())
}
