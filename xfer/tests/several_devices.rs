//! One agent, memory of several devices: an agent registers host memory and the memory of
//! two devices beside it, and one pair of agents moves bytes between any two of them over
//! tcp, which copies device memory through staging per region (each region's own device).
//! The devices here are fakes: host bytes behind a region that offers no host pointer and
//! says it is device 0's or device 1's memory, as GPU memory does, so that the transport
//! must reach every byte through the region's copy methods. The same transfers with two
//! real GPUs need a machine that has them (`gpu_one_agent.rs` covers host and one GPU).

use fabric_core::testing::ClaimedDevice;
use std::sync::atomic::Ordering;
use std::time::Duration;
use xfer::{
    Access, Agent, AgentOptions, HostBuffer, MemoryLocation, Region, Transfer, TransportChoice,
    TransportKind,
};

const T: Duration = Duration::from_secs(30);
const LEN: usize = 1 << 20;

/// Whether `len` bytes of `b` from `at` are all `byte`.
fn all(b: &HostBuffer, at: usize, len: usize, byte: u8) -> bool {
    b.to_vec(at as u64, len).unwrap().iter().all(|&x| x == byte)
}

fn tcp_agent(name: &str) -> Agent {
    Agent::new(AgentOptions {
        name: Some(name.into()),
        transport: TransportChoice::Only(TransportKind::Tcp),
        rails: Some(2),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("a tcp agent")
}

/// `len` bytes from `src` at 0 into `dst` at `at`, with immediate data `imm`, seen landed.
fn write(a: &Agent, b: &Agent, peer: &xfer::Peer, src: &Region, dst: &Region, at: u64, imm: u32) {
    let len = (LEN / 4) as u64;
    a.submit(
        peer,
        src,
        dst.descriptor(),
        Transfer::segments(vec![(0, at, len)]).imm(imm),
    )
    .unwrap()
    .wait(T)
    .unwrap();
    b.wait_imm(imm, 1, T).unwrap();
}

#[test]
fn one_agent_moves_host_memory_and_two_devices_memory_between_any_two() {
    let (a, b) = (tcp_agent("a"), tcp_agent("b"));
    let peer = a.connect(b.info()).unwrap();

    // a: host memory and both devices' memory, each a different byte.
    let host = HostBuffer::new_shared(LEN).unwrap();
    host.fill(0, LEN as u64, 0x11).unwrap();
    let (d0, d1) = (ClaimedDevice::new(0, LEN), ClaimedDevice::new(1, LEN));
    d0.bytes.fill(0, LEN as u64, 0x22).unwrap();
    d1.bytes.fill(0, LEN as u64, 0x33).unwrap();
    let sh = a.register(host, Access::NONE).unwrap();
    let s0 = a.register(d0.clone(), Access::NONE).unwrap();
    let s1 = a.register(d1.clone(), Access::NONE).unwrap();
    assert_eq!(s1.descriptor().memory, MemoryLocation::Cuda { device: 1 });

    // b: the same three kinds, written by a.
    let (t0, t1) = (ClaimedDevice::new(0, LEN), ClaimedDevice::new(1, LEN));
    let host_dst = HostBuffer::new_shared(LEN).unwrap();
    let w = Access::REMOTE_WRITE | Access::REMOTE_READ;
    let th = b.register(host_dst.clone(), w).unwrap();
    let r0 = b.register(t0.clone(), w).unwrap();
    let r1 = b.register(t1.clone(), w).unwrap();
    assert_eq!(r0.descriptor().memory, MemoryLocation::Cuda { device: 0 });

    let q = (LEN / 4) as u64;
    // Into device 1: from host memory, from device 0, from device 1.
    write(&a, &b, &peer, &sh, &r1, 0, 1);
    write(&a, &b, &peer, &s0, &r1, q, 2);
    write(&a, &b, &peer, &s1, &r1, 2 * q, 3);
    // Into device 0 and into host memory, from device 1.
    write(&a, &b, &peer, &s1, &r0, 0, 4);
    write(&a, &b, &peer, &s0, &th, 0, 5);

    let q = q as usize;
    let mut got = vec![0; 3 * q];
    t1.bytes.read(0, &mut got).unwrap();
    assert!(got[..q].iter().all(|&x| x == 0x11), "host -> device 1");
    assert!(got[q..2 * q].iter().all(|&x| x == 0x22), "device 0 -> 1");
    assert!(got[2 * q..].iter().all(|&x| x == 0x33), "device 1 -> 1");
    assert!(t0.all(0, q, 0x33), "device 1 -> 0");
    assert!(all(&host_dst, 0, q, 0x22), "device 0 -> host");
    // Nothing else was written.
    assert!(t1.all(3 * q as u64, q, 0), "past what was written");

    // And back by READ: a pulls b's device 1 bytes into its device 0 memory.
    let pulled = ClaimedDevice::new(0, LEN);
    let local = a.register(pulled.clone(), Access::LOCAL_WRITE).unwrap();
    a.submit(
        &peer,
        &local,
        r1.descriptor(),
        Transfer::segments(vec![(0, q as u64, q as u64)]).read(),
    )
    .unwrap()
    .wait(T)
    .unwrap();
    assert!(pulled.all(0, q, 0x22), "read from device 1 into device 0");

    // Every device byte went through its region's copies, never a host pointer.
    for d in [&d0, &d1, &t0, &t1, &pulled] {
        assert!(d.copies.load(Ordering::Relaxed) > 0);
    }
}
