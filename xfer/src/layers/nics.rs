//! The NIC each rail runs on ([`Nics`]: `auto`, or names).
//!
//! A rail is one engine (a worker thread and its transport). For `tcp` its NIC is a network
//! interface: the rail listens on the interface's address and binds its connections to it
//! (`SO_BINDTODEVICE`). For `efa` it is a libfabric domain: `rdmap79s0-rdm` on a p5, an
//! interface name (`veth0`) with libfabric's `tcp` provider. Rail `i` runs on NIC
//! `i % NICs`, so several rails may share one NIC (more endpoints on it), and `--rails`
//! defaults to the number of NICs.
//!
//! `auto` (the default) asks the placement plan ([`topology::PlacementPlan`]) for the NICs
//! of the worker's GPU (on a p5, the four EFA NICs under its PCIe switch) and keeps those
//! the transport can use; when it has none it falls back, with the reason stated in the
//! summary: for tcp to the interface of the route toward the peer, for efa to the
//! provider's first domain. Toward a loopback address nothing is chosen: every rail runs on
//! `lo`, unbound, as before there were NICs to choose.
//!
//! `if-addrs` lists the interfaces and their addresses (getifaddrs, without unsafe code of
//! ours); its flags in `/sys/class/net` say whether one is up.

use fabric_core::metadata::TransportKind;
use serde::Serialize;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use topology::{NicKind, PlacementPlan, Topology, WorkerPlacement};

/// Which NICs an agent's rails run on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Nics {
    /// The placement plan's NICs for the worker (see the module documentation).
    #[default]
    Auto,
    /// These NICs, by name: interfaces for tcp, libfabric domains for efa.
    Named(Vec<String>),
}

impl std::str::FromStr for Nics {
    type Err = NicError;

    /// `auto`, or a comma-separated list of names.
    fn from_str(s: &str) -> Result<Nics, NicError> {
        if s == "auto" {
            return Ok(Nics::Auto);
        }
        let names: Vec<String> = s.split(',').map(|n| n.trim().to_string()).collect();
        if names.iter().any(String::is_empty) {
            return Err(NicError::EmptyName(s.to_owned()));
        }
        Ok(Nics::Named(names))
    }
}

/// Why NICs could not be chosen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NicError {
    /// A list of names with an empty one (`a,,b`).
    #[error("{0:?}: expected auto or NAME[,NAME...] (an empty name)")]
    EmptyName(String),
    /// No interface of that name on this machine.
    #[error("no interface {name:?} on this machine (its interfaces: {known})")]
    NoSuchInterface {
        /// The name asked for.
        name: String,
        /// The interfaces there are.
        known: String,
    },
    /// The interface is down.
    #[error("interface {name:?} is down (bring it up: ip link set {name} up)")]
    Down {
        /// The interface.
        name: String,
    },
    /// The interface has no address of the peer's family.
    #[error("interface {name:?} has no {family} address")]
    NoAddress {
        /// The interface.
        name: String,
        /// `IPv4` or `IPv6`.
        family: &'static str,
    },
    /// The libfabric provider lists no domain of that name.
    #[error("the provider has no domain {name:?} (its domains: {known})")]
    NoSuchDomain {
        /// The name asked for.
        name: String,
        /// The domains it lists.
        known: String,
    },
    /// The interfaces could not be listed.
    #[error("cannot list interfaces")]
    Interfaces(#[source] std::io::Error),
    /// The provider's domains could not be listed.
    #[error("cannot list the provider's domains")]
    Domains(#[source] fabric_core::Error),
    /// NICs were named for a transport that runs on none.
    #[error("NICs apply to the tcp and efa transports, not {0}")]
    NotOnNics(TransportKind),
}

/// One NIC a rail runs on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RailNic {
    /// The interface (tcp) or libfabric domain (efa).
    pub name: String,
    /// tcp: the interface's address the rail listens on and leaves from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ip: Option<IpAddr>,
}

/// The NICs of one worker's rails, and how they were chosen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NicChoice {
    /// The NICs, in rail order (rail `i` on `nics[i % len]`); empty: the rails are not
    /// bound to a NIC (loopback, or nothing to choose).
    pub nics: Vec<RailNic>,
    /// Why these: `--nics`, the plan's NICs for the GPU, or the fallback and its reason.
    pub reason: String,
}

impl NicChoice {
    /// No NIC chosen, for `reason`.
    pub fn unbound(reason: impl Into<String>) -> NicChoice {
        NicChoice {
            nics: Vec::new(),
            reason: reason.into(),
        }
    }

    /// Rails when `--rails` is not given: one per NIC, or `unbound` without NICs.
    pub fn default_rails(&self, unbound: usize) -> usize {
        if self.nics.is_empty() {
            unbound
        } else {
            self.nics.len()
        }
    }

    /// The NIC of each of `rails` rails (rail `i` on NIC `i % NICs`); empty when unbound.
    pub fn per_rail(&self, rails: usize) -> Vec<RailNic> {
        if self.nics.is_empty() {
            return Vec::new();
        }
        (0..rails)
            .map(|i| self.nics[i % self.nics.len()].clone())
            .collect()
    }

    /// The names, comma-separated (`unbound` when there are none), for summaries.
    pub fn names(&self) -> String {
        if self.nics.is_empty() {
            return "unbound".into();
        }
        self.nics
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A network interface of this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    /// Its name (`eth0`).
    pub name: String,
    /// Whether it is up (its IFF_UP flag: `ip link set NAME up`).
    pub up: bool,
    /// Its addresses.
    pub addrs: Vec<IpAddr>,
}

/// The interfaces of this machine (of its network namespace), sorted by name.
pub fn interfaces() -> Result<Vec<Interface>, NicError> {
    let mut out: Vec<Interface> = Vec::new();
    // Interfaces without an address are listed too: naming one gets a precise error.
    if let Ok(dir) = std::fs::read_dir("/sys/class/net") {
        for e in dir.flatten() {
            if let Some(name) = e.file_name().to_str() {
                out.push(Interface {
                    name: name.to_string(),
                    up: false,
                    addrs: Vec::new(),
                });
            }
        }
    }
    let addrs = if_addrs::get_if_addrs().map_err(NicError::Interfaces)?;
    for a in addrs {
        match out.iter_mut().find(|i| i.name == a.name) {
            Some(i) => i.addrs.push(a.ip()),
            None => out.push(Interface {
                name: a.name.clone(),
                up: false,
                addrs: vec![a.ip()],
            }),
        }
    }
    for i in &mut out {
        // Administratively up (IFF_UP, what `ip link set X up` sets): a link whose carrier
        // comes a moment later is still the user's to use.
        let flags = std::fs::read_to_string(format!("/sys/class/net/{}/flags", i.name))
            .ok()
            .and_then(|f| u32::from_str_radix(f.trim().trim_start_matches("0x"), 16).ok());
        i.up = flags.is_some_and(|f| f & 1 != 0);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// `names` as tcp rails' NICs: each must be an interface of this machine that is up and
/// has an address of the family of `toward` (IPv4 if `toward` is).
pub fn tcp_named(
    names: &[String],
    ifaces: &[Interface],
    toward: IpAddr,
) -> Result<Vec<RailNic>, NicError> {
    let known = || {
        ifaces
            .iter()
            .map(|i| i.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    names
        .iter()
        .map(|name| {
            let i = ifaces.iter().find(|i| &i.name == name).ok_or_else(|| {
                NicError::NoSuchInterface {
                    name: name.clone(),
                    known: known(),
                }
            })?;
            if !i.up {
                return Err(NicError::Down { name: name.clone() });
            }
            let ip = i
                .addrs
                .iter()
                .copied()
                .find(|a| a.is_ipv4() == toward.is_ipv4())
                .ok_or_else(|| NicError::NoAddress {
                    name: name.clone(),
                    family: if toward.is_ipv4() { "IPv4" } else { "IPv6" },
                })?;
            Ok(RailNic {
                name: name.clone(),
                ip: Some(ip),
            })
        })
        .collect()
}

/// `names` as efa rails' NICs: each must be a domain the provider lists.
pub fn efa_named(names: &[String], domains: &[String]) -> Result<Vec<RailNic>, NicError> {
    names
        .iter()
        .map(|name| {
            if domains.contains(name) {
                Ok(RailNic {
                    name: name.clone(),
                    ip: None,
                })
            } else {
                Err(NicError::NoSuchDomain {
                    name: name.clone(),
                    known: domains.join(", "),
                })
            }
        })
        .collect()
}

/// The plan's worker that a rail group of GPU `gpu_slot` (position in `--gpus`, host
/// memory: the first worker) uses.
pub fn plan_worker(plan: &PlacementPlan, slot: usize) -> Option<&WorkerPlacement> {
    plan.workers.get(slot).or_else(|| plan.workers.first())
}

/// The efa domain of a plan NIC: `name` itself, or `name-rdm` / `name-dgrm` as the efa
/// provider spells it, or (socket providers) its network interface.
fn domain_of(nic: &topology::Nic, domains: &[String]) -> Option<String> {
    domains
        .iter()
        .find(|d| {
            **d == nic.name
                || d.strip_prefix(nic.name.as_str())
                    .is_some_and(|rest| rest.starts_with('-'))
                || nic.netdev.as_deref() == Some(d.as_str())
        })
        .cloned()
}

/// `auto` for efa: the plan's NICs for `worker` that the provider lists as domains; else
/// unbound (the provider's first domain).
pub fn efa_auto(t: &Topology, worker: &WorkerPlacement, domains: &[String]) -> NicChoice {
    let nics: Vec<RailNic> = worker
        .nics
        .iter()
        .filter_map(|&i| t.nic(i))
        .filter_map(|n| domain_of(n, domains))
        .map(|name| RailNic { name, ip: None })
        .collect();
    if domains.is_empty() {
        return NicChoice::unbound("auto: the provider lists no domain on this machine");
    }
    if nics.is_empty() {
        return NicChoice::unbound(format!(
            "auto: none of the plan's NICs for this worker is a domain of the provider; its \
             first domain ({}) is used",
            domains.first().map_or("none", String::as_str)
        ));
    }
    let how = worker.nic_affinity.label();
    NicChoice {
        reason: format!("auto: the placement plan's NICs for this worker ({how})"),
        nics,
    }
}

/// `auto` for tcp toward `toward`: loopback is unbound; else the plan's NICs for `worker`
/// that are interfaces with an address of `toward`'s family and up; else the interface of
/// the route toward `toward`; else unbound.
pub fn tcp_auto(
    t: Option<&Topology>,
    worker: Option<&WorkerPlacement>,
    ifaces: &[Interface],
    toward: IpAddr,
) -> NicChoice {
    if toward.is_loopback() {
        return NicChoice::unbound("auto: the peer is on loopback; rails run on lo, unbound");
    }
    let usable = |name: &str| -> Option<RailNic> {
        let i = ifaces.iter().find(|i| i.name == name && i.up)?;
        let ip = i
            .addrs
            .iter()
            .copied()
            .find(|a| a.is_ipv4() == toward.is_ipv4())?;
        Some(RailNic {
            name: name.to_string(),
            ip: Some(ip),
        })
    };
    if let (Some(t), Some(w)) = (t, worker) {
        let nics: Vec<RailNic> = w
            .nics
            .iter()
            .filter_map(|&i| t.nic(i))
            .filter(|n| n.kind != NicKind::Other)
            .filter_map(|n| n.netdev.as_deref().and_then(usable))
            .collect();
        if !nics.is_empty() {
            return NicChoice {
                reason: format!(
                    "auto: the placement plan's NICs for this worker ({}) that have an address",
                    w.nic_affinity.label()
                ),
                nics,
            };
        }
    }
    if toward.is_unspecified() {
        return NicChoice::unbound(
            "auto: no NIC of the plan has an address and the address is unspecified; the \
             routing table chooses",
        );
    }
    match route_interface(ifaces, toward).and_then(|name| usable(&name)) {
        Some(nic) => NicChoice {
            reason: format!(
                "auto: no NIC of the plan has an address; the route to {toward} leaves through {}",
                nic.name
            ),
            nics: vec![nic],
        },
        None => NicChoice::unbound(format!(
            "auto: no NIC of the plan has an address and no interface holds the route to \
             {toward}; the routing table chooses"
        )),
    }
}

/// The interface that holds the source address the kernel picks toward `to` (a UDP
/// socket's connect sends nothing).
fn route_interface(ifaces: &[Interface], to: IpAddr) -> Option<String> {
    let any: SocketAddr = if to.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = UdpSocket::bind(any).ok()?;
    s.connect(SocketAddr::new(to, 9)).ok()?;
    let local = s.local_addr().ok()?.ip();
    ifaces
        .iter()
        .find(|i| i.addrs.contains(&local))
        .map(|i| i.name.clone())
}

/// Chooses the NICs of one rail group: `arg` for `kind`, toward `toward` (the peer's
/// address, or for serve the address it listens on), for the plan worker at `slot`.
pub fn choose(
    arg: &Nics,
    kind: TransportKind,
    provider: Option<&str>,
    toward: IpAddr,
    slot: usize,
) -> Result<NicChoice, NicError> {
    match kind {
        TransportKind::Tcp => {
            let ifaces = interfaces()?;
            match arg {
                Nics::Named(names) => Ok(NicChoice {
                    nics: tcp_named(names, &ifaces, toward)?,
                    reason: "--nics".into(),
                }),
                Nics::Auto => {
                    let t = if toward.is_loopback() {
                        None
                    } else {
                        crate::placement::machine()
                    };
                    let plan = t.map(Topology::plan);
                    let w = plan.as_ref().and_then(|p| plan_worker(p, slot)).cloned();
                    Ok(tcp_auto(t, w.as_ref(), &ifaces, toward))
                }
            }
        }
        TransportKind::Efa => {
            if *arg == Nics::Auto && toward.is_loopback() {
                return Ok(NicChoice::unbound(
                    "auto: the peer is on loopback; the provider's first domain",
                ));
            }
            let domains = efa_domains(provider)?;
            match arg {
                Nics::Named(names) => Ok(NicChoice {
                    nics: efa_named(names, &domains)?,
                    reason: "--nics".into(),
                }),
                Nics::Auto => {
                    let Some(t) = crate::placement::machine() else {
                        return Ok(NicChoice::unbound(
                            "auto: no topology to plan with; the provider's first domain",
                        ));
                    };
                    let plan = t.plan();
                    Ok(match plan_worker(&plan, slot) {
                        Some(w) => efa_auto(t, w, &domains),
                        None => NicChoice::unbound("auto: the plan has no worker"),
                    })
                }
            }
        }
        _ => match arg {
            Nics::Auto => Ok(NicChoice::unbound(format!(
                "{} does not run on a NIC",
                kind.name()
            ))),
            Nics::Named(_) => Err(NicError::NotOnNics(kind)),
        },
    }
}

/// [`choose`] for `serve`, listening on `listen`: with `auto` and a tcp listen address that
/// is neither loopback nor unspecified, the interface that holds it (the address the user
/// asked for); otherwise as [`choose`].
pub fn choose_to_serve(
    arg: &Nics,
    kind: TransportKind,
    provider: Option<&str>,
    listen: IpAddr,
    slot: usize,
) -> Result<NicChoice, NicError> {
    if *arg == Nics::Auto
        && kind == TransportKind::Tcp
        && !listen.is_loopback()
        && !listen.is_unspecified()
    {
        let ifaces = interfaces()?;
        if let Some(i) = ifaces.iter().find(|i| i.addrs.contains(&listen)) {
            return Ok(NicChoice {
                nics: vec![RailNic {
                    name: i.name.clone(),
                    ip: Some(listen),
                }],
                reason: format!("auto: the interface that holds the listen address {listen}"),
            });
        }
    }
    choose(arg, kind, provider, listen, slot)
}

/// The domains the libfabric provider lists, in its order.
fn efa_domains(provider: Option<&str>) -> Result<Vec<String>, NicError> {
    let cfg = match provider {
        Some(p) => transport_efa::EfaConfig::with_provider(p),
        None => transport_efa::EfaConfig::default(),
    };
    let name = cfg.provider_name();
    let infos = transport_efa::info(name.as_deref()).map_err(NicError::Domains)?;
    let mut domains: Vec<String> = Vec::new();
    for i in infos {
        if !domains.contains(&i.domain) {
            domains.push(i.domain);
        }
    }
    Ok(domains)
}

/// The rails `--nics auto` gives one worker of the plan, for `xfer topo`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerRails {
    /// The worker's position in the plan (`--per-gpu` worker, `--gpus` position).
    pub worker: usize,
    /// Its GPU (topology index), `None` for the host-only worker.
    pub gpu: Option<u32>,
    /// efa: the NICs (libfabric domains where the provider lists them) and why.
    pub efa: NicChoice,
    /// tcp: the interfaces, toward a peer off this host, and why.
    pub tcp: NicChoice,
}

/// What `bench --nics auto` would run each worker's rails on. `live`: `t` is this machine
/// (its interfaces and libfabric's efa domains are asked); else (a replayed topology) the
/// plan's NICs as they are named, efa domains spelled `<NIC>-rdm` as the efa provider does.
pub fn rail_map(t: &Topology, plan: &PlacementPlan, live: bool) -> Vec<WorkerRails> {
    let efa_domains: Vec<String> = if live {
        efa_domains(Some(transport_efa::DEFAULT_PROVIDER)).unwrap_or_default()
    } else {
        t.nics
            .iter()
            .filter(|n| n.kind.is_rdma())
            .map(|n| format!("{}-rdm", n.name))
            .collect()
    };
    let ifaces: Vec<Interface> = if live {
        interfaces().unwrap_or_default()
    } else {
        // A replay knows names, not addresses: pretend every plan NIC with an interface
        // has one (in the documentation range), so the map shows what the plan would give.
        t.nics
            .iter()
            .filter_map(|n| n.netdev.clone())
            .map(|name| Interface {
                name,
                up: true,
                addrs: vec![IpAddr::from([192, 0, 2, 1])],
            })
            .collect()
    };
    // A peer off this host: the documentation address (a routing decision, nothing sent).
    let toward = IpAddr::from([192, 0, 2, 7]);
    plan.workers
        .iter()
        .enumerate()
        .map(|(i, w)| WorkerRails {
            worker: i,
            gpu: w.gpu.map(|g| g.0),
            efa: efa_auto(t, w, &efa_domains),
            tcp: match tcp_auto(Some(t), Some(w), &ifaces, toward) {
                c if !live && c.nics.is_empty() => NicChoice::unbound(
                    "replayed topology: no NIC of the plan has a network interface; on the \
                     machine itself tcp takes the interface of the route to the peer",
                ),
                c => c,
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Topology {
        let path = format!(
            "{}/../topology/tests/fixtures/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        Topology::from_xml_file(std::path::Path::new(&path)).expect("fixture loads")
    }

    #[test]
    fn nics_parse_as_auto_or_names() {
        assert_eq!("auto".parse::<Nics>().unwrap(), Nics::Auto);
        assert_eq!(
            "veth0,veth1".parse::<Nics>().unwrap(),
            Nics::Named(vec!["veth0".into(), "veth1".into()])
        );
        assert!("veth0,,veth1".parse::<Nics>().is_err());
    }

    #[test]
    fn rails_wrap_around_the_nics() {
        let c = NicChoice {
            nics: ["a", "b"]
                .iter()
                .map(|n| RailNic {
                    name: n.to_string(),
                    ip: None,
                })
                .collect(),
            reason: String::new(),
        };
        assert_eq!(c.default_rails(4), 2);
        let names: Vec<String> = c.per_rail(5).into_iter().map(|n| n.name).collect();
        assert_eq!(names, ["a", "b", "a", "b", "a"]);
        assert_eq!(NicChoice::unbound("x").default_rails(4), 4);
        assert!(NicChoice::unbound("x").per_rail(3).is_empty());
    }

    /// On a p5 every GPU's rails are exactly the 4 EFA domains under its PCIe switch, and
    /// the 8 GPUs together open 32 distinct domains.
    #[test]
    fn p5_gpus_each_get_their_four_switch_local_efa_domains() {
        let t = fixture("p5.48xlarge.xml");
        let plan = t.plan();
        assert_eq!(plan.workers.len(), 8);
        // What the efa provider lists on a p5: `<device>-rdm` for every EFA device.
        let domains: Vec<String> = t
            .nics
            .iter()
            .filter(|n| n.kind == NicKind::Efa)
            .map(|n| format!("{}-rdm", n.name))
            .collect();
        assert_eq!(domains.len(), 32);
        let mut all = Vec::new();
        for (slot, w) in plan.workers.iter().enumerate() {
            let c = efa_auto(&t, plan_worker(&plan, slot).unwrap(), &domains);
            assert_eq!(c.nics.len(), 4, "GPU {slot}: {c:?}");
            assert!(c.reason.contains("same switch"), "{}", c.reason);
            let gpu = t.gpus.iter().find(|g| Some(g.index) == w.gpu).unwrap();
            for n in &c.nics {
                let nic = t
                    .nics
                    .iter()
                    .find(|x| format!("{}-rdm", x.name) == n.name)
                    .unwrap();
                assert_eq!(
                    nic.switch, gpu.switch,
                    "GPU {slot}: {} not under its switch",
                    n.name
                );
                all.push(n.name.clone());
            }
        }
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 32, "--per-gpu opens 32 distinct domains");
    }

    /// Where the plan has no NIC that tcp can use, auto falls back to one NIC, or none,
    /// and says why.
    #[test]
    fn fixtures_without_usable_nics_fall_back_with_a_reason() {
        for name in ["h200-vm.captured.xml", "laptop.xml"] {
            let t = fixture(name);
            let plan = t.plan();
            let w = plan_worker(&plan, 0).unwrap();
            // An interface list that holds none of the plan's NICs but a route.
            let ifaces = vec![Interface {
                name: "wlan9".into(),
                up: true,
                addrs: vec!["10.9.0.1".parse().unwrap()],
            }];
            let c = tcp_auto(Some(&t), Some(w), &ifaces, "10.9.0.7".parse().unwrap());
            assert!(c.nics.len() <= 1, "{name}: {c:?}");
            assert!(c.reason.starts_with("auto: "), "{name}: {}", c.reason);
            let e = efa_auto(&t, w, &["lo".to_string()]);
            assert!(e.nics.is_empty(), "{name}: {e:?}");
            assert!(e.reason.contains("first domain (lo)"), "{}", e.reason);
        }
        // The H200 VM's plan NIC is eth0: when it has an address, auto takes it.
        let t = fixture("h200-vm.captured.xml");
        let plan = t.plan();
        let eth = t.nics.iter().find_map(|n| n.netdev.clone());
        if let Some(eth) = eth {
            let ifaces = vec![Interface {
                name: eth.clone(),
                up: true,
                addrs: vec!["172.16.0.5".parse().unwrap()],
            }];
            let c = tcp_auto(
                Some(&t),
                plan_worker(&plan, 0),
                &ifaces,
                "172.16.0.9".parse().unwrap(),
            );
            assert_eq!(c.nics.len(), 1, "{c:?}");
            assert_eq!(c.nics[0].name, eth);
        }
    }

    #[test]
    fn loopback_is_unbound() {
        let c = tcp_auto(None, None, &[], "127.0.0.1".parse().unwrap());
        assert!(c.nics.is_empty());
        assert!(c.reason.contains("loopback"));
    }

    #[test]
    fn unknown_down_and_addressless_nics_are_named_with_the_ones_that_exist() {
        let ifaces = vec![
            Interface {
                name: "eth0".into(),
                up: true,
                addrs: vec!["10.0.0.1".parse().unwrap()],
            },
            Interface {
                name: "veth1".into(),
                up: false,
                addrs: vec!["10.0.1.1".parse().unwrap()],
            },
            Interface {
                name: "veth2".into(),
                up: true,
                addrs: vec![],
            },
        ];
        let to: IpAddr = "10.0.0.2".parse().unwrap();
        let e = tcp_named(&["nope".into()], &ifaces, to)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"nope\"") && e.contains("eth0, veth1, veth2"),
            "{e}"
        );
        let e = tcp_named(&["veth1".into()], &ifaces, to)
            .unwrap_err()
            .to_string();
        assert!(e.contains("down"), "{e}");
        let e = tcp_named(&["veth2".into()], &ifaces, to)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no IPv4 address"), "{e}");
        let ok = tcp_named(&["eth0".into()], &ifaces, to).unwrap();
        assert_eq!(ok[0].ip, Some("10.0.0.1".parse().unwrap()));
        let e = efa_named(&["rdmap9".into()], &["lo".into(), "eth0".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"rdmap9\"") && e.contains("lo, eth0"), "{e}");
    }
}
