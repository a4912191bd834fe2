//! Stream order over libfabric's `shm` with GPU memory (FI_HMEM), between two processes as
//! shm is used: the source is filled by a kernel queued behind half a second of GPU time,
//! the WRITE is submitted at once with a fence on that stream, and the target, reading on a
//! stream of its own right after the immediate data arrived, must find every byte of the
//! fill. The target is this test binary again (`XFER_STREAM_ORDER_CHILD=1`); the two talk
//! through its stdin and stdout.
//!
//! Needs a GPU and a libfabric built with CUDA, so it is `#[ignore]`d: `--include-ignored`
//! runs it (`scripts/efa-hmem-proof.sh`), failing with what is missing where something is.

use fabric_core::engine::{Engine, EngineConfig, Transfer};
use fabric_core::plan::Segment;
use fabric_core::{Access, MemoryRegion, RemoteKey, RemoteRegion};
use gpu_mem::StreamRef;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;
use transport_efa::{EfaConfig, EfaTransport};

const LEN: usize = 64 << 20;
const T: Duration = Duration::from_secs(60);
const TEST: &str = "a_fenced_write_of_gpu_memory_over_shm_waits_for_the_stream";

fn engine() -> Engine {
    let provider = std::env::var("XFER_HMEM_PROVIDER").unwrap_or_else(|_| "shm".into());
    let cfg = EfaConfig::with_provider(provider.clone()).hmem(true);
    Engine::spawn(move || EfaTransport::new(&cfg), EngineConfig::default()).unwrap_or_else(|e| {
        panic!("needs a libfabric provider with FI_HMEM ({provider}, built with CUDA): {e}")
    })
}

/// The line after "XFER " in what `r` says (the harness may print before it on a line).
fn said(r: &mut impl BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).expect("read a line") > 0,
            "the other process ended"
        );
        if let Some(at) = line.find("XFER ") {
            return line[at + 5..].trim_end().to_owned();
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU and a libfabric with FI_HMEM (--include-ignored runs it; scripts/efa-hmem-proof.sh)"]
fn a_fenced_write_of_gpu_memory_over_shm_waits_for_the_stream() {
    if std::env::var_os("XFER_STREAM_ORDER_CHILD").is_some() {
        return target();
    }
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let a = engine();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            TEST,
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("XFER_STREAM_ORDER_CHILD", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the target process");
    let mut from = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut to = child.stdin.take().unwrap();
    let addr = hex::decode(said(&mut from).strip_prefix("addr ").expect("addr")).unwrap();
    let key: Vec<u64> = said(&mut from)
        .strip_prefix("region ")
        .expect("region")
        .split(' ')
        .map(|w| w.parse().unwrap())
        .collect();
    let region = RemoteRegion {
        addr: key[0],
        len: key[1],
        key: RemoteKey(key[2]),
    };
    let src = Arc::new(gpu.alloc_zeroed(LEN).unwrap());
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let peer = a.add_peer(&addr).unwrap();
    gpu.synchronize().unwrap();
    gpu_mem::testing::late_fill(&src, 7, Duration::from_millis(500), StreamRef::LEGACY).unwrap();
    let fence = gpu.fence_on(StreamRef::LEGACY).unwrap();
    let t = Transfer::new(peer)
        .segment(Segment {
            src: s.local,
            src_offset: 0,
            dst: region,
            dst_offset: 0,
            len: LEN as u64,
        })
        .imm(11)
        .after(Arc::new(fence));
    a.submit(t).unwrap().wait(T).expect("the write");
    writeln!(to, "XFER written").unwrap();
    let verdict = said(&mut from);
    writeln!(to, "XFER quit").unwrap();
    assert!(child.wait().unwrap().success(), "the target process failed");
    assert_eq!(
        verdict,
        format!("filled {LEN}"),
        "bytes of the fill at the target"
    );
}

/// The target: GPU memory registered for remote writes; once the immediate data arrived,
/// reads it at once on a stream of its own and says how many bytes carry the fill.
fn target() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let b = engine();
    let dst = Arc::new(gpu.alloc_zeroed(LEN).unwrap());
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    println!("XFER addr {}", hex::encode(b.address()));
    println!(
        "XFER region {} {} {}",
        d.remote.addr, d.remote.len, d.remote.key.0
    );
    let ev = b.next_event(T).expect("the immediate data");
    assert_eq!(ev.imm(), Some(11));
    let host = Arc::new(gpu.alloc_pinned(LEN).unwrap());
    let mut reader = gpu.copy_stream().unwrap();
    reader
        .copy_d2h_async(&dst, 0, &host, 0, LEN as u64)
        .unwrap();
    reader.record_event().unwrap().synchronize().unwrap();
    let mut got = vec![0u8; LEN];
    host.read_to_host(0, &mut got).unwrap();
    let mut stdin = std::io::stdin().lock();
    assert_eq!(said(&mut stdin), "written");
    println!("XFER filled {}", got.iter().filter(|&&v| v == 7).count());
    assert_eq!(said(&mut stdin), "quit");
}
