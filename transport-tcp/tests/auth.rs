//! The optional shared token (`TcpConfig::auth_token`): peers without it are refused during
//! the handshake, before any of their frames touches memory.

mod common;

use common::{Deadline, Node, Raw, concat, hello_frame, write_frame};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{Access, OpError, PostOutcome, Transport, WorkRequestId};
use transport_tcp::TcpConfig;

const LEN: u64 = 4096;

fn with_token(t: Option<&str>) -> TcpConfig {
    TcpConfig {
        auth_token: t.map(String::from),
        ..TcpConfig::default()
    }
}

/// Writes `LEN` bytes from a fresh initiator with `token` into `dst`; returns its result.
fn write_from(
    token: Option<&str>,
    target: &mut Node,
    dst: &Canaried,
    seed: u64,
) -> Result<u64, OpError> {
    let mut a = Node::new(with_token(token));
    let src = Canaried::new(&mut a.t, LEN, Access::NONE, 0);
    src.write(0, &pattern(seed, LEN as usize));
    let peer = a.t.add_peer(&target.t.address()).expect("add_peer");
    let d = Deadline::new("the write to complete");
    while a
        .t
        .post_write(
            peer,
            WorkRequestId(1),
            src.local(0, LEN),
            dst.remote(0, LEN),
            None,
        )
        .expect("post")
        == PostOutcome::NoRoom
    {
        a.step();
        target.step();
        d.check();
    }
    while a.done.is_empty() {
        a.step();
        target.step();
        d.check();
    }
    a.done[0].result.clone()
}

#[test]
fn the_right_token_is_let_in_and_others_are_refused() {
    let mut target = Node::new(with_token(Some("s3cret")));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0x11);
    for wrong in [None, Some("wrong")] {
        let r = write_from(wrong, &mut target, &dst, 1);
        assert!(
            matches!(r, Err(OpError::PeerUnreachable { .. })),
            "token {wrong:?}: {r:?}"
        );
        assert_eq!(
            dst.read(0, LEN as usize),
            vec![0x11; LEN as usize],
            "token {wrong:?} wrote"
        );
    }
    assert_eq!(write_from(Some("s3cret"), &mut target, &dst, 2), Ok(LEN));
    assert_eq!(dst.read(0, LEN as usize), pattern(2, LEN as usize));
    dst.assert_canaries();
}

#[test]
fn frames_right_behind_an_unauthenticated_hello_never_land() {
    let mut target = Node::new(with_token(Some("s3cret")));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0x11);
    let key = dst.reg.remote.key.0;
    let mut c = Raw::connect(&target.t);
    // HELLO without a token, and a valid WRITE in the same segment.
    c.send_ok(
        &concat(&[
            &hello_frame(),
            &write_frame(key, 0, &[0xEE; 64], Some(5), 1),
        ]),
        || target.step(),
    );
    c.expect_closed("an unauthenticated HELLO", || target.step());
    assert_eq!(dst.read(0, LEN as usize), vec![0x11; LEN as usize]);
    assert!(
        target.remote_writes().is_empty(),
        "no immediate data from a refused peer"
    );
    dst.assert_canaries();
}

#[test]
fn a_target_without_a_token_accepts_peers_that_send_one() {
    let mut target = Node::new(with_token(None));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0);
    assert_eq!(write_from(Some("anything"), &mut target, &dst, 3), Ok(LEN));
}
