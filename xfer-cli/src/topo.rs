//! `xfer topo`: this machine's (or a saved) topology and the placement plan, and the
//! topology summary of `xfer info`.

use crate::CliError;
use clap::Args;
use fabric_core::error::report;
use serde::Serialize;
use std::path::PathBuf;
use topology::{PlacementPlan, Topology};

/// The arguments of `xfer topo`.
#[derive(Args)]
pub struct TopoArgs {
    /// Replay a topology saved as hwloc XML (by `--export`, `lstopo FILE.xml`) instead of
    /// discovering this machine.
    #[arg(long, value_name = "FILE")]
    xml: Option<PathBuf>,
    /// Print the topology and the plan as one JSON object.
    #[arg(long)]
    json: bool,
    /// Save this machine's topology as hwloc XML, for replay elsewhere with `--xml`.
    #[arg(long, value_name = "FILE", conflicts_with = "xml")]
    export: Option<PathBuf>,
}

/// What `xfer topo --json` prints.
#[derive(Serialize)]
struct TopoReport<'a> {
    topology: &'a Topology,
    plan: &'a PlacementPlan,
    /// The NICs `bench --nics auto` runs each worker's rails on, for efa and tcp.
    rails: Vec<xfer::layers::nics::WorkerRails>,
}

/// An error and its sources on one line: `a: b: c` (the library's [`report`]).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    report(e)
}

fn topology_error(e: topology::TopologyError) -> CliError {
    CliError::because("topology", e)
}

/// A saved topology that cannot be replayed: what hwloc said, and how to write a file it reads.
fn xml_error(path: &std::path::Path, e: &topology::TopologyError) -> CliError {
    let how = format!(
        "write it on the machine it describes with `lstopo --of xml {}` or `xfer topo --export {0}`",
        path.display()
    );
    let why = match e {
        topology::TopologyError::InvalidXml { .. }
            if std::fs::read_to_string(path).is_ok_and(|xml| xml.contains("<!--")) =>
        {
            "; the file holds an XML comment, which hwloc's built-in parser rejects (remove it, \
             or install libhwloc-plugins for the libxml2 parser)"
        }
        _ => "",
    };
    CliError::failed(format!("{}{why}; {how}", error_chain(e)))
}

/// Runs `xfer topo`.
pub fn run(a: TopoArgs) -> Result<(), CliError> {
    if let Some(path) = &a.export {
        Topology::export_xml(path).map_err(topology_error)?;
        eprintln!(
            "xfer: saved this machine's topology to {} (replay it with: xfer topo --xml {0})",
            path.display()
        );
    }
    let t = match &a.xml {
        Some(path) => Topology::from_xml_file(path).map_err(|e| xml_error(path, &e))?,
        None => Topology::discover().map_err(topology_error)?,
    };
    let plan = t.plan();
    let rails = xfer::layers::nics::rail_map(&t, &plan, a.xml.is_none());
    if a.json {
        let report = TopoReport {
            topology: &t,
            plan: &plan,
            rails,
        };
        outln!(
            "{}",
            serde_json::to_string(&report)
                .map_err(|e| CliError::because("cannot encode the JSON", e))?
        );
    } else {
        out!("{}", topology::render_table(&t, &plan));
        outln!();
        outln!("Rails with --nics auto (rail i on NIC i mod N; --rails defaults to N):");
        for r in &rails {
            let who = r
                .gpu
                .map_or_else(|| "host".to_string(), |g| format!("GPU {g}"));
            outln!(
                "  worker {} ({who}): efa: {} [{}]; tcp: {} [{}]",
                r.worker,
                r.efa.names(),
                r.efa.reason,
                r.tcp.names(),
                r.tcp.reason
            );
        }
    }
    Ok(())
}

/// The topology line of `xfer info`.
#[derive(Serialize)]
pub struct TopologySummary {
    /// NUMA nodes.
    pub numa_nodes: usize,
    /// Physical cores.
    pub cores: usize,
    /// NVIDIA GPUs seen on the PCI bus.
    pub gpus: usize,
    /// Network devices.
    pub nics: usize,
    /// Of which RDMA (EFA, verbs).
    pub rdma_nics: usize,
}

impl TopologySummary {
    /// Counts what `t` holds.
    pub fn of(t: &Topology) -> TopologySummary {
        TopologySummary {
            numa_nodes: t.numa_nodes.len(),
            cores: t.core_count(),
            gpus: t.gpus.len(),
            nics: t.nics.len(),
            rdma_nics: t.nics.iter().filter(|n| n.kind.is_rdma()).count(),
        }
    }
}

impl std::fmt::Display for TopologySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |n: usize| if n == 1 { "" } else { "s" };
        write!(
            f,
            "{} NUMA node{}, {} core{}, {} GPU{}, {} NIC{} ({} RDMA)",
            self.numa_nodes,
            s(self.numa_nodes),
            self.cores,
            s(self.cores),
            self.gpus,
            s(self.gpus),
            self.nics,
            s(self.nics),
            self.rdma_nics
        )
    }
}
