//! `mem`: an in-process transport with the same semantics as the others and no I/O.
//!
//! Peers are other `MemTransport`s of the same process, found by address. A WRITE is
//! validated against the target's registrations (key, permission, bounds) and copied at
//! once; SENDs go to the target's posted receives or its bounded early-arrival queue.
//! Used to test the engine and to measure its own overhead (`xfer demo --transport mem`).

use crate::error::{Error, OpError, Result};
use crate::memory::{MemoryRegion, check_range};
use crate::transport::{Completion, OpKind, PostOutcome, Transport, TransportLimits};
use crate::types::{
    Access, LocalKey, LocalSlice, PeerId, Registration, RemoteKey, RemoteRegion, RemoteSlice,
    WorkRequestId,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

const PREFIX: &str = "mem://";
/// Completions a transport holds before posts answer `NoRoom`.
const MAX_PENDING: usize = 1 << 16;
/// Early-arrival queue for SENDs.
const MAX_UNEXPECTED: usize = 4096;

struct Target {
    mem: Arc<dyn MemoryRegion>,
    access: Access,
}

struct PostedRecv {
    wr_id: WorkRequestId,
    mem: Arc<dyn MemoryRegion>,
    offset: u64,
    cap: u64,
}

#[derive(Default)]
struct Inbox {
    targets: HashMap<u64, Target>,
    recvs: VecDeque<PostedRecv>,
    unexpected: VecDeque<(u64, Option<u32>, Vec<u8>)>,
    /// Completions produced by peers' operations (remote writes, receives).
    events: Vec<Completion>,
}

struct Endpoint {
    id: u64,
    inbox: Mutex<Inbox>,
}

fn registry() -> &'static Mutex<HashMap<u64, Weak<Endpoint>>> {
    static R: OnceLock<Mutex<HashMap<u64, Weak<Endpoint>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The in-memory transport.
pub struct MemTransport {
    me: Arc<Endpoint>,
    peers: HashMap<PeerId, Weak<Endpoint>>,
    next_peer: u64,
    local: HashMap<LocalKey, (Arc<dyn MemoryRegion>, Access, u64)>,
    next_local: u64,
    done: Vec<Completion>,
}

impl Default for MemTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl MemTransport {
    /// A new endpoint, reachable by its [`address`](Transport::address) in this process.
    pub fn new() -> MemTransport {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let me = Arc::new(Endpoint {
            id,
            inbox: Mutex::new(Inbox::default()),
        });
        lock(registry()).insert(id, Arc::downgrade(&me));
        MemTransport {
            me,
            peers: HashMap::new(),
            next_peer: 1,
            local: HashMap::new(),
            next_local: 1,
            done: Vec::new(),
        }
    }

    fn src(&self, s: &LocalSlice) -> Result<&Arc<dyn MemoryRegion>> {
        let (m, _, _) = self
            .local
            .get(&s.key)
            .ok_or(Error::Op(OpError::LocalKeyInvalid(s.key)))?;
        check_range(s.offset, s.len, m.len() as u64)
            .map_err(|e| Error::InvalidArgument(format!("local slice: {e}")))?;
        Ok(m)
    }

    fn peer(&self, p: PeerId) -> Result<Arc<Endpoint>> {
        let w = self.peers.get(&p).ok_or(Error::UnknownPeer(p))?;
        w.upgrade().ok_or(Error::Op(OpError::PeerUnreachable {
            peer: p,
            reason: "endpoint dropped".into(),
        }))
    }

    fn copy_out(&self, s: &LocalSlice) -> Result<Vec<u8>> {
        let mut v = vec![0u8; s.len as usize];
        self.src(s)?.read_to_host(s.offset, &mut v)?;
        Ok(v)
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        lock(registry()).remove(&self.me.id);
    }
}

fn copy_region(
    src: &dyn MemoryRegion,
    so: u64,
    dst: &dyn MemoryRegion,
    d_o: u64,
    len: u64,
) -> std::result::Result<(), OpError> {
    let err = |e: crate::MemoryError| OpError::Transport(e.to_string());
    match (src.host_ptr(), dst.host_ptr()) {
        (Some(_), Some(_)) => {
            let s = crate::memory::checked_host_ptr(src, so, len).map_err(err)?;
            let d = crate::memory::checked_host_ptr(dst, d_o, len).map_err(err)?;
            // SAFETY: both ranges were bounds-checked against live regions (kept alive by the
            // Arcs the caller holds); `copy` tolerates overlap (a region written to itself).
            unsafe { std::ptr::copy(s, d, len as usize) };
            Ok(())
        }
        _ => {
            let mut v = vec![0u8; len as usize];
            src.read_to_host(so, &mut v).map_err(err)?;
            dst.write_from_host(d_o, &v).map_err(err)
        }
    }
}

impl Transport for MemTransport {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn address(&self) -> Vec<u8> {
        format!("{PREFIX}{}", self.me.id).into_bytes()
    }

    fn limits(&self) -> TransportLimits {
        TransportLimits {
            max_msg_size: 1 << 30,
            max_outstanding: MAX_PENDING,
            write_imm: true,
            busy_poll: true,
        }
    }

    fn add_peer(&mut self, address: &[u8]) -> Result<PeerId> {
        let s =
            std::str::from_utf8(address).map_err(|_| Error::InvalidAddress("not UTF-8".into()))?;
        let id: u64 = s
            .strip_prefix(PREFIX)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Error::InvalidAddress(format!("{s:?} is not a mem:// address")))?;
        let ep = lock(registry()).get(&id).cloned().ok_or_else(|| {
            Error::InvalidAddress(format!("no mem endpoint {id} in this process"))
        })?;
        let p = PeerId(self.next_peer);
        self.next_peer += 1;
        self.peers.insert(p, ep);
        Ok(p)
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<()> {
        // Operations complete at post time, so none is in flight to fail.
        self.peers
            .remove(&peer)
            .map(|_| ())
            .ok_or(Error::UnknownPeer(peer))
    }

    fn register(&mut self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Registration> {
        static KEYS: AtomicU64 = AtomicU64::new(0x5EED_0000_0000_0001);
        let rkey = KEYS.fetch_add(0x9E37_79B9, Ordering::Relaxed);
        let local = LocalKey(self.next_local);
        self.next_local += 1;
        let len = mem.len() as u64;
        lock(&self.me.inbox).targets.insert(
            rkey,
            Target {
                mem: mem.clone(),
                access,
            },
        );
        self.local.insert(local, (mem, access, rkey));
        Ok(Registration {
            local,
            remote: RemoteRegion {
                addr: 0,
                len,
                key: RemoteKey(rkey),
            },
        })
    }

    fn deregister(&mut self, key: LocalKey) -> Result<()> {
        let (_, _, rkey) = self
            .local
            .remove(&key)
            .ok_or(Error::Op(OpError::LocalKeyInvalid(key)))?;
        lock(&self.me.inbox).targets.remove(&rkey);
        Ok(())
    }

    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        if self.done.len() >= MAX_PENDING {
            return Ok(PostOutcome::NoRoom);
        }
        let ep = self.peer(peer)?;
        let data = self.copy_out(&src)?;
        let mut inbox = lock(&ep.inbox);
        let me = self.me.id;
        let result = if let Some(r) = inbox.recvs.pop_front() {
            let res = if src.len > r.cap {
                Err(OpError::Truncated {
                    len: src.len,
                    capacity: r.cap,
                })
            } else {
                r.mem
                    .write_from_host(r.offset, &data)
                    .map(|_| src.len)
                    .map_err(|e| OpError::Transport(e.to_string()))
            };
            inbox.events.push(Completion {
                wr_id: r.wr_id,
                op: OpKind::Recv,
                result: res.clone(),
                peer: Some(PeerId(me)),
                imm,
            });
            res
        } else if inbox.unexpected.len() < MAX_UNEXPECTED {
            inbox.unexpected.push_back((me, imm, data));
            Ok(src.len)
        } else {
            return Ok(PostOutcome::NoRoom);
        };
        self.done.push(Completion {
            wr_id,
            op: OpKind::Send,
            result,
            peer: Some(peer),
            imm: None,
        });
        Ok(PostOutcome::Posted)
    }

    fn post_recv(&mut self, wr_id: WorkRequestId, dst: LocalSlice) -> Result<PostOutcome> {
        let m = self.src(&dst)?.clone();
        let access = self.local[&dst.key].1;
        if !access.contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "receive buffer registered without LOCAL_WRITE".into(),
            ));
        }
        let mut inbox = lock(&self.me.inbox);
        if let Some((from, imm, data)) = inbox.unexpected.pop_front() {
            let res = if data.len() as u64 > dst.len {
                Err(OpError::Truncated {
                    len: data.len() as u64,
                    capacity: dst.len,
                })
            } else {
                m.write_from_host(dst.offset, &data)
                    .map(|_| data.len() as u64)
                    .map_err(|e| OpError::Transport(e.to_string()))
            };
            inbox.events.push(Completion {
                wr_id,
                op: OpKind::Recv,
                result: res,
                peer: Some(PeerId(from)),
                imm,
            });
        } else {
            inbox.recvs.push_back(PostedRecv {
                wr_id,
                mem: m,
                offset: dst.offset,
                cap: dst.len,
            });
        }
        Ok(PostOutcome::Posted)
    }

    fn post_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        if src.len != dst.len {
            return Err(Error::InvalidArgument(format!(
                "source is {} bytes, destination {}",
                src.len, dst.len
            )));
        }
        if self.done.len() >= MAX_PENDING {
            return Ok(PostOutcome::NoRoom);
        }
        let s = self.src(&src)?.clone();
        let ep = self.peer(peer)?;
        let me = self.me.id;
        let mut inbox = lock(&ep.inbox);
        let result = match inbox.targets.get(&dst.region.key.0) {
            None => Err(OpError::RemoteKeyInvalid(dst.region.key)),
            Some(t) if !t.access.contains(Access::REMOTE_WRITE) => Err(OpError::PermissionDenied),
            Some(t) => match check_range(dst.offset, dst.len, t.mem.len() as u64) {
                Err(_) => Err(OpError::OutOfBounds {
                    offset: dst.offset,
                    len: dst.len,
                    region_len: t.mem.len() as u64,
                }),
                Ok(()) => {
                    copy_region(&*s, src.offset, &*t.mem, dst.offset, dst.len).map(|_| dst.len)
                }
            },
        };
        if let (Ok(len), Some(v)) = (&result, imm) {
            inbox.events.push(Completion {
                wr_id: WorkRequestId(0),
                op: OpKind::RemoteWrite,
                result: Ok(*len),
                peer: Some(PeerId(me)),
                imm: Some(v),
            });
        }
        drop(inbox);
        self.done.push(Completion {
            wr_id,
            op: OpKind::Write,
            result,
            peer: Some(peer),
            imm: None,
        });
        Ok(PostOutcome::Posted)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        let n0 = out.len();
        out.append(&mut self.done);
        {
            let mut inbox = lock(&self.me.inbox);
            out.append(&mut inbox.events);
        }
        Ok(out.len() - n0)
    }
}
