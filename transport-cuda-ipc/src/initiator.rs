//! The initiator's half of the protocol: reservations out, grants in, copies queued on the
//! link (into the peer's mapping for WRITEs, out of it for READs), completions and DONE
//! frames once the copies have finished.

use crate::error::ProtocolError;
use crate::wire::{self, Grant, Header, KeyInfo, Landed, Op, Reserve, Status, put_frame, records};
use crate::{Copying, CudaIpcTransport, KeyMap, Link, LinkError, WriteOp, op_error};
use fabric_core::{Completion, OpError, OpKind, PeerId, WorkRequestId};
use std::time::Instant;

impl<L: Link> CudaIpcTransport<L> {
    /// Waits for the copies of `peer` (all copies: they share one stream), completing them.
    pub(crate) fn drain_copies_of(&mut self, peer: PeerId) {
        if !self.copying.iter().any(|c| c.peer == peer) {
            return;
        }
        let result = self.link.synchronize();
        self.retire_copies(result);
    }

    /// Completes the batches whose copies finished (all of them after an error).
    pub(crate) fn retire_copies(&mut self, done: std::result::Result<u64, LinkError>) {
        let (upto, err) = match done {
            Ok(t) => (t, None),
            Err(e) => (u64::MAX, Some(e)),
        };
        while self.copying.front().is_some_and(|c| c.ticket <= upto) {
            let Some(b) = self.copying.pop_front() else {
                break;
            };
            let mut landed = Vec::new();
            tracing::trace!(
                target: "transport_cuda_ipc::timeline",
                batch = b.batch,
                ops = b.ops.len(),
                "copied"
            );
            for op in &b.ops {
                self.outstanding -= 1;
                let result = match &err {
                    None => {
                        if let Some(imm) = op.imm {
                            landed.push(Landed {
                                imm,
                                len: op.bytes(),
                            });
                        }
                        Ok(op.bytes())
                    }
                    Some(e) => Err(OpError::transport_with("device copy failed", e.clone())),
                };
                self.done.push(Completion {
                    wr_id: op.wr,
                    op: OpKind::one_sided(op.read),
                    result,
                    peer: Some(b.peer),
                    imm: None,
                });
            }
            if let Some(p) = self.peers.get_mut(&b.peer) {
                p.in_flight = p.in_flight.saturating_sub(1);
                if let Some(c) = p
                    .conn
                    .and_then(|i| self.conns.get_mut(i))
                    .and_then(Option::as_mut)
                {
                    put_frame(c.io.out(), Op::Done, b.batch, 0, &landed);
                }
            }
        }
    }

    /// Sends reservations for pending writes, within each peer's window.
    pub(crate) fn reserve(&mut self) {
        let max_batch = self.cfg.max_batch;
        let window = self.cfg.max_batches_in_flight;
        for p in self.peers.values_mut() {
            let Some(ci) = p.conn else { continue };
            let Some(Some(c)) = self.conns.get_mut(ci) else {
                continue;
            };
            // No reservation (no key, no range) before the target has proved itself.
            if !c.hs.is_done() {
                continue;
            }
            while !p.pending.is_empty() && p.in_flight < window {
                // A batch is all writes or all reads (its reservation says which).
                let read = p.pending.front().is_some_and(|o| o.read);
                let n = p
                    .pending
                    .iter()
                    .take(max_batch)
                    .take_while(|o| o.read == read)
                    .count();
                let ops: Vec<WriteOp> = p.pending.drain(..n).collect();
                let entries: Vec<Reserve> = ops
                    .iter()
                    .map(|o| Reserve {
                        key: o.key,
                        offset: o.off,
                        len: o.dst_span(),
                    })
                    .collect();
                let batch = p.next_batch;
                p.next_batch += 1;
                let kind = if read { wire::RESERVE_READS } else { 0 };
                put_frame(c.io.out(), Op::Reserve, batch, kind, &entries);
                tracing::trace!(
                    target: "transport_cuda_ipc::timeline",
                    batch,
                    ops = ops.len(),
                    bytes = ops.iter().map(WriteOp::bytes).sum::<u64>(),
                    "reserving"
                );
                p.reserving.insert(batch, (Instant::now(), ops));
                p.in_flight += 1;
            }
        }
    }

    /// A frame from a target we write to.
    pub(crate) fn on_answer(
        &mut self,
        idx: usize,
        peer: PeerId,
        (h, payload): (Header, Vec<u8>),
    ) -> std::result::Result<(), ProtocolError> {
        let Some(p) = self.peers.get_mut(&peer) else {
            return Err(ProtocolError::RemovedPeer);
        };
        match h.op {
            Op::SendAck => {
                let pos = p
                    .sends
                    .iter()
                    .position(|(wr, _)| wr.0 == h.id)
                    .ok_or(ProtocolError::UnknownSend(h.id))?;
                let (wr, len) = p.sends.remove(pos).unwrap_or((WorkRequestId(h.id), 0));
                let result = match Status::from_u32(h.x as u32) {
                    Some(Status::Ok) => Ok(len),
                    Some(Status::Truncated) => Err(OpError::Remote(format!(
                        "the peer's receive buffer is smaller than the {len}-byte message"
                    ))),
                    _ => Err(OpError::Remote(format!("SEND refused (status {})", h.x))),
                };
                self.outstanding -= 1;
                self.done.push(Completion {
                    wr_id: wr,
                    op: OpKind::Send,
                    result,
                    peer: Some(peer),
                    imm: None,
                });
            }
            Op::KeyInfo => {
                let infos =
                    records::<KeyInfo>(Op::KeyInfo, &payload).map_err(ProtocolError::Payload)?;
                let [info] = infos[..] else {
                    return Err(ProtocolError::KeyInfoRecords(infos.len()));
                };
                let mapped = match self.link.open(&info.handle, p.same_process.as_ref()) {
                    Ok(m)
                        if info
                            .offset
                            .checked_add(info.len)
                            .is_some_and(|e| e <= L::mapping_len(&m)) =>
                    {
                        Ok(KeyMap {
                            mapping: m,
                            offset: info.offset,
                            len: info.len,
                        })
                    }
                    Ok(m) => Err(LinkError::BeyondMapping {
                        offset: info.offset,
                        len: info.len,
                        mapped: L::mapping_len(&m),
                    }),
                    Err(e) => Err(e),
                };
                p.keys.insert(h.x, mapped);
            }
            Op::Grant => {
                tracing::trace!(target: "transport_cuda_ipc::timeline", batch = h.id, "granted");
                let (_, ops) = p
                    .reserving
                    .remove(&h.id)
                    .ok_or(ProtocolError::UnknownGrant(h.id))?;
                let verdicts =
                    records::<Grant>(Op::Grant, &payload).map_err(ProtocolError::Payload)?;
                if verdicts.len() != ops.len() {
                    return Err(ProtocolError::GrantCount {
                        verdicts: verdicts.len(),
                        writes: ops.len(),
                    });
                }
                let mut ok_ops = Vec::with_capacity(ops.len());
                let mut failed = Vec::new();
                for (op, g) in ops.into_iter().zip(verdicts) {
                    if g.status != Status::Ok as u32 {
                        let e = op_error(g.status, &op, g.region_len);
                        failed.push((op, e));
                        continue;
                    }
                    let placed = match p.keys.get(&op.key) {
                        Some(Ok(k)) => k.place(&op).map(|at| (k, at)),
                        Some(Err(why)) => Err(OpError::transport_with(
                            "cannot map the peer's memory",
                            why.clone(),
                        )),
                        None => Err(OpError::Remote(
                            "the peer granted a write without sending its handle".into(),
                        )),
                    };
                    let pushed = match placed {
                        Ok((k, at)) if op.read => self
                            .link
                            .pull(&k.mapping, at, &op.src, op.src_off, op.len)
                            .map_err(|e| OpError::transport_with("device copy failed", e)),
                        Ok((k, at)) if op.rows > 1 => self
                            .link
                            .push_rows(
                                &op.src,
                                (op.src_off, op.src_stride),
                                &k.mapping,
                                (at, op.dst_stride),
                                op.len,
                                op.rows,
                            )
                            .map_err(|e| OpError::transport_with("device copy failed", e)),
                        Ok((k, at)) => self
                            .link
                            .push(&op.src, op.src_off, &k.mapping, at, op.len)
                            .map_err(|e| OpError::transport_with("device copy failed", e)),
                        Err(e) => Err(e),
                    };
                    match pushed {
                        Ok(()) => ok_ops.push(op),
                        Err(e) => failed.push((op, e)),
                    }
                }
                for (op, e) in failed {
                    self.outstanding -= 1;
                    self.done.push(Completion {
                        wr_id: op.wr,
                        op: OpKind::one_sided(op.read),
                        result: Err(e),
                        peer: Some(peer),
                        imm: None,
                    });
                }
                let launched = self.link.submit();
                tracing::trace!(
                    target: "transport_cuda_ipc::timeline",
                    batch = h.id,
                    ops = ok_ops.len(),
                    "launched"
                );
                match launched {
                    Ok(ticket) => self.copying.push_back(Copying {
                        ticket,
                        peer,
                        batch: h.id,
                        ops: ok_ops,
                    }),
                    Err(e) => {
                        // Nothing is known about the batch's copies: wait for the stream,
                        // then fail them all.
                        let _ = self.link.synchronize();
                        for op in ok_ops {
                            self.outstanding -= 1;
                            self.done.push(Completion {
                                wr_id: op.wr,
                                op: OpKind::one_sided(op.read),
                                result: Err(OpError::transport_with(
                                    "device copy failed",
                                    e.clone(),
                                )),
                                peer: Some(peer),
                                imm: None,
                            });
                        }
                        if let Some(p) = self.peers.get_mut(&peer) {
                            p.in_flight = p.in_flight.saturating_sub(1);
                        }
                        if let Some(Some(c)) = self.conns.get_mut(idx) {
                            put_frame::<Landed>(c.io.out(), Op::Done, h.id, 0, &[]);
                        }
                    }
                }
            }
            Op::Revoke => {
                p.keys.remove(&h.x);
            }
            other => return Err(ProtocolError::NotForInitiator(other)),
        }
        Ok(())
    }
}
