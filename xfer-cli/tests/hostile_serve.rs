//! Hostile clients alongside a legitimate bench: 4 slow-loris hellos at a time (a byte
//! every 100 ms), 4 connections at a time that never say hello, a flood of hellos in
//! bursts of 32 five times a second (past the new regions the server allows a second: 4 of
//! 64 MiB, `--region-rate 256MiB`), and 20 oversized requests a second. The rates are fixed
//! so that the figure measures the server, not how the attacking threads of this test
//! share the machine's cores with it. Each is refused with its reason (in the reply, in the server's
//! log, and counted by reason in its metrics); the server stays up; the legitimate bench
//! verifies every byte, before, during and after.
//!
//! The bench's throughput alone and beside the hostiles is measured in the same test and
//! printed (`-- --nocapture`) with their ratio (best run beside the hostiles over best run
//! alone); the issue asks for at least 0.8. One run does not decide that: on CI's two
//! shared cores the hostile threads and the server's refusals take the same cores as the
//! bench, and the ratio varies from run to run. `scripts/hostile-ratio.sh` decides it: a
//! release build, this test 3 times with `XFER_ASSERT_HOSTILE_RATIO=1` (under which each
//! run asserts its own ratio), each ratio and the median printed, failing when the median
//! is below 0.8 or a run fails. Without the variable each run asserts a floor of 0.25,
//! which any run keeps unless the hostiles starve the server (debug runs on the 2-core VM
//! read 0.89 to 1.07).

mod common;

use common::{Scrape, Server, serve_on_loopback, xfer};
use fabric_core::testing::eventually;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const REGION: &str = "64MiB";
const REGION_BYTES: f64 = (64u64 << 20) as f64;
const HELLO: &[u8] = common::HELLO.as_bytes();
/// The limits a refusal may name.
const LIMITS: [&str; 5] = [
    "--hello-timeout",
    "--max-request-bytes",
    "--max-clients",
    "--max-region-bytes",
    "--region-rate",
];

fn bench(peer: &str) -> (f64, std::process::Output) {
    let out = xfer()
        .args([
            "bench",
            "--peer",
            peer,
            "--rails",
            "2",
            "--region-size",
            REGION,
            "--page-size",
            "64KiB",
            "--pages",
            "64",
            "--bytes",
            "1GiB",
            "--pin",
            "off",
            "--json",
        ])
        .output()
        .expect("bench runs");
    assert!(
        out.status.success(),
        "the legitimate bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON summary");
    assert_eq!(v["verified"], true);
    (v["gbps"].as_f64().expect("gbps"), out)
}

/// The reason of the refusal the server sends on `s` before closing it, past its greeting
/// (`None`: it closed without one, or said yes).
fn refusal(s: &TcpStream) -> Option<String> {
    s.set_read_timeout(Some(Duration::from_secs(15))).ok()?;
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        r.read_line(&mut line).ok()?;
        let v: Value = serde_json::from_str(&line).ok()?;
        if v["op"] == "challenge" {
            continue;
        }
        return (v["ok"] == false).then(|| v["error"].as_str().unwrap_or_default().to_owned());
    }
}

/// What the hostiles were told, by kind.
#[derive(Default)]
struct Told {
    loris: Vec<String>,
    silent: Vec<String>,
    flood: Vec<String>,
    oversized: Vec<String>,
}

/// Starts the hostile clients; they run until `stop` is raised.
fn hostiles(
    addr: SocketAddr,
    stop: &Arc<AtomicBool>,
    told: &Arc<Mutex<Told>>,
) -> Vec<std::thread::JoinHandle<()>> {
    let mut threads = Vec::new();
    let spawn = |f: Box<dyn Fn() + Send>| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                f();
            }
        })
    };
    // Slow-loris: the hello a byte every 100 ms, never done within --hello-timeout.
    for _ in 0..4 {
        let (told, stop) = (told.clone(), stop.clone());
        threads.push(spawn(Box::new(move || {
            let Ok(mut s) = TcpStream::connect(addr) else {
                return;
            };
            let r = s.try_clone().expect("clone");
            let reader = std::thread::spawn(move || refusal(&r));
            for &b in HELLO {
                if stop.load(Ordering::SeqCst) || s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if let Ok(Some(why)) = reader.join() {
                told.lock().unwrap().loris.push(why);
            }
        })));
    }
    // Connections that never send a byte.
    for _ in 0..4 {
        let told = told.clone();
        threads.push(spawn(Box::new(move || {
            if let Ok(s) = TcpStream::connect(addr)
                && let Some(why) = refusal(&s)
            {
                told.lock().unwrap().silent.push(why);
            }
        })));
    }
    // Bursts of 32 hellos at once, 5 a second: past --max-clients and --max-region-bytes.
    let t = told.clone();
    threads.push(spawn(Box::new(move || {
        let next = Instant::now() + Duration::from_millis(200);
        let burst: Vec<TcpStream> = (0..32)
            .filter_map(|_| TcpStream::connect(addr).ok())
            .collect();
        for mut s in &burst {
            let _ = s.write_all(HELLO);
        }
        for s in &burst {
            if let Some(why) = refusal(s) {
                t.lock().unwrap().flood.push(why);
            }
        }
        drop(burst);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    })));
    // Requests over --max-request-bytes, 20 a second.
    let t = told.clone();
    threads.push(spawn(Box::new(move || {
        let next = Instant::now() + Duration::from_millis(50);
        if let Ok(mut s) = TcpStream::connect(addr) {
            let _ = s.write_all(&vec![b'{'; 256 << 10]);
            if let Some(why) = refusal(&s) {
                t.lock().unwrap().oversized.push(why);
            }
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        }
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    })));
    threads
}

/// Waits (at most 60 s) until the bytes the server's clients' regions hold satisfy `ok`:
/// the bench holds its region, or every client is gone.
fn wait_for_region_bytes(url: &str, what: &str, ok: impl Fn(f64) -> bool) {
    eventually(what, Duration::from_secs(60), || {
        ok(Scrape::fetch(url).sum("xfer_serve_region_bytes", &[]))
    });
}

#[test]
fn hostile_clients_are_refused_with_reasons_while_a_bench_runs() {
    let serve = serve_on_loopback(
        REGION,
        &[
            "--max-clients",
            "48",
            "--max-region-bytes",
            "512MiB",
            // Four new 64 MiB regions a second: the flood's page zeroing is bounded.
            "--region-rate",
            "256MiB",
            "--hello-timeout",
            "2",
            "--request-timeout",
            "2",
            "--max-request-bytes",
            "64KiB",
        ],
    );
    let mut server = Server::spawn_logged(serve);
    let url = server.metrics_url();
    let addr = server.control_addr();

    let alone: Vec<f64> = (0..2).map(|_| bench(&server.peer).0).collect();

    // The same bench with the hostiles at it: they start once the bench holds its region
    // (a flood that came first could take every place, which is what --auth-token and a
    // firewall are for), and run until it ends.
    let mut with = Vec::new();
    let told = Arc::new(Mutex::new(Told::default()));
    for _ in 0..2 {
        // Every earlier client (a bench, the last hostiles) is gone before this bench says
        // hello: its region is then the one the wait below sees, and a flood cannot come
        // first (a flood that comes first wins, see above).
        wait_for_region_bytes(&url, "every earlier client to leave", |b| b == 0.0);
        let stop = Arc::new(AtomicBool::new(false));
        let peer = server.peer.clone();
        let running = std::thread::spawn(move || bench(&peer).0);
        wait_for_region_bytes(&url, "the bench to hold its region", |b| b >= REGION_BYTES);
        let threads = hostiles(addr, &stop, &told);
        let gbps = running.join().expect("the bench under attack");
        stop.store(true, Ordering::SeqCst);
        for t in threads {
            t.join().expect("a hostile thread");
        }
        with.push(gbps);
        assert!(server.running(), "the server stays up");
    }

    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let ratio = best(&with) / best(&alone);
    println!(
        "legitimate bench alone: {alone:?} Gbps; beside the hostiles: {with:?} Gbps; \
         ratio of the best runs {ratio:.2}"
    );
    if std::env::var("XFER_ASSERT_HOSTILE_RATIO").as_deref() == Ok("1") {
        assert!(ratio >= 0.8, "the bench kept {ratio:.2} of its throughput");
    } else {
        // One debug run on shared cores varies too much for the 0.8 target (that is
        // scripts/hostile-ratio.sh's to judge, on medians of release runs), but a server
        // that the hostiles starve keeps far less than a quarter: that much holds anywhere.
        assert!(
            ratio >= 0.25,
            "the bench kept {ratio:.2} of its throughput beside the hostiles"
        );
    }

    // Every kind was refused with its own reason; some may have met another limit first
    // (while the flood held every place or region byte, or when a loaded server read a
    // slow hello only once it had all come), and were refused naming that one.
    let told = told.lock().unwrap();
    let all = |v: &[String], flag: &str, kind: &str| {
        assert!(
            v.iter().any(|why| why.contains(flag)),
            "no {kind} was refused naming {flag}: {v:?}"
        );
        assert!(
            v.iter().all(|why| LIMITS.iter().any(|l| why.contains(l))),
            "{kind}: reasons {v:?} name none of {LIMITS:?}"
        );
    };
    all(&told.loris, "--hello-timeout", "slow-loris client");
    all(&told.silent, "--hello-timeout", "silent connection");
    all(&told.oversized, "--max-request-bytes", "oversized request");
    all(&told.flood, "--region-rate", "hello of the flood");
    println!(
        "refused: {} slow-loris, {} silent, {} of the flood, {} oversized",
        told.loris.len(),
        told.silent.len(),
        told.flood.len(),
        told.oversized.len()
    );

    // The server logged each reason and counted it.
    let log = server.log();
    for reason in ["hello_timeout", "request_too_long"] {
        assert!(
            log.iter()
                .any(|l| l.contains("client refused") && l.contains(reason)),
            "no log line for {reason}"
        );
    }
    let m = Scrape::fetch(&url);
    for reason in ["hello_timeout", "request_too_long"] {
        assert!(
            m.sum("xfer_serve_refusals_total", &[("reason", reason)]) > 0.0,
            "{reason} not counted: {}",
            m.text
        );
    }
    assert!(
        m.sum("xfer_serve_refusals_total", &[("reason", "region_rate")]) > 0.0,
        "the flood's refusals not counted"
    );

    // And it still serves: the bench once more, alone.
    assert!(server.running());
    bench(&server.peer);
}

/// A hello past `--region-rate` is refused with the time to ask again, and `bench` asks
/// again then and gets its region: one 64 MiB region drains a bucket of 16 MiB a second
/// for 4 s, so a bench that says hello within them is refused once and let in after.
#[test]
fn a_bench_refused_by_the_region_rate_asks_again_and_gets_through() {
    let server = Server::spawn_logged(serve_on_loopback(REGION, &["--region-rate", "16MiB"]));
    let url = server.metrics_url();

    // The first client takes a full bucket's worth and more, and holds its region.
    let first = common::said_hello(server.control_addr());
    let mut line = String::new();
    BufReader::new(&first).read_line(&mut line).expect("reply");
    let v: Value = serde_json::from_str(&line).expect("a JSON reply");
    assert_eq!(v["ok"], true, "the first hello is let in: {line}");

    let (gbps, _) = bench(&server.peer);
    assert!(gbps > 0.0);
    let m = Scrape::fetch(&url);
    assert!(
        m.sum("xfer_serve_refusals_total", &[("reason", "region_rate")]) >= 1.0,
        "the bench's first hello was not refused by the rate: {}",
        m.text
    );
    assert!(
        server
            .log()
            .iter()
            .any(|l| l.contains("client refused") && l.contains("--region-rate")),
        "no log line for the rate's refusal"
    );
    drop(first);
}
