//! The cluster directory in the CLI ([`directory`]): `serve --directory --name` publishes
//! the server, `bench --peer-name` finds one by name, `bench --peers all` writes to every
//! member in turn as members come and go, and `xfer members` lists or watches a cluster.

use crate::backend::MemoryKind;
use crate::nics::{self, NicChoice};
use crate::placement::WorkerPins;
use crate::{BenchArgs, CliError, workload_of};
use directory::{Directory, Event, Member, Publication, Record};
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// Where the cluster directory is, and which cluster.
#[derive(clap::Args, Clone, Debug)]
pub struct DirectoryArgs {
    /// The cluster directory: etcd://HOST:PORT[,HOST:PORT...] or file://PATH.
    #[arg(long, env = "XFER_DIRECTORY")]
    pub directory: Option<String>,
    /// The cluster within the directory.
    #[arg(long, env = "XFER_CLUSTER", default_value = "default")]
    pub cluster: String,
}

impl DirectoryArgs {
    /// Opens the directory, if one was given.
    fn open(&self) -> Result<Option<Box<dyn Directory>>, CliError> {
        let Some(url) = &self.directory else {
            return Ok(None);
        };
        directory::record::check_name("cluster", &self.cluster)
            .map_err(|e| CliError::Usage(format!("--cluster: {e}")))?;
        directory::open(url).map(Some).map_err(dir_error)
    }

    /// Opens the directory, which `what` needs.
    fn require(&self, what: &str) -> Result<Box<dyn Directory>, CliError> {
        self.open()?
            .ok_or_else(|| CliError::Usage(format!("{what} needs --directory (or XFER_DIRECTORY)")))
    }
}

/// A directory error as the CLI reports it (with its sources).
fn dir_error(e: directory::Error) -> CliError {
    CliError::Failed(fabric_core::error::report(&e))
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

/// What a server offers, for its record.
pub struct Offer<'a> {
    pub ctl: SocketAddr,
    pub transport: &'static str,
    pub addresses: Vec<Vec<u8>>,
    pub memory: MemoryKind,
    pub gpu: Option<u32>,
    pub nics: &'a NicChoice,
}

/// Publishes the server (with `--directory`): its control address, rails and NICs; each
/// client still gets its own region from the control channel. `None` without a directory.
pub fn publish(p: &PublishArgs, offer: Offer<'_>) -> Result<Option<Publication>, CliError> {
    let name = match (&p.dir.directory, &p.name) {
        (None, None) => return Ok(None),
        (None, Some(_)) => return Err(CliError::Usage("--name needs --directory".into())),
        (Some(_), None) => {
            return Err(CliError::Usage("--directory needs --name for serve".into()));
        }
        (Some(_), Some(n)) => n.as_str(),
    };
    directory::record::check_name("member", name)
        .map_err(|e| CliError::Usage(format!("--name: {e}")))?;
    let host = match (offer.ctl.ip(), p.advertise) {
        (_, Some(ip)) => ip,
        (ip, None) if ip.is_unspecified() => {
            return Err(CliError::Usage(format!(
                "serving on every interface ({ip}): say which address peers reach this server at \
                 with --advertise IP (in Kubernetes, the pod IP)"
            )));
        }
        (ip, None) => ip,
    };
    let dir = p.dir.require("serve --name")?;
    let mut r = Record::new(&p.dir.cluster, name, offer.transport);
    r.control = Some(SocketAddr::new(host, offer.ctl.port()).to_string());
    r.addresses = offer.addresses;
    r.memory = offer.memory.name().into();
    r.gpu = offer.gpu;
    r.nics = offer.nics.nics.iter().map(|n| n.name.clone()).collect();
    let publication = dir
        .publish(r, Duration::from_secs(p.ttl.max(1)))
        .map_err(dir_error)?;
    eprintln!(
        "xfer: published as {name} in cluster {} at {} (ttl {} s)",
        p.dir.cluster,
        dir.endpoint(),
        p.ttl.max(1)
    );
    Ok(Some(publication))
}

/// The control address of member `name`.
fn control_of(m: &Member, dir: &dyn Directory) -> Result<SocketAddr, CliError> {
    let c = m.record.control.as_deref().ok_or_else(|| {
        CliError::Failed(format!(
            "member {} in {} offers no control address (not an xfer serve)",
            m.record.name,
            dir.endpoint()
        ))
    })?;
    c.parse().map_err(|e| {
        CliError::Failed(format!(
            "member {}: control address {c:?} in {}: {e}",
            m.record.name,
            dir.endpoint()
        ))
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
            match dir.lookup(cluster, name).map_err(dir_error)? {
                Some(m) => Ok(format!("xfer://{}", control_of(&m, &*dir)?)),
                None => {
                    let names: Vec<String> = dir
                        .members(cluster)
                        .map(|l| l.members.into_iter().map(|m| m.record.name).collect())
                        .unwrap_or_default();
                    Err(CliError::Failed(format!(
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

/// `bench --peers all`: the workload to each member in turn (by name), for `--duration`
/// seconds, following the cluster as members join and leave. A member whose round fails
/// (it died mid-transfer, say) is reported and the next member gets its turn; the run goes
/// on. Fails only if no round succeeded.
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
    let watch = dir.watch(&a.dir.cluster).map_err(dir_error)?;
    let w = workload_of(&a.knobs)?;
    let json = a.knobs.json;
    let start = Instant::now();
    let until = start + Duration::from_secs(a.duration);
    let mut members: BTreeMap<String, Member> = BTreeMap::new();
    let mut tally: BTreeMap<String, Tally> = BTreeMap::new();
    let mut last: Option<String> = None;
    let mut round = 0u64;
    let follow = |members: &mut BTreeMap<String, Member>, e: Event| match e {
        Event::Joined(m) => {
            if !json {
                eprintln!("xfer: member {} joined", m.record.name);
            }
            members.insert(m.record.name.clone(), m);
        }
        Event::Updated { new, .. } => {
            members.insert(new.record.name.clone(), *new);
        }
        Event::Left(m) => {
            if !json {
                eprintln!("xfer: member {} left", m.record.name);
            }
            members.remove(&m.record.name);
        }
        _ => {}
    };
    while Instant::now() < until {
        while let Some(e) = watch.try_next() {
            follow(&mut members, e);
        }
        // The member after the last one, by name.
        let next = last
            .as_ref()
            .and_then(|l| {
                members
                    .range::<String, _>((std::ops::Bound::Excluded(l), std::ops::Bound::Unbounded))
                    .next()
            })
            .or_else(|| members.iter().next())
            .map(|(n, m)| (n.clone(), m.clone()));
        let Some((name, m)) = next else {
            let left = until.saturating_duration_since(Instant::now());
            if let Ok(Some(e)) = watch.next(left.min(Duration::from_millis(200))) {
                follow(&mut members, e);
            }
            continue;
        };
        last = Some(name.clone());
        round += 1;
        let result = control_of(&m, &*dir).and_then(|ctl| one_round(&a, ctl, &w));
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
                    verified: !a.knobs.no_verify,
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
                    error: Some(e.to_string()),
                }
            }
        };
        if json {
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
        } else if r.ok {
            println!(
                "round {round}: {name}: {} at {:.2} Gbps{}",
                crate::size::format_size(r.bytes),
                r.gbps,
                if r.verified { ", verified" } else { "" }
            );
        } else {
            println!(
                "round {round}: {name}: failed: {}",
                r.error.as_deref().unwrap_or("")
            );
        }
    }
    let ok: u64 = tally.values().map(|t| t.ok).sum();
    if json {
        println!(
            "{}",
            serde_json::json!({ "summary": { "rounds": round, "members": tally } })
        );
    } else {
        for (n, t) in &tally {
            println!(
                "{n}: {} rounds ok, {} failed, {}",
                t.ok,
                t.failed,
                crate::size::format_size(t.bytes)
            );
        }
    }
    if ok == 0 {
        return Err(CliError::Failed(format!(
            "no round succeeded in {} s ({} members seen)",
            a.duration,
            tally.len()
        )));
    }
    Ok(())
}

/// One member's round: the usual bench worker against its control address.
fn one_round(
    a: &BenchArgs,
    ctl: SocketAddr,
    w: &crate::workload::Workload,
) -> Result<(u64, f64), CliError> {
    let choices: Vec<NicChoice> =
        nics::per_worker(&a.backend, false, ctl.ip(), false).map_err(CliError::Usage)?;
    let first = choices
        .first()
        .cloned()
        .unwrap_or_else(|| NicChoice::unbound(""));
    let mut a = a.clone();
    a.knobs.rails = a.knobs.rails_asked.unwrap_or(first.default_rails(1));
    crate::setup::check_rails(a.knobs.rails).map_err(CliError::Usage)?;
    // Quiet: the round's line is the report.
    a.knobs.json = true;
    let pins = WorkerPins::for_this_machine(a.knobs.pin);
    let rails = (
        pins.rail_pins(pins.initiator, a.knobs.rails, 0),
        pins.initiator,
    );
    let (_, report, _, _) = crate::remote::bench_worker(&a, ctl, w, None, rails, None, &first)?;
    Ok((report.bytes, report.gbps()))
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
    address: String,
    age_s: u64,
    transport: String,
    host: String,
    memory: String,
    gpu: Option<u32>,
    nics: Vec<String>,
    regions: Vec<String>,
    instance: String,
}

impl Shown {
    fn of(m: &Member) -> Shown {
        let r = &m.record;
        Shown {
            name: r.name.clone(),
            address: r
                .control
                .clone()
                .or_else(|| r.addresses.first().map(|a| crate::address_to_text(a)))
                .unwrap_or_default(),
            age_s: r.age().as_secs(),
            transport: r.transport.clone(),
            host: r.host.clone(),
            memory: r.memory.clone(),
            gpu: r.gpu,
            nics: r.nics.clone(),
            regions: r.regions.keys().cloned().collect(),
            instance: format!("{:016x}", r.instance),
        }
    }
}

/// Runs `xfer members`.
pub fn members(a: MembersArgs) -> Result<(), CliError> {
    let dir = a.dir.require("xfer members")?;
    // A watch reports every member present as a join first, then each change from the
    // revision of that listing: nothing between the two is missed.
    if a.watch {
        let watch = dir.watch(&a.dir.cluster).map_err(dir_error)?;
        let until = a.watch_for.map(|s| Instant::now() + Duration::from_secs(s));
        loop {
            let left = until.map(|u| u.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(());
            }
            let Some(e) = watch
                .next(
                    left.unwrap_or(Duration::from_secs(1))
                        .min(Duration::from_secs(1)),
                )
                .map_err(dir_error)?
            else {
                continue;
            };
            let (what, m) = match &e {
                Event::Joined(m) => ("joined", Some(m)),
                Event::Updated { new, .. } => ("updated", Some(&**new)),
                Event::Left(m) => ("left", Some(m)),
                Event::Skipped { key, error } => {
                    if a.json {
                        println!(
                            "{}",
                            serde_json::json!({"event": "skipped", "key": key, "error": error.to_string()})
                        );
                    } else {
                        println!("skipped {key}: {error}");
                    }
                    continue;
                }
                _ => continue,
            };
            let Some(m) = m else { continue };
            let s = Shown::of(m);
            if a.json {
                println!("{}", serde_json::json!({"event": what, "member": s}));
            } else {
                println!("{what} {} {} {}", s.name, s.address, s.transport);
            }
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
    }
    let listing = dir.members(&a.dir.cluster).map_err(dir_error)?;
    for (key, e) in &listing.skipped {
        eprintln!("xfer: warning: skipped {key}: {e}");
    }
    let shown: Vec<Shown> = listing.members.iter().map(Shown::of).collect();
    if a.json {
        println!("{}", serde_json::to_string(&shown).unwrap_or_default());
        return Ok(());
    }
    if shown.is_empty() {
        println!(
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
            s.host.clone(),
            s.gpu.map_or("-".into(), |g| g.to_string()),
            if s.nics.is_empty() {
                "-".into()
            } else {
                s.nics.join(",")
            },
        ]);
    }
    println!("{t}");
    Ok(())
}
