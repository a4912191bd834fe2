//! Handles belong to the agent that returned them: another agent's `Peer` or `Region` is
//! refused with `Error::ForeignHandle`, never taken for one of ours that happens to have the
//! same number. Over mem, so these run anywhere.

use std::time::Duration;
use xfer::{Access, Agent, AgentOptions, Error, ErrorKind, HostBuffer, Transfer, TransportChoice};

const T: Duration = Duration::from_secs(10);

fn agent() -> Agent {
    Agent::new(AgentOptions {
        transport: TransportChoice::Only(xfer::TransportKind::Mem),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("a mem agent")
}

fn foreign(e: Error, what: &str) {
    assert_eq!(e.kind(), ErrorKind::ForeignHandle, "{e}");
    match &e {
        Error::ForeignHandle { what: w, .. } => assert_eq!(*w, what, "{e}"),
        other => panic!("expected ForeignHandle for a {what}, got {other:?}"),
    }
}

#[test]
fn another_agents_peer_or_region_is_refused_and_nothing_moves() {
    // a and b each have one region and one peer (toward t): the same numbers in both.
    let (a, b, t) = (agent(), agent(), agent());
    let src = HostBuffer::new_shared(4096).unwrap();
    src.fill(0, 4096, 7).unwrap();
    let ra = a.register(src.clone(), Access::NONE).unwrap();
    let rb = b.register(src, Access::NONE).unwrap();
    let dst = HostBuffer::new_shared(4096).unwrap();
    let d = t.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let pa = a.connect(t.info()).unwrap();
    let pb = b.connect(t.info()).unwrap();
    let page = || Transfer::segments(vec![(0, 0, 4096)]);

    foreign(
        a.submit(&pb, &ra, d.descriptor(), page()).unwrap_err(),
        "peer",
    );
    foreign(
        a.submit(&pa, &rb, d.descriptor(), page()).unwrap_err(),
        "region",
    );
    foreign(a.warm_up(&pb, &ra, d.descriptor(), T).unwrap_err(), "peer");
    foreign(a.deregister(&rb).unwrap_err(), "region");
    foreign(a.offer("x", &rb).unwrap_err(), "region");
    foreign(a.disconnect(&pb).unwrap_err(), "peer");
    assert!(a.check_region(&ra).is_ok() && a.check_peer(&pa).is_ok());
    assert_eq!(
        dst.to_vec(0, 4096).unwrap(),
        vec![0; 4096],
        "nothing landed"
    );
    assert!(a.offered().is_empty());

    // b's handles still work for b (nothing was removed or deregistered through a), and
    // a's for a.
    b.submit(&pb, &rb, d.descriptor(), page())
        .unwrap()
        .wait(T)
        .unwrap();
    a.submit(&pa, &ra, d.descriptor(), page())
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![7; 4096]);
    b.deregister(&rb).unwrap();
}

/// One error type at the front door: a transfer's failure comes back from its handle as
/// `xfer::Error`, with a kind a program matches on.
#[test]
fn a_handles_failure_is_the_front_doors_error_with_its_kind() {
    let (a, t) = (agent(), agent());
    let src = a
        .register(HostBuffer::new_shared(4096).unwrap(), Access::NONE)
        .unwrap();
    let read_only = t
        .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_READ)
        .unwrap();
    let p = a.connect(t.info()).unwrap();
    let h = a
        .submit(
            &p,
            &src,
            read_only.descriptor(),
            Transfer::segments(vec![(0, 0, 64)]),
        )
        .unwrap();
    let e: Error = h.wait(T).expect_err("a WRITE into a read-only region");
    assert_eq!(e.kind(), ErrorKind::RemoteAccess, "{e}");
    assert!(!e.kind().is_retryable());
    let e = a
        .submit(
            &p,
            &src,
            read_only.descriptor(),
            Transfer::segments(vec![(0, 0, 8192)]),
        )
        .expect_err("beyond the local region");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let e = a.wait_imm(1, 1, Duration::from_millis(1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(e.kind().is_retryable());
    let e = Agent::new(AgentOptions {
        rails: Some(0),
        ..AgentOptions::default()
    })
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert_eq!(e.to_string(), "rails: must be at least 1");
}
