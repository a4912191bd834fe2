//! Helpers shared by the hostile-input tests: transports polled from the test thread, and a
//! raw TCP socket that speaks the wire format by hand (as a hostile client, or as a hostile
//! target answering a real initiator).
//!
//! Nothing here sleeps to synchronise: every wait polls the transports under test until a
//! condition holds, and fails at a deadline.
#![allow(dead_code)]

use fabric_core::testing::{Canaried, pattern};
use fabric_core::{Access, Completion, OpKind, PostOutcome, Transport, WorkRequestId};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use transport_tcp::auth::{self, Nonce};
use transport_tcp::frame::{
    AUTH_NONE, AUTH_TOKEN, FLAG_IMM, HEADER_LEN, HELLO_CONTEXT, HELLO_NONCE_LEN, HELLO_TAG_LEN,
    Header, MUTUAL_VERSION, Op, PROOF_CONTEXT, PROTOCOL_VERSION,
};
use transport_tcp::{TcpConfig, TcpTransport};

/// The longest any one wait may take.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// Fails the test once `TIMEOUT` has passed.
pub struct Deadline {
    at: Instant,
    what: String,
}

impl Deadline {
    pub fn new(what: impl Into<String>) -> Deadline {
        Deadline::within(TIMEOUT, what)
    }
    pub fn within(limit: Duration, what: impl Into<String>) -> Deadline {
        Deadline {
            at: Instant::now() + limit,
            what: what.into(),
        }
    }
    pub fn passed(&self) -> bool {
        Instant::now() >= self.at
    }
    pub fn check(&self) {
        assert!(
            Instant::now() < self.at,
            "timed out waiting for {}",
            self.what
        );
    }
}

/// A transport polled from the test thread, and the completions it reported.
pub struct Node {
    pub t: TcpTransport,
    pub done: Vec<Completion>,
}

impl Node {
    pub fn new(cfg: TcpConfig) -> Node {
        Node {
            t: TcpTransport::new(cfg).expect("listen on 127.0.0.1"),
            done: Vec::new(),
        }
    }

    /// A target with a 1 MiB message limit, so that "too long" is cheap to say.
    pub fn small() -> Node {
        Node::new(small_config())
    }

    /// One round of progress: wait (at most 1 ms) for a socket to be ready, then poll.
    pub fn step(&mut self) {
        self.t.wait(Duration::from_millis(1)).expect("wait");
        self.t.poll(&mut self.done).expect("poll");
    }

    /// Polls until `cond` holds.
    pub fn until(&mut self, what: &str, mut cond: impl FnMut(&Node) -> bool) {
        let d = Deadline::new(what);
        while !cond(self) {
            d.check();
            self.step();
        }
    }

    /// Completions of peers' writes with immediate data.
    pub fn remote_writes(&self) -> Vec<&Completion> {
        self.done
            .iter()
            .filter(|c| c.op == OpKind::RemoteWrite)
            .collect()
    }
}

/// 1 MiB messages, otherwise the defaults.
pub fn small_config() -> TcpConfig {
    TcpConfig {
        max_msg_size: 1 << 20,
        ..TcpConfig::default()
    }
}

/// The byte strings one after the other.
pub fn concat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// The frame `h` followed by `payload`.
pub fn frame(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// A HELLO frame with a fresh instance id, as a peer's first frame: protocol version 0
/// (no SEND credit) and a zero tag, which a target without a token takes whatever its
/// CHALLENGE (it need not be read first).
pub fn hello_frame() -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&0u32.to_le_bytes());
    let instance = 0x4057_11E0_0000_0000 | NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed);
    p.extend_from_slice(&instance.to_le_bytes());
    p.extend_from_slice(b"tcp://127.0.0.1:1");
    frame(Header::new(Op::Hello, p.len() as u64), &p)
}

/// [`hello_frame`] of protocol `version`, carrying the tag that proves `token` for `nonce`
/// (a CHALLENGE's), as a real initiator's HELLO does; from version 5 on, with the
/// initiator's own nonce `mine` first in its payload and the token's mode.
pub fn tagged_hello_frame(version: u8, token: &str, nonce: &Nonce) -> Vec<u8> {
    mutual_hello_frame(
        version,
        Some(token),
        nonce,
        &Nonce::new().expect("random nonce"),
    )
}

/// A HELLO of `version` as an initiator with `token` (or none) sends it: the tag of the
/// target's `nonce` (zeros without a token) and, from version 5 on, its own nonce `mine`
/// before the rail, instance and address, and its authentication mode.
pub fn mutual_hello_frame(
    version: u8,
    token: Option<&str>,
    nonce: &Nonce,
    mine: &Nonce,
) -> Vec<u8> {
    let plain = hello_frame();
    let mut h = Header::decode(plain[..HEADER_LEN].try_into().expect("40 bytes")).expect("a HELLO");
    let mut payload = Vec::new();
    if version >= MUTUAL_VERSION {
        payload.extend_from_slice(mine.as_bytes());
        h.imm = if token.is_some() {
            AUTH_TOKEN
        } else {
            AUTH_NONE
        };
    }
    payload.extend_from_slice(&plain[HEADER_LEN..]);
    h.code = version;
    h.len = payload.len() as u64;
    if let Some(token) = token {
        let tag = auth::tag(token, HELLO_CONTEXT, nonce);
        h.set_key_offset_bytes(tag[..HELLO_TAG_LEN].try_into().expect("16 bytes"));
    }
    frame(h, &payload)
}

/// A CHALLENGE with a fresh nonce from a target without a token, as a target's first frame.
pub fn challenge_frame() -> Vec<u8> {
    Header::challenge(&Nonce::new().expect("random nonce"), AUTH_NONE)
        .encode()
        .to_vec()
}

/// The PROOF a target with `token` (zeros without one) answers a HELLO of version 5 with:
/// the tag of the initiator's nonce, the first bytes of the HELLO's `payload`.
pub fn proof_frame(token: Option<&str>, hello_payload: &[u8]) -> Vec<u8> {
    let nonce = Nonce::from_bytes(
        hello_payload[..HELLO_NONCE_LEN]
            .try_into()
            .expect("a HELLO of version 5 begins with a nonce"),
    );
    let mut tag = [0u8; HELLO_TAG_LEN];
    if let Some(token) = token {
        tag.copy_from_slice(&auth::tag(token, PROOF_CONTEXT, &nonce)[..HELLO_TAG_LEN]);
    }
    Header::proof(&tag).encode().to_vec()
}

/// The handshake of a fake target without a token on `fake` (a connection a real initiator
/// opened): its CHALLENGE, the initiator's HELLO taken in (returned, header and payload),
/// and its PROOF, after which the initiator sends its requests.
pub fn fake_target_handshake(fake: &mut Raw, mut step: impl FnMut()) -> (Header, Vec<u8>) {
    fake.send_ok(&challenge_frame(), &mut step);
    let h = fake.read_header(&mut step);
    assert_eq!((h.op, h.code), (Op::Hello, PROTOCOL_VERSION), "{h:?}");
    let payload = fake.read_bytes(h.len as usize, &mut step);
    fake.send_ok(&proof_frame(None, &payload), &mut step);
    (h, payload)
}

/// A WRITE header.
pub fn write_header(key: u64, offset: u64, len: u64, imm: Option<u32>, wr_id: u64) -> Header {
    let mut h = Header::new(Op::Write, len);
    h.key = key;
    h.offset = offset;
    h.wr_id = wr_id;
    if let Some(v) = imm {
        h.flags = FLAG_IMM;
        h.imm = v;
    }
    h
}

/// A single (unbatched) WRITE frame.
pub fn write_frame(key: u64, offset: u64, data: &[u8], imm: Option<u32>, wr_id: u64) -> Vec<u8> {
    frame(
        write_header(key, offset, data.len() as u64, imm, wr_id),
        data,
    )
}

/// A BATCH of `entries`: the BATCH header, every entry's header, then the payloads in order.
pub fn batch_frame(entries: &[(Header, Vec<u8>)]) -> Vec<u8> {
    let mut v = Header::new(Op::Batch, entries.len() as u64)
        .encode()
        .to_vec();
    for (h, _) in entries {
        v.extend_from_slice(&h.encode());
    }
    for (_, p) in entries {
        v.extend_from_slice(p);
    }
    v
}

/// A SEND frame.
pub fn send_frame(data: &[u8], imm: Option<u32>, wr_id: u64) -> Vec<u8> {
    let mut h = Header::new(Op::Send, data.len() as u64);
    h.wr_id = wr_id;
    if let Some(v) = imm {
        h.flags = FLAG_IMM;
        h.imm = v;
    }
    frame(h, data)
}

/// One request's answer, from the cumulative ACKs and the NACKs of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Ack,
    Nack(Header),
}

impl Answer {
    /// The NACK header, checking its code.
    pub fn nack(&self, code: u8, what: &str) -> Header {
        match self {
            Answer::Nack(h) if h.code == code => *h,
            other => panic!("{what}: expected a NACK with code {code}, got {other:?}"),
        }
    }
}

/// A raw, non-blocking TCP socket speaking the wire format by hand.
pub struct Raw {
    pub s: TcpStream,
    /// Connected to a target, whose first frame, its CHALLENGE, is taken into `challenge`
    /// as it arrives (it is not in `rx`): what a test reads are the answers to its frames.
    takes_challenge: bool,
    /// The CHALLENGE the target sent (connections to a target).
    pub challenge: Option<Header>,
    /// Bytes received and not consumed yet.
    pub rx: Vec<u8>,
    /// Bytes received in all (but the CHALLENGE: they count what answers us).
    pub received: usize,
    /// The other side closed (EOF) or reset the connection.
    pub closed: bool,
}

fn broken(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
    )
}

impl Raw {
    /// Connects to `t`'s listener.
    pub fn connect(t: &TcpTransport) -> Raw {
        Raw::connect_with(t.local_addr(), None)
    }

    /// Connects to `to`, with socket buffers of `buf` bytes if given.
    pub fn connect_with(to: SocketAddr, buf: Option<usize>) -> Raw {
        let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).expect("socket");
        if let Some(n) = buf {
            s.set_send_buffer_size(n).expect("SO_SNDBUF");
            s.set_recv_buffer_size(n).expect("SO_RCVBUF");
        }
        s.connect(&SockAddr::from(to)).expect("connect");
        let mut r = Raw::from_stream(s.into());
        r.takes_challenge = true;
        r
    }

    /// Wraps an accepted or connected stream (posing as a target: it sends its CHALLENGE
    /// itself, if any).
    pub fn from_stream(s: TcpStream) -> Raw {
        s.set_nodelay(true).expect("TCP_NODELAY");
        s.set_nonblocking(true).expect("non-blocking");
        Raw {
            s,
            takes_challenge: false,
            challenge: None,
            rx: Vec::new(),
            received: 0,
            closed: false,
        }
    }

    /// Writes what the socket takes now: `Ok(0)` when it is full, `Err` when the other side
    /// is gone.
    pub fn try_write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if bytes.is_empty() {
            return Ok(0);
        }
        match self.s.write(bytes) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                Ok(0)
            }
            Err(e) => Err(e),
        }
    }

    /// Writes all of `bytes`, driving `step` whenever the socket is full. `Err` if the other
    /// side closed the connection meanwhile.
    pub fn send(&mut self, bytes: &[u8], mut step: impl FnMut()) -> std::io::Result<()> {
        let d = Deadline::new("the raw socket to take our bytes");
        let mut off = 0;
        while off < bytes.len() {
            match self.try_write(&bytes[off..]) {
                Ok(0) => {
                    self.pump();
                    step();
                    d.check();
                }
                Ok(n) => off += n,
                Err(e) if broken(&e) => return Err(e),
                Err(e) => panic!("raw write: {e}"),
            }
        }
        Ok(())
    }

    /// Like [`Raw::send`], for bytes the other side must accept.
    pub fn send_ok(&mut self, bytes: &[u8], step: impl FnMut()) {
        self.send(bytes, step)
            .expect("the other side closed the connection while we wrote");
    }

    /// Reads whatever has arrived.
    pub fn pump(&mut self) {
        let mut buf = [0u8; 64 * 1024];
        while !self.closed {
            match self.s.read(&mut buf) {
                Ok(0) => self.closed = true,
                Ok(n) => {
                    self.rx.extend_from_slice(&buf[..n]);
                    self.received += n;
                    self.take_challenge();
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if broken(&e) => self.closed = true,
                Err(e) => panic!("raw read: {e}"),
            }
        }
    }

    /// Takes the target's CHALLENGE off the front of `rx`, once it is all there.
    fn take_challenge(&mut self) {
        if !self.takes_challenge || self.challenge.is_some() || self.rx.len() < HEADER_LEN {
            return;
        }
        let b: Vec<u8> = self.rx.drain(..HEADER_LEN).collect();
        self.received -= HEADER_LEN;
        let h = Header::decode(b[..].try_into().expect("40 bytes")).expect("a header");
        assert_eq!(
            (h.op, h.len, h.flags),
            (Op::Challenge, 0, 0),
            "a target's first frame: {h:?}"
        );
        self.challenge = Some(h);
    }

    /// Waits for the target's CHALLENGE and returns its nonce.
    pub fn nonce(&mut self, mut step: impl FnMut()) -> Nonce {
        let d = Deadline::new("the target's CHALLENGE");
        loop {
            self.pump();
            if let Some(h) = self.challenge {
                return Nonce::from_bytes(h.key_offset_bytes());
            }
            assert!(!self.closed, "the connection closed before its CHALLENGE");
            step();
            d.check();
        }
    }

    /// Waits for `n` bytes and takes them.
    pub fn read_bytes(&mut self, n: usize, mut step: impl FnMut()) -> Vec<u8> {
        let d = Deadline::new(format!("{n} bytes from the other side"));
        loop {
            self.pump();
            if self.rx.len() >= n {
                return self.rx.drain(..n).collect();
            }
            assert!(
                !self.closed,
                "the connection closed with {} of {n} bytes received",
                self.rx.len()
            );
            step();
            d.check();
        }
    }

    /// Waits for one header and decodes it.
    pub fn read_header(&mut self, step: impl FnMut()) -> Header {
        let b = self.read_bytes(HEADER_LEN, step);
        Header::decode(b[..].try_into().expect("40 bytes")).expect("well-formed header")
    }

    /// Waits for the answers to the next `n` requests (ACK `k` counts for `k` requests).
    pub fn answers(&mut self, n: usize, mut step: impl FnMut()) -> Vec<Answer> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let h = self.read_header(&mut step);
            match h.op {
                Op::Ack => {
                    assert!(
                        out.len() as u64 + h.len <= n as u64,
                        "ACK for {} requests with {} unanswered",
                        h.len,
                        n - out.len()
                    );
                    out.extend(std::iter::repeat_n(Answer::Ack, h.len as usize));
                }
                Op::Nack => out.push(Answer::Nack(h)),
                op => panic!("{op:?} frame where an answer was expected"),
            }
        }
        out
    }

    /// Drives `step` until the other side closes the connection (EOF or reset).
    pub fn expect_closed(&mut self, what: &str, mut step: impl FnMut()) {
        let d = Deadline::new(format!("the connection to close after {what}"));
        loop {
            self.pump();
            if self.closed {
                return;
            }
            step();
            d.check();
        }
    }

    /// Half-closes: the other side reads EOF, we can still read.
    pub fn shutdown_write(&self) {
        // The other side may have closed first; either way no more bytes leave.
        let _ = self.s.shutdown(Shutdown::Write);
    }
}

/// A fresh, real initiator writes `len` pattern bytes into `dst` at `offset` of `target`,
/// and they land: the target still serves well-behaved peers.
pub fn honest_write(target: &mut Node, dst: &Canaried, offset: u64, len: u64, seed: u64) {
    let mut a = Node::new(TcpConfig::default());
    let src = Canaried::new(&mut a.t, len.max(1), Access::NONE, 0);
    let data = pattern(seed, len as usize);
    src.write(0, &data);
    let peer = a.t.add_peer(&target.t.address()).expect("add_peer");
    let d = Deadline::new("an honest peer's write");
    loop {
        match a
            .t
            .post_write(
                peer,
                WorkRequestId(seed),
                src.local(0, len),
                dst.remote(offset, len),
                None,
            )
            .expect("post_write")
        {
            PostOutcome::Posted => break,
            PostOutcome::NoRoom => {
                a.step();
                target.step();
                d.check();
            }
        }
    }
    while a.done.is_empty() {
        a.step();
        target.step();
        d.check();
    }
    let c = a.done.remove(0);
    assert_eq!(c.wr_id, WorkRequestId(seed));
    assert_eq!(c.result, Ok(len), "an honest write after hostile input");
    assert!(
        dst.read(offset, len as usize) == data,
        "the honest write did not land"
    );
    dst.assert_canaries();
}

/// Writes `n` pages of `page` bytes from `src` (page i) to `dst` (page `i * stride % n`)
/// through the pair, the last with immediate data 99, then checks the completions, the
/// immediate data and every byte. Data goes in and out with the batched copies, so regions
/// without a host pointer (GPU memory) work too.
pub fn scattered_pages(
    p: &mut fabric_core::testing::Pair<TcpTransport>,
    src: std::sync::Arc<dyn fabric_core::MemoryRegion>,
    dst: std::sync::Arc<dyn fabric_core::MemoryRegion>,
    page: u64,
    n: u64,
    stride: u64,
) {
    use fabric_core::{LocalSlice, RemoteSlice};
    let data = pattern(11, (page * n) as usize);
    src.write_many_from_host(&[(0, &data[..])]).unwrap();
    let s = p.a.register(src, Access::NONE).unwrap();
    let d = p.b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = p.b_at_a;
    let target = |i: u64| (i * stride) % n;
    for i in 0..n {
        let imm = (i == n - 1).then_some(99);
        let src_slice = LocalSlice {
            key: s.local,
            offset: i * page,
            len: page,
        };
        let dst_slice = RemoteSlice {
            region: d.remote,
            offset: target(i) * page,
            len: page,
        };
        p.post_a(|t| t.post_write(peer, WorkRequestId(i), src_slice, dst_slice, imm));
    }
    let done = p.take_a(n as usize, "write completions");
    assert!(done.iter().all(|c| c.result == Ok(page)), "{done:?}");
    let r = p.take_b(1, "imm").remove(0);
    assert_eq!((r.op, r.imm), (OpKind::RemoteWrite, Some(99)));
    let mut got = vec![0u8; (page * n) as usize];
    dst.read_many_to_host(&mut [(0, &mut got[..])]).unwrap();
    for i in 0..n {
        let j = target(i) as usize;
        let page = page as usize;
        assert!(
            got[j * page..(j + 1) * page] == data[i as usize * page..(i as usize + 1) * page],
            "page {i} -> {j} differs"
        );
    }
}
