//! One control connection: a non-blocking Unix stream with an input buffer that yields whole
//! frames and an output buffer that drains as the socket accepts bytes.

use crate::error::ConnError;
use crate::wire::{HEADER_LEN, Header, WireError};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;

/// Bytes read per `read` call at most.
const READ_CHUNK: usize = 256 << 10;

/// What reading found.
pub enum ReadOutcome {
    /// Nothing more for now.
    Idle,
    /// The peer closed the connection, or it failed.
    Closed(ConnError),
}

/// A framed, buffered connection.
pub struct FrameConn {
    pub stream: UnixStream,
    inb: Vec<u8>,
    start: usize,
    out: Vec<u8>,
    sent: usize,
    max_payload: u64,
}

impl FrameConn {
    /// Wraps a connected stream (made non-blocking here).
    pub fn new(stream: UnixStream, max_payload: u64) -> std::io::Result<FrameConn> {
        stream.set_nonblocking(true)?;
        Ok(FrameConn {
            stream,
            inb: Vec::new(),
            start: 0,
            out: Vec::new(),
            sent: 0,
            max_payload,
        })
    }

    /// The output buffer: append encoded frames here.
    pub fn out(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Sets the longest payload a frame may announce (small until the handshake is over).
    pub fn set_max_payload(&mut self, max_payload: u64) {
        self.max_payload = max_payload;
    }

    /// Whether bytes wait to be written.
    pub fn has_output(&self) -> bool {
        self.sent < self.out.len()
    }

    /// Reads what the socket has (up to `budget` bytes).
    pub fn fill(&mut self, budget: usize) -> ReadOutcome {
        if self.start > 0 && self.start == self.inb.len() {
            self.inb.clear();
            self.start = 0;
        }
        let mut got = 0;
        while got < budget {
            if self.start > 0 && self.start >= self.inb.len() / 2 {
                self.inb.drain(..self.start);
                self.start = 0;
            }
            let len = self.inb.len();
            self.inb.resize(len + READ_CHUNK, 0);
            match self.stream.read(&mut self.inb[len..]) {
                Ok(0) => {
                    self.inb.truncate(len);
                    return ReadOutcome::Closed(ConnError::PeerClosed);
                }
                Ok(n) => {
                    self.inb.truncate(len + n);
                    got += n;
                    if n < READ_CHUNK {
                        return ReadOutcome::Idle;
                    }
                }
                Err(e) => {
                    self.inb.truncate(len);
                    match e.kind() {
                        ErrorKind::WouldBlock => return ReadOutcome::Idle,
                        ErrorKind::Interrupted => continue,
                        _ => return ReadOutcome::Closed(ConnError::Read(e)),
                    }
                }
            }
        }
        ReadOutcome::Idle
    }

    /// The next whole frame in the input buffer, if one has arrived. The payload is copied
    /// out so the caller may keep it while it handles the frame.
    pub fn next_frame(&mut self) -> Result<Option<(Header, Vec<u8>)>, WireError> {
        let avail = &self.inb[self.start..];
        if avail.len() < HEADER_LEN {
            return Ok(None);
        }
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(&avail[..HEADER_LEN]);
        let h = Header::decode(&hb, self.max_payload)?;
        // h.len <= max_payload, which fits in memory (it was configured as a usize).
        let total = HEADER_LEN + h.len as usize;
        if avail.len() < total {
            return Ok(None);
        }
        let payload = avail[HEADER_LEN..total].to_vec();
        self.start += total;
        Ok(Some((h, payload)))
    }

    /// Gives back the last frame [`next_frame`](Self::next_frame) returned (`len` bytes,
    /// header included), to be returned again later. Nothing may be read in between.
    pub fn unread(&mut self, len: usize) {
        self.start = self.start.saturating_sub(len);
    }

    /// Writes what the socket takes. An error means the connection is gone.
    pub fn flush(&mut self) -> Result<(), ConnError> {
        while self.sent < self.out.len() {
            match self.stream.write(&self.out[self.sent..]) {
                Ok(0) => return Err(ConnError::StoppedReading),
                Ok(n) => self.sent += n,
                Err(e) => match e.kind() {
                    ErrorKind::WouldBlock => break,
                    ErrorKind::Interrupted => continue,
                    _ => return Err(ConnError::Write(e)),
                },
            }
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        } else if self.sent > (1 << 20) {
            self.out.drain(..self.sent);
            self.sent = 0;
        }
        Ok(())
    }
}
