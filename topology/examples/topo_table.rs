//! Prints the topology table and placement plan of this machine, or of a
//! saved hwloc XML file, optionally as JSON:
//!
//! ```text
//! cargo run -p topology --example topo_table [-- [FILE.xml] [--json]]
//! cargo run -p topology --example topo_table -- --export THIS-MACHINE.xml
//! ```

use topology::{Topology, render_table};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut json = false;
    let mut file = None;
    let mut arguments = std::env::args().skip(1);
    while let Some(argument) = arguments.next() {
        match argument.as_str() {
            "--json" => json = true,
            "--export" => {
                let path = arguments.next().ok_or("--export needs a file name")?;
                Topology::export_xml(&path)?;
                println!("wrote {path}");
                return Ok(());
            }
            _ => file = Some(argument),
        }
    }
    let topology = match file {
        Some(path) => Topology::from_xml_file(path)?,
        None => Topology::discover()?,
    };
    let plan = topology.plan();
    if json {
        let both = serde_json::json!({ "topology": topology, "plan": plan });
        println!("{}", serde_json::to_string_pretty(&both)?);
    } else {
        print!("{}", render_table(&topology, &plan));
    }
    Ok(())
}
