//! A peer restarted over the efa backend (libfabric's `tcp` provider, the way CI runs the
//! efa code without EFA hardware): the restarted process has a new fabric address (the
//! provider picks it) and a new incarnation. The transfer that meets the dead peer ends
//! with a typed error once the agent is told the new incarnation (`update_peer`, as the
//! directory's follow would: the old address leaves the address vector, and the provider
//! fails what was pending to it), and the address vector holds the new address: a
//! descriptor of the previous process is refused with `StaleDescriptor` before anything
//! moves, the new process's memory is untouched, and a write through its own descriptor
//! lands.
//!
//! Its own harness (`harness = false`); with `XFER_EFA_RESTART_PEER=1` this binary is the
//! peer. Where libfabric or its tcp provider is missing it prints `skipped:` and passes,
//! unless `XFER_REQUIRE_LIBFABRIC=1` (CI).

mod common;

use common::child::{self, Child};
use fabric_core::MemoryLocation;
use fabric_core::engine::{EngineConfig, RailGroup};
use std::time::{Duration, Instant};
use transport_efa::{EfaConfig, EfaTransport};
use xfer::layers::AgentLayers;
use xfer::{
    Access, Agent, Error, ErrorKind, HostBuffer, RegionDescriptor, Transfer, TransportKind,
};

const LEN: usize = 1 << 20;
/// Far beyond what a transfer here needs.
const T: Duration = Duration::from_secs(30);
const PEER_ENV: &str = "XFER_EFA_RESTART_PEER";

fn config() -> EfaConfig {
    let mut c = EfaConfig::default();
    c.provider = Some("tcp".into());
    c
}

/// An agent of one efa rail over the tcp provider, or why there is none here.
fn agent(name: &str) -> Result<Agent, String> {
    let group = RailGroup::spawn(1, |_| EfaTransport::new(&config()), EngineConfig::default())
        .map_err(|e| e.to_string())?;
    Agent::from_groups(
        name,
        MemoryLocation::Host,
        vec![(TransportKind::Efa, group)],
    )
    .map_err(|e| e.to_string())
}

fn byte(round: u8) -> u8 {
    round.wrapping_mul(37).wrapping_add(1)
}

/// The peer: announces its agent's and region's metadata, then answers each line
/// `check N` with `ok` when its region holds round N's byte everywhere (round 0: zeros).
fn peer() {
    let b = agent("efa-restarting-peer").expect("the peer's agent");
    child::serve_region(&b, LEN, |mem, round| {
        let want = if round == 0 { 0 } else { byte(round) };
        mem.to_vec(0, LEN).unwrap() == vec![want; LEN]
    });
}

fn main() {
    if std::env::var_os(PEER_ENV).is_some() {
        peer();
        return;
    }
    let a = match agent("efa-initiator") {
        Ok(a) => a,
        Err(why) => {
            assert!(
                std::env::var("XFER_REQUIRE_LIBFABRIC").as_deref() != Ok("1"),
                "libfabric's tcp provider is required (XFER_REQUIRE_LIBFABRIC=1): {why}"
            );
            eprintln!("skipped: no efa agent over libfabric's tcp provider here: {why}");
            return;
        }
    };
    let (mut p, info, desc) = Child::spawn(Child::this_binary(PEER_ENV, "1"));
    let mem = HostBuffer::new_shared(LEN).unwrap();
    let src = a.register(mem.clone(), Access::NONE).unwrap();
    let peer = a.connect(&info).unwrap();
    let write = |desc: &RegionDescriptor, round: u8| {
        mem.fill(0, LEN as u64, byte(round)).unwrap();
        a.submit(
            &peer,
            &src,
            desc,
            Transfer::segments(vec![(0, 0, LEN as u64)]).timeout(Duration::from_secs(20)),
        )
    };
    write(&desc, 1).unwrap().wait(T).expect("a first write");
    assert!(p.holds(1));

    // The peer killed and started again: a new address, a new incarnation.
    p.kill();
    let (mut p, info2, desc2) = Child::spawn(Child::this_binary(PEER_ENV, "1"));
    assert_ne!(info2.instance, info.instance);
    assert_ne!(
        info2.transport(TransportKind::Efa).unwrap().rails,
        info.transport(TransportKind::Efa).unwrap().rails,
        "the provider gave the new process another address"
    );
    // A write toward the dead process: over libfabric's tcp provider it may stay pending
    // (the provider neither completes nor fails it; the engine never gives its memory back
    // while the provider may still touch it). Telling the agent of the new incarnation
    // removes the old address from the address vector, and the provider then fails what
    // was pending: it ends typed, promptly.
    let pending = write(&desc, 2);
    assert!(p.holds(0), "nothing reached the new process");
    let began = Instant::now();
    a.update_peer(&peer, &info2).expect("the new incarnation");
    let e = match pending {
        Ok(h) => h.wait(T).expect_err("the peer is dead"),
        Err(e) => e,
    };
    assert!(
        matches!(
            e.kind(),
            ErrorKind::PeerRemoved | ErrorKind::PeerUnreachable | ErrorKind::TimedOut
        ),
        "{e:?}"
    );
    println!(
        "efa: the write toward the dead peer ended {:.2?} after update_peer: {e}",
        began.elapsed()
    );
    // The agent now knows the new incarnation and its address.
    let e = write(&desc, 4).expect_err("a descriptor of the previous incarnation");
    assert!(
        matches!(e, Error::StaleDescriptor { descriptor_instance, peer_instance, .. }
            if descriptor_instance == info.instance && peer_instance == info2.instance),
        "{e:?}"
    );
    assert!(p.holds(0), "nothing of the new process's memory changed");
    write(&desc2, 5)
        .unwrap()
        .wait(T)
        .expect("a write through the new process's descriptor");
    assert!(p.holds(5), "it landed in the new process");
    println!(
        "efa restart: the dead peer's writes failed typed, the old descriptor refused \
         (StaleDescriptor), the new process reached at its new address"
    );
}
