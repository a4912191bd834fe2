//! The target's half of the protocol: HELLO (its proof of the token checked before anything
//! else of the peer's, then our PROOF), SEND delivery, reservations (for WRITEs or READs)
//! checked against the registered regions (key, bounds, permission) before any grant, and
//! DONE frames turned into remote-write completions.

use crate::error::ProtocolError;
use crate::handshake::{self, Handshake};
use crate::wire::{self, Grant, Header, KeyInfo, Landed, Op, Reserve, Status, put_frame, records};
use crate::{Conn, CudaIpcTransport, IpcAddress, Link, Role};
use fabric_core::recv::Arrival;
use fabric_core::{Access, Completion, MemoryRegion, OpError, OpKind, PeerId, WorkRequestId};
use std::sync::Arc;

impl<L: Link> CudaIpcTransport<L> {
    /// A frame from a peer that writes to us.
    pub(crate) fn on_request(
        &mut self,
        idx: usize,
        (h, payload): (Header, Vec<u8>),
    ) -> std::result::Result<(), ProtocolError> {
        let peer = match &self.conns[idx] {
            Some(Conn {
                role: Role::Target { peer, .. },
                ..
            }) => *peer,
            _ => return Err(ProtocolError::NotTarget),
        };
        if h.op != Op::Hello && peer.is_none() {
            return Err(ProtocolError::BeforeHello(h.op));
        }
        match h.op {
            Op::Hello => {
                let nonce = match &self.conns[idx] {
                    Some(Conn {
                        hs: Handshake::Challenged { nonce },
                        ..
                    }) if peer.is_none() => *nonce,
                    _ => return Err(ProtocolError::SecondHello),
                };
                // Version, modes and the tag of our CHALLENGE's nonce, before anything else.
                let token = self.cfg.auth_token.as_deref();
                let hello = handshake::check_hello(&nonce, token, &h, &payload)?;
                let addr = IpcAddress::parse(hello.address).map_err(ProtocolError::HelloAddress)?;
                addr.check_same_host(&self.boot_id)
                    .map_err(ProtocolError::OtherHost)?;
                let known = self
                    .peers
                    .iter()
                    .find(|(_, p)| p.address == hello.address)
                    .map(|(id, _)| *id);
                let id = match known.or_else(|| self.passive.get(hello.address).copied()) {
                    Some(id) => id,
                    None => {
                        let id = PeerId(self.next_peer);
                        self.next_peer += 1;
                        self.passive.insert(hello.address.to_vec(), id);
                        id
                    }
                };
                let max_payload = self.max_payload();
                if let Some(Some(Conn {
                    io,
                    role: Role::Target { peer, .. },
                    hs,
                    ..
                })) = self.conns.get_mut(idx)
                {
                    *peer = Some(id);
                    *hs = Handshake::Done;
                    io.set_max_payload(max_payload);
                    handshake::prove(token, &hello.nonce, io.out());
                }
            }
            Op::Send => {
                let status = match self.recv.arrive(peer, h.imm, &payload, &mut self.done) {
                    Arrival::Delivered(Err(OpError::Truncated { .. })) => Status::Truncated,
                    Arrival::Delivered(_) | Arrival::Queued => Status::Ok,
                    // No room: handle this frame again once receives are posted.
                    Arrival::Full => return self.pause_with(idx, h, payload),
                };
                if let Some(Some(c)) = self.conns.get_mut(idx) {
                    Header::new(Op::SendAck, h.id, status as u64, 0).encode(c.io.out());
                }
            }
            Op::Reserve => {
                let entries =
                    records::<Reserve>(Op::Reserve, &payload).map_err(ProtocolError::Payload)?;
                let Some(Some(Conn {
                    io,
                    role:
                        Role::Target {
                            known_keys,
                            granted,
                            ..
                        },
                    ..
                })) = self.conns.get_mut(idx)
                else {
                    return Err(ProtocolError::NotTarget);
                };
                if granted.len() >= 4 * self.cfg.max_batches_in_flight.max(16) {
                    return Err(ProtocolError::TooManyReservations);
                }
                if granted.contains_key(&h.id) {
                    return Err(ProtocolError::ReservedTwice(h.id));
                }
                let need = match h.x {
                    0 => Access::REMOTE_WRITE,
                    wire::RESERVE_READS => Access::REMOTE_READ,
                    x => return Err(ProtocolError::ReservationKind(x)),
                };
                let mut verdicts = Vec::with_capacity(entries.len());
                let mut keep: Vec<Arc<dyn MemoryRegion>> = Vec::new();
                let mut ok = 0usize;
                for e in &entries {
                    let (status, region_len) = match self.targets.get(&e.key) {
                        None => (Status::BadKey, 0),
                        Some(t) => {
                            let len = t.mem.len() as u64;
                            let status = if !t.access.contains(need) {
                                Status::NoPermission
                            } else if e.offset.checked_add(e.len).is_none_or(|end| end > len) {
                                Status::OutOfBounds
                            } else if let Some(x) = &t.export {
                                if known_keys.insert(e.key) {
                                    let info = KeyInfo {
                                        handle: x.handle,
                                        offset: x.offset,
                                        len: t.mem.len() as u64,
                                        device: self.link.device(),
                                    };
                                    put_frame(io.out(), Op::KeyInfo, 0, e.key, &[info]);
                                }
                                if !keep.last().is_some_and(|k| Arc::ptr_eq(k, &t.mem)) {
                                    keep.push(t.mem.clone());
                                }
                                ok += 1;
                                Status::Ok
                            } else {
                                Status::NoPermission
                            };
                            (status, len)
                        }
                    };
                    verdicts.push(Grant {
                        status: status as u32,
                        region_len,
                    });
                }
                granted.insert(h.id, (keep, ok));
                put_frame(io.out(), Op::Grant, h.id, 0, &verdicts);
            }
            Op::Done => {
                let landed =
                    records::<Landed>(Op::Done, &payload).map_err(ProtocolError::Payload)?;
                let Some(Some(Conn {
                    role: Role::Target { granted, .. },
                    ..
                })) = self.conns.get_mut(idx)
                else {
                    return Err(ProtocolError::NotTarget);
                };
                let Some((_, ok)) = granted.remove(&h.id) else {
                    return Err(ProtocolError::UnknownDone(h.id));
                };
                if landed.len() > ok {
                    return Err(ProtocolError::DoneOverrun {
                        reported: landed.len(),
                        granted: ok,
                    });
                }
                for l in landed {
                    self.done.push(Completion {
                        wr_id: WorkRequestId(0),
                        op: OpKind::RemoteWrite,
                        result: Ok(l.len),
                        peer,
                        imm: Some(l.imm),
                    });
                }
            }
            other => return Err(ProtocolError::NotForTarget(other)),
        }
        Ok(())
    }

    /// Puts a SEND back in front of the connection's input and stops reading it.
    pub(crate) fn pause_with(
        &mut self,
        idx: usize,
        h: Header,
        payload: Vec<u8>,
    ) -> std::result::Result<(), ProtocolError> {
        if let Some(Some(c)) = self.conns.get_mut(idx) {
            c.io.unread(wire::HEADER_LEN + payload.len());
            c.paused = true;
        }
        let _ = h;
        Ok(())
    }
}
