//! Completions: reading the CQ and its error queue, and what their entries mean.

use super::post::{SEND_IMM, SEND_NO_IMM};
use super::{EfaTransport, RECONNECT_WINDOW};
use crate::fi::{FiError, check};
use crate::ops::{Followers, Op, Slot};
use fabric_core::{Completion, OpError, OpKind, Result, WorkRequestId};
use libfabric_sys as sys;
use std::mem::MaybeUninit;
use std::time::Instant;

/// Completions read from the CQ per `fi_cq_read` call.
const CQ_BATCH: usize = 64;
/// `fi_cq_read` calls per `poll`, at most (so that one busy CQ cannot starve the caller).
const CQ_READS_PER_POLL: usize = 8;

impl EfaTransport {
    /// Reads completions (and errors) from the CQ, which also drives the provider's
    /// progress, until it is empty or [`CQ_READS_PER_POLL`] batches were read.
    pub(super) fn read_cq(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        // Not zeroed: poll runs this on every call, and the provider writes what it returns.
        let mut entries = [const { MaybeUninit::<sys::fi_cq_data_entry>::uninit() }; CQ_BATCH];
        for _ in 0..CQ_READS_PER_POLL {
            // SAFETY: cq is open with FI_CQ_FORMAT_DATA; entries has room for CQ_BATCH
            // entries of that format.
            let rc =
                unsafe { sys::fi_cq_read(self.cq.as_ptr(), entries.as_mut_ptr().cast(), CQ_BATCH) };
            if rc == -(sys::FI_EAGAIN as isize) {
                break;
            }
            if rc == -(sys::FI_EAVAIL as isize) {
                self.read_errors(out)?;
                continue;
            }
            let n = check("fi_cq_read", rc)?.min(CQ_BATCH);
            for e in &entries[..n] {
                // SAFETY: fi_cq_read wrote its first n entries.
                let e = unsafe { e.assume_init_ref() };
                self.complete(e, out);
            }
            if n < CQ_BATCH {
                break;
            }
        }
        Ok(())
    }

    /// Handles a failed operation of a peer whose connection broke: notes when it broke
    /// and, within [`RECONNECT_WINDOW`], puts an operation that was never sent
    /// (FI_ENOTCONN) back in the peer's backlog. Returns whether it did.
    pub(super) fn retry_after_break(&mut self, idx: usize, code: i32) -> bool {
        let Slot::Active(op) = *self.ops.get(idx) else {
            return false;
        };
        let Some(p) = op.peer else {
            return false;
        };
        let breaks = breaks_connection(&op, code);
        let Some(peer) = self.peers.get_mut(&p) else {
            return false;
        };
        if breaks && peer.broken_since.is_none() {
            peer.broken_since = Some(Instant::now());
        }
        let retry = code == sys::FI_ENOTCONN
            && peer
                .broken_since
                .is_some_and(|t| t.elapsed() < RECONNECT_WINDOW);
        if retry {
            if peer.backlog.is_empty() {
                self.backlogged.push(p);
            }
            // The operations of the call go back in their order, to be sent again
            // (together again where they still may): none leads a call any more.
            peer.backlog.push_back(idx);
            peer.backlog.extend(op.followers.slots());
            for i in std::iter::once(idx).chain(op.followers.slots()) {
                if let Slot::Active(op) = self.ops.get_mut(i) {
                    op.posted = false;
                    op.followers = Followers::default();
                }
            }
        }
        retry
    }

    /// The immediate value of a receive's completion (see [`SEND_IMM`]).
    pub(super) fn recv_imm(&self, flags: u64, data: u64) -> Option<u32> {
        if self.tag_cq_data {
            match data >> 32 {
                SEND_IMM => return Some(data as u32),
                SEND_NO_IMM => return None,
                _ => {}
            }
        }
        (flags & sys::FI_REMOTE_CQ_DATA != 0).then_some(data as u32)
    }

    /// Turns one CQ entry into completions: one for each operation of the call it reports
    /// (or failures, for a removed peer's operations), or one for a peer's write with
    /// immediate data.
    pub(super) fn complete(&mut self, e: &sys::fi_cq_data_entry, out: &mut Vec<Completion>) {
        let imm = (e.flags & sys::FI_REMOTE_CQ_DATA != 0).then_some(e.data as u32);
        match self.ops.index_of(e.op_context) {
            Some(idx) if matches!(self.ops.get(idx), Slot::Active(_)) => {
                let Slot::Active(op) = self.finish_slot(idx) else {
                    unreachable!()
                };
                if let Some(peer) = op.peer.and_then(|p| self.peers.get_mut(&p)) {
                    peer.broken_since = None;
                }
                let (bytes, imm) = match op.kind {
                    OpKind::Recv => (e.len as u64, self.recv_imm(e.flags, e.data)),
                    _ => (op.len, None),
                };
                out.push(Completion {
                    wr_id: op.wr_id,
                    op: op.kind,
                    result: Ok(bytes),
                    peer: op.peer,
                    imm,
                });
                self.finish_followers(&op, out, |f| Ok(f.len));
            }
            Some(idx) if matches!(self.ops.get(idx), Slot::Orphaned(..)) => {
                // Its peer was removed: now that the provider is done with it, it fails.
                if let Slot::Orphaned(op, peer) = self.finish_slot(idx) {
                    out.push(failed(&op, OpError::PeerRemoved(peer)));
                    self.finish_followers(&op, out, |_| Err(OpError::PeerRemoved(peer)));
                }
            }
            // Not an operation in flight: a peer's write with immediate data (whose
            // context, where the provider fills it at all, means nothing to us).
            _ if imm.is_some() => out.push(Completion {
                wr_id: WorkRequestId(0),
                op: OpKind::RemoteWrite,
                // tcp reports 0 here and sockets the last segment's length: only the
                // immediate value is reliable.
                result: Ok(e.len as u64),
                peer: None,
                imm,
            }),
            _ => {
                tracing::warn!(
                    flags = e.flags,
                    "completion without an operation in flight; ignored"
                );
            }
        }
    }

    /// Completes the operations that went out in `leader`'s call with the result
    /// `result` gives each (a follower whose peer was removed meanwhile fails with
    /// `PeerRemoved`).
    pub(super) fn finish_followers(
        &mut self,
        leader: &Op,
        out: &mut Vec<Completion>,
        result: impl Fn(&Op) -> std::result::Result<u64, OpError>,
    ) {
        for f in leader.followers.slots() {
            match self.finish_slot(f) {
                Slot::Active(op) => out.push(Completion {
                    wr_id: op.wr_id,
                    op: op.kind,
                    result: result(&op),
                    peer: op.peer,
                    imm: None,
                }),
                Slot::Orphaned(op, peer) => out.push(failed(&op, OpError::PeerRemoved(peer))),
                Slot::Free => {}
            }
        }
    }

    /// Reads the CQ's error entries until there are none, appending their completions.
    pub(super) fn read_errors(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        loop {
            let mut err = sys::fi_cq_err_entry::default();
            // SAFETY: cq is open; err is a valid, zeroed entry (err_data_size 0 lets the
            // provider point err_data at its own buffer, valid until the next read).
            let rc = unsafe { sys::fi_cq_readerr(self.cq.as_ptr(), &mut err, 0) };
            if rc == -(sys::FI_EAGAIN as isize) {
                return Ok(());
            }
            check("fi_cq_readerr", rc)?;
            let text = self.cq_strerror(&err);
            tracing::debug!(
                err = err.err,
                prov_errno = err.prov_errno,
                len = err.len,
                olen = err.olen,
                flags = err.flags,
                %text,
                "CQ error entry"
            );
            match self.ops.index_of(err.op_context) {
                Some(idx) => {
                    if self.retry_after_break(idx, err.err) {
                        continue;
                    }
                    match self.finish_slot(idx) {
                        Slot::Active(op) => {
                            // The call failed as a whole: each of its operations fails
                            // with what the provider said (they share peer and region).
                            out.push(failed(&op, map_error(&op, &err, text.clone())));
                            self.finish_followers(&op, out, |f| {
                                Err(map_error(f, &err, text.clone()))
                            });
                        }
                        // Its peer was removed; the provider has let go of it now.
                        Slot::Orphaned(op, peer) => {
                            out.push(failed(&op, OpError::PeerRemoved(peer)));
                            self.finish_followers(&op, out, |_| Err(OpError::PeerRemoved(peer)));
                        }
                        Slot::Free => {}
                    }
                }
                None => {
                    // An error without one of our contexts: a failed remote access
                    // reported at the target (some providers do). The initiator gets the
                    // error; there is no local operation to fail here.
                    tracing::debug!(err = err.err, %text, "target-side error completion; ignored");
                }
            }
        }
    }

    pub(super) fn cq_strerror(&self, err: &sys::fi_cq_err_entry) -> String {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: cq is open; err_data is what fi_cq_readerr returned; buf is writable for
        // its length and the result (when non-null) is a NUL-terminated string.
        let p = unsafe {
            sys::fi_cq_strerror(
                self.cq.as_ptr(),
                err.prov_errno,
                err.err_data,
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        let prov = crate::fi::c_str(p);
        let generic = FiError::new(err.err).message();
        if prov.is_empty() || prov == generic {
            generic
        } else {
            format!("{generic}: {prov}")
        }
    }
}

/// A failed completion of `op`.
pub(super) fn failed(op: &Op, error: OpError) -> Completion {
    Completion {
        wr_id: op.wr_id,
        op: op.kind,
        result: Err(error),
        peer: op.peer,
        imm: None,
    }
}

/// Whether a failure of `op` with `code` means the provider dropped its connection to the
/// peer: errors of the connection itself, and FI_ECANCELED on a send or write (we never
/// cancel those; the tcp provider reports a failure at the target that way, after which
/// its connection is closed and operations fail with FI_ENOTCONN until it reconnects).
fn breaks_connection(op: &Op, code: i32) -> bool {
    matches!(
        code,
        sys::FI_ENOTCONN | sys::FI_ECONNRESET | sys::FI_ECONNABORTED | sys::FI_ESHUTDOWN
    ) || (code == sys::FI_ECANCELED && op.kind != OpKind::Recv)
}

/// Maps a CQ error entry of `op` to an [`OpError`], as exactly as the provider tells.
fn map_error(op: &Op, err: &sys::fi_cq_err_entry, text: String) -> OpError {
    let code = err.err;
    match code {
        // `olen` is what did not fit. Providers that leave it 0 (tcp) do not say how long
        // the message was: then `len` is the lower bound `capacity + 1`.
        c if c == sys::FI_ETRUNC as i32 => OpError::Truncated {
            len: op.len + (err.olen as u64).max(1),
            capacity: op.len,
        },
        // We never cancel sends or writes: the tcp provider reports a failure at the
        // target (bad key, no permission) as FI_ECANCELED, with the target's errno in
        // prov_errno, without telling which.
        sys::FI_ECANCELED if op.kind == OpKind::Recv => OpError::Cancelled,
        sys::FI_ECANCELED => OpError::Remote(text),
        c if c == sys::FI_ENOKEY as i32 || c == sys::FI_EKEYREJECTED => {
            OpError::RemoteKeyInvalid(op.remote_key)
        }
        sys::FI_EACCES | sys::FI_EPERM => OpError::PermissionDenied,
        sys::FI_ETIMEDOUT => OpError::TimedOut,
        sys::FI_ECONNREFUSED
        | sys::FI_ECONNRESET
        | sys::FI_ECONNABORTED
        | sys::FI_EHOSTUNREACH
        | sys::FI_ENETUNREACH
        | sys::FI_ENOTCONN
        | sys::FI_ESHUTDOWN
        | sys::FI_EHOSTDOWN => match op.peer {
            Some(peer) => OpError::PeerUnreachable { peer, reason: text },
            None => OpError::transport(text),
        },
        _ if matches!(op.kind, OpKind::Write | OpKind::Read) => OpError::Remote(text),
        _ => OpError::transport(text),
    }
}
