//! The plain-data description of a machine: what discovery produces and what
//! the planner reads. Nothing here knows about hwloc.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::TopologyError;

/// A machine's layout: NUMA nodes and their cores, NVIDIA GPUs, network
/// devices, and which PCIe switch each device sits under.
///
/// Build one with [`Topology::discover`] (this machine) or
/// [`Topology::from_xml_file`] / [`Topology::from_xml_str`] (a saved hwloc
/// topology). It is plain data: it can be cloned, compared, and sent as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Where this description came from.
    pub source: TopologySource,
    /// The host name recorded by hwloc, when it recorded one.
    pub hostname: Option<String>,
    /// NUMA nodes, sorted by OS index. hwloc always reports at least one.
    pub numa_nodes: Vec<NumaNode>,
    /// NVIDIA GPUs, sorted by PCI address; `gpus[i].index == GpuIndex(i)`.
    pub gpus: Vec<Gpu>,
    /// Network devices (PCI class 0x02 and Amazon EFA), sorted by PCI address;
    /// `nics[i].index == NicIndex(i)`.
    pub nics: Vec<Nic>,
}

/// Where a [`Topology`] was read from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TopologySource {
    /// Discovered on the machine this process runs on.
    LiveMachine,
    /// Loaded from a saved hwloc XML file.
    XmlFile(PathBuf),
    /// Loaded from hwloc XML held in memory.
    XmlString,
}

impl fmt::Display for TopologySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LiveMachine => f.write_str("live machine"),
            Self::XmlFile(path) => write!(f, "XML file {}", path.display()),
            Self::XmlString => f.write_str("XML string"),
        }
    }
}

/// One NUMA node: a set of CPUs with their local memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNode {
    /// The OS index of the node (Linux `node<N>`), as used by `numactl` and
    /// memory binding.
    pub id: u32,
    /// One entry per **physical core** of this node: the OS index of the
    /// core's first (lowest-numbered) PU, i.e. the Linux CPU number to pass to
    /// [`pin_current_thread`](crate::pin_current_thread). Hyperthread
    /// siblings are left out, so two workers pinned to two entries never share
    /// a core. Sorted ascending. Empty for memory-only nodes.
    pub cores: Vec<u32>,
    /// Every PU (hardware thread, Linux CPU number) of this node, sorted
    /// ascending, hyperthread siblings included.
    pub pus: Vec<u32>,
    /// Local memory in bytes, as reported by hwloc (0 when unknown).
    pub memory_bytes: u64,
}

/// Position of a GPU in [`Topology::gpus`]: NVIDIA GPUs numbered in PCI
/// address order.
///
/// This equals the CUDA device ordinal only under
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`; match CUDA devices by
/// [`Gpu::pci`] instead (see [`Topology::gpu_by_pci`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GpuIndex(pub u32);

impl fmt::Display for GpuIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU{}", self.0)
    }
}

/// Position of a NIC in [`Topology::nics`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NicIndex(pub u32);

impl fmt::Display for NicIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NIC{}", self.0)
    }
}

/// An NVIDIA GPU found by PCI vendor 0x10de and class 0x0302 (3D controller)
/// or 0x0300 (VGA controller).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Position in [`Topology::gpus`].
    pub index: GpuIndex,
    /// PCI address; CUDA's `CU_DEVICE_ATTRIBUTE_PCI_*` give the same triple.
    pub pci: PciAddress,
    /// The NUMA node the GPU is attached to, when hwloc knows a single one.
    pub numa_node: Option<u32>,
    /// The PCIe switch the GPU sits under; see [`SwitchId`].
    pub switch: Option<SwitchId>,
    /// PCI vendor id (0x10de).
    pub vendor_id: u16,
    /// PCI device id (0x2330 for an H100 SXM5).
    pub device_id: u16,
    /// Marketing or PCI database name when hwloc has one, else
    /// `"vvvv:dddd"`.
    pub name: String,
}

/// What a network device can do, as far as the topology can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NicKind {
    /// AWS Elastic Fabric Adapter: Amazon PCI vendor 0x1d0f with an EFA device
    /// id (0xefa0..=0xefaf), or any Amazon device with an RDMA OS device.
    Efa,
    /// Another RDMA device: an RDMA (OpenFabrics) OS device such as `mlx5_0`,
    /// or PCI class 0x0207 (InfiniBand).
    Rdma,
    /// PCI class 0x0200 (Ethernet) without RDMA, e.g. `eth0` or AWS ENA.
    Ethernet,
    /// Any other network controller (class 0x02xx), e.g. Wi-Fi (0x0280).
    Other,
}

impl NicKind {
    /// Whether the device offers RDMA (EFA or verbs).
    pub fn is_rdma(self) -> bool {
        matches!(self, Self::Efa | Self::Rdma)
    }
}

impl fmt::Display for NicKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Efa => "efa",
            Self::Rdma => "rdma",
            Self::Ethernet => "ethernet",
            Self::Other => "other",
        })
    }
}

/// A network device (one PCI function).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nic {
    /// Position in [`Topology::nics`].
    pub index: NicIndex,
    /// The OS device name: the RDMA device name when there is one
    /// (`rdmap79s0`, `mlx5_0`: what libfabric and verbs call the domain),
    /// else the network interface (`eth0`), else the PCI address.
    pub name: String,
    /// The network interface name when the device has one (`eth0`), even
    /// when [`Nic::name`] is the RDMA name.
    pub netdev: Option<String>,
    /// What the device can do.
    pub kind: NicKind,
    /// PCI address.
    pub pci: PciAddress,
    /// The NUMA node the device is attached to, when hwloc knows a single one.
    pub numa_node: Option<u32>,
    /// The PCIe switch the device sits under; see [`SwitchId`].
    pub switch: Option<SwitchId>,
    /// PCI vendor id.
    pub vendor_id: u16,
    /// PCI device id.
    pub device_id: u16,
}

/// A PCI address `domain:bus:device.function`, written `0000:53:00.0`.
///
/// Parsing also accepts CUDA's 8-digit domain (`00000000:53:00.0`) and
/// upper-case hex. Serialized as the string form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PciAddress {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0..32).
    pub device: u8,
    /// Function number (0..8).
    pub function: u8,
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl FromStr for PciAddress {
    type Err = TopologyError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = || TopologyError::InvalidPciAddress {
            text: text.to_owned(),
        };
        let (domain, rest) = text.trim().split_once(':').ok_or_else(invalid)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(invalid)?;
        let (device, function) = rest.split_once('.').ok_or_else(invalid)?;
        let hex32 = |s: &str, max_digits: usize| {
            if s.is_empty() || s.len() > max_digits {
                return Err(invalid());
            }
            u32::from_str_radix(s, 16).map_err(|_| invalid())
        };
        let domain = hex32(domain, 8)?;
        let bus = u8::try_from(hex32(bus, 2)?).map_err(|_| invalid())?;
        let device = u8::try_from(hex32(device, 2)?).map_err(|_| invalid())?;
        let function = u8::try_from(hex32(function, 1)?).map_err(|_| invalid())?;
        if device >= 32 || function >= 8 {
            return Err(invalid());
        }
        Ok(Self {
            domain,
            bus,
            device,
            function,
        })
    }
}

impl TryFrom<String> for PciAddress {
    type Error = TopologyError;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<PciAddress> for String {
    fn from(address: PciAddress) -> Self {
        address.to_string()
    }
}

/// Identifies the PCIe switch (more precisely: the PCIe hierarchy below one
/// root port) that a device sits under.
///
/// **Definition.** Walk up from the device through its PCI-to-PCI bridges to
/// the host bridge (the root complex, which hwloc shows as a `HostBridge`).
/// The switch id is the PCI address of the last PCI-to-PCI bridge before the
/// host bridge, i.e. the bridge directly below the host bridge on the
/// device's path (on real hardware: the root port that the switch hangs
/// from). A device attached straight to a host bridge, with no PCI-to-PCI
/// bridge above it, has no switch (`None`).
///
/// So two devices get the same id exactly when their nearest common upstream
/// bridge is a PCI-to-PCI bridge rather than the host bridge, that is when
/// traffic between them stays inside the PCIe fabric and never crosses the
/// CPU's root complex: `nvidia-smi topo -m` calls that PIX or PXB, and PHB
/// or worse otherwise. On a p5.48xlarge each GPU shares its id with its four
/// EFA NICs and its NVMe drive. Nested switches under one root port share
/// one id. A device alone on its root port (a workstation GPU in a slot) gets
/// an id that nothing else shares, which makes the planner fall back to
/// NUMA locality.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SwitchId(pub PciAddress);

impl fmt::Display for SwitchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Topology {
    /// The GPU at this PCI address, e.g. the one CUDA reports for a device
    /// ordinal (`cuDeviceGetPCIBusId`).
    pub fn gpu_by_pci(&self, pci: &PciAddress) -> Option<&Gpu> {
        self.gpus.iter().find(|gpu| gpu.pci == *pci)
    }

    /// The GPU with this index.
    pub fn gpu(&self, index: GpuIndex) -> Option<&Gpu> {
        self.gpus.get(usize::try_from(index.0).ok()?)
    }

    /// The NIC with this index.
    pub fn nic(&self, index: NicIndex) -> Option<&Nic> {
        self.nics.get(usize::try_from(index.0).ok()?)
    }

    /// The NUMA node with this OS index.
    pub fn numa_node(&self, id: u32) -> Option<&NumaNode> {
        self.numa_nodes.iter().find(|node| node.id == id)
    }

    /// Number of physical cores over all NUMA nodes.
    pub fn core_count(&self) -> usize {
        self.numa_nodes.iter().map(|node| node.cores.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_address_round_trips() {
        let address: PciAddress = "0000:53:00.0".parse().unwrap();
        assert_eq!(
            address,
            PciAddress {
                domain: 0,
                bus: 0x53,
                device: 0,
                function: 0
            }
        );
        assert_eq!(address.to_string(), "0000:53:00.0");
        let cuda: PciAddress = "00000001:A8:1F.7".parse().unwrap();
        assert_eq!(cuda.to_string(), "0001:a8:1f.7");
    }

    #[test]
    fn pci_address_rejects_garbage() {
        for text in [
            "",
            "53:00.0",
            "0000:53:00",
            "0000:153:00.0",
            "0000:53:20.0",
            "0000:53:00.8",
            "x:y:z.w",
        ] {
            assert!(
                matches!(
                    text.parse::<PciAddress>(),
                    Err(TopologyError::InvalidPciAddress { .. })
                ),
                "{text:?} was accepted"
            );
        }
    }
}
