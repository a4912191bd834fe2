//! One agent for host and GPU memory: an agent of GPU memory (`MemoryKind::Cuda`, every
//! transport that can work: cuda-ipc, tcp) registers host memory too, and each transfer
//! goes over the first transport on which both its regions are registered: GPU to GPU over
//! cuda-ipc, host to GPU over cuda-ipc (a host source), GPU to host over tcp (cuda-ipc
//! cannot reach host memory that peers write). And an agent of tcp holding host memory and
//! two GPUs' memory at once. Needs one GPU (and two for the second): ignored here, run by
//! the GPU kit (`gpu-kit/gpu_one_agent_tests --include-ignored`).

use std::sync::Arc;
use std::time::Duration;
use xfer::{
    Access, Agent, AgentOptions, HostBuffer, MemoryKind, MemoryRegion, Transfer, TransportKind,
};

const T: Duration = Duration::from_secs(30);
const LEN: usize = 1 << 20;

fn gpu_agent(name: &str) -> Agent {
    Agent::new(AgentOptions {
        name: Some(name.into()),
        memory: MemoryKind::Cuda,
        gpu: 0,
        rails: Some(1),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("an agent of GPU memory")
}

#[test]
fn the_gpus_this_machine_must_have_are_here() {
    gpu_mem::testing::check_required_gpus();
}

#[test]
#[ignore = "needs a GPU"]
fn host_and_gpu_memory_move_through_one_pair_of_agents() {
    let cuda = xfer::cuda::Cuda::probe().unwrap().expect("a GPU");
    let gpu = cuda.device(0).unwrap();
    let (a, b) = (gpu_agent("a"), gpu_agent("b"));
    let peer = a.connect(b.info()).unwrap();
    assert_eq!(
        peer.transports(),
        vec![TransportKind::CudaIpc, TransportKind::Tcp]
    );
    let host_src = HostBuffer::new_shared(LEN).unwrap();
    host_src.fill(0, LEN as u64, 0x5a).unwrap();
    let gpu_src: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc_zeroed(LEN).unwrap());
    gpu_src.write_from_host(0, &vec![0xa5; LEN]).unwrap();
    let gpu_dst: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc_zeroed(LEN).unwrap());
    let host_dst = HostBuffer::new_shared(LEN).unwrap();

    let hs = a.register(host_src, Access::NONE).unwrap();
    let gs = a.register(gpu_src, Access::NONE).unwrap();
    let gd = b.register(gpu_dst.clone(), Access::REMOTE_WRITE).unwrap();
    let hd = b.register(host_dst.clone(), Access::REMOTE_WRITE).unwrap();
    // Host memory that peers write is not on cuda-ipc; GPU memory is on both.
    assert!(hd.descriptor().on(TransportKind::CudaIpc).is_none());
    assert!(hd.descriptor().on(TransportKind::Tcp).is_some());
    assert!(gd.descriptor().on(TransportKind::CudaIpc).is_some());

    let half = (LEN / 2) as u64;
    // Host -> GPU: the first half of b's GPU buffer.
    a.submit(
        &peer,
        &hs,
        gd.descriptor(),
        Transfer::segments(vec![(0, 0, half)]).imm(1),
    )
    .unwrap()
    .wait(T)
    .unwrap();
    // GPU -> GPU: the second half.
    a.submit(
        &peer,
        &gs,
        gd.descriptor(),
        Transfer::segments(vec![(0, half, half)]).imm(2),
    )
    .unwrap()
    .wait(T)
    .unwrap();
    // GPU -> host: all of b's host buffer.
    a.submit(
        &peer,
        &gs,
        hd.descriptor(),
        Transfer::segments(vec![(0, 0, LEN as u64)]).imm(3),
    )
    .unwrap()
    .wait(T)
    .unwrap();
    for v in 1..=3 {
        b.wait_imm(v, 1, T).unwrap();
    }
    let mut got = vec![0u8; LEN];
    gpu_dst.read_to_host(0, &mut got).unwrap();
    assert!(got[..LEN / 2].iter().all(|&x| x == 0x5a), "host -> GPU");
    assert!(got[LEN / 2..].iter().all(|&x| x == 0xa5), "GPU -> GPU");
    assert_eq!(
        host_dst.to_vec(0, LEN).unwrap(),
        vec![0xa5; LEN],
        "GPU -> host"
    );
}

/// One agent, host memory and two GPUs' memory: a tcp agent registers all three (each
/// device region copied through staging on its own device) and one pair of agents moves
/// between GPU 0, GPU 1 and host memory. `several_devices.rs` runs the same without GPUs.
#[test]
#[ignore = "needs 2 CUDA GPUs (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn two_gpus_and_host_memory_through_one_pair_of_tcp_agents() {
    let cuda = gpu_mem::testing::require_gpus(2);
    let (g0, g1) = (cuda.device(0).unwrap(), cuda.device(1).unwrap());
    let agent = |name: &str| {
        Agent::new(AgentOptions {
            name: Some(name.into()),
            transport: xfer::TransportChoice::Only(TransportKind::Tcp),
            rails: Some(2),
            pin: xfer::PinMode::Off,
            ..AgentOptions::default()
        })
        .expect("a tcp agent")
    };
    let (a, b) = (agent("a"), agent("b"));
    let peer = a.connect(b.info()).unwrap();
    let src0: Arc<dyn MemoryRegion> = Arc::new(g0.alloc_zeroed(LEN).unwrap());
    src0.write_from_host(0, &vec![0x10; LEN]).unwrap();
    let src1: Arc<dyn MemoryRegion> = Arc::new(g1.alloc_zeroed(LEN).unwrap());
    src1.write_from_host(0, &vec![0x11; LEN]).unwrap();
    let host = HostBuffer::new_shared(LEN).unwrap();
    host.fill(0, LEN as u64, 0x12).unwrap();
    let dst0: Arc<dyn MemoryRegion> = Arc::new(g0.alloc_zeroed(LEN).unwrap());
    let dst1: Arc<dyn MemoryRegion> = Arc::new(g1.alloc_zeroed(LEN).unwrap());
    let host_dst = HostBuffer::new_shared(LEN).unwrap();

    let s0 = a.register(src0, Access::NONE).unwrap();
    let s1 = a.register(src1, Access::NONE).unwrap();
    let sh = a.register(host, Access::NONE).unwrap();
    let d0 = b.register(dst0.clone(), Access::REMOTE_WRITE).unwrap();
    let d1 = b.register(dst1.clone(), Access::REMOTE_WRITE).unwrap();
    let dh = b.register(host_dst.clone(), Access::REMOTE_WRITE).unwrap();
    let third = (LEN / 3) as u64;
    // GPU 1 gets a third from each: GPU 0, GPU 1, host. GPU 0 gets GPU 1's; host gets GPU 0's.
    let moves = [
        (&s0, &d1, 0),
        (&s1, &d1, third),
        (&sh, &d1, 2 * third),
        (&s1, &d0, 0),
        (&s0, &dh, 0),
    ];
    for (imm, (src, dst, at)) in (1u32..).zip(moves) {
        a.submit(
            &peer,
            src,
            dst.descriptor(),
            Transfer::segments(vec![(0, at, third)]).imm(imm),
        )
        .unwrap()
        .wait(T)
        .unwrap();
        b.wait_imm(imm, 1, T).unwrap();
    }
    let t = third as usize;
    let mut got = vec![0u8; LEN];
    dst1.read_to_host(0, &mut got).unwrap();
    assert!(got[..t].iter().all(|&x| x == 0x10), "GPU 0 -> GPU 1");
    assert!(got[t..2 * t].iter().all(|&x| x == 0x11), "GPU 1 -> GPU 1");
    assert!(
        got[2 * t..3 * t].iter().all(|&x| x == 0x12),
        "host -> GPU 1"
    );
    dst0.read_to_host(0, &mut got).unwrap();
    assert!(got[..t].iter().all(|&x| x == 0x11), "GPU 1 -> GPU 0");
    let h = host_dst.to_vec(0, t).unwrap();
    assert!(h.iter().all(|&x| x == 0x10), "GPU 0 -> host");
}

/// An agent of GPU 0 (cuda-ipc and tcp) registers GPU 1's memory too: cuda-ipc (whose rails
/// copy on GPU 0) leaves it out, tcp holds it, and its transfers go over tcp.
#[test]
#[ignore = "needs 2 CUDA GPUs (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn two_gpus_in_an_agent_of_gpu_0_the_other_gpus_memory_goes_over_tcp() {
    let cuda = gpu_mem::testing::require_gpus(2);
    let g1 = cuda.device(1).unwrap();
    let (a, b) = (gpu_agent("a"), gpu_agent("b"));
    let peer = a.connect(b.info()).unwrap();
    let src: Arc<dyn MemoryRegion> = Arc::new(g1.alloc_zeroed(LEN).unwrap());
    src.write_from_host(0, &vec![0x61; LEN]).unwrap();
    let dst: Arc<dyn MemoryRegion> = Arc::new(g1.alloc_zeroed(LEN).unwrap());
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    assert!(d.descriptor().on(TransportKind::CudaIpc).is_none());
    assert!(d.descriptor().on(TransportKind::Tcp).is_some());
    a.submit(
        &peer,
        &s,
        d.descriptor(),
        Transfer::segments(vec![(0, 0, LEN as u64)]).imm(9),
    )
    .unwrap()
    .wait(T)
    .unwrap();
    b.wait_imm(9, 1, T).unwrap();
    let mut got = vec![0u8; LEN];
    dst.read_to_host(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0x61), "GPU 1 -> GPU 1 over tcp");
}
