//! The handshake of a connection (see [`frame`](crate::frame)): the target's CHALLENGE with
//! a fresh nonce and its authentication mode, the initiator's HELLO that answers it with a
//! tag of the nonce keyed by the shared token and a fresh nonce of its own, the target's
//! check of that tag before it reads anything else, and its PROOF: the tag of the
//! initiator's nonce, which the initiator checks before it sends anything else. Each side
//! proves the token to the other; a token on one side only is refused by both.

use super::*;
use crate::auth::{self, Nonce};
use crate::frame::{
    AUTH_NONE, AUTH_TOKEN, CHALLENGE_VERSION, HELLO_CONTEXT, HELLO_NONCE_LEN, HELLO_TAG_LEN,
    MUTUAL_VERSION, PROOF_CONTEXT, PROTOCOL_VERSION,
};
use std::time::{Duration, Instant};

/// Where a connection is in its handshake.
pub(crate) enum Handshake {
    /// Accepted, and our CHALLENGE carried `nonce`: the HELLO's tag must prove `token` for
    /// it (the HELLO must say it has none when we have none).
    Challenged {
        nonce: Nonce,
        token: Option<Arc<str>>,
    },
    /// Opened by us: our HELLO (its payload, `hello`, without our nonce) waits for the
    /// target's CHALLENGE, which must come by `by` (set once the connection is made);
    /// nothing leaves before it.
    AwaitingChallenge {
        hello: Vec<u8>,
        token: Option<Arc<str>>,
        by: Option<Instant>,
    },
    /// Opened by us: our HELLO, carrying `nonce`, is queued first; nothing after it leaves
    /// until the target's PROOF has come (by `by`) and proved `token` for `nonce`.
    AwaitingProof {
        nonce: Nonce,
        token: Option<Arc<str>>,
        by: Option<Instant>,
    },
    /// Opened by us, and the target's mode is not ours: our HELLO (untagged) leaves so that
    /// the target can say why too, then the connection fails with `why` (by `by` at the
    /// latest).
    Refusing { why: TcpError, by: Option<Instant> },
    /// Over: the HELLO was verified (accepted), or the PROOF (opened).
    Done,
}

impl Conn {
    /// A connection we accepted: its CHALLENGE, carrying `nonce` (fresh for it), our mode
    /// and the incarnation we announce (`announce`, 0: none, in the header's `wr_id`), is
    /// queued; its HELLO must prove `token` for that nonce.
    pub fn challenging(
        stream: TcpStream,
        nonce: Nonce,
        token: Option<Arc<str>>,
        announce: u64,
    ) -> Conn {
        let mode = if token.is_some() {
            AUTH_TOKEN
        } else {
            AUTH_NONE
        };
        let mut c = Conn::new(stream, PeerId(0), Handshake::Challenged { nonce, token });
        let mut h = Header::challenge(&nonce, mode);
        h.wr_id = announce;
        c.queue(h, Payload::None);
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

    /// The connection is made (seen at `now`): the handshake must be over within `limit`.
    pub fn made(&mut self, now: Instant, limit: Duration) {
        self.connecting = None;
        if let Handshake::AwaitingChallenge { by, .. } = &mut self.handshake {
            *by = Some(now + limit);
        }
    }

    /// A connection we opened that is connected and past its handshake (the target proved
    /// itself).
    pub fn is_up(&self) -> bool {
        self.connecting.is_none() && !self.opening()
    }

    /// An accepted connection whose HELLO has not come yet.
    pub fn awaiting_hello(&self) -> bool {
        matches!(self.handshake, Handshake::Challenged { .. })
    }

    /// A connection we opened whose CHALLENGE has not come yet: it sends nothing.
    pub fn awaiting_challenge(&self) -> bool {
        matches!(self.handshake, Handshake::AwaitingChallenge { .. })
    }

    /// A connection we opened whose handshake is not over: only its HELLO may leave.
    pub fn opening(&self) -> bool {
        matches!(
            self.handshake,
            Handshake::AwaitingChallenge { .. }
                | Handshake::AwaitingProof { .. }
                | Handshake::Refusing { .. }
        )
    }

    /// How many frames at the front of the queue may leave now: none before the CHALLENGE,
    /// only our HELLO before the PROOF, all of them after.
    pub(super) fn writable_frames(&self) -> usize {
        match self.handshake {
            Handshake::AwaitingChallenge { .. } => 0,
            Handshake::AwaitingProof { .. } | Handshake::Refusing { .. } => self
                .out
                .front()
                .is_some_and(|f| f.head.first() == Some(&(Op::Hello as u8)))
                as usize,
            _ => self.out.len(),
        }
    }

    /// Whether bytes are queued that may leave now (the socket's writability matters).
    pub fn wants_write(&self) -> bool {
        self.writable_frames() > 0
    }

    /// Ends the handshake where it must end now (`limit` is the time it was given, for the
    /// message): [`TcpError::NoChallenge`] or [`TcpError::NoProof`] once overdue, and a
    /// refusal once our HELLO has left (or is overdue).
    pub fn check_handshake(&mut self, now: Instant, limit: Duration) -> Result<(), TcpError> {
        let refuse_now = match &self.handshake {
            Handshake::AwaitingChallenge { by: Some(by), .. } if now >= *by => {
                return Err(TcpError::NoChallenge(limit));
            }
            Handshake::AwaitingProof { by: Some(by), .. } if now >= *by => {
                return Err(TcpError::NoProof(limit));
            }
            Handshake::Refusing { by, .. } => {
                self.writable_frames() == 0 || by.is_some_and(|by| now >= by)
            }
            _ => return Ok(()),
        };
        if !refuse_now {
            return Ok(());
        }
        self.take_refusal().map_or(Ok(()), Err)
    }

    /// The refusal this connection was heading for, if it was (it then fails with that,
    /// whatever else went wrong meanwhile: the target closing on our untagged HELLO, say).
    pub fn take_refusal(&mut self) -> Option<TcpError> {
        if !matches!(self.handshake, Handshake::Refusing { .. }) {
            return None;
        }
        match std::mem::replace(&mut self.handshake, Handshake::Done) {
            Handshake::Refusing { why, .. } => Some(why),
            _ => None,
        }
    }

    /// A CHALLENGE arrived: checks it, and queues our HELLO ahead of every request posted
    /// meanwhile, with our nonce and the tag of the target's, or untagged toward a refusal
    /// when one side has a token and the other none.
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
        let Handshake::AwaitingChallenge { hello, token, by } =
            std::mem::replace(&mut self.handshake, Handshake::Done)
        else {
            return Err(TcpError::UnexpectedChallenge); // checked above
        };
        let theirs = Nonce::from_bytes(h.key_offset_bytes());
        // The target's incarnation, where it announces one (older builds send 0).
        self.announced = (h.wr_id != 0).then_some(h.wr_id);
        if h.code < MUTUAL_VERSION {
            // A target of version 4: it cannot prove the token. Without one, we answer as
            // a build of version 4 did (the target judges the version).
            if token.is_some() {
                return Err(TcpError::ChallengeNotMutual(h.code));
            }
            let mut hh = Header::new(Op::Hello, hello.len() as u64);
            hh.code = CHALLENGE_VERSION;
            self.queue_first(hh, Payload::Owned(hello));
            return Ok(());
        }
        // Its `code` (the target's version) is for the target to judge ours by beyond that:
        // a target that does not serve our version refuses our HELLO, and says why.
        let mine = Nonce::new().map_err(TcpError::Random)?;
        let mut payload = Vec::with_capacity(HELLO_NONCE_LEN + hello.len());
        payload.extend_from_slice(mine.as_bytes());
        payload.extend_from_slice(&hello);
        let mut hh = Header::new(Op::Hello, payload.len() as u64);
        hh.code = PROTOCOL_VERSION;
        hh.imm = if token.is_some() {
            AUTH_TOKEN
        } else {
            AUTH_NONE
        };
        self.handshake = match (h.imm, token) {
            (AUTH_TOKEN, Some(token)) => {
                hh.set_key_offset_bytes(&left(&auth::tag(&token, HELLO_CONTEXT, &theirs)));
                Handshake::AwaitingProof {
                    nonce: mine,
                    token: Some(token),
                    by,
                }
            }
            (AUTH_NONE, None) => Handshake::AwaitingProof {
                nonce: mine,
                token: None,
                by,
            },
            // No tag for a target without a token: it would be a tag of a nonce of its
            // choosing, for nothing.
            (AUTH_NONE, Some(_)) => Handshake::Refusing {
                why: TcpError::PeerHasNoToken,
                by,
            },
            (AUTH_TOKEN, None) => Handshake::Refusing {
                why: TcpError::NoTokenHere,
                by,
            },
            (mode, _) => return Err(TcpError::UnknownAuthMode(mode)),
        };
        self.queue_first(hh, Payload::Owned(payload));
        Ok(())
    }

    /// A PROOF arrived: it must prove our token for our HELLO's nonce (in constant time);
    /// without a token it only ends the handshake.
    pub(super) fn on_proof(&mut self, h: &Header) -> Result<(), TcpError> {
        let Handshake::AwaitingProof { nonce, token, .. } = &self.handshake else {
            return Err(TcpError::UnexpectedProof);
        };
        if h.flags != 0 {
            return Err(TcpError::UnexpectedFlags {
                op: h.op,
                flags: h.flags,
            });
        }
        if h.len != 0 {
            return Err(TcpError::ProofLength(h.len));
        }
        if let Some(token) = token
            && !auth::verify(token, PROOF_CONTEXT, nonce, &h.key_offset_bytes())
        {
            return Err(TcpError::ProofFailed);
        }
        self.handshake = Handshake::Done;
        Ok(())
    }

    /// Whether the HELLO `h` may be let in, judged before anything else of the peer is
    /// read: its version's (a token takes version 5 only), its authentication mode against
    /// ours, and its tag of our CHALLENGE's nonce (in constant time).
    pub(super) fn check_hello(&self, h: &Header) -> Result<(), TcpError> {
        let Handshake::Challenged { nonce, token } = &self.handshake else {
            return Err(TcpError::UnexpectedHello);
        };
        if h.code < MUTUAL_VERSION {
            // Versions that cannot check us are served only without a token.
            return match token {
                Some(_) => Err(TcpError::HelloNotMutual(h.code)),
                None => Ok(()),
            };
        }
        match (h.imm, token) {
            (AUTH_TOKEN, Some(token)) => {
                if auth::verify(token, HELLO_CONTEXT, nonce, &h.key_offset_bytes()) {
                    Ok(())
                } else {
                    Err(TcpError::AuthenticationFailed)
                }
            }
            (AUTH_NONE, None) => Ok(()),
            (AUTH_NONE, Some(_)) => Err(TcpError::PeerHasNoToken),
            (AUTH_TOKEN, None) => Err(TcpError::NoTokenHere),
            (mode, _) => Err(TcpError::UnknownAuthMode(mode)),
        }
    }

    /// The payload of a HELLO that was let in: its rail, instance and address; for version
    /// 5, after the initiator's nonce, whose tag our PROOF carries (queued now, behind the
    /// CHALLENGE and before anything else we send).
    pub(super) fn on_hello_payload(&mut self, data: &[u8]) -> (u32, u64, Vec<u8>) {
        let mut data = data;
        if self.peer_version.is_some_and(|v| v >= MUTUAL_VERSION) {
            let (theirs, rest) = data.split_at(HELLO_NONCE_LEN);
            let nonce = Nonce::from_bytes(theirs.try_into().expect("length checked"));
            let tag = match &self.handshake {
                Handshake::Challenged {
                    token: Some(token), ..
                } => left(&auth::tag(token, PROOF_CONTEXT, &nonce)),
                _ => [0u8; HELLO_TAG_LEN],
            };
            self.queue(Header::proof(&tag), Payload::None);
            data = rest;
        }
        self.handshake = Handshake::Done;
        let rail = u32::from_le_bytes(data[0..4].try_into().expect("length checked"));
        let instance = u64::from_le_bytes(data[4..12].try_into().expect("length checked"));
        (rail, instance, data[12..].to_vec())
    }
}

impl Conn {
    /// Before an accepted connection whose HELLO was refused closes: tells a peer of
    /// version 5 so (a NACK of code [`AUTH`](crate::frame::code::AUTH), written at once
    /// and without blocking: nothing else of ours is queued behind our CHALLENGE), and
    /// takes what the peer sent meanwhile (a bounded amount), so that closing does not
    /// reset the connection before the NACK is read. Best effort: a peer that reads
    /// nothing learns it from the close.
    pub fn tell_refusal(&mut self) {
        if !std::mem::take(&mut self.refused_hello) || !self.out.is_empty() {
            return;
        }
        let mut nack = Header::new(Op::Nack, 0);
        nack.code = crate::frame::code::AUTH;
        let mut stream = &self.stream;
        if std::io::Write::write_all(&mut stream, &nack.encode()).is_err() {
            return;
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let mut sink = [0u8; 4096];
        for _ in 0..16 {
            match (&self.stream).read(&mut sink) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
    }
}

/// The left [`HELLO_TAG_LEN`] bytes of a tag: what a HELLO or a PROOF carries.
fn left(tag: &[u8; auth::TAG_LEN]) -> [u8; HELLO_TAG_LEN] {
    let mut l = [0u8; HELLO_TAG_LEN];
    l.copy_from_slice(&tag[..HELLO_TAG_LEN]);
    l
}
