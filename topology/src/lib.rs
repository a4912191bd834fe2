//! Machine topology for xfer: hwloc discovery turned into plain data (NUMA
//! nodes and their cores, NVIDIA GPUs, NICs, and the PCIe switch each device
//! sits under).
//!
//! Saved hwloc XML topologies load anywhere, so a p5.48xlarge can be
//! examined on a laptop. No hwloc type appears in the API.
//!
//! ```
//! use topology::Topology;
//!
//! # fn main() -> Result<(), topology::TopologyError> {
//! let machine = Topology::discover()?;
//! assert!(!machine.numa_nodes.is_empty());
//!
//! // Another machine's layout, from `lstopo f.xml`:
//! let p5 = Topology::from_xml_file(concat!(
//!     env!("CARGO_MANIFEST_DIR"),
//!     "/tests/fixtures/p5.48xlarge.xml"
//! ))?;
//! assert_eq!(p5.gpus.len(), 8);
//! # Ok(())
//! # }
//! ```
//!
//! Building needs the system hwloc 2.x (`libhwloc-dev`, and `libudev-dev`
//! which its static pkg-config line names). Debian's hwloc has no CUDA or
//! NVML plugin, so GPUs are recognised by PCI ids (see [`Gpu`]) and matched
//! to CUDA devices by PCI address ([`Topology::gpu_by_pci`]).
#![warn(missing_docs)]

mod discover;
mod error;
mod model;

pub use error::{HwlocError, TopologyError};
pub use model::{
    Gpu, GpuIndex, Nic, NicIndex, NicKind, NumaNode, PciAddress, SwitchId, Topology,
    TopologySource,
};
