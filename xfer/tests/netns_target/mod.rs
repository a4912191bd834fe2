//! What the tests between an agent and target processes in network namespaces share
//! (`netns_liveness.rs`, `fault_soak.rs`): the agents (tcp rails with a token, listening on
//! given ports so that a restarted target takes the same addresses), the target process
//! (this test binary run again in namespace B, its metadata on stdout), signals, the ports of
//! an agent's rails, its metrics, the namespace's connections, and cuts of the link.
//!
//! The including test declares `mod netns;` (transport-tcp/tests/netns/mod.rs) and
//! `mod common;` at its root.
#![allow(dead_code)]

use crate::netns::{NetPair, Side};
use fabric_core::MemoryLocation;
use fabric_core::engine::{EngineConfig, RailGroup};
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};
use xfer::layers::AgentLayers;
use xfer::{Agent, AgentInfo, RegionDescriptor, TransportKind};

/// Rails of every agent.
pub const RAILS: usize = 2;
const TOKEN: &str = "netns-target-token";

/// An agent of [`RAILS`] tcp rails listening on `ip` at `ports` (0: any), with the token,
/// and `liveness` as its connections' liveness timeout (`None`: the transport's default).
pub fn agent(name: &str, ip: IpAddr, ports: &[u16], liveness: Option<Duration>) -> Agent {
    let ports = ports.to_vec();
    let group = RailGroup::spawn(
        RAILS,
        move |i| {
            let d = TcpConfig::default();
            TcpTransport::new(TcpConfig {
                listen: SocketAddr::new(ip, ports[i]),
                auth_token: Some(TOKEN.into()),
                liveness_timeout: liveness.unwrap_or(d.liveness_timeout),
                ..d
            })
        },
        EngineConfig::default(),
    )
    .expect("tcp rails");
    Agent::from_groups(
        name,
        MemoryLocation::Host,
        vec![(TransportKind::Tcp, group)],
    )
    .expect("an agent")
}

/// `ADDR,PORT,PORT`: where a target listens, passed in its environment.
pub fn spec(ip: IpAddr, ports: &[u16]) -> String {
    std::iter::once(ip.to_string())
        .chain(ports.iter().map(|p| p.to_string()))
        .collect::<Vec<_>>()
        .join(",")
}

/// The address and ports of a [`spec`].
pub fn parse_spec(spec: &str) -> (IpAddr, Vec<u16>) {
    let mut parts = spec.split(',');
    let ip: IpAddr = parts.next().unwrap().parse().expect("an address");
    let ports: Vec<u16> = parts.map(|p| p.parse().expect("a port")).collect();
    assert_eq!(ports.len(), RAILS, "a port per rail");
    (ip, ports)
}

pub use crate::common::child::{Child as Target, announce};

/// This test binary run again in namespace B with `env=spec(B's address, ports)`: a
/// target, once it has announced its metadata.
pub fn start(net: &NetPair, env: &str, ports: &[u16]) -> (Target, AgentInfo, RegionDescriptor) {
    // `ip netns exec` enters the namespace and execs the binary: the child's pid is the
    // target's own, for the signals.
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", net.name(Side::B)])
        .arg(std::env::current_exe().unwrap())
        .env(env, spec(IpAddr::V4(net.ip(Side::B)), ports));
    Target::spawn(cmd)
}

/// The ports of an agent's tcp rails (`tcp://ADDR:PORT`).
pub fn ports_of(info: &AgentInfo) -> Vec<u16> {
    info.transport(TransportKind::Tcp)
        .unwrap()
        .rails
        .iter()
        .map(|a| {
            let a = std::str::from_utf8(a).unwrap();
            a.rsplit(':').next().unwrap().parse().unwrap()
        })
        .collect()
}

/// The established tcp connections of this process's namespace (`ss`), as (local, peer).
pub fn connections() -> BTreeSet<(String, String)> {
    let out = Command::new("ss")
        .args(["-Htn", "state", "established"])
        .output()
        .expect("ss");
    assert!(out.status.success(), "ss: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() >= 4).then(|| (w[2].to_string(), w[3].to_string()))
        })
        .collect()
}

/// A counter of the agent's metrics.
pub fn metric(a: &Agent, name: &str) -> u64 {
    let m = a.metrics();
    m.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{m}"))
        .trim()
        .parse()
        .unwrap()
}

/// Runs nft commands (one a string) in the side's namespace.
fn nft(net: &NetPair, side: Side, rules: &[String]) {
    for r in rules {
        let args: Vec<&str> = r.split_whitespace().collect();
        net.exec(side, "nft", &args).expect("nft");
    }
}

/// Drops every packet both sides receive on their veth (the link cut), or stops dropping.
pub fn cut(net: &NetPair, on: bool) {
    for side in [Side::A, Side::B] {
        let dev = net.dev(side);
        let rules: Vec<String> = if on {
            vec![
                "add table inet xfercut".into(),
                "add chain inet xfercut in { type filter hook prerouting priority -10 ; }".into(),
                format!("add rule inet xfercut in iifname {dev} drop"),
            ]
        } else {
            vec!["delete table inet xfercut".into()]
        };
        nft(net, side, &rules);
    }
}

/// Drops every packet to and from the target listening at `ports` (in B), both ways, under
/// the name `tag` (a cut of that target alone), or stops dropping.
pub fn cut_ports(net: &NetPair, tag: &str, ports: &[u16], on: bool) {
    let set = ports
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let table = format!("xfercut{tag}");
    for (side, dir) in [(Side::B, "dport"), (Side::A, "sport")] {
        let dev = net.dev(side);
        let rules: Vec<String> = if on {
            vec![
                format!("add table inet {table}"),
                format!(
                    "add chain inet {table} in {{ type filter hook prerouting priority -10 ; }}"
                ),
                format!("add rule inet {table} in iifname {dev} tcp {dir} {{ {set} }} drop"),
            ]
        } else {
            vec![format!("delete table inet {table}")]
        };
        nft(net, side, &rules);
    }
}
