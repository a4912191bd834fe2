//! The control protocol spoken by hand, for the tests that play a hostile, old or relaying
//! peer: handshake frames, a fake target's listening socket, and a raw connection that
//! reads whole frames while the transport under test is polled.
#![allow(dead_code)]

use fabric_core::auth::{self, Nonce};
use std::io::{ErrorKind, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};
use transport_cuda_ipc::IpcAddress;
use transport_cuda_ipc::wire::{
    AUTH_NONE, AUTH_TOKEN, Challenge, HEADER_LEN, HELLO_CONTEXT, Header, Hello, Op, PROOF_CONTEXT,
    Proof, TAG_LEN, VERSION,
};

/// How long a test waits for a frame or a close before it fails.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// A frame as it came: header, payload, and its bytes (to replay them).
#[derive(Clone, Debug)]
pub struct Frame {
    /// The header.
    pub h: Header,
    /// The payload.
    pub payload: Vec<u8>,
    /// Header and payload as they were on the wire.
    pub bytes: Vec<u8>,
}

/// A connection spoken by hand: non-blocking, with what was read and not yet taken.
pub struct Raw {
    /// The socket.
    pub s: UnixStream,
    buf: Vec<u8>,
    eof: bool,
}

impl Raw {
    /// Wraps a connected socket.
    pub fn new(s: UnixStream) -> Raw {
        s.set_nonblocking(true).unwrap();
        Raw {
            s,
            buf: Vec::new(),
            eof: false,
        }
    }

    /// Connects to the transport whose address is `address`.
    pub fn connect(address: &[u8]) -> Raw {
        let a = IpcAddress::parse(address).unwrap();
        let sa = SocketAddr::from_abstract_name(a.socket.as_bytes()).unwrap();
        Raw::new(UnixStream::connect_addr(&sa).unwrap())
    }

    /// Sends `bytes` (the peer may have closed: a failed write is not the test's failure).
    pub fn send(&mut self, bytes: &[u8]) {
        self.s.set_nonblocking(false).unwrap();
        let _ = self.s.write_all(bytes);
        self.s.set_nonblocking(true).unwrap();
    }

    /// Reads what the socket has now; whether the peer has closed.
    fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 4096];
        loop {
            match self.s.read(&mut chunk) {
                Ok(0) => {
                    self.eof = true;
                    return true;
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return self.eof,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.eof = true;
                    return true;
                }
            }
        }
    }

    /// The next whole frame read so far, if any.
    fn take(&mut self) -> Option<Frame> {
        if self.buf.len() < HEADER_LEN {
            return None;
        }
        let h = Header::decode(self.buf[..HEADER_LEN].try_into().unwrap(), 1 << 30)
            .expect("the transport sent a bad header");
        let end = HEADER_LEN + h.len as usize;
        if self.buf.len() < end {
            return None;
        }
        let bytes: Vec<u8> = self.buf.drain(..end).collect();
        Some(Frame {
            h,
            payload: bytes[HEADER_LEN..].to_vec(),
            bytes,
        })
    }

    /// The next frame, calling `poll` (the transport under test) while none has come; `None`
    /// once the peer has closed without one.
    pub fn next(&mut self, mut poll: impl FnMut()) -> Option<Frame> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(f) = self.take() {
                return Some(f);
            }
            let closed = self.fill();
            if let Some(f) = self.take() {
                return Some(f);
            }
            if closed {
                return None;
            }
            assert!(Instant::now() < deadline, "no frame within {PATIENCE:?}");
            poll();
        }
    }

    /// Every frame until the peer closes, calling `poll` meanwhile.
    pub fn until_closed(&mut self, mut poll: impl FnMut()) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(f) = self.next(&mut poll) {
            frames.push(f);
        }
        frames
    }
}

/// The one frame in `bytes`.
pub fn frame_of(bytes: &[u8]) -> Frame {
    let h = Header::decode(bytes[..HEADER_LEN].try_into().unwrap(), 1 << 30).unwrap();
    assert_eq!(bytes.len(), HEADER_LEN + h.len as usize);
    Frame {
        h,
        payload: bytes[HEADER_LEN..].to_vec(),
        bytes: bytes.to_vec(),
    }
}

/// A HELLO of this version with `mode` and `tag`, from `from`, carrying `nonce`.
pub fn hello_with(from: &[u8], mode: u64, tag: [u8; TAG_LEN], nonce: Nonce) -> Vec<u8> {
    let mut v = Vec::new();
    Hello {
        version: VERSION,
        mode,
        nonce,
        tag,
        address: from,
    }
    .encode(&mut v);
    v
}

/// A HELLO that a target without a token lets in, whatever its CHALLENGE said (it looks at
/// no tag): it may be sent before the CHALLENGE is read.
pub fn hello(from: &[u8]) -> Vec<u8> {
    hello_with(from, AUTH_NONE, [0; TAG_LEN], Nonce::new().unwrap())
}

/// A HELLO that proves `token` for the CHALLENGE nonce `theirs`, with a fresh nonce of ours
/// (returned, for the PROOF).
pub fn proving_hello(from: &[u8], token: &str, theirs: &Nonce) -> (Vec<u8>, Nonce) {
    let ours = Nonce::new().unwrap();
    let tag = auth::tag(token, HELLO_CONTEXT, theirs);
    (hello_with(from, AUTH_TOKEN, tag, ours), ours)
}

/// A HELLO of protocol version 2: the initiator's address only, sent at once.
pub fn old_hello(from: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    Header::new(Op::Hello, 0, 2, from.len() as u64).encode(&mut v);
    v.extend_from_slice(from);
    v
}

/// A CHALLENGE of this version with `mode` and a fresh nonce (returned).
pub fn challenge(mode: u64) -> (Vec<u8>, Nonce) {
    let nonce = Nonce::new().unwrap();
    let mut v = Vec::new();
    Challenge {
        version: VERSION,
        mode,
        nonce,
    }
    .encode(&mut v);
    (v, nonce)
}

/// The PROOF of `token` (zeros without one) for the HELLO nonce `theirs`.
pub fn proof(token: Option<&str>, theirs: &Nonce) -> Vec<u8> {
    let tag = token.map_or([0; TAG_LEN], |t| auth::tag(t, PROOF_CONTEXT, theirs));
    let mut v = Vec::new();
    Proof { tag }.encode(&mut v);
    v
}

/// The challenge nonce of a CHALLENGE frame.
pub fn nonce_of(f: &Frame) -> Nonce {
    assert_eq!(f.h.op, Op::Challenge, "{f:?}");
    Challenge::decode(&f.h, &f.payload).unwrap().nonce
}

/// The nonce of a HELLO frame.
pub fn hello_nonce(f: &Frame) -> Nonce {
    assert_eq!(f.h.op, Op::Hello, "{f:?}");
    Hello::decode(&f.h, &f.payload).unwrap().nonce
}

/// A listening socket named as a transport's, and the address that names it: a fake
/// target.
pub fn fake_listener() -> (UnixListener, Vec<u8>) {
    let name = format!(
        "xfer-ipc-{}-{:016x}",
        std::process::id(),
        fabric_core::random_u64()
    );
    let l =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let addr = IpcAddress {
        boot_id: transport_cuda_ipc::boot_id().unwrap(),
        pid: std::process::id(),
        device: 0,
        socket: name,
    };
    (l, addr.encode())
}
