//! The unauthenticated phase of a rendezvous server's control port: one event loop for
//! every connection that has not yet said who it is.
//!
//! A connection takes no client's place, no thread and no memory beyond its few bytes of
//! hello until its hello line is complete and judged: silent or trickling connections
//! (slow-loris) cannot keep legitimate clients out. What it does hold is bounded three ways:
//! - a deadline: the hello must be complete within `hello_timeout` of the accept;
//! - a cap per address and one in all (`max_pending_per_address`, `max_pending`): past
//!   either, the **oldest** pending connection (of that address, or of all) is closed to
//!   make room, so a newcomer always gets its chance and a flood only churns itself;
//! - a cap on the hello's bytes.
//!
//! On accept the server greets first with a fresh nonce (the challenge of the control
//! protocol's authentication); the hello line that follows is handed to the caller's judge,
//! which admits it (the connection then leaves the loop, blocking again, for a thread of
//! its own) or refuses it with a reason that is written without blocking before the
//! connection closes. The loop never blocks on any one connection.
//!
//! `mio` (the maintained event-loop crate under tokio) gives the readiness polling: epoll
//! on Linux, so thousands of pending connections cost one `epoll_wait`, not a scan.

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};
use transport_tcp::auth::Nonce;

/// The listener's token; connections take the others.
const LISTENER: Token = Token(usize::MAX);

/// The token of the [`Stop`] handle's waker.
const STOP: Token = Token(usize::MAX - 1);

/// Ends a door's loop from another thread: [`Door::run`] returns `Ok(())` at its next
/// turn after [`stop`](Stop::stop).
#[derive(Clone)]
pub struct Stop {
    waker: std::sync::Arc<mio::Waker>,
    stopped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Stop {
    /// Asks the loop to end (the listener and every pending connection close with it).
    pub fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
        if let Err(e) = self.waker.wake() {
            tracing::warn!(error = %e, "could not wake the rendezvous loop to stop it");
        }
    }
}

/// How many bytes one read of a pending connection takes at most.
const READ_CHUNK: usize = 4096;

/// What bounds the unauthenticated phase (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct DoorLimits {
    /// The hello must be complete within this of the accept.
    pub hello_timeout: Duration,
    /// Pending connections in all; past it the oldest is closed.
    pub max_pending: usize,
    /// Pending connections of one IP address; past it that address's oldest is closed.
    pub max_pending_per_address: usize,
    /// The longest hello line.
    pub max_hello_bytes: usize,
}

/// Why the door closed a pending connection without a judgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// No complete hello within the deadline.
    HelloTimeout,
    /// A hello longer than the cap.
    TooLong,
    /// Closed to make room for a newer connection (a cap was reached).
    Evicted,
}

/// A complete hello line, for the judge.
pub struct Hello<'a> {
    /// The line, without its newline.
    pub line: &'a [u8],
    /// The nonce this connection was greeted with.
    pub nonce: &'a Nonce,
    /// Who sent it.
    pub from: SocketAddr,
}

/// The judge's answer to a hello.
pub enum Verdict<T> {
    /// Take the connection out of the loop, with what the judge made of it.
    Admit(T),
    /// Refuse: this line (a JSON reply, newline included) is written without blocking,
    /// then the connection closes.
    Refuse(Vec<u8>),
}

/// A connection the judge admitted: blocking again, for a thread of its own.
pub struct Admitted<T> {
    /// The connection.
    pub conn: TcpStream,
    /// Who it is.
    pub from: SocketAddr,
    /// What the judge made of its hello.
    pub admitted: T,
}

/// A connection in the unauthenticated phase.
struct Pending {
    conn: TcpStream,
    from: SocketAddr,
    accepted: Instant,
    nonce: Nonce,
    buf: Vec<u8>,
}

/// The event loop of the unauthenticated phase.
pub struct Door {
    listener: TcpListener,
    poll: Poll,
    limits: DoorLimits,
    pending: HashMap<Token, Pending>,
    /// Tokens in order of acceptance (the oldest first; closed ones are skipped).
    order: VecDeque<Token>,
    /// Per address, its pending tokens in order of acceptance.
    by_address: HashMap<IpAddr, VecDeque<Token>>,
    next: usize,
    stop: Stop,
}

impl Door {
    /// A door on `listener` (made non-blocking here).
    pub fn new(listener: TcpListener, limits: DoorLimits) -> std::io::Result<Door> {
        listener.set_nonblocking(true)?;
        let poll = Poll::new()?;
        poll.registry().register(
            &mut SourceFd(&listener.as_raw_fd()),
            LISTENER,
            Interest::READABLE,
        )?;
        let stop = Stop {
            waker: std::sync::Arc::new(mio::Waker::new(poll.registry(), STOP)?),
            stopped: Default::default(),
        };
        Ok(Door {
            listener,
            poll,
            limits,
            pending: HashMap::new(),
            order: VecDeque::new(),
            by_address: HashMap::new(),
            next: 0,
            stop,
        })
    }

    /// A handle that ends [`run`](Door::run) from another thread.
    pub fn stopper(&self) -> Stop {
        self.stop.clone()
    }

    /// Runs the loop until an error of the poll itself or a [`Stop`]: accepts, greets each connection
    /// with `greeting(nonce)` (a line, newline included), reads hellos, hands each complete
    /// one to `judge`, hands admitted connections to `admit`, and reports every connection
    /// the door closes itself to `closed` (with its address and why). `on_pending` hears
    /// the number of pending connections after each turn.
    pub fn run<T>(
        mut self,
        greeting: impl Fn(&Nonce) -> Vec<u8>,
        mut judge: impl FnMut(Hello<'_>) -> Verdict<T>,
        mut admit: impl FnMut(Admitted<T>),
        mut closed: impl FnMut(SocketAddr, Closed),
        mut on_pending: impl FnMut(usize),
    ) -> std::io::Result<()> {
        let mut events = Events::with_capacity(1024);
        loop {
            let timeout = self.oldest_deadline().map(|d| {
                d.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1))
            });
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if self.stop.stopped.load(std::sync::atomic::Ordering::Acquire) {
                return Ok(());
            }
            for ev in events.iter() {
                if ev.token() == STOP {
                    continue;
                }
                if ev.token() == LISTENER {
                    self.accept_all(&greeting, &mut closed);
                } else {
                    self.read(ev.token(), &mut judge, &mut admit, &mut closed);
                }
            }
            self.expire(&mut closed);
            on_pending(self.pending.len());
        }
    }

    /// The deadline of the oldest pending connection.
    fn oldest_deadline(&mut self) -> Option<Instant> {
        while let Some(t) = self.order.front() {
            match self.pending.get(t) {
                Some(p) => return Some(p.accepted + self.limits.hello_timeout),
                None => {
                    self.order.pop_front();
                }
            }
        }
        None
    }

    /// Accepts every connection waiting, greeting each.
    fn accept_all(
        &mut self,
        greeting: &impl Fn(&Nonce) -> Vec<u8>,
        closed: &mut impl FnMut(SocketAddr, Closed),
    ) {
        loop {
            match self.listener.accept() {
                Ok((conn, from)) => self.take(conn, from, greeting, closed),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors (EMFILE): the oldest pending connection makes room;
                    // with none to close, the next turn tries again.
                    tracing::warn!(error = %e, pending = self.pending.len(), "accept failed");
                    match self.oldest() {
                        Some(t) => self.close(t, Closed::Evicted, closed),
                        None => return,
                    }
                }
            }
        }
    }

    /// The oldest pending connection, if any.
    fn oldest(&mut self) -> Option<Token> {
        self.oldest_deadline()?;
        self.order.front().copied()
    }

    /// Takes a new connection into the loop, making room under the caps first.
    fn take(
        &mut self,
        conn: TcpStream,
        from: SocketAddr,
        greeting: &impl Fn(&Nonce) -> Vec<u8>,
        closed: &mut impl FnMut(SocketAddr, Closed),
    ) {
        let ip = from.ip();
        let of_address = self.by_address.get(&ip).map_or(0, VecDeque::len);
        if of_address >= self.limits.max_pending_per_address.max(1)
            && let Some(&t) = self.by_address.get(&ip).and_then(|q| q.front())
        {
            self.close(t, Closed::Evicted, closed);
        }
        if self.pending.len() >= self.limits.max_pending.max(1)
            && let Some(t) = self.oldest()
        {
            self.close(t, Closed::Evicted, closed);
        }
        let Ok(nonce) = Nonce::new() else {
            tracing::warn!(%from, "no randomness for a nonce: connection dropped");
            return;
        };
        // A fresh socket takes a line of greeting whole; one that does not is dropped.
        let line = greeting(&nonce);
        let greeted = conn.set_nonblocking(true).is_ok()
            && (&conn).write(&line).is_ok_and(|n| n == line.len());
        if !greeted {
            return;
        }
        let token = Token(self.next);
        self.next = self.next.wrapping_add(1) % (usize::MAX - 1);
        if let Err(e) = self.poll.registry().register(
            &mut SourceFd(&conn.as_raw_fd()),
            token,
            Interest::READABLE,
        ) {
            tracing::warn!(%from, error = %e, "cannot watch a new connection: dropped");
            return;
        }
        self.pending.insert(
            token,
            Pending {
                conn,
                from,
                accepted: Instant::now(),
                nonce,
                buf: Vec::new(),
            },
        );
        self.order.push_back(token);
        self.by_address.entry(ip).or_default().push_back(token);
    }

    /// Reads what `token` sent; judges its hello once the line is complete.
    fn read<T>(
        &mut self,
        token: Token,
        judge: &mut impl FnMut(Hello<'_>) -> Verdict<T>,
        admit: &mut impl FnMut(Admitted<T>),
        closed: &mut impl FnMut(SocketAddr, Closed),
    ) {
        let max = self.limits.max_hello_bytes;
        let Some(p) = self.pending.get_mut(&token) else {
            return;
        };
        let mut chunk = [0u8; READ_CHUNK];
        let mut eof = false;
        loop {
            match (&p.conn).read(&mut chunk) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    p.buf.extend_from_slice(&chunk[..n]);
                    if p.buf.len() > max || p.buf.contains(&b'\n') {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    eof = true;
                    break;
                }
            }
        }
        let Some(end) = p.buf.iter().position(|&b| b == b'\n') else {
            if p.buf.len() > max {
                self.close(token, Closed::TooLong, closed);
            } else if eof {
                // Gone before its hello was complete: nothing to answer.
                self.forget(token);
            }
            return;
        };
        if end > max {
            self.close(token, Closed::TooLong, closed);
            return;
        }
        let Some(p) = self.forget(token) else { return };
        let verdict = judge(Hello {
            line: &p.buf[..end],
            nonce: &p.nonce,
            from: p.from,
        });
        match verdict {
            Verdict::Refuse(reply) => {
                let _ = (&p.conn).write(&reply);
                let _ = p.conn.shutdown(std::net::Shutdown::Write);
            }
            Verdict::Admit(admitted) => {
                if p.buf.len() > end + 1 {
                    // A request before the hello's answer: the protocol waits for it.
                    tracing::warn!(from = %p.from, "bytes after the hello, before its answer: dropped");
                    return;
                }
                if p.conn.set_nonblocking(false).is_err() {
                    return;
                }
                admit(Admitted {
                    conn: p.conn,
                    from: p.from,
                    admitted,
                });
            }
        }
    }

    /// Closes the connections whose hello is overdue.
    fn expire(&mut self, closed: &mut impl FnMut(SocketAddr, Closed)) {
        let now = Instant::now();
        while let Some(t) = self.oldest() {
            let overdue = self
                .pending
                .get(&t)
                .is_some_and(|p| p.accepted + self.limits.hello_timeout <= now);
            if !overdue {
                return;
            }
            self.close(t, Closed::HelloTimeout, closed);
        }
    }

    /// Takes `token` out of the loop (unwatched, off the lists) and returns it.
    fn forget(&mut self, token: Token) -> Option<Pending> {
        let p = self.pending.remove(&token)?;
        let _ = self
            .poll
            .registry()
            .deregister(&mut SourceFd(&p.conn.as_raw_fd()));
        let ip = p.from.ip();
        if let Some(q) = self.by_address.get_mut(&ip) {
            q.retain(|&t| t != token);
            if q.is_empty() {
                self.by_address.remove(&ip);
            }
        }
        // `order` skips forgotten tokens lazily.
        Some(p)
    }

    /// Closes `token` for `why`, telling it first where that helps (a late or oversized
    /// hello hears the reason), and reports it.
    fn close(&mut self, token: Token, why: Closed, closed: &mut impl FnMut(SocketAddr, Closed)) {
        let Some(p) = self.forget(token) else { return };
        let reason = match why {
            Closed::HelloTimeout => format!(
                "no complete hello within {:?} (--hello-timeout)",
                self.limits.hello_timeout
            ),
            Closed::TooLong => format!(
                "hello longer than {} bytes (--max-request-bytes)",
                self.limits.max_hello_bytes
            ),
            Closed::Evicted => "closed to make room: too many connections waiting for their hello \
                 (--max-pending, --max-pending-per-address)"
                .to_owned(),
        };
        let mut line = serde_json::to_vec(&serde_json::json!({"ok": false, "error": reason}))
            .unwrap_or_default();
        line.push(b'\n');
        let _ = (&p.conn).write(&line);
        let _ = p.conn.shutdown(std::net::Shutdown::Write);
        closed(p.from, why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};

    fn limits() -> DoorLimits {
        DoorLimits {
            hello_timeout: Duration::from_secs(30),
            max_pending: 8,
            max_pending_per_address: 4,
            max_hello_bytes: 64,
        }
    }

    /// A door on loopback in a thread: admits hellos that say "yes", refuses others;
    /// admitted connections and closures are sent back.
    fn door(
        limits: DoorLimits,
    ) -> (
        SocketAddr,
        crossbeam_channel::Receiver<Admitted<String>>,
        crossbeam_channel::Receiver<(SocketAddr, Closed)>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (atx, arx) = crossbeam_channel::unbounded();
        let (ctx, crx) = crossbeam_channel::unbounded();
        let d = Door::new(l, limits).unwrap();
        std::thread::spawn(move || {
            let _ = d.run(
                |n| format!("hi {}\n", n.to_hex()).into_bytes(),
                |h| {
                    let line = String::from_utf8_lossy(h.line).into_owned();
                    if line == "yes" {
                        Verdict::Admit(line)
                    } else {
                        Verdict::Refuse(b"no\n".to_vec())
                    }
                },
                move |a| atx.send(a).unwrap(),
                move |from, why| ctx.send((from, why)).unwrap(),
                |_| {},
            );
        });
        (addr, arx, crx)
    }

    /// A connection that has read its greeting.
    fn greeted(addr: SocketAddr) -> (TcpStream, BufReader<TcpStream>) {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(
            line.starts_with("hi ") && line.len() == 3 + 32 + 1,
            "{line:?}"
        );
        (s, r)
    }

    #[test]
    fn a_hello_is_judged_and_the_admitted_connection_leaves_the_loop_blocking() {
        let (addr, admitted, _) = door(limits());
        let (mut s, mut r) = greeted(addr);
        s.write_all(b"yes\n").unwrap();
        let a = admitted.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(a.admitted, "yes");
        // Blocking again: a plain write and read work on it.
        (&a.conn).write_all(b"welcome\n").unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert_eq!(line, "welcome\n");
        // A refused hello hears the judge's line, then the close.
        let (mut s2, mut r2) = greeted(addr);
        s2.write_all(b"maybe\n").unwrap();
        let mut rest = String::new();
        r2.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "no\n");
        drop(s);
    }

    #[test]
    fn silent_connections_take_no_place_and_the_oldest_make_room() {
        let (addr, admitted, closed) = door(limits());
        // More silent connections from this address than its cap, and more than the door
        // holds in all.
        let silent: Vec<_> = (0..12).map(|_| greeted(addr)).collect();
        let evicted: Vec<_> = (0..8)
            .map(|_| closed.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert!(evicted.iter().all(|(_, why)| *why == Closed::Evicted));
        // The oldest went first, told why: the first connection is closed, the last is not.
        let mut silent = silent.into_iter();
        let (_, mut oldest) = silent.next().unwrap();
        let mut said = String::new();
        oldest.read_to_string(&mut said).unwrap();
        assert!(said.contains("--max-pending"), "{said}");
        let (_, newest) = silent.next_back().unwrap();
        newest
            .get_ref()
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut byte = [0u8; 1];
        let still_open = matches!(
            newest.get_ref().read(&mut byte),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut
        );
        assert!(still_open, "the newest silent connection is still pending");
        // A newcomer still gets in at once.
        let (mut s, _r) = greeted(addr);
        s.write_all(b"yes\n").unwrap();
        admitted
            .recv_timeout(Duration::from_secs(10))
            .expect("the newcomer is admitted beside the silent ones");
    }

    #[test]
    fn an_overdue_or_oversized_hello_is_closed_with_the_reason() {
        let (addr, _, closed) = door(DoorLimits {
            hello_timeout: Duration::from_millis(200),
            ..limits()
        });
        let (mut slow, mut r) = greeted(addr);
        slow.write_all(b"ye").unwrap();
        let (_, why) = closed.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(why, Closed::HelloTimeout);
        let mut said = String::new();
        r.read_to_string(&mut said).unwrap();
        assert!(said.contains("--hello-timeout"), "{said}");
        let (mut big, mut r) = greeted(addr);
        big.write_all(&[b'x'; 200]).unwrap();
        let (_, why) = closed.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(why, Closed::TooLong);
        let mut said = String::new();
        r.read_to_string(&mut said).unwrap();
        assert!(said.contains("longer than 64 bytes"), "{said}");
    }
}
