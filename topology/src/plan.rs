//! The placement plan: which NICs, which core and which NUMA node each
//! worker thread of the engine gets. Pure functions over [`Topology`].

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::model::{Gpu, GpuIndex, Nic, NicIndex, Topology};

/// Where the engine's worker threads go: one worker per GPU, or a single
/// host-only worker on a machine without GPU. Never empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementPlan {
    /// True when the machine has no GPU and the plan is the single
    /// host-memory worker.
    pub host_only: bool,
    /// One entry per GPU in [`Topology::gpus`] order, or one host-only entry.
    pub workers: Vec<WorkerPlacement>,
}

/// The placement of one worker thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerPlacement {
    /// The GPU this worker serves; `None` for the host-only worker.
    pub gpu: Option<GpuIndex>,
    /// The NICs (rails) this worker drives, in [`Topology::nics`] order.
    pub nics: Vec<NicIndex>,
    /// How close those NICs are to the GPU (or, host-only, to
    /// [`WorkerPlacement::numa_node`]).
    pub nic_affinity: NicAffinity,
    /// The CPU to pin the worker thread to (a Linux CPU number, one of
    /// [`NumaNode::cores`](crate::NumaNode::cores)).
    pub core: u32,
    /// The NUMA node for the worker's host buffers and queues: the GPU's node
    /// when known, else the node of [`WorkerPlacement::core`].
    pub numa_node: u32,
}

/// How the NICs of a worker were chosen, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NicAffinity {
    /// Under the GPU's own PCIe switch (see [`SwitchId`](crate::SwitchId)):
    /// GPU-NIC traffic never crosses the CPU.
    SameSwitch,
    /// No NIC under the GPU's switch; these sit on the GPU's NUMA node.
    SameNuma,
    /// No NIC near the GPU: every usable NIC of the machine.
    Any,
    /// The machine has no usable NIC at all.
    NoNic,
}

impl NicAffinity {
    /// A short label for tables.
    pub fn label(self) -> &'static str {
        match self {
            Self::SameSwitch => "same switch",
            Self::SameNuma => "same NUMA",
            Self::Any => "any",
            Self::NoNic => "none",
        }
    }
}

impl PlacementPlan {
    /// The worker serving this GPU.
    pub fn worker_for_gpu(&self, gpu: GpuIndex) -> Option<&WorkerPlacement> {
        self.workers.iter().find(|worker| worker.gpu == Some(gpu))
    }
}

impl Topology {
    /// Places one worker per GPU, or one host-only worker when there is no
    /// GPU.
    ///
    /// **NICs.** Only RDMA NICs (EFA or verbs) are used when the machine has
    /// any: on a p5 the ENA Ethernet device carries the control traffic, not
    /// the data. Otherwise every NIC is usable (TCP). For a GPU: the usable
    /// NICs under its switch; if none, those on its NUMA node; if none, all
    /// of them ([`NicAffinity`]). Several GPUs may share NICs in the
    /// fallbacks. The host-only worker gets every usable NIC and sits on the
    /// NUMA node that hosts most of them (lowest id on a tie, or when no NIC
    /// has a known node).
    ///
    /// **Cores.** Each worker gets a distinct physical core
    /// ([`NumaNode::cores`](crate::NumaNode::cores)) on its NUMA node, in
    /// ascending CPU order, GPU by GPU. CPU 0 (where the OS lands interrupts
    /// and housekeeping) is used only when the node has no other free core.
    /// When the node is full the worker goes to a free core of another node,
    /// and only when the whole machine is full do workers share cores (the
    /// least loaded first). A topology without any core (only possible for
    /// hand-built data) gets CPU 0.
    pub fn plan(&self) -> PlacementPlan {
        let usable = usable_nics(self);
        let mut cores = CoreAllocator::new(self);
        if self.gpus.is_empty() {
            return PlacementPlan {
                host_only: true,
                workers: vec![host_worker(self, &usable, &mut cores)],
            };
        }
        let workers = self
            .gpus
            .iter()
            .map(|gpu| {
                let (nics, nic_affinity) = nics_for_gpu(gpu, &usable);
                let (core, core_node) = cores.take(gpu.numa_node);
                WorkerPlacement {
                    gpu: Some(gpu.index),
                    nics,
                    nic_affinity,
                    core,
                    numa_node: gpu.numa_node.unwrap_or(core_node),
                }
            })
            .collect();
        PlacementPlan {
            host_only: false,
            workers,
        }
    }
}

/// The RDMA NICs if there are any, else all NICs.
fn usable_nics(topology: &Topology) -> Vec<&Nic> {
    let rdma: Vec<&Nic> = topology
        .nics
        .iter()
        .filter(|nic| nic.kind.is_rdma())
        .collect();
    if rdma.is_empty() {
        topology.nics.iter().collect()
    } else {
        rdma
    }
}

fn nics_for_gpu(gpu: &Gpu, usable: &[&Nic]) -> (Vec<NicIndex>, NicAffinity) {
    let pick = |keep: &dyn Fn(&Nic) -> bool| -> Vec<NicIndex> {
        usable
            .iter()
            .filter(|nic| keep(nic))
            .map(|nic| nic.index)
            .collect()
    };
    if let Some(switch) = gpu.switch {
        let nics = pick(&|nic| nic.switch == Some(switch));
        if !nics.is_empty() {
            return (nics, NicAffinity::SameSwitch);
        }
    }
    if let Some(node) = gpu.numa_node {
        let nics = pick(&|nic| nic.numa_node == Some(node));
        if !nics.is_empty() {
            return (nics, NicAffinity::SameNuma);
        }
    }
    if usable.is_empty() {
        (Vec::new(), NicAffinity::NoNic)
    } else {
        (pick(&|_| true), NicAffinity::Any)
    }
}

fn host_worker(topology: &Topology, usable: &[&Nic], cores: &mut CoreAllocator) -> WorkerPlacement {
    let mut per_node: HashMap<u32, usize> = HashMap::new();
    for node in usable.iter().filter_map(|nic| nic.numa_node) {
        *per_node.entry(node).or_default() += 1;
    }
    // Most NICs first, then the lowest id.
    let busiest = per_node
        .iter()
        .max_by_key(|&(&node, &count)| (count, std::cmp::Reverse(node)))
        .map(|(&node, _)| node);
    let preferred = busiest.or_else(|| {
        topology
            .numa_nodes
            .iter()
            .find(|node| !node.cores.is_empty())
            .map(|node| node.id)
    });
    let (core, core_node) = cores.take(preferred);
    let numa_node = preferred.unwrap_or(core_node);
    let nics: Vec<NicIndex> = usable.iter().map(|nic| nic.index).collect();
    let nic_affinity = if nics.is_empty() {
        NicAffinity::NoNic
    } else if usable.iter().all(|nic| nic.numa_node == Some(numa_node)) {
        NicAffinity::SameNuma
    } else {
        NicAffinity::Any
    };
    WorkerPlacement {
        gpu: None,
        nics,
        nic_affinity,
        core,
        numa_node,
    }
}

/// Hands out cores: distinct while any is free, near the wanted node, CPU 0
/// last.
struct CoreAllocator {
    /// (core, its node) for every core of the machine.
    cores: Vec<(u32, u32)>,
    /// How many workers each core already has.
    load: HashMap<u32, usize>,
}

impl CoreAllocator {
    fn new(topology: &Topology) -> Self {
        let cores = topology
            .numa_nodes
            .iter()
            .flat_map(|node| node.cores.iter().map(move |&core| (core, node.id)))
            .collect();
        Self {
            cores,
            load: HashMap::new(),
        }
    }

    /// Picks the best core for a worker that wants `node`, and returns it with
    /// its node. Order: least loaded, then on the wanted node, then not CPU 0,
    /// then lowest number.
    fn take(&mut self, node: Option<u32>) -> (u32, u32) {
        let best = self.cores.iter().copied().min_by_key(|&(core, core_node)| {
            let load = self.load.get(&core).copied().unwrap_or(0);
            let off_node = node.is_some_and(|wanted| wanted != core_node);
            (load, off_node, core == 0, core)
        });
        let (core, core_node) = best.unwrap_or((0, node.unwrap_or(0)));
        *self.load.entry(core).or_default() += 1;
        (core, core_node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NicKind, NumaNode, PciAddress, SwitchId, TopologySource};

    fn pci(bus: u8) -> PciAddress {
        PciAddress {
            domain: 0,
            bus,
            device: 0,
            function: 0,
        }
    }

    fn node(id: u32, cores: &[u32]) -> NumaNode {
        NumaNode {
            id,
            cores: cores.to_vec(),
            pus: cores.to_vec(),
            memory_bytes: 1 << 30,
        }
    }

    fn gpu(index: u32, numa_node: Option<u32>, switch: Option<u8>) -> Gpu {
        Gpu {
            index: GpuIndex(index),
            pci: pci(0x10 + u8::try_from(index).unwrap()),
            numa_node,
            switch: switch.map(|bus| SwitchId(pci(bus))),
            vendor_id: 0x10de,
            device_id: 0x2330,
            name: "H100".into(),
        }
    }

    fn nic(index: u32, kind: NicKind, numa_node: Option<u32>, switch: Option<u8>) -> Nic {
        Nic {
            index: NicIndex(index),
            name: format!("nic{index}"),
            netdev: None,
            kind,
            pci: pci(0x80 + u8::try_from(index).unwrap()),
            numa_node,
            switch: switch.map(|bus| SwitchId(pci(bus))),
            vendor_id: 0x1d0f,
            device_id: 0xefa1,
        }
    }

    fn topology(numa_nodes: Vec<NumaNode>, gpus: Vec<Gpu>, nics: Vec<Nic>) -> Topology {
        Topology {
            source: TopologySource::XmlString,
            hostname: None,
            numa_nodes,
            gpus,
            nics,
        }
    }

    #[test]
    fn cores_avoid_zero_then_spill_then_share() {
        let topo = topology(
            vec![node(0, &[0, 1]), node(1, &[2])],
            (0..4).map(|i| gpu(i, Some(0), None)).collect(),
            vec![],
        );
        let plan = topo.plan();
        let cores: Vec<u32> = plan.workers.iter().map(|w| w.core).collect();
        // 1 first (not CPU 0), then 0 (still on node 0), then node 1, then shared.
        assert_eq!(cores, vec![1, 0, 2, 1]);
        assert!(plan.workers.iter().all(|w| w.numa_node == 0));
        assert!(
            plan.workers
                .iter()
                .all(|w| w.nic_affinity == NicAffinity::NoNic)
        );
    }

    #[test]
    fn rdma_nics_win_over_ethernet() {
        let topo = topology(
            vec![node(0, &[0, 1, 2])],
            vec![gpu(0, Some(0), Some(1))],
            vec![
                nic(0, NicKind::Ethernet, Some(0), Some(1)),
                nic(1, NicKind::Efa, Some(0), Some(2)),
            ],
        );
        let worker = &topo.plan().workers[0];
        assert_eq!(worker.nics, vec![NicIndex(1)]);
        assert_eq!(worker.nic_affinity, NicAffinity::SameNuma);
    }

    #[test]
    fn any_when_nothing_is_near() {
        let topo = topology(
            vec![node(0, &[0, 1]), node(1, &[2, 3])],
            vec![gpu(0, Some(0), Some(1))],
            vec![nic(0, NicKind::Rdma, Some(1), Some(9))],
        );
        let worker = &topo.plan().workers[0];
        assert_eq!(worker.nics, vec![NicIndex(0)]);
        assert_eq!(worker.nic_affinity, NicAffinity::Any);
        assert_eq!((worker.core, worker.numa_node), (1, 0));
    }

    #[test]
    fn host_worker_sits_with_most_nics() {
        let topo = topology(
            vec![node(0, &[0, 1]), node(1, &[2, 3])],
            vec![],
            vec![
                nic(0, NicKind::Ethernet, Some(0), None),
                nic(1, NicKind::Ethernet, Some(1), None),
                nic(2, NicKind::Ethernet, Some(1), None),
            ],
        );
        let plan = topo.plan();
        assert!(plan.host_only);
        let [worker] = plan.workers.as_slice() else {
            panic!("expected one worker, got {:?}", plan.workers);
        };
        assert_eq!(worker.gpu, None);
        assert_eq!(worker.nics.len(), 3);
        assert_eq!(worker.nic_affinity, NicAffinity::Any);
        assert_eq!((worker.core, worker.numa_node), (2, 1));
    }

    #[test]
    fn empty_topology_still_has_a_worker() {
        let plan = topology(vec![], vec![], vec![]).plan();
        assert_eq!(plan.workers.len(), 1);
        assert_eq!(plan.workers[0].core, 0);
        assert_eq!(plan.workers[0].nic_affinity, NicAffinity::NoNic);
    }
}
