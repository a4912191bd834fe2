//! `xfer kv-bench` end to end on this machine: host memory over tcp, each rank a process:
//! the request's size, its plan's counts and both timings are reported.

use std::process::Command;

#[test]
fn kv_bench_moves_a_request_between_rank_processes_and_reports_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args([
            "kv-bench",
            "--memory",
            "host",
            "--transport",
            "tcp",
            "--tokens",
            "256",
        ])
        .args([
            "--requests",
            "1",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "4",
            "--json",
        ])
        .output()
        .expect("xfer runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "xfer kv-bench failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    // 32 layers x K and V x 256 tokens x 8 heads x 128 x 2 bytes.
    assert_eq!(v["request_bytes"], 32 * 2 * 256 * 8 * 128 * 2);
    // Each decode rank's half of a prefill rank's heads: a run per block (16 blocks,
    // random tables) per pair, 4 pairs, 64 tensors.
    assert_eq!(v["transfers_per_request"], 16 * 4 * 64);
    assert!(v["kv_gbps_median"].as_f64().unwrap() > 0.0);
    assert!(
        v["ratio"].as_f64().unwrap() > 0.0,
        "the paged write ran too"
    );
}

#[test]
fn kv_bench_refuses_an_unknown_order() {
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(["kv-bench", "--memory", "host", "--order", "nchw"])
        .output()
        .expect("xfer runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--order nchw: nhd or hnd"));
}

#[test]
fn kv_bench_takes_a_copy_method_by_name_and_refuses_another() {
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(["kv-bench", "--cuda-copy", "dma"])
        .output()
        .expect("xfer runs");
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("kernel-rows") && stderr.contains("\"dma\""),
        "{stderr}"
    );
    // Over tcp with host memory the method is accepted and passed to every rank process
    // (cuda-ipc is the transport that uses it).
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(["kv-bench", "--memory", "host", "--transport", "tcp"])
        .args(["--tokens", "64", "--requests", "1", "--no-baseline"])
        .args(["--cuda-copy", "kernel-rows", "--json"])
        .output()
        .expect("xfer runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "xfer kv-bench failed: {stderr}");
}
