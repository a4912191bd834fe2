//! A text table of a topology and its plan, in the spirit of
//! `nvidia-smi topo -m`.

use std::fmt::Write as _;

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
    let mut nodes = vec![row(["NUMA", "Cores", "CPUs", "Memory"])];
    for node in &topology.numa_nodes {
        nodes.push(vec![
            node.id.to_string(),
            node.cores.len().to_string(),
            cpu_ranges(&node.pus),
            bytes(node.memory_bytes),
        ]);
    }
    push_table(&mut out, &nodes);

    out.push('\n');
    let mut workers = vec![row([
        "Worker", "GPU", "PCI", "NUMA", "Switch", "Core", "NICs", "Affinity",
    ])];
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
    push_table(&mut out, &workers);

    if !topology.nics.is_empty() {
        out.push('\n');
        let mut nics = vec![row(["NIC", "Name", "Kind", "PCI", "NUMA", "Switch"])];
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
        push_table(&mut out, &nics);
    }
    out
}

fn plural(count: usize) -> &'static str {
    if count == 1 { "" } else { "s" }
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.iter().map(|&cell| cell.to_owned()).collect()
}

fn switch(switch: Option<SwitchId>) -> String {
    switch.map_or_else(|| "-".to_owned(), |switch| switch.to_string())
}

/// Left-aligned columns, two spaces apart, no trailing spaces.
fn push_table(out: &mut String, rows: &[Vec<String>]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|column| {
            rows.iter()
                .filter_map(|row| row.get(column))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
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

/// Bytes in binary units with one decimal.
fn bytes(count: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut whole = count;
    while whole >= 1024 && unit + 1 < UNITS.len() {
        whole /= 1024;
        unit += 1;
    }
    if unit == 0 {
        return format!("{count} B");
    }
    // Tenths of the unit, in integers to stay exact.
    let scale = 1u128 << (10 * unit);
    let tenths = (u128::from(count) * 10 + scale / 2) / scale;
    format!("{}.{} {}", tenths / 10, tenths % 10, UNITS[unit])
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
