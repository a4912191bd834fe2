//! Authentication of the raw TCP streams `serve` opens beside a control connection (the
//! `sink` of `bench --baseline`, the `echo` of `bench --latency`), both ways: the server
//! greets each accepted stream with its mode (1 byte: 1 with a token, 0 without) and a fresh
//! nonce ([`NONCE_LEN`] bytes); the client answers with its mode, the HMAC-SHA256 tag of
//! that nonce keyed by the shared token ([`TAG_LEN`] bytes; zeros without a token, or when
//! the modes differ) and a fresh nonce of its own; the server checks the modes and the tag
//! (in constant time) and answers with the tag of the client's nonce in the other direction
//! (zeros without a token), which the client checks. A token on one side only fails on
//! both ([`RawAuthError`], the source of the [`std::io::Error`] either side returns). The
//! exchange happens before the client's clock starts.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use transport_tcp::auth::{Nonce, TAG_LEN};

/// Bytes of the nonce a stream is greeted with.
pub const NONCE_LEN: usize = transport_tcp::auth::NONCE_LEN;
/// What the tags of `sink` streams are HMACs of, beside the nonce (client to server; the
/// server's answer adds [`SERVER_SUFFIX`]).
pub const SINK_CONTEXT: &str = "xfer sink stream v3";
/// What the tags of `echo` streams are HMACs of, beside the nonce.
pub const ECHO_CONTEXT: &str = "xfer echo stream v3";
/// What the server's answer adds to a stream's context: the other direction.
pub const SERVER_SUFFIX: &str = ": server to client";

/// Why a raw stream's authentication failed (the source of the `std::io::Error` of kind
/// `PermissionDenied` that [`challenge`] and [`answer`] return).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RawAuthError {
    /// The other side has no token and this side has one.
    #[error("authentication refused: the peer has no --auth-token and this side has one")]
    PeerHasNoToken,
    /// The other side has a token and this side has none.
    #[error("authentication refused: the peer has an --auth-token and this side has none")]
    NoTokenHere,
    /// The client's tag does not prove the server's token (another token, or a replay).
    #[error("authentication failed: the client does not prove this side's --auth-token")]
    ClientFailed,
    /// The server's tag does not prove the client's token (another token, or not the
    /// server we meant).
    #[error("authentication failed: the server does not prove this side's --auth-token")]
    ServerFailed,
    /// A mode byte that is neither 0 nor 1.
    #[error("unknown authentication mode {0}")]
    UnknownMode(u8),
}

impl From<RawAuthError> for std::io::Error {
    fn from(e: RawAuthError) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, e)
    }
}

/// The mode byte of a side with or without a token.
fn mode(token: Option<&str>) -> u8 {
    token.is_some() as u8
}

/// Whether a side with `token` and a peer of mode `theirs` go on (both tokens: the tags
/// decide), or why not.
fn modes(token: Option<&str>, theirs: u8) -> Result<(), RawAuthError> {
    match (token, theirs) {
        (Some(_), 1) | (None, 0) => Ok(()),
        (Some(_), 0) => Err(RawAuthError::PeerHasNoToken),
        (None, 1) => Err(RawAuthError::NoTokenHere),
        (_, m) => Err(RawAuthError::UnknownMode(m)),
    }
}

/// The server's side: greets `conn` with its mode and a fresh nonce, reads the client's
/// answer (within `within`), checks it against `token`, and proves `token` back. An error
/// closes the stream.
pub fn challenge(
    mut conn: &TcpStream,
    token: Option<&str>,
    context: &str,
    within: Duration,
) -> std::io::Result<()> {
    let nonce = Nonce::new().map_err(std::io::Error::other)?;
    conn.set_write_timeout(Some(within))?;
    conn.set_read_timeout(Some(within))?;
    let mut greeting = [0u8; 1 + NONCE_LEN];
    greeting[0] = mode(token);
    greeting[1..].copy_from_slice(nonce.as_bytes());
    conn.write_all(&greeting)?;
    let mut reply = [0u8; 1 + TAG_LEN + NONCE_LEN];
    conn.read_exact(&mut reply)?;
    modes(token, reply[0])?;
    let theirs = Nonce::from_bytes(reply[1 + TAG_LEN..].try_into().expect("16 bytes"));
    let proof = match token {
        Some(t) => {
            if !transport_tcp::auth::verify(t, context, &nonce, &reply[1..1 + TAG_LEN]) {
                return Err(RawAuthError::ClientFailed.into());
            }
            transport_tcp::auth::tag(t, &format!("{context}{SERVER_SUFFIX}"), &theirs)
        }
        None => [0u8; TAG_LEN],
    };
    conn.write_all(&proof)
}

/// The client's side: reads the server's mode and nonce from `conn`, answers with the tag
/// of `token` (zeros without one, or toward a refusal) and a nonce of its own, and checks
/// the server's proof of `token`.
pub fn answer(mut conn: &TcpStream, token: Option<&str>, context: &str) -> std::io::Result<()> {
    let mut greeting = [0u8; 1 + NONCE_LEN];
    conn.read_exact(&mut greeting)?;
    let agreed = modes(token, greeting[0]);
    let mine = Nonce::new().map_err(std::io::Error::other)?;
    let mut reply = [0u8; 1 + TAG_LEN + NONCE_LEN];
    reply[0] = mode(token);
    if let (Some(t), Ok(())) = (token, &agreed) {
        let theirs = Nonce::from_bytes(greeting[1..].try_into().expect("16 bytes"));
        reply[1..1 + TAG_LEN].copy_from_slice(&transport_tcp::auth::tag(t, context, &theirs));
    }
    reply[1 + TAG_LEN..].copy_from_slice(mine.as_bytes());
    // Sent even toward a refusal, so that the server can say why too.
    conn.write_all(&reply)?;
    agreed?;
    let mut proof = [0u8; TAG_LEN];
    conn.read_exact(&mut proof)?;
    if let Some(t) = token
        && !transport_tcp::auth::verify(t, &format!("{context}{SERVER_SUFFIX}"), &mine, &proof)
    {
        return Err(RawAuthError::ServerFailed.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// The server's verdict and the client's on one stream.
    fn verdicts(
        server_token: Option<&str>,
        client_token: Option<&str>,
    ) -> (std::io::Result<()>, std::io::Result<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let client_token = client_token.map(str::to_owned);
        let c = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            answer(&s, client_token.as_deref(), SINK_CONTEXT)
        });
        let (conn, _) = l.accept().unwrap();
        let v = challenge(&conn, server_token, SINK_CONTEXT, Duration::from_secs(10));
        drop(conn);
        (v, c.join().unwrap())
    }

    /// The typed cause of a refusal.
    fn why(r: std::io::Result<()>) -> RawAuthError {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        e.into_inner()
            .and_then(|i| i.downcast::<RawAuthError>().ok())
            .map(|b| *b)
            .expect("a RawAuthError")
    }

    #[test]
    fn a_stream_passes_with_the_token_on_both_sides_and_fails_otherwise_on_both() {
        let (s, c) = verdicts(Some("s3cret"), Some("s3cret"));
        s.expect("the server, right token");
        c.expect("the client, right token");
        let (s, c) = verdicts(None, None);
        s.expect("no token on either side");
        c.expect("no token on either side");
        let (s, _) = verdicts(Some("s3cret"), Some("guess"));
        assert_eq!(why(s), RawAuthError::ClientFailed);
        let (s, c) = verdicts(Some("s3cret"), None);
        assert_eq!(why(s), RawAuthError::PeerHasNoToken);
        assert_eq!(why(c), RawAuthError::NoTokenHere);
        // Was "a server without a token takes any": now refused both ways.
        let (s, c) = verdicts(None, Some("anything"));
        assert_eq!(why(s), RawAuthError::NoTokenHere);
        assert_eq!(why(c), RawAuthError::PeerHasNoToken);
    }

    #[test]
    fn a_server_that_cannot_prove_the_token_fails_the_client() {
        // A fake server: says it has a token, takes the answer, proves with another.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            let (mut conn, _) = l.accept().unwrap();
            let mut greeting = vec![1u8];
            greeting.extend_from_slice(Nonce::new().unwrap().as_bytes());
            conn.write_all(&greeting).unwrap();
            let mut reply = [0u8; 1 + TAG_LEN + NONCE_LEN];
            conn.read_exact(&mut reply).unwrap();
            let theirs = Nonce::from_bytes(reply[1 + TAG_LEN..].try_into().unwrap());
            let proof = transport_tcp::auth::tag(
                "guess",
                &format!("{SINK_CONTEXT}{SERVER_SUFFIX}"),
                &theirs,
            );
            conn.write_all(&proof).unwrap();
            conn
        });
        let s = TcpStream::connect(addr).unwrap();
        let r = answer(&s, Some("s3cret"), SINK_CONTEXT);
        drop(fake.join().unwrap());
        assert_eq!(why(r), RawAuthError::ServerFailed);
    }

    #[test]
    fn a_tag_from_another_stream_does_not_pass() {
        // Record a legitimate answer to one nonce, replay it to a fresh one.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let recorded = std::thread::spawn(move || {
            let (mut conn, _) = l.accept().unwrap();
            let mut greeting = vec![1u8];
            greeting.extend_from_slice(Nonce::new().unwrap().as_bytes());
            conn.write_all(&greeting).unwrap();
            let mut reply = [0u8; 1 + TAG_LEN + NONCE_LEN];
            conn.read_exact(&mut reply).unwrap();
            (l, reply)
        });
        let s = TcpStream::connect(addr).unwrap();
        // The recorder proves nothing back: the client fails, the answer is recorded.
        assert!(answer(&s, Some("s3cret"), SINK_CONTEXT).is_err());
        let (l, reply) = recorded.join().unwrap();
        let replay = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut greeting = [0u8; 1 + NONCE_LEN];
            s.read_exact(&mut greeting).unwrap();
            s.write_all(&reply).unwrap();
            s
        });
        let (conn, _) = l.accept().unwrap();
        let v = challenge(&conn, Some("s3cret"), SINK_CONTEXT, Duration::from_secs(10));
        drop(replay.join().unwrap());
        assert_eq!(
            why(v),
            RawAuthError::ClientFailed,
            "a replayed tag is refused"
        );
    }
}
