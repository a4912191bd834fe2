//! Writes the hwloc XML fixtures of `topology/tests/fixtures/`:
//!
//! ```text
//! cargo run -p topology --example gen_fixtures
//! ```
//!
//! Machines are described in code rather than XML by hand, so that bus
//! numbers, cpusets and gp indices stay consistent. The test
//! `fixtures_match_generator` fails when a checked-in file differs from what
//! this program writes.
//!
//! Every generated file was checked with hwloc 2.9's own importer:
//! `lstopo --input topology/tests/fixtures/FILE.xml --whole-io --of console`
//! loads each without a warning and shows the expected tree (p5: 2 packages,
//! 2 NUMA nodes, 96 cores / 192 PUs, 8 PCIe switches each with 1 GPU, 4 EFA
//! and 1 NVMe).
//!
//! The XML follows what `lstopo --of xml` writes with hwloc 2.9: memory
//! children before normal children before I/O children; `bridge_type`
//! "0-1" for a host bridge and "1-1" for a PCI-to-PCI bridge; `pci_type` is
//! "class [vendor:device] [subvendor:subdevice] revision"; `osdev_type` 0 =
//! storage, 1 = GPU, 2 = network, 3 = OpenFabrics (RDMA).

use std::path::Path;

/// OS device types of hwloc 2.x XML.
const OSDEV_STORAGE: u8 = 0;
const OSDEV_GPU: u8 = 1;
const OSDEV_NETWORK: u8 = 2;
const OSDEV_OPENFABRICS: u8 = 3;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (name, xml) in fixtures() {
        let path = dir.join(name);
        std::fs::write(&path, xml)
            .unwrap_or_else(|error| panic!("writing {}: {error}", path.display()));
        println!("wrote {}", path.display());
    }
}

/// Every fixture: file name and contents.
pub fn fixtures() -> Vec<(&'static str, String)> {
    vec![
        ("p5.48xlarge.xml", p5_48xlarge()),
        ("laptop.xml", laptop()),
        ("workstation-2gpu.xml", workstation()),
        ("no-io.xml", no_io()),
    ]
}

/// `<info name=".." value=".."/>` entries.
type Infos = Vec<(&'static str, String)>;

/// An OS device below a PCI function.
struct OsDevice {
    name: String,
    osdev_type: u8,
    infos: Infos,
}

/// A PCI function.
struct PciFunction {
    bus: u8,
    device: u8,
    function: u8,
    class: u16,
    vendor: u16,
    device_id: u16,
    subvendor: u16,
    subdevice: u16,
    revision: u8,
    infos: Infos,
    os_devices: Vec<OsDevice>,
}

impl PciFunction {
    fn new(bus: u8, device: u8, class: u16, vendor: u16, device_id: u16) -> Self {
        Self {
            bus,
            device,
            function: 0,
            class,
            vendor,
            device_id,
            subvendor: vendor,
            subdevice: device_id,
            revision: 0,
            infos: Vec::new(),
            os_devices: Vec::new(),
        }
    }

    fn function(mut self, function: u8) -> Self {
        self.function = function;
        self
    }

    fn subsystem(mut self, subvendor: u16, subdevice: u16, revision: u8) -> Self {
        self.subvendor = subvendor;
        self.subdevice = subdevice;
        self.revision = revision;
        self
    }

    fn names(mut self, vendor: &str, device: &str) -> Self {
        self.infos.push(("PCIVendor", vendor.to_owned()));
        self.infos.push(("PCIDevice", device.to_owned()));
        self
    }

    fn os_device(mut self, name: impl Into<String>, osdev_type: u8, infos: Infos) -> Self {
        self.os_devices.push(OsDevice {
            name: name.into(),
            osdev_type,
            infos,
        });
        self
    }
}

/// A node of the I/O tree.
enum Io {
    /// A host bridge (root complex) with its root bus range.
    HostBridge { buses: (u8, u8), children: Vec<Io> },
    /// A PCI-to-PCI bridge: its own address, the buses below it, its depth.
    Bridge {
        bus: u8,
        device: u8,
        function: u8,
        vendor: u16,
        device_id: u16,
        buses: (u8, u8),
        depth: u8,
        children: Vec<Io>,
    },
    /// An endpoint.
    Device(PciFunction),
}

/// A core with its PUs (OS indices).
struct Core {
    os_index: u32,
    pus: Vec<u32>,
}

/// A package holding one NUMA node.
struct Package {
    os_index: u32,
    memory_bytes: u64,
    cores: Vec<Core>,
    io: Vec<Io>,
}

impl Package {
    fn pus(&self) -> Vec<u32> {
        let mut pus: Vec<u32> = self
            .cores
            .iter()
            .flat_map(|core| core.pus.iter().copied())
            .collect();
        pus.sort_unstable();
        pus
    }
}

/// A whole machine.
struct Machine {
    hostname: &'static str,
    cpu_vendor: &'static str,
    cpu_model: &'static str,
    packages: Vec<Package>,
}

/// hwloc's bitmap syntax: 32-bit hex words, most significant first.
fn bitmap(bits: &[u32]) -> String {
    let words = bits.iter().map(|bit| bit / 32 + 1).max().unwrap_or(1);
    let mut values = vec![0u32; words as usize];
    for bit in bits {
        values[(bit / 32) as usize] |= 1 << (bit % 32);
    }
    values
        .iter()
        .rev()
        .map(|word| format!("0x{word:08x}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Escapes an attribute value.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

struct Writer {
    out: String,
    next_gp_index: u32,
}

impl Writer {
    fn gp(&mut self) -> u32 {
        self.next_gp_index += 1;
        self.next_gp_index
    }

    fn line(&mut self, depth: usize, text: &str) {
        for _ in 0..depth {
            self.out.push_str("  ");
        }
        self.out.push_str(text);
        self.out.push('\n');
    }

    fn info(&mut self, depth: usize, name: &str, value: &str) {
        self.line(
            depth,
            &format!(
                r#"<info name="{}" value="{}"/>"#,
                escape(name),
                escape(value)
            ),
        );
    }

    /// `cpuset`, `complete_cpuset`, `nodeset`, `complete_nodeset`.
    fn sets(cpus: &[u32], nodes: &[u32]) -> String {
        let cpuset = bitmap(cpus);
        let nodeset = bitmap(nodes);
        format!(
            r#"cpuset="{cpuset}" complete_cpuset="{cpuset}" nodeset="{nodeset}" complete_nodeset="{nodeset}""#
        )
    }

    fn io(&mut self, depth: usize, io: &Io) {
        match io {
            Io::HostBridge { buses, children } => {
                let gp = self.gp();
                self.line(
                    depth,
                    &format!(
                        r#"<object type="Bridge" gp_index="{gp}" bridge_type="0-1" depth="0" bridge_pci="0000:[{:02x}-{:02x}]">"#,
                        buses.0, buses.1
                    ),
                );
                for child in children {
                    self.io(depth + 1, child);
                }
                self.line(depth, "</object>");
            }
            Io::Bridge {
                bus,
                device,
                function,
                vendor,
                device_id,
                buses,
                depth: bridge_depth,
                children,
            } => {
                let gp = self.gp();
                self.line(
                    depth,
                    &format!(
                        r#"<object type="Bridge" gp_index="{gp}" bridge_type="1-1" depth="{bridge_depth}" bridge_pci="0000:[{:02x}-{:02x}]" pci_busid="0000:{bus:02x}:{device:02x}.{function:x}" pci_type="0604 [{vendor:04x}:{device_id:04x}] [0000:0000] 00">"#,
                        buses.0, buses.1
                    ),
                );
                for child in children {
                    self.io(depth + 1, child);
                }
                self.line(depth, "</object>");
            }
            Io::Device(pci) => {
                let gp = self.gp();
                self.line(
                    depth,
                    &format!(
                        r#"<object type="PCIDev" gp_index="{gp}" pci_busid="0000:{:02x}:{:02x}.{:x}" pci_type="{:04x} [{:04x}:{:04x}] [{:04x}:{:04x}] {:02x}">"#,
                        pci.bus,
                        pci.device,
                        pci.function,
                        pci.class,
                        pci.vendor,
                        pci.device_id,
                        pci.subvendor,
                        pci.subdevice,
                        pci.revision
                    ),
                );
                for (name, value) in &pci.infos {
                    self.info(depth + 1, name, value);
                }
                for OsDevice {
                    name,
                    osdev_type,
                    infos,
                } in &pci.os_devices
                {
                    let gp = self.gp();
                    let open = format!(
                        r#"<object type="OSDev" gp_index="{gp}" name="{}" osdev_type="{osdev_type}""#,
                        escape(name)
                    );
                    if infos.is_empty() {
                        self.line(depth + 1, &format!("{open}/>"));
                    } else {
                        self.line(depth + 1, &format!("{open}>"));
                        for (info, value) in infos {
                            self.info(depth + 2, info, value);
                        }
                        self.line(depth + 1, "</object>");
                    }
                }
                self.line(depth, "</object>");
            }
        }
    }
}

fn render(machine: &Machine) -> String {
    let mut writer = Writer {
        out: String::new(),
        next_gp_index: 0,
    };
    writer.line(0, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    writer.line(0, r#"<!DOCTYPE topology SYSTEM "hwloc2.dtd">"#);
    // No XML comment here: hwloc's built-in ("minimalistic") parser rejects comments, and
    // only a machine with libhwloc-plugins (the libxml2 importer) could read such a file.
    // Provenance lives in tests/fixtures/README.md instead.
    writer.line(0, r#"<topology version="2.0">"#);

    let all_pus: Vec<u32> = {
        let mut pus: Vec<u32> = machine.packages.iter().flat_map(Package::pus).collect();
        pus.sort_unstable();
        pus
    };
    let all_nodes: Vec<u32> = machine
        .packages
        .iter()
        .map(|package| package.os_index)
        .collect();
    let gp = writer.gp();
    let cpuset = bitmap(&all_pus);
    let nodeset = bitmap(&all_nodes);
    writer.line(
        1,
        &format!(
            r#"<object type="Machine" os_index="0" {} allowed_cpuset="{cpuset}" allowed_nodeset="{nodeset}" gp_index="{gp}">"#,
            Writer::sets(&all_pus, &all_nodes)
        ),
    );
    writer.info(2, "OSName", "Linux");
    writer.info(2, "HostName", machine.hostname);
    writer.info(2, "Architecture", "x86_64");

    for package in &machine.packages {
        let pus = package.pus();
        let node = [package.os_index];
        let gp = writer.gp();
        writer.line(
            2,
            &format!(
                r#"<object type="Package" os_index="{}" {} gp_index="{gp}">"#,
                package.os_index,
                Writer::sets(&pus, &node)
            ),
        );
        writer.info(3, "CPUVendor", machine.cpu_vendor);
        writer.info(3, "CPUModel", machine.cpu_model);
        let gp = writer.gp();
        writer.line(
            3,
            &format!(
                r#"<object type="NUMANode" os_index="{}" {} gp_index="{gp}" local_memory="{}">"#,
                package.os_index,
                Writer::sets(&pus, &node),
                package.memory_bytes
            ),
        );
        writer.line(
            4,
            &format!(
                r#"<page_type size="4096" count="{}"/>"#,
                package.memory_bytes / 4096
            ),
        );
        writer.line(3, "</object>");
        for core in &package.cores {
            let gp = writer.gp();
            writer.line(
                3,
                &format!(
                    r#"<object type="Core" os_index="{}" {} gp_index="{gp}">"#,
                    core.os_index,
                    Writer::sets(&core.pus, &node)
                ),
            );
            for &pu in &core.pus {
                let gp = writer.gp();
                writer.line(
                    4,
                    &format!(
                        r#"<object type="PU" os_index="{pu}" {} gp_index="{gp}"/>"#,
                        Writer::sets(&[pu], &node)
                    ),
                );
            }
            writer.line(3, "</object>");
        }
        for io in &package.io {
            writer.io(3, io);
        }
        writer.line(2, "</object>");
    }
    writer.line(1, "</object>");
    writer.line(0, "</topology>");
    writer.out
}

const GIB: u64 = 1 << 30;

/// Cores `first..first + count`, each with the PUs `core + offset` for every
/// offset (`[0]`: no SMT, `[0, 96]`: hyperthread sibling 96 CPUs up).
fn cores(first: u32, count: u32, sibling_offsets: &[u32]) -> Vec<Core> {
    (first..first + count)
        .map(|core| Core {
            os_index: core,
            pus: sibling_offsets.iter().map(|offset| core + offset).collect(),
        })
        .collect()
}

/// A PCI-to-PCI bridge at `bus:device.0` (PCI ids `vendor:device_id`)
/// leading to the buses `buses`, at bridge depth `depth` (1 for a root port).
fn bridge(
    bus: u8,
    device: u8,
    vendor: u16,
    device_id: u16,
    buses: (u8, u8),
    depth: u8,
    children: Vec<Io>,
) -> Io {
    Io::Bridge {
        bus,
        device,
        function: 0,
        vendor,
        device_id,
        buses,
        depth,
        children,
    }
}

/// p5.48xlarge-like: 2 sockets of AMD EPYC, one NUMA node each, 48 cores
/// with 2 hyperthreads (PUs `c` and `c + 96`), 1 TiB per node. On each
/// socket one host bridge with four root ports, each leading to a PCIe
/// switch (Broadcom-like upstream port, six downstream ports) with one H100,
/// four EFA and one NVMe. The ENA primary interface sits on socket 0's root
/// bus, outside any switch.
fn p5_48xlarge() -> String {
    const AMD_ROOT_PORT: u16 = 0x14ab;
    const SWITCH: u16 = 0xc030;
    let mut nvme = 0;
    let packages = (0..2u8)
        .map(|socket| {
            let root_bus = socket * 0x80;
            let mut host_children = Vec::new();
            if socket == 0 {
                host_children.push(Io::Device(
                    PciFunction::new(root_bus, 5, 0x0200, 0x1d0f, 0xec20)
                        .names("Amazon.com, Inc.", "Elastic Network Adapter (ENA)")
                        .os_device(
                            "ens32",
                            OSDEV_NETWORK,
                            vec![("Address", "0a:00:00:00:00:01".to_owned())],
                        ),
                ));
            }
            for port in 0..4u8 {
                // Buses b .. b+7: b below the root port (switch upstream
                // port), b+1 inside the switch, b+2.. one per downstream port.
                let b = root_bus + 0x10 * (port + 1);
                let downstream = (0..6u8)
                    .map(|slot| {
                        let bus = b + 2 + slot;
                        let device = match slot {
                            0 => PciFunction::new(bus, 0, 0x0302, 0x10de, 0x2330)
                                .subsystem(0x10de, 0x16c1, 0xa1)
                                .names("NVIDIA Corporation", "GH100 [H100 SXM5 80GB]"),
                            1..=4 => PciFunction::new(bus, 0, 0x0200, 0x1d0f, 0xefa1)
                                .names("Amazon.com, Inc.", "Elastic Fabric Adapter (EFA)")
                                .os_device(
                                    format!("rdmap{bus}s0"),
                                    OSDEV_OPENFABRICS,
                                    vec![
                                        ("Port1State", "4".to_owned()),
                                        ("Port1LID", "0x0".to_owned()),
                                    ],
                                ),
                            _ => {
                                let name = format!("nvme{nvme}n1");
                                nvme += 1;
                                PciFunction::new(bus, 0, 0x0108, 0x1d0f, 0xcd01)
                                    .names("Amazon.com, Inc.", "NVMe SSD Controller")
                                    .os_device(name, OSDEV_STORAGE, vec![])
                            }
                        };
                        bridge(
                            b + 1,
                            slot,
                            0x1000,
                            SWITCH,
                            (bus, bus),
                            3,
                            vec![Io::Device(device)],
                        )
                    })
                    .collect();
                let upstream = bridge(b, 0, 0x1000, SWITCH, (b + 1, b + 7), 2, downstream);
                host_children.push(bridge(
                    root_bus,
                    port + 1,
                    0x1022,
                    AMD_ROOT_PORT,
                    (b, b + 7),
                    1,
                    vec![upstream],
                ));
            }
            let socket = u32::from(socket);
            Package {
                os_index: socket,
                memory_bytes: 1024 * GIB,
                cores: cores(48 * socket, 48, &[0, 96]),
                io: vec![Io::HostBridge {
                    buses: (root_bus, root_bus + 0x4f),
                    children: host_children,
                }],
            }
        })
        .collect();
    render(&Machine {
        hostname: "p5-48xlarge-fixture",
        cpu_vendor: "AuthenticAMD",
        cpu_model: "AMD EPYC 7R13 Processor",
        packages,
    })
}

/// A laptop: 8 cores, one NUMA node, an Intel iGPU (not NVIDIA: must not
/// count as a GPU), an NVMe drive and a Wi-Fi adapter (class 0x0280).
fn laptop() -> String {
    render(&Machine {
        hostname: "laptop-fixture",
        cpu_vendor: "GenuineIntel",
        cpu_model: "12th Gen Intel(R) Core(TM) i7-1260P",
        packages: vec![Package {
            os_index: 0,
            memory_bytes: 16 * GIB,
            cores: cores(0, 8, &[0]),
            io: vec![Io::HostBridge {
                buses: (0x00, 0x02),
                children: vec![
                    Io::Device(
                        PciFunction::new(0x00, 0x02, 0x0300, 0x8086, 0x46a6)
                            .subsystem(0x17aa, 0x22e7, 0x0c)
                            .names(
                                "Intel Corporation",
                                "Alder Lake-P Integrated Graphics Controller",
                            )
                            .os_device("card0", OSDEV_GPU, vec![]),
                    ),
                    bridge(
                        0x00,
                        0x1c,
                        0x8086,
                        0x51b8,
                        (0x01, 0x01),
                        1,
                        vec![Io::Device(
                            PciFunction::new(0x01, 0, 0x0108, 0x144d, 0xa80a)
                                .names("Samsung Electronics Co Ltd", "NVMe SSD Controller PM9A1")
                                .os_device("nvme0n1", OSDEV_STORAGE, vec![]),
                        )],
                    ),
                    bridge(
                        0x00,
                        0x1d,
                        0x8086,
                        0x51b0,
                        (0x02, 0x02),
                        1,
                        vec![Io::Device(
                            PciFunction::new(0x02, 0, 0x0280, 0x8086, 0x2725)
                                .subsystem(0x8086, 0x0024, 0x1a)
                                .names("Intel Corporation", "Wi-Fi 6E AX210")
                                .os_device(
                                    "wlp2s0",
                                    OSDEV_NETWORK,
                                    vec![("Address", "3c:21:9c:00:00:01".to_owned())],
                                ),
                        )],
                    ),
                ],
            }],
        }],
    })
}

/// A 2-GPU workstation: 16 cores with hyperthreads (PUs `c` and `c + 16`),
/// one NUMA node, an RTX A6000 (VGA class 0x0300, with its HDMI audio
/// function) and an A100 PCIe (3D class 0x0302), each alone on its root
/// port, and an Intel Ethernet NIC on a third root port: no RDMA, no shared
/// switch.
fn workstation() -> String {
    render(&Machine {
        hostname: "workstation-fixture",
        cpu_vendor: "AuthenticAMD",
        cpu_model: "AMD Ryzen Threadripper PRO 5955WX 16-Cores",
        packages: vec![Package {
            os_index: 0,
            memory_bytes: 128 * GIB,
            cores: cores(0, 16, &[0, 16]),
            io: vec![Io::HostBridge {
                buses: (0x00, 0x06),
                children: vec![
                    bridge(
                        0x00,
                        0x01,
                        0x1022,
                        0x1453,
                        (0x01, 0x01),
                        1,
                        vec![
                            Io::Device(
                                PciFunction::new(0x01, 0, 0x0300, 0x10de, 0x2230)
                                    .subsystem(0x10de, 0x1459, 0xa1)
                                    .names("NVIDIA Corporation", "GA102GL [RTX A6000]")
                                    .os_device("card0", OSDEV_GPU, vec![]),
                            ),
                            Io::Device(
                                PciFunction::new(0x01, 0, 0x0403, 0x10de, 0x1aef)
                                    .function(1)
                                    .names(
                                        "NVIDIA Corporation",
                                        "GA102 High Definition Audio Controller",
                                    ),
                            ),
                        ],
                    ),
                    bridge(
                        0x00,
                        0x03,
                        0x1022,
                        0x1453,
                        (0x02, 0x02),
                        1,
                        vec![Io::Device(
                            PciFunction::new(0x02, 0, 0x0302, 0x10de, 0x20f1)
                                .subsystem(0x10de, 0x145f, 0xa1)
                                .names("NVIDIA Corporation", "GA100 [A100 PCIe 40GB]"),
                        )],
                    ),
                    bridge(
                        0x00,
                        0x1c,
                        0x1022,
                        0x1453,
                        (0x05, 0x05),
                        1,
                        vec![Io::Device(
                            PciFunction::new(0x05, 0, 0x0200, 0x8086, 0x15f3)
                                .subsystem(0x8086, 0x0000, 0x03)
                                .names("Intel Corporation", "Ethernet Controller I225-V")
                                .os_device(
                                    "enp5s0",
                                    OSDEV_NETWORK,
                                    vec![("Address", "a8:a1:59:00:00:01".to_owned())],
                                ),
                        )],
                    ),
                    bridge(
                        0x00,
                        0x1d,
                        0x1022,
                        0x1453,
                        (0x06, 0x06),
                        1,
                        vec![Io::Device(
                            PciFunction::new(0x06, 0, 0x0108, 0x144d, 0xa80a)
                                .names("Samsung Electronics Co Ltd", "NVMe SSD Controller PM9A1")
                                .os_device("nvme0n1", OSDEV_STORAGE, vec![]),
                        )],
                    ),
                ],
            }],
        }],
    })
}

/// A small VM where hwloc sees no I/O device at all: 1 NUMA node, 2 cores.
fn no_io() -> String {
    render(&Machine {
        hostname: "no-io-fixture",
        cpu_vendor: "AuthenticAMD",
        cpu_model: "AMD EPYC",
        packages: vec![Package {
            os_index: 0,
            memory_bytes: 4 * GIB,
            cores: cores(0, 2, &[0]),
            io: vec![],
        }],
    })
}
