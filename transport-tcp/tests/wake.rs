//! Wake on work over TCP: a worker asleep in `ppoll` starts on a submit at once, and a
//! target asleep is woken by its peer's bytes.

use fabric_core::engine::{Engine, EngineConfig, Transfer};
use fabric_core::plan::Segment;
use fabric_core::{Access, HostBuffer};
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};

fn sleepy_tcp_engine() -> Engine {
    let cfg = EngineConfig {
        // Far longer than any wait below: only wake-ups can make the test pass.
        idle_wait: Duration::from_secs(600),
        ..EngineConfig::default()
    };
    Engine::spawn(|| TcpTransport::new(TcpConfig::default()), cfg).unwrap()
}

#[test]
fn a_sleeping_tcp_worker_starts_on_a_submit_at_once() {
    let (a, b) = (sleepy_tcp_engine(), sleepy_tcp_engine());
    let short = Duration::from_secs(5);
    let src = HostBuffer::new_shared(1 << 16).unwrap();
    src.fill(0, 1 << 16, 9).unwrap();
    let dst = HostBuffer::new_shared(1 << 16).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    for round in 0..5u32 {
        // Both workers idle, asleep in ppoll with nothing readable.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !(a.is_asleep() && b.is_asleep()) {
            assert!(
                std::time::Instant::now() < deadline,
                "the idle workers never went to sleep"
            );
            std::thread::yield_now();
        }
        let t = Transfer::new(peer)
            .segment(Segment {
                src: s.local,
                src_offset: 0,
                dst: d.remote,
                dst_offset: 0,
                len: 1 << 16,
            })
            .imm(round);
        a.submit(t).unwrap().wait(short).unwrap();
        assert_eq!(b.next_event(short).unwrap().imm(), Some(round));
    }
    assert_eq!(dst.to_vec(0, 1 << 16).unwrap(), vec![9; 1 << 16]);
}
