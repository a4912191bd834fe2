//! Two processes: the real CUDA IPC path (a handle exported by one process, opened by the
//! other), and what happens when the target process exits.
//!
//! The test re-runs its own binary, the same test with `XFER_IPC_CHILD` set, as the target.
//! Compiled everywhere and `#[ignore]`d without a GPU (`--include-ignored` runs it, and it
//! fails naming what is missing where there is no GPU); `cuda_is_there_when_required`
//! always runs and fails when `XFER_REQUIRE_CUDA` asks for a GPU this machine lacks.

mod common;

use fabric_core::testing::pattern;
use fabric_core::{
    Access, Completion, LocalSlice, OpError, OpKind, RemoteKey, RemoteRegion, RemoteSlice,
    Transport, WorkRequestId,
};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport};

const PAGE: u64 = 65536;
const PAGES: u64 = 256;
const IMM: u32 = 0xC0FFEE;

/// The target process: registers device memory of `XFER_IPC_DEVICE`, prints its address
/// and descriptor, waits for the writes' immediate data, checks every byte, reports, then
/// serves until its stdin closes.
fn child_target() {
    let (cuda, _) = common::cuda();
    let device: u32 = std::env::var("XFER_IPC_DEVICE").unwrap().parse().unwrap();
    let mut t = CudaIpcTransport::new(
        cuda,
        CudaIpcConfig {
            device,
            ..CudaIpcConfig::default()
        },
    )
    .unwrap();
    let mem = Arc::new(
        cuda.device(device)
            .unwrap()
            .alloc_zeroed((PAGE * PAGES) as usize)
            .unwrap(),
    );
    let reg = t.register(mem.clone(), Access::REMOTE_WRITE).unwrap();
    println!(
        "READY {} {} {}",
        hex::encode(t.address()),
        reg.remote.key.0,
        reg.remote.len
    );
    std::io::stdout().flush().unwrap();
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done.iter().any(|c: &Completion| c.imm == Some(IMM)) {
        assert!(Instant::now() < deadline, "no immediate data");
        t.poll(&mut done).unwrap();
    }
    let want = expected();
    let got = mem.to_vec(0, want.len()).unwrap();
    println!("{}", if got == want { "VERIFIED" } else { "MISMATCH" });
    std::io::stdout().flush().unwrap();
    // Serve (answer reservations) until the parent closes our stdin.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        s.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        t.wait(Duration::from_millis(10)).unwrap();
        t.poll(&mut done).unwrap();
    }
}

/// Page i of the source lands at page (i * 37) % PAGES of the target.
fn target_page(i: u64) -> u64 {
    (i * 37) % PAGES
}

fn expected() -> Vec<u8> {
    let data = pattern(21, (PAGE * PAGES) as usize);
    let mut want = vec![0u8; data.len()];
    for i in 0..PAGES {
        let (s, d) = ((i * PAGE) as usize, (target_page(i) * PAGE) as usize);
        want[d..d + PAGE as usize].copy_from_slice(&data[s..s + PAGE as usize]);
    }
    want
}

#[test]
fn cuda_is_there_when_required() {
    gpu_mem::testing::check_required_gpus();
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/ipc-proof.sh)"]
fn writes_across_processes_then_the_target_exits() {
    if std::env::var("XFER_IPC_CHILD").is_ok() {
        return child_target();
    }
    let (cuda, gpu) = common::cuda();
    let target_device = if cuda.device_count().unwrap() > 1 {
        1
    } else {
        0
    };
    eprintln!("target process on CUDA device {target_device}");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "writes_across_processes_then_the_target_exits",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("XFER_IPC_CHILD", "1")
        .env("XFER_IPC_DEVICE", target_device.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = loop {
        let l = lines.next().expect("child output").unwrap();
        // libtest may print "test child_target ... " on the same line first.
        if let Some(at) = l.find("READY ") {
            break l[at + 6..].to_string();
        }
    };
    let f: Vec<&str> = ready.split(' ').collect();
    let (addr, key, len) = (
        hex::decode(f[0]).unwrap(),
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
    );
    let remote = RemoteRegion {
        addr: 0,
        len,
        key: RemoteKey(key),
    };

    let mut t = CudaIpcTransport::new(cuda, CudaIpcConfig::default()).unwrap();
    eprintln!("copy method: {}", t.copy_method());
    let src = Arc::new(gpu.alloc((PAGE * PAGES) as usize).unwrap());
    src.copy_from_host(0, &pattern(21, (PAGE * PAGES) as usize))
        .unwrap();
    let s = t.register(src, Access::NONE).unwrap();
    let peer = t.add_peer(&addr).unwrap();
    assert_eq!(gpu_mem::open_ipc_mappings(), 0);
    let write = |t: &mut CudaIpcTransport, i: u64, imm| {
        t.post_write(
            peer,
            WorkRequestId(i),
            LocalSlice {
                key: s.local,
                offset: i * PAGE,
                len: PAGE,
            },
            RemoteSlice {
                region: remote,
                offset: target_page(i) * PAGE,
                len: PAGE,
            },
            imm,
        )
    };
    for i in 0..PAGES {
        let r = write(&mut t, i, (i == PAGES - 1).then_some(IMM)).unwrap();
        assert_eq!(r, fabric_core::PostOutcome::Posted);
    }
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.len() < PAGES as usize {
        assert!(
            Instant::now() < deadline,
            "writes did not complete: {}",
            done.len()
        );
        t.poll(&mut done).unwrap();
    }
    assert!(
        done.iter()
            .all(|c| c.op == OpKind::Write && c.result == Ok(PAGE)),
        "{done:?}"
    );
    assert_eq!(
        gpu_mem::open_ipc_mappings(),
        1,
        "the peer's region is mapped once"
    );
    let verdict = lines.next().expect("child verdict").unwrap();
    assert!(
        verdict.ends_with("VERIFIED"),
        "the target process saw other bytes: {verdict}"
    );

    // The target exits: the next write fails with "unreachable", not a hang or a crash.
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut failed = None;
    let mut done = Vec::new();
    while failed.is_none() {
        assert!(Instant::now() < deadline, "no error after the peer exited");
        match write(&mut t, 0, None) {
            Err(e) => failed = Some(e.to_string()),
            Ok(_) => {
                let until = Instant::now() + Duration::from_secs(5);
                while done.is_empty() && Instant::now() < until {
                    t.poll(&mut done).unwrap();
                }
                if let Some(c) = done.pop() {
                    match c.result {
                        Err(OpError::PeerUnreachable { .. }) => failed = Some(format!("{c:?}")),
                        other => panic!("write to an exited peer: {other:?}"),
                    }
                }
            }
        }
    }
    eprintln!("after the target exited: {}", failed.unwrap());
    // The mapping of the exited peer's memory is closed once the peer is removed.
    assert_eq!(
        gpu_mem::open_ipc_mappings(),
        0,
        "a closed connection keeps no mapping"
    );
    t.remove_peer(peer).unwrap();
    assert_eq!(gpu_mem::open_ipc_mappings(), 0);
}
