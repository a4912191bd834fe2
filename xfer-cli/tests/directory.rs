//! `serve --directory`, `bench --peer-name`, `bench --peers all` and `xfer members` against a
//! real etcd (Debian's etcd-server on free loopback ports; `XFER_REQUIRE_ETCD` makes its
//! absence a failure): servers publish themselves, bench finds them by name, a server
//! killed with SIGKILL fails only its own rounds and leaves the directory within its TTL, the
//! same name restarted is written to again, and an etcd restart fails nothing.

mod common;

use common::Server;
use directory::testing::Etcd;
use directory::{Directory, EtcdDirectory, EtcdOptions};
use fabric_core::testing::eventually;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TTL_S: u64 = 2;

fn xfer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xfer"))
}

fn serve(e: &Etcd, name: &str) -> Server {
    let mut c = xfer();
    c.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        "4MiB",
        "--rails",
        "1",
    ])
    .args(["--directory", &e.url(), "--cluster", "t", "--name", name])
    .args(["--ttl", &TTL_S.to_string()]);
    Server::spawn(c)
}

/// The small workload every bench here runs: 4 MiB of 64 KiB pages into a 4 MiB region.
const WORKLOAD: [&str; 8] = [
    "--region-size",
    "4MiB",
    "--pages",
    "64",
    "--bytes",
    "4MiB",
    "--rails",
    "1",
];

#[test]
fn serve_publishes_and_bench_finds_it_by_name() {
    let Some(e) = Etcd::start_or_skip() else {
        return;
    };
    let s = serve(&e, "s1");
    let out = xfer()
        .args([
            "members",
            "--directory",
            &e.url(),
            "--cluster",
            "t",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["name"], "s1");
    assert_eq!(
        format!("xfer://{}", listed[0]["address"].as_str().unwrap()),
        s.peer,
        "the record holds the control address serve printed"
    );
    assert_eq!(listed[0]["transport"], "tcp");

    let out = xfer()
        .args([
            "bench",
            "--directory",
            &e.url(),
            "--cluster",
            "t",
            "--peer-name",
            "s1",
            "--json",
        ])
        .args(WORKLOAD)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["verified"], true, "{summary}");
    assert_eq!(summary["bytes"], 4 << 20);

    let out = xfer()
        .args([
            "bench",
            "--directory",
            &e.url(),
            "--cluster",
            "t",
            "--peer-name",
            "s9",
        ])
        .args(WORKLOAD)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no member \"s9\" in cluster t") && err.contains("members: s1"),
        "{err}"
    );
}

#[test]
fn an_unreachable_directory_is_one_clear_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("etcd://127.0.0.1:{port}");
    let t = Instant::now();
    let out = xfer()
        .args(["bench", "--directory", &url, "--peer-name", "s1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("unreachable"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let out = xfer()
        .args(["serve", "--listen", "127.0.0.1:0", "--directory", &url])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "--directory without --name is a usage error"
    );
}

/// One line of `bench --peers all --json`.
#[derive(Debug)]
struct Round {
    member: String,
    ok: bool,
    at_ms: u64,
    error: Option<String>,
}

#[test]
fn members_come_and_go_under_a_running_bench() {
    let Some(mut e) = Etcd::start_or_skip() else {
        return;
    };
    let d = EtcdDirectory::connect(&[e.endpoint()], EtcdOptions::default()).unwrap();
    let s1 = serve(&e, "s1");
    let _s2 = serve(&e, "s2");
    let started = Instant::now();
    let mut bench = xfer()
        .args([
            "bench",
            "--directory",
            &e.url(),
            "--cluster",
            "t",
            "--peers",
            "all",
        ])
        .args(["--duration", "20", "--json"])
        .args(WORKLOAD)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel::<serde_json::Value>();
    let out = BufReader::new(bench.stdout.take().unwrap());
    let reader = std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
            if tx.send(v).is_err() {
                break;
            }
        }
    });
    let mut rounds: Vec<Round> = Vec::new();
    let mut summary = None;
    // Reads rounds until `done` holds of them, within 20 s.
    let mut until = |rounds: &mut Vec<Round>, what: &str, done: &dyn Fn(&[Round]) -> bool| {
        let by = Instant::now() + Duration::from_secs(20);
        while !done(rounds) {
            let left = by.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(v) if v.get("summary").is_some() => summary = Some(v),
                Ok(v) => rounds.push(Round {
                    member: v["member"].as_str().unwrap().to_string(),
                    ok: v["ok"].as_bool().unwrap(),
                    at_ms: v["at_ms"].as_u64().unwrap(),
                    error: v["error"].as_str().map(str::to_string),
                }),
                Err(_) => panic!("bench: {what} did not happen; rounds so far: {rounds:#?}"),
            }
        }
    };
    let ok_for = |name: &'static str, after_ms: u64| {
        move |r: &[Round]| {
            r.iter()
                .any(|r| r.member == name && r.ok && r.at_ms > after_ms)
        }
    };
    until(&mut rounds, "a round to each member", &|r| {
        ok_for("s1", 0)(r) && ok_for("s2", 0)(r)
    });

    // s1 dies without a word: its record leaves within its TTL.
    let killed = Instant::now();
    drop(s1);
    eventually(
        "s1 to leave the directory after SIGKILL",
        Duration::from_millis(TTL_S * 1000 + 1500),
        || d.lookup("t", "s1").unwrap().is_none(),
    );
    let gone_after = killed.elapsed();
    // The same name again, on a new port: written to again within seconds.
    let _s1b = serve(&e, "s1");
    let back_ms = started.elapsed().as_millis() as u64;
    until(
        &mut rounds,
        "a round to the restarted s1",
        &ok_for("s1", back_ms),
    );
    let back_after = killed.elapsed();

    // etcd restarts under the running bench: members re-publish, no round fails.
    e.restart(false);
    let etcd_back_ms = started.elapsed().as_millis() as u64;
    until(&mut rounds, "rounds after etcd's restart", &|r| {
        ok_for("s1", etcd_back_ms)(r) && ok_for("s2", etcd_back_ms)(r)
    });
    let _ = bench.kill();
    let _ = bench.wait();
    drop(rx);
    let _ = reader.join();
    let _ = summary;

    let failed: Vec<&Round> = rounds.iter().filter(|r| !r.ok).collect();
    assert!(
        failed.iter().all(|r| r.member == "s1"),
        "only the killed member's rounds fail: {failed:#?}"
    );
    // Rounds to s1 between its death and its record's expiry fail, each saying why.
    assert!(
        !failed.is_empty(),
        "no round to s1 failed after it was killed: {rounds:#?}"
    );
    for r in &failed {
        let e = r.error.as_deref().unwrap_or("");
        assert!(!e.is_empty(), "a failed round says why: {r:?}");
    }
    let after_etcd: Vec<&Round> = rounds.iter().filter(|r| r.at_ms > etcd_back_ms).collect();
    assert!(
        after_etcd.len() >= 2 && after_etcd.iter().all(|r| r.ok),
        "{after_etcd:#?}"
    );
    eprintln!(
        "s1 left the directory {gone_after:?} after SIGKILL; written to again {back_after:?} after; \
         {} failed rounds of {}: {:?}",
        failed.len(),
        rounds.len(),
        failed.first().and_then(|r| r.error.as_deref())
    );
}
