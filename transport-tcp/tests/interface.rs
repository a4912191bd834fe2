//! `TcpConfig::interface`: a transport bound to a named NIC works over it, and a name that
//! is no interface fails at once, naming it. (That each rail's bytes leave through its own
//! NIC is proven with four veth pairs in `xfer-cli/tests/netns_nics.rs`.)

use fabric_core::engine::{Engine, EngineConfig, Transfer};
use fabric_core::plan::Segment;
use fabric_core::{Access, Error, HostBuffer};
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};

fn on(interface: Option<&str>) -> fabric_core::Result<TcpTransport> {
    TcpTransport::new(TcpConfig {
        interface: interface.map(str::to_string),
        ..TcpConfig::default()
    })
}

#[test]
fn a_transport_bound_to_lo_moves_bytes() {
    let a = Engine::spawn(|| on(Some("lo")), EngineConfig::default()).unwrap();
    let b = Engine::spawn(|| on(Some("lo")), EngineConfig::default()).unwrap();
    let src = HostBuffer::new_shared(4096).unwrap();
    src.write(0, &[7u8; 4096]).unwrap();
    let dst = HostBuffer::new_shared(4096).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    a.submit(Transfer::new(peer).segment(Segment {
        src: s.local,
        src_offset: 0,
        dst: d.remote,
        dst_offset: 0,
        len: 4096,
    }))
    .unwrap()
    .wait(Duration::from_secs(10))
    .unwrap();
    assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![7u8; 4096]);
}

#[test]
fn an_interface_that_does_not_exist_is_named_in_the_error() {
    let Err(e) = on(Some("nosuchnic9")) else {
        panic!("a transport on a missing interface started");
    };
    assert!(matches!(e, Error::Backend { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("nosuchnic9"), "{text}");
}
