//! `--op read`: demo and bench READ the pages from the peer's region, and the check is of
//! the initiator's region (the peer's pattern must be there after the run); what a READ
//! cannot do is one clear line.

mod common;

use common::Server;
use serde_json::Value;
use std::process::{Command, Output};

fn xfer<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(args)
        .env_remove("RUST_LOG")
        .env("HWLOC_LIBXML_IMPORT", "0")
        .output()
        .expect("xfer runs")
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {text:?}"))
}

/// The one line on stderr of a run that failed with `code`.
fn one_line(out: &Output, code: i32) -> String {
    assert_eq!(
        out.status.code(),
        Some(code),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line on stderr, got {lines:?}");
    lines[0].to_owned()
}

fn small_demo(extra: &[&str]) -> Output {
    demo_of_pages("4KiB", extra)
}

fn demo_of_pages(page_size: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "demo",
        "--page-size",
        page_size,
        "--pages",
        "64",
        "--bytes",
        "4MiB",
        "--region-size",
        "4MiB",
        "--json",
    ];
    args.extend_from_slice(extra);
    xfer(&args)
}

#[test]
fn demo_read_verifies_the_initiators_region() {
    for extra in [
        &["--op", "read", "--transport", "tcp"][..],
        &["--op", "read", "--transport", "tcp", "--rails", "3"][..],
        &["--op", "read", "--transport", "mem", "--rails", "2"][..],
    ] {
        let v = json_of(&small_demo(extra));
        assert_eq!(v["verified"], true, "{extra:?}");
        assert_eq!(v["op"], "read", "{extra:?}");
        assert_eq!(v["bytes"], 4 << 20, "{extra:?}");
    }
    let v = json_of(&demo_of_pages(
        "64KiB",
        &["--op", "read", "--transport", "tcp"],
    ));
    assert_eq!(
        (v["op"].as_str(), v["verified"].as_bool()),
        (Some("read"), Some(true))
    );
    // Writes are the default, and the summary says so.
    let v = json_of(&small_demo(&["--transport", "tcp"]));
    assert_eq!(
        (v["op"].as_str(), v["verified"].as_bool()),
        (Some("write"), Some(true))
    );
    // The text summary names the op too.
    let out = xfer(&[
        "demo",
        "--op",
        "read",
        "--transport",
        "tcp",
        "--bytes",
        "1MiB",
        "--region-size",
        "4MiB",
        "--page-size",
        "4KiB",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("tcp read "), "{text}");
}

#[test]
fn read_with_what_a_read_cannot_do_is_one_clear_line() {
    // A READ carries no immediate data, which --latency times.
    let line = one_line(&small_demo(&["--op", "read", "--latency"]), 2);
    assert!(
        line.contains("--op read") && line.contains("--latency"),
        "{line}"
    );
    // An op that does not exist.
    let out = small_demo(&["--op", "erase"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("erase"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn read_over_efa_verifies_the_initiators_region() {
    // transport-efa reads with fi_readmsg (libfabric's tcp provider here).
    let out = small_demo(&["--op", "read", "--transport", "efa", "--provider", "tcp"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json_of(&out);
    assert_eq!(v["transport"], "efa", "{v}");
    assert_eq!(v["op"], "read", "{v}");
    assert_eq!(v["verified"], true, "{v}");
}

#[test]
fn bench_read_verifies_its_own_region_against_the_servers_pattern() {
    let mut serve = Command::new(env!("CARGO_BIN_EXE_xfer"));
    serve.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        "8MiB",
        "--rails",
        "2",
    ]);
    let server = Server::spawn(serve);
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--peer",
            &server.peer,
            "--page-size",
            "4KiB",
            "--pages",
            "16",
            "--bytes",
            "2MiB",
            "--region-size",
            "8MiB",
            "--json",
        ];
        args.extend_from_slice(extra);
        xfer(&args)
    };
    // Seeds differ between runs: a region left from an earlier run would not match.
    for (seed, rails) in [("3", "1"), ("4", "3")] {
        let v = json_of(&bench(&["--op", "read", "--seed", seed, "--rails", rails]));
        assert_eq!(v["verified"], true, "seed {seed}");
        assert_eq!(v["op"], "read");
    }
    // A write after the reads still verifies at the server.
    let v = json_of(&bench(&["--seed", "5"]));
    assert_eq!(
        (v["op"].as_str(), v["verified"].as_bool()),
        (Some("write"), Some(true))
    );
    let line = one_line(&bench(&["--op", "read", "--latency"]), 2);
    assert!(line.contains("--op read"), "{line}");
}
