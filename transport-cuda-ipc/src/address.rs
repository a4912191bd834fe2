//! Addresses of CUDA IPC transports: which host (by boot id), which process, which device,
//! and the name of the abstract Unix socket the transport listens on.
//!
//! Text form: `xipc1 <boot id> <pid> <device> <socket name>`; the socket name is
//! `xfer-ipc-<pid>-<random hex>`. Pure parsing, tested without sockets.

use fabric_core::Error;

/// A parsed peer address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcAddress {
    /// `/proc/sys/kernel/random/boot_id` of the peer's host: equal boot ids mean the same
    /// host (and the same boot), which CUDA IPC requires.
    pub boot_id: String,
    /// The peer's process id.
    pub pid: u32,
    /// The CUDA device the peer's transport copies with.
    pub device: u32,
    /// Name of the peer's abstract Unix socket.
    pub socket: String,
}

const PREFIX: &str = "xipc1";

impl IpcAddress {
    /// The bytes peers pass to `add_peer`.
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{PREFIX} {} {} {} {}",
            self.boot_id, self.pid, self.device, self.socket
        )
        .into_bytes()
    }

    /// Parses an address. Malformed input is [`Error::InvalidAddress`].
    pub fn parse(bytes: &[u8]) -> Result<IpcAddress, Error> {
        let bad = |why: &str| Error::InvalidAddress(format!("not a CUDA IPC address: {why}"));
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8"))?;
        let mut parts = text.split(' ');
        if parts.next() != Some(PREFIX) {
            return Err(bad("it does not start with `xipc1`"));
        }
        let boot_id = parts.next().ok_or_else(|| bad("no boot id"))?;
        let pid = parts.next().and_then(|p| p.parse().ok());
        let device = parts.next().and_then(|d| d.parse().ok());
        let socket = parts.next().ok_or_else(|| bad("no socket name"))?;
        let (Some(pid), Some(device)) = (pid, device) else {
            return Err(bad("bad process id or device"));
        };
        if parts.next().is_some() {
            return Err(bad("trailing fields"));
        }
        let ok_id = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        };
        if !ok_id(boot_id) || !ok_id(socket) {
            return Err(bad("bad boot id or socket name"));
        }
        Ok(IpcAddress {
            boot_id: boot_id.to_string(),
            pid,
            device,
            socket: socket.to_string(),
        })
    }

    /// Checks that the peer runs on this host (same boot id).
    pub fn check_same_host(&self, ours: &str) -> Result<(), Error> {
        if self.boot_id == ours {
            Ok(())
        } else {
            Err(Error::InvalidAddress(format!(
                "the peer runs on another host (boot id {}, ours {ours}): CUDA IPC reaches only \
                 processes of this host; use the tcp or efa transport",
                self.boot_id
            )))
        }
    }
}

/// This host's boot id (`/proc/sys/kernel/random/boot_id`).
pub fn boot_id() -> Result<String, Error> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| Error::io("read /proc/sys/kernel/random/boot_id", e))?;
    Ok(s.trim().to_string())
}

/// Whether `address` is a CUDA IPC address of a process on this host.
pub fn is_local_address(address: &[u8]) -> bool {
    match (IpcAddress::parse(address), boot_id()) {
        (Ok(a), Ok(ours)) => a.boot_id == ours,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> IpcAddress {
        IpcAddress {
            boot_id: "0a1b2c3d-0000-4000-8000-000000000001".into(),
            pid: 4242,
            device: 1,
            socket: "xfer-ipc-4242-00ff".into(),
        }
    }

    #[test]
    fn addresses_round_trip() {
        let a = sample();
        assert_eq!(IpcAddress::parse(&a.encode()).unwrap(), a);
    }

    #[test]
    fn malformed_addresses_are_invalid_not_panics() {
        for bad in [
            &b""[..],
            b"\xff\x00garbage",
            b"xipc1",
            b"xipc1 id",
            b"xipc1 id x 0 s",
            b"xipc1 id 1 0 s extra",
            b"xipc1 id/../x 1 0 s",
            b"tcp 127.0.0.1:80",
        ] {
            assert!(
                matches!(IpcAddress::parse(bad), Err(Error::InvalidAddress(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn another_host_is_refused_with_the_reason() {
        let a = sample();
        let e = a.check_same_host("ffffffff-0000-4000-8000-000000000009");
        let msg = e.unwrap_err().to_string();
        assert!(msg.contains("another host"), "{msg}");
        assert!(a.check_same_host(&a.boot_id).is_ok());
    }

    #[test]
    fn this_host_has_a_boot_id() {
        let id = boot_id().unwrap();
        let mut a = sample();
        a.boot_id = id;
        assert!(is_local_address(&a.encode()));
        assert!(!is_local_address(&sample().encode()));
    }
}
