//! Messages: bytes sent to a peer once a transfer's bytes are placed, taken from the
//! peer's notifications with their sender, never lost when the receiver looks late.

use fabric_core::engine::{
    Direction, Engine, EngineConfig, GroupTransfer, MAX_MESSAGE, RailGroup, Transfer,
};
use fabric_core::mem::MemTransport;
use fabric_core::plan::Segment;
use fabric_core::{Access, Error, HostBuffer, Invalid};
use std::collections::BTreeMap;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn taking(messages: usize, keys: usize) -> EngineConfig {
    EngineConfig {
        messages,
        notification_keys: keys,
        ..EngineConfig::default()
    }
}

fn engine(cfg: EngineConfig) -> Engine {
    Engine::spawn(|| Ok(MemTransport::new()), cfg).unwrap()
}

#[test]
fn a_message_follows_the_bytes_and_names_its_sender() {
    let a = engine(EngineConfig::default());
    let b = engine(taking(8, 1 << 20));
    let src = HostBuffer::new_shared(1 << 16).unwrap();
    src.fill(0, 1 << 16, 5).unwrap();
    let dst = HostBuffer::new_shared(1 << 16).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let seg = Segment {
        src: s.local,
        src_offset: 0,
        dst: d.remote,
        dst_offset: 0,
        len: 1 << 16,
    };
    let t = Transfer::new(peer)
        .segment(seg)
        .imm(7)
        .message(&b"request 42"[..]);
    a.submit(t).unwrap().wait(T).unwrap();
    let n = b.notifications().next(T).unwrap();
    assert_eq!(n.key.imm, 7);
    assert_eq!(n.key.message.as_deref(), Some(&b"request 42"[..]));
    assert_eq!(
        n.key.from.as_deref(),
        Some(&a.address()[..]),
        "names its sender"
    );
    // Delivered after the bytes: they are all there when the message is seen.
    assert_eq!(dst.to_vec(0, 1 << 16).unwrap(), vec![5; 1 << 16]);
    // The value was carried once, by the message, not also by a write.
    assert_eq!(b.notifications().count(7), 0);

    // A message alone (no bytes) carries value 0 unless told otherwise.
    a.submit(Transfer::new(peer).message(&b"hello"[..]))
        .unwrap()
        .wait(T)
        .unwrap();
    let n = b.notifications().next(T).unwrap();
    assert_eq!(
        (n.key.imm, n.key.message.as_deref()),
        (0, Some(&b"hello"[..]))
    );

    // Too long a message is refused before anything moves.
    let e = a
        .submit(Transfer::new(peer).message(vec![0u8; MAX_MESSAGE + 1]))
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(Invalid::TooLarge { .. })),
        "{e}"
    );
    // An engine that takes messages refuses receives of the application's own.
    let e = b
        .post_recv(fabric_core::LocalSlice {
            key: d.local,
            offset: 0,
            len: 8,
        })
        .err()
        .expect("refused");
    assert!(matches!(e, Error::UnsupportedOp { .. }), "{e}");
}

#[test]
fn a_read_tells_the_owner_with_a_message_once_its_bytes_are_read() {
    let a = engine(taking(8, 1 << 20));
    let b = engine(taking(8, 1 << 20));
    let theirs = HostBuffer::new_shared(4096).unwrap();
    theirs.fill(0, 4096, 9).unwrap();
    let ours = HostBuffer::new_shared(4096).unwrap();
    let o = a.register(ours.clone(), Access::LOCAL_WRITE).unwrap();
    let t = b.register(theirs.clone(), Access::REMOTE_READ).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let seg = Segment {
        src: o.local,
        src_offset: 0,
        dst: t.remote,
        dst_offset: 0,
        len: 4096,
    };
    let read = Transfer::new(peer)
        .segment(seg)
        .direction(Direction::Read)
        .imm(3)
        .message(&b"done with 9"[..]);
    a.submit(read).unwrap().wait(T).unwrap();
    assert_eq!(ours.to_vec(0, 4096).unwrap(), vec![9; 4096]);
    let n = b.notifications().next(T).unwrap();
    assert_eq!(
        (n.key.imm, n.key.message.as_deref()),
        (3, Some(&b"done with 9"[..]))
    );
}

#[test]
fn messages_to_a_receiver_that_looks_late_are_held_back_never_lost() {
    // Room for 4 untaken pairs and 2 receives: 300 distinct messages cannot all be kept,
    // so the senders must wait for the receiver, not lose anything.
    let a = engine(EngineConfig::default());
    let b = engine(taking(2, 4));
    let peer = a.add_peer(&b.address()).unwrap();
    let sender = std::thread::spawn(move || {
        let handles: Vec<_> = (0..300u32)
            .map(|i| {
                let t = Transfer::new(peer)
                    .imm(i % 3)
                    .message(format!("m{i}").into_bytes());
                a.submit(t).unwrap()
            })
            .collect();
        for h in handles {
            h.wait(Duration::from_secs(60)).unwrap();
        }
        a
    });
    let mut seen = BTreeMap::new();
    while seen.len() < 300 {
        let n = b.notifications().next(Duration::from_secs(60)).unwrap();
        assert_eq!(n.count, 1);
        let text = String::from_utf8(n.key.message.unwrap().to_vec()).unwrap();
        let i: u32 = text[1..].parse().unwrap();
        assert_eq!(n.key.imm, i % 3);
        *seen.entry(i).or_insert(0) += 1;
    }
    let _a = sender.join().unwrap();
    assert!(seen.values().all(|&c| c == 1), "each message once");
    assert!(b.notifications().try_next().is_none());
    assert_eq!(b.inbox().refused(), 0);
}

#[test]
fn a_rail_group_sends_its_message_after_every_chunk_landed() {
    let a = RailGroup::spawn(4, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let b = RailGroup::spawn(2, |_| Ok(MemTransport::new()), taking(4, 1 << 20)).unwrap();
    let len = 4 << 20;
    let src = HostBuffer::new_shared(len).unwrap();
    src.fill(0, len as u64, 4).unwrap();
    let dst = HostBuffer::new_shared(len).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    let pages: Vec<u64> = (0..256).collect();
    let mut t = GroupTransfer::same_pages(s.clone(), d.remote.clone(), &pages, 16384);
    t.imm = Some(11);
    t.message = Some(b"layer 3 of request 8".to_vec().into());
    let p = a.prepare(&peer, t).unwrap();
    for round in 0..3 {
        dst.fill(0, len as u64, 0).unwrap();
        a.post(&p, None).unwrap().wait(T).unwrap();
        let n = b.notifications().next(T).unwrap();
        assert_eq!(
            (n.key.imm, n.key.message.as_deref()),
            (11, Some(&b"layer 3 of request 8"[..])),
            "round {round}"
        );
        assert!(dst.to_vec(0, len).unwrap().iter().all(|&x| x == 4));
    }
    assert_eq!(b.notifications().count(11), 0);
}
