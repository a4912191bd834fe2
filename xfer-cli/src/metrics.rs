//! `--metrics ADDR`: the library's figures ([`xfer::metrics`], the Prometheus text
//! exposition) served over HTTP at `GET /metrics`.
//!
//! One thread answers one connection at a time, bounded: a request must arrive whole within
//! [`REQUEST_DEADLINE`] and [`MAX_REQUEST`] bytes, the answer leave within
//! [`WRITE_DEADLINE`]; then the connection closes. A slow or hostile scraper so delays the
//! next scrape by at most those deadlines, and costs no thread or memory beyond its one
//! request.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};
pub use xfer::metrics::{Sources, render};

/// Longest request accepted (its request line and headers).
pub const MAX_REQUEST: usize = 8 << 10;
/// Time a connection has to send its whole request.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Time the answer has to leave.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(2);

/// Listens on `addr` and answers `GET /metrics` from a thread of its own, for as long as
/// the process runs; returns the address it listens on (port 0 picks one).
pub fn spawn(addr: SocketAddr, sources: Arc<Sources>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let at = listener.local_addr()?;
    std::thread::Builder::new()
        .name("xfer-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(c) => {
                        if let Err(e) = answer(c, &sources) {
                            tracing::debug!(error = %e, "metrics: connection ended");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "metrics: accept failed"),
                }
            }
        })?;
    Ok(at)
}

/// What a request asked for.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    Metrics,
    NotFound,
    NotAllowed,
    Bad,
}

/// Reads one request (bounded in bytes and time) and answers it.
fn answer(mut c: TcpStream, sources: &Arc<Sources>) -> std::io::Result<()> {
    let asked = match read_request(&mut c)? {
        Some(head) => parse(&head),
        None => return Ok(()),
    };
    let (status, body) = match asked {
        Asked::Metrics => ("200 OK", render(sources)),
        Asked::NotFound => ("404 Not Found", "only /metrics is served\n".to_owned()),
        Asked::NotAllowed => ("405 Method Not Allowed", "only GET\n".to_owned()),
        Asked::Bad => (
            "400 Bad Request",
            "malformed or oversized request\n".to_owned(),
        ),
    };
    let content_type = if asked == Asked::Metrics {
        prometheus_client::encoding::prometheus_text::CONTENT_TYPE
    } else {
        "text/plain; charset=utf-8"
    };
    c.set_write_timeout(Some(WRITE_DEADLINE))?;
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes())?;
    c.write_all(body.as_bytes())?;
    c.flush()
}

/// The request's head (up to its blank line), read within [`REQUEST_DEADLINE`];
/// `None` if the client closed before sending one; an oversized or late one is an empty
/// head (answered 400).
fn read_request(c: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(Some(Vec::new()));
        }
        c.set_read_timeout(Some(left))?;
        let n = match c.read(&mut buf) {
            Ok(0) if head.is_empty() => return Ok(None),
            Ok(0) => return Ok(Some(Vec::new())),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(Some(Vec::new()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            head.truncate(end);
            return Ok(Some(head));
        }
        if head.len() > MAX_REQUEST {
            return Ok(Some(Vec::new()));
        }
    }
}

/// What the request line of `head` asks for.
fn parse(head: &[u8]) -> Asked {
    let Ok(text) = std::str::from_utf8(head) else {
        return Asked::Bad;
    };
    let mut parts = text.lines().next().unwrap_or("").split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Asked::Bad;
    };
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return Asked::Bad;
    }
    if method != "GET" {
        return Asked::NotAllowed;
    }
    match target.split('?').next() {
        Some("/metrics") => Asked::Metrics,
        _ => Asked::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_parsed_strictly() {
        assert_eq!(parse(b"GET /metrics HTTP/1.1\r\nHost: x"), Asked::Metrics);
        assert_eq!(parse(b"GET /metrics?x=1 HTTP/1.0"), Asked::Metrics);
        assert_eq!(parse(b"GET / HTTP/1.1"), Asked::NotFound);
        assert_eq!(parse(b"POST /metrics HTTP/1.1"), Asked::NotAllowed);
        assert_eq!(parse(b"GET /metrics"), Asked::Bad);
        assert_eq!(parse(b"GET /metrics SPDY/3"), Asked::Bad);
        assert_eq!(parse(b""), Asked::Bad);
        assert_eq!(parse(&[0xff, 0xfe]), Asked::Bad);
    }
}
