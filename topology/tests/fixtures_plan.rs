//! Discovery and planning on the saved topologies of `tests/fixtures/`
//! (written by `examples/gen_fixtures.rs`).

use std::collections::{BTreeSet, HashSet};
use std::path::PathBuf;

use topology::{
    GpuIndex, NicAffinity, NicIndex, NicKind, PciAddress, PlacementPlan, Topology, TopologySource,
    render_table,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn load(name: &str) -> Topology {
    Topology::from_xml_file(fixture(name)).unwrap_or_else(|error| panic!("{name}: {error:?}"))
}

fn assert_distinct_cores(plan: &PlacementPlan) {
    let cores: HashSet<u32> = plan.workers.iter().map(|worker| worker.core).collect();
    assert_eq!(cores.len(), plan.workers.len(), "cores shared: {plan:#?}");
}

#[test]
fn p5_discovery() {
    let topo = load("p5.48xlarge.xml");
    assert_eq!(
        topo.source,
        TopologySource::XmlFile(fixture("p5.48xlarge.xml"))
    );
    assert_eq!(topo.hostname.as_deref(), Some("p5-48xlarge-fixture"));

    assert_eq!(topo.numa_nodes.len(), 2);
    for (id, node) in (0..).zip(&topo.numa_nodes) {
        assert_eq!(node.id, id);
        assert_eq!(node.memory_bytes, 1 << 40);
        // 48 physical cores, named by their first PU; 96 PUs with siblings.
        let first = 48 * id;
        assert_eq!(node.cores, (first..first + 48).collect::<Vec<_>>());
        let mut pus: Vec<u32> = (first..first + 48).chain(first + 96..first + 144).collect();
        pus.sort_unstable();
        assert_eq!(node.pus, pus);
    }
    assert_eq!(topo.core_count(), 96);

    assert_eq!(topo.gpus.len(), 8);
    for (index, gpu) in (0..).zip(&topo.gpus) {
        assert_eq!(gpu.index, GpuIndex(index));
        assert_eq!((gpu.vendor_id, gpu.device_id), (0x10de, 0x2330));
        assert_eq!(gpu.name, "GH100 [H100 SXM5 80GB]");
        assert_eq!(gpu.numa_node, Some(index / 4));
        assert!(gpu.switch.is_some());
    }
    assert_eq!(
        topo.gpus[0].pci,
        "0000:12:00.0".parse::<PciAddress>().unwrap()
    );
    assert_eq!(
        topo.gpus[4].pci,
        "0000:92:00.0".parse::<PciAddress>().unwrap()
    );
    let switches: BTreeSet<_> = topo.gpus.iter().map(|gpu| gpu.switch).collect();
    assert_eq!(switches.len(), 8, "each GPU has its own switch");

    let efa: Vec<_> = topo
        .nics
        .iter()
        .filter(|nic| nic.kind == NicKind::Efa)
        .collect();
    assert_eq!(efa.len(), 32);
    assert!(
        efa.iter()
            .all(|nic| nic.name.starts_with("rdmap") && nic.netdev.is_none())
    );
    // The ENA primary interface is a NIC too, but Ethernet and outside any switch.
    let others: Vec<_> = topo
        .nics
        .iter()
        .filter(|nic| nic.kind != NicKind::Efa)
        .collect();
    assert_eq!(others.len(), 1);
    assert_eq!(others[0].kind, NicKind::Ethernet);
    assert_eq!(others[0].name, "ens32");
    assert_eq!(others[0].netdev.as_deref(), Some("ens32"));
    assert_eq!(others[0].switch, None);
    assert_eq!(others[0].numa_node, Some(0));
    for (index, nic) in (0..).zip(&topo.nics) {
        assert_eq!(nic.index, NicIndex(index));
    }
}

#[test]
fn p5_plan_pairs_each_gpu_with_its_switch() {
    let topo = load("p5.48xlarge.xml");
    let plan = topo.plan();
    assert!(!plan.host_only);
    assert_eq!(plan.workers.len(), 8);
    assert_distinct_cores(&plan);

    let mut all_nics = HashSet::new();
    for (gpu, worker) in topo.gpus.iter().zip(&plan.workers) {
        assert_eq!(worker.gpu, Some(gpu.index));
        assert_eq!(worker.nic_affinity, NicAffinity::SameSwitch);
        // Exactly the four EFA NICs of its own switch.
        let expected: Vec<NicIndex> = topo
            .nics
            .iter()
            .filter(|nic| nic.kind == NicKind::Efa && nic.switch == gpu.switch)
            .map(|nic| nic.index)
            .collect();
        assert_eq!(expected.len(), 4);
        assert_eq!(worker.nics, expected);
        for &nic in &worker.nics {
            let nic = topo.nic(nic).unwrap();
            assert_eq!(nic.kind, NicKind::Efa);
            assert_eq!(nic.switch, gpu.switch);
            assert_eq!(nic.numa_node, gpu.numa_node);
            assert!(all_nics.insert(nic.index), "{} given twice", nic.name);
        }
        // A core of the GPU's own NUMA node, not CPU 0, for the worker and
        // its buffers.
        let node = gpu.numa_node.unwrap();
        assert_eq!(worker.numa_node, node);
        assert!(topo.numa_node(node).unwrap().cores.contains(&worker.core));
        assert_ne!(worker.core, 0);
    }
    assert_eq!(all_nics.len(), 32);
    let cores: Vec<u32> = plan.workers.iter().map(|worker| worker.core).collect();
    assert_eq!(cores, vec![1, 2, 3, 4, 48, 49, 50, 51]);
}

#[test]
fn laptop_gets_one_host_only_worker() {
    let topo = load("laptop.xml");
    assert_eq!(topo.numa_nodes.len(), 1);
    assert_eq!(topo.numa_nodes[0].cores, (0..8).collect::<Vec<_>>());
    // The Intel iGPU is not an NVIDIA GPU.
    assert!(topo.gpus.is_empty());
    assert_eq!(topo.nics.len(), 1);
    let wifi = &topo.nics[0];
    assert_eq!(wifi.name, "wlp2s0");
    assert_eq!(wifi.kind, NicKind::Other);
    assert!(!wifi.kind.is_rdma());

    let plan = topo.plan();
    assert!(plan.host_only);
    assert_eq!(plan.workers.len(), 1);
    let worker = &plan.workers[0];
    assert_eq!(worker.gpu, None);
    assert_eq!(worker.nics, vec![NicIndex(0)]);
    assert_eq!(worker.nic_affinity, NicAffinity::SameNuma);
    assert_eq!((worker.core, worker.numa_node), (1, 0));
}

#[test]
fn workstation_falls_back_to_numa_for_nics() {
    let topo = load("workstation-2gpu.xml");
    assert_eq!(topo.numa_nodes.len(), 1);
    assert_eq!(topo.numa_nodes[0].cores, (0..16).collect::<Vec<_>>());
    assert_eq!(topo.numa_nodes[0].pus.len(), 32);

    // A VGA-class and a 3D-class GPU; the HDMI audio function is not one.
    assert_eq!(topo.gpus.len(), 2);
    assert_eq!(topo.gpus[0].device_id, 0x2230);
    assert_eq!(topo.gpus[1].device_id, 0x20f1);
    assert_ne!(topo.gpus[0].switch, topo.gpus[1].switch);
    assert_eq!(topo.nics.len(), 1);
    assert_eq!(topo.nics[0].kind, NicKind::Ethernet);
    assert_eq!(topo.nics[0].name, "enp5s0");
    assert!(
        topo.gpus
            .iter()
            .all(|gpu| gpu.switch != topo.nics[0].switch)
    );

    let plan = topo.plan();
    assert!(!plan.host_only);
    assert_eq!(plan.workers.len(), 2);
    assert_distinct_cores(&plan);
    for worker in &plan.workers {
        assert_eq!(worker.nics, vec![NicIndex(0)]);
        assert_eq!(worker.nic_affinity, NicAffinity::SameNuma);
        assert_eq!(worker.numa_node, 0);
        assert_ne!(worker.core, 0);
    }
}

#[test]
fn no_io_machine_is_a_valid_host_only_plan() {
    let topo = load("no-io.xml");
    assert!(topo.gpus.is_empty());
    assert!(topo.nics.is_empty());
    let plan = topo.plan();
    assert!(plan.host_only);
    assert_eq!(plan.workers.len(), 1);
    assert_eq!(plan.workers[0].nic_affinity, NicAffinity::NoNic);
    assert_eq!(plan.workers[0].core, 1);
}

#[test]
fn from_xml_str_matches_from_xml_file() {
    let path = fixture("workstation-2gpu.xml");
    let text = std::fs::read_to_string(&path).unwrap();
    let from_string = Topology::from_xml_str(&text).unwrap();
    assert_eq!(from_string.source, TopologySource::XmlString);
    let from_file = Topology::from_xml_file(&path).unwrap();
    assert_eq!(
        Topology {
            source: TopologySource::XmlString,
            ..from_file
        },
        from_string
    );
}

#[test]
fn topology_and_plan_round_trip_through_json() {
    let topo = load("p5.48xlarge.xml");
    let plan = topo.plan();
    let json = serde_json::to_string(&topo).unwrap();
    assert!(
        json.contains(r#""pci":"0000:12:00.0""#),
        "PCI addresses are strings"
    );
    assert_eq!(serde_json::from_str::<Topology>(&json).unwrap(), topo);
    let json = serde_json::to_string(&plan).unwrap();
    assert_eq!(serde_json::from_str::<PlacementPlan>(&json).unwrap(), plan);
}

#[test]
fn table_shows_every_worker() {
    let topo = load("p5.48xlarge.xml");
    let plan = topo.plan();
    let table = render_table(&topo, &plan);
    println!("{table}");
    assert!(table.starts_with("p5-48xlarge-fixture (XML file "));
    assert!(table.contains("2 NUMA nodes, 96 cores, 8 GPUs, 33 NICs"));
    let gpu0 = table
        .lines()
        .find(|line| line.contains("GPU0"))
        .expect("a row for GPU0");
    for cell in [
        "0000:12:00.0",
        "0000:00:01.0",
        "rdmap19s0,rdmap20s0,rdmap21s0,rdmap22s0",
        "same switch",
    ] {
        assert!(gpu0.contains(cell), "{cell} missing from {gpu0:?}");
    }
    assert!(table.contains("0-47,96-143"));
    assert!(table.lines().all(|line| line == line.trim_end()));

    let laptop = load("laptop.xml");
    let table = render_table(&laptop, &laptop.plan());
    println!("{table}");
    assert!(table.contains("host-only plan"));
    assert!(
        table
            .lines()
            .any(|line| line.contains("host") && line.contains("wlp2s0"))
    );
}

#[test]
fn captured_h200_vm_export_replays() {
    // A real export (hwloc 2.10) from the single-H200 VM, read by this hwloc.
    let topo = load("h200-vm.captured.xml");
    assert_eq!(topo.numa_nodes.len(), 1);
    assert_eq!(topo.numa_nodes[0].cores, (0..16).collect::<Vec<_>>());
    assert_eq!(topo.gpus.len(), 1);
    let gpu = &topo.gpus[0];
    assert_eq!((gpu.vendor_id, gpu.device_id), (0x10de, 0x2335));
    assert_eq!(gpu.pci, "0000:00:06.0".parse::<PciAddress>().unwrap());
    assert_eq!(gpu.numa_node, Some(0));
    // Flat virtual PCI: everything hangs off the host bridge, no switch.
    assert_eq!(gpu.switch, None);
    assert_eq!(topo.nics.len(), 1);
    assert_eq!(topo.nics[0].name, "eth0");
    assert_eq!(topo.nics[0].kind, NicKind::Ethernet);

    let plan = topo.plan();
    assert!(!plan.host_only);
    let [worker] = plan.workers.as_slice() else {
        panic!("one worker expected: {plan:?}");
    };
    assert_eq!(worker.gpu, Some(GpuIndex(0)));
    assert_eq!(worker.nics, vec![NicIndex(0)]);
    assert_eq!(worker.nic_affinity, NicAffinity::SameNuma);
    assert_eq!((worker.core, worker.numa_node), (1, 0));
}
