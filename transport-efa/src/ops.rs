//! Operations in flight: their per-operation context (the `void *context` that libfabric
//! hands back in the completion) and what we need to report them.

use fabric_core::{LocalKey, OpKind, PeerId, RemoteKey, WorkRequestId};
use std::cell::UnsafeCell;
use std::ffi::c_void;

/// Storage for one `struct fi_context2`: scratch space that providers with FI_CONTEXT /
/// FI_CONTEXT2 mode use while the operation is in flight. Its address is the operation's
/// context, so it must not move: contexts live in boxed chunks that are never reallocated
/// nor freed before the transport is (after its endpoint is closed).
#[repr(C, align(8))]
struct OpContext(UnsafeCell<[u64; 8]>);

const _: () =
    assert!(std::mem::size_of::<OpContext>() >= std::mem::size_of::<libfabric_sys::fi_context2>());

/// Contexts per chunk.
const CHUNK: usize = 256;

/// The most operations one provider call carries (one iovec each, on both sides): the
/// tcp, shm and rxm providers take 4 (their `iov_limit` and `rma_iov_limit`); efa takes
/// one remote iovec, so there every operation goes alone.
pub(crate) const MAX_GATHER: usize = 4;

/// The operations that went out in one provider call with the one that holds the call's
/// context (the leader): their slots, in the order of their iovecs. The provider reports
/// the call once, under the leader's context; each of them then completes, or fails, with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Followers {
    idx: [u32; MAX_GATHER - 1],
    n: u8,
}

impl Followers {
    /// The followers' slots.
    pub(crate) fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.idx[..usize::from(self.n)].iter().map(|&i| i as usize)
    }

    /// Adds one; false when full.
    pub(crate) fn push(&mut self, slot: usize) -> bool {
        let (Some(cell), Ok(i)) = (self.idx.get_mut(usize::from(self.n)), u32::try_from(slot))
        else {
            return false;
        };
        *cell = i;
        self.n += 1;
        true
    }
}

/// What was asked of the provider (enough to post it again after -FI_EAGAIN).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Op {
    pub wr_id: WorkRequestId,
    pub kind: OpKind,
    /// The peer of a send or write (receives take messages from any peer).
    pub peer: Option<PeerId>,
    /// The local region and the range in it.
    pub local: LocalKey,
    pub offset: u64,
    pub len: u64,
    /// For writes: the address on the wire (the peer's base plus offset) and the key.
    pub remote_addr: u64,
    pub remote_key: RemoteKey,
    pub imm: Option<u32>,
    /// A READ (`fi_readmsg`: the remote range into the local one), `kind`
    /// [`OpKind::Read`]; WRITEs and READs take the same paths otherwise.
    pub read: bool,
    /// Whether the provider has accepted it (false while it waits in a peer's backlog).
    pub posted: bool,
    /// Whether the local range is host memory (only such ranges share calls: shm picks its
    /// CUDA IPC protocol only for an operation of one iovec). Taken from the registration
    /// when the operation is posted, so that gathering looks up no registration.
    pub host: bool,
    /// For the leader of a gathered call: the operations that went out with it.
    pub followers: Followers,
}

impl Op {
    /// Whether it may share one provider call with others of its kind (see
    /// [`MAX_GATHER`]): READs, and WRITEs without immediate data, of host memory that carry
    /// bytes.
    pub(crate) fn gatherable(&self) -> bool {
        matches!(self.kind, OpKind::Write | OpKind::Read)
            && self.imm.is_none()
            && self.len > 0
            && self.peer.is_some()
            && self.host
    }

    /// Whether `next` may go out in the same call as `self` (the call's first operation):
    /// the same direction, peer and remote region (so that a failure of the remote key,
    /// which fails the whole call, is the failure of each of them).
    pub(crate) fn gathers_with(&self, next: &Op) -> bool {
        self.gatherable()
            && next.gatherable()
            && self.read == next.read
            && self.peer == next.peer
            && self.remote_key == next.remote_key
    }
}

/// The state of one context.
#[derive(Debug)]
pub(crate) enum Slot {
    Free,
    Active(Op),
    /// Its peer was removed while the provider held it: it fails with `PeerRemoved` when
    /// the provider hands it back (completed or not), not before, because until then the
    /// NIC may still read or write its memory. It keeps its local region registered until
    /// then.
    Orphaned(Op, PeerId),
}

/// Operations by context.
#[derive(Default)]
pub(crate) struct OpTable {
    contexts: Vec<Box<[OpContext]>>,
    slots: Vec<Slot>,
    free: Vec<usize>,
}

impl OpTable {
    /// Stores `op` and returns its index.
    pub(crate) fn insert(&mut self, op: Op) -> usize {
        if let Some(i) = self.free.pop() {
            self.slots[i] = Slot::Active(op);
            return i;
        }
        let i = self.slots.len();
        if i == self.contexts.len() * CHUNK {
            self.contexts.push(
                (0..CHUNK)
                    .map(|_| OpContext(UnsafeCell::new([0; 8])))
                    .collect(),
            );
        }
        self.slots.push(Slot::Active(op));
        i
    }

    /// The context pointer of slot `i`, to give to libfabric.
    pub(crate) fn context(&self, i: usize) -> *mut c_void {
        self.contexts[i / CHUNK][i % CHUNK].0.get().cast()
    }

    /// The slot whose context is `ctx`, if it is one of ours.
    pub(crate) fn index_of(&self, ctx: *mut c_void) -> Option<usize> {
        let addr = ctx as usize;
        let size = std::mem::size_of::<OpContext>();
        self.contexts.iter().enumerate().find_map(|(c, chunk)| {
            let base = chunk.as_ptr() as usize;
            let off = addr.checked_sub(base)?;
            (off < CHUNK * size && off % size == 0).then(|| c * CHUNK + off / size)
        })
    }

    pub(crate) fn get(&self, i: usize) -> &Slot {
        &self.slots[i]
    }

    pub(crate) fn get_mut(&mut self, i: usize) -> &mut Slot {
        &mut self.slots[i]
    }

    /// Frees slot `i` and returns what it held.
    pub(crate) fn release(&mut self, i: usize) -> Slot {
        let s = std::mem::replace(&mut self.slots[i], Slot::Free);
        if !matches!(s, Slot::Free) {
            self.free.push(i);
        }
        s
    }

    /// Marks the active operation in slot `i` orphaned (its peer `peer` was removed);
    /// whether it was active.
    pub(crate) fn orphan(&mut self, i: usize, peer: PeerId) -> bool {
        match self.slots[i] {
            Slot::Active(op) => {
                self.slots[i] = Slot::Orphaned(op, peer);
                true
            }
            _ => false,
        }
    }

    /// Indices of active operations of `peer` that the provider holds.
    pub(crate) fn posted_for(&self, peer: PeerId) -> Vec<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Active(op) if op.posted && op.peer == Some(peer) => Some(i),
                _ => None,
            })
            .collect()
    }

    /// Number of slots not free (active or orphaned).
    pub(crate) fn in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(i: u64) -> Op {
        Op {
            wr_id: WorkRequestId(i),
            kind: OpKind::Write,
            read: false,
            peer: Some(PeerId(1)),
            local: LocalKey(1),
            offset: 0,
            len: 1,
            remote_addr: 0,
            remote_key: RemoteKey(0),
            imm: None,
            posted: true,
            host: true,
            followers: Followers::default(),
        }
    }

    #[test]
    fn contexts_map_back_to_slots_and_are_reused() {
        let mut t = OpTable::default();
        let ids: Vec<usize> = (0..600).map(|i| t.insert(op(i))).collect();
        for &i in &ids {
            assert_eq!(t.index_of(t.context(i)), Some(i));
        }
        assert_eq!(t.index_of(std::ptr::null_mut()), None);
        let odd = t.context(3).cast::<u8>().wrapping_add(1).cast();
        assert_eq!(t.index_of(odd), None);
        assert!(matches!(t.release(5), Slot::Active(_)));
        assert_eq!(t.in_use(), 599);
        assert_eq!(t.insert(op(9)), 5);
        assert!(t.orphan(7, PeerId(1)));
        assert!(!t.orphan(7, PeerId(1)));
        assert_eq!(t.posted_for(PeerId(1)).len(), 599);
    }

    #[test]
    fn followers_hold_at_most_the_gather_limit_less_the_leader() {
        let mut f = Followers::default();
        assert!(f.push(7) && f.push(3) && f.push(9));
        assert!(!f.push(1), "a call carries at most MAX_GATHER operations");
        assert_eq!(f.slots().collect::<Vec<_>>(), [7, 3, 9]);
        assert!(!Followers::default().push(u32::MAX as usize + 1));
    }

    #[test]
    fn only_bulk_operations_of_one_direction_peer_and_region_gather() {
        let w = op(1);
        assert!(w.gathers_with(&op(2)));
        let read = Op {
            read: true,
            ..op(2)
        };
        assert!(
            !w.gathers_with(&read),
            "reads and writes go in separate calls"
        );
        let imm = Op {
            imm: Some(1),
            ..op(2)
        };
        assert!(!w.gathers_with(&imm), "immediate data travels alone");
        let empty = Op { len: 0, ..op(2) };
        assert!(!w.gathers_with(&empty));
        let other_key = Op {
            remote_key: RemoteKey(5),
            ..op(2)
        };
        assert!(
            !w.gathers_with(&other_key),
            "one bad key must not fail another region's op"
        );
        let other_peer = Op {
            peer: Some(PeerId(2)),
            ..op(2)
        };
        assert!(!w.gathers_with(&other_peer));
        let device = Op {
            host: false,
            ..op(2)
        };
        assert!(!w.gathers_with(&device), "device memory travels alone");
        let send = Op {
            kind: OpKind::Send,
            ..op(2)
        };
        assert!(!send.gatherable());
    }
}
