//! How far a peer reaches, on the loopback link (host memory, no GPU needed; the protocol
//! code is the one the CUDA link runs): a hostile target cannot make the initiator copy
//! outside the region its KeyInfo described, nor into the initiator's own memory by sending
//! one of the initiator's own handles; a peer asking a target for bytes outside a region,
//! or to write a region registered for reads, is refused with a typed verdict, is never
//! sent the handle, and changes nothing.
//!
//! The hostile target is a thread of this process speaking the wire format by hand, or, to
//! be another process, this binary run again with `XFER_IPC_HOSTILE_TARGET` set.

mod raw;

use fabric_core::testing::Canaried;
use fabric_core::{
    Access, Completion, OpError, PeerId, RemoteKey, RemoteRegion, RemoteSlice, Transport,
    WorkRequestId,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_cuda_ipc::wire::{
    self, Grant, HEADER_LEN, Header, KeyInfo, Op, Record, Reserve, Status, put_frame, records,
};
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, IpcAddress, Link, LoopbackLink};

type T = CudaIpcTransport<LoopbackLink>;

fn make() -> T {
    CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default()).unwrap()
}

/// The descriptor the hostile target hands out: any key, and as long as it likes.
const FAKE_KEY: u64 = 0xFA4E;

/// A listening socket named as a transport's, and the address that names it.
fn fake_listener() -> (UnixListener, Vec<u8>) {
    raw::fake_listener()
}

fn read_frame(s: &mut UnixStream) -> Option<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).ok()?;
    let h = Header::decode(&h, 1 << 24).expect("the initiator sent a bad header");
    let mut payload = vec![0u8; h.len as usize];
    s.read_exact(&mut payload).ok()?;
    Some((h, payload))
}

/// A hostile target on `l` (without a token): it goes through the handshake (its CHALLENGE,
/// a PROOF for the HELLO), then answers every reservation with `info` as the handle of the
/// key reserved and grants every range, whatever it asks. Returns at the initiator's EOF.
fn hostile_target(l: UnixListener, info: KeyInfo) {
    let (mut s, _) = l.accept().unwrap();
    s.write_all(&raw::challenge(wire::AUTH_NONE).0).unwrap();
    let mut sent_info = false;
    while let Some((h, payload)) = read_frame(&mut s) {
        if h.op == Op::Hello {
            let hello = wire::Hello::decode(&h, &payload).unwrap();
            if s.write_all(&raw::proof(None, &hello.nonce)).is_err() {
                return;
            }
            continue;
        }
        if h.op != Op::Reserve {
            continue;
        }
        let entries: Vec<Reserve> = records(Op::Reserve, &payload).unwrap();
        let mut out = Vec::new();
        if !sent_info {
            put_frame(&mut out, Op::KeyInfo, 0, entries[0].key, &[info]);
            sent_info = true;
        }
        let verdicts: Vec<Grant> = entries
            .iter()
            .map(|_| Grant {
                status: Status::Ok as u32,
                region_len: u64::MAX,
            })
            .collect();
        put_frame(&mut out, Op::Grant, h.id, 0, &verdicts);
        if s.write_all(&out).is_err() {
            return;
        }
    }
}

/// Posts one WRITE of `src` into `dst` on `peer` and polls until it completes.
fn write_once(t: &mut T, peer: PeerId, src: &Canaried, dst: RemoteSlice) -> Completion {
    let r = t
        .post_write(peer, WorkRequestId(1), src.local(0, dst.len), dst, None)
        .unwrap();
    assert_eq!(r, fabric_core::PostOutcome::Posted);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    while done.is_empty() {
        assert!(Instant::now() < deadline, "the write never completed");
        t.wait(Duration::from_millis(10)).unwrap();
        t.poll(&mut done).unwrap();
    }
    done.remove(0)
}

fn region(len: u64) -> RemoteRegion {
    RemoteRegion {
        addr: 0,
        len,
        key: RemoteKey(FAKE_KEY),
    }
}

/// Granted ranges are checked against the region the target's KeyInfo described, with
/// checked arithmetic, before any copy: a descriptor that claims more, or an offset that
/// would wrap around, fails the write as out of bounds (no panic, nothing copied), even
/// where the mapped allocation is larger than the region.
#[test]
fn a_grant_outside_the_region_of_its_key_info_copies_nothing() {
    // The target's allocation: 8 KiB, of which its KeyInfo describes the second 4 KiB.
    let buf = fabric_core::HostBuffer::new_shared(8192).unwrap();
    let alloc: Arc<dyn fabric_core::MemoryRegion> = buf.clone();
    let export = LoopbackLink::new().export(&alloc).unwrap();
    let info = KeyInfo {
        handle: export.handle,
        offset: 4096,
        len: 4096,
        device: 0,
    };
    for (what, dst) in [
        (
            "past the region's end",
            RemoteSlice {
                region: region(8192),
                offset: 4096,
                len: 4096,
            },
        ),
        (
            "an offset that wraps around",
            RemoteSlice {
                region: region(u64::MAX),
                offset: u64::MAX - 4096,
                len: 16,
            },
        ),
    ] {
        let mut t = make();
        let src = Canaried::new(&mut t, 4096, Access::NONE, 0x33);
        let (l, addr) = fake_listener();
        let target = std::thread::spawn(move || hostile_target(l, info));
        let peer = t.add_peer(&addr).unwrap();
        let c = write_once(&mut t, peer, &src, dst);
        assert!(
            matches!(
                c.result,
                Err(OpError::OutOfBounds {
                    region_len: 4096,
                    ..
                })
            ),
            "{what}: {c:?}"
        );
        drop(t);
        target.join().unwrap();
        assert_eq!(
            buf.to_vec(0, 8192).unwrap(),
            vec![0u8; 8192],
            "{what}: the allocation changed"
        );
    }
}

/// A target in another process sends, as its region's handle, the handle of one of the
/// initiator's own regions. The handle must not be resolved through the initiator's
/// exports (the kernel says the peer is another process): the write fails, typed, and the
/// initiator's region is untouched.
#[test]
fn a_target_in_another_process_cannot_aim_our_copies_at_our_own_memory() {
    if let Ok(handle) = std::env::var("XFER_IPC_HOSTILE_TARGET") {
        return child_target(&handle);
    }
    let mut t = make();
    let src = Canaried::new(&mut t, 4096, Access::NONE, 0x33);
    let victim = Canaried::new(&mut t, 4096, Access::REMOTE_WRITE, 0);
    // A handle of the victim in this process's table (the transport's own export of it
    // is another handle of the same kind).
    let export = LoopbackLink::new().export(&victim.buf).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_target_in_another_process_cannot_aim_our_copies_at_our_own_memory",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("XFER_IPC_HOSTILE_TARGET", hex::encode(export.handle))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("the child's address").unwrap();
        // libtest may print "test ... " on the same line first.
        if let Some(at) = l.find("READY ") {
            break hex::decode(&l[at + 6..]).unwrap();
        }
    };
    let peer = t.add_peer(&addr).unwrap();
    let c = write_once(
        &mut t,
        peer,
        &src,
        RemoteSlice {
            region: region(4096),
            offset: 0,
            len: 4096,
        },
    );
    let Err(OpError::Transport(e)) = &c.result else {
        panic!("the write did not fail as unmappable: {c:?}");
    };
    assert!(
        fabric_core::error::report(e).contains("another process"),
        "{e}"
    );
    assert_eq!(
        victim.read(0, 4096),
        vec![0u8; 4096],
        "our own region changed"
    );
    victim.assert_canaries();
    drop(t);
    assert!(child.wait().unwrap().success());
}

/// The hostile target process: prints its address, then serves one initiator.
fn child_target(handle: &str) {
    let handle: [u8; 64] = hex::decode(handle).unwrap().try_into().unwrap();
    let (l, addr) = fake_listener();
    println!("READY {}", hex::encode(addr));
    std::io::stdout().flush().unwrap();
    hostile_target(
        l,
        KeyInfo {
            handle,
            offset: 0,
            len: 4096,
            device: 0,
        },
    );
}

/// Reads frames from the target `t` until `want` verdicts of one GRANT have come.
fn answers(t: &mut T, s: &mut UnixStream, want: usize) -> Vec<(Header, Vec<u8>)> {
    s.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let mut frames = Vec::new();
    loop {
        assert!(Instant::now() < deadline, "no grant");
        t.poll(&mut Vec::new()).unwrap();
        match s.read(&mut buf) {
            Ok(0) => panic!("the target closed the connection"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("{e}"),
        }
        while got.len() >= HEADER_LEN {
            let h = Header::decode(got[..HEADER_LEN].try_into().unwrap(), 1 << 20).unwrap();
            let end = HEADER_LEN + h.len as usize;
            if got.len() < end {
                break;
            }
            // The handshake's frames (the CHALLENGE, the PROOF) are no answers.
            if !matches!(h.op, Op::Challenge | Op::Proof) {
                frames.push((h, got[HEADER_LEN..end].to_vec()));
            }
            got.drain(..end);
            if h.op == Op::Grant {
                assert_eq!(h.len as usize, want * Grant::LEN);
                return frames;
            }
        }
    }
}

/// Reservations a target must refuse, each with its own verdict (which the initiator
/// turns into `OutOfBounds` or `PermissionDenied`): bytes past a region's end, an offset
/// that wraps around, writes into a region registered for reads only, reads of one
/// registered for writes only. None of them is sent the handle (no KEY_INFO), and no byte
/// changes.
#[test]
fn reservations_outside_a_region_or_its_access_are_refused_without_the_handle() {
    let mut t = make();
    let rw = Canaried::new(&mut t, 4096, Access::REMOTE_WRITE, 0x11);
    let ro = Canaried::new(&mut t, 4096, Access::REMOTE_READ, 0x22);
    let (rw_key, ro_key) = (rw.reg.remote.key.0, ro.reg.remote.key.0);
    let reserve = |key, offset, len| Reserve { key, offset, len };
    let cases: [(u64, Vec<Reserve>, Vec<Status>); 2] = [
        (
            0,
            vec![
                reserve(rw_key, 4000, 200),
                reserve(rw_key, u64::MAX - 1, 4),
                reserve(rw_key, 4096, 1),
                reserve(ro_key, 0, 16),
            ],
            vec![
                Status::OutOfBounds,
                Status::OutOfBounds,
                Status::OutOfBounds,
                Status::NoPermission,
            ],
        ),
        (
            wire::RESERVE_READS,
            vec![reserve(rw_key, 0, 16), reserve(ro_key, 1, 4096)],
            vec![Status::NoPermission, Status::OutOfBounds],
        ),
    ];
    for (kind, entries, want) in cases {
        let a = IpcAddress::parse(&t.address()).unwrap();
        let mut s =
            UnixStream::connect_addr(&SocketAddr::from_abstract_name(a.socket.as_bytes()).unwrap())
                .unwrap();
        // A target without a token looks at no tag: the HELLO may go before its CHALLENGE
        // is read.
        let mut v = raw::hello(&make().address());
        put_frame(&mut v, Op::Reserve, 1, kind, &entries);
        s.write_all(&v).unwrap();
        let frames = answers(&mut t, &mut s, entries.len());
        assert_eq!(
            frames.len(),
            1,
            "the target sent more than its verdicts: {frames:?}"
        );
        let verdicts: Vec<Grant> = records(Op::Grant, &frames[0].1).unwrap();
        let got: Vec<Option<Status>> = verdicts
            .iter()
            .map(|g| Status::from_u32(g.status))
            .collect();
        let want: Vec<Option<Status>> = want.into_iter().map(Some).collect();
        assert_eq!(got, want, "reservations of kind {kind}");
    }
    assert_eq!(rw.read(0, 4096), vec![0x11; 4096]);
    assert_eq!(ro.read(0, 4096), vec![0x22; 4096]);
    rw.assert_canaries();
    ro.assert_canaries();
}
