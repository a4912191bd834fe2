//! The crate's one error type.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Everything that can go wrong in this crate: one variant per failing call.
///
/// hwloc failures carry a [`HwlocError`] as their source, OS failures an
/// [`io::Error`]. None of them is worth retrying as is: the machine or the
/// input has to change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// Configuring hwloc before loading (type filters) failed.
    #[error("configuring hwloc failed")]
    Configure {
        /// What hwloc said.
        #[source]
        source: HwlocError,
    },
    /// hwloc could not discover this machine (`hwloc_topology_load`).
    #[error("hwloc could not discover this machine's topology")]
    Discover {
        /// What hwloc said.
        #[source]
        source: HwlocError,
    },
    /// A topology XML file could not be read (missing, unreadable, not UTF-8).
    #[error("cannot read topology XML file {}", path.display())]
    ReadXmlFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The XML declares an hwloc XML format this build cannot import. hwloc
    /// 2.x reads its own format (`version="2.x"`) and the 1.x format (no
    /// version, or `version="1.x"`), nothing newer.
    #[error(
        "{origin}: hwloc XML format version {found:?} is not supported (this hwloc 2.x reads XML versions 1.x and 2.x)"
    )]
    UnsupportedXmlVersion {
        /// The file path, or `<string>`.
        origin: String,
        /// The `version` attribute of the `<topology>` element.
        found: String,
    },
    /// hwloc rejected the XML: not well-formed, not an hwloc topology, or
    /// inconsistent (set with `hwloc_topology_set_xmlbuffer`, or loaded with
    /// `hwloc_topology_load`).
    #[error("{origin}: hwloc rejected the topology XML")]
    InvalidXml {
        /// The file path, or `<string>`.
        origin: String,
        /// What hwloc said.
        #[source]
        source: HwlocError,
    },
    /// hwloc could not export the topology to XML.
    #[error("hwloc could not export the topology to XML")]
    ExportXml {
        /// What hwloc said.
        #[source]
        source: HwlocError,
    },
    /// Writing the exported XML to a file failed.
    #[error("cannot write topology XML file {}", path.display())]
    WriteXmlFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The CPU number does not fit the kernel's affinity mask.
    #[error("CPU {cpu} is out of range (CPU numbers go up to {limit})")]
    CpuOutOfRange {
        /// The CPU asked for.
        cpu: u32,
        /// One past the largest CPU number the mask can hold.
        limit: u32,
    },
    /// `sched_setaffinity` refused to pin the thread (the CPU is offline,
    /// absent, or outside this process's cgroup).
    #[error("cannot pin the current thread to CPU {cpu}")]
    PinThread {
        /// The CPU asked for.
        cpu: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The NUMA node number does not fit the kernel's node mask.
    #[error("NUMA node {node} is out of range (node numbers go up to {limit})")]
    NumaNodeOutOfRange {
        /// The node asked for.
        node: u32,
        /// One past the largest node number the mask can hold.
        limit: u32,
    },
    /// `set_mempolicy` refused the memory policy (no such node, or a kernel
    /// without NUMA support).
    #[error("cannot prefer memory from NUMA node {node} for the current thread")]
    BindMemory {
        /// The node asked for.
        node: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Text that is not a PCI address `dddd:bb:dd.f`.
    #[error("{text:?} is not a PCI address (expected dddd:bb:dd.f)")]
    InvalidPciAddress {
        /// The text given.
        text: String,
    },
}

/// An error reported by hwloc, without hwloc types: the entry point that
/// failed, the `errno` it left when it set one, and a description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HwlocError {
    call: &'static str,
    errno: Option<i32>,
    detail: String,
}

impl HwlocError {
    pub(crate) fn new(call: &'static str, errno: Option<i32>, detail: impl Into<String>) -> Self {
        Self {
            call,
            errno,
            detail: detail.into(),
        }
    }

    /// The hwloc entry point that failed, e.g. `hwloc_topology_load`.
    pub fn call(&self) -> &'static str {
        self.call
    }

    /// The `errno` value hwloc left, when it set one.
    pub fn errno(&self) -> Option<i32> {
        self.errno
    }
}

impl fmt::Display for HwlocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.call, self.detail)?;
        if let Some(errno) = self.errno {
            write!(f, " ({})", io::Error::from_raw_os_error(errno))?;
        }
        Ok(())
    }
}

impl std::error::Error for HwlocError {}
