//! The `xfer` binary as a user runs it: exit codes, one-line errors, JSON output, and a
//! served region written by several bench clients, in turn and at once.

mod common;

use common::Server;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

fn xfer<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(args)
        .env_remove("RUST_LOG")
        // hwloc's built-in XML parser, the only one a machine without libhwloc-plugins has:
        // the suite must pass on such a machine.
        .env("HWLOC_LIBXML_IMPORT", "0")
        .output()
        .expect("xfer runs")
}

fn stdout_json(out: &Output) -> Value {
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {text:?}"))
}

fn stderr_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Asserts the exit code, and that stderr is exactly one line.
fn assert_fails_with_one_line(out: &Output, code: i32) -> String {
    assert_eq!(
        out.status.code(),
        Some(code),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = stderr_lines(out);
    assert_eq!(lines.len(), 1, "expected one line on stderr, got {lines:?}");
    lines.into_iter().next().expect("one line")
}

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../topology/tests/fixtures")
        .join(name)
        .to_str()
        .expect("utf-8 path")
        .to_owned()
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("xfer-cli-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn topo_replays_p5_as_json_with_four_nics_per_gpu() {
    let out = xfer(&["topo", "--xml", &fixture("p5.48xlarge.xml"), "--json"]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = stdout_json(&out);
    assert_eq!(v["topology"]["gpus"].as_array().expect("gpus").len(), 8);
    let workers = v["plan"]["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 8);
    let mut cores = Vec::new();
    for w in workers {
        assert!(w["gpu"].is_u64(), "{w}");
        assert_eq!(w["nics"].as_array().expect("nics").len(), 4, "{w}");
        assert_eq!(w["nic_affinity"], "SameSwitch", "{w}");
        cores.push(w["core"].as_u64().expect("core"));
    }
    cores.sort_unstable();
    cores.dedup();
    assert_eq!(cores.len(), 8, "workers share cores");
    // The rail map: each GPU's efa rails are its 4 switch-local NICs, 32 distinct in all.
    let rails = v["rails"].as_array().expect("rails");
    assert_eq!(rails.len(), 8);
    let mut domains = Vec::new();
    for r in rails {
        let nics = r["efa"]["nics"].as_array().expect("efa nics");
        assert_eq!(nics.len(), 4, "{r}");
        domains.extend(nics.iter().map(|n| n["name"].as_str().unwrap().to_string()));
    }
    domains.sort();
    domains.dedup();
    assert_eq!(domains.len(), 32, "{domains:?}");
}

#[test]
fn topo_prints_a_table_for_the_live_machine() {
    let out = xfer(&["topo"]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for column in ["NUMA", "Worker", "Core", "NICs"] {
        assert!(text.contains(column), "no {column} column in {text}");
    }
}

#[test]
fn topo_of_a_missing_file_is_one_line_and_exit_1() {
    let line = assert_fails_with_one_line(&xfer(&["topo", "--xml", "/nonexistent"]), 1);
    assert!(
        line.contains("/nonexistent") && line.contains("lstopo --of xml"),
        "{line}"
    );
}

#[test]
fn topo_of_malformed_xml_exits_1() {
    let dir = TempDir::new("malformed");
    let whole = std::fs::read_to_string(fixture("p5.48xlarge.xml")).expect("fixture");
    let commented = whole.replacen("<topology", "<!-- saved by hand -->\n<topology", 1);
    for (name, text) in [
        ("truncated.xml", &whole[..whole.len() / 2]),
        ("garbage.xml", "this is not xml <<<"),
        ("html.xml", "<?xml version=\"1.0\"?><html><body/></html>"),
        ("empty.xml", ""),
        ("commented.xml", commented.as_str()),
    ] {
        let path = dir.0.join(name);
        std::fs::write(&path, text).expect("write");
        let out = xfer(&["topo", "--xml", path.to_str().expect("utf-8"), "--json"]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{name}: stderr {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stdout.is_empty(),
            "{name}: printed {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        let line = assert_fails_with_one_line(&out, 1);
        assert!(
            line.starts_with("xfer: error: ")
                && line.contains(path.to_str().expect("utf-8"))
                && line.contains("lstopo --of xml"),
            "{name}: the line names the file and how to write one: {line}"
        );
        if name == "commented.xml" {
            assert!(line.contains("XML comment"), "{name}: {line}");
        }
    }
}

#[test]
fn topo_replays_what_lstopo_exports_with_the_built_in_parser() {
    // A user's real export, as the README tells them to make it (hwloc package, installed by
    // the test command's dependencies).
    let dir = TempDir::new("lstopo");
    let path = dir.0.join("lstopo.xml");
    let path = path.to_str().expect("utf-8");
    let lstopo = Command::new("lstopo")
        .args(["--of", "xml", path])
        .output()
        .expect("lstopo runs (Debian package hwloc, installed by scripts/deps.sh)");
    assert!(lstopo.status.success(), "{lstopo:?}");
    let replayed = xfer(&["topo", "--xml", path, "--json"]);
    assert!(
        replayed.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&replayed.stderr)
    );
    let live = stdout_json(&xfer(&["topo", "--json"]));
    let v = stdout_json(&replayed);
    assert_eq!(v["topology"]["numa_nodes"], live["topology"]["numa_nodes"]);
}

#[test]
fn topo_export_replays_to_the_same_machine() {
    let dir = TempDir::new("export");
    let path = dir.0.join("this-machine.xml");
    let path = path.to_str().expect("utf-8");
    let exported = xfer(&["topo", "--export", path, "--json"]);
    assert!(
        exported.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&exported.stderr)
    );
    let replayed = xfer(&["topo", "--xml", path, "--json"]);
    assert!(
        replayed.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&replayed.stderr)
    );
    let (a, b) = (stdout_json(&exported), stdout_json(&replayed));
    assert_eq!(a["plan"], b["plan"]);
    assert_eq!(a["topology"]["numa_nodes"], b["topology"]["numa_nodes"]);
    let line =
        assert_fails_with_one_line(&xfer(&["topo", "--export", "/nonexistent/dir/t.xml"]), 1);
    assert!(line.contains("/nonexistent/dir/t.xml"), "{line}");
}

#[test]
fn info_json_has_transports_memory_cuda_and_topology() {
    let out = xfer(&["info", "--json"]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = stdout_json(&out);
    let transports = v["transports"].as_array().expect("transports");
    assert!(transports.iter().any(|t| t == "tcp"));
    let memory = v["memory"].as_array().expect("memory");
    assert!(memory.iter().any(|m| m == "host"));
    let devices = v["cuda"]["devices"].as_array().expect("cuda.devices");
    assert_eq!(memory.iter().any(|m| m == "cuda"), !devices.is_empty());
    for d in devices {
        for field in ["name", "total_memory", "pci_bus_id", "driver_version"] {
            assert!(!d[field].is_null(), "device without {field}: {d}");
        }
    }
    assert!(v["cuda"]["driver_present"].is_boolean());
    let t = &v["topology"];
    for field in ["numa_nodes", "cores", "gpus", "nics"] {
        assert!(t[field].is_u64(), "topology without {field}: {v}");
    }
    assert!(t["numa_nodes"].as_u64() >= Some(1));
}

#[test]
fn info_text_says_what_cuda_there_is() {
    let out = xfer(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().any(|l| l.starts_with("CUDA: ")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("topology: ")), "{text}");
}

#[test]
fn demo_verifies_small_run_pinned_and_unpinned() {
    for pin in ["auto", "off"] {
        let out = xfer(&[
            "demo",
            "--page-size",
            "4KiB",
            "--pages",
            "64",
            "--bytes",
            "4MiB",
            "--region-size",
            "4MiB",
            "--json",
            "--pin",
            pin,
        ]);
        assert!(
            out.status.success(),
            "--pin {pin}: stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout_json(&out)["verified"], true, "--pin {pin}");
    }
}

#[test]
fn demo_with_zero_pages_is_a_usage_error() {
    let out = xfer(&["demo", "--pages", "0"]);
    assert_fails_with_one_line(&out, 2);
}

#[test]
fn bench_with_a_malformed_peer_is_a_usage_error() {
    let line = assert_fails_with_one_line(&xfer(&["bench", "--peer", "nonsense"]), 2);
    assert!(line.contains("nonsense"), "{line}");
}

#[test]
fn bench_with_nobody_listening_cannot_reach() {
    let line = assert_fails_with_one_line(&xfer(&["bench", "--peer", "xfer://127.0.0.1:1"]), 1);
    assert!(line.contains("cannot reach"), "{line}");
}

impl Server {
    fn start() -> Server {
        Server::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Server {
        let mut serve = Command::new(env!("CARGO_BIN_EXE_xfer"));
        serve
            .args(["serve", "--listen", "127.0.0.1:0", "--region-size", "8MiB"])
            .args(extra)
            .env("RUST_LOG", "xfer::control=info");
        Server::spawn(serve)
    }
}

fn bench_args(peer: &str) -> Vec<String> {
    [
        "bench",
        "--peer",
        peer,
        "--page-size",
        "4KiB",
        "--pages",
        "16",
        "--bytes",
        "1MiB",
        "--region-size",
        "8MiB",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn assert_bench_verified(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout_json(out)["verified"], true, "{what}");
}

#[test]
fn serve_takes_bench_clients_in_turn_and_at_once() {
    let server = Server::start();
    for round in 0..2 {
        let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
            .args(bench_args(&server.peer))
            .output()
            .expect("bench runs");
        assert_bench_verified(&out, &format!("sequential bench {round}"));
    }
    let clients: Vec<Child> = (0..2)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_xfer"))
                .args(bench_args(&server.peer))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("bench starts")
        })
        .collect();
    for (i, c) in clients.into_iter().enumerate() {
        let out = c.wait_with_output().expect("bench finishes");
        assert_bench_verified(&out, &format!("concurrent bench {i}"));
    }
    drop(server);
}

fn small_demo(extra: &[&str]) -> Output {
    let mut args = vec![
        "demo",
        "--page-size",
        "4KiB",
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

/// `demo --latency` with many pages per transfer: each transfer's pages are distinct (64 of a
/// region's 1024: drawn with replacement, nearly every transfer would repeat a page, which
/// the engine refuses as an overlap), and every transfer is timed both ways.
#[test]
fn demo_latency_of_many_pages_a_transfer_times_every_transfer() {
    let out = small_demo(&["--latency", "--transport", "tcp"]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = stdout_json(&out);
    assert_eq!(j["pages"], 64, "{j}");
    // 4 MiB in transfers of 64 pages of 4 KiB.
    for series in ["transfer", "imm_event", "raw_tcp_round_trip"] {
        assert_eq!(j[series]["count"], 16, "{series}: {j}");
    }
}

#[test]
fn demo_over_three_rails_and_over_mem_verifies() {
    for extra in [
        &["--rails", "3"][..],
        &["--transport", "mem", "--rails", "2"][..],
    ] {
        let out = small_demo(extra);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = stdout_json(&out);
        assert_eq!(v["verified"], true, "{extra:?}");
        assert_eq!(v["bytes"], 4 << 20, "{extra:?}");
    }
}

#[test]
fn demo_over_libfabric_tcp_provider_verifies() {
    // libfabric's tcp provider comes with Debian's libfabric, which the build needs anyway.
    let out = small_demo(&["--transport", "efa", "--provider", "tcp", "--rails", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = stdout_json(&out);
    assert_eq!(v["verified"], true);
    assert_eq!(v["transport"], "efa");
}

#[test]
fn unknown_provider_is_one_clear_line() {
    let out = small_demo(&["--transport", "efa", "--provider", "no-such-provider"]);
    let line = assert_fails_with_one_line(&out, 1);
    assert!(line.contains("no-such-provider"), "{line}");
}

#[test]
fn cuda_memory_without_the_gpu_is_one_clear_line() {
    if gpu_mem::Cuda::probe().ok().flatten().is_some() {
        // A GPU machine: a GPU it does not have is a usage error.
        let out = small_demo(&["--memory", "cuda", "--gpus", "999"]);
        let line = assert_fails_with_one_line(&out, 2);
        assert!(line.contains("999"), "{line}");
    } else {
        let out = small_demo(&["--memory", "cuda"]);
        let line = assert_fails_with_one_line(&out, 1);
        assert!(line.contains("no CUDA driver"), "{line}");
    }
}

#[test]
fn bench_over_two_rails_to_a_four_rail_server_verifies() {
    let server = Server::start();
    let mut args = bench_args(&server.peer);
    args.extend(["--rails".to_string(), "2".to_string()]);
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(&args)
        .output()
        .expect("bench runs");
    assert_bench_verified(&out, "bench --rails 2");
    let mut args = bench_args(&server.peer);
    args.extend([
        "--transport".to_string(),
        "efa".to_string(),
        "--provider".to_string(),
        "tcp".to_string(),
    ]);
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(&args)
        .output()
        .expect("bench runs");
    let line = assert_fails_with_one_line(&out, 1);
    assert!(line.contains("offers tcp, not efa"), "{line}");
}

#[test]
fn serve_with_a_token_refuses_benches_without_it() {
    let server = Server::start_with(&["--auth-token", "t0ken"]);
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(bench_args(&server.peer))
        .env_remove("XFER_AUTH_TOKEN")
        .output()
        .expect("bench runs");
    let line = assert_fails_with_one_line(&out, 1);
    assert!(line.contains("authentication failed"), "{line}");
    assert!(
        !line.contains("t0ken"),
        "the token must never be printed: {line}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(bench_args(&server.peer))
        .env("XFER_AUTH_TOKEN", "t0ken")
        .output()
        .expect("bench runs");
    assert_bench_verified(&out, "bench with the token from XFER_AUTH_TOKEN");
}

#[test]
fn cuda_ipc_with_host_memory_is_a_usage_error_and_auto_on_host_memory_is_tcp() {
    let out = small_demo(&["--transport", "cuda-ipc"]);
    let line = assert_fails_with_one_line(&out, 2);
    assert!(line.contains("add --memory cuda"), "{line}");
    let out = small_demo(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(v["transport"], "tcp");
    assert_eq!(v["path"], "auto: not GPU memory on one host");
}

#[test]
fn per_gpu_runs_one_verified_worker_per_listed_gpu_at_once() {
    let out = small_demo(&["--per-gpu", "--gpus", "0,1,2", "--rails", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let workers = v["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3, "{v}");
    for (w, gpu) in workers.iter().zip([0, 1, 2]) {
        assert_eq!(w["gpu"], gpu);
        assert_eq!(w["verified"], true, "{w}");
        assert_eq!(w["cores"].as_array().unwrap().len(), 2);
    }
    let total: u64 = workers.iter().map(|w| w["bytes"].as_u64().unwrap()).sum();
    assert_eq!(v["bytes"].as_u64().unwrap(), total);
    let out = small_demo(&["--per-gpu", "--gpus", "1,1"]);
    let line = assert_fails_with_one_line(&out, 2);
    assert!(line.contains("listed twice"), "{line}");
}

#[test]
fn bench_per_gpu_writes_to_the_servers_worker_of_each_gpu() {
    let server = Server::start_with(&["--per-gpu", "--gpus", "0,1", "--rails", "2"]);
    let mut args = bench_args(&server.peer);
    args.extend(["--per-gpu", "--gpus", "0,1", "--rails", "2"].map(String::from));
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(&args)
        .output()
        .expect("bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = stdout_json(&out);
    let workers = v["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2, "{v}");
    assert!(workers.iter().all(|w| w["verified"] == true), "{v}");
    // A third worker does not exist at the server: one clear line.
    let mut args = bench_args(&server.peer);
    args.extend(["--per-gpu", "--gpus", "0,1,2"].map(String::from));
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(&args)
        .output()
        .expect("bench runs");
    let line = assert_fails_with_one_line(&out, 1);
    assert!(line.contains("worker 2 does not exist"), "{line}");
}

/// `--bytes` that is not a whole number of pages (not a multiple, less than a page, more
/// than the region) moves whole pages, verifies, and says it rounded up.
#[test]
fn demo_of_part_pages_rounds_up_and_verifies() {
    for (page, bytes, moved) in [
        ("3KiB", "1000000", 1_000_000u64.div_ceil(3072) * 3072),
        ("64KiB", "1000", 65536),
        ("4KiB", "9437185", (9 << 20) + 4096),
    ] {
        let args = [
            "demo",
            "--page-size",
            page,
            "--pages",
            "16",
            "--bytes",
            bytes,
            "--region-size",
            "4MiB",
        ];
        let out = xfer(&args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("verified: yes"), "{args:?}: {text}");
        assert!(
            text.contains(&format!("moved {moved} bytes (rounded up to whole pages)")),
            "{args:?}: {text}"
        );
        let mut json = args.to_vec();
        json.push("--json");
        let v = stdout_json(&xfer(&json));
        assert_eq!(v["verified"], true, "{args:?}");
        assert_eq!(v["bytes"], moved, "{args:?}");
        assert_eq!(v["bytes_asked"], bytes.parse::<u64>().unwrap(), "{args:?}");
    }
    // A whole number of pages is not rounded and says nothing about it.
    let v = stdout_json(&small_demo(&[]));
    assert!(v.get("bytes_asked").is_none(), "{v}");
}

/// Above the stated limit of rails, demo, bench and serve refuse at once with one line.
#[test]
fn too_many_rails_is_one_clear_line_and_exit_2() {
    for args in [
        &["demo", "--rails", "1000", "--bytes", "64MiB"][..],
        &["bench", "--peer", "xfer://127.0.0.1:1", "--rails", "257"][..],
        &["serve", "--listen", "127.0.0.1:0", "--rails", "257"][..],
    ] {
        let line = assert_fails_with_one_line(&xfer(args), 2);
        assert!(line.contains("above the limit of 256"), "{args:?}: {line}");
    }
}

/// The bench line that serve prints uses what the server offers: run as printed (with only
/// knobs of its own added: how much to move and JSON), it writes over all the server's
/// rails into a region of the server's size, and verifies.
#[test]
fn the_bench_line_serve_prints_uses_all_its_rails() {
    let server = Server::start_with(&["--rails", "3"]);
    let printed = server.bench.join(" ");
    assert!(printed.contains("--rails 3"), "{printed}");
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(&server.bench)
        .args(["--bytes", "2MiB", "--json"])
        .env_remove("RUST_LOG")
        .output()
        .expect("bench runs");
    assert_bench_verified(&out, &printed);
    let v = stdout_json(&out);
    assert_eq!(v["rails"], 3, "{printed}: {v}");
    // The server's region (8 MiB) holds fewer than the default 1000 pages of 64 KiB: the
    // line says what fits, so the printed command runs as it is.
    assert!(printed.contains("--region-size 8MiB"), "{printed}");
    assert!(printed.contains("--pages 128"), "{printed}");
}

/// The control address of a server, for raw connections.
fn control_addr(server: &Server) -> std::net::SocketAddr {
    server
        .peer
        .strip_prefix("xfer://")
        .expect("xfer:// address")
        .parse()
        .expect("control address")
}

/// Reads one reply line from a raw control connection, with a deadline; `None` when the
/// server closed it without a reply.
fn reply_line(s: &std::net::TcpStream, within: std::time::Duration) -> Option<Value> {
    s.set_read_timeout(Some(within)).expect("read timeout");
    let mut line = String::new();
    match BufReader::new(s).read_line(&mut line) {
        Ok(0) => None,
        Ok(_) => Some(serde_json::from_str(&line).expect("a JSON reply")),
        Err(e) => panic!("no reply within {within:?}: {e}"),
    }
}

/// Asserts that the server answers `s` with a refusal naming `flag`, the limit it hit.
fn assert_refused(s: &std::net::TcpStream, flag: &str) {
    let r = reply_line(s, std::time::Duration::from_secs(10)).expect("a refusal before the close");
    assert_eq!(r["ok"], false, "{r}");
    let why = r["error"].as_str().expect("a reason");
    assert!(why.contains(flag), "the reason names {flag}: {r}");
}

#[test]
fn serve_refuses_clients_beyond_its_limits_with_the_reason_and_keeps_serving() {
    use common::{greeted, said_hello};
    use std::io::Write;
    use std::time::{Duration, Instant};
    // One place: the second client with a hello is refused for it (and told when to ask
    // again); connections without a hello take no place.
    let server = Server::start_with(&[
        "--max-clients",
        "1",
        "--hello-timeout",
        "2",
        "--max-request-bytes",
        "4KiB",
    ]);
    let addr = control_addr(&server);
    let holder = said_hello(addr);
    let r = reply_line(&holder, Duration::from_secs(10)).expect("a reply");
    assert_eq!(r["ok"], true, "{r}");
    let (_silent_beside, _) = greeted(addr);
    let over = said_hello(addr);
    let r = reply_line(&over, Duration::from_secs(10)).expect("a refusal");
    assert_eq!(r["ok"], false, "{r}");
    assert!(
        r["error"].as_str().unwrap().contains("--max-clients"),
        "{r}"
    );
    assert!(
        r["retry_ms"].as_u64().is_some_and(|ms| ms > 0),
        "says when to ask again: {r}"
    );

    // A connection that never completes its hello is closed, with the reason, at its
    // deadline.
    let (silent, _) = greeted(addr);
    let started = Instant::now();
    assert_refused(&silent, "--hello-timeout");
    let waited = started.elapsed();
    assert!(reply_line(&silent, Duration::from_secs(10)).is_none());
    assert!(
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(8),
        "closed after {waited:?}, --hello-timeout 2"
    );

    // An oversized hello is refused, not buffered.
    let (mut big, _) = greeted(addr);
    let mut line = vec![b' '; 64 << 10];
    line.push(b'\n');
    let _ = big.write_all(&line);
    assert_refused(&big, "--max-request-bytes");
    assert!(reply_line(&big, Duration::from_secs(10)).is_none());

    // When the holder leaves, its place comes back: a real bench verifies (asking again
    // while the server has not seen the close yet).
    drop(holder);
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(bench_args(&server.peer))
        .output()
        .expect("bench runs");
    assert_bench_verified(&out, "bench after the hostile clients");

    // Region bytes: one region fits the cap, a second client's does not, whatever the
    // places.
    let server = Server::start_with(&["--max-clients", "4", "--max-region-bytes", "8MiB"]);
    let addr = control_addr(&server);
    let holder = said_hello(addr);
    assert_eq!(
        reply_line(&holder, Duration::from_secs(10)).expect("a reply")["ok"],
        true
    );
    let second = said_hello(addr);
    assert_refused(&second, "--max-region-bytes");
    assert!(reply_line(&second, Duration::from_secs(10)).is_none());
}

#[test]
fn an_unknown_cuda_copy_method_is_a_usage_error_naming_the_choices() {
    let out = small_demo(&["--cuda-copy", "dma"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("dma") && err.contains("kernel, kernel-rows, batch or memcpy"),
        "{err}"
    );
}

/// `bench --latency` against a server: one JSON object with both series (transfers, and
/// the raw ping-pong against the echo the server opens), a sample per transfer in each,
/// ordered percentiles, no immediate-data series (the target is remote); and the server
/// serves the next client as before.
#[test]
fn bench_latency_times_transfers_and_the_raw_floor_against_the_server() {
    let server = Server::start();
    let peer = server.peer.clone();
    let out = xfer(&[
        "bench",
        "--peer",
        &peer,
        "--latency",
        "--page-size",
        "4KiB",
        "--pages",
        "2",
        "--bytes",
        "400KiB",
        "--region-size",
        "8MiB",
        "--rails",
        "1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = stdout_json(&out);
    assert_eq!(j["transport"], "tcp", "{j}");
    assert_eq!(j["peer"], peer.as_str(), "{j}");
    assert_eq!(j["pages"], 2, "{j}");
    assert!(
        j["imm_event"].is_null(),
        "no imm series for a remote target: {j}"
    );
    for series in ["transfer", "raw_tcp_round_trip"] {
        let s = &j[series];
        // 400 KiB in transfers of two 4 KiB pages.
        assert_eq!(s["count"], 50, "{series}: {j}");
        let at = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{series}.{k}: {j}"));
        let (p50, p90, p99, max, mean) = (
            at("p50_us"),
            at("p90_us"),
            at("p99_us"),
            at("max_us"),
            at("mean_us"),
        );
        assert!(p50 > 0.0, "{series}: {j}");
        assert!(p50 <= p90 && p90 <= p99 && p99 <= max, "{series}: {j}");
        assert!(mean > 0.0 && mean <= max, "{series}: {j}");
        // Each sample finished within its 30 s limit.
        assert!(max < 30e6, "{series}: {j}");
    }
    let ratio = j["ratio_p50"].as_f64().expect("a ratio");
    let want = j["transfer"]["p50_us"].as_f64().unwrap()
        / j["raw_tcp_round_trip"]["p50_us"].as_f64().unwrap();
    assert!((ratio - want).abs() < 1e-9 * want.max(1.0), "{j}");
    // The text form says why the immediate-data line is missing.
    let text = xfer(&[
        "bench",
        "--peer",
        &peer,
        "--latency",
        "--page-size",
        "4KiB",
        "--pages",
        "1",
        "--bytes",
        "40KiB",
        "--region-size",
        "8MiB",
    ]);
    assert!(
        text.status.success(),
        "{}",
        String::from_utf8_lossy(&text.stderr)
    );
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("raw TCP round trip to the server"), "{text}");
    assert!(text.contains("immediate data: not measured"), "{text}");
    let out = xfer(&bench_args(&server.peer));
    assert_bench_verified(&out, "a bench after the latency runs");
}

/// The control channel's echo: refused before hello and for rounds larger than the
/// client's region; else a listener that answers each round with 8 bytes, after which the
/// control connection takes requests again.
#[test]
fn the_echo_request_answers_rounds_and_gives_the_control_connection_back() {
    use std::io::{Read, Write};
    use std::time::Duration;
    let server = Server::start();
    let addr = control_addr(&server);
    let echo = |pages: u64| format!("{{\"op\":\"echo\",\"page_size\":4096,\"pages\":{pages}}}\n");
    let (mut early, _) = common::greeted(addr);
    early.write_all(echo(1).as_bytes()).expect("send");
    let r = reply_line(&early, Duration::from_secs(10)).expect("a reply");
    assert_eq!(r["ok"], false, "{r}");
    assert!(r["error"].as_str().unwrap().contains("before hello"), "{r}");

    let mut s = common::said_hello(addr);
    assert_eq!(
        reply_line(&s, Duration::from_secs(10)).expect("hello reply")["ok"],
        true
    );
    // 8 MiB region: 2048 pages of 4 KiB fit it, 4097 do not.
    s.write_all(echo(4097).as_bytes()).expect("send");
    let r = reply_line(&s, Duration::from_secs(10)).expect("a reply");
    assert_eq!(r["ok"], false, "{r}");
    assert!(r["error"].as_str().unwrap().contains("do not fit"), "{r}");

    s.write_all(echo(3).as_bytes()).expect("send");
    let r = reply_line(&s, Duration::from_secs(10)).expect("a reply");
    assert_eq!(r["ok"], true, "{r}");
    let at: std::net::SocketAddr = r["address"]
        .as_str()
        .expect("address")
        .parse()
        .expect("IP:PORT");
    assert_eq!(at.ip(), addr.ip(), "{r}");
    let mut e = common::raw_stream(at);
    e.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut ack = [0u8; 8];
    for round in 0..5 {
        // A round arrives in pieces: the answer comes only once all 12 KiB are in.
        e.write_all(&[round as u8; 5000]).expect("part");
        e.write_all(&[round as u8; 3 * 4096 - 5000]).expect("rest");
        e.read_exact(&mut ack).expect("the answer");
        assert_eq!(ack, [1u8; 8]);
    }
    drop(e);
    // The control connection answers again once the echo is closed.
    s.write_all(b"{\"op\":\"verify\",\"seed\":1,\"page_size\":4096,\"pages\":[]}\n")
        .expect("verify");
    let r = reply_line(&s, Duration::from_secs(10)).expect("a reply");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["checked"], 0, "{r}");
}

/// `bench --baseline` against a server: the run verifies, then raw TCP streams (one per
/// rail) to the sink the server opens move the same bytes, and the summary carries their
/// Gbps, the ratio and what they were, in JSON and in text.
#[test]
fn bench_baseline_streams_to_the_server_and_reports_the_ratio() {
    let server = Server::start();
    let mut args = bench_args(&server.peer);
    args.extend(["--baseline", "--rails", "2"].map(String::from));
    let out = xfer(&args);
    assert_bench_verified(&out, "bench --baseline");
    let j = stdout_json(&out);
    let base = j["baseline_gbps"].as_f64().expect("baseline_gbps");
    assert!(base > 0.0 && base.is_finite(), "{j}");
    let ratio = j["ratio"].as_f64().expect("a ratio");
    assert!(ratio.is_finite() && ratio > 0.0, "{j}");
    let want = j["gbps"].as_f64().unwrap() / base;
    assert!((ratio - want).abs() < 1e-9 * want.max(1.0), "{j}");
    let kind = j["baseline_kind"].as_str().expect("baseline_kind");
    assert!(
        kind.contains("one per rail") && kind.contains("to the server"),
        "{j}"
    );
    // Text: the baseline line, and the server serves the next client as before.
    args.retain(|a| a != "--json");
    let out = xfer(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("baseline: raw TCP streams, 2, one per rail") && text.contains("ratio"),
        "{text}"
    );
    let out = xfer(&bench_args(&server.peer));
    assert_bench_verified(&out, "a bench after the baseline runs");
}

/// `--baseline` is for one worker's throughput over a network path: with --per-gpu,
/// --latency or cuda-ipc it is a usage error that names --baseline.
#[test]
fn bench_baseline_with_per_gpu_latency_or_cuda_ipc_is_a_usage_error() {
    for extra in [
        &["--per-gpu"][..],
        &["--latency"][..],
        &["--transport", "cuda-ipc", "--memory", "cuda"][..],
    ] {
        let mut args = vec!["bench", "--peer", "xfer://127.0.0.1:1", "--baseline"];
        args.extend_from_slice(extra);
        let line = assert_fails_with_one_line(&xfer(&args), 2);
        assert!(line.contains("--baseline"), "{extra:?}: {line}");
    }
}

/// The baseline's figures of a demo summary: its Gbps, `ratio` = gbps / it, and its kind.
fn assert_baseline(j: &Value) -> String {
    let base = j["baseline_gbps"].as_f64().expect("baseline_gbps");
    assert!(base > 0.0 && base.is_finite(), "{j}");
    let ratio = j["ratio"].as_f64().expect("a ratio");
    assert!(ratio > 0.0 && ratio.is_finite(), "{j}");
    let want = j["gbps"].as_f64().unwrap() / base;
    assert!((ratio - want).abs() < 1e-9 * want.max(1.0), "{j}");
    j["baseline_kind"]
        .as_str()
        .expect("baseline_kind")
        .to_owned()
}

/// `demo --transport mem --baseline`: a memcpy of the same pages, one thread per rail,
/// named in JSON and on the text's baseline line; no TCP streams (no cache-hot figure).
#[test]
fn demo_baseline_over_mem_is_a_scattered_memcpy_of_the_same_pages() {
    let out = small_demo(&["--transport", "mem", "--rails", "2", "--baseline"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = stdout_json(&out);
    assert_eq!(j["verified"], true, "{j}");
    let kind = assert_baseline(&j);
    assert_eq!(kind, "scattered memcpy of the same pages, 2 threads", "{j}");
    assert!(
        j["baseline_hot_gbps"].is_null() && j["ratio_hot"].is_null(),
        "{j}"
    );
    let out = small_demo(&["--transport", "mem", "--baseline", "--op", "read"]);
    let j = stdout_json(&out);
    assert_eq!(
        assert_baseline(&j),
        "scattered memcpy of the same pages, 1 thread"
    );
    let out = xfer(&[
        "demo",
        "--transport",
        "mem",
        "--baseline",
        "--page-size",
        "4KiB",
        "--pages",
        "64",
        "--bytes",
        "4MiB",
        "--region-size",
        "4MiB",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l
            .starts_with("baseline: scattered memcpy of the same pages, 1 thread: ")
            && l.contains("ratio")),
        "{text}"
    );
}

/// `demo --transport tcp --baseline`: raw TCP streams on loopback, one per rail, through
/// buffers of the region's size, and beside it the cache-hot figure and the streams moving
/// the run's pages.
#[test]
fn demo_baseline_over_tcp_is_raw_tcp_streams_on_loopback() {
    // The streams run the rails' congestion control, named in the kinds.
    let args = ["--transport", "tcp", "--rails", "2", "--baseline"];
    let out = small_demo(&[&args[..], &["--tcp-congestion", "reno"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = stdout_json(&out);
    let kind = assert_baseline(&j);
    assert_eq!(
        kind, "raw TCP streams, 2, loopback (reno), 4.0 MiB buffers",
        "{j}"
    );
    let hot = j["baseline_hot_gbps"].as_f64().expect("baseline_hot_gbps");
    let ratio_hot = j["ratio_hot"].as_f64().expect("ratio_hot");
    assert!(hot > 0.0 && ratio_hot > 0.0 && ratio_hot.is_finite(), "{j}");
    // And the same streams moving the run's pages, 16 random ones per writev.
    assert_eq!(
        j["baseline_pages_kind"].as_str(),
        Some(
            "raw TCP streams, 2, loopback (reno), writev of 16 random 4.0 KiB pages of 4.0 MiB \
             into the same pages"
        ),
        "{j}"
    );
    let pages = j["baseline_pages_gbps"]
        .as_f64()
        .expect("baseline_pages_gbps");
    let ratio_pages = j["ratio_pages"].as_f64().expect("ratio_pages");
    assert!(
        pages > 0.0 && ratio_pages > 0.0 && ratio_pages.is_finite(),
        "{j}"
    );
    let out = xfer(&[
        "demo",
        "--page-size",
        "4KiB",
        "--pages",
        "64",
        "--bytes",
        "4MiB",
        "--region-size",
        "4MiB",
        "--transport",
        "tcp",
        "--baseline",
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.lines()
            .any(|l| l.starts_with("baseline, pages: raw TCP streams, 1")),
        "{text}"
    );
    // An algorithm the kernel does not have stops the run before it starts, named.
    let out = small_demo(&[&args[..], &["--tcp-congestion", "no_such_algo"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no_such_algo"),
        "{err}"
    );
}

/// `demo --baseline` where no like-for-like run exists in one process (efa; GPU memory
/// over tcp or mem) or that is no one worker's throughput (--latency, --per-gpu): exit 2,
/// one line that names --baseline, before anything runs (no libfabric or GPU is needed to
/// be told).
#[test]
fn demo_baseline_without_a_like_for_like_run_is_a_usage_error() {
    for (extra, names) in [
        (
            &["--transport", "efa", "--provider", "tcp"][..],
            "fi_raw_bw",
        ),
        (
            &["--transport", "tcp", "--memory", "cuda"][..],
            "--memory host",
        ),
        (&["--transport", "mem", "--memory", "cuda"][..], "cuda-ipc"),
        (&["--latency"][..], "--latency"),
        (&["--per-gpu"][..], "--per-gpu"),
    ] {
        let mut args = extra.to_vec();
        args.push("--baseline");
        let line = assert_fails_with_one_line(&small_demo(&args), 2);
        assert!(
            line.contains("--baseline") && line.contains(names),
            "{extra:?}: {line}"
        );
    }
}

/// `demo --transport cuda-ipc --baseline`: the same pages copied device to device with
/// batched copies, between the same GPUs (GPU 0 to itself, or 0 to 1 where there are two).
#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn demo_baseline_over_cuda_ipc_copies_the_same_pages_device_to_device() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpus = if cuda.device_count().unwrap_or(1) >= 2 {
        "0,1"
    } else {
        "0"
    };
    for method in [None, Some("memcpy")] {
        let mut args = vec![
            "--transport",
            "cuda-ipc",
            "--memory",
            "cuda",
            "--gpus",
            gpus,
            "--rails",
            "2",
            "--baseline",
        ];
        if let Some(m) = method {
            args.extend(["--cuda-copy", m]);
        }
        let out = small_demo(&args);
        assert!(
            out.status.success(),
            "{method:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j = stdout_json(&out);
        assert_eq!(j["verified"], true, "{j}");
        let kind = assert_baseline(&j);
        let to = if gpus == "0" { 0 } else { 1 };
        assert!(
            kind.starts_with("scattered device-to-device copies of the same pages (")
                && kind.ends_with(&format!("), 2 streams, GPU 0 -> GPU {to}")),
            "{j}"
        );
        if method.is_some() {
            assert!(kind.contains("(one cuMemcpyAsync a page)"), "{j}");
        }
    }
}

/// The control channel's sink: refused before hello and for no or too many streams; else
/// a listener per rail IP that counts each stream to EOF and answers with the count. A
/// sink whose streams do not all come ends at --hello-timeout, and the control connection
/// takes requests again.
#[test]
fn the_sink_request_counts_streams_and_refuses_before_hello_and_too_many() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;
    let server = Server::start_with(&["--hello-timeout", "2"]);
    let addr = control_addr(&server);
    let sink = |n: u32| format!("{{\"op\":\"sink\",\"streams\":{n}}}\n");
    let (mut early, _) = common::greeted(addr);
    early.write_all(sink(1).as_bytes()).expect("send");
    let r = reply_line(&early, Duration::from_secs(10)).expect("a reply");
    assert_eq!(r["ok"], false, "{r}");
    assert!(r["error"].as_str().unwrap().contains("before hello"), "{r}");

    let mut s = common::said_hello(addr);
    assert_eq!(
        reply_line(&s, Duration::from_secs(10)).expect("hello reply")["ok"],
        true
    );
    for n in [0, 257, 100_000] {
        s.write_all(sink(n).as_bytes()).expect("send");
        let r = reply_line(&s, Duration::from_secs(10)).expect("a reply");
        assert_eq!(r["ok"], false, "{n}: {r}");
        assert!(
            r["error"]
                .as_str()
                .unwrap()
                .contains(&format!("{n} streams")),
            "{r}"
        );
    }

    let open = |s: &mut TcpStream, n: u32| -> std::net::SocketAddr {
        s.write_all(sink(n).as_bytes()).expect("send");
        let r = reply_line(s, Duration::from_secs(10)).expect("a reply");
        assert_eq!(r["ok"], true, "{r}");
        // Four rails, all on the control IP: one listener.
        let at = r["addresses"].as_array().expect("addresses");
        assert_eq!(at.len(), 1, "{r}");
        let at: std::net::SocketAddr = at[0].as_str().unwrap().parse().expect("IP:PORT");
        assert_eq!(at.ip(), addr.ip(), "{r}");
        at
    };
    let count = |e: &mut TcpStream, bytes: usize| -> u64 {
        e.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        for _ in 0..bytes / 1000 {
            e.write_all(&[7u8; 1000]).expect("write");
        }
        e.write_all(&vec![7u8; bytes % 1000]).expect("write");
        e.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let mut n = [0u8; 8];
        e.read_exact(&mut n).expect("the count");
        u64::from_le_bytes(n)
    };
    let at = open(&mut s, 2);
    let mut a = common::raw_stream(at);
    let mut b = common::raw_stream(at);
    assert_eq!(count(&mut b, 12_345), 12_345);
    assert_eq!(count(&mut a, 3 << 20), 3 << 20);
    let verify = b"{\"op\":\"verify\",\"seed\":1,\"page_size\":4096,\"pages\":[]}\n";
    s.write_all(verify).expect("verify");
    let r = reply_line(&s, Duration::from_secs(10)).expect("a reply");
    assert_eq!(r["ok"], true, "{r}");

    // Two asked for, one comes: it is counted, the sink ends at --hello-timeout (2 s),
    // and the control connection answers again.
    let at = open(&mut s, 2);
    let mut a = common::raw_stream(at);
    assert_eq!(count(&mut a, 5000), 5000);
    s.write_all(verify).expect("verify");
    let r = reply_line(&s, Duration::from_secs(10)).expect("a reply after the sink ended");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["checked"], 0, "{r}");
}

/// Output into a pipe whose reader has gone (`xfer info --json | head -c 10`) ends the
/// command quietly with status 141, as SIGPIPE would, instead of a panic.
#[test]
fn output_into_a_pipe_nobody_reads_ends_quietly_with_141() {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(["info", "--json"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("xfer runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `--version` names the commit the binary was built from when it was built in xfer's own
/// git checkout (as every test run here is); the crate's version alone elsewhere.
#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = xfer(&["--version"]);
    assert!(out.status.success());
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let real = |p: &std::path::Path| std::fs::canonicalize(p).ok();
    let ours = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(real);
    let top = git(&["rev-parse", "--show-toplevel"]).and_then(|t| real(t.as_ref()));
    let head = git(&["rev-parse", "--short=7", "HEAD"]).filter(|_| top.is_some() && top == ours);
    let version = env!("CARGO_PKG_VERSION");
    match head {
        Some(commit) => assert_eq!(line, format!("xfer {version} ({commit})")),
        None => assert_eq!(line, format!("xfer {version}")),
    }
}
