//! KV caches on the GPU over cuda-ipc: every shape of the KV tests (other TP degrees and
//! block sizes, HND into NHD, replicated heads, MLA) with each rank's cache in device
//! memory and each rank its own agent, pushed and pulled, every decode byte checked
//! against the logical cache; with the default copy method and with the rows kernel
//! (`CopyMethod::KernelRows`: each strided run one entry). Needs a GPU: ignored here, run
//! by the GPU kit (`gpu-kit/gpu_kv_tests --include-ignored`).

use std::sync::Arc;
use std::time::Duration;
use xfer::cuda::CopyMethod;
use xfer::kv::{KvLayout, KvRank, KvRequest, Side};
use xfer::{
    Agent, AgentOptions, CudaIpcOptions, MemoryKind, MemoryRegion, TransportChoice, TransportKind,
};

mod common;
use common::kv::{cells, region_lens, shapes, table, value};

const T: Duration = Duration::from_secs(60);

#[test]
fn the_gpus_this_machine_must_have_are_here() {
    gpu_mem::testing::check_required_gpus();
}

type Ranks = Vec<(KvRank, Vec<Arc<xfer::cuda::DeviceBuffer>>)>;

fn ranks(
    dev: &xfer::cuda::Device,
    side: Side,
    layouts: &[KvLayout],
    all: (&[KvLayout], &[KvLayout]),
    method: Option<CopyMethod>,
) -> Ranks {
    layouts
        .iter()
        .enumerate()
        .map(|(r, l)| {
            let bufs: Vec<Arc<xfer::cuda::DeviceBuffer>> = region_lens(l)
                .iter()
                .map(|&n| Arc::new(dev.alloc_zeroed(n as usize).unwrap()))
                .collect();
            let mems = bufs
                .iter()
                .map(|b| b.clone() as Arc<dyn MemoryRegion>)
                .collect();
            let agent = Agent::new(AgentOptions {
                name: Some(format!("gpu-kv-{side}-{r}")),
                transport: TransportChoice::Only(TransportKind::CudaIpc),
                memory: MemoryKind::Cuda,
                rails: Some(2),
                pin: xfer::PinMode::Off,
                cuda_ipc: CudaIpcOptions {
                    copy_method: method,
                },
                ..AgentOptions::default()
            })
            .unwrap();
            let rank =
                KvRank::register(agent, side, r as u32, mems, all.0.to_vec(), all.1.to_vec())
                    .unwrap();
            (rank, bufs)
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU"]
fn every_shape_over_cuda_ipc_with_device_caches() {
    every_shape(None);
}

#[test]
#[ignore = "needs a GPU"]
fn every_shape_over_cuda_ipc_with_the_rows_kernel() {
    every_shape(Some(CopyMethod::KernelRows));
}

/// Every shape pushed and pulled between ranks whose copies use `method` (`None`: the
/// default), every decode byte checked.
fn every_shape(method: Option<CopyMethod>) {
    let cuda = gpu_mem::testing::require_gpus(1);
    let dev = cuda.device(0).unwrap();
    for (i, s) in shapes().iter().enumerate() {
        let all = (&s.prefill[..], &s.decode[..]);
        let prefill = ranks(&dev, Side::Prefill, &s.prefill, all, method);
        let decode = ranks(&dev, Side::Decode, &s.decode, all, method);
        for (p, _) in &prefill {
            for (d, _) in &decode {
                p.attach(&d.info()).unwrap();
                d.attach(&p.info()).unwrap();
            }
        }
        let (pb, db) = (s.prefill[0].num_blocks, s.decode[0].num_blocks);
        let (p_bs, d_bs) = (
            s.prefill[0].block_size as u64,
            s.decode[0].block_size as u64,
        );
        let tokens = (pb as u64 * p_bs).min(db as u64 * d_bs) - 5;
        let req = KvRequest::new(
            tokens,
            table(tokens.div_ceil(p_bs) as usize, pb, 5 + i as u64),
            table(tokens.div_ceil(d_bs) as usize, db, 17 + i as u64),
        );
        for (r, (rank, bufs)) in prefill.iter().enumerate() {
            let l = rank.layout();
            let t = req.table(Side::Prefill, r as u32, prefill.len()).unwrap();
            cells(l, t, req.num_tokens, |reg, off, layer, c, token, head| {
                let bytes: Vec<u8> = (0..l.head_bytes)
                    .map(|i| value(layer, c, token, head, i))
                    .collect();
                bufs[reg].copy_from_host(off, &bytes).unwrap();
            });
        }
        let check = |what: &str| {
            for (r, (rank, bufs)) in decode.iter().enumerate() {
                let l = rank.layout();
                let t = req.table(Side::Decode, r as u32, decode.len()).unwrap();
                let host: Vec<Vec<u8>> =
                    bufs.iter().map(|b| b.to_vec(0, b.len()).unwrap()).collect();
                cells(l, t, req.num_tokens, |reg, off, layer, c, token, head| {
                    let got = &host[reg][off as usize..(off + l.head_bytes) as usize];
                    let want: Vec<u8> = (0..l.head_bytes)
                        .map(|i| value(layer, c, token, head, i))
                        .collect();
                    assert_eq!(
                        got,
                        &want[..],
                        "{} {what}: decode rank {r} layer {layer} token {token} head {head}",
                        s.name
                    );
                });
            }
        };
        let plan = prefill[0].0.plan(&req).unwrap();
        let id = format!("gpu-push-{i}");
        let sends: Vec<_> = prefill
            .iter()
            .map(|(p, _)| p.push(id.as_bytes(), &plan, None).unwrap())
            .collect();
        for (d, _) in &decode {
            d.wait(id.as_bytes(), T).unwrap();
        }
        for t in &sends {
            t.wait(T).unwrap();
        }
        check("push");
        for (_, bufs) in &decode {
            for b in bufs {
                b.fill(0, b.len() as u64, 0).unwrap();
            }
        }
        let id = format!("gpu-pull-{i}");
        for (d, _) in &decode {
            d.pull(id.as_bytes(), &plan).unwrap().wait(T).unwrap();
        }
        check("pull");
    }
}
