//! Authentication of the raw TCP streams `serve` opens beside a control connection (the
//! `sink` of `bench --baseline`, the `echo` of `bench --latency`): the server greets each
//! accepted stream with a fresh nonce ([`NONCE_LEN`] bytes), and the client answers with
//! the HMAC-SHA256 tag of it keyed by the shared token ([`TAG_LEN`] bytes; zeros without a
//! token), before any other byte. A server with `--auth-token` closes a stream whose tag
//! does not match (compared in constant time); one without accepts any tag. The exchange
//! happens before the client's clock starts.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use transport_tcp::auth::{Nonce, TAG_LEN};

/// Bytes of the nonce a stream is greeted with.
pub const NONCE_LEN: usize = transport_tcp::auth::NONCE_LEN;
/// What the tags of `sink` streams are HMACs of, beside the nonce.
pub const SINK_CONTEXT: &str = "xfer sink stream v2";
/// What the tags of `echo` streams are HMACs of, beside the nonce.
pub const ECHO_CONTEXT: &str = "xfer echo stream v2";

/// The server's side: greets `conn` with a fresh nonce, reads the tag (within `within`)
/// and checks it against `token` when there is one. An error closes the stream.
pub fn challenge(
    mut conn: &TcpStream,
    token: Option<&str>,
    context: &str,
    within: Duration,
) -> std::io::Result<()> {
    let nonce = Nonce::new().map_err(std::io::Error::other)?;
    conn.set_write_timeout(Some(within))?;
    conn.set_read_timeout(Some(within))?;
    conn.write_all(nonce.as_bytes())?;
    let mut tag = [0u8; TAG_LEN];
    conn.read_exact(&mut tag)?;
    match token {
        Some(t) if !transport_tcp::auth::verify(t, context, &nonce, &tag) => {
            Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "authentication failed: no or wrong --auth-token",
            ))
        }
        _ => Ok(()),
    }
}

/// The client's side: reads the server's nonce from `conn` and answers with the tag of
/// `token` (zeros without one).
pub fn answer(mut conn: &TcpStream, token: Option<&str>, context: &str) -> std::io::Result<()> {
    let mut raw = [0u8; NONCE_LEN];
    conn.read_exact(&mut raw)?;
    let tag = match token {
        Some(t) => transport_tcp::auth::tag(t, context, &Nonce::from_bytes(raw)),
        None => [0u8; TAG_LEN],
    };
    conn.write_all(&tag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// The server's verdict on one stream whose client answers with `client_token`.
    fn verdict(server_token: Option<&str>, client_token: Option<&str>) -> std::io::Result<()> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let client_token = client_token.map(str::to_owned);
        let c = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            answer(&s, client_token.as_deref(), SINK_CONTEXT).unwrap();
            s
        });
        let (conn, _) = l.accept().unwrap();
        let v = challenge(&conn, server_token, SINK_CONTEXT, Duration::from_secs(10));
        drop(c.join().unwrap());
        v
    }

    #[test]
    fn a_stream_passes_with_the_token_and_fails_without_it() {
        verdict(Some("s3cret"), Some("s3cret")).expect("right token");
        let e = verdict(Some("s3cret"), Some("guess")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(verdict(Some("s3cret"), None).is_err(), "no token");
        verdict(None, Some("anything")).expect("a server without a token takes any");
    }

    #[test]
    fn a_tag_from_another_stream_does_not_pass() {
        // Record a legitimate answer to one nonce, replay it to a fresh one.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let recorded = std::thread::spawn(move || {
            let (mut conn, _) = l.accept().unwrap();
            let nonce = Nonce::new().unwrap();
            conn.write_all(nonce.as_bytes()).unwrap();
            let mut tag = [0u8; TAG_LEN];
            conn.read_exact(&mut tag).unwrap();
            (l, tag)
        });
        let s = TcpStream::connect(addr).unwrap();
        answer(&s, Some("s3cret"), SINK_CONTEXT).unwrap();
        let (l, tag) = recorded.join().unwrap();
        let replay = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut nonce = [0u8; NONCE_LEN];
            s.read_exact(&mut nonce).unwrap();
            s.write_all(&tag).unwrap();
            s
        });
        let (conn, _) = l.accept().unwrap();
        let v = challenge(&conn, Some("s3cret"), SINK_CONTEXT, Duration::from_secs(10));
        drop(replay.join().unwrap());
        assert!(v.is_err(), "a replayed tag is refused");
    }
}
