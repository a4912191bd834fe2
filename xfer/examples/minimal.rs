use std::time::Duration;
use xfer::{Access, Agent, AgentOptions, HostBuffer, Transfer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Two agents in one process; across machines, ship b.info() and d.descriptor() (serde).
    let a = Agent::new(AgentOptions::default())?;
    let b = Agent::new(AgentOptions::default())?;
    let src = HostBuffer::new_shared(1 << 20)?;
    src.fill(0, 1 << 20, 7)?;
    let dst = HostBuffer::new_shared(1 << 20)?;
    let s = a.register(src, Access::NONE)?;
    let d = b.register(dst.clone(), Access::REMOTE_WRITE)?;
    let peer = a.connect(b.info())?; // tcp here; cuda-ipc or efa where both offer them
    let pages = Transfer::pages(&[3, 9], 4096, &[0, 1], 4096, 4096)?.imm(42);
    a.submit(&peer, &s, d.descriptor(), pages)?
        .wait(Duration::from_secs(10))?;
    b.wait_imm(42, 1, Duration::from_secs(10))?; // the receiver learns the pages landed
    assert_eq!(dst.to_vec(0, 8192)?, vec![7; 8192]);
    Ok(())
}
