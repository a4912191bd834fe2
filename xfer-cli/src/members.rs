//! The cluster directory in the CLI, on the library's discovery ([`xfer::discovery`]):
//! `serve --directory --name` publishes the server's agent ([`xfer::Agent::publish`]),
//! `bench --peer-name` finds one by name ([`xfer::discovery::lookup`]), `bench --peers all`
//! follows the cluster ([`xfer::Agent::follow`]) and writes to every member in turn as
//! members come and go, and `xfer members` lists or watches a cluster's records
//! ([`directory::Record`]).

use crate::backend::alloc;
use crate::control::BenchClient;
use crate::{BenchArgs, CliError, OpArg, workload_of};
use directory::{Directory, Event, Member, Record};
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};
use xfer::discovery::{FollowEvent, Publication};
use xfer::layers::AgentLayers;
use xfer::{Access, Agent, AgentOptions, Region, Role};

/// Where the cluster directory is, and which cluster.
#[derive(clap::Args, Clone, Debug)]
pub struct DirectoryArgs {
    /// The cluster directory: etcd://HOST:PORT[,HOST:PORT...] or file://PATH.
    #[arg(long, env = "XFER_DIRECTORY")]
    pub directory: Option<String>,
    /// The cluster within the directory.
    #[arg(long, env = "XFER_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// A file holding the cluster's token: records published are signed with it, and only
    /// records signed with it are read (see docs/security.md). Without it the directory is
    /// open.
    #[arg(long, env = "XFER_DIRECTORY_TOKEN_FILE")]
    pub directory_token_file: Option<std::path::PathBuf>,
    /// etcd over TLS: the CA certificate (PEM) etcd's certificate must chain to.
    #[arg(long, env = "XFER_ETCD_CA")]
    pub etcd_ca: Option<std::path::PathBuf>,
    /// etcd over TLS: this client's certificate (PEM), where etcd asks for one.
    #[arg(
        long,
        env = "XFER_ETCD_CERT",
        requires = "etcd_ca",
        requires = "etcd_key"
    )]
    pub etcd_cert: Option<std::path::PathBuf>,
    /// etcd over TLS: this client's key (PEM).
    #[arg(long, env = "XFER_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<std::path::PathBuf>,
    /// The etcd user to authenticate as (with --etcd-password-file).
    #[arg(long, env = "XFER_ETCD_USER", requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    /// A file holding the etcd user's password.
    #[arg(long, env = "XFER_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<std::path::PathBuf>,
}

impl DirectoryArgs {
    /// Opens the directory, if one was given.
    fn open(&self) -> Result<Option<Box<dyn Directory>>, CliError> {
        let Some(url) = &self.directory else {
            return Ok(None);
        };
        directory::record::check_name("cluster", &self.cluster)
            .map_err(|e| CliError::Usage(format!("--cluster: {e}")))?;
        Ok(Some(xfer::discovery::open_with(url, &self.config()?)?))
    }

    /// The directory's configuration from the flags. Without a token the directory is
    /// open, and regions are published in unsigned records as before (with a warning).
    fn config(&self) -> Result<xfer::discovery::DirectoryConfig, CliError> {
        let read = |flag: &str, path: &std::path::Path| {
            xfer::read_token_file(path).map_err(|e| CliError::Usage(format!("{flag}: {e}")))
        };
        let mut config = xfer::discovery::DirectoryConfig::open();
        if let Some(p) = &self.directory_token_file {
            config.token = Some(read("--directory-token-file", p)?);
        }
        if let Some(ca) = &self.etcd_ca {
            config.etcd.tls = Some(xfer::discovery::EtcdTls {
                ca: ca.clone(),
                cert: self.etcd_cert.clone(),
                key: self.etcd_key.clone(),
            });
        }
        if let (Some(name), Some(p)) = (&self.etcd_user, &self.etcd_password_file) {
            config.etcd.user = Some(xfer::discovery::EtcdUser {
                name: name.clone(),
                password: read("--etcd-password-file", p)?,
            });
        }
        Ok(config)
    }

    /// Opens the directory, which `what` needs.
    fn require(&self, what: &str) -> Result<Box<dyn Directory>, CliError> {
        self.open()?
            .ok_or_else(|| CliError::Usage(format!("{what} needs --directory (or XFER_DIRECTORY)")))
    }
}

/// What `serve` publishes, from its flags.
#[derive(clap::Args, Clone, Debug)]
pub struct PublishArgs {
    #[command(flatten)]
    pub dir: DirectoryArgs,
    /// This server's name in the cluster (with --directory); a Kubernetes pod name, say.
    #[arg(long, env = "XFER_NAME")]
    pub name: Option<String>,
    /// Seconds the record outlives this process if it dies without withdrawing it.
    #[arg(long, default_value_t = 10)]
    pub ttl: u64,
    /// The host peers reach this server at, when --listen is every interface (0.0.0.0);
    /// a pod's IP, say.
    #[arg(long, env = "XFER_ADVERTISE")]
    pub advertise: Option<IpAddr>,
}

/// A server about to publish itself: the directory, its name there, and where peers reach
/// its control port.
pub struct Publishing {
    dir: Box<dyn Directory>,
    cluster: String,
    /// Its member name (its agent's name).
    pub name: String,
    /// Where peers say hello (its agent's [`control`](xfer::AgentOptions::control)).
    pub control: SocketAddr,
    ttl: Duration,
}

impl Publishing {
    /// What `serve` will publish with these flags, its control port at `ctl` (checked and
    /// the directory opened before anything is built); `None` without a directory.
    pub fn of(p: &PublishArgs, ctl: SocketAddr) -> Result<Option<Publishing>, CliError> {
        let name = match (&p.dir.directory, &p.name) {
            (None, None) => return Ok(None),
            (None, Some(_)) => return Err(CliError::Usage("--name needs --directory".into())),
            (Some(_), None) => {
                return Err(CliError::Usage("--directory needs --name for serve".into()));
            }
            (Some(_), Some(n)) => n.clone(),
        };
        directory::record::check_name("member", &name)
            .map_err(|e| CliError::Usage(format!("--name: {e}")))?;
        let host = match (ctl.ip(), p.advertise) {
            (_, Some(ip)) => ip,
            (ip, None) if ip.is_unspecified() => {
                return Err(CliError::Usage(format!(
                    "serving on every interface ({ip}): say which address peers reach this server \
                     at with --advertise IP (in Kubernetes, the pod IP)"
                )));
            }
            (ip, None) => ip,
        };
        Ok(Some(Publishing {
            dir: p.dir.require("serve --name")?,
            cluster: p.dir.cluster.clone(),
            name,
            control: SocketAddr::new(host, ctl.port()),
            ttl: Duration::from_secs(p.ttl.max(1)),
        }))
    }

    /// Publishes `agent` (built with this name and control address): its record stays while
    /// the publication lives. Each client still gets its own region at its hello.
    pub fn publish(&self, agent: &Agent) -> Result<Publication, CliError> {
        let publication = agent.publish(&*self.dir, &self.cluster, self.ttl)?;
        eprintln!(
            "xfer: published as {} in cluster {} at {} (ttl {} s)",
            self.name,
            self.cluster,
            self.dir.endpoint(),
            self.ttl.as_secs()
        );
        Ok(publication)
    }
}

/// The control address member `name` published (`None`: it serves no rendezvous).
fn control_of(name: &str, info: &xfer::AgentInfo, where_: &str) -> Result<SocketAddr, CliError> {
    let c = info.control.as_deref().ok_or_else(|| {
        CliError::failed(format!(
            "member {name} in {where_} offers no control address (not an xfer serve)"
        ))
    })?;
    c.parse().map_err(|e| {
        CliError::because(
            format!("member {name}: control address {c:?} in {where_}"),
            e,
        )
    })
}

/// The server bench writes to: `--peer`, or `--peer-name` looked up in the directory.
pub fn resolve_peer(a: &BenchArgs) -> Result<String, CliError> {
    match (&a.peer, &a.peer_name) {
        (Some(_), Some(_)) => Err(CliError::Usage(
            "give --peer or --peer-name, not both".into(),
        )),
        (Some(p), None) => Ok(p.clone()),
        (None, Some(name)) => {
            let dir = a.dir.require("--peer-name")?;
            let cluster = &a.dir.cluster;
            match xfer::discovery::lookup(&*dir, cluster, name)? {
                Some(m) => Ok(format!(
                    "xfer://{}",
                    control_of(name, &m.info, &dir.endpoint())?
                )),
                None => {
                    let names: Vec<String> = dir
                        .members(cluster)
                        .map(|l| {
                            l.members
                                .iter()
                                .map(|m| m.record.name().to_owned())
                                .collect()
                        })
                        .unwrap_or_default();
                    Err(CliError::failed(format!(
                        "no member {name:?} in cluster {cluster} at {} (members: {})",
                        dir.endpoint(),
                        if names.is_empty() {
                            "none".to_string()
                        } else {
                            names.join(", ")
                        }
                    )))
                }
            }
        }
        (None, None) => Err(CliError::Usage(
            "bench needs --peer xfer://HOST:PORT, --peer-name NAME or --peers all".into(),
        )),
    }
}

/// One round of `bench --peers all`, as printed.
#[derive(Serialize)]
struct Round<'a> {
    round: u64,
    member: &'a str,
    /// Milliseconds since the bench started.
    at_ms: u64,
    ok: bool,
    bytes: u64,
    gbps: f64,
    verified: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// What `bench --peers all` did with each member.
#[derive(Default, Serialize)]
struct Tally {
    ok: u64,
    failed: u64,
    bytes: u64,
}

/// `bench --peers all`: one agent follows the cluster, and the workload goes to each
/// connected member in turn (by name), for `--duration` seconds, as members join and
/// leave: each round says hello to the member's rendezvous for a region of its own,
/// connects, writes (or reads) and verifies. A member whose round fails (it died
/// mid-transfer, say) is reported and the next member gets its turn; the run goes on.
/// Fails only if no round succeeded.
pub fn bench_all(a: BenchArgs) -> Result<(), CliError> {
    if a.peer.is_some() || a.peer_name.is_some() {
        return Err(CliError::Usage(
            "--peers all writes to the directory's members: leave out --peer and --peer-name"
                .into(),
        ));
    }
    if a.per_gpu || a.baseline || a.knobs.latency {
        return Err(CliError::Usage(
            "--peers all runs the throughput workload with one worker: leave out --per-gpu, \
             --baseline and --latency"
                .into(),
        ));
    }
    let dir = a.dir.require("--peers all")?;
    let w = workload_of(&a.knobs)?;
    a.backend.check_gpus()?;
    let k = &a.knobs;
    let json = k.json;
    // One agent for every round: it listens on every interface, and its NICs face the
    // members (`--nics auto` takes the route toward the first member there is now, none
    // toward loopback; without a member yet, the plan's NICs or the routing table).
    let first = dir.members(&a.dir.cluster)?.members.iter().find_map(|m| {
        m.record
            .agent
            .control
            .as_deref()?
            .parse::<SocketAddr>()
            .ok()
    });
    let agent = Agent::new(AgentOptions {
        role: Role::Initiator,
        listen: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        toward: first.map(|c| c.ip()),
        ..a.backend.options(k.pin, k.rails_asked)?
    })?;
    let read = k.op == OpArg::Read;
    if let Some(p) = agent.home() {
        p.prefer_memory_here("xfer-main");
    }
    let local = alloc(agent.info().memory, k.region_size)?;
    if !read {
        crate::workload::fill_pattern(&*local, k.seed)?;
    }
    let access = if read {
        Access::LOCAL_WRITE
    } else {
        Access::NONE
    };
    let src = agent.register(local.clone(), access)?;
    let following = agent.follow(&*dir, &a.dir.cluster)?;
    let start = Instant::now();
    let until = start + Duration::from_secs(a.duration);
    let mut tally: BTreeMap<String, Tally> = BTreeMap::new();
    let mut last: Option<String> = None;
    let mut round = 0u64;
    let say = |e: FollowEvent| {
        if json {
            return;
        }
        match e {
            FollowEvent::Joined(name) => eprintln!("xfer: member {name} joined"),
            FollowEvent::Left(name) => eprintln!("xfer: member {name} left"),
            FollowEvent::Unreachable { name, error } => eprintln!(
                "xfer: member {name} cannot be connected: {}",
                fabric_core::error::report(&error)
            ),
            FollowEvent::Incompatible { name, theirs, ours } => eprintln!(
                "xfer: member {name} offers {theirs:?}, this bench {ours:?}: no transport in \
                 common"
            ),
            _ => {}
        }
    };
    while Instant::now() < until {
        while let Some(e) = following.try_event() {
            say(e);
        }
        let members: BTreeMap<String, xfer::discovery::Connected> = following
            .peers()
            .into_iter()
            .map(|c| (c.name().to_owned(), c))
            .collect();
        // The member after the last one, by name.
        let next = last
            .as_ref()
            .and_then(|l| {
                members
                    .range::<String, _>((std::ops::Bound::Excluded(l), std::ops::Bound::Unbounded))
                    .next()
            })
            .or_else(|| members.iter().next())
            .map(|(n, c)| (n.clone(), c.member.info.clone()));
        let Some((name, info)) = next else {
            let left = until.saturating_duration_since(Instant::now());
            if let Some(e) = following.next_event(left.min(Duration::from_millis(200))) {
                say(e);
            }
            continue;
        };
        last = Some(name.clone());
        round += 1;
        let result = control_of(&name, &info, &dir.endpoint())
            .and_then(|ctl| one_round(&agent, &src, &local, &a, ctl, &w));
        let t = tally.entry(name.clone()).or_default();
        let r = match result {
            Ok((bytes, gbps)) => {
                t.ok += 1;
                t.bytes += bytes;
                Round {
                    round,
                    member: &name,
                    at_ms: start.elapsed().as_millis() as u64,
                    ok: true,
                    bytes,
                    gbps,
                    verified: !k.no_verify,
                    error: None,
                }
            }
            Err(e) => {
                t.failed += 1;
                Round {
                    round,
                    member: &name,
                    at_ms: start.elapsed().as_millis() as u64,
                    ok: false,
                    bytes: 0,
                    gbps: 0.0,
                    verified: false,
                    error: Some(fabric_core::error::report(&e)),
                }
            }
        };
        if json {
            outln!("{}", serde_json::to_string(&r).unwrap_or_default());
        } else if r.ok {
            outln!(
                "round {round}: {name}: {} at {:.2} Gbps{}",
                crate::size::format_size(r.bytes),
                r.gbps,
                if r.verified { ", verified" } else { "" }
            );
        } else {
            outln!(
                "round {round}: {name}: failed: {}",
                r.error.as_deref().unwrap_or("")
            );
        }
    }
    let ok: u64 = tally.values().map(|t| t.ok).sum();
    if json {
        outln!(
            "{}",
            serde_json::json!({ "summary": { "rounds": round, "members": tally } })
        );
    } else {
        for (n, t) in &tally {
            outln!(
                "{n}: {} rounds ok, {} failed, {}",
                t.ok,
                t.failed,
                crate::size::format_size(t.bytes)
            );
        }
    }
    if ok == 0 {
        return Err(CliError::failed(format!(
            "no round succeeded in {} s ({} members seen)",
            a.duration,
            tally.len()
        )));
    }
    Ok(())
}

/// One member's round, from `agent`'s region `src` (memory `local`): hello at its control
/// address for a region, connect, warm up, the workload, the check; then the member is
/// disconnected (the region it gave goes when the control connection closes).
fn one_round(
    agent: &Agent,
    src: &Region,
    local: &std::sync::Arc<dyn fabric_core::MemoryRegion>,
    a: &BenchArgs,
    ctl: SocketAddr,
    w: &crate::workload::Workload,
) -> Result<(u64, f64), CliError> {
    let k = &a.knobs;
    let (client, welcome) = crate::remote::say_hello(a, agent, ctl, None)?;
    let mut ctl = BenchClient(client);
    let remote = crate::remote::region_of(&welcome, k)?;
    if k.op == OpArg::Read {
        ctl.fill(k.seed)?;
    }
    let peer = agent.connect(&welcome.agent)?;
    let run = (|| {
        crate::warm_up(agent, &peer, src, &remote, k)?;
        // Quiet: the round's line is the report.
        let mut progress = crate::progress::Progress::new(true);
        let report = crate::workload::run(agent, src, &peer, &remote, w, &mut progress)?;
        crate::remote::check(k, &mut ctl, &**local, &report)?;
        Ok((report.bytes, report.gbps()))
    })();
    if let Err(e) = agent.disconnect(&peer) {
        tracing::warn!(error = %fabric_core::error::report(&e), "disconnect failed");
    }
    run
}

/// `xfer members`: the cluster's members, or with `--watch` their joins and leaves live.
#[derive(clap::Args)]
pub struct MembersArgs {
    #[command(flatten)]
    dir: DirectoryArgs,
    /// After the listing, print joins, updates and leaves as they happen.
    #[arg(long)]
    watch: bool,
    /// With --watch, stop after this many seconds (default: until stopped).
    #[arg(long, value_name = "SECS")]
    watch_for: Option<u64>,
    /// JSON: the listing as one array; with --watch, one object per event.
    #[arg(long)]
    json: bool,
}

/// A member as `xfer members` shows it.
#[derive(Serialize)]
struct Shown {
    name: String,
    /// Its control address (where it says hello), else its first rail's address.
    address: String,
    age_s: u64,
    /// The transports it offers, in the order it prefers them.
    transport: String,
    /// Its host's name (for people: two pods of one node have different ones).
    host: String,
    /// Whether it runs on this host (the same boot id).
    same_host: bool,
    memory: String,
    gpu: Option<u32>,
    nics: Vec<String>,
    regions: Vec<String>,
    instance: String,
}

impl Shown {
    fn of(r: &Record, boot_id: &str) -> Shown {
        let a = &r.agent;
        let mut nics: Vec<String> = Vec::new();
        for n in a.transports.iter().flat_map(|t| &t.nics) {
            if !nics.contains(n) {
                nics.push(n.clone());
            }
        }
        Shown {
            name: r.name().to_owned(),
            address: a
                .control
                .clone()
                .or_else(|| {
                    a.transports
                        .first()
                        .and_then(|t| t.rails.first())
                        .map(|x| crate::address_to_text(x))
                })
                .unwrap_or_default(),
            age_s: r.age().as_secs(),
            transport: a
                .transports
                .iter()
                .map(|t| t.kind.name())
                .collect::<Vec<_>>()
                .join(","),
            host: a.hostname.clone(),
            same_host: !boot_id.is_empty() && a.boot_id == boot_id,
            memory: crate::backend::memory_name(a.memory).to_owned(),
            gpu: match a.memory {
                fabric_core::MemoryLocation::Cuda { device } => Some(device),
                fabric_core::MemoryLocation::Host => None,
            },
            nics,
            regions: r.regions.keys().cloned().collect(),
            instance: format!("{:016x}", r.instance()),
        }
    }

    /// Its host column: the hostname, marked when it is this host.
    fn host_text(&self) -> String {
        match (self.host.is_empty(), self.same_host) {
            (true, true) => "(this host)".into(),
            (true, false) => "-".into(),
            (false, true) => format!("{} (this host)", self.host),
            (false, false) => self.host.clone(),
        }
    }
}

/// Runs `xfer members`.
pub fn members(a: MembersArgs) -> Result<(), CliError> {
    let dir = a.dir.require("xfer members")?;
    let boot_id = transport_cuda_ipc::boot_id().unwrap_or_default();
    // A watch reports every member present as a join first, then each change from the
    // revision of that listing: nothing between the two is missed.
    if a.watch {
        let watch = dir.watch(&a.dir.cluster)?;
        let until = a.watch_for.map(|s| Instant::now() + Duration::from_secs(s));
        loop {
            let left = until.map(|u| u.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(());
            }
            let Some(e) = watch.next(
                left.unwrap_or(Duration::from_secs(1))
                    .min(Duration::from_secs(1)),
            )?
            else {
                continue;
            };
            let (what, m): (&str, &Member) = match &e {
                Event::Joined(m) => ("joined", m),
                Event::Updated { new, .. } => ("updated", new),
                Event::Left(m) => ("left", m),
                Event::Skipped { key, error } => {
                    if a.json {
                        outln!(
                            "{}",
                            serde_json::json!({"event": "skipped", "key": key, "error": error.to_string()})
                        );
                    } else {
                        outln!("skipped {key}: {error}");
                    }
                    continue;
                }
                _ => continue,
            };
            let s = Shown::of(&m.record, &boot_id);
            if a.json {
                outln!("{}", serde_json::json!({"event": what, "member": s}));
            } else {
                outln!("{what} {} {} {}", s.name, s.address, s.transport);
            }
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
    }
    let listing = dir.members(&a.dir.cluster)?;
    for (key, e) in &listing.skipped {
        eprintln!("xfer: warning: skipped {key}: {e}");
    }
    let shown: Vec<Shown> = listing
        .members
        .iter()
        .map(|m| Shown::of(&m.record, &boot_id))
        .collect();
    if a.json {
        outln!("{}", serde_json::to_string(&shown).unwrap_or_default());
        return Ok(());
    }
    if shown.is_empty() {
        outln!(
            "no members in cluster {} at {}",
            a.dir.cluster,
            dir.endpoint()
        );
        return Ok(());
    }
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(["name", "address", "age", "transport", "host", "gpu", "nics"]);
    for s in &shown {
        t.add_row([
            s.name.clone(),
            s.address.clone(),
            format!("{} s", s.age_s),
            s.transport.clone(),
            s.host_text(),
            s.gpu.map_or("-".into(), |g| g.to_string()),
            if s.nics.is_empty() {
                "-".into()
            } else {
                s.nics.join(",")
            },
        ]);
    }
    outln!("{t}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::MemoryLocation;
    use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};

    #[test]
    fn a_member_is_shown_from_its_agent_and_on_this_host_by_boot_id() {
        let mut tcp = TransportInfo::new(TransportKind::Tcp, vec![b"tcp://10.0.0.5:4000".to_vec()]);
        tcp.nics = vec!["eth1".into()];
        let agent = AgentInfo {
            hostname: "pod-a".into(),
            control: Some("10.0.0.5:7471".into()),
            transports: vec![
                TransportInfo::new(TransportKind::CudaIpc, vec![b"ipc".to_vec()]),
                tcp,
            ],
            ..AgentInfo::new("kv-0", "boot-1", MemoryLocation::Cuda { device: 3 })
        };
        let r = Record::new("kv", agent);
        let here = Shown::of(&r, "boot-1");
        assert_eq!(here.name, "kv-0");
        assert_eq!(here.address, "10.0.0.5:7471");
        assert_eq!(here.transport, "cuda-ipc,tcp");
        assert_eq!((here.memory.as_str(), here.gpu), ("cuda", Some(3)));
        assert_eq!(here.nics, ["eth1"]);
        assert_eq!(here.host_text(), "pod-a (this host)");
        // Another pod of another node: its hostname alone; a pod of this node with another
        // hostname is still this host (the boot id decides).
        let there = Shown::of(&r, "boot-2");
        assert!(!there.same_host);
        assert_eq!(there.host_text(), "pod-a");
        assert!(
            Shown::of(&r, "").host_text() == "pod-a",
            "an unknown boot id is no match"
        );
        let json = serde_json::to_value(&here).unwrap();
        for field in [
            "name",
            "address",
            "age_s",
            "transport",
            "host",
            "memory",
            "gpu",
            "nics",
            "regions",
            "instance",
        ] {
            assert!(json.get(field).is_some(), "no {field}: {json}");
        }
    }
}
