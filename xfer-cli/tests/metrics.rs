//! `--metrics`: `serve` and `bench` scraped with a real HTTP client while a bench runs. The
//! counters grow during the run, and once it ends the bytes the server's transport counted
//! as placed by peers' WRITEs equal the bytes the bench's summary says it wrote (and the
//! bench's own endpoint, the bytes of its rails).

mod common;

use common::{Scrape, Server, xfer};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn serve_with_metrics(extra: &[&str]) -> Server {
    let mut serve = xfer();
    serve
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--region-size",
            "64MiB",
            "--rails",
            "2",
            "--metrics",
            "127.0.0.1:0",
        ])
        .args(extra);
    Server::spawn_logged(serve)
}

#[test]
fn counters_grow_during_a_bench_and_match_its_summary() {
    let server = serve_with_metrics(&[]);
    let url = server.metrics_url();
    let before = Scrape::fetch(&url);
    assert_eq!(before.sum("xfer_rail_received_bytes_total", &[]), 0.0);
    assert_eq!(before.sum("xfer_serve_clients", &[]), 0.0);
    assert_eq!(
        before.sum("xfer_rail_ops_in_flight", &[]),
        0.0,
        "{}",
        before.text
    );
    // Two rails of one group, each reporting.
    for rail in ["0", "1"] {
        assert!(
            before.samples.contains_key(&format!(
                "xfer_rail_received_bytes_total{{group=\"tcp-0\",rail=\"{rail}\",nic=\"\"}}"
            )),
            "{}",
            before.text
        );
    }

    let mut bench = xfer()
        .args([
            "bench",
            "--peer",
            &server.peer,
            "--rails",
            "2",
            "--region-size",
            "64MiB",
            "--page-size",
            "64KiB",
            "--pages",
            "64",
            "--bytes",
            "2GiB",
            "--json",
            "--metrics",
            "127.0.0.1:0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bench starts");
    // The bench's endpoint, from its stderr (read by a thread, so the pipe never fills).
    let (tx, bench_url) = mpsc::channel();
    let err = bench.stderr.take().expect("stderr");
    let bench_log = std::thread::spawn(move || {
        let mut all = Vec::new();
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some(u) = line.strip_prefix("xfer: metrics on ") {
                let _ = tx.send(u.to_owned());
            }
            all.push(line);
        }
        all
    });
    let bench_url = bench_url
        .recv_timeout(Duration::from_secs(30))
        .expect("bench prints its metrics address");

    // Scrape both ends while the bench runs: the server's count of placed bytes and the
    // bench's count of written bytes never go back, and grow.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut served, mut written) = (Vec::new(), Vec::new());
    let mut bench_latencies = 0.0;
    let mut clients_seen = 0.0f64;
    while bench.try_wait().expect("bench status").is_none() {
        assert!(Instant::now() < deadline, "bench did not finish in time");
        let s = Scrape::fetch(&url);
        served.push(s.sum("xfer_rail_received_bytes_total", &[]));
        // The bench may end between the two scrapes: its endpoint then closes.
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        if let Ok(mut r) = agent.get(&bench_url).call() {
            let b = Scrape::parse(r.body_mut().read_to_string().expect("text"));
            written.push(b.sum("xfer_rail_bytes_total", &[("group", "bench-0")]));
            bench_latencies = b.sum("xfer_transfer_latency_seconds_count", &[]);
        }
        clients_seen = clients_seen.max(s.sum("xfer_serve_clients", &[]));
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = bench.wait_with_output().expect("bench output");
    let log = bench_log.join().expect("stderr reader");
    assert!(out.status.success(), "bench failed: {log:?}");
    let summary: Value = serde_json::from_slice(&out.stdout).expect("one JSON summary");
    assert_eq!(summary["verified"], true);
    let bytes = summary["bytes"].as_u64().expect("bytes");
    assert_eq!(bytes, 2 << 30);

    for w in [&served, &written] {
        assert!(
            w.windows(2).all(|p| p[0] <= p[1]),
            "a counter went back: {w:?}"
        );
    }
    let mid: Vec<&f64> = written
        .iter()
        .filter(|&&b| b > 0.0 && b < bytes as f64)
        .collect();
    assert!(
        mid.len() >= 2 && mid.windows(2).any(|p| p[0] < p[1]),
        "the bench's bytes seen growing mid-run: {written:?}"
    );
    assert!(
        served.iter().any(|&b| b > 0.0 && b < bytes as f64),
        "the server's bytes seen mid-run: {served:?}"
    );
    assert!(
        bench_latencies > 0.0,
        "the bench's latency histogram filled"
    );
    assert_eq!(
        clients_seen, 1.0,
        "the bench held a client's place while it ran"
    );

    // Once the bench is done, the server counted every byte it wrote (warm-up writes are
    // empty), its client left, and its region was deregistered.
    let after = Scrape::fetch(&url);
    assert_eq!(
        after.sum("xfer_rail_received_bytes_total", &[]),
        bytes as f64
    );
    assert_eq!(after.sum("xfer_serve_clients_admitted_total", &[]), 1.0);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = Scrape::fetch(&url);
        if s.sum("xfer_serve_clients", &[]) == 0.0 && s.sum("xfer_registered_bytes", &[]) == 0.0 {
            assert_eq!(s.sum("xfer_serve_region_bytes", &[]), 0.0);
            // The bench's peers, closed, with why.
            assert!(
                s.sum("xfer_peer_connections", &[("state", "closed")]) == 0.0
                    && s.samples
                        .keys()
                        .any(|k| k.starts_with("xfer_peer_connections{")
                            && k.contains("state=\"closed\"")),
                "{}",
                s.text
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the client never left: {}",
            s.text
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `request` raw and returns the status line of the answer (empty if none).
fn raw_status(addr: &str, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(request);
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer.lines().next().unwrap_or("").to_owned()
}

#[test]
fn the_endpoint_answers_only_get_metrics_and_bounds_slow_or_big_requests() {
    let server = serve_with_metrics(&[]);
    let url = server.metrics_url();
    let addr = url
        .strip_prefix("http://")
        .and_then(|r| r.strip_suffix("/metrics"))
        .expect("http://ADDR/metrics")
        .to_owned();
    assert_eq!(
        raw_status(&addr, b"GET / HTTP/1.1\r\n\r\n"),
        "HTTP/1.1 404 Not Found"
    );
    assert_eq!(
        raw_status(&addr, b"DELETE /metrics HTTP/1.1\r\n\r\n"),
        "HTTP/1.1 405 Method Not Allowed"
    );
    let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 64 << 10));
    assert_eq!(raw_status(&addr, &big), "HTTP/1.1 400 Bad Request");
    // A scraper that never finishes its request is answered at the deadline, and the next
    // scrape is served.
    let slow = TcpStream::connect(&addr).expect("connect");
    let started = Instant::now();
    let mut slow_w = slow.try_clone().unwrap();
    slow_w.write_all(b"GET /metr").unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = String::new();
    let _ = (&slow).read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(8));
    let s = Scrape::fetch(&url);
    assert!(s.text.contains("# TYPE xfer_serve_refusals_total counter"));
}
