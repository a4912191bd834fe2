//! hwloc (through `hwlocality`) to plain data. The only module that touches
//! hwloc types.

use std::collections::{BTreeSet, HashMap};
use std::num::NonZeroU64;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;

use hwlocality::errors::{HybridError, RawHwlocError};
use hwlocality::object::TopologyObject;
use hwlocality::object::attributes::{OSDeviceAttributes, ObjectAttributes, UpstreamAttributes};
use hwlocality::object::types::{BridgeType, OSDeviceType, ObjectType};
use hwlocality::topology::builder::{StringInputError, TopologyBuilder, TypeFilter};
use hwlocality::topology::export::xml::XMLExportFlags;

use crate::TopologyError;
use crate::error::HwlocError;
use crate::model::{
    Gpu, GpuIndex, Nic, NicIndex, NicKind, NumaNode, PciAddress, SwitchId, Topology, TopologySource,
};

/// PCI vendor id of NVIDIA.
const NVIDIA: u16 = 0x10de;
/// PCI vendor id of Amazon (Annapurna Labs): EFA, ENA, EBS NVMe.
const AMAZON: u16 = 0x1d0f;
/// PCI class "display controller, VGA compatible".
const CLASS_VGA: u16 = 0x0300;
/// PCI class "display controller, 3D" (data-centre GPUs).
const CLASS_3D: u16 = 0x0302;
/// PCI base class "network controller".
const BASE_CLASS_NETWORK: u16 = 0x02;
/// PCI class "network controller, Ethernet".
const CLASS_ETHERNET: u16 = 0x0200;
/// PCI class "network controller, InfiniBand".
const CLASS_INFINIBAND: u16 = 0x0207;

/// Origin label for XML that did not come from a file.
const STRING_ORIGIN: &str = "<string>";

impl Topology {
    /// Discovers the machine this process runs on, I/O devices included.
    ///
    /// A machine where hwloc sees no PCI devices (a container without
    /// `/sys/bus/pci`, some VMs) still gives a valid topology, with no GPU and
    /// no NIC; [`Topology::plan`] then makes a host-only plan.
    ///
    /// # Errors
    /// [`TopologyError::Configure`] or [`TopologyError::Discover`] when hwloc
    /// fails.
    pub fn discover() -> Result<Self, TopologyError> {
        let hwloc = load_live()?;
        Ok(extract(&hwloc, TopologySource::LiveMachine))
    }

    /// Loads a topology saved as hwloc XML (by [`Topology::export_xml`],
    /// `lstopo file.xml` or `hwloc-gather-topology`) on any machine.
    ///
    /// Treat the XML as trusted input, as hwloc does. Unreadable files,
    /// text that is not XML or not a topology, truncated files and XML of a
    /// newer hwloc major version are errors. But hwloc checks the
    /// *consistency* of a well-formed topology only loosely: a hand-edited
    /// file whose PU cpusets contradict their parents makes debug builds
    /// abort (hwlocality runs hwloc's assert-based `hwloc_topology_check`
    /// after every load when `debug_assertions` are on; release builds load
    /// it), and some crafted trees (a NUMA node inside a PU) crash hwloc
    /// 2.9's importer itself, `lstopo --input` included. Files written by
    /// hwloc or by `examples/gen_fixtures.rs` are consistent. libxml2 prints
    /// its parse errors to stderr.
    ///
    /// # Errors
    /// [`TopologyError::ReadXmlFile`] when the file cannot be read,
    /// [`TopologyError::UnsupportedXmlVersion`] for XML of a newer hwloc
    /// major version, [`TopologyError::InvalidXml`] when hwloc rejects it.
    pub fn from_xml_file(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let path = path.as_ref();
        // Read it ourselves: the OS error is more useful than hwloc's EINVAL,
        // and hwlocality's file path goes through checks we do not need.
        let xml = std::fs::read_to_string(path).map_err(|source| TopologyError::ReadXmlFile {
            path: path.to_owned(),
            source,
        })?;
        let hwloc = load_xml(&xml, &path.display().to_string())?;
        Ok(extract(&hwloc, TopologySource::XmlFile(path.to_owned())))
    }

    /// Loads a topology from hwloc XML held in memory. The same caveats as
    /// [`Topology::from_xml_file`] apply.
    ///
    /// # Errors
    /// [`TopologyError::UnsupportedXmlVersion`] for XML of a newer hwloc
    /// major version, [`TopologyError::InvalidXml`] when hwloc rejects it.
    pub fn from_xml_str(xml: &str) -> Result<Self, TopologyError> {
        let hwloc = load_xml(xml, STRING_ORIGIN)?;
        Ok(extract(&hwloc, TopologySource::XmlString))
    }

    /// Discovers this machine and writes its topology, I/O devices included,
    /// as hwloc 2 XML to `path`, for replay elsewhere with
    /// [`Topology::from_xml_file`] (or `lstopo --input`).
    ///
    /// # Errors
    /// Discovery errors as in [`Topology::discover`],
    /// [`TopologyError::ExportXml`], [`TopologyError::WriteXmlFile`].
    pub fn export_xml(path: impl AsRef<Path>) -> Result<(), TopologyError> {
        let path = path.as_ref();
        let xml = Self::live_xml()?;
        std::fs::write(path, xml).map_err(|source| TopologyError::WriteXmlFile {
            path: path.to_owned(),
            source,
        })
    }

    /// Discovers this machine and returns its topology as hwloc 2 XML, as
    /// [`Topology::export_xml`] writes it.
    ///
    /// # Errors
    /// Discovery errors as in [`Topology::discover`],
    /// [`TopologyError::ExportXml`].
    pub fn live_xml() -> Result<String, TopologyError> {
        let hwloc = load_live()?;
        let xml = hwloc.export_xml(XMLExportFlags::empty()).map_err(|error| {
            TopologyError::ExportXml {
                source: raw_error(&error),
            }
        })?;
        Ok(xml.as_str().to_owned())
    }
}

/// A builder that keeps every I/O object: hwloc's default filter drops PCI
/// devices, bridges and OS devices, which are what we are here for.
fn builder_keeping_io() -> Result<TopologyBuilder, TopologyError> {
    hwlocality::Topology::builder()
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(|error| TopologyError::Configure {
            source: hybrid_error("hwloc_topology_set_io_types_filter", error),
        })
}

fn load_live() -> Result<hwlocality::Topology, TopologyError> {
    builder_keeping_io()?
        .build()
        .map_err(|error| TopologyError::Discover {
            source: raw_error(&error),
        })
}

fn load_xml(xml: &str, origin: &str) -> Result<hwlocality::Topology, TopologyError> {
    check_xml_version(xml, origin)?;
    let builder = builder_keeping_io()?;
    let invalid = |source| TopologyError::InvalidXml {
        origin: origin.to_owned(),
        source,
    };
    // hwlocality maps an hwloc failure with an errno other than EINVAL to
    // `unreachable!()`. hwloc's libxml2 importer may leave whatever errno
    // libxml2 set (for instance from iconv on a bogus `encoding=`), and bad
    // input must never abort the caller, so that one call is fenced.
    let set = panic::catch_unwind(AssertUnwindSafe(move || builder.from_xml(xml)));
    let builder = match set {
        Ok(Ok(builder)) => builder,
        Ok(Err(StringInputError::ContainsNul)) => {
            return Err(invalid(HwlocError::new(
                "hwloc_topology_set_xmlbuffer",
                None,
                "the XML contains a NUL character",
            )));
        }
        Ok(Err(error)) => {
            return Err(invalid(HwlocError::new(
                "hwloc_topology_set_xmlbuffer",
                None,
                error.to_string(),
            )));
        }
        Err(_) => {
            return Err(invalid(HwlocError::new(
                "hwloc_topology_set_xmlbuffer",
                None,
                "hwloc failed with an unexpected errno while parsing the XML",
            )));
        }
    };
    builder.build().map_err(|error| invalid(raw_error(&error)))
}

fn raw_error(error: &RawHwlocError) -> HwlocError {
    HwlocError::new(
        error.api,
        error.errno.map(|errno| errno.0),
        "hwloc reported an error",
    )
}

fn hybrid_error<E: std::error::Error>(call: &'static str, error: HybridError<E>) -> HwlocError {
    match error {
        HybridError::Rust(error) => HwlocError::new(call, None, error.to_string()),
        HybridError::Hwloc(error) => raw_error(&error),
    }
}

/// Refuses XML whose `<topology version="...">` has a major version this
/// hwloc 2.x cannot import (3 and up, or not a number), with a clear error
/// rather than hwloc's EINVAL. XML without the attribute is the hwloc 1.x
/// format, which hwloc 2 imports; anything without a `<topology>` element is
/// left for hwloc to reject.
pub(crate) fn check_xml_version(xml: &str, origin: &str) -> Result<(), TopologyError> {
    let Some(tag) = root_tag(xml) else {
        return Ok(());
    };
    let Some(version) = attribute(tag, "version") else {
        return Ok(());
    };
    let major = version.split('.').next().unwrap_or_default().trim();
    match major.parse::<u32>() {
        Ok(1 | 2) => Ok(()),
        _ => Err(TopologyError::UnsupportedXmlVersion {
            origin: origin.to_owned(),
            found: version.to_owned(),
        }),
    }
}

/// The text of the first `<topology ...>` start tag, without the brackets.
fn root_tag(xml: &str) -> Option<&str> {
    let mut rest = xml;
    loop {
        let start = rest.find("<topology")?;
        let after = &rest[start + "<topology".len()..];
        if after.starts_with(|c: char| c.is_ascii_whitespace() || c == '>' || c == '/') {
            let end = after.find('>')?;
            return Some(&after[..end]);
        }
        rest = after;
    }
}

/// The value of attribute `name` in the inside of a start tag.
fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = tag;
    while let Some(position) = rest.find(name) {
        let before = rest[..position].chars().next_back();
        let after = rest[position + name.len()..].trim_start();
        rest = &rest[position + name.len()..];
        if !before.is_some_and(|c| c.is_ascii_whitespace()) {
            continue;
        }
        let Some(value) = after.strip_prefix('=') else {
            continue;
        };
        let value = value.trim_start();
        let quote = value.chars().next()?;
        if quote != '"' && quote != '\'' {
            return None;
        }
        let value = &value[1..];
        return value.find(quote).map(|end| &value[..end]);
    }
    None
}

/// Converts a loaded hwloc topology to plain data.
fn extract(hwloc: &hwlocality::Topology, source: TopologySource) -> Topology {
    let hostname = hwloc
        .root_object()
        .info("HostName")
        .map(|name| name.to_string_lossy().into_owned());
    let numa_nodes = numa_nodes(hwloc);

    let mut gpus = Vec::new();
    let mut nics = Vec::new();
    for device in hwloc.pci_devices() {
        let Some(ObjectAttributes::PCIDevice(attributes)) = device.attributes() else {
            continue;
        };
        let pci = PciAddress {
            domain: u32::from(attributes.domain()),
            bus: attributes.bus_id(),
            device: attributes.bus_device(),
            function: attributes.function(),
        };
        let class = attributes.class_id();
        let vendor_id = attributes.vendor_id();
        let device_id = attributes.device_id();
        if vendor_id == NVIDIA && (class == CLASS_3D || class == CLASS_VGA) {
            gpus.push(Gpu {
                index: GpuIndex(0),
                pci,
                numa_node: numa_node_of(device),
                switch: switch_of(device),
                vendor_id,
                device_id,
                name: device_name(device, vendor_id, device_id),
            });
        } else if class >> 8 == BASE_CLASS_NETWORK || (vendor_id == AMAZON && is_efa_id(device_id))
        {
            let rdma_name = os_device_name(device, OSDeviceType::OpenFabrics);
            let netdev = os_device_name(device, OSDeviceType::Network);
            let kind = if vendor_id == AMAZON && (is_efa_id(device_id) || rdma_name.is_some()) {
                NicKind::Efa
            } else if rdma_name.is_some() || class == CLASS_INFINIBAND {
                NicKind::Rdma
            } else if class == CLASS_ETHERNET {
                NicKind::Ethernet
            } else {
                NicKind::Other
            };
            nics.push(Nic {
                index: NicIndex(0),
                name: rdma_name
                    .clone()
                    .or_else(|| netdev.clone())
                    .unwrap_or_else(|| pci.to_string()),
                netdev,
                kind,
                pci,
                numa_node: numa_node_of(device),
                switch: switch_of(device),
                vendor_id,
                device_id,
            });
        }
    }
    gpus.sort_by_key(|gpu| gpu.pci);
    for (index, gpu) in (0..).zip(gpus.iter_mut()) {
        gpu.index = GpuIndex(index);
    }
    nics.sort_by_key(|nic| nic.pci);
    for (index, nic) in (0..).zip(nics.iter_mut()) {
        nic.index = NicIndex(index);
    }

    Topology {
        source,
        hostname,
        numa_nodes,
        gpus,
        nics,
    }
}

/// EFA device ids are 0xefa0 (first generation) onwards.
fn is_efa_id(device_id: u16) -> bool {
    device_id & 0xfff0 == 0xefa0
}

fn numa_nodes(hwloc: &hwlocality::Topology) -> Vec<NumaNode> {
    // Every PU, and the lowest-numbered PU of each core, which stands for the
    // core. A PU with no Core above it (some XML, some architectures) is its
    // own core.
    let mut all_pus = BTreeSet::new();
    let mut first_pu_of_core = HashMap::new();
    let mut coreless_pus = BTreeSet::new();
    for pu in hwloc.objects_with_type(ObjectType::PU) {
        let Some(os_index) = pu.os_index().and_then(|index| u32::try_from(index).ok()) else {
            continue;
        };
        all_pus.insert(os_index);
        match pu.first_ancestor_with_type(ObjectType::Core) {
            Some(core) => {
                first_pu_of_core
                    .entry(core.global_persistent_index())
                    .and_modify(|first: &mut u32| *first = (*first).min(os_index))
                    .or_insert(os_index);
            }
            None => {
                coreless_pus.insert(os_index);
            }
        }
    }
    let core_pus: BTreeSet<u32> = first_pu_of_core.into_values().chain(coreless_pus).collect();

    let mut nodes: Vec<NumaNode> = hwloc
        .objects_with_type(ObjectType::NUMANode)
        .filter_map(|node| {
            let id = u32::try_from(node.os_index()?).ok()?;
            let memory_bytes = match node.attributes() {
                Some(ObjectAttributes::NUMANode(attributes)) => {
                    attributes.local_memory().map_or(0, NonZeroU64::get)
                }
                _ => 0,
            };
            let pus: Vec<u32> = node
                .cpuset()
                .map(|cpuset| {
                    cpuset
                        .iter_set()
                        .filter_map(|index| u32::try_from(usize::from(index)).ok())
                        .filter(|pu| all_pus.contains(pu))
                        .collect()
                })
                .unwrap_or_default();
            let cores = pus
                .iter()
                .copied()
                .filter(|pu| core_pus.contains(pu))
                .collect();
            Some(NumaNode {
                id,
                cores,
                pus,
                memory_bytes,
            })
        })
        .collect();
    nodes.sort_by_key(|node| node.id);
    nodes
}

/// The NUMA node of an I/O object: the nodeset of the first normal object
/// above it, when that is exactly one node. hwloc attaches I/O trees to the
/// object that covers their locality, so a device attached to the whole
/// machine of a multi-node host has no single node (`None`).
fn numa_node_of(object: &TopologyObject) -> Option<u32> {
    let parent = object.first_non_io_ancestor()?;
    let nodeset = parent.nodeset()?;
    if nodeset.weight() != Some(1) {
        return None;
    }
    u32::try_from(usize::from(nodeset.first_set()?)).ok()
}

/// See [`SwitchId`] for the definition: the PCI-to-PCI bridge directly below
/// the host bridge on the device's path.
fn switch_of(object: &TopologyObject) -> Option<SwitchId> {
    let mut topmost = None;
    let mut current = object.parent();
    while let Some(bridge) = current {
        let Some(ObjectAttributes::Bridge(attributes)) = bridge.attributes() else {
            break;
        };
        if attributes.upstream_type() != BridgeType::PCI {
            // The host bridge: the root complex.
            break;
        }
        let Some(UpstreamAttributes::PCI(upstream)) = attributes.upstream_attributes() else {
            break;
        };
        topmost = Some(PciAddress {
            domain: u32::from(upstream.domain()),
            bus: upstream.bus_id(),
            device: upstream.bus_device(),
            function: upstream.function(),
        });
        current = bridge.parent();
    }
    topmost.map(SwitchId)
}

/// The name of the first OS device of this type below a PCI device.
fn os_device_name(device: &TopologyObject, wanted: OSDeviceType) -> Option<String> {
    device.io_children().find_map(|child| {
        let attributes: &OSDeviceAttributes = match child.attributes() {
            Some(ObjectAttributes::OSDevice(attributes)) => attributes,
            _ => return None,
        };
        if attributes.device_type() != wanted {
            return None;
        }
        child.name().map(|name| name.to_string_lossy().into_owned())
    })
}

fn device_name(device: &TopologyObject, vendor_id: u16, device_id: u16) -> String {
    device
        .info("PCIDevice")
        .or_else(|| device.name())
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| format!("{vendor_id:04x}:{device_id:04x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_check_reads_the_root_element() {
        let v2 = r#"<?xml version="1.0"?><!DOCTYPE topology SYSTEM "hwloc2.dtd"><topology version="2.0"><object/></topology>"#;
        assert!(check_xml_version(v2, "x").is_ok());
        let v1 = r#"<?xml version="1.0"?><topology><object/></topology>"#;
        assert!(check_xml_version(v1, "x").is_ok());
        let v3 = "<topology  version = '3.1' >";
        assert!(matches!(
            check_xml_version(v3, "x"),
            Err(TopologyError::UnsupportedXmlVersion { found, .. }) if found == "3.1"
        ));
        let junk = r#"<topology version="two">"#;
        assert!(check_xml_version(junk, "x").is_err());
        // `<topologyfoo version="9">` is not the root element, and `subversion` is not `version`.
        let other = r#"<topologyfoo version="9"/><topology subversion="9" version="2.1">"#;
        assert!(check_xml_version(other, "x").is_ok());
    }

    #[test]
    fn efa_device_ids() {
        assert!(is_efa_id(0xefa0));
        assert!(is_efa_id(0xefa1));
        assert!(is_efa_id(0xefa2));
        assert!(!is_efa_id(0xec20)); // ENA
        assert!(!is_efa_id(0x8061)); // EBS NVMe
    }
}
