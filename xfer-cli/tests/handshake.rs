//! `serve` against connections that never say who they are: 300 silent ones and 30
//! slow-loris hellos (a byte every 200 ms), from ten loopback addresses (127.0.0.2 to
//! .11, each under the per-address cap), held open (reopened as the server closes them)
//! while a legitimate `bench` runs twice. Each bench must verify within 5 s of its start;
//! the server's threads must not grow with the pending connections, and its memory stays
//! under 256 MiB. And a full server (`--max-clients`) makes `bench` wait and ask again
//! instead of failing.

mod common;

use common::{HELLO, Scrape, Server, said_hello, serve_on_loopback, xfer};
use fabric_core::testing::eventually;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const SILENT: usize = 300;
const LORIS: usize = 30;
const T: Duration = Duration::from_secs(30);

/// A field of `/proc/PID/status` (`Threads`, `VmRSS`), as a number.
fn status(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// A bench of `bytes` against `peer`: its JSON summary and how long it took from spawn.
fn bench(peer: &str, bytes: &str) -> (Value, Duration) {
    let start = Instant::now();
    let out = xfer()
        .args([
            "bench",
            "--peer",
            peer,
            "--rails",
            "2",
            "--region-size",
            "16MiB",
            "--page-size",
            "64KiB",
            "--pages",
            "64",
            "--bytes",
            bytes,
            "--pin",
            "off",
            "--json",
        ])
        .output()
        .expect("bench runs");
    let took = start.elapsed();
    assert!(
        out.status.success(),
        "the legitimate bench failed after {took:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON summary");
    assert_eq!(v["verified"], true, "{v}");
    (v, took)
}

/// A connection to `addr` from 127.0.0.`2 + i % 10`, its greeting read.
fn open(addr: SocketAddr, i: usize) -> Option<TcpStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).ok()?;
    let from = SocketAddr::from(([127, 0, 0, 2 + (i % 10) as u8], 0));
    s.bind(&SockAddr::from(from)).ok()?;
    s.connect(&SockAddr::from(addr)).ok()?;
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        (&s).read_exact(&mut b).ok()?;
    }
    Some(s)
}

/// Whether the server has closed `s` (past its greeting: EOF, or a refusal line followed
/// by EOF), without waiting.
fn closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 256];
    s.set_nonblocking(true).expect("non-blocking");
    let gone = match (&*s).read(&mut b) {
        Ok(_) => true, // EOF, or the refusal that comes before it
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = s.set_nonblocking(false);
    gone
}

/// Keeps `SILENT` silent connections and `LORIS` slow-loris hellos open against `addr`
/// until `stop`, reopening each the server closes.
fn flood(addr: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut silent: Vec<Option<TcpStream>> = (0..SILENT).map(|i| open(addr, i)).collect();
        let mut loris: Vec<(Option<TcpStream>, usize)> =
            (0..LORIS).map(|i| (open(addr, i), 0)).collect();
        let hello = HELLO.as_bytes();
        while !stop.load(Ordering::SeqCst) {
            for (i, s) in silent.iter_mut().enumerate() {
                if s.as_ref().is_none_or(closed) {
                    *s = open(addr, i);
                }
            }
            for (i, (s, sent)) in loris.iter_mut().enumerate() {
                // One byte of the hello, never its end.
                let alive = s.as_mut().is_some_and(|c| {
                    !closed(c)
                        && c.write_all(&hello[*sent % (hello.len() - 1)..][..1])
                            .is_ok()
                });
                if alive {
                    *sent += 1;
                } else {
                    (*s, *sent) = (open(addr, i), 0);
                }
            }
            // The loris's pace: a byte every 200 ms (a rate, not a synchronisation).
            std::thread::sleep(Duration::from_millis(200));
        }
    })
}

#[test]
fn silent_and_slow_connections_do_not_keep_a_bench_out() {
    let server = Server::spawn_logged(serve_on_loopback("16MiB", &[]));
    let url = server.metrics_url();
    let pid = server.pid();
    // A first bench with nobody else around: the server's threads with its workers and
    // one client come and gone.
    bench(&server.peer, "64MiB");
    eventually("the first client to leave", T, || {
        Scrape::fetch(&url).sum("xfer_serve_clients", &[]) == 0.0
    });
    let threads_alone = status(pid, "Threads");

    let stop = Arc::new(AtomicBool::new(false));
    let attack = flood(server.control_addr(), stop.clone());
    let pending = || Scrape::fetch(&url).sum("xfer_serve_pending_handshakes", &[]);
    eventually("the flood to be pending", T, || {
        pending() >= (SILENT + LORIS) as f64 * 0.9
    });
    for round in 0..2 {
        let (_, took) = bench(&server.peer, "64MiB");
        assert!(
            took < Duration::from_secs(5),
            "round {round}: the bench verified only after {took:?} beside {} pending connections",
            pending()
        );
        let held = pending();
        eprintln!("round {round}: bench verified in {took:?} beside {held} pending connections");
        assert!(
            held >= (SILENT + LORIS) as f64 * 0.9,
            "round {round}: the flood stays while the bench runs ({held} pending)"
        );
    }
    eventually("the benches to leave", T, || {
        Scrape::fetch(&url).sum("xfer_serve_clients", &[]) == 0.0
    });
    let threads = status(pid, "Threads");
    let rss_kib = status(pid, "VmRSS");
    let held = pending();
    eprintln!(
        "serve: {threads} threads ({threads_alone} alone), {} MiB resident, {held} pending",
        rss_kib >> 10
    );
    stop.store(true, Ordering::SeqCst);
    attack.join().expect("the flood thread");
    assert!(
        threads <= threads_alone + 2,
        "{threads} threads beside {held} pending connections, {threads_alone} alone: \
         a pending connection must not cost a thread"
    );
    assert!(
        rss_kib < 256 << 10,
        "serve holds {} MiB beside {held} pending connections",
        rss_kib >> 10
    );
    let s = Scrape::fetch(&url);
    assert!(
        s.sum("xfer_serve_refusals_total", &[("reason", "server_full")]) == 0.0,
        "no place was ever taken by a connection without a hello"
    );
}

#[test]
fn a_full_server_makes_bench_wait_and_ask_again() {
    let server = Server::spawn_logged(serve_on_loopback("16MiB", &["--max-clients", "1"]));
    let url = server.metrics_url();
    // A client whose hello holds the only place.
    let holder = said_hello(server.control_addr());
    let mut line = [0u8; 1];
    (&holder).read_exact(&mut line).expect("the holder's reply");
    assert_eq!(Scrape::fetch(&url).sum("xfer_serve_clients", &[]), 1.0);
    let peer = server.peer.clone();
    let waiting = std::thread::spawn(move || bench(&peer, "16MiB"));
    eventually("the bench to be refused for the place", T, || {
        Scrape::fetch(&url).sum("xfer_serve_refusals_total", &[("reason", "server_full")]) >= 1.0
    });
    // It asks again (with growing pauses) rather than giving up; once the place is free it
    // gets in and verifies.
    eventually("the bench to ask again", T, || {
        Scrape::fetch(&url).sum("xfer_serve_refusals_total", &[("reason", "server_full")]) >= 2.0
    });
    drop(holder);
    let (v, _) = waiting.join().expect("the waiting bench");
    assert_eq!(v["verified"], true);
}
