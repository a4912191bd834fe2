//! Two network namespaces joined by a veth pair, for tests of faults between hosts: loss
//! (nftables `numgen random`), rate limits (`tc ... tbf`) and partitions (link down).
//!
//! Every namespace is created by the test, named `xfer-t-<pid>-<n>-a` / `-b`, and deleted
//! when its [`NetPair`] drops (also on panic); namespaces left by a killed test process are
//! swept at the next start. Addresses (10.231.<n>.1 and .2) exist only inside them.
//!
//! A thread joins a namespace with [`enter`] (`setns(2)`), so that the sockets it creates
//! afterwards live there: call it first thing inside an `Engine::spawn` closure.
//!
//! Where namespaces cannot be made (not root, no `ip`), [`NetPair::new`] prints
//! `skipped: ...` (to the terminal, past the harness's capture) and returns `None`, unless
//! they are required: `XFER_REQUIRE_NETNS=1`, or running as root (who can make them) without
//! `XFER_REQUIRE_NETNS=0`; then it panics.
#![allow(dead_code)]

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};

/// Interface names inside the namespaces (the same in every pair: each lives in its own).
pub const DEV_A: &str = "xa";
/// See [`DEV_A`].
pub const DEV_B: &str = "xb";

const PREFIX: &str = "xfer-t-";

static NEXT: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

/// Whether a missing namespace facility is a failure: `XFER_REQUIRE_NETNS=1` (CI sets it),
/// or root without `XFER_REQUIRE_NETNS=0`.
pub fn required() -> bool {
    match std::env::var("XFER_REQUIRE_NETNS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        // SAFETY: geteuid has no preconditions and cannot fail.
        _ => (unsafe { libc::geteuid() }) == 0,
    }
}

/// Prints why the test is skipped, or panics when namespaces are required.
pub fn skip(why: &str) {
    assert!(
        !required(),
        "XFER_REQUIRE_NETNS=1 but network namespaces are unavailable: {why}"
    );
    use std::io::Write;
    // Straight to stderr: the harness captures `println!`, and a skip must be seen.
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
}

/// Runs a command and returns its stdout.
pub fn output(prog: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{prog}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{prog} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs a command; its stderr is the error.
pub fn run(prog: &str, args: &[&str]) -> Result<(), String> {
    output(prog, args).map(drop)
}

/// Deletes namespaces of earlier test processes that died before their cleanup ran.
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run("ip", &["netns", "del", name]);
        }
    }
}

/// Moves the calling thread into namespace `name`: sockets it creates from now on live there.
pub fn enter(name: &str) -> std::io::Result<()> {
    let f = File::open(format!("/var/run/netns/{name}"))?;
    // SAFETY: setns only reads the descriptor, which `f` keeps open for the call; it changes
    // the network namespace of this thread alone.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One side of a [`NetPair`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The first namespace (10.231.<n>.1, device `xa`).
    A,
    /// The second namespace (10.231.<n>.2, device `xb`).
    B,
}

/// Two namespaces and the veth pair between them; deleted on drop.
pub struct NetPair {
    names: [String; 2],
    subnet: u8,
    /// Extra veth pairs `veth0..vethN-1` ([`NetPair::with_veths`]).
    veths: usize,
}

impl NetPair {
    /// Two namespaces joined by the usual pair and `n` more veth pairs, `veth0` to
    /// `veth{n-1}` on both sides (four "NICs" each), pair `i` in its own subnet
    /// 10.(232+i).<n>.0/24; or `None` as [`NetPair::new`].
    pub fn with_veths(n: usize) -> Option<NetPair> {
        assert!(n <= 16, "at most 16 veth pairs");
        let mut pair = NetPair::new()?;
        pair.veths = n;
        if let Err(e) = pair.build_veths() {
            drop(pair);
            skip(&format!("cannot create veth pairs: {e}"));
            return None;
        }
        Some(pair)
    }

    fn build_veths(&self) -> Result<(), String> {
        let [a, b] = &self.names;
        for i in 0..self.veths {
            let dev = Self::veth(i);
            run(
                "ip",
                &[
                    "link", "add", &dev, "netns", a, "type", "veth", "peer", "name", &dev, "netns",
                    b,
                ],
            )?;
            for side in [Side::A, Side::B] {
                let cidr = format!("{}/24", self.veth_ip(i, side));
                self.ip_cmd(side, &["addr", "add", &cidr, "dev", &dev])?;
                self.ip_cmd(side, &["link", "set", &dev, "up"])?;
            }
        }
        // A veth reports carrier a moment after both ends are up; until then the kernel
        // queues or drops what is sent on it. Wait (with a deadline) for every end.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for i in 0..self.veths {
            for side in [Side::A, Side::B] {
                let path = format!("/sys/class/net/{}/operstate", Self::veth(i));
                loop {
                    let state = output("ip", &["netns", "exec", self.name(side), "cat", &path])?;
                    if state.trim() == "up" {
                        break;
                    }
                    if std::time::Instant::now() > deadline {
                        return Err(format!("{} stays {:?}", Self::veth(i), state.trim()));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
        }
        Ok(())
    }

    /// The name of extra veth pair `i` (the same on both sides).
    pub fn veth(i: usize) -> String {
        format!("veth{i}")
    }

    /// The side's address on extra veth pair `i`.
    pub fn veth_ip(&self, i: usize, side: Side) -> Ipv4Addr {
        Ipv4Addr::new(10, 232 + i as u8, self.subnet, side as u8 + 1)
    }

    /// Bytes the side's device `dev` has sent: the kernel's own counter
    /// (`/sys/class/net/DEV/statistics/tx_bytes`, read inside the namespace).
    pub fn tx_bytes(&self, side: Side, dev: &str) -> Result<u64, String> {
        let path = format!("/sys/class/net/{dev}/statistics/tx_bytes");
        let out = output("ip", &["netns", "exec", self.name(side), "cat", &path])?;
        out.trim()
            .parse()
            .map_err(|e| format!("{path}: {e}: {out:?}"))
    }

    /// Limits the rate at which the side sends on device `dev` (`tc ... tbf`).
    pub fn rate_dev(&self, side: Side, dev: &str, rate: &str) -> Result<(), String> {
        self.exec(
            side,
            "tc",
            &[
                "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "64kb",
                "latency", "50ms",
            ],
        )
    }

    /// Creates the pair, or prints why it cannot and returns `None` (see the module docs).
    pub fn new() -> Option<NetPair> {
        SWEEP.call_once(sweep_stale);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let pair = NetPair {
            names: [
                format!("{PREFIX}{pid}-{n}-a"),
                format!("{PREFIX}{pid}-{n}-b"),
            ],
            subnet: (n % 250 + 1) as u8,
            veths: 0,
        };
        // A pair half made is still deleted by Drop.
        if let Err(e) = pair.build() {
            drop(pair);
            skip(&format!("cannot create network namespaces: {e}"));
            return None;
        }
        Some(pair)
    }

    fn build(&self) -> Result<(), String> {
        let [a, b] = &self.names;
        run("ip", &["netns", "add", a])?;
        run("ip", &["netns", "add", b])?;
        run(
            "ip",
            &[
                "link", "add", DEV_A, "netns", a, "type", "veth", "peer", "name", DEV_B, "netns", b,
            ],
        )?;
        for side in [Side::A, Side::B] {
            let cidr = format!("{}/24", self.ip(side));
            self.ip_cmd(side, &["addr", "add", &cidr, "dev", self.dev(side)])?;
            self.ip_cmd(side, &["link", "set", "lo", "up"])?;
            self.ip_cmd(side, &["link", "set", self.dev(side), "up"])?;
        }
        Ok(())
    }

    /// The namespace's name.
    pub fn name(&self, side: Side) -> &str {
        &self.names[side as usize]
    }

    /// The veth device inside the namespace.
    pub fn dev(&self, side: Side) -> &'static str {
        match side {
            Side::A => DEV_A,
            Side::B => DEV_B,
        }
    }

    /// The side's address.
    pub fn ip(&self, side: Side) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, self.subnet, side as u8 + 1)
    }

    /// The side's address with port 0, for `TcpConfig::listen`.
    pub fn listen(&self, side: Side) -> SocketAddr {
        SocketAddr::from((self.ip(side), 0))
    }

    /// `ip -n NAMESPACE args...`.
    pub fn ip_cmd(&self, side: Side, args: &[&str]) -> Result<(), String> {
        let mut v = vec!["-n", self.name(side)];
        v.extend_from_slice(args);
        run("ip", &v)
    }

    /// A command run inside the namespace (`ip netns exec`).
    pub fn exec(&self, side: Side, prog: &str, args: &[&str]) -> Result<(), String> {
        let mut v = vec!["netns", "exec", self.name(side), prog];
        v.extend_from_slice(args);
        run("ip", &v)
    }

    /// Drops `percent` % of the packets the side receives on its veth (nftables
    /// `numgen random` in a prerouting chain: a drop on the sender's output hook would be
    /// reported to its TCP stack as a failed send and retried at once, not lost).
    ///
    /// Call it before sockets connect: it also limits both devices to one segment per
    /// packet (`gso_max_segs 1`), so that the rule sees wire-sized packets and not 64 KiB
    /// GSO bundles.
    pub fn loss(&self, side: Side, percent: u32) -> Result<(), String> {
        for s in [Side::A, Side::B] {
            self.ip_cmd(s, &["link", "set", self.dev(s), "gso_max_segs", "1"])?;
        }
        let dev = self.dev(side);
        let rules = [
            "add table inet xfer".to_string(),
            "add chain inet xfer in { type filter hook prerouting priority 0 ; }".to_string(),
            format!(
                "add rule inet xfer in iifname {dev} numgen random mod 100 < {percent} counter drop"
            ),
        ];
        for r in &rules {
            let args: Vec<&str> = r.split_whitespace().collect();
            self.exec(side, "nft", &args)?;
        }
        Ok(())
    }

    /// Packets to the side dropped so far by its [`loss`](NetPair::loss) rule.
    pub fn dropped(&self, side: Side) -> Result<u64, String> {
        let mut v = vec!["netns", "exec", self.name(side), "nft"];
        v.extend("list chain inet xfer in".split_whitespace());
        let out = output("ip", &v)?;
        let words: Vec<&str> = out.split_whitespace().collect();
        words
            .windows(2)
            .find(|w| w[0] == "packets")
            .and_then(|w| w[1].parse().ok())
            .ok_or_else(|| format!("no packet counter in: {out}"))
    }

    /// TCP segments the side has retransmitted (`RetransSegs` of its /proc/net/snmp).
    pub fn retransmitted(&self, side: Side) -> Result<u64, String> {
        let out = output(
            "ip",
            &["netns", "exec", self.name(side), "cat", "/proc/net/snmp"],
        )?;
        let mut tcp = out.lines().filter(|l| l.starts_with("Tcp:"));
        let (names, values) = (tcp.next(), tcp.next());
        let (Some(names), Some(values)) = (names, values) else {
            return Err("no Tcp lines in /proc/net/snmp".into());
        };
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(n, _)| *n == "RetransSegs")
            .and_then(|(_, v)| v.parse().ok())
            .ok_or_else(|| "no RetransSegs in /proc/net/snmp".into())
    }

    /// Limits the rate at which the side sends (a token bucket, `tc ... tbf`).
    pub fn rate(&self, side: Side, rate: &str) -> Result<(), String> {
        self.exec(
            side,
            "tc",
            &[
                "qdisc",
                "replace",
                "dev",
                self.dev(side),
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "64kb",
                "latency",
                "50ms",
            ],
        )
    }

    /// Removes the side's rate limit (the `tbf` of [`rate`](NetPair::rate)).
    pub fn unrate(&self, side: Side) -> Result<(), String> {
        self.exec(side, "tc", &["qdisc", "del", "dev", self.dev(side), "root"])
    }

    /// Takes the side's link down (a partition) or up again.
    pub fn link(&self, side: Side, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        self.ip_cmd(side, &["link", "set", self.dev(side), state])
    }

    /// Whether a tool is installed (for tests that need more than `ip`).
    pub fn has_tool(prog: &str) -> bool {
        Command::new(prog)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        // Deleting a namespace removes its end of the veth, and with it the other end.
        for name in &self.names {
            if let Err(e) = run("ip", &["netns", "del", name])
                && !e.contains("No such file")
            {
                eprintln!("warning: {e}");
            }
        }
    }
}
