//! Weight sync between processes over tcp, members found by name through a `file://`
//! directory: a destination killed in the middle of an update fails alone (the other
//! completes and checks its bytes) and is redone once restarted; a destination that joins
//! later pulls the current version from the sources, is then planned in and pushed to, and
//! is dropped when it leaves.
//!
//! Destinations are this test binary run again as a child (`child_destination`, which does
//! nothing unless `XFER_WEIGHTS_CHILD` is set). A child reports on stdout, one line each:
//! `WEIGHTS ready INSTANCE`, `WEIGHTS verified V`, `WEIGHTS pulled V`, or `WEIGHTS error
//! WHY`; it leaves the cluster and exits when its stdin closes.

mod common;

use common::layouts::{element_indices, pattern};
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xfer::discovery::{self, Directory, Following};
use xfer::weights::exec::{Destination, Source, SyncError, SyncOptions};
use xfer::weights::{Holding, Layout, Plan, Side, TensorSpec};
use xfer::{Access, Agent, AgentOptions, HostBuffer, Region, TransportChoice, TransportKind};

const T: Duration = Duration::from_secs(30);
const CHILD: &str = "XFER_WEIGHTS_CHILD";

/// A small Llama-shaped model (2 layers, hidden 64, 4 query heads and 2 key-value heads of
/// 16, MLP 128, vocabulary 256), 2-byte elements: `(tensor, split dimension of the
/// Megatron tensor-parallel layout, or None for replicated)`.
fn model() -> Vec<(TensorSpec, Option<usize>)> {
    let h = 64;
    let mut m = vec![(TensorSpec::new("t0", vec![256, h], 2), Some(0))];
    for l in 0..2u64 {
        let shapes: [(Vec<u64>, Option<usize>); 7] = [
            (vec![h, h], Some(0)),   // q
            (vec![32, h], Some(0)),  // k
            (vec![32, h], Some(0)),  // v
            (vec![h, h], Some(1)),   // o
            (vec![128, h], Some(0)), // up
            (vec![h, 128], Some(1)), // down
            (vec![h], None),         // norm
        ];
        for (i, (shape, dim)) in shapes.into_iter().enumerate() {
            let id = 1 + l * 7 + i as u64;
            m.push((TensorSpec::new(format!("t{id}"), shape, 2), dim));
        }
    }
    m.push((TensorSpec::new("t15", vec![256, h], 2), Some(0)));
    m
}

/// Source `rank` of 2: tensor-parallel halves (norms whole).
fn source_layout(rank: u64) -> Layout {
    let m = model();
    let table: Arc<[TensorSpec]> = m.iter().map(|x| x.0.clone()).collect();
    let holdings = m.iter().enumerate().map(|(i, (t, dim))| {
        let h = match dim {
            Some(d) => Holding::split(&t.shape, *d, 2, rank).unwrap(),
            None => Holding::whole(&t.shape),
        };
        (i as u32, h)
    });
    Layout::pack(table, "weights", holdings).unwrap()
}

/// A destination: `flat0`/`flat1` (flat shard 0 or 1 of 2 of every tensor, cut mid-row) or
/// `whole` (everything).
fn destination_layout(kind: &str) -> Layout {
    let m = model();
    let table: Arc<[TensorSpec]> = m.iter().map(|x| x.0.clone()).collect();
    let holdings = m.iter().enumerate().map(|(i, (t, _))| {
        let n = t.elements().unwrap();
        let h = match kind {
            "flat0" => Holding::flat_shard(n, 2, 0),
            "flat1" => Holding::flat_shard(n, 2, 1),
            _ => Holding::whole(&t.shape),
        };
        (i as u32, h)
    });
    Layout::pack(table, "weights", holdings).unwrap()
}

/// What `l`'s regions hold at `version`: byte `j` of element `g` of tensor `t` is
/// `pattern(t, g, j) ^ version`.
fn contents(l: &Layout, version: u32) -> Vec<Vec<u8>> {
    let mut regions: Vec<Vec<u8>> = l.regions.iter().map(|r| vec![0; r.len as usize]).collect();
    for p in &l.pieces {
        let spec = &l.tensors[p.tensor as usize];
        let t: usize = spec.name[1..].parse().unwrap();
        let e = u64::from(spec.elem_size);
        for (i, g) in element_indices(&p.holding, &spec.shape)
            .into_iter()
            .enumerate()
        {
            for j in 0..e {
                regions[p.region as usize][(p.offset + i as u64 * e + j) as usize] =
                    pattern(t, g, j) ^ version as u8;
            }
        }
    }
    regions
}

fn tcp_agent(name: &str) -> Agent {
    Agent::new(AgentOptions {
        name: Some(name.into()),
        transport: TransportChoice::Only(TransportKind::Tcp),
        ..AgentOptions::default()
    })
    .expect("a tcp agent")
}

/// Registers host buffers holding `bytes`, one per region of `l`.
fn register(
    agent: &Agent,
    l: &Layout,
    bytes: &[Vec<u8>],
    access: Access,
) -> (Vec<Region>, Vec<Arc<HostBuffer>>) {
    let mut regions = Vec::new();
    let mut bufs = Vec::new();
    for (spec, b) in l.regions.iter().zip(bytes) {
        let buf = HostBuffer::new_shared(spec.len as usize).unwrap();
        buf.write(0, b).unwrap();
        regions.push(agent.register(buf.clone(), access).unwrap());
        bufs.push(buf);
    }
    (regions, bufs)
}

/// Small chunks, few in flight: an update is many transfers.
fn options() -> SyncOptions {
    SyncOptions::default()
        .chunk_bytes(2048)
        .max_inflight_transfers(2)
        .transfer_timeout(T)
}

// ---------------------------------------------------------------- the child

/// The destination process (does nothing unless run as a child by the tests below).
#[test]
fn child_destination() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    if let Err(e) = run_child(&spec) {
        println!("WEIGHTS error {e}");
    }
}

/// `URL CLUSTER NAME RANK|join KIND SCRIPT...`, SCRIPT items `wait:V` or `pull`.
fn run_child(spec: &str) -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<&str> = spec.split(' ').collect();
    let [url, cluster, name, rank, kind, script @ ..] = &args[..] else {
        return Err(format!("bad {CHILD}: {spec}").into());
    };
    let dir = discovery::open(url)?;
    let layout = destination_layout(kind);
    let agent = tcp_agent(name);
    let blank: Vec<Vec<u8>> = layout
        .regions
        .iter()
        .map(|r| vec![0xEE; r.len as usize])
        .collect();
    let access = Access::REMOTE_WRITE | Access::LOCAL_WRITE;
    let (regions, bufs) = register(&agent, &layout, &blank, access);
    let rank = rank.parse::<u32>().ok();
    let mut sync =
        Destination::new(&agent, layout.clone(), regions, 2, rank)?.with_options(options());
    sync.offer().expect("offer");
    let _published = agent.publish(&*dir, cluster, Duration::from_secs(30))?;
    let following = agent.follow(&*dir, cluster)?;
    println!("WEIGHTS ready {}", agent.info().instance);
    let check = |version: u32| -> Result<(), String> {
        let want = contents(&layout, version);
        for (r, (w, b)) in want.iter().zip(&bufs).enumerate() {
            let have = b.to_vec(0, w.len()).map_err(|e| e.to_string())?;
            if let Some(i) = (0..w.len()).find(|&i| have[i] != w[i]) {
                return Err(format!(
                    "region {r} byte {i}: {:#x}, want {:#x}",
                    have[i], w[i]
                ));
            }
        }
        Ok(())
    };
    for step in script {
        if let Some(v) = step.strip_prefix("wait:") {
            let v: u32 = v.parse()?;
            sync.wait(v, Duration::from_secs(60))?;
            check(v)?;
            println!("WEIGHTS verified {v}");
        } else if *step == "pull" {
            sync.wait_sources(&following, T)?;
            let r = sync.pull(None, T)?;
            check(r.version)?;
            println!("WEIGHTS pulled {}", r.version);
        }
    }
    // Leaves when the test closes stdin.
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line)? > 0 {
        line.clear();
    }
    Ok(())
}

// ---------------------------------------------------------------- the tests' side

/// A destination process.
struct Dest {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Dest {
    fn start(url: &str, cluster: &str, name: &str, rank: &str, kind: &str, script: &str) -> Dest {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "child_destination",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                CHILD,
                format!("{url} {cluster} {name} {rank} {kind} {script}"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the child starts");
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        Dest { child, stdin, out }
    }

    /// The next `WEIGHTS` line's words after `WEIGHTS` (its stdout closing is a failure).
    fn next(&mut self) -> Vec<String> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.out.read_line(&mut line).unwrap();
            assert!(n > 0, "the child's stdout closed");
            // libtest prints "test child_destination ... " before the child's first line.
            if let Some(at) = line.find("WEIGHTS ") {
                let rest = line[at + "WEIGHTS ".len()..].trim();
                let words: Vec<String> = rest.split(' ').map(str::to_owned).collect();
                assert_ne!(words[0], "error", "the child failed: {rest}");
                return words;
            }
        }
    }

    /// Waits for its `ready` line; returns its agent's instance.
    fn ready(&mut self) -> u64 {
        let w = self.next();
        assert_eq!(w[0], "ready", "{w:?}");
        w[1].parse().unwrap()
    }

    fn expect(&mut self, what: &str, version: u32) {
        let w = self.next();
        assert_eq!(w, [what.to_owned(), version.to_string()]);
    }

    /// Closes its stdin and waits for it to leave the cluster and exit.
    fn finish(mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
    }
}

impl Drop for Dest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `file://` directory in a temporary file, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p =
            std::env::temp_dir().join(format!("xfer-weights-{tag}-{}.json", std::process::id()));
        let _ = std::fs::remove_file(&p);
        TempDir(p)
    }
    fn url(&self) -> String {
        format!("file://{}", self.0.display())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(self.0.with_extension("lock"));
    }
}

/// The two sources (agents of this process), their regions holding `version`, published in
/// `cluster` and following it.
struct Sources {
    syncs: Vec<Source>,
    bufs: Vec<Vec<Arc<HostBuffer>>>,
    following: Vec<Following>,
    _published: Vec<discovery::Publication>,
}

impl Sources {
    fn start(dir: &dyn Directory, cluster: &str, tag: &str, plan: &Plan, version: u32) -> Sources {
        let mut s = Sources {
            syncs: Vec::new(),
            bufs: Vec::new(),
            following: Vec::new(),
            _published: Vec::new(),
        };
        for r in 0..2u32 {
            let l = source_layout(u64::from(r));
            let agent = tcp_agent(&format!("{tag}-src{r}"));
            let (regions, bufs) = register(&agent, &l, &contents(&l, version), Access::REMOTE_READ);
            let sync = Source::new(&agent, plan, r, l, regions)
                .unwrap()
                .with_options(options());
            sync.offer().expect("offer");
            s._published.push(
                agent
                    .publish(dir, cluster, Duration::from_secs(30))
                    .unwrap(),
            );
            s.following.push(agent.follow(dir, cluster).unwrap());
            s.syncs.push(sync);
            s.bufs.push(bufs);
        }
        s
    }

    /// Writes `version`'s weights (after saying so: pulls meanwhile retry).
    fn update(&self, version: u32) {
        for (r, (sync, bufs)) in self.syncs.iter().zip(&self.bufs).enumerate() {
            sync.begin_update().unwrap();
            let l = source_layout(r as u64);
            for (b, c) in bufs.iter().zip(contents(&l, version)) {
                b.write(0, &c).unwrap();
            }
        }
    }

    /// Refreshes every source until `done` holds for each (each change of the cluster
    /// wakes it).
    fn refresh_until(&mut self, what: &str, done: impl Fn(&Source) -> bool) {
        let deadline = Instant::now() + T;
        for (sync, f) in self.syncs.iter_mut().zip(&self.following) {
            loop {
                sync.refresh(f).unwrap();
                if done(sync) {
                    break;
                }
                assert!(Instant::now() < deadline, "sources: {what}: {sync:?}");
                f.next_event(Duration::from_millis(100));
            }
        }
    }
}

/// Whether `sync` has `rank` attached to the member of that instance.
fn attached_as(sync: &Source, rank: u32, instance: u64) -> bool {
    sync.member(rank).is_some_and(|m| m.1 == instance)
}

#[test]
fn a_destination_killed_mid_update_fails_alone_and_is_redone() {
    let tmp = TempDir::new("kill");
    let url = tmp.url();
    let dir = discovery::open(&url).unwrap();
    let cluster = "kill";
    let src: Vec<Layout> = (0..2).map(source_layout).collect();
    let dst = vec![destination_layout("flat0"), destination_layout("flat1")];
    let plan = Plan::new(&src, &dst).unwrap();
    let v = 1;
    let mut d0 = Dest::start(&url, cluster, "d0", "0", "flat0", "wait:1");
    let mut d1 = Dest::start(&url, cluster, "d1", "1", "flat1", "wait:1");
    let i0 = d0.ready();
    let i1 = d1.ready();
    let mut sources = Sources::start(&*dir, cluster, "kill", &plan, v);
    sources.refresh_until("attach d0 and d1", |s| {
        attached_as(s, 0, i0) && attached_as(s, 1, i1)
    });

    // Source 0 kills d1 when it is about to send the second layer's o_proj (piece 11): the
    // first layer's chunks to d1 have gone, the rest fail. Source 1 pushes at the same time.
    let victim = Mutex::new(Some(d1));
    let (r0, r1) = std::thread::scope(|scope| {
        let s0 = &sources.syncs[0];
        let victim = &victim;
        let a = scope.spawn(move || {
            s0.push_with(v, None, |p| {
                if p.index == 11
                    && let Some(mut d) = victim.lock().unwrap().take()
                {
                    d.child.kill().unwrap();
                    d.child.wait().unwrap();
                }
                Ok(None)
            })
            .unwrap()
        });
        let s1 = &sources.syncs[1];
        let b = scope.spawn(move || s1.push(v).unwrap());
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(victim.lock().unwrap().is_none(), "d1 was killed mid-push");
    assert!(r0.destinations[&0].is_ok(), "{r0:?}");
    assert!(r1.destinations[&0].is_ok(), "{r1:?}");
    let e = r0.destinations[&1].as_ref().unwrap_err();
    assert!(
        matches!(
            e,
            SyncError::Transfer {
                side: Some(Side::Destination),
                rank: Some(1),
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(r0.failed(), vec![1]);
    assert!(
        r0.destinations[&1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("destination 1 (d1)")
    );
    // d0 got the whole update and says so.
    d0.expect("verified", v);

    // d1 comes back (a new process under its name): the sources drop the dead one, attach
    // the new one, and redo its update alone.
    let mut d1 = Dest::start(&url, cluster, "d1", "1", "flat1", "wait:1");
    let i1 = d1.ready();
    sources.refresh_until("attach the new d1", |s| attached_as(s, 1, i1));
    for s in &sources.syncs {
        let r = s.push_to(v, &[1]).unwrap();
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(r.destinations.len(), 1);
    }
    d1.expect("verified", v);
    d0.finish();
    d1.finish();
}

#[test]
fn a_destination_that_joins_later_pulls_the_current_version_then_is_pushed_to() {
    let tmp = TempDir::new("join");
    let url = tmp.url();
    let dir = discovery::open(&url).unwrap();
    let cluster = "join";
    let src: Vec<Layout> = (0..2).map(source_layout).collect();
    let dst = vec![destination_layout("flat0")];
    let plan = Plan::new(&src, &dst).unwrap();
    // The sources run a few versions for the destination of the plan.
    let mut d0 = Dest::start(&url, cluster, "j-d0", "0", "flat0", "wait:4 wait:5 wait:6");
    let i0 = d0.ready();
    let mut sources = Sources::start(&*dir, cluster, "join", &plan, 4);
    sources.refresh_until("attach d0", |s| attached_as(s, 0, i0));
    for s in &sources.syncs {
        assert!(s.push(4).unwrap().is_ok());
    }
    d0.expect("verified", 4);
    sources.update(5);
    for s in &sources.syncs {
        assert!(s.push(5).unwrap().is_ok());
    }
    d0.expect("verified", 5);

    // A new inference replica (all of the weights) joins by name and pulls version 5: the
    // sources' code does nothing for it.
    let mut joiner = Dest::start(&url, cluster, "j-new", "join", "whole", "pull wait:6");
    let ij = joiner.ready();
    joiner.expect("pulled", 5);

    // The sources see it, plan it in (d0's pairs untouched) and push version 6 to both.
    let before: Vec<_> = sources
        .syncs
        .iter()
        .map(|s| s.pairs_to(0).unwrap().to_vec())
        .collect();
    sources.refresh_until("plan in the joiner", |s| {
        s.attached().len() == 2 && s.attached().iter().any(|&r| attached_as(s, r, ij))
    });
    for (s, b) in sources.syncs.iter().zip(&before) {
        assert_eq!(s.pairs_to(0).unwrap(), &b[..], "d0's pairs are untouched");
        assert_eq!(s.attached(), vec![0, 1], "the joiner has the next rank");
    }
    sources.update(6);
    for s in &sources.syncs {
        let r = s.push(6).unwrap();
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(r.destinations.len(), 2);
    }
    d0.expect("verified", 6);
    joiner.expect("verified", 6);

    // It leaves: the sources drop it.
    joiner.finish();
    sources.refresh_until("drop the joiner", |s| s.attached() == [0]);
    for s in &sources.syncs {
        assert_eq!(s.destinations(), vec![0]);
    }
    d0.finish();
}
