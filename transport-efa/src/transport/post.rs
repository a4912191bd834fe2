//! Posting: validated operations go to the provider, or wait in a peer's backlog.

use super::EfaTransport;
use super::complete::failed;
use crate::fi::{Posted, check_post};
use crate::ops::{Op, Slot};
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

impl EfaTransport {
    /// Accepts a validated operation: hands it to the provider, or queues it behind the
    /// peer's backlog, or answers NoRoom.
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
        let idx = self.ops.insert(op);
        self.hold(op.local);
        if !queue {
            match self.issue(idx, fi_addr) {
                Ok(Posted::Yes) => {
                    self.mark_posted(idx);
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

    pub(super) fn mark_posted(&mut self, idx: usize) {
        if let Slot::Active(op) = self.ops.get_mut(idx) {
            op.posted = true;
            if let Some(peer) = op.peer.and_then(|p| self.peers.get_mut(&p)) {
                peer.ready = true;
            }
        }
    }

    /// Makes the provider call for the operation in slot `idx`.
    pub(super) fn issue(&mut self, idx: usize, fi_addr: sys::fi_addr_t) -> Result<Posted> {
        let Slot::Active(op) = *self.ops.get(idx) else {
            unreachable!("issue on a slot that is not active");
        };
        let reg = &self.regs[&op.local];
        let mut iov = sys::iovec {
            iov_base: reg.base.wrapping_add(op.offset) as *mut c_void,
            iov_len: op.len as usize,
        };
        let mut desc = [reg.desc()];
        // A zero-length operation carries no buffer (shm hangs on a zero-length iovec).
        let iov_count = usize::from(op.len > 0);
        let context = self.ops.context(idx);
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
                    msg_iov: &mut iov,
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
                    msg_iov: &mut iov,
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
            OpKind::Write => {
                let rma = sys::fi_rma_iov {
                    addr: op.remote_addr,
                    len: op.len as usize,
                    key: op.remote_key.0,
                };
                let msg = sys::fi_msg_rma {
                    msg_iov: &mut iov,
                    desc: desc.as_mut_ptr(),
                    iov_count,
                    addr: fi_addr,
                    rma_iov: &rma,
                    rma_iov_count: 1,
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

    /// Hands backlogged operations to the provider, in order, until it says "again".
    pub(super) fn flush_backlogs(&mut self) {
        let mut i = 0;
        while i < self.backlogged.len() {
            let p = self.backlogged[i];
            while let Some((idx, fi_addr)) = self
                .peers
                .get(&p)
                .and_then(|peer| Some((*peer.backlog.front()?, peer.fi_addr)))
            {
                match self.issue(idx, fi_addr) {
                    Ok(Posted::Again) => break,
                    Ok(Posted::Yes) => {
                        self.peers.get_mut(&p).map(|x| x.backlog.pop_front());
                        self.mark_posted(idx);
                    }
                    Err(e) => {
                        self.peers.get_mut(&p).map(|x| x.backlog.pop_front());
                        if let Slot::Active(op) = self.finish_slot(idx) {
                            self.ready.push_back(failed(&op, OpError::transport(e)));
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
