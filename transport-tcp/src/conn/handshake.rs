//! The handshake of a connection (see [`frame`](crate::frame)): the target's CHALLENGE with
//! a fresh nonce, the initiator's HELLO that answers it with a tag of the nonce keyed by the
//! shared token, and the target's check of that tag before it reads anything else.

use super::*;
use crate::auth::{self, Nonce};
use crate::frame::{HELLO_CONTEXT, HELLO_TAG_LEN, PROTOCOL_VERSION};
use std::time::{Duration, Instant};

/// Where a connection is in its handshake.
pub(crate) enum Handshake {
    /// Accepted, and our CHALLENGE carried `nonce`: the HELLO's tag must prove `token` for
    /// it (any tag does when we have no token).
    Challenged {
        nonce: Nonce,
        token: Option<Arc<str>>,
    },
    /// Opened by us: our HELLO (its payload, `hello`) waits for the target's CHALLENGE,
    /// which must come by `by` (set once the connection is made); nothing leaves before it.
    AwaitingChallenge {
        hello: Vec<u8>,
        token: Option<Arc<str>>,
        by: Option<Instant>,
    },
    /// Over: the HELLO was verified (accepted), or queued (opened).
    Done,
}

impl Conn {
    /// A connection we accepted: its CHALLENGE, carrying `nonce` (fresh for it), is queued;
    /// its HELLO must prove `token` for that nonce.
    pub fn challenging(stream: TcpStream, nonce: Nonce, token: Option<Arc<str>>) -> Conn {
        let mut c = Conn::new(stream, PeerId(0), Handshake::Challenged { nonce, token });
        c.queue(Header::challenge(&nonce), Payload::None);
        c
    }

    /// A connection we opened (or are opening) for `peer`: the HELLO with payload `hello`
    /// leaves once the target's CHALLENGE has come, with a tag of its nonce keyed by
    /// `token` (zeros without one).
    pub fn initiating(
        stream: TcpStream,
        peer: PeerId,
        hello: Vec<u8>,
        token: Option<Arc<str>>,
    ) -> Conn {
        Conn::new(
            stream,
            peer,
            Handshake::AwaitingChallenge {
                hello,
                token,
                by: None,
            },
        )
    }

    /// The connection is made (seen at `now`): the CHALLENGE must come within `limit`.
    pub fn made(&mut self, now: Instant, limit: Duration) {
        self.connecting = None;
        if let Handshake::AwaitingChallenge { by, .. } = &mut self.handshake {
            *by = Some(now + limit);
        }
    }

    /// A connection we opened that is connected and past its handshake (our HELLO queued).
    pub fn is_up(&self) -> bool {
        self.connecting.is_none() && !self.awaiting_challenge()
    }

    /// An accepted connection whose HELLO has not come yet.
    pub fn awaiting_hello(&self) -> bool {
        matches!(self.handshake, Handshake::Challenged { .. })
    }

    /// A connection we opened whose CHALLENGE has not come yet: it sends nothing.
    pub fn awaiting_challenge(&self) -> bool {
        matches!(self.handshake, Handshake::AwaitingChallenge { .. })
    }

    /// [`TcpError::NoChallenge`] once a CHALLENGE we wait for is overdue (`limit` is the
    /// time it was given, for the message).
    pub fn check_challenge_due(&self, now: Instant, limit: Duration) -> Result<(), TcpError> {
        match self.handshake {
            Handshake::AwaitingChallenge { by: Some(by), .. } if now >= by => {
                Err(TcpError::NoChallenge(limit))
            }
            _ => Ok(()),
        }
    }

    /// A CHALLENGE arrived: checks it, and queues our HELLO with the tag of its nonce ahead
    /// of every request posted meanwhile.
    pub(super) fn on_challenge(&mut self, h: &Header) -> Result<(), TcpError> {
        if !self.awaiting_challenge() {
            return Err(TcpError::UnexpectedChallenge);
        }
        if h.flags != 0 {
            return Err(TcpError::UnexpectedFlags {
                op: h.op,
                flags: h.flags,
            });
        }
        if h.len != 0 {
            return Err(TcpError::ChallengeLength(h.len));
        }
        // Its `code` (the target's version) is for the target to judge ours by: a target
        // that does not serve our version refuses our HELLO, and says why.
        let Handshake::AwaitingChallenge { hello, token, .. } =
            std::mem::replace(&mut self.handshake, Handshake::Done)
        else {
            return Err(TcpError::UnexpectedChallenge); // checked above
        };
        let nonce = Nonce::from_bytes(h.key_offset_bytes());
        let mut hh = Header::new(Op::Hello, hello.len() as u64);
        hh.code = PROTOCOL_VERSION;
        if let Some(token) = token {
            let tag = auth::tag(&token, HELLO_CONTEXT, &nonce);
            let mut left = [0u8; HELLO_TAG_LEN];
            left.copy_from_slice(&tag[..HELLO_TAG_LEN]);
            hh.set_key_offset_bytes(&left);
        }
        self.queue_first(hh, Payload::Owned(hello));
        Ok(())
    }

    /// Whether the HELLO `h` proves our token for the nonce of our CHALLENGE (in constant
    /// time); any HELLO does when we have no token.
    pub(super) fn check_hello_tag(&self, h: &Header) -> Result<(), TcpError> {
        match &self.handshake {
            Handshake::Challenged {
                nonce,
                token: Some(token),
            } if !auth::verify(token, HELLO_CONTEXT, nonce, &h.key_offset_bytes()) => {
                Err(TcpError::AuthenticationFailed)
            }
            _ => Ok(()),
        }
    }
}
