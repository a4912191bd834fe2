//! Every fixture loads with hwloc's built-in ("minimalistic") XML parser, the only one a
//! machine without `libhwloc-plugins` has, so the suite can never again pass only where the
//! libxml2 importer happens to be installed.
//!
//! This binary holds one test on purpose: hwloc reads `HWLOC_LIBXML_IMPORT` once per process,
//! so the variable is set before the first load, while no other thread runs.

use std::path::Path;
use topology::{Topology, TopologyError};

#[test]
fn every_fixture_loads_with_the_built_in_parser() {
    // SAFETY: this test binary has a single test, which runs alone in its thread before any
    // hwloc call; no other thread reads or writes the environment meanwhile.
    unsafe { std::env::set_var("HWLOC_LIBXML_IMPORT", "0") };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut loaded = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "xml") {
            let topo = Topology::from_xml_file(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(
                topo.numa_nodes.iter().any(|n| !n.cores.is_empty()),
                "{}: no cores",
                path.display()
            );
            loaded.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    loaded.sort();
    assert_eq!(
        loaded,
        [
            "h200-vm.captured.xml",
            "laptop.xml",
            "no-io.xml",
            "p5.48xlarge.xml",
            "workstation-2gpu.xml"
        ]
    );

    // The built-in parser really is the one in use: a comment, which only libxml2 accepts,
    // is refused (this fails if the variable was not honoured on a machine with the plugin).
    let p5 = std::fs::read_to_string(dir.join("p5.48xlarge.xml")).unwrap();
    let commented = p5.replacen("<topology", "<!-- a comment -->\n<topology", 1);
    assert!(matches!(
        Topology::from_xml_str(&commented),
        Err(TopologyError::InvalidXml { .. })
    ));
}
