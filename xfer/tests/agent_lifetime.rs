//! An agent's end: what `Agent::close` gives back and reports, the keep-alives of
//! registered memory, and the `mem` transport's one-process rule. In-process transports
//! only (mem, and a transport that hangs on demand), so these run anywhere.

use fabric_core::engine::{EngineConfig, RailGroup};
use fabric_core::testing::{StuckGate, StuckTransport, eventually};
use std::sync::Arc;
use std::time::Duration;
use xfer::layers::AgentLayers;
use xfer::{
    Access, Agent, AgentInfo, AgentOptions, Error, HostBuffer, MemoryLocation, TransportChoice,
    TransportKind,
};

fn mem_agent() -> Agent {
    Agent::new(AgentOptions {
        transport: TransportChoice::Only(TransportKind::Mem),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("a mem agent")
}

/// A keep-alive that says whether it was dropped: the test holds the other handle.
fn token() -> (Arc<()>, Option<Box<dyn Send>>) {
    let t = Arc::new(());
    (t.clone(), Some(Box::new(t)))
}

#[test]
fn closing_the_last_handle_stops_the_agent_and_gives_every_keep_alive_back() {
    let a = mem_agent();
    let (t1, keep1) = token();
    let (t2, keep2) = token();
    let r1 = a
        .register_kept(HostBuffer::new_shared(4096).unwrap(), Access::NONE, keep1)
        .unwrap();
    let _r2 = a
        .register_kept(HostBuffer::new_shared(4096).unwrap(), Access::NONE, keep2)
        .unwrap();
    a.deregister(&r1).unwrap();
    assert_eq!(Arc::strong_count(&t1), 1, "deregistering gave it back");
    assert_eq!(Arc::strong_count(&t2), 2, "still registered");
    let other = a.clone();
    assert_eq!(a.close(), None, "another handle remains: nothing stops");
    assert_eq!(Arc::strong_count(&t2), 2);
    assert_eq!(
        other.close(),
        Some(0),
        "the last handle stops it, nothing held"
    );
    assert_eq!(Arc::strong_count(&t2), 1, "closing gave it back");
}

#[test]
fn an_agent_closed_while_its_transport_is_stuck_keeps_the_memory_until_it_lets_go() {
    let gate = Arc::new(StuckGate::default());
    let g = gate.clone();
    let cfg = EngineConfig {
        shutdown_timeout: Duration::from_millis(100),
        ..EngineConfig::default()
    };
    let group = RailGroup::spawn(1, move |_| Ok(StuckTransport::new(g.clone())), cfg).unwrap();
    let a = Agent::from_groups(
        "stuck",
        MemoryLocation::Host,
        vec![(TransportKind::Mem, group)],
    )
    .unwrap();
    let (t, keep) = token();
    a.register_kept(HostBuffer::new_shared(4096).unwrap(), Access::NONE, keep)
        .unwrap();
    gate.shut();
    eventually(
        "the worker to hang in its transport",
        Duration::from_secs(10),
        || gate.hanging(),
    );
    assert_eq!(a.close(), Some(1), "one region still held by the transport");
    assert_eq!(
        Arc::strong_count(&t),
        2,
        "kept while the transport may touch it"
    );
    gate.open();
    eventually("the transport to let go", Duration::from_secs(10), || {
        xfer::release_kept() == 0 && Arc::strong_count(&t) == 1
    });
}

#[test]
fn mem_reaches_agents_of_this_process_only() {
    let (a, b) = (mem_agent(), mem_agent());
    let p = a.connect(b.info()).expect("an agent of this process");
    assert_eq!(p.transport(), TransportKind::Mem);
    // Another process's agent: its rails' addresses are those of b (mem addresses are
    // small numbers, and another process's may well name an endpoint of this one), but it
    // is not an agent of this process.
    let foreign = AgentInfo {
        transports: b.info().transports.clone(),
        ..AgentInfo::new("elsewhere", &b.info().boot_id, MemoryLocation::Host)
    };
    let bytes = foreign.to_bytes().unwrap();
    let e = a
        .connect(&AgentInfo::from_bytes(&bytes).unwrap())
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotInThisProcess {
                kind: TransportKind::Mem,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("one process"), "{e}");
}
