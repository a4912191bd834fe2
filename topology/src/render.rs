//! A text table of a topology and its plan, in the spirit of
//! `nvidia-smi topo -m`. `comfy-table` lays out the columns and `bytesize`
//! writes the memory sizes.

use std::fmt::Write as _;

use bytesize::ByteSize;
use comfy_table::Table;
use comfy_table::presets::NOTHING;

use crate::model::{SwitchId, Topology};
use crate::plan::PlacementPlan;

/// Renders the NUMA nodes, one row per worker (GPU, PCI, NUMA, switch,
/// worker core, NICs and how they were chosen), and the NICs, as aligned
/// text columns. `xfer topo` prints this.
pub fn render_table(topology: &Topology, plan: &PlacementPlan) -> String {
    let mut out = String::new();
    let host = topology.hostname.as_deref().unwrap_or("unknown host");
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        "{host} ({}): {} NUMA node{}, {} cores, {} GPU{}, {} NIC{}{}",
        topology.source,
        topology.numa_nodes.len(),
        plural(topology.numa_nodes.len()),
        topology.core_count(),
        topology.gpus.len(),
        plural(topology.gpus.len()),
        topology.nics.len(),
        plural(topology.nics.len()),
        if plan.host_only {
            "; host-only plan (no GPU)"
        } else {
            ""
        },
    );

    out.push('\n');
    let mut nodes = Vec::new();
    for node in &topology.numa_nodes {
        nodes.push(vec![
            node.id.to_string(),
            node.cores.len().to_string(),
            cpu_ranges(&node.pus),
            bytes(node.memory_bytes),
        ]);
    }
    push_table(&mut out, ["NUMA", "Cores", "CPUs", "Memory"], nodes);

    out.push('\n');
    let mut workers = Vec::new();
    for (number, worker) in plan.workers.iter().enumerate() {
        let gpu = worker.gpu.and_then(|index| topology.gpu(index));
        let nic_names: Vec<&str> = worker
            .nics
            .iter()
            .filter_map(|&index| topology.nic(index))
            .map(|nic| nic.name.as_str())
            .collect();
        workers.push(vec![
            number.to_string(),
            worker
                .gpu
                .map_or_else(|| "host".to_owned(), |index| index.to_string()),
            gpu.map_or_else(|| "-".to_owned(), |gpu| gpu.pci.to_string()),
            worker.numa_node.to_string(),
            switch(gpu.and_then(|gpu| gpu.switch)),
            worker.core.to_string(),
            if nic_names.is_empty() {
                "-".to_owned()
            } else {
                nic_names.join(",")
            },
            worker.nic_affinity.label().to_owned(),
        ]);
    }
    push_table(
        &mut out,
        [
            "Worker", "GPU", "PCI", "NUMA", "Switch", "Core", "NICs", "Affinity",
        ],
        workers,
    );

    if !topology.nics.is_empty() {
        out.push('\n');
        let mut nics = Vec::new();
        for nic in &topology.nics {
            nics.push(vec![
                nic.index.to_string(),
                nic.name.clone(),
                nic.kind.to_string(),
                nic.pci.to_string(),
                nic.numa_node
                    .map_or_else(|| "-".to_owned(), |node| node.to_string()),
                switch(nic.switch),
            ]);
        }
        push_table(
            &mut out,
            ["NIC", "Name", "Kind", "PCI", "NUMA", "Switch"],
            nics,
        );
    }
    out
}

fn plural(count: usize) -> &'static str {
    if count == 1 { "" } else { "s" }
}

fn switch(switch: Option<SwitchId>) -> String {
    switch.map_or_else(|| "-".to_owned(), |switch| switch.to_string())
}

/// Left-aligned columns under a header, two spaces apart, no borders and no
/// trailing spaces. Content arrangement stays off, so a narrow terminal
/// never wraps a cell.
fn push_table<const N: usize>(out: &mut String, header: [&str; N], rows: Vec<Vec<String>>) {
    let mut table = Table::new();
    table.load_preset(NOTHING).set_header(header).add_rows(rows);
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    out.push_str(&table.trim_fmt());
    out.push('\n');
}

/// `0-47,96-143` from a sorted list of CPU numbers.
fn cpu_ranges(cpus: &[u32]) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &cpu in cpus {
        match ranges.last_mut() {
            Some((_, end)) if cpu == *end + 1 => *end = cpu,
            _ => ranges.push((cpu, cpu)),
        }
    }
    if ranges.is_empty() {
        return "-".to_owned();
    }
    ranges
        .iter()
        .map(|&(start, end)| {
            if start == end {
                start.to_string()
            } else {
                format!("{start}-{end}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Bytes in binary units with one decimal (`1.0 TiB`, `512 B`).
fn bytes(count: u64) -> String {
    ByteSize(count).display().iec().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ranges_compress() {
        assert_eq!(cpu_ranges(&[]), "-");
        assert_eq!(cpu_ranges(&[3]), "3");
        assert_eq!(cpu_ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }

    #[test]
    fn bytes_are_readable() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(4_523_778_048), "4.2 GiB");
        assert_eq!(bytes(1 << 40), "1.0 TiB");
    }
}
