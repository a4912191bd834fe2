//! READ through the engine over TCP: paged READs over several rails land whole before their
//! handles complete, and removing the owner mid-transfer fails the READ with a typed error,
//! reported only once nothing writes its memory any more.

use fabric_core::engine::{EngineConfig, GroupTransfer, RailGroup};
use fabric_core::testing::pattern;
use fabric_core::{Access, HostBuffer, OpError};
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};

const T: Duration = Duration::from_secs(20);

fn group(rails: usize) -> RailGroup {
    RailGroup::spawn(
        rails,
        |_| TcpTransport::new(TcpConfig::default()),
        EngineConfig::default(),
    )
    .unwrap()
}

#[test]
fn paged_reads_over_tcp_rails_land_before_their_handles_complete() {
    let a = group(3);
    let b = group(2);
    let (page, n) = (4096u64, 2048u64);
    let owned = HostBuffer::new_shared((page * n) as usize).unwrap();
    let data = pattern(77, (page * n) as usize);
    owned.write(0, &data).unwrap();
    let o = b.register(owned, Access::REMOTE_READ).unwrap();
    let local = HostBuffer::new_shared((page * n) as usize).unwrap();
    let l = a.register(local.clone(), Access::LOCAL_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    // Remote page i into local page (i * 7) % n: scattered on both sides.
    let remote: Vec<u64> = (0..n).collect();
    let mine: Vec<u64> = (0..n).map(|i| (i * 7) % n).collect();
    for round in 0..3 {
        local.fill(0, page * n, 0).unwrap();
        let t = GroupTransfer::paged(
            l.clone(),
            o.remote.clone(),
            &mine,
            page,
            &remote,
            page,
            page,
        )
        .unwrap()
        .read();
        assert_eq!(a.submit(&peer, t).unwrap().wait(T).unwrap().bytes, page * n);
        for (m, r) in mine.iter().zip(&remote) {
            let got = local.to_vec(m * page, page as usize).unwrap();
            assert!(
                got == data[(r * page) as usize..((r + 1) * page) as usize],
                "round {round}: local page {m}"
            );
        }
    }
    let per_rail = a.rail_counters();
    assert!(per_rail.iter().all(|c| c.bytes > 0), "{per_rail:?}");
}

#[test]
fn removing_the_owner_fails_a_read_in_flight_with_a_typed_error() {
    let a = group(2);
    let b = group(2);
    let len = 64u64 << 20;
    let owned = HostBuffer::new_shared(len as usize).unwrap();
    owned.fill(0, len, 0x5C).unwrap();
    let o = b.register(owned, Access::REMOTE_READ).unwrap();
    let local = HostBuffer::new_shared(len as usize).unwrap();
    let l = a.register(local.clone(), Access::LOCAL_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    let pages: Vec<u64> = (0..len / 65536).collect();
    let t = GroupTransfer::same_pages(l.clone(), o.remote.clone(), &pages, 65536).read();
    let h = a.submit(&peer, t).unwrap();
    a.remove_peer(&peer).unwrap();
    match h.wait(T) {
        // It may have finished before the removal: then every byte is there.
        Ok(s) => {
            assert_eq!(s.bytes, len);
            assert!(
                local
                    .to_vec(0, len as usize)
                    .unwrap()
                    .iter()
                    .all(|&b| b == 0x5C)
            );
        }
        Err(e) => assert!(
            matches!(e, fabric_core::Error::Op(OpError::PeerRemoved(_))),
            "{e}"
        ),
    }
    // Complete (either way) means the region is free: it deregisters at once.
    a.deregister(&l).unwrap();
}
