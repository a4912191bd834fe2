//! A userspace TCP proxy for fault tests, for the faults this kernel cannot make (it has no
//! netem): between an initiator and its target it adds delay and jitter, cuts a connection
//! after a given number of bytes (mid-frame, where the test chooses), stalls its reads for a
//! given time, and flips a payload byte. Faults apply to the bytes from the client (the
//! initiator) to the server (the target); delay and jitter to both directions.
//!
//! Each connection runs four threads (a reader and a writer per direction: the reader
//! timestamps what it reads, the writer sends each chunk when its time comes, in order).
//! Nothing here sleeps to synchronise with the test: sleeps are the faults themselves.
//! Dropping the proxy closes its listener and every connection.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the proxy does to the traffic it carries.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Added to every chunk, both ways.
    pub delay: Duration,
    /// Each chunk's delay varies by up to this much either way (order is kept).
    pub jitter: Duration,
    /// Forward exactly this many bytes from the client, then close both sides.
    pub cut_after: Option<u64>,
    /// After this many bytes from the client, read nothing more from it for this long.
    pub stall: Option<(u64, Duration)>,
    /// Invert the byte at this offset of the client's stream.
    pub flip_at: Option<u64>,
}

/// What the proxy has done, for the test to check.
#[derive(Debug, Default)]
pub struct Seen {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Bytes forwarded from clients to the server, and back.
    pub upstream_bytes: AtomicU64,
    pub downstream_bytes: AtomicU64,
    /// A connection was cut (`cut_after`).
    pub cut: AtomicBool,
    /// A stall began, and ended.
    pub stalled: AtomicBool,
    pub stall_over: AtomicBool,
    /// A byte was flipped.
    pub flipped: AtomicBool,
    /// Connections whose four threads have all ended.
    pub closed: AtomicU64,
}

/// A running proxy to `upstream`.
pub struct Proxy {
    addr: SocketAddr,
    pub seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Listens on 127.0.0.1 and forwards every connection to `upstream` with `faults`.
    pub fn start(upstream: SocketAddr, faults: Faults) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listens");
        let addr = listener.local_addr().expect("proxy address");
        let seen = Arc::new(Seen::default());
        let stop = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let (seen2, stop2, streams2) = (seen.clone(), stop.clone(), streams.clone());
        let acceptor = std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                if stop2.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = conn else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                seen2.connections.fetch_add(1, Ordering::SeqCst);
                for s in [&client, &server] {
                    let _ = s.set_nodelay(true);
                    if let Ok(c) = s.try_clone() {
                        streams2.lock().unwrap().push(c);
                    }
                }
                relay(client, server, &faults, seen2.clone(), n as u64);
            }
        });
        Proxy {
            addr,
            seen,
            stop,
            streams,
            acceptor: Some(acceptor),
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The proxy's address as a TCP transport address.
    pub fn transport_address(&self) -> Vec<u8> {
        format!("{}{}", transport_tcp::ADDRESS_PREFIX, self.addr).into_bytes()
    }

    /// Waits (at most `within`) until `cond` holds of what the proxy has seen.
    pub fn wait_for(&self, within: Duration, what: &str, cond: impl Fn(&Seen) -> bool) {
        let deadline = Instant::now() + within;
        while !cond(&self.seen) {
            assert!(
                Instant::now() < deadline,
                "proxy: timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for s in self.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        // Unblocks the acceptor, which then sees `stop`.
        let _ = TcpStream::connect(self.addr);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

/// A chunk read, and when it may leave.
type Chunk = (Instant, Vec<u8>);

/// Small deterministic noise for the jitter (an xorshift), seeded per connection and
/// direction.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// `delay` plus or minus up to `jitter`, never below zero.
    fn delay(&mut self, delay: Duration, jitter: Duration) -> Duration {
        if jitter.is_zero() {
            return delay;
        }
        let span = jitter.as_nanos() as u64 * 2 + 1;
        let off = (self.next() % span) as i128 - jitter.as_nanos() as i128;
        Duration::from_nanos((delay.as_nanos() as i128 + off).max(0) as u64)
    }
}

fn relay(client: TcpStream, server: TcpStream, f: &Faults, seen: Arc<Seen>, n: u64) {
    let pairs = [
        (client.try_clone(), server.try_clone(), true),
        (server.try_clone(), client.try_clone(), false),
    ];
    let ended = Arc::new(AtomicU64::new(0));
    for (from, to, up) in pairs {
        let (Ok(from), Ok(to)) = (from, to) else {
            continue;
        };
        let (tx, rx) = mpsc::channel::<Chunk>();
        let f = f.clone();
        let seen_r = seen.clone();
        let (from_w, to_r) = (from.try_clone().ok(), to.try_clone().ok());
        let ended_r = ended.clone();
        let seen_e = seen.clone();
        std::thread::spawn(move || {
            read_side(
                from,
                tx,
                &f,
                up,
                &seen_r,
                Noise(0x9E37_79B9 ^ (n << 1 | up as u64)),
            );
            // The other side learns of the end once what was read has left (writer).
            drop(to_r);
            if ended_r.fetch_add(1, Ordering::SeqCst) == 3 {
                seen_e.closed.fetch_add(1, Ordering::SeqCst);
            }
        });
        let seen_w = seen.clone();
        let ended_w = ended.clone();
        std::thread::spawn(move || {
            write_side(to, rx, up, &seen_w);
            if let Some(f) = from_w {
                let _ = f.shutdown(Shutdown::Read);
            }
            if ended_w.fetch_add(1, Ordering::SeqCst) == 3 {
                seen_w.closed.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
}

/// Reads `from`, applies the client-side faults, and hands each chunk with its due time to
/// the writer. Ends at EOF, an error, or a cut.
fn read_side(
    mut from: TcpStream,
    tx: mpsc::Sender<Chunk>,
    f: &Faults,
    up: bool,
    seen: &Seen,
    mut noise: Noise,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut offset = 0u64;
    let mut last_due = Instant::now();
    let mut stalled = false;
    loop {
        let mut want = buf.len();
        if up {
            // Stop exactly where a fault begins, so it lands on the byte asked for.
            for at in [f.cut_after, f.stall.map(|s| s.0), f.flip_at.map(|x| x + 1)]
                .into_iter()
                .flatten()
            {
                if at > offset {
                    want = want.min((at - offset) as usize);
                }
            }
        }
        let n = match from.read(&mut buf[..want]) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut chunk = buf[..n].to_vec();
        if up
            && let Some(at) = f.flip_at
            && (offset..offset + n as u64).contains(&at)
        {
            chunk[(at - offset) as usize] ^= 0xFF;
            seen.flipped.store(true, Ordering::SeqCst);
        }
        offset += n as u64;
        let due = (Instant::now() + noise.delay(f.delay, f.jitter)).max(last_due);
        last_due = due;
        if tx.send((due, chunk)).is_err() {
            return;
        }
        if up && f.cut_after == Some(offset) {
            seen.cut.store(true, Ordering::SeqCst);
            // The writer forwards what it holds, then both sides are shut (see `write_side`).
            return;
        }
        if up
            && !stalled
            && let Some((at, for_)) = f.stall
            && offset >= at
        {
            stalled = true;
            seen.stalled.store(true, Ordering::SeqCst);
            std::thread::sleep(for_);
            seen.stall_over.store(true, Ordering::SeqCst);
        }
    }
}

/// Writes each chunk to `to` when it is due; once the reader has ended, shuts `to` (for a
/// cut, or the end of the other side's stream).
fn write_side(mut to: TcpStream, rx: mpsc::Receiver<Chunk>, up: bool, seen: &Seen) {
    for (due, chunk) in rx {
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if to.write_all(&chunk).is_err() {
            break;
        }
        let counter = if up {
            &seen.upstream_bytes
        } else {
            &seen.downstream_bytes
        };
        counter.fetch_add(chunk.len() as u64, Ordering::SeqCst);
    }
    let _ = to.shutdown(Shutdown::Both);
}
