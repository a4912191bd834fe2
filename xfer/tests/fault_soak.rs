//! A soak with random faults between processes in network namespaces: an agent in namespace
//! A writes to four target processes in namespace B (one thread per target, each WRITE of a
//! random range read back and compared), while a fault thread, one fault at a time, stops
//! and continues a target (SIGSTOP for 1 to 8 s), cuts and restores the links to one (1 to
//! 8 s), or kills one and starts it again on the same addresses (the agent told of the new
//! incarnation with `update_peer`, as the directory's follow would). The connections'
//! liveness timeout is 4 s, so that short faults are survived and long ones kill
//! connections that the agent then makes again.
//!
//! Asserted: every transfer either verified (written, read back, equal) or ended with a
//! typed error of a kind that the fault explains (`PeerUnreachable`, `PeerRemoved`,
//! `PeerStalled`, `RemoteAccess`, `TimedOut`, or `InvalidInput` for a stale descriptor);
//! none is still running past its timeout plus the liveness timeout; after the soak (every
//! fault undone) each target takes a verified transfer again; the agent's resident memory at
//! the end is within 64 MiB of what it was after the first quarter.
//!
//! `XFER_SOAK_SECS` (default 40) sets the length; `cargo test -p xfer --test fault_soak`
//! with `XFER_SOAK_SECS=600` is the ten-minute soak. `XFER_SOAK_SEED` replays a run (the
//! seed is printed). Its own harness (`harness = false`); needs root for the namespaces
//! (as `netns_liveness.rs`). With `XFER_SOAK_TARGET` set, this binary is a target.

mod common;
#[path = "../../transport-tcp/tests/netns/mod.rs"]
mod netns;
mod netns_target;

use netns::{NetPair, Side};
use netns_target::{RAILS, agent, cut_ports, metric, ports_of};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xfer::{Access, Agent, Error, ErrorKind, HostBuffer, Peer, RegionDescriptor, Transfer};

const TARGETS: usize = 4;
/// Each target's region, and the initiator's source and read-back buffers per target.
const REGION: u64 = 16 << 20;
const PAGE: u64 = 4096;
/// The largest transfer.
const MAX_LEN: u64 = 4 << 20;
const LIVENESS: Duration = Duration::from_secs(4);
/// Each transfer's own timeout (`Transfer::timeout`).
const TRANSFER_T: Duration = Duration::from_secs(20);
/// Past this a transfer hangs: its timeout, the liveness timeout, and room for a loaded
/// machine.
const HANG: Duration = Duration::from_secs(60);
const TARGET_ENV: &str = "XFER_SOAK_TARGET";

/// xorshift64*: reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The bytes of a transfer: 8-byte words naming the round and the word's place.
fn pattern(round: u64, off: u64, len: u64) -> Vec<u8> {
    (off / 8..(off + len) / 8)
        .flat_map(|w| (round << 40 | w).to_le_bytes())
        .collect()
}

/// A target: announces its agent and region, then serves until its stdin closes.
fn target(spec: &str) {
    let (ip, ports) = netns_target::parse_spec(spec);
    let b = agent("soak-target", ip, &ports, Some(LIVENESS));
    let mem = HostBuffer::new_shared(REGION as usize).expect("memory");
    let r = b
        .register(mem, Access::REMOTE_WRITE | Access::REMOTE_READ)
        .expect("a region");
    netns_target::announce(b.info(), r.descriptor());
    // Serves until the parent closes stdin.
    common::child::serve(|_| String::new());
}

/// What the agent knows of one target: its descriptor and ports, changed by a restart.
struct Known {
    desc: RegionDescriptor,
    ports: Vec<u16>,
}

/// What happened to the transfers, by outcome.
#[derive(Default)]
struct Tally {
    verified: u64,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn error(&mut self, e: &Error) {
        let kind = e.kind();
        let allowed = matches!(
            kind,
            ErrorKind::PeerUnreachable
                | ErrorKind::PeerRemoved
                | ErrorKind::PeerStalled
                | ErrorKind::RemoteAccess
                | ErrorKind::TimedOut
        ) || matches!(e, Error::StaleDescriptor { .. });
        assert!(allowed, "an error no fault explains: {e:?}");
        let name = format!("{e:?}");
        let variant = name
            .split([' ', '(', '{'])
            .next()
            .unwrap_or("?")
            .to_string();
        *self
            .errors
            .entry(format!("{kind:?}/{variant}"))
            .or_default() += 1;
    }
}

/// Submits and waits: `Ok` once done, the typed error otherwise; panics if it is still
/// running after `HANG`.
fn run(
    a: &Agent,
    peer: &Peer,
    src: &xfer::Region,
    desc: &RegionDescriptor,
    t: Transfer,
) -> xfer::Result<()> {
    let h = a.submit(peer, src, desc, t.timeout(TRANSFER_T))?;
    let started = Instant::now();
    loop {
        match h.wait(HANG.saturating_sub(started.elapsed())) {
            Ok(_) => return Ok(()),
            // A stall is reported and the transfer goes on: wait on.
            Err(Error::PeerStalled { .. }) => continue,
            Err(e) => {
                assert!(
                    h.is_finished(),
                    "a transfer still running {:.1?} after it started: {e:?}",
                    started.elapsed()
                );
                return Err(e);
            }
        }
    }
}

/// One target's traffic: WRITEs of random ranges, each read back and compared.
fn traffic(a: &Agent, peer: &Peer, known: &Mutex<Known>, stop: &AtomicBool, seed: u64) -> Tally {
    let src_mem = HostBuffer::new_shared(REGION as usize).unwrap();
    let back_mem = HostBuffer::new_shared(REGION as usize).unwrap();
    let src = a.register(src_mem.clone(), Access::NONE).unwrap();
    let back = a.register(back_mem.clone(), Access::LOCAL_WRITE).unwrap();
    let mut rng = Rng(seed | 1);
    let mut tally = Tally::default();
    let mut round = 0;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        let len = PAGE * (1 + rng.below(MAX_LEN / PAGE));
        let off = PAGE * rng.below((REGION - len) / PAGE + 1);
        let bytes = pattern(round, off, len);
        src_mem.write(off, &bytes).unwrap();
        back_mem.fill(off, len, 0).unwrap();
        let desc = known.lock().unwrap().desc.clone();
        let seg = || Transfer::segments(vec![(off, off, len)]);
        let r = run(
            a,
            peer,
            &src,
            &desc,
            seg().stall_timeout(Duration::from_secs(1)),
        )
        .and_then(|_| run(a, peer, &back, &desc, seg().read()));
        match r {
            Ok(()) => {
                let got = back_mem.to_vec(off, len as usize).unwrap();
                assert!(
                    got == bytes,
                    "round {round}: {len} bytes at {off} read back differ"
                );
                tally.verified += 1;
            }
            Err(e) => tally.error(&e),
        }
    }
    tally
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

fn main() {
    if let Ok(spec) = std::env::var(TARGET_ENV) {
        target(&spec);
        return;
    }
    let secs: u64 = std::env::var("XFER_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let seed: u64 = std::env::var("XFER_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("fault soak: {secs} s, {TARGETS} targets, seed {seed} (XFER_SOAK_SEED)");
    let Some(net) = NetPair::new() else { return };
    if !NetPair::has_tool("nft") {
        netns::skip("`nft` is not installed (Debian package nftables)");
        return;
    }
    netns::enter(net.name(Side::A)).expect("enter namespace A");
    let a = agent(
        "soak-initiator",
        IpAddr::V4(net.ip(Side::A)),
        &[0; RAILS],
        Some(LIVENESS),
    );
    let mut targets = Vec::new();
    let mut known = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..TARGETS {
        let (t, info, desc) = netns_target::start(&net, TARGET_ENV, &[0; RAILS]);
        peers.push(a.connect(&info).unwrap());
        known.push(Arc::new(Mutex::new(Known {
            desc,
            ports: ports_of(&info),
        })));
        targets.push(Some(t));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let soak = Duration::from_secs(secs);
    let (tallies, faults, rss) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..TARGETS)
            .map(|i| {
                let (a, peer, known, stop) = (&a, &peers[i], &known[i], &stop);
                s.spawn(move || traffic(a, peer, known, stop, seed ^ ((i as u64 + 1) * 0x9e37)))
            })
            .collect();
        let mut rng = Rng(seed | 1);
        let mut faults: BTreeMap<&str, u64> = BTreeMap::new();
        let mut rss = (None, 0);
        while started.elapsed() < soak {
            if rss.0.is_none() && started.elapsed() >= soak / 4 {
                rss.0 = Some(rss_kib());
            }
            let i = rng.below(TARGETS as u64) as usize;
            let hold = Duration::from_millis(1000 + rng.below(7000));
            match rng.below(3) {
                0 => {
                    let t = targets[i].as_ref().unwrap();
                    t.signal(libc::SIGSTOP);
                    // The fault's own length, not a synchronisation.
                    std::thread::sleep(hold);
                    t.signal(libc::SIGCONT);
                    *faults.entry("stop/continue").or_default() += 1;
                }
                1 => {
                    let ports = known[i].lock().unwrap().ports.clone();
                    cut_ports(&net, &i.to_string(), &ports, true);
                    std::thread::sleep(hold);
                    cut_ports(&net, &i.to_string(), &ports, false);
                    *faults.entry("cut/restore").or_default() += 1;
                }
                _ => {
                    let ports = known[i].lock().unwrap().ports.clone();
                    targets[i].take().unwrap().kill();
                    let (t, info, desc) = netns_target::start(&net, TARGET_ENV, &ports);
                    targets[i] = Some(t);
                    // As the directory's follow would report the new incarnation.
                    a.update_peer(&peers[i], &info)
                        .unwrap_or_else(|e| panic!("update_peer after a restart: {e:?}"));
                    known[i].lock().unwrap().desc = desc;
                    *faults.entry("kill/restart").or_default() += 1;
                }
            }
            // Calm between faults (the soak's rhythm).
            std::thread::sleep(Duration::from_millis(500 + rng.below(1500)));
        }
        stop.store(true, Ordering::Relaxed);
        let tallies: Vec<Tally> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        rss.1 = rss_kib();
        (tallies, faults, rss)
    });

    // Every fault undone: each target takes a verified transfer again (a page written, read
    // back, compared), with no call of the application: the agent reconnects where a
    // connection died. The first transfer may still meet a connection that died at the
    // soak's end.
    let page = HostBuffer::new_shared(PAGE as usize).unwrap();
    page.fill(0, PAGE, 0x5a).unwrap();
    let back = HostBuffer::new_shared(PAGE as usize).unwrap();
    let src = a.register(page, Access::NONE).unwrap();
    let dst = a.register(back.clone(), Access::LOCAL_WRITE).unwrap();
    for i in 0..TARGETS {
        let desc = known[i].lock().unwrap().desc.clone();
        let seg = || Transfer::segments(vec![(0, 0, PAGE)]);
        let round_trip = || {
            run(&a, &peers[i], &src, &desc, seg())
                .and_then(|_| run(&a, &peers[i], &dst, &desc, seg().read()))
        };
        back.fill(0, PAGE, 0).unwrap();
        match round_trip() {
            Err(e) if e.kind() == ErrorKind::PeerUnreachable => round_trip(),
            r => r,
        }
        .unwrap_or_else(|e| panic!("target {i} after the soak: {e:?}"));
        assert_eq!(
            back.to_vec(0, PAGE as usize).unwrap(),
            vec![0x5a; PAGE as usize],
            "target {i}"
        );
    }

    let verified: u64 = tallies.iter().map(|t| t.verified).sum();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for t in &tallies {
        for (k, n) in &t.errors {
            *errors.entry(k.clone()).or_default() += n;
        }
    }
    let (rss_quarter, rss_end) = (rss.0.unwrap_or(rss.1), rss.1);
    println!(
        "fault soak {secs} s: faults {faults:?}; {verified} transfers verified; typed errors \
         {errors:?}; reconnects {}; initiator RSS {} MiB after a quarter, {} MiB at the end",
        metric(&a, "xfer_reconnects_total"),
        rss_quarter / 1024,
        rss_end / 1024
    );
    assert!(verified > 0, "nothing was verified");
    assert!(faults.values().sum::<u64>() > 0, "no fault was made");
    assert!(
        rss_end <= rss_quarter + 64 * 1024,
        "resident memory grew from {rss_quarter} KiB to {rss_end} KiB"
    );
}
