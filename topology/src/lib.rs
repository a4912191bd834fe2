//! Machine topology for xfer: hwloc discovery turned into plain data (NUMA
//! nodes and their cores, NVIDIA GPUs, NICs, and the PCIe switch each device
//! sits under), and a placement plan that gives every engine worker its
//! GPU, its NICs, a core to pin to and a NUMA node for its buffers.
//!
//! Saved hwloc XML topologies load anywhere, so the plan for a p5.48xlarge
//! can be checked on a laptop. No hwloc type appears in the API.
//!
//! ```
//! use topology::{Topology, pin_current_thread, render_table};
//!
//! # fn main() -> Result<(), topology::TopologyError> {
//! let machine = Topology::discover()?;
//! let plan = machine.plan();
//! println!("{}", render_table(&machine, &plan));
//!
//! // A worker thread pins itself before it opens its transports.
//! let worker = &plan.workers[0];
//! std::thread::spawn({
//!     let core = worker.core;
//!     move || pin_current_thread(core)
//! })
//! .join()
//! .expect("worker panicked")?;
//!
//! // Another machine's layout, from `xfer topo --export` or `lstopo f.xml`:
//! let p5 = Topology::from_xml_file(concat!(
//!     env!("CARGO_MANIFEST_DIR"),
//!     "/tests/fixtures/p5.48xlarge.xml"
//! ))?;
//! assert_eq!(p5.plan().workers.len(), 8);
//! # Ok(())
//! # }
//! ```
//!
//! Building needs the system hwloc 2.x (`libhwloc-dev`, and `libudev-dev`
//! which its static pkg-config line names). Debian's hwloc has no CUDA or
//! NVML plugin, so GPUs are recognised by PCI ids (see [`Gpu`]) and matched
//! to CUDA devices by PCI address ([`Topology::gpu_by_pci`]).
//!
//! Dependencies and why: `hwlocality` is the maintained safe binding to
//! hwloc, the one library that knows NUMA, PCIe switches and devices on
//! every Linux machine; `serde` so a topology and its plan travel as JSON;
//! `thiserror` for [`TopologyError`]; `libc` for the `sched_setaffinity`
//! and `set_mempolicy` calls of [`pin_current_thread`] and
//! [`prefer_memory_node`]. [`render_table`] uses `comfy-table` (built
//! without its terminal feature, so no `crossterm`) to lay out the
//! columns, in place of a hand-written width pass, and `bytesize` (as
//! `xfer-cli` does) for memory sizes in binary units.
#![warn(missing_docs)]

mod affinity;
mod discover;
mod error;
mod model;
mod plan;
mod render;

pub use affinity::{pin_current_thread, prefer_memory_node};
pub use error::{HwlocError, TopologyError};
pub use model::{
    Gpu, GpuIndex, Nic, NicIndex, NicKind, NumaNode, PciAddress, SwitchId, Topology, TopologySource,
};
pub use plan::{NicAffinity, PlacementPlan, WorkerPlacement};
pub use render::render_table;
