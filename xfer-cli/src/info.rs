//! `xfer info`: the transports, memory kinds, CUDA devices and topology of this machine.
//!
//! Nothing here fails the command: a missing driver or a failed discovery is reported as
//! part of the answer.

use crate::CliError;
use crate::topo::{TopologySummary, error_chain};
use serde::Serialize;
use topology::{PciAddress, Topology};

/// What `xfer info --json` prints.
#[derive(Serialize)]
struct Info {
    version: &'static str,
    transports: Vec<&'static str>,
    memory: Vec<&'static str>,
    cuda: CudaReport,
    cuda_ipc: CudaIpcReport,
    libfabric: LibfabricReport,
    topology: Option<TopologySummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    topology_error: Option<String>,
}

/// The libfabric part (`--transport efa`): which file was loaded, its version and each
/// provider's attributes.
#[derive(Serialize)]
struct LibfabricReport {
    /// The file loaded (as named, and as the loader resolved it), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resolved: Option<String>,
    /// Version of the libfabric loaded ("none" if it could not be).
    version: String,
    /// API version requested from it.
    api: String,
    /// Providers offering FI_EP_RDM with messages and RMA.
    providers: Vec<transport_efa::ProviderInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

fn libfabric_report() -> LibfabricReport {
    let lib = match transport_efa::library() {
        Ok(lib) => lib,
        Err(e) => {
            return LibfabricReport {
                path: None,
                resolved: None,
                version: "none".into(),
                api: "none".into(),
                providers: Vec::new(),
                error: Some(e.to_string()),
            };
        }
    };
    let (providers, error) = match transport_efa::info(None) {
        Ok(p) => (p, None),
        Err(e) => (Vec::new(), Some(format!("no provider: {e}"))),
    };
    LibfabricReport {
        path: Some(lib.path),
        resolved: lib.resolved,
        version: format!("{}.{}", lib.version.0, lib.version.1),
        api: format!("{}.{}", lib.api.0, lib.api.1),
        providers,
        error,
    }
}

fn libfabric_lines(l: &LibfabricReport) -> Vec<String> {
    let mut lines = vec![match (&l.path, &l.resolved) {
        (Some(p), Some(r)) if p != r => format!(
            "libfabric {} (API {} requested), loaded from {p} ({r})",
            l.version, l.api
        ),
        (Some(p), _) => format!(
            "libfabric {} (API {} requested), loaded from {p}",
            l.version, l.api
        ),
        (None, _) => "libfabric: not loaded".to_string(),
    }];
    if let Some(e) = &l.error {
        lines.push(format!("  {e}"));
    }
    for p in &l.providers {
        lines.push(format!(
            "  {} on {}/{}: mr_mode [{}], cq_data {} B, max_msg {} B, iov {}/{} (rma), inject {} B, progress {:?}, hmem {}",
            p.provider,
            p.fabric,
            p.domain,
            p.mr_mode.join(" "),
            p.cq_data_size,
            p.max_msg_size,
            p.iov_limit,
            p.rma_iov_limit,
            p.inject_size,
            p.data_progress,
            if p.hmem { "yes" } else { "no" }
        ));
    }
    lines
}

/// The CUDA part.
#[derive(Serialize)]
struct CudaReport {
    /// Whether `libcuda` can be loaded.
    driver_present: bool,
    /// The CUDA version the driver supports, e.g. "12.8".
    driver_version: Option<String>,
    devices: Vec<CudaDevice>,
    /// Why the driver could not be used, when it is present but failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// The cuda-ipc transport (`--transport cuda-ipc`, or `auto` between GPU memory of one
/// host): whether it can run here, and which GPU pairs reach each other directly.
#[derive(Serialize)]
struct CudaIpcReport {
    available: bool,
    /// How its copies are made on device 0 (`kernel`, `kernel-rows`, `batch` or `memcpy`).
    copy_method: Option<String>,
    /// For each ordered pair of devices: whether copies go device to device directly (peer
    /// access over NVLink or PCIe) rather than staged by the driver.
    peer_access: Vec<PeerAccess>,
}

#[derive(Serialize)]
struct PeerAccess {
    from: u32,
    to: u32,
    direct: bool,
}

fn cuda_ipc_report(c: &CudaReport) -> CudaIpcReport {
    let mut peer_access = Vec::new();
    let mut copy_method = None;
    if let Ok(Some(cuda)) = gpu_mem::Cuda::probe() {
        let devs: Vec<_> = c
            .devices
            .iter()
            .filter_map(|d| cuda.device(d.ordinal).ok())
            .collect();
        copy_method = devs.first().map(|d| match gpu_mem::PeerCopies::new(d) {
            Ok(c) => {
                let how = format!("{}, completions by {}", c.method().name(), c.completion());
                match c.method_note() {
                    Some(n) => format!("{how} ({n})"),
                    None => how,
                }
            }
            Err(e) => format!("unavailable: {e}"),
        });
        for a in &devs {
            for b in &devs {
                if a.ordinal() != b.ordinal() {
                    peer_access.push(PeerAccess {
                        from: a.ordinal(),
                        to: b.ordinal(),
                        direct: gpu_mem::can_access_peer(a, b).unwrap_or(false),
                    });
                }
            }
        }
    }
    CudaIpcReport {
        available: !c.devices.is_empty(),
        copy_method,
        peer_access,
    }
}

fn cuda_ipc_lines(r: &CudaIpcReport) -> Vec<String> {
    if !r.available {
        return vec!["cuda-ipc: unavailable (no CUDA device); auto uses tcp".into()];
    }
    let mut lines = vec![format!(
        "cuda-ipc: available; auto picks it between GPU memory of this host; copies: {}",
        r.copy_method.as_deref().unwrap_or("?")
    )];
    for p in &r.peer_access {
        lines.push(format!(
            "  cuda:{} -> cuda:{}: {}",
            p.from,
            p.to,
            if p.direct {
                "direct (peer access)"
            } else {
                "staged by the driver"
            }
        ));
    }
    lines
}

/// One CUDA device, placed in the topology when its PCI address matches.
#[derive(Serialize)]
struct CudaDevice {
    ordinal: u32,
    name: String,
    total_memory: u64,
    pci_bus_id: String,
    driver_version: String,
    compute_capability: String,
    dmabuf_supported: bool,
    /// The NUMA node of the device, from the topology.
    numa_node: Option<u32>,
    /// The core its worker would be pinned to, from the placement plan.
    worker_core: Option<u32>,
}

fn cuda_report(topo: Option<&Topology>) -> CudaReport {
    let driver_present = gpu_mem::driver_present();
    let plan = topo.map(Topology::plan);
    let (devices, error) = match gpu_mem::devices() {
        Ok(d) => (d, None),
        Err(e) => (Vec::new(), Some(error_chain(&e))),
    };
    let devices: Vec<CudaDevice> = devices
        .into_iter()
        .map(|d| {
            let gpu = d
                .pci_bus_id
                .parse::<PciAddress>()
                .ok()
                .and_then(|pci| topo.and_then(|t| t.gpu_by_pci(&pci)));
            let worker = gpu.and_then(|g| plan.as_ref().and_then(|p| p.worker_for_gpu(g.index)));
            CudaDevice {
                ordinal: d.ordinal,
                name: d.name,
                total_memory: d.total_memory,
                pci_bus_id: d.pci_bus_id,
                driver_version: d.driver_version.to_string(),
                compute_capability: format!(
                    "{}.{}",
                    d.compute_capability.0, d.compute_capability.1
                ),
                dmabuf_supported: d.dmabuf_supported,
                numa_node: gpu.and_then(|g| g.numa_node),
                worker_core: worker.map(|w| w.core),
            }
        })
        .collect();
    CudaReport {
        driver_present,
        driver_version: devices.first().map(|d| d.driver_version.clone()),
        devices,
        error,
    }
}

fn cuda_lines(c: &CudaReport) -> Vec<String> {
    if let Some(e) = &c.error {
        return vec![format!("CUDA: unavailable ({e})")];
    }
    if c.devices.is_empty() {
        return vec![if c.driver_present {
            "CUDA: none (the driver sees no device)".into()
        } else {
            "CUDA: none (no driver on this machine)".into()
        }];
    }
    let mut lines = vec![format!(
        "CUDA: {} device{}, driver supports CUDA {}",
        c.devices.len(),
        if c.devices.len() == 1 { "" } else { "s" },
        c.driver_version.as_deref().unwrap_or("?")
    )];
    for d in &c.devices {
        let mut line = format!(
            "  cuda:{} {}, {}, PCI {}, compute {}, dmabuf {}",
            d.ordinal,
            d.name,
            crate::size::format_size(d.total_memory),
            d.pci_bus_id,
            d.compute_capability,
            if d.dmabuf_supported { "yes" } else { "no" }
        );
        if let Some(n) = d.numa_node {
            line.push_str(&format!(", NUMA {n}"));
        }
        if let Some(c) = d.worker_core {
            line.push_str(&format!(", worker core {c}"));
        }
        lines.push(line);
    }
    lines
}

/// Runs `xfer info`.
pub fn run(json: bool) -> Result<(), CliError> {
    let (topo, topology_error) = match Topology::discover() {
        Ok(t) => (Some(t), None),
        Err(e) => (None, Some(error_chain(&e))),
    };
    let cuda = cuda_report(topo.as_ref());
    let mut memory = vec!["host"];
    if !cuda.devices.is_empty() {
        memory.push("cuda");
    }
    let i = Info {
        version: env!("CARGO_PKG_VERSION"),
        transports: vec!["auto", "tcp", "cuda-ipc", "efa", "mem"],
        cuda_ipc: cuda_ipc_report(&cuda),
        memory,
        libfabric: libfabric_report(),
        topology: topo.as_ref().map(TopologySummary::of),
        topology_error,
        cuda,
    };
    if json {
        outln!(
            "{}",
            serde_json::to_string(&i)
                .map_err(|e| CliError::because("cannot encode the JSON", e))?
        );
        return Ok(());
    }
    outln!("xfer {}", i.version);
    outln!("transports: {}", i.transports.join(", "));
    outln!("memory: {}", i.memory.join(", "));
    for line in cuda_lines(&i.cuda)
        .into_iter()
        .chain(cuda_ipc_lines(&i.cuda_ipc))
    {
        outln!("{line}");
    }
    for line in libfabric_lines(&i.libfabric) {
        outln!("{line}");
    }
    match (&i.topology, &i.topology_error) {
        (Some(s), _) => outln!("topology: {s} (xfer topo for the plan)"),
        (None, Some(e)) => outln!("topology: unavailable ({e})"),
        (None, None) => {}
    }
    Ok(())
}
