//! The [`Transport`] methods of [`CudaIpcTransport`]: what applications and the engine call.

use crate::wire::{self, Header, Op};
use crate::{
    Conn, CudaIpcTransport, FrameConn, Handshake, IpcAddress, Link, LocalRegion, Peer, Role,
    TargetRegion, WriteOp,
};
use fabric_core::{
    Access, Completion, Error, LocalKey, LocalSlice, MemoryLocation, MemoryRegion, OpError, PeerId,
    PostOutcome, Registration, RemoteKey, RemoteRegion, RemoteSlice, Result, Rows, Transport,
    TransportLimits, WorkRequestId,
};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl<L: Link> Transport for CudaIpcTransport<L> {
    fn name(&self) -> &'static str {
        "cuda-ipc"
    }

    fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    fn limits(&self) -> TransportLimits {
        TransportLimits {
            max_msg_size: self.cfg.max_msg_size,
            max_outstanding: self.cfg.max_outstanding,
            write_imm: true,
            busy_poll: false,
            strided_writes: true,
        }
    }

    fn add_peer(&mut self, address: &[u8]) -> Result<PeerId> {
        let to = IpcAddress::parse(address)?;
        to.check_same_host(&self.boot_id)?;
        let sa = SocketAddr::from_abstract_name(to.socket.as_bytes())
            .map_err(|e| Error::io("abstract socket name", e))?;
        let stream = UnixStream::connect_addr(&sa).map_err(|e| {
            Error::InvalidAddress(format!(
                "no CUDA IPC transport listens at {} (process {} exited?): {e}",
                to.socket, to.pid
            ))
        })?;
        // Who listens there, as the kernel recorded it: anything but this very process (or
        // a process the kernel cannot name to us) is another process.
        let same_process = gpu_mem::SameProcess::of_unix_peer(&stream).unwrap_or_else(|e| {
            tracing::debug!("SO_PEERCRED of a CUDA IPC peer failed ({e}): another process");
            None
        });
        // Our HELLO's nonce, fresh for this connection: the target's PROOF must cover it.
        let nonce = fabric_core::auth::Nonce::new().map_err(|e| Error::Backend {
            call: "draw a nonce for the CUDA IPC handshake",
            message: e.to_string(),
            source: Some(Arc::new(e)),
        })?;
        // Nothing leaves before the target's CHALLENGE (then our HELLO), and frames are
        // handshake-sized until its PROOF has come.
        let io = FrameConn::new(stream, wire::HANDSHAKE_MAX_PAYLOAD)
            .map_err(|e| Error::io("set_nonblocking", e))?;
        let id = PeerId(self.next_peer);
        self.next_peer += 1;
        let now = Instant::now();
        let idx = self.insert_conn(Conn {
            io,
            role: Role::Initiator(id),
            hs: Handshake::AwaitingChallenge { nonce },
            held: Vec::new(),
            opened: now,
            paused: false,
            last_heard: now,
        });
        self.peers.insert(
            id,
            Peer {
                conn: Some(idx),
                address: address.to_vec(),
                broken: None,
                pending: VecDeque::new(),
                reserving: Default::default(),
                next_batch: 1,
                in_flight: 0,
                keys: Default::default(),
                sends: VecDeque::new(),
                same_process,
            },
        );
        Ok(id)
    }

    /// Ready once the target has proved itself (its PROOF); a refused or failed handshake is
    /// its error (a refusal: [`OpError::Transport`] whose cause is the
    /// [`HandshakeError`](crate::HandshakeError)), after which the peer is gone.
    fn peer_ready(&mut self, peer: PeerId) -> Result<bool> {
        let p = self.peers.get(&peer).ok_or(Error::UnknownPeer(peer))?;
        if let Some(why) = p.broken.clone() {
            self.peers.remove(&peer);
            return Err(Error::Op(why));
        }
        Ok(p.conn
            .and_then(|i| self.conns.get(i))
            .and_then(Option::as_ref)
            .is_some_and(|c| c.hs.is_done()))
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<()> {
        let conn = self.peers.get(&peer).ok_or(Error::UnknownPeer(peer))?.conn;
        if let Some(idx) = conn {
            self.close_conn(idx, OpError::PeerRemoved);
        }
        self.peers.remove(&peer);
        Ok(())
    }

    fn register(&mut self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Registration> {
        // The link copies on its own device, from or into that device's memory: another
        // device's memory is not this transport's to hold (an agent then carries it over
        // another transport, such as tcp, which copies each region on its own device).
        if let MemoryLocation::Cuda { device } = mem.location()
            && device != self.link.device()
        {
            return Err(Error::Unsupported(format!(
                "the cuda-ipc transport of CUDA device {} holds that device's memory (and \
                 host memory it copies from), not device {device}'s: use a cuda-ipc \
                 transport of device {device}, or the tcp transport",
                self.link.device()
            )));
        }
        let export =
            if access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_READ) {
                Some(self.link.export(&mem)?)
            } else {
                None
            };
        let rkey = RemoteKey::random(|k| self.targets.contains_key(&k)).0;
        let local = LocalKey(self.next_local);
        self.next_local += 1;
        let len = mem.len() as u64;
        self.targets.insert(
            rkey,
            TargetRegion {
                mem: mem.clone(),
                access,
                export,
            },
        );
        self.local.insert(local, LocalRegion { mem, access, rkey });
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
        let r = self
            .local
            .remove(&key)
            .ok_or(Error::Op(OpError::LocalKeyInvalid(key)))?;
        self.targets.remove(&r.rkey);
        for c in self.conns.iter_mut().flatten() {
            if let Role::Target { known_keys, .. } = &mut c.role
                && known_keys.remove(&r.rkey)
            {
                Header::new(Op::Revoke, 0, r.rkey, 0).encode(c.io.out());
            }
        }
        Ok(())
    }

    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        if src.len > self.cfg.max_send_size {
            return Err(fabric_core::Invalid::TooLarge {
                op: "SEND",
                len: src.len,
                limit: self.cfg.max_send_size,
                setting: "CudaIpcConfig::max_send_size",
            }
            .into());
        }
        let mem = self.local_slice(src)?.mem.clone();
        self.live_peer(peer)?;
        if self.outstanding >= self.cfg.max_outstanding {
            return Ok(PostOutcome::NoRoom);
        }
        let mut bytes = vec![0u8; src.len as usize];
        mem.read_to_host(src.offset, &mut bytes)?;
        let p = self.live_peer(peer)?;
        p.sends.push_back((wr_id, src.len));
        let conn = p.conn;
        let Some(c) = conn
            .and_then(|i| self.conns.get_mut(i))
            .and_then(Option::as_mut)
        else {
            return Err(Error::UnknownPeer(peer));
        };
        let mut h = Header::new(Op::Send, wr_id.0, 0, src.len);
        h.imm = imm;
        // Held until the target has proved itself: no byte of ours goes to a peer that has
        // not.
        let out = if c.hs.is_done() {
            c.io.out()
        } else {
            &mut c.held
        };
        h.encode(out);
        out.extend_from_slice(&bytes);
        self.outstanding += 1;
        Ok(PostOutcome::Posted)
    }

    fn post_recv(&mut self, wr_id: WorkRequestId, dst: LocalSlice) -> Result<PostOutcome> {
        let r = self.local_slice(dst)?;
        if !r.access.contains(Access::LOCAL_WRITE) {
            return Err(Error::Op(OpError::PermissionDenied));
        }
        let recv = fabric_core::recv::PostedRecv {
            wr_id,
            mem: r.mem.clone(),
            offset: dst.offset,
            cap: dst.len,
        };
        self.recv.post(recv, &mut self.done);
        // A SEND held back for room may go on now (it is handled again).
        for c in self.conns.iter_mut().flatten() {
            c.paused = false;
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
        fabric_core::check_write_lengths(&src, &dst)?;
        self.queue_write(peer, wr_id, src, dst, None, imm)
    }

    fn post_write_rows(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        rows: Rows,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        fabric_core::check_write_lengths(&src, &dst)?;
        self.queue_write(peer, wr_id, src, dst, Some(rows), imm)
    }

    fn post_read(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        dst: LocalSlice,
        src: RemoteSlice,
    ) -> Result<PostOutcome> {
        fabric_core::check_read_lengths(&dst, &src)?;
        if dst.len > self.cfg.max_msg_size {
            return Err(fabric_core::Invalid::TooLarge {
                op: "READ",
                len: dst.len,
                limit: self.cfg.max_msg_size,
                setting: "CudaIpcConfig::max_msg_size",
            }
            .into());
        }
        let r = self.local_slice(dst)?;
        if !r.access.contains(Access::LOCAL_WRITE) {
            return Err(fabric_core::Invalid::NotLocallyWritable {
                what: "a READ".into(),
            }
            .into());
        }
        let mem = r.mem.clone();
        self.live_peer(peer)?;
        if self.outstanding >= self.cfg.max_outstanding {
            return Ok(PostOutcome::NoRoom);
        }
        self.live_peer(peer)?.pending.push_back(WriteOp {
            wr: wr_id,
            src: mem,
            src_off: dst.offset,
            key: src.region.key.0,
            off: src.offset,
            len: src.len,
            imm: None,
            read: true,
            rows: 1,
            src_stride: 0,
            dst_stride: 0,
        });
        self.outstanding += 1;
        Ok(PostOutcome::Posted)
    }

    fn supports_read(&self) -> bool {
        true
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        self.accept();
        for idx in 0..self.conns.len() {
            self.service(idx);
        }
        if !self.copying.is_empty() {
            let r = self.link.completed();
            self.retire_copies(r);
        }
        self.reserve();
        let mut gone = Vec::new();
        for (i, c) in self.conns.iter_mut().enumerate() {
            if let Some(c) = c
                && let Err(why) = c.io.flush()
            {
                gone.push((i, why));
            }
        }
        for (i, why) in gone {
            let why = fabric_core::error::report(&why);
            self.close_conn(i, |peer| OpError::PeerUnreachable {
                peer,
                reason: format!("{why} (did its process exit?)"),
            });
        }
        self.expire(Instant::now());
        let n = self.done.len();
        out.append(&mut self.done);
        Ok(n)
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        if !self.done.is_empty() {
            return Ok(());
        }
        if !self.copying.is_empty() {
            // Copies finish on the GPU, which has no file descriptor to sleep on.
            std::thread::yield_now();
            return Ok(());
        }
        self.pollfds.clear();
        self.pollfds.push(libc::pollfd {
            fd: self.wake.fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        self.pollfds.push(libc::pollfd {
            fd: self.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for c in self.conns.iter().flatten() {
            let mut events = 0;
            if !c.paused {
                events |= libc::POLLIN;
            }
            if c.io.has_output() {
                events |= libc::POLLOUT;
            }
            self.pollfds.push(libc::pollfd {
                fd: c.io.stream.as_raw_fd(),
                events,
                revents: 0,
            });
        }
        // Exactly the time asked for (at most a second): the engine wakes us when it has
        // work, peers' frames through their sockets.
        let left = timeout.min(Duration::from_secs(1));
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        // SAFETY: pollfds is a valid, exclusively borrowed array of pollfd of this length;
        // ts is a valid timespec; a null signal mask leaves the mask unchanged.
        let r = unsafe {
            libc::ppoll(
                self.pollfds.as_mut_ptr(),
                self.pollfds.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::io("poll", e));
            }
        }
        if self.pollfds[0].revents != 0 {
            self.wake.drain();
        }
        Ok(())
    }

    fn waker(&mut self) -> Arc<dyn fabric_core::wake::Wake> {
        self.wake.waker()
    }
}

impl<L: Link> CudaIpcTransport<L> {
    /// Queues a WRITE (of `rows`, when strided) for the peer's next reservation, after
    /// checking its sizes and its local span.
    fn queue_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        rows: Option<Rows>,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        let (count, src_stride, dst_stride, src_span, bytes) = match rows {
            None => (1, 0, 0, src.len, src.len),
            Some(r) => {
                let (src_span, _, bytes) = r.check(src.len)?;
                (r.count, r.src_stride, r.dst_stride, src_span, bytes)
            }
        };
        if bytes > self.cfg.max_msg_size {
            return Err(fabric_core::Invalid::TooLarge {
                op: "WRITE",
                len: bytes,
                limit: self.cfg.max_msg_size,
                setting: "CudaIpcConfig::max_msg_size",
            }
            .into());
        }
        let mem = self
            .local_slice(LocalSlice {
                len: src_span,
                ..src
            })?
            .mem
            .clone();
        self.live_peer(peer)?;
        if self.outstanding >= self.cfg.max_outstanding {
            return Ok(PostOutcome::NoRoom);
        }
        self.live_peer(peer)?.pending.push_back(WriteOp {
            wr: wr_id,
            src: mem,
            src_off: src.offset,
            key: dst.region.key.0,
            off: dst.offset,
            len: dst.len,
            imm,
            read: false,
            rows: count,
            src_stride,
            dst_stride,
        });
        self.outstanding += 1;
        Ok(PostOutcome::Posted)
    }
}
