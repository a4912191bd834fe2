//! Bad input gives clear errors, never a panic: malformed and foreign addresses, unknown
//! providers and domains, operations on removed peers, device memory without FI_HMEM.

mod common;

use fabric_core::{
    Access, Error, HostBuffer, LocalSlice, MemoryLocation, MemoryRegion, OpError, PeerId,
    PostOutcome, RemoteSlice, Transport, WorkRequestId,
};
use std::ptr::NonNull;
use std::sync::Arc;
use transport_efa::{EfaConfig, EfaTransport, info, libfabric_version};

/// A transport of the tcp provider on loopback, or `None` (skipped) where there is none.
fn tcp() -> Option<EfaTransport> {
    common::maker("tcp").map(|make| make())
}

#[test]
fn malformed_and_foreign_addresses_are_rejected() {
    let Some(mut t) = tcp() else { return };
    for bad in [
        &b""[..],
        b"\xff\x00garbage",
        b"efa1",
        b"efa1\x03tcp\x10\x00short",
    ] {
        assert!(
            matches!(t.add_peer(bad), Err(Error::InvalidAddress(_))),
            "{bad:?}"
        );
    }
    let e = t.add_peer(b"tcp://127.0.0.1:1").unwrap_err();
    assert!(matches!(e, Error::InvalidAddress(_)), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("\"tcp\" transport"), "{text}");

    // A well-formed address of this backend, but of another provider.
    let mut own = t.address();
    assert!(own.starts_with(transport_efa::ADDRESS_TAG));
    own[5] = b'x'; // "tcp;ofi_rxm" -> "xcp;ofi_rxm"
    let text = t.add_peer(&own).unwrap_err().to_string();
    assert!(text.contains("provider"), "{text}");

    // The right provider with a raw address of the wrong length.
    let own = t.address();
    let name_len = own[4] as usize;
    let mut short = own[..5 + name_len].to_vec();
    short.extend_from_slice(&4u16.to_le_bytes());
    short.extend_from_slice(&[1, 2, 3, 4]);
    assert!(matches!(t.add_peer(&short), Err(Error::InvalidAddress(_))));
}

#[test]
fn address_of_another_provider_is_rejected() {
    let (Some(make_tcp), Some(make_sockets)) = (common::maker("tcp"), common::maker("sockets"))
    else {
        return;
    };
    let mut tcp = make_tcp();
    let sockets = make_sockets();
    let text = tcp.add_peer(&sockets.address()).unwrap_err().to_string();
    assert!(
        text.contains("sockets") && text.contains(tcp.provider()),
        "{text}"
    );
}

#[test]
fn unknown_provider_lists_the_providers_that_exist() {
    if tcp().is_none() {
        return;
    }
    let e = EfaTransport::new(&EfaConfig::with_provider("no-such-provider")).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
    assert!(text.contains("no-such-provider"), "{text}");
    // 1.17 offers FI_EP_RDM over tcp through rxm only; 2.x's tcp provider has its own.
    assert!(text.contains("tcp"), "{text}");
    let e = info(Some("no-such-provider")).unwrap_err().to_string();
    assert!(e.contains("tcp"), "{e}");
}

#[test]
fn unknown_domain_lists_the_domains() {
    if tcp().is_none() {
        return;
    }
    let e = EfaTransport::new(&EfaConfig::with_provider("tcp").domain("no-such-nic"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no-such-nic") && e.contains("lo"), "{e}");
}

#[test]
fn hmem_on_a_provider_without_it_is_a_clear_error() {
    if tcp().is_none() {
        return;
    }
    let e = EfaTransport::new(&common::config("tcp").hmem(true)).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
    assert!(e.to_string().contains("FI_HMEM"), "{e}");
}

/// Device memory as the memory layer describes it (never touched: registration must
/// refuse it first).
struct FakeCuda;

// SAFETY: no host pointer is offered and the device address is never dereferenced here.
unsafe impl MemoryRegion for FakeCuda {
    fn len(&self) -> usize {
        4096
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda { device: 0 }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        0x7f00_0000_0000
    }
}

#[test]
fn cuda_memory_without_hmem_is_unsupported() {
    let Some(mut t) = tcp() else { return };
    let e = t.register(Arc::new(FakeCuda), Access::ALL).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("FI_HMEM") && text.contains("efa") && text.contains("shm"),
        "{text}"
    );
}

#[test]
fn operations_on_a_removed_peer_fail() {
    let Some(make) = common::maker("tcp") else {
        return;
    };
    let mut a = make();
    let mut b = make();
    let peer = a.add_peer(&b.address()).unwrap();
    let src = a
        .register(HostBuffer::new_shared(4096).unwrap(), Access::NONE)
        .unwrap();
    let dst = b
        .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let local = LocalSlice {
        key: src.local,
        offset: 0,
        len: 64,
    };
    let remote = RemoteSlice {
        region: dst.remote,
        offset: 0,
        len: 64,
    };
    // Queued while the connection comes up, then failed by the removal, once.
    let posted = a
        .post_write(peer, WorkRequestId(1), local, remote, Some(3))
        .unwrap();
    assert_eq!(posted, PostOutcome::Posted);
    a.remove_peer(peer).unwrap();
    let mut done = Vec::new();
    for _ in 0..1000 {
        a.poll(&mut done).unwrap();
        b.poll(&mut Vec::new()).unwrap();
    }
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].result, Err(OpError::PeerRemoved(peer)));
    assert!(matches!(
        a.post_write(peer, WorkRequestId(2), local, remote, None),
        Err(Error::UnknownPeer(p)) if p == peer
    ));
    assert!(matches!(
        a.post_send(peer, WorkRequestId(3), local, None),
        Err(Error::UnknownPeer(_))
    ));
    assert!(matches!(a.remove_peer(peer), Err(Error::UnknownPeer(_))));
    assert!(matches!(
        a.remove_peer(PeerId(12345)),
        Err(Error::UnknownPeer(_))
    ));
}

#[test]
fn info_lists_the_software_providers() {
    let (major, minor) = match libfabric_version() {
        Ok(v) => v,
        Err(e) if !common::required() => {
            common::say_skipped(&format!("{e}"));
            return;
        }
        Err(e) => panic!("XFER_REQUIRE_LIBFABRIC=1: {e}"),
    };
    assert!(major >= 1, "{major}.{minor}");
    let (rmaj, rmin) = transport_efa::requested_api_version().unwrap();
    assert!((rmaj, rmin) <= (major, minor) && (rmaj, rmin) <= (1, 20));
    let all = info(None).unwrap();
    // 1.17 offers FI_EP_RDM over tcp as `tcp;ofi_rxm`; 2.x also as `tcp` itself.
    let is_tcp = |p: &str| p == "tcp;ofi_rxm" || p == "tcp";
    let tcp: Vec<_> = all.iter().filter(|p| is_tcp(&p.provider)).collect();
    if tcp.is_empty() {
        assert!(!common::required(), "no tcp provider in {all:?}");
        common::say_skipped("libfabric lists no tcp provider here");
        return;
    }
    let lo = tcp.iter().find(|p| p.domain == "lo").expect("tcp on lo");
    assert!(lo.cq_data_size >= 4);
    assert!(lo.max_msg_size > 0 && lo.iov_limit > 0 && lo.tx_size > 0);
    assert!(!lo.hmem, "tcp offers no FI_HMEM");
    let only = info(Some("tcp")).unwrap();
    assert!(only.iter().all(|p| is_tcp(&p.provider)), "{only:?}");
}
