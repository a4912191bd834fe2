//! Posting: validated operations go to the provider, or wait in a peer's backlog.

use super::EfaTransport;
use super::complete::failed;
use crate::fi::{Posted, check_post};
use crate::ops::{Followers, MAX_GATHER, Op, Slot};
use fabric_core::{OpError, OpKind, PostOutcome, Result};
use libfabric_sys as sys;
use std::ffi::c_void;

/// Where the provider carries 8 bytes of remote CQ data, every SEND carries CQ data whose
/// upper half says whether the lower half is an immediate value ([`SEND_IMM`]) or not
/// ([`SEND_NO_IMM`]). The sockets provider delivers the data of a SEND that arrived before
/// its receive was posted but drops the FI_REMOTE_CQ_DATA flag from that completion, and
/// leaves the previous message's data in completions without it: with the tag, receives
/// read the immediate value right either way.
pub(super) const SEND_IMM: u64 = 0x7866_6572; // "xfer"
/// See [`SEND_IMM`].
pub(super) const SEND_NO_IMM: u64 = 0x7866_6500;

/// The slots of one provider call: the leader first, then its followers, in backlog order.
#[derive(Clone, Copy, Debug)]
pub(super) struct Group {
    idx: [usize; MAX_GATHER],
    n: usize,
}

impl Group {
    /// A call of one operation.
    pub(super) fn one(idx: usize) -> Group {
        Group {
            idx: [idx; MAX_GATHER],
            n: 1,
        }
    }

    pub(super) fn slots(&self) -> &[usize] {
        &self.idx[..self.n]
    }
}

impl EfaTransport {
    /// Accepts a validated operation: hands it to the provider, or queues it behind the
    /// peer's backlog, or answers NoRoom.
    ///
    /// Where the provider takes several iovecs ([`EfaTransport::gather`] above 1), READs and
    /// bulk WRITEs of host memory always wait in the peer's backlog until the next `poll`
    /// (or `wait`), which hands them over up to `gather` in one call: the operations an
    /// engine posts in one go (the pages of a transfer) then share requests and replies.
    /// Nothing moves before that poll anyway with such providers (manual progress).
    pub(super) fn submit(&mut self, op: Op) -> Result<PostOutcome> {
        let peer_id = op.peer;
        let (fi_addr, queue) = match peer_id {
            Some(p) => {
                let peer = self.peer(p)?;
                if peer.backlog.len() >= self.info.tx_size.max(1) {
                    return Ok(PostOutcome::NoRoom);
                }
                (peer.fi_addr, !peer.backlog.is_empty())
            }
            None => (sys::FI_ADDR_UNSPEC, false),
        };
        let defer = self.gather > 1 && op.gatherable();
        let idx = self.ops.insert(op);
        self.hold(op.local);
        if !queue && !defer {
            match self.issue(Group::one(idx), fi_addr) {
                Ok(Posted::Yes) => {
                    self.mark_posted(Group::one(idx));
                    return Ok(PostOutcome::Posted);
                }
                Ok(Posted::Again) => {
                    let connecting = peer_id.is_some_and(|p| !self.peers[&p].ready);
                    if !connecting {
                        self.finish_slot(idx);
                        return Ok(PostOutcome::NoRoom);
                    }
                }
                Err(e) => {
                    self.finish_slot(idx);
                    return Err(e);
                }
            }
        }
        let p = peer_id.expect("only peer operations are queued");
        let peer = self.peers.get_mut(&p).expect("peer checked above");
        if peer.backlog.is_empty() {
            self.backlogged.push(p);
        }
        peer.backlog.push_back(idx);
        Ok(PostOutcome::Posted)
    }

    /// Marks the operations of a call accepted by the provider; the leader records its
    /// followers, whose completions come with its own.
    pub(super) fn mark_posted(&mut self, group: Group) {
        let (leader, rest) = group.slots().split_first().expect("a group is never empty");
        let mut followers = Followers::default();
        for &f in rest {
            let pushed = followers.push(f);
            debug_assert!(pushed, "a group holds at most MAX_GATHER operations");
        }
        for &idx in group.slots() {
            if let Slot::Active(op) = self.ops.get_mut(idx) {
                op.posted = true;
                if idx == *leader {
                    op.followers = followers;
                }
                if let Some(peer) = op.peer.and_then(|p| self.peers.get_mut(&p)) {
                    peer.ready = true;
                }
            }
        }
    }

    /// The call that the front of `peer`'s backlog makes: its first operation and, where
    /// they may share it, the ones behind it, up to [`EfaTransport::gather`] operations
    /// and `max_msg_size` bytes.
    fn next_group(&self, peer: &super::Peer) -> Option<Group> {
        let &first = peer.backlog.front()?;
        let mut group = Group::one(first);
        let Slot::Active(lead) = *self.ops.get(first) else {
            return Some(group);
        };
        if self.gather < 2 || !lead.gatherable() {
            return Some(group);
        }
        let mut bytes = lead.len;
        for &idx in peer.backlog.iter().skip(1).take(self.gather - 1) {
            let Slot::Active(op) = *self.ops.get(idx) else {
                break;
            };
            let fits = bytes
                .checked_add(op.len)
                .is_some_and(|b| b <= self.info.max_msg_size);
            if !fits || !lead.gathers_with(&op) {
                break;
            }
            bytes += op.len;
            group.idx[group.n] = idx;
            group.n += 1;
        }
        Some(group)
    }

    /// Makes the provider call for the operations of `group` (several only for READs or
    /// bulk WRITEs that [`Op::gathers_with`] the first), under the first one's context.
    pub(super) fn issue(&mut self, group: Group, fi_addr: sys::fi_addr_t) -> Result<Posted> {
        let Slot::Active(op) = *self.ops.get(group.slots()[0]) else {
            unreachable!("issue on a slot that is not active");
        };
        let mut iov = [sys::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_GATHER];
        let mut desc = [std::ptr::null_mut::<c_void>(); MAX_GATHER];
        let mut rma = [sys::fi_rma_iov {
            addr: 0,
            len: 0,
            key: 0,
        }; MAX_GATHER];
        for (i, &idx) in group.slots().iter().enumerate() {
            let Slot::Active(m) = *self.ops.get(idx) else {
                unreachable!("a group holds active slots only");
            };
            let reg = &self.regs[&m.local];
            iov[i] = sys::iovec {
                iov_base: reg.base.wrapping_add(m.offset) as *mut c_void,
                iov_len: m.len as usize,
            };
            desc[i] = reg.desc();
            rma[i] = sys::fi_rma_iov {
                addr: m.remote_addr,
                len: m.len as usize,
                key: m.remote_key.0,
            };
        }
        let n = group.n;
        // A zero-length operation carries no buffer (shm hangs on a zero-length iovec).
        let iov_count = if op.len > 0 { n } else { 0 };
        let context = self.ops.context(group.slots()[0]);
        let tagged = self.tag_cq_data && op.kind == OpKind::Send;
        let data = match op.imm {
            Some(imm) if tagged => SEND_IMM << 32 | u64::from(imm),
            Some(imm) => u64::from(imm),
            None if tagged => SEND_NO_IMM << 32,
            None => 0,
        };
        let mut flags = sys::FI_COMPLETION;
        if op.imm.is_some() || tagged {
            flags |= sys::FI_REMOTE_CQ_DATA;
        }
        // A zero-length operation has nothing to deliver; shm never completes one that asks
        // for delivery completion.
        let delivery = if op.len > 0 {
            sys::FI_DELIVERY_COMPLETE
        } else {
            0
        };
        let ep = self.ep.as_ptr();
        match op.kind {
            OpKind::Recv => {
                let msg = sys::fi_msg {
                    msg_iov: iov.as_mut_ptr(),
                    desc: desc.as_mut_ptr(),
                    iov_count,
                    addr: sys::FI_ADDR_UNSPEC,
                    context,
                    data: 0,
                };
                // SAFETY: msg points to an iovec inside a registered region (checked at
                // post time) whose registration and memory stay alive until the
                // completion (held by the slot); context is the slot's pinned context.
                let rc = unsafe { sys::fi_recvmsg(ep, &msg, sys::FI_COMPLETION) };
                check_post("fi_recvmsg", rc)
            }
            OpKind::Send => {
                let msg = sys::fi_msg {
                    msg_iov: iov.as_mut_ptr(),
                    desc: desc.as_mut_ptr(),
                    iov_count,
                    addr: fi_addr,
                    context,
                    data,
                };
                flags |= delivery;
                // SAFETY: as for fi_recvmsg; fi_addr is a live AV entry of this endpoint.
                let rc = unsafe { sys::fi_sendmsg(ep, &msg, flags) };
                check_post("fi_sendmsg", rc)
            }
            OpKind::Write | OpKind::Read => {
                let msg = sys::fi_msg_rma {
                    msg_iov: iov.as_mut_ptr(),
                    desc: desc.as_mut_ptr(),
                    iov_count,
                    addr: fi_addr,
                    rma_iov: rma.as_ptr(),
                    rma_iov_count: n,
                    context,
                    data, // 0 for a read: it carries no immediate data
                };
                if op.read {
                    // SAFETY: as for fi_sendmsg; the local iovec lies in a region
                    // registered for FI_READ (checked at post time) that stays alive until
                    // the completion; the remote range is checked by the owner.
                    let rc = unsafe { sys::fi_readmsg(ep, &msg, sys::FI_COMPLETION) };
                    check_post("fi_readmsg", rc)
                } else {
                    flags |= delivery;
                    // SAFETY: as for fi_sendmsg; the remote range is checked by the target.
                    let rc = unsafe { sys::fi_writemsg(ep, &msg, flags) };
                    check_post("fi_writemsg", rc)
                }
            }
            OpKind::RemoteWrite => unreachable!("remote writes are not posted"),
        }
    }

    /// Hands backlogged operations to the provider, in order (several to a call where they
    /// may share one), until it says "again".
    pub(super) fn flush_backlogs(&mut self) {
        let mut i = 0;
        while i < self.backlogged.len() {
            let p = self.backlogged[i];
            while let Some((group, fi_addr)) = self
                .peers
                .get(&p)
                .and_then(|peer| Some((self.next_group(peer)?, peer.fi_addr)))
            {
                let issued = self.issue(group, fi_addr);
                if matches!(issued, Ok(Posted::Again)) {
                    break;
                }
                if let Some(peer) = self.peers.get_mut(&p) {
                    peer.backlog.drain(..group.n);
                }
                match issued {
                    Ok(_) => self.mark_posted(group),
                    Err(e) => {
                        let text = e.to_string();
                        for &idx in group.slots() {
                            if let Slot::Active(op) = self.finish_slot(idx) {
                                let error = OpError::transport(text.clone());
                                self.ready.push_back(failed(&op, error));
                            }
                        }
                    }
                }
            }
            if self.peers.get(&p).is_none_or(|x| x.backlog.is_empty()) {
                self.backlogged.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }
}
