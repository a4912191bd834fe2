//! What several test binaries share.
#![allow(dead_code)]

pub mod child;
pub mod kv;
pub mod layouts;

/// Aborts this host's established loopback connections to `port` (`ss -K`, which needs
/// CAP_NET_ADMIN; the kernel here has socket destroy): false where that cannot be done
/// here (not root, no `ss`, or `ss` failed).
pub fn kill_loopback_connections_to(port: u16) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return false;
    }
    let out = std::process::Command::new("ss")
        .args(["-K", "dst", "127.0.0.1", "dport", "=", &port.to_string()])
        .output();
    matches!(out, Ok(o) if o.status.success())
}
