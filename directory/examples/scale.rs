//! The directory at scale, against one real etcd on loopback (started here):
//! `cargo run --release -p directory --features testing --example scale -- [MEMBERS] [LEAVING] [TTL_S]`
//! (defaults 1000, 100, 2).
//!
//! 1. MEMBERS records are published, each under its own lease with its own keep-alive (as
//!    many processes would), from 8 clients; one watcher reports how long each join took
//!    from the start of its `publish` call to the watcher's event (p50, p99, max).
//! 2. LEAVING members withdraw at once (a rolling shutdown): time until the watcher has seen
//!    every leave.
//! 3. LEAVING more stop renewing at once (a crash of that many processes): time from the
//!    crash until the watcher has seen every leave (bounded below by the TTL).

use directory::testing::Etcd;
use directory::{Directory, EtcdDirectory, EtcdOptions, Event, Publication, Record};
use fabric_core::MemoryLocation;
use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CLIENTS: usize = 8;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: MEMBERS LEAVING TTL_S"))
        .collect();
    let members = *args.first().unwrap_or(&1000) as usize;
    let leaving = (*args.get(1).unwrap_or(&100) as usize).min(members / 2);
    let ttl = Duration::from_secs(*args.get(2).unwrap_or(&2));
    let etcd = Etcd::start_or_skip().expect("this benchmark needs etcd (Debian: etcd-server)");
    let connect = || EtcdDirectory::connect(&[etcd.endpoint()], EtcdOptions::default()).unwrap();
    let watcher = connect();
    let watch = watcher.watch("scale").unwrap();
    let started: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();

    // 1. Joins, read by a watcher thread while they are published.
    let reader = {
        let started = started.clone();
        std::thread::spawn(move || {
            let mut joins = Vec::new();
            while joins.len() < members {
                match watch.next(Duration::from_secs(30)).unwrap() {
                    Some(Event::Joined(m)) => {
                        let at = started.lock().unwrap()[m.record.name()];
                        joins.push(at.elapsed());
                    }
                    Some(_) => {}
                    None => panic!("only {} of {members} joins seen", joins.len()),
                }
            }
            (watch, joins)
        })
    };
    let t0 = Instant::now();
    let pubs: Vec<Vec<(String, Publication)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let started = started.clone();
                let connect = &connect;
                s.spawn(move || {
                    let d = connect();
                    let mut mine = Vec::new();
                    for i in (c..members).step_by(CLIENTS) {
                        let name = format!("m{i:05}");
                        let mut a = AgentInfo::new(&name, "boot", MemoryLocation::Host);
                        a.transports = vec![TransportInfo::new(
                            TransportKind::Tcp,
                            vec![format!("tcp://10.0.{}.{}:7000", i / 250, i % 250).into_bytes()],
                        )];
                        let r = Record::new("scale", a);
                        started.lock().unwrap().insert(name.clone(), Instant::now());
                        mine.push((name, d.publish(r, ttl).unwrap()));
                    }
                    // Each publication holds the client's runtime: dropping `d` is fine.
                    drop(d);
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (watch, mut joins) = reader.join().unwrap();
    let all_in = t0.elapsed();
    joins.sort();
    println!(
        "joins: {members} members from {CLIENTS} clients in {}: publish-to-watcher p50 {}, p99 {}, max {}",
        ms(all_in),
        ms(pct(&joins, 0.5)),
        ms(pct(&joins, 0.99)),
        ms(*joins.last().unwrap())
    );
    // Nothing is reported while everyone renews: wait two TTLs.
    let quiet = Instant::now() + ttl * 2;
    let mut spurious = 0;
    while let Some(left) = quiet.checked_duration_since(Instant::now()) {
        if let Ok(Some(_)) = watch.next(left) {
            spurious += 1;
        }
    }
    println!(
        "renewals: {members} leases kept alive for {:?}: {spurious} spurious events",
        ttl * 2
    );

    let mut flat: Vec<(String, Publication)> = pubs.into_iter().flatten().collect();
    // 2. Withdrawals at once.
    let going: Vec<(String, Publication)> = flat.drain(..leaving).collect();
    let t = Instant::now();
    let handles: Vec<_> = going
        .into_iter()
        .map(|(_, p)| std::thread::spawn(move || p.withdraw().unwrap()))
        .collect();
    let mut left = 0;
    while left < leaving {
        match watch.next(Duration::from_secs(30)).unwrap() {
            Some(Event::Left(_)) => left += 1,
            Some(_) => {}
            None => panic!("only {left} of {leaving} leaves seen"),
        }
    }
    let converged = t.elapsed();
    handles.into_iter().for_each(|h| h.join().unwrap());
    println!(
        "withdraw: {leaving} members withdrew at once: the watcher saw every leave after {}",
        ms(converged)
    );

    // 3. A crash of as many.
    let crashing: Vec<(String, Publication)> = flat.drain(..leaving).collect();
    let t = Instant::now();
    for (_, p) in crashing {
        p.abandon();
    }
    let mut left = 0;
    let mut first = None;
    while left < leaving {
        match watch.next(ttl * 10).unwrap() {
            Some(Event::Left(_)) => {
                left += 1;
                first.get_or_insert_with(|| t.elapsed());
            }
            Some(_) => {}
            None => panic!("only {left} of {leaving} expiries seen"),
        }
    }
    println!(
        "crash: {leaving} members stopped renewing at once (ttl {ttl:?}): first leave after {}, all after {}",
        ms(first.unwrap_or_default()),
        ms(t.elapsed())
    );
    drop(flat);
}
