//! Which congestion control a connection runs (`TCP_CONGESTION`).
//!
//! The algorithm must be chosen before a connection is established: BBR, once started on
//! a connection, leaves the kernel's pacing on for it whatever comes after (measured: raw
//! streams switched to cubic after connecting moved 4 KiB pages at 24 Gbps, those set
//! before at 41). So connections are set up before `connect`, and accepted ones inherit
//! their listener's ([`Congestion::connect`], [`Congestion::listen`]).
//!
//! BBR paces a connection at the bandwidth it has measured. Over loopback (both ends on one
//! host) nothing is lost or queued, so pacing can only hold a stream back, and its timers
//! send segments from other CPUs, which reorders them and sets off retransmissions of
//! segments that were never lost. On the 2-core VM (Linux 6.18, BBR the system's default)
//! one rail of 64 KiB pages moved 26-27 Gbps with BBR, 2-3 % of its segments retransmitted,
//! and 48-51 Gbps with cubic or reno, none retransmitted; on the H200 machine 28.7-30.4
//! against 38.4 Gbps. [`Congestion::Auto`] therefore moves loopback connections off a
//! BBR default and leaves every other choice, and every connection between hosts, to the
//! system.

use crate::CongestionError;
use socket2::{Domain, Protocol, SockAddr, SockRef, Socket, Type};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// Which congestion control the transport's connections run ([`crate::TcpConfig::congestion`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Congestion {
    /// Connections over loopback whose system default is BBR (which paces) run cubic, or
    /// reno where cubic is not allowed; all others keep the system's default
    /// (`net.ipv4.tcp_congestion_control`). See the module documentation. A listener on a
    /// loopback address passes it to every connection it accepts; one on another address
    /// (`0.0.0.0`) can switch an accepted loopback connection only once it is established,
    /// when BBR's pacing has started, so what that side sends (READ replies) stays paced.
    #[default]
    Auto,
    /// Every connection keeps the system's default.
    System,
    /// Every connection runs this algorithm (`cubic`, `reno`, `bbr`, ...). An unprivileged
    /// process may set only those in `net.ipv4.tcp_allowed_congestion_control`; the
    /// transport refuses to start with one it cannot set.
    Named(String),
}

/// The algorithm `Auto` puts loopback connections on, in order of preference: loss-based,
/// no pacing. Linux always allows reno; cubic may need `tcp_allowed_congestion_control`.
const LOOPBACK: [&str; 2] = ["cubic", "reno"];

impl Congestion {
    /// Parses `auto`, `system` or an algorithm's name (what `--tcp-congestion` takes).
    pub fn parse(s: &str) -> Result<Congestion, CongestionError> {
        match s {
            "" => Err(CongestionError::Empty),
            "auto" => Ok(Congestion::Auto),
            "system" => Ok(Congestion::System),
            name if name.len() >= 16 => Err(CongestionError::TooLong { name: name.into() }),
            name if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') => {
                Err(CongestionError::BadCharacter { name: name.into() })
            }
            name => Ok(Congestion::Named(name.to_string())),
        }
    }

    /// Sets the algorithm on `socket`, a connection to or from `peer` (or a listener on
    /// `peer`, whose accepted connections inherit it), before it connects: see the module
    /// documentation. Returns the algorithm it set, `None` where the system's stays. Only
    /// [`Congestion::Named`] fails (the kernel's error, e.g. `EPERM` for an algorithm not
    /// allowed); `Auto` keeps the default where it can set neither of its choices.
    pub fn apply<'s>(
        &self,
        socket: impl Into<SockRef<'s>>,
        peer: IpAddr,
    ) -> std::io::Result<Option<String>> {
        let socket = socket.into();
        match self {
            Congestion::System => Ok(None),
            Congestion::Named(name) => {
                socket.set_tcp_congestion(name.as_bytes())?;
                Ok(Some(name.clone()))
            }
            Congestion::Auto => {
                if !peer.to_canonical().is_loopback() {
                    return Ok(None);
                }
                if !Congestion::algorithm(&*socket)?.starts_with("bbr") {
                    return Ok(None);
                }
                for name in LOOPBACK {
                    if socket.set_tcp_congestion(name.as_bytes()).is_ok() {
                        return Ok(Some(name.to_string()));
                    }
                }
                Ok(None)
            }
        }
    }

    /// The algorithm `socket` runs, as the kernel names it (`cubic`, `bbr`, ...).
    pub fn algorithm<'s>(socket: impl Into<SockRef<'s>>) -> std::io::Result<String> {
        let name = socket.into().tcp_congestion()?;
        Ok(String::from_utf8_lossy(&name)
            .trim_end_matches('\0')
            .to_string())
    }

    /// What an error of [`Congestion::apply`] means, for messages: the kernel's `ENOENT`
    /// and `EPERM` say little by themselves.
    pub fn explain(&self, e: &std::io::Error) -> String {
        let why = match e.raw_os_error() {
            Some(libc::ENOENT) => {
                ": this kernel has no such algorithm (net.ipv4.tcp_available_congestion_control \
                 lists those it has)"
            }
            Some(libc::EPERM) => {
                ": not allowed to this process (net.ipv4.tcp_allowed_congestion_control lists \
                 those an unprivileged one may use)"
            }
            _ => "",
        };
        format!("congestion control {self}{why}")
    }

    /// A new, unconnected TCP socket of `peer`'s address family that runs this choice
    /// toward `peer` from its first segment: bind it (to a device or an address) as needed,
    /// then connect it. [`Congestion::connect`] is this and the connection.
    pub fn socket_toward(&self, peer: SocketAddr) -> std::io::Result<Socket> {
        let s = Socket::new(Domain::for_address(peer), Type::STREAM, Some(Protocol::TCP))?;
        self.apply(&s, peer.ip())?;
        Ok(s)
    }

    /// A blocking connection to `to` (within `timeout`, if given) that runs this choice
    /// from its first segment.
    pub fn connect(&self, to: SocketAddr, timeout: Option<Duration>) -> std::io::Result<TcpStream> {
        let s = self.socket_toward(to)?;
        match timeout {
            Some(t) => s.connect_timeout(&SockAddr::from(to), t)?,
            None => s.connect(&SockAddr::from(to))?,
        }
        Ok(s.into())
    }

    /// A blocking listener on `addr` whose accepted connections run this choice (for
    /// [`Congestion::Auto`]: when `addr` is a loopback address, every peer is local).
    pub fn listen(&self, addr: SocketAddr) -> std::io::Result<TcpListener> {
        let s = self.socket_toward(addr)?;
        s.bind(&SockAddr::from(addr))?;
        s.listen(128)?;
        Ok(s.into())
    }
}

impl std::fmt::Display for Congestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Congestion::Auto => f.write_str("auto"),
            Congestion::System => f.write_str("system"),
            Congestion::Named(n) => f.write_str(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener, TcpStream};

    fn algorithm(s: &TcpStream) -> String {
        Congestion::algorithm(s).unwrap()
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (c, l.accept().unwrap().0)
    }

    /// Connections made and accepted through `connect` and `listen` run the choice from
    /// the start, at both ends.
    #[test]
    fn connect_and_listen_set_it_before_the_connection_starts() {
        let named = Congestion::Named("reno".into());
        let l = named.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let c = named
            .connect(l.local_addr().unwrap(), Some(Duration::from_secs(5)))
            .unwrap();
        let (s, _) = l.accept().unwrap();
        assert_eq!(
            (algorithm(&c), algorithm(&s)),
            ("reno".into(), "reno".into())
        );
        let l = Congestion::Auto
            .listen("127.0.0.1:0".parse().unwrap())
            .unwrap();
        let c = Congestion::Auto
            .connect(l.local_addr().unwrap(), None)
            .unwrap();
        let (s, _) = l.accept().unwrap();
        for (end, name) in [("connected", algorithm(&c)), ("accepted", algorithm(&s))] {
            assert!(!name.starts_with("bbr"), "{end} loopback end on {name}");
        }
    }

    #[test]
    fn parses_what_the_option_takes() {
        assert_eq!(Congestion::parse("auto"), Ok(Congestion::Auto));
        assert_eq!(Congestion::parse("system"), Ok(Congestion::System));
        assert_eq!(
            Congestion::parse("cubic"),
            Ok(Congestion::Named("cubic".into()))
        );
        for bad in ["", "cu bic", "a-b", "sixteen_bytes_xx"] {
            assert!(Congestion::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(Congestion::parse(""), Err(CongestionError::Empty));
        let long = "sixteen_bytes_xx";
        assert_eq!(
            Congestion::parse(long),
            Err(CongestionError::TooLong { name: long.into() })
        );
        let e = Congestion::parse("a-b").unwrap_err();
        assert_eq!(e, CongestionError::BadCharacter { name: "a-b".into() });
        assert_eq!(
            e.to_string(),
            "\"a-b\": an algorithm's name is letters, digits and '_'"
        );
        assert_eq!(Congestion::Named("reno".into()).to_string(), "reno");
    }

    #[test]
    fn named_sets_it_and_refuses_what_the_kernel_refuses() {
        let (c, _s) = pair();
        let set = Congestion::Named("reno".into())
            .apply(&c, Ipv4Addr::LOCALHOST.into())
            .unwrap();
        assert_eq!(set.as_deref(), Some("reno"));
        assert_eq!(algorithm(&c), "reno");
        let err = Congestion::Named("no_such_algo".into())
            .apply(&c, Ipv4Addr::LOCALHOST.into())
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
        assert_eq!(
            algorithm(&c),
            "reno",
            "a refused name changed the algorithm"
        );
    }

    #[test]
    fn auto_moves_loopback_off_bbr_only() {
        let (c, _s) = pair();
        // Put the connection on BBR as a system default would (the kernels here default to
        // it; one without tcp_bbr fails this test rather than passing it unchecked).
        SockRef::from(&c)
            .set_tcp_congestion(b"bbr")
            .expect("this test needs the kernel's bbr (tcp_bbr)");
        let lo = IpAddr::from(Ipv4Addr::LOCALHOST);
        // Between hosts the system's choice stays.
        let remote = IpAddr::from(Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(Congestion::Auto.apply(&c, remote).unwrap(), None);
        assert_eq!(algorithm(&c), "bbr");
        assert_eq!(Congestion::System.apply(&c, lo).unwrap(), None);
        assert_eq!(algorithm(&c), "bbr");
        let set = Congestion::Auto.apply(&c, lo).unwrap();
        let now = algorithm(&c);
        assert!(LOOPBACK.contains(&now.as_str()), "loopback still on {now}");
        assert_eq!(set.as_deref(), Some(now.as_str()));
        // Another algorithm stays; an IPv4-mapped loopback address is loopback too.
        SockRef::from(&c).set_tcp_congestion(b"reno").unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert_eq!(Congestion::Auto.apply(&c, mapped).unwrap(), None);
        assert_eq!(algorithm(&c), "reno");
        SockRef::from(&c).set_tcp_congestion(b"bbr").unwrap();
        assert!(Congestion::Auto.apply(&c, mapped).unwrap().is_some());
        assert_ne!(algorithm(&c), "bbr");
    }
}
