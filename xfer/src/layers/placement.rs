//! Where an agent's engine workers run ([`PinMode`]).
//!
//! With `auto`, the live machine's placement plan ([`topology::Topology::plan`]) gives the
//! initiator worker its core and NUMA node; each worker pins itself inside the engine's
//! `make` closure, before it creates its transport, so the transport's sockets and queues
//! are allocated from the right node. `demo` runs a target worker in the same process: it
//! gets another core of the same node on machines of [`MIN_CORES_TO_PIN_TARGET`] cores or
//! more, and stays unpinned on smaller ones (see [`WorkerPins::from_topology`]).
//!
//! Host buffers are allocated, and first touched (zeroed or filled), by the thread that asks
//! for them, not by the pinned workers: the main thread in `demo` and `bench`, a control
//! thread per client in `serve`. [`CorePin::prefer_memory_here`] steers those threads'
//! allocations to the worker's NUMA node first, so the pages land where the worker runs
//! (a no-op on single-node machines, where there is nothing to steer).

use fabric_core::error::report;
use topology::{GpuIndex, PlacementPlan, Topology};

/// This machine's topology, discovered once per process (hwloc takes a while on large
/// hosts, and an agent asks for it several times: pins, NICs, whether EFA is there);
/// `None` when discovery failed (said once in the log): workers then run unpinned and
/// NICs are chosen by route.
pub fn machine() -> Option<&'static Topology> {
    static MACHINE: std::sync::OnceLock<Option<Topology>> = std::sync::OnceLock::new();
    MACHINE
        .get_or_init(|| match Topology::discover() {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %report(&e), "topology discovery failed; workers run unpinned");
                None
            }
        })
        .as_ref()
}

/// Whether workers are pinned to the placement plan's cores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PinMode {
    /// Pin each worker to the placement plan's core (unpinned if discovery fails).
    #[default]
    Auto,
    /// Leave the threads where the OS puts them.
    Off,
}

/// A core (and memory node) for one worker thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CorePin {
    /// The Linux CPU number to pin to.
    pub core: u32,
    /// The NUMA node the worker's memory should come from.
    pub numa_node: u32,
    /// Whether to set a memory preference at all: only worth it with several NUMA nodes.
    pub prefer_memory: bool,
}

/// Applies `pin`, if any, to the calling thread (the worker named `worker`), and logs which
/// core the worker got.
pub fn pin_worker(pin: Option<CorePin>, worker: &str) {
    match pin {
        Some(p) => p.apply(worker),
        None => tracing::info!(worker, "worker unpinned"),
    }
}

impl CorePin {
    /// Pins the calling thread (a worker named `worker`) and, on a multi-node machine,
    /// makes its allocations prefer the node. Failures are logged, not fatal: an unpinned
    /// worker is slower, not wrong.
    pub fn apply(&self, worker: &str) {
        match topology::pin_current_thread(self.core) {
            Ok(()) => tracing::info!(
                worker,
                core = self.core,
                numa_node = self.numa_node,
                "worker pinned"
            ),
            Err(e) => {
                tracing::warn!(worker, core = self.core, error = %report(&e), "cannot pin worker; it runs unpinned")
            }
        }
        self.prefer_memory_here(worker);
    }

    /// Makes the calling thread's future allocations prefer this pin's NUMA node (a no-op on
    /// a single-node machine). For the thread that allocates a worker's buffers.
    pub fn prefer_memory_here(&self, thread: &str) {
        if !self.prefer_memory {
            return;
        }
        if let Err(e) = topology::prefer_memory_node(self.numa_node) {
            tracing::warn!(thread, numa_node = self.numa_node, error = %report(&e), "cannot prefer the worker's NUMA node");
        }
    }
}

/// Cores a machine needs before `demo`'s target worker is pinned as well as its initiator
/// (one rail each; several rails on so few cores pair up instead, see
/// [`WorkerPins::rail_pins`]).
///
/// Pinning both busy workers of `demo` to the two cores of a 2-core VM left no core free for
/// the main thread, the loopback's softirq work and other processes, and a pinned worker
/// cannot leave a busy core: 64 KiB pages, 8 GiB, medians of 5 interleaved runs were 11.8
/// Gbps with both pinned, 18.7 with the initiator alone pinned, 19.5 unpinned. With a core
/// to spare the scheduler has room again, and the plan's locality is worth keeping.
pub const MIN_CORES_TO_PIN_TARGET: usize = 3;

/// The cores of this process's workers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerPins {
    /// The worker that initiates transfers (demo, bench).
    pub initiator: Option<CorePin>,
    /// The target worker: `demo`'s (same process) and `serve`'s (see
    /// [`WorkerPins::serve_pins`]).
    pub target: Option<CorePin>,
    /// Cores for several rails: those of the initiator's NUMA node from its core on, CPU 0
    /// last (see [`WorkerPins::rail_pins`]).
    pub pool: Vec<u32>,
}

impl WorkerPins {
    /// Pins for `mode` on this machine, for the plan's first worker. With `auto`, a failed
    /// discovery gives no pins.
    pub fn for_this_machine(mode: PinMode) -> WorkerPins {
        WorkerPins::for_slot(mode, 0)
    }

    /// Pins for `mode` on this machine, for the plan's worker at `slot` (see
    /// [`plan_slot`]; the first when there is no such worker).
    pub fn for_slot(mode: PinMode, slot: usize) -> WorkerPins {
        match mode {
            PinMode::Off => {
                tracing::info!("pinning off: workers run unpinned");
                WorkerPins::default()
            }
            PinMode::Auto => match machine() {
                Some(t) => {
                    let plan = t.plan();
                    match plan.workers.get(slot).or(plan.workers.first()) {
                        Some(w) => WorkerPins::from_worker(t, w),
                        None => WorkerPins::default(),
                    }
                }
                None => WorkerPins::default(),
            },
        }
    }

    /// [`WorkerPins::from_worker`] for the plan's first worker (GPU 0's, or the host-only
    /// worker).
    pub fn from_topology(t: &Topology, plan: &PlacementPlan) -> WorkerPins {
        match plan.workers.first() {
            Some(w) => WorkerPins::from_worker(t, w),
            None => WorkerPins::default(),
        }
    }

    /// The initiator gets worker `w`'s core; the target gets the next core after it on the
    /// same NUMA node (wrapping around, CPU 0 last), else the next core of the machine, but
    /// only on a machine of at least [`MIN_CORES_TO_PIN_TARGET`] cores: below that it stays
    /// unpinned.
    pub fn from_worker(t: &Topology, w: &topology::WorkerPlacement) -> WorkerPins {
        let prefer_memory = t.numa_nodes.len() > 1;
        let initiator = CorePin {
            core: w.core,
            numa_node: w.numa_node,
            prefer_memory,
        };
        let node_of = |core: u32| {
            t.numa_nodes
                .iter()
                .find(|n| n.cores.contains(&core))
                .map(|n| n.id)
        };
        let same_node: Vec<u32> = t
            .numa_node(node_of(w.core).unwrap_or(w.numa_node))
            .map(|n| n.cores.clone())
            .unwrap_or_default();
        let all: Vec<u32> = {
            let mut v: Vec<u32> = t
                .numa_nodes
                .iter()
                .flat_map(|n| n.cores.iter().copied())
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        // The node's cores from the initiator's on, wrapping, CPU 0 last: rails take them in turn.
        let pool = pool_from(&same_node, w.core);
        if all.len() < MIN_CORES_TO_PIN_TARGET {
            return WorkerPins {
                initiator: Some(initiator),
                target: None,
                pool,
            };
        }
        let target = next_core(&same_node, w.core)
            .or_else(|| next_core(&all, w.core))
            .map(|core| CorePin {
                core,
                numa_node: node_of(core).unwrap_or(w.numa_node),
                prefer_memory,
            });
        WorkerPins {
            initiator: Some(initiator),
            target,
            pool,
        }
    }

    /// Pins for the `rails` workers of a group of `serve`: the target's, as in `demo`
    /// ([`WorkerPins::rail_pins`] with the target pin, after the initiator's cores), never
    /// the initiator's. A `bench` on the same host pins its workers to the initiator's
    /// cores, and a server pinned there too would share each of them with a busy client
    /// worker. Unpinned where the target is (machines of fewer than
    /// [`MIN_CORES_TO_PIN_TARGET`] cores).
    pub fn serve_pins(&self, rails: usize) -> Vec<Option<CorePin>> {
        self.rail_pins(self.target, rails, rails)
    }

    /// Pins for `rails` workers of one group: `first` (the role's own pin) alone for one
    /// rail; for several, distinct cores of the pool, the initiator's group from the start
    /// of the pool and the target's (`offset = rails`) after it, where the pool holds both
    /// groups and a core to spare. Where it holds at most one core per rail, rail `i` of
    /// both groups shares core `i` of the pool (cycling; [`paired`](Self::paired)), also on
    /// machines too small to pin a single target. In between they run unpinned.
    pub fn rail_pins(
        &self,
        first: Option<CorePin>,
        rails: usize,
        offset: usize,
    ) -> Vec<Option<CorePin>> {
        if rails == 1 {
            return vec![first];
        }
        let Some(base) = first.or(self.initiator) else {
            return vec![None; rails];
        };
        if self.paired(rails) {
            return (0..rails)
                .map(|i| {
                    Some(CorePin {
                        core: self.pool[i % self.pool.len()],
                        ..base
                    })
                })
                .collect();
        }
        if first.is_none() || self.pool.len() <= 2 * rails {
            return vec![None; rails];
        }
        (0..rails)
            .map(|i| {
                Some(CorePin {
                    core: self.pool[offset + i],
                    ..base
                })
            })
            .collect()
    }

    /// Whether `rails` rails (of each of the initiator and the target) share cores in
    /// pairs: when the pool has at most one core per rail, so that every core runs two or
    /// more busy rail workers whatever the placement. Rail `i` of both groups then runs on
    /// one core, where the reader of a rail's bytes copies them out of the cache its writer
    /// just filled. Left to the scheduler, the two initiator rails of a 2-core VM sometimes
    /// ran on one core and the two target rails on the other, each rail's bytes then
    /// crossing cores: 4 KiB pages, 2 rails, 6 runs interleaved, 32.8-40.6 Gbps unpinned
    /// (two runs near 33) against 38.9-40.5 paired.
    pub fn paired(&self, rails: usize) -> bool {
        rails > 1 && !self.pool.is_empty() && self.pool.len() <= rails
    }
}

/// Which worker of the placement plan an agent is: for GPU memory, the plan's worker of its
/// CUDA device `gpu` (so an agent per GPU, in one process or several, takes that GPU's
/// cores and NICs); else `worker` (its position among the process's agents).
pub fn plan_slot(cuda: bool, gpu: u32, worker: usize) -> usize {
    match machine() {
        Some(t) if cuda => slot_in(t, &t.plan(), gpu, worker),
        _ => worker,
    }
}

/// [`plan_slot`] on topology `t` and its plan, for GPU memory.
fn slot_in(t: &Topology, plan: &PlacementPlan, gpu: u32, worker: usize) -> usize {
    topology_gpu(t, gpu)
        .and_then(|g| plan.workers.iter().position(|w| w.gpu == Some(g)))
        .unwrap_or(worker)
}

/// The topology's GPU for CUDA device `ordinal`: matched by PCI address where CUDA can
/// tell it, else the topology's GPU at that position (host-memory runs without CUDA).
pub fn topology_gpu(t: &Topology, ordinal: u32) -> Option<GpuIndex> {
    let by_pci = gpu_mem::devices().ok().and_then(|devs| {
        let d = devs.into_iter().find(|d| d.ordinal == ordinal)?;
        let pci = d.pci_bus_id.parse::<topology::PciAddress>().ok()?;
        t.gpu_by_pci(&pci).map(|g| g.index)
    });
    by_pci.or_else(|| t.gpus.get(ordinal as usize).map(|g| g.index))
}

/// Pins of one worker per GPU (`--per-gpu`): its initiator rails and its target rails.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuWorkerPins {
    /// The core whose NUMA node the worker's memory should come from (its first rail's).
    pub home: Option<CorePin>,
    /// One pin per initiator rail.
    pub initiator: Vec<Option<CorePin>>,
    /// One pin per target rail (demo).
    pub target: Vec<Option<CorePin>>,
}

/// Pins for one worker per entry of `gpus` (topology GPU indices; `None` for a GPU the
/// topology does not show), each with `rails` initiator and `rails` target rails.
///
/// Each worker's first rail takes the plan's core for its GPU; its other rails take distinct
/// cores of the GPU's NUMA node that no other worker's plan core is (CPU 0 last); a worker
/// whose node has fewer than `2 * rails` cores left runs unpinned,
/// and so does everything on a machine of fewer than [`MIN_CORES_TO_PIN_TARGET`] cores.
pub fn per_gpu_pins(
    t: &Topology,
    plan: &PlacementPlan,
    gpus: &[Option<GpuIndex>],
    rails: usize,
) -> Vec<GpuWorkerPins> {
    let cores_total: usize = t.numa_nodes.iter().map(|n| n.cores.len()).sum();
    let prefer_memory = t.numa_nodes.len() > 1;
    // Each worker's own plan core is its first rail's; the other rails take free cores.
    let homes: Vec<u32> = gpus
        .iter()
        .filter_map(|g| g.and_then(|g| plan.worker_for_gpu(g)).map(|w| w.core))
        .collect();
    let mut taken: Vec<u32> = Vec::new();
    gpus.iter()
        .map(|g| {
            let unpinned = GpuWorkerPins {
                home: None,
                initiator: vec![None; rails],
                target: vec![None; rails],
            };
            if cores_total < MIN_CORES_TO_PIN_TARGET {
                return unpinned;
            }
            let Some(w) = g.and_then(|g| plan.worker_for_gpu(g)) else {
                return unpinned;
            };
            let node: Vec<u32> = t
                .numa_node(w.numa_node)
                .map(|n| n.cores.clone())
                .unwrap_or_default();
            // The node's cores from the worker's own on, wrapping, CPU 0 last.
            let order = pool_from(&node, w.core);
            if taken.contains(&w.core) {
                return unpinned;
            }
            let free: Vec<u32> = std::iter::once(w.core)
                .chain(
                    order
                        .into_iter()
                        .filter(|c| !taken.contains(c) && !homes.contains(c)),
                )
                .collect();
            if free.len() < 2 * rails {
                return unpinned;
            }
            let pin = |core| {
                Some(CorePin {
                    core,
                    numa_node: w.numa_node,
                    prefer_memory,
                })
            };
            let mine = &free[..2 * rails];
            taken.extend_from_slice(mine);
            GpuWorkerPins {
                home: pin(mine[0]),
                initiator: mine[..rails].iter().map(|&c| pin(c)).collect(),
                target: mine[rails..].iter().map(|&c| pin(c)).collect(),
            }
        })
        .collect()
}

/// `first`, then the other cores of `cores` in ascending order from `first` on, wrapping
/// around, CPU 0 last (when it is not `first`).
fn pool_from(cores: &[u32], first: u32) -> Vec<u32> {
    let mut rest: Vec<u32> = cores
        .iter()
        .copied()
        .filter(|&c| c != first && c != 0)
        .collect();
    rest.sort_unstable();
    rest.dedup();
    let wrap = rest.partition_point(|&c| c < first);
    rest.rotate_left(wrap);
    let mut pool = vec![first];
    pool.extend(rest);
    if first != 0 && cores.contains(&0) {
        pool.push(0);
    }
    pool
}

/// The first core of `cores` after `taken` in ascending order, wrapping around, with CPU 0
/// tried last; `None` when `cores` has no core but `taken`.
fn next_core(cores: &[u32], taken: u32) -> Option<u32> {
    pool_from(cores, taken).get(1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> Topology {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../topology/tests/fixtures")
            .join(name);
        Topology::from_xml_file(p).expect("fixture loads")
    }

    #[test]
    fn an_agent_of_gpu_memory_is_its_gpus_worker_with_its_core() {
        let t = fixture("p5.48xlarge.xml");
        let plan = t.plan();
        for gpu in [0u32, 3, 7] {
            let slot = slot_in(&t, &plan, gpu, 0);
            let w = &plan.workers[slot];
            assert_eq!(w.gpu, topology_gpu(&t, gpu), "GPU {gpu}'s worker");
            let pins = WorkerPins::from_worker(&t, w);
            assert_eq!(pins.initiator.map(|p| p.core), Some(w.core));
        }
        assert_ne!(
            plan.workers[slot_in(&t, &plan, 0, 0)].core,
            plan.workers[slot_in(&t, &plan, 7, 0)].core,
            "two GPUs' agents do not share a core"
        );
        // A GPU the topology does not show keeps the caller's position.
        assert_eq!(slot_in(&t, &plan, 99, 2), 2);
    }

    #[test]
    fn next_core_wraps_and_keeps_cpu0_last() {
        assert_eq!(next_core(&[0, 1], 1), Some(0));
        assert_eq!(next_core(&[0, 1, 2, 3], 1), Some(2));
        assert_eq!(next_core(&[0, 1, 2, 3], 3), Some(1));
        assert_eq!(next_core(&[4, 6, 8], 8), Some(4));
        assert_eq!(next_core(&[1], 1), None);
        assert_eq!(next_core(&[], 1), None);
    }

    #[test]
    fn a_pool_runs_from_the_first_core_and_wraps_with_cpu0_last() {
        assert_eq!(pool_from(&[0, 1], 1), vec![1, 0]);
        assert_eq!(pool_from(&[0, 1, 2], 1), vec![1, 2, 0]);
        assert_eq!(pool_from(&[3, 0, 1, 2, 4], 3), vec![3, 4, 1, 2, 0]);
        assert_eq!(pool_from(&[0, 1, 2, 3], 0), vec![0, 1, 2, 3]);
        assert_eq!(pool_from(&[4, 6, 8], 6), vec![6, 8, 4]);
        assert_eq!(pool_from(&[5], 5), vec![5]);
    }

    #[test]
    fn p5_pins_initiator_to_gpu0_worker_and_target_nearby() {
        let t = fixture("p5.48xlarge.xml");
        let plan = t.plan();
        let pins = WorkerPins::from_topology(&t, &plan);
        let init = pins.initiator.expect("initiator pinned");
        assert_eq!(init.core, plan.workers[0].core);
        assert_eq!(init.numa_node, plan.workers[0].numa_node);
        assert!(init.prefer_memory, "p5 has two NUMA nodes");
        let target = pins.target.expect("target pinned");
        assert_ne!(target.core, init.core);
        assert_eq!(target.numa_node, init.numa_node);
        assert!(
            t.numa_node(init.numa_node)
                .unwrap()
                .cores
                .contains(&target.core)
        );
    }

    #[test]
    fn laptop_pins_both_workers_without_memory_policy() {
        let t = fixture("laptop.xml");
        let pins = WorkerPins::from_topology(&t, &t.plan());
        let init = pins.initiator.expect("initiator pinned");
        let target = pins.target.expect("target pinned");
        assert_ne!(init.core, target.core);
        assert!(!init.prefer_memory && !target.prefer_memory);
    }

    /// A one-node machine with these cores, no GPU and no NIC.
    fn machine_with_cores(cores: &[u32]) -> Topology {
        Topology {
            source: topology::TopologySource::XmlString,
            hostname: None,
            numa_nodes: vec![topology::NumaNode {
                id: 0,
                cores: cores.to_vec(),
                pus: cores.to_vec(),
                memory_bytes: 1 << 30,
            }],
            gpus: Vec::new(),
            nics: Vec::new(),
        }
    }

    #[test]
    fn two_core_machine_pins_only_the_initiator() {
        let t = machine_with_cores(&[0, 1]);
        let pins = WorkerPins::from_topology(&t, &t.plan());
        assert_eq!(pins.initiator.map(|p| p.core), Some(1));
        assert_eq!(pins.target, None);
        let t = machine_with_cores(&[0, 1, 2]);
        let pins = WorkerPins::from_topology(&t, &t.plan());
        assert_eq!(pins.initiator.map(|p| p.core), Some(1));
        assert_eq!(pins.target.map(|p| p.core), Some(2));
    }

    #[test]
    fn serve_never_pins_to_the_cores_of_a_bench_on_the_same_host() {
        for (t, what) in [
            (fixture("p5.48xlarge.xml"), "p5"),
            (machine_with_cores(&(0..16).collect::<Vec<_>>()), "16 cores"),
        ] {
            let pins = WorkerPins::from_topology(&t, &t.plan());
            for rails in [1, 2, 4, 8] {
                let bench: Vec<u32> = pins
                    .rail_pins(pins.initiator, rails, 0)
                    .iter()
                    .flatten()
                    .map(|p| p.core)
                    .collect();
                let serve: Vec<u32> = pins
                    .serve_pins(rails)
                    .iter()
                    .flatten()
                    .map(|p| p.core)
                    .collect();
                // Pinned wherever the bench is (both need the pool's spare core).
                assert_eq!(serve.len(), bench.len(), "{what}, {rails} rails");
                assert!(
                    rails < 8 || what == "p5" || serve.is_empty(),
                    "{what}: 8+8 rails on 16 cores"
                );
                assert!(
                    rails > 4 || serve.len() == rails,
                    "{what}, {rails} rails: serve pinned"
                );
                assert!(
                    serve.iter().all(|c| !bench.contains(c)),
                    "{what}, {rails} rails: serve {serve:?} shares a core with bench {bench:?}"
                );
            }
        }
        // Too small to pin a target: serve runs unpinned, the scheduler places it.
        let t = machine_with_cores(&[0, 1]);
        let pins = WorkerPins::from_topology(&t, &t.plan());
        assert_eq!(pins.serve_pins(1), vec![None]);
    }

    #[test]
    fn off_gives_no_pins() {
        assert_eq!(
            WorkerPins::for_this_machine(PinMode::Off),
            WorkerPins::default()
        );
    }

    #[test]
    fn rails_get_distinct_cores_of_their_node_or_none() {
        let t = fixture("p5.48xlarge.xml");
        let pins = WorkerPins::from_topology(&t, &t.plan());
        let a = pins.rail_pins(pins.initiator, 4, 0);
        let b = pins.rail_pins(pins.target, 4, 4);
        let mut cores: Vec<u32> = a
            .iter()
            .chain(&b)
            .map(|p| p.expect("pinned").core)
            .collect();
        assert!(!cores.contains(&0), "CPU 0 is kept free: {cores:?}");
        let node0 = &t.numa_nodes[0].cores;
        assert!(
            cores.iter().all(|c| node0.contains(c)),
            "all on the initiator's node: {cores:?}"
        );
        cores.sort_unstable();
        cores.dedup();
        assert_eq!(cores.len(), 8, "eight distinct cores");
        // A pool that holds both groups but no core to spare leaves several rails unpinned.
        let small = WorkerPins {
            pool: vec![1, 2, 3, 0],
            ..pins.clone()
        };
        assert_eq!(small.rail_pins(small.initiator, 2, 0), vec![None, None]);
        assert_eq!(small.rail_pins(small.target, 2, 2), vec![None, None]);
        assert_eq!(pins.rail_pins(pins.initiator, 1, 0), vec![pins.initiator]);
    }

    fn cores(pins: &[Option<CorePin>]) -> Vec<Option<u32>> {
        pins.iter().map(|p| p.map(|p| p.core)).collect()
    }

    #[test]
    fn rails_pair_up_on_a_core_each_where_cores_are_no_more_than_rails() {
        // 2 cores: rail i of the initiator and of the target (in demo, or serve beside a
        // bench) share a core, cycling through the pool (CPU 0 last), even though a single
        // target worker is not pinned on so small a machine.
        let t = machine_with_cores(&[0, 1]);
        let pins = WorkerPins::from_topology(&t, &t.plan());
        assert_eq!(pins.target, None);
        for (rails, want) in [
            (2, vec![Some(1), Some(0)]),
            (3, vec![Some(1), Some(0), Some(1)]),
            (8, [Some(1), Some(0)].repeat(4)),
        ] {
            assert!(pins.paired(rails), "{rails} rails on 2 cores");
            assert_eq!(cores(&pins.rail_pins(pins.initiator, rails, 0)), want);
            assert_eq!(cores(&pins.serve_pins(rails)), want, "{rails} rails");
        }
        // One rail: the initiator alone is pinned, as before.
        assert!(!pins.paired(1));
        assert_eq!(cores(&pins.rail_pins(pins.initiator, 1, 0)), vec![Some(1)]);
        assert_eq!(cores(&pins.serve_pins(1)), vec![None]);
        // 3 cores and 2 rails: more cores than rails but fewer than both groups and a spare:
        // the scheduler places them; 3 rails pair, CPU 0 last.
        let t = machine_with_cores(&[0, 1, 2]);
        let pins = WorkerPins::from_topology(&t, &t.plan());
        assert_eq!(pins.pool, vec![1, 2, 0]);
        assert!(!pins.paired(2) && pins.paired(3));
        assert_eq!(pins.rail_pins(pins.initiator, 2, 0), vec![None, None]);
        assert_eq!(pins.serve_pins(2), vec![None, None]);
        assert_eq!(cores(&pins.serve_pins(3)), vec![Some(1), Some(2), Some(0)]);
        // 16 cores pair only from 16 rails on.
        let t = machine_with_cores(&(0..16).collect::<Vec<_>>());
        let pins = WorkerPins::from_topology(&t, &t.plan());
        assert!(!pins.paired(8) && !pins.paired(15) && pins.paired(16));
        // Pinning off: nothing is pinned at any count.
        let off = WorkerPins::default();
        assert!(!off.paired(2));
        assert_eq!(off.rail_pins(off.initiator, 2, 0), vec![None, None]);
    }

    #[test]
    fn per_gpu_workers_on_p5_get_distinct_cores_of_their_gpus_nodes() {
        let t = fixture("p5.48xlarge.xml");
        let plan = t.plan();
        let gpus: Vec<Option<GpuIndex>> = t.gpus.iter().map(|g| Some(g.index)).collect();
        assert_eq!(gpus.len(), 8);
        let pins = per_gpu_pins(&t, &plan, &gpus, 4);
        let mut seen = std::collections::HashSet::new();
        for (g, p) in t.gpus.iter().zip(&pins) {
            let node = g.numa_node.expect("p5 GPUs have a node");
            assert_eq!(p.initiator.len(), 4);
            assert_eq!(p.target.len(), 4);
            for pin in p.initiator.iter().chain(&p.target) {
                let pin = pin.expect("p5 has cores for 8 workers of 4+4 rails");
                assert_eq!(pin.numa_node, node, "GPU {}", g.index);
                let cores = &t.numa_node(node).unwrap().cores;
                assert!(
                    cores.contains(&pin.core),
                    "core {} not on node {node}",
                    pin.core
                );
                assert!(seen.insert(pin.core), "core {} given twice", pin.core);
            }
            assert_eq!(
                p.home.unwrap().core,
                plan.worker_for_gpu(g.index).unwrap().core,
                "the worker's first rail sits on the plan's core"
            );
        }
    }

    #[test]
    fn per_gpu_workers_run_unpinned_when_cores_run_out_or_the_gpu_is_unknown() {
        let t = fixture("p5.48xlarge.xml");
        let plan = t.plan();
        let gpus: Vec<Option<GpuIndex>> = t.gpus.iter().map(|g| Some(g.index)).collect();
        // 8 workers of 16 + 16 rails need 256 cores: the later ones find none left.
        let pins = per_gpu_pins(&t, &plan, &gpus, 16);
        assert!(pins[0].initiator.iter().all(Option::is_some));
        assert!(pins.last().unwrap().initiator.iter().all(Option::is_none));
        let pins = per_gpu_pins(&t, &plan, &[None], 2);
        assert_eq!(
            pins[0],
            GpuWorkerPins {
                home: None,
                initiator: vec![None; 2],
                target: vec![None; 2],
            }
        );
        let laptop = fixture("laptop.xml");
        let pins = per_gpu_pins(&laptop, &laptop.plan(), &[None, None], 1);
        assert_eq!(pins.len(), 2);
    }

    #[test]
    fn a_per_gpu_worker_takes_cpu0_last_when_it_needs_every_core_of_its_node() {
        let t = fixture("p5.48xlarge.xml");
        let plan = t.plan();
        let g = t.gpus[0].index;
        let w = plan.worker_for_gpu(g).expect("GPU 0 has a worker");
        let node = &t.numa_node(w.numa_node).expect("its node").cores;
        assert!(
            node.contains(&0) && node.len().is_multiple_of(2),
            "fixture: {node:?}"
        );
        let pins = per_gpu_pins(&t, &plan, &[Some(g)], node.len() / 2);
        let all: Vec<u32> = pins[0]
            .initiator
            .iter()
            .chain(&pins[0].target)
            .map(|p| p.expect("pinned: the node has exactly the cores").core)
            .collect();
        assert_eq!(all[0], w.core, "the worker's own core first");
        assert_eq!(all.last(), Some(&0), "CPU 0 last: {all:?}");
        let mut distinct = all.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), node.len(), "every core of the node once");
    }
}
