//! Discovery, export and thread pinning on the machine running the tests.

use std::collections::HashSet;

use topology::{
    Topology, TopologyError, TopologySource, pin_current_thread, prefer_memory_node, render_table,
};

#[test]
fn discover_this_machine() {
    let topo = Topology::discover().expect("hwloc discovery");
    assert_eq!(topo.source, TopologySource::LiveMachine);
    assert!(!topo.numa_nodes.is_empty());
    assert!(topo.core_count() >= 1);
    let cpus = std::thread::available_parallelism().unwrap().get();
    let pus: usize = topo.numa_nodes.iter().map(|node| node.pus.len()).sum();
    assert!(
        pus >= 1 && pus <= cpus.max(1024),
        "{pus} PUs for {cpus} CPUs"
    );
    let plan = topo.plan();
    assert!(!plan.workers.is_empty());
    assert_eq!(plan.host_only, topo.gpus.is_empty());
    let cores: HashSet<u32> = plan.workers.iter().map(|worker| worker.core).collect();
    assert_eq!(cores.len(), plan.workers.len().min(topo.core_count()));
    println!("{}", render_table(&topo, &plan));
}

#[test]
fn exported_xml_replays_to_the_same_topology() {
    let live = Topology::discover().unwrap();
    let dir = std::env::temp_dir().join(format!("topology-live-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("here.xml");
    Topology::export_xml(&path).unwrap();
    let replayed = Topology::from_xml_file(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(replayed.source, TopologySource::XmlFile(path));
    assert_eq!(
        Topology {
            source: TopologySource::LiveMachine,
            ..replayed
        },
        live
    );
    assert_eq!(
        Topology::from_xml_str(&Topology::live_xml().unwrap())
            .unwrap()
            .plan(),
        live.plan()
    );
}

#[test]
fn export_to_an_unwritable_path_fails() {
    assert!(matches!(
        Topology::export_xml("/nonexistent/dir/here.xml"),
        Err(TopologyError::WriteXmlFile { .. })
    ));
}

#[test]
fn pin_to_the_planned_core_and_to_every_core() {
    let topo = Topology::discover().unwrap();
    let plan = topo.plan();
    let cores: Vec<u32> = std::iter::once(plan.workers[0].core)
        .chain(
            topo.numa_nodes
                .iter()
                .flat_map(|node| node.pus.iter().copied()),
        )
        .collect();
    for cpu in cores {
        std::thread::spawn(move || {
            pin_current_thread(cpu).unwrap_or_else(|error| panic!("pin to {cpu}: {error:?}"));
            // SAFETY: sched_getcpu has no preconditions.
            let now = unsafe { libc::sched_getcpu() };
            assert_eq!(u32::try_from(now).ok(), Some(cpu));
        })
        .join()
        .unwrap();
    }
}

#[test]
fn pin_to_an_absurd_core_fails() {
    std::thread::spawn(|| {
        assert!(matches!(
            pin_current_thread(1_000_000),
            Err(TopologyError::CpuOutOfRange {
                cpu: 1_000_000,
                limit: 1024
            })
        ));
        // In range of the mask, but no such CPU here.
        let absent = 1023;
        let topo = Topology::discover().unwrap();
        assert!(
            topo.numa_nodes
                .iter()
                .all(|node| !node.pus.contains(&absent))
        );
        match pin_current_thread(absent) {
            Err(TopologyError::PinThread { cpu, source }) => {
                assert_eq!(cpu, absent);
                assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
            }
            other => panic!("expected PinThread, got {other:?}"),
        }
    })
    .join()
    .unwrap();
}

#[test]
fn prefer_memory_on_the_workers_node() {
    std::thread::spawn(|| {
        let topo = Topology::discover().unwrap();
        let node = topo.plan().workers[0].numa_node;
        let numa_kernel = std::path::Path::new("/sys/devices/system/node/node0").exists();
        let result = prefer_memory_node(node);
        if numa_kernel {
            result.unwrap_or_else(|error| panic!("prefer node {node}: {error:?}"));
            // A node this machine does not have.
            assert!(matches!(
                prefer_memory_node(1000),
                Err(TopologyError::BindMemory { node: 1000, .. })
            ));
        } else {
            assert!(
                matches!(result, Err(TopologyError::BindMemory { .. })),
                "{result:?}"
            );
        }
        assert!(matches!(
            prefer_memory_node(5000),
            Err(TopologyError::NumaNodeOutOfRange { node: 5000, .. })
        ));
    })
    .join()
    .unwrap();
}
