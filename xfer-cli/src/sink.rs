//! `bench --baseline` against a server: plain TCP streams, one per rail, each leaving on its
//! rail's NIC toward the server's address that the rail itself writes to, moving the bytes
//! the engine run moved. Both ends live here: [`drain`], the server's end, answers the
//! control channel's `sink` request; [`send`], the client's, times the streams.
//!
//! The server opens one listener per distinct IP its rails serve on ([`listen`]), in the
//! order [`distinct_ips`] gives, and the client pairs its rail `i` with the listener on the
//! IP of server rail `i mod N` ([`pair`]), the pairing the rails themselves use. Each stream
//! is written to EOF; the server then answers with the bytes it counted (8 bytes, little
//! endian), so the client's clock includes delivery.
//!
//! The server's end is bounded ([`SinkLimits`]): at most [`MAX_STREAMS`] streams, accepted
//! within a deadline, each read making progress within its stall limit, [`MAX_BYTES`] in
//! all and [`MAX_DURATION`] at most; whatever goes wrong ends the sink, never the server.

use socket2::SockAddr;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use xfer::Congestion;
use xfer::layers::nics::RailNic;
use xfer::layers::raw_auth;

/// Most streams one `sink` request may ask for (as many as the most rails).
pub const MAX_STREAMS: u32 = 256;
/// Most bytes one sink takes, all its streams together.
pub const MAX_BYTES: u64 = 64 << 30;
/// Longest one sink lasts, from its reply to its last stream's answer.
pub const MAX_DURATION: Duration = Duration::from_secs(15 * 60);
/// Bytes per write (client) and per read buffer (server, one per stream).
const CHUNK: usize = 1 << 20;

/// The distinct IPs among rails' data addresses, in order of first appearance (`None`
/// for an address that is not a TCP one: those rails are reached at the control IP), and
/// for each address the position of its IP in that list.
pub fn distinct_ips(addresses: &[Vec<u8>]) -> (Vec<Option<IpAddr>>, Vec<usize>) {
    let mut ips: Vec<Option<IpAddr>> = Vec::new();
    let at = addresses
        .iter()
        .map(|a| {
            let ip = transport_tcp::TcpTransport::parse_address(a)
                .ok()
                .map(|s| s.ip());
            match ips.iter().position(|i| *i == ip) {
                Some(p) => p,
                None => {
                    ips.push(ip);
                    ips.len() - 1
                }
            }
        })
        .collect();
    (ips, at)
}

/// One listener per distinct IP of the rails at `addresses` ([`distinct_ips`]'s order);
/// an unspecified IP, or a rail that is not TCP, is served at `control_ip`.
pub fn listen(addresses: &[Vec<u8>], control_ip: IpAddr) -> std::io::Result<Vec<TcpListener>> {
    let (ips, _) = distinct_ips(addresses);
    ips.iter()
        .map(|ip| {
            let ip = ip.filter(|i| !i.is_unspecified()).unwrap_or(control_ip);
            TcpListener::bind((ip, 0))
        })
        .collect()
}

/// How long a sink waits, and for how much.
#[derive(Clone, Copy, Debug)]
pub struct SinkLimits {
    /// All streams must connect within this, from the reply (`--hello-timeout`).
    pub accept_within: Duration,
    /// Each read, and the answer, must make progress within this (`--request-timeout`).
    pub stall: Duration,
    /// The whole sink ends by this ([`MAX_DURATION`]).
    pub total: Duration,
    /// Bytes all streams may bring together ([`MAX_BYTES`]).
    pub max_bytes: u64,
}

/// Why a sink ended before every stream was answered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// Fewer streams connected than were asked for, within the deadline.
    #[error("{got} of {want} streams connected within {within:?} (--hello-timeout)")]
    TooFewStreams {
        /// Streams that connected.
        got: usize,
        /// Streams asked for.
        want: usize,
        /// The deadline.
        within: Duration,
    },
    /// Waiting for or accepting a stream failed.
    #[error("accepting a stream: {0}")]
    Accept(#[source] std::io::Error),
    /// No thread for a stream.
    #[error("no thread for a stream: {0}")]
    Spawn(#[source] std::io::Error),
    /// A stream sent nothing for the stall limit.
    #[error("a stream stalled for {0:?} (--request-timeout)")]
    Stalled(Duration),
    /// The sink outlived [`MAX_DURATION`].
    #[error("the sink ran past its {0:?}")]
    TooLong(Duration),
    /// The streams brought more than the sink takes.
    #[error("the streams sent more than {0} bytes")]
    TooManyBytes(u64),
    /// Reading a stream failed.
    #[error("reading a stream: {0}")]
    Read(#[source] std::io::Error),
    /// A stream did not pass the authentication ([`raw_auth`]).
    #[error("a stream's authentication: {0}")]
    Auth(#[source] std::io::Error),
    /// Answering a stream with its count failed.
    #[error("answering a stream: {0}")]
    Answer(#[source] std::io::Error),
    /// A stream's thread panicked.
    #[error("a stream's thread panicked")]
    Panicked,
}

/// The server's end of a sink: accepts `streams` connections on `listeners` (any of them),
/// reads each to EOF (discarding), answers each with its count; returns the bytes of all.
/// Streams are read at once, a thread each; the first failure is returned once every
/// stream accepted has ended.
///
/// Each stream first passes [`raw_auth::challenge`] against `token` (within the
/// stall limit); one that does not is counted as failed.
pub fn drain(
    listeners: &[TcpListener],
    streams: usize,
    limits: SinkLimits,
    token: Option<&str>,
) -> Result<u64, SinkError> {
    let start = Instant::now();
    let accept_by = start + limits.accept_within;
    let end_by = start + limits.total;
    let budget = AtomicU64::new(limits.max_bytes);
    std::thread::scope(|scope| {
        let mut readers = Vec::with_capacity(streams);
        let mut failed = None;
        while readers.len() < streams {
            let conn = match accept_any(listeners, accept_by) {
                Ok(Some(c)) => c,
                Ok(None) => {
                    failed = Some(SinkError::TooFewStreams {
                        got: readers.len(),
                        want: streams,
                        within: limits.accept_within,
                    });
                    break;
                }
                Err(e) => {
                    failed = Some(SinkError::Accept(e));
                    break;
                }
            };
            let budget = &budget;
            let spawned = std::thread::Builder::new()
                .name("xfer-sink".into())
                .spawn_scoped(scope, move || {
                    raw_auth::challenge(
                        &conn,
                        token,
                        raw_auth::SINK_CONTEXT,
                        limits.stall.max(Duration::from_millis(1)),
                    )
                    .map_err(SinkError::Auth)?;
                    drain_one(conn, limits.stall, end_by, budget, limits.max_bytes)
                });
            match spawned {
                Ok(h) => readers.push(h),
                Err(e) => {
                    failed = Some(SinkError::Spawn(e));
                    break;
                }
            }
        }
        let mut total = 0u64;
        for h in readers {
            match h.join() {
                Ok(Ok(n)) => total += n,
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(_) => {
                    failed.get_or_insert(SinkError::Panicked);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(total),
        }
    })
}

/// Reads `conn` to EOF into one reused buffer, taking what arrives from `budget`, then
/// answers with the count.
fn drain_one(
    mut conn: TcpStream,
    stall: Duration,
    end_by: Instant,
    budget: &AtomicU64,
    max_bytes: u64,
) -> Result<u64, SinkError> {
    // A zero timeout would mean none: at least a millisecond.
    let stall = stall.max(Duration::from_millis(1));
    let mut buf = vec![0u8; CHUNK];
    let mut count = 0u64;
    loop {
        let left = end_by.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(SinkError::TooLong(MAX_DURATION));
        }
        conn.set_read_timeout(Some(stall.min(left).max(Duration::from_millis(1))))
            .map_err(SinkError::Read)?;
        let n = match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(if Instant::now() >= end_by {
                    SinkError::TooLong(MAX_DURATION)
                } else {
                    SinkError::Stalled(stall)
                });
            }
            Err(e) => return Err(SinkError::Read(e)),
        };
        budget
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| b.checked_sub(n))
            .map_err(|_| SinkError::TooManyBytes(max_bytes))?;
        count += n;
    }
    conn.set_write_timeout(Some(stall))
        .and_then(|_| conn.write_all(&count.to_le_bytes()))
        .map_err(SinkError::Answer)?;
    Ok(count)
}

/// The next connection to any of `listeners`, or `None` if none comes by `deadline`.
pub fn accept_any(
    listeners: &[TcpListener],
    deadline: Instant,
) -> std::io::Result<Option<TcpStream>> {
    use std::os::fd::AsRawFd;
    let mut fds: Vec<libc::pollfd> = listeners
        .iter()
        .map(|l| libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `fds` is a vector of initialised pollfds that outlives the call, and the
        // count passed is its length; the descriptors are the listeners', open for the
        // whole call since `listeners` is borrowed.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if let Some(i) = fds.iter().position(|f| f.revents != 0) {
            return listeners[i].accept().map(|(conn, _)| Some(conn));
        }
    }
}

/// One stream of the client's end: the NIC it leaves on (`None`: unbound) and the
/// server's sink listener it goes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stream {
    /// The rail's NIC: the stream is bound to the interface and to its address.
    pub nic: Option<RailNic>,
    /// The sink listener on the IP of the server rail this rail writes to.
    pub to: SocketAddr,
}

/// The streams of `rails` rails: rail `i` on `nics[i]` (none when `nics` is empty), to the
/// sink listener on the IP of server rail `i mod N`. `server` are the server's rail
/// addresses as its hello gave them, `sinks` the sink's listeners in [`distinct_ips`]'s
/// order of them.
pub fn pair(
    server: &[Vec<u8>],
    sinks: &[SocketAddr],
    rails: usize,
    nics: &[RailNic],
) -> Result<Vec<Stream>, String> {
    let (ips, at) = distinct_ips(server);
    if at.is_empty() || ips.len() != sinks.len() {
        return Err(format!(
            "the peer's sink answered {} addresses for its {} rail IPs",
            sinks.len(),
            ips.len()
        ));
    }
    Ok((0..rails)
        .map(|i| Stream {
            nic: nics.get(i).cloned(),
            to: sinks[at[i % at.len()]],
        })
        .collect())
}

/// Why the client's streams failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// A stream's source buffer could not be allocated.
    #[error("allocating a stream's buffer: {0}")]
    Memory(String),
    /// A stream could not be opened, bound to its NIC, or connected.
    #[error("stream {stream} to {to}{}: {source}", .nic.as_ref().map(|n| format!(" on {n}")).unwrap_or_default())]
    Connect {
        /// The stream (its rail).
        stream: usize,
        /// Its NIC, if bound.
        nic: Option<String>,
        /// The sink listener.
        to: SocketAddr,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Writing a stream, or reading its count, failed.
    #[error("stream {stream}: {source}")]
    Io {
        /// The stream.
        stream: usize,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The server counted other bytes than the stream sent.
    #[error("stream {stream}: sent {sent} bytes, the server counted {counted}")]
    Mismatch {
        /// The stream.
        stream: usize,
        /// Bytes sent.
        sent: u64,
        /// Bytes the server counted.
        counted: u64,
    },
    /// A stream's thread panicked.
    #[error("a stream's thread panicked")]
    Panicked,
}

/// What the client's streams did.
#[derive(Clone, Copy, Debug)]
pub struct SendReport {
    /// Bytes all streams sent (and the server counted).
    pub bytes: u64,
    /// From the first write to the last count's arrival.
    pub seconds: f64,
}

impl SendReport {
    /// Gbit/s.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.seconds.max(1e-9) / 1e9
    }
}

/// Opens a socket toward `to`, bound to `nic` (interface and address) when given, with the
/// congestion control `congestion` gives it (what the engine's tcp rails run), and
/// connects within 5 s.
fn connect(
    nic: Option<&RailNic>,
    to: SocketAddr,
    congestion: &Congestion,
) -> std::io::Result<TcpStream> {
    let s = congestion.socket_toward(to)?;
    if let Some(nic) = nic {
        s.bind_device(Some(nic.name.as_bytes()))?;
        if let Some(ip) = nic.ip.filter(|ip| ip.is_ipv4() == to.is_ipv4()) {
            s.bind(&SockAddr::from(SocketAddr::new(ip, 0)))?;
        }
    }
    s.connect_timeout(&SockAddr::from(to), Duration::from_secs(5))?;
    let s: TcpStream = s.into();
    // A server that stops reading or answering does not hold the client forever.
    s.set_write_timeout(Some(Duration::from_secs(60)))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    Ok(s)
}

/// Sends `per_stream` bytes on each of `streams` at once, each from its own buffer of
/// `footprint / streams` bytes (whole MiB, at least one; cycled) in 1 MiB writes, then
/// closes its writing side and checks the server's count. Connections and buffers are set
/// up before the clock starts.
///
/// Each stream runs the congestion control `congestion` gives it (the rails' rule), and
/// answers the sink's challenge with `token` first
/// ([`raw_auth::answer`]), before the clock starts.
pub fn send(
    streams: &[Stream],
    per_stream: u64,
    footprint: u64,
    token: Option<&str>,
    congestion: &Congestion,
) -> Result<SendReport, SendError> {
    let n = streams.len().max(1);
    let share = ((footprint / n as u64) as usize / CHUNK).max(1) * CHUNK;
    let mut ready = Vec::with_capacity(streams.len());
    for (i, st) in streams.iter().enumerate() {
        let mut mem =
            gpu_mem::HostMemory::new(share).map_err(|e| SendError::Memory(e.to_string()))?;
        mem.as_mut_slice().fill(0x5A);
        let conn = connect(st.nic.as_ref(), st.to, congestion)
            .and_then(|c| raw_auth::answer(&c, token, raw_auth::SINK_CONTEXT).map(|()| c))
            .map_err(|source| SendError::Connect {
                stream: i,
                nic: st.nic.as_ref().map(|n| n.name.clone()),
                to: st.to,
                source,
            })?;
        ready.push((conn, mem));
    }
    let go = Barrier::new(ready.len() + 1);
    std::thread::scope(|scope| {
        let writers: Vec<_> = ready
            .into_iter()
            .enumerate()
            .map(|(i, (mut conn, mut mem))| {
                let go = &go;
                scope.spawn(move || -> Result<Instant, SendError> {
                    go.wait();
                    let io = |source| SendError::Io { stream: i, source };
                    let src = mem.as_mut_slice();
                    let mut left = per_stream;
                    let mut at = 0usize;
                    while left > 0 {
                        let len = left.min(CHUNK as u64) as usize;
                        conn.write_all(&src[at..at + len]).map_err(io)?;
                        left -= len as u64;
                        at = if at + CHUNK >= share { 0 } else { at + CHUNK };
                    }
                    conn.shutdown(std::net::Shutdown::Write).map_err(io)?;
                    let mut count = [0u8; 8];
                    conn.read_exact(&mut count).map_err(io)?;
                    let done = Instant::now();
                    let counted = u64::from_le_bytes(count);
                    if counted != per_stream {
                        return Err(SendError::Mismatch {
                            stream: i,
                            sent: per_stream,
                            counted,
                        });
                    }
                    Ok(done)
                })
            })
            .collect();
        go.wait();
        let start = Instant::now();
        let mut last = start;
        let mut failed = None;
        for w in writers {
            match w.join() {
                Ok(Ok(done)) => last = last.max(done),
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(_) => {
                    failed.get_or_insert(SendError::Panicked);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(SendReport {
                bytes: per_stream * streams.len() as u64,
                seconds: last.duration_since(start).as_secs_f64(),
            }),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(a: &str) -> Vec<u8> {
        format!("tcp://{a}").into_bytes()
    }

    #[test]
    fn rails_pair_with_the_listener_on_their_server_rails_ip() {
        // Four server rails on two IPs, in the order a..b..a..b.
        let server = [
            tcp("10.0.0.1:1"),
            tcp("10.0.1.1:2"),
            tcp("10.0.0.1:3"),
            tcp("10.0.1.1:4"),
        ];
        let (ips, at) = distinct_ips(&server);
        assert_eq!(
            ips,
            [
                Some("10.0.0.1".parse().unwrap()),
                Some("10.0.1.1".parse().unwrap())
            ]
        );
        assert_eq!(at, [0, 1, 0, 1]);
        let sinks: Vec<SocketAddr> = vec![
            "10.0.0.1:50".parse().unwrap(),
            "10.0.1.1:51".parse().unwrap(),
        ];
        let nics: Vec<RailNic> = (0..3)
            .map(|i| RailNic {
                name: format!("veth{i}"),
                ip: Some(format!("10.0.{i}.2").parse().unwrap()),
            })
            .collect();
        // Three rails on three NICs: rail i to server rail i's IP.
        let s = pair(&server, &sinks, 3, &nics).unwrap();
        let to: Vec<u16> = s.iter().map(|s| s.to.port()).collect();
        assert_eq!(to, [50, 51, 50]);
        assert_eq!(s[1].nic.as_ref().unwrap().name, "veth1");
        // Six unbound rails wrap around the four server rails.
        let s = pair(&server, &sinks, 6, &[]).unwrap();
        let to: Vec<u16> = s.iter().map(|s| s.to.port()).collect();
        assert_eq!(to, [50, 51, 50, 51, 50, 51]);
        assert!(s.iter().all(|s| s.nic.is_none()));
        // A sink answer that does not match the IPs is an error, not a wrong pairing.
        assert!(pair(&server, &sinks[..1], 2, &[]).is_err());
        assert!(pair(&[], &[], 2, &[]).is_err());
    }

    #[test]
    fn rails_that_are_not_tcp_share_one_listener() {
        let server = [b"\x01\x02".to_vec(), b"\x03".to_vec()];
        let (ips, at) = distinct_ips(&server);
        assert_eq!(ips, [None]);
        assert_eq!(at, [0, 0]);
        let l = listen(&server, "127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(l.len(), 1);
        assert!(l[0].local_addr().unwrap().ip().is_loopback());
    }

    /// The two ends together on loopback: the counts come back, and a sink that takes
    /// fewer bytes than a stream sends ends that stream with an error, not a count.
    #[test]
    fn streams_are_counted_and_a_sink_over_its_bytes_refuses() {
        let limits = |max_bytes| SinkLimits {
            accept_within: Duration::from_secs(10),
            stall: Duration::from_secs(10),
            total: Duration::from_secs(60),
            max_bytes,
        };
        let server = [tcp("127.0.0.1:1")];
        let run = |max_bytes, per: u64| {
            let listeners = listen(&server, "127.0.0.1".parse().unwrap()).unwrap();
            let sinks: Vec<SocketAddr> =
                listeners.iter().map(|l| l.local_addr().unwrap()).collect();
            let streams = pair(&server, &sinks, 3, &[]).unwrap();
            std::thread::scope(|s| {
                let d = s.spawn(|| drain(&listeners, 3, limits(max_bytes), Some("tok")));
                let sent = send(&streams, per, 4 << 20, Some("tok"), &Congestion::Auto);
                (sent, d.join().unwrap())
            })
        };
        let (sent, drained) = run(MAX_BYTES, 3 << 20 | 17);
        let sent = sent.unwrap();
        assert_eq!(sent.bytes, 3 * (3 << 20 | 17));
        assert!(sent.gbps() > 0.0);
        assert_eq!(drained.unwrap(), sent.bytes);
        let (sent, drained) = run(4 << 20, 2 << 20);
        assert!(sent.is_err(), "{sent:?}");
        assert!(
            matches!(drained, Err(SinkError::TooManyBytes(_))),
            "{drained:?}"
        );
    }
}
