//! CUDA IPC: device memory shared between processes of one host.
//!
//! The exporting process turns a registered device region into an [`IpcExport`] (a 64-byte
//! [`IpcHandle`] of the allocation that contains it, and the region's place inside that
//! allocation) and sends the handle to a peer over any channel. The peer opens it once with
//! [`Device::open_ipc`] (an [`IpcMapping`], shared and reference-counted per process and
//! device, closed when the last user drops it) and copies into it with [`PeerCopies`]:
//! device-to-device copies queued on a stream (over NVLink between GPUs that have it), as
//! one launch of a copy kernel per submit (or one `cuMemcpyBatchAsync`, or plain copies:
//! see [`CopyMethod`]), completed by events.
//!
//! A handle exported by this very process is not opened again (the driver refuses that):
//! it is found in a process-wide table of exports and mapped onto the exporting region
//! itself, which the mapping then keeps alive. A handle received from a peer is looked up
//! there only when the peer is provably this process ([`SameProcess`], the kernel's word on
//! a Unix socket's other end): [`Device::open_peer_ipc`]. Were a peer's handle resolved
//! through our own exports, a hostile peer could send the handle of one of *our*
//! allocations and aim our copies into our own memory; from another process, such a handle
//! goes to the driver, which refuses to open a handle of the process that opens it.
//!
//! What CUDA IPC cannot restrict: a handle opens the whole allocation that contains the
//! exported region (for a PyTorch tensor, the caching allocator's segment, with other
//! tensors in it), for reading and writing alike. An exporter cannot give a peer less; it
//! can only decide whom to give the handle (see the transport's own checks).

use crate::copies::{CopyMethod, RangeCopies};
use crate::device::Device;
use crate::error::{CopyDirection, GpuMemError, check, check_call};
use crate::range::check_range;
use crate::stream::new_nonblocking_stream;
use cudarc::driver::sys;
use fabric_core::{MemoryLocation, MemoryRegion};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// The opaque handle of a device allocation, valid for other processes on the same host.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle([u8; IPC_HANDLE_LEN]);

impl IpcHandle {
    /// A handle from its bytes (as received from a peer; nothing is checked until it is
    /// opened).
    pub fn from_bytes(bytes: [u8; IPC_HANDLE_LEN]) -> IpcHandle {
        IpcHandle(bytes)
    }

    /// The handle's bytes, to send to a peer.
    pub fn as_bytes(&self) -> &[u8; IPC_HANDLE_LEN] {
        &self.0
    }

    fn to_sys(self) -> sys::CUipcMemHandle {
        sys::CUipcMemHandle {
            reserved: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcHandle({}..)", hex::encode(&self.0[..8]))
    }
}

/// One allocation exported by this process.
struct ExportEntry {
    /// The exporting device.
    device: Device,
    /// Device address of the allocation's first byte.
    base: u64,
    /// Bytes of the allocation.
    size: u64,
    /// Live [`IpcExport`]s of it, each with the region it was made from (any of them keeps
    /// the allocation alive for a same-process mapping).
    regions: Vec<(u64, Arc<dyn MemoryRegion>)>,
}

/// One peer allocation opened by this process on one device.
struct OpenEntry {
    base: u64,
    size: u64,
    users: usize,
}

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    // The tables stay consistent across a panic (every update is a single insert or
    // remove), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn exports() -> &'static Mutex<HashMap<IpcHandle, ExportEntry>> {
    static T: OnceLock<Mutex<HashMap<IpcHandle, ExportEntry>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn opened() -> &'static Mutex<HashMap<(u32, IpcHandle), OpenEntry>> {
    static T: OnceLock<Mutex<HashMap<(u32, IpcHandle), OpenEntry>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn next_export_id() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A device region made reachable for other processes on this host. Dropping it withdraws
/// it from this process's table (peers that opened the handle keep their mapping until
/// they close it: withdraw access with your own protocol first).
pub struct IpcExport {
    handle: IpcHandle,
    offset: u64,
    len: u64,
    alloc_len: u64,
    id: u64,
}

impl IpcExport {
    /// The handle of the allocation that contains the region.
    pub fn handle(&self) -> IpcHandle {
        self.handle
    }

    /// Where the region starts inside the allocation.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The region's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the whole allocation.
    pub fn alloc_len(&self) -> u64 {
        self.alloc_len
    }
}

impl std::fmt::Debug for IpcExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcExport")
            .field("handle", &self.handle)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for IpcExport {
    fn drop(&mut self) {
        let mut table = lock(exports());
        if let Some(e) = table.get_mut(&self.handle) {
            e.regions.retain(|(id, _)| *id != self.id);
            if e.regions.is_empty() {
                table.remove(&self.handle);
            }
        }
    }
}

/// The kernel's word that the other end of a Unix socket is this very process: its
/// `SO_PEERCRED` pid (the pid of the process that made the listening or connecting socket,
/// as the kernel recorded it, translated into our pid namespace) is ours. The one case in
/// which [`Device::open_peer_ipc`] resolves a received handle through this process's own
/// exports. Not `Clone`: each connection is checked on its own.
#[derive(Debug)]
pub struct SameProcess(());

impl SameProcess {
    /// Asks the kernel who is at the other end of the connected Unix socket `socket`:
    /// `Some` when it is this process, `None` for any other (or one the kernel cannot name
    /// in our pid namespace).
    pub fn of_unix_peer(socket: &impl std::os::fd::AsFd) -> std::io::Result<Option<SameProcess>> {
        use std::os::fd::AsRawFd;
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: the descriptor is borrowed live for the call; cred and len are valid
        // out-pointers of the size given.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_fd().as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&raw mut cred).cast::<c_void>(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ours = i32::try_from(std::process::id()).is_ok_and(|p| p == cred.pid);
        Ok((cred.pid > 0 && ours).then_some(SameProcess(())))
    }
}

/// A peer's allocation as this process reaches it.
pub struct IpcMapping {
    device: Device,
    handle: IpcHandle,
    base: u64,
    size: u64,
    /// `Some` when the handle was exported by this process: the exporting region, kept
    /// alive so the memory stays valid while the mapping exists.
    local: Option<Arc<dyn MemoryRegion>>,
    /// Whether kernels of `device` can write the memory directly (same device, or peer
    /// access enabled); if not, copies into it go through `cuMemcpyAsync`.
    direct: bool,
}

impl IpcMapping {
    /// Bytes of the mapped allocation (as the driver reports it, not as the peer claims).
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// Whether the handle came from this process (no driver mapping was opened).
    pub fn is_local(&self) -> bool {
        self.local.is_some()
    }

    /// The handle this mapping opened.
    pub fn handle(&self) -> IpcHandle {
        self.handle
    }
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("device", &self.device.ordinal())
            .field("handle", &self.handle)
            .field("len", &self.size)
            .field("local", &self.is_local())
            .finish()
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.local.is_some() {
            return;
        }
        let mut table = lock(opened());
        let key = (self.device.ordinal(), self.handle);
        let last = match table.get_mut(&key) {
            Some(e) => {
                e.users -= 1;
                e.users == 0
            }
            None => false,
        };
        if last {
            table.remove(&key);
            if self.device.bind().is_ok() {
                // SAFETY: base was returned by cuIpcOpenMemHandle on this device's context
                // and is closed once, by its last user; PeerCopies holds an Arc of the
                // mapping until its copies are complete, so none is in flight.
                let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
            }
        }
    }
}

impl Device {
    /// Exports `region` (device memory of this device) for other processes on this host.
    pub fn export_ipc(&self, region: &Arc<dyn MemoryRegion>) -> Result<IpcExport, GpuMemError> {
        match region.location() {
            MemoryLocation::Cuda { device } if device == self.ordinal() => {}
            other => {
                return Err(GpuMemError::WrongMemory(format!(
                    "CUDA IPC exports device memory of CUDA device {}, not {other:?}",
                    self.ordinal()
                )));
            }
        }
        self.bind()?;
        let addr = region.device_addr();
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        check_call(
            // SAFETY: out-pointers are valid; the context is current; a bad address returns
            // an error.
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) },
            "cuMemGetAddressRange",
        )?;
        let offset = addr - base;
        check_range(offset, region.len() as u64, size as u64)?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        check_call(
            // SAFETY: raw is a valid out-pointer; base is the start of a live allocation
            // of this context (just looked up), which is current.
            unsafe { sys::cuIpcGetMemHandle(&mut raw, base) },
            "cuIpcGetMemHandle",
        )?;
        let handle = IpcHandle(raw.reserved.map(|c| c as u8));
        let id = next_export_id();
        lock(exports())
            .entry(handle)
            .or_insert_with(|| ExportEntry {
                device: self.clone(),
                base,
                size: size as u64,
                regions: Vec::new(),
            })
            .regions
            .push((id, region.clone()));
        Ok(IpcExport {
            handle,
            offset,
            len: region.len() as u64,
            alloc_len: size as u64,
            id,
        })
    }

    /// Opens a handle this process trusts on this device: one of its own exports (mapped
    /// onto the exporting region), else through the driver (once per process and device:
    /// later calls share the mapping). Fails with [`GpuMemError::IpcOpen`] for a stale or
    /// foreign handle.
    ///
    /// Never for a handle a peer sent: a hostile peer could send one of this process's own
    /// handles and so aim its copies into its own memory. Use [`Device::open_peer_ipc`].
    pub fn open_ipc(&self, handle: &IpcHandle) -> Result<Arc<IpcMapping>, GpuMemError> {
        match self.open_own(handle)? {
            Some(m) => Ok(m),
            None => self.open_foreign(handle),
        }
    }

    /// Opens a handle that a peer sent: through this process's own exports only when
    /// `same_process` proves the peer is this process (a handle it names must then be a
    /// live export: else [`GpuMemError::NotOurExport`]), and otherwise through the driver
    /// alone, which refuses handles of the process that opens them
    /// ([`GpuMemError::IpcOpen`]). So a peer cannot make this process copy into its own
    /// allocations by sending their handles.
    pub fn open_peer_ipc(
        &self,
        handle: &IpcHandle,
        same_process: Option<&SameProcess>,
    ) -> Result<Arc<IpcMapping>, GpuMemError> {
        match same_process {
            Some(_) => self.open_own(handle)?.ok_or(GpuMemError::NotOurExport),
            None => self.open_foreign(handle),
        }
    }

    /// A handle of this process's own exports, mapped onto the exporting region.
    fn open_own(&self, handle: &IpcHandle) -> Result<Option<Arc<IpcMapping>>, GpuMemError> {
        let local = lock(exports()).get(handle).and_then(|e| {
            let (_, region) = e.regions.first()?;
            Some((e.device.clone(), e.base, e.size, region.clone()))
        });
        let Some((owner, base, size, region)) = local else {
            return Ok(None);
        };
        enable_peer_access(self, &owner)?;
        let direct = owner.ordinal() == self.ordinal() || can_access_peer(self, &owner)?;
        Ok(Some(Arc::new(IpcMapping {
            device: self.clone(),
            handle: *handle,
            base,
            size,
            local: Some(region),
            direct,
        })))
    }

    /// Another process's handle, opened through the driver (shared per device).
    fn open_foreign(&self, handle: &IpcHandle) -> Result<Arc<IpcMapping>, GpuMemError> {
        let mut table = lock(opened());
        let key = (self.ordinal(), *handle);
        if let Some(e) = table.get_mut(&key) {
            e.users += 1;
            return Ok(Arc::new(IpcMapping {
                device: self.clone(),
                handle: *handle,
                base: e.base,
                size: e.size,
                local: None,
                direct: true,
            }));
        }
        self.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        check(
            // SAFETY: base is a valid out-pointer; the context is current; the driver
            // validates the handle and fails for a stale or foreign one.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut base,
                    handle.to_sys(),
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            |source| GpuMemError::IpcOpen {
                device: self.ordinal(),
                source,
            },
        )?;
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: out-pointers are valid; base is a live mapping of this context.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) };
        if let Err(e) = check_call(r, "cuMemGetAddressRange") {
            // SAFETY: base was opened just above and nobody else knows it.
            unsafe { sys::cuIpcCloseMemHandle(base) };
            return Err(e);
        }
        table.insert(
            key,
            OpenEntry {
                base,
                size: size as u64,
                users: 1,
            },
        );
        Ok(Arc::new(IpcMapping {
            device: self.clone(),
            handle: *handle,
            base,
            size: size as u64,
            local: None,
            // cuIpcOpenMemHandle maps it into this context (peer access enabled lazily).
            direct: true,
        }))
    }
}

/// How many peers' allocations this process has open through `cuIpcOpenMemHandle` (all
/// devices): a check that mappings are closed when their users go.
pub fn open_ipc_mappings() -> usize {
    lock(opened()).len()
}

/// Makes memory of `to` reachable from `from`'s context (peer access), where the devices
/// differ and allow it; without it the driver stages cross-device copies through the host.
pub fn enable_peer_access(from: &Device, to: &Device) -> Result<(), GpuMemError> {
    if from.ordinal() == to.ordinal() || !can_access_peer(from, to)? {
        return Ok(());
    }
    from.bind()?;
    // SAFETY: both contexts are live (held by the Devices); the current one is `from`'s.
    match unsafe { sys::cuCtxEnablePeerAccess(to.inner.ctx.cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        other => check_call(other, "cuCtxEnablePeerAccess"),
    }
}

/// Asynchronous copies from local memory into peers' [`IpcMapping`]s (and, with
/// [`pull`](Self::pull), from them into local memory), on one stream of one device.
///
/// [`push`](Self::push) checks and queues a copy; [`submit`](Self::submit) starts what was
/// queued (one launch of the copy kernel, or see [`CopyMethod`]) and returns a ticket;
/// [`completed`](Self::completed) says, without waiting, the highest ticket whose copies
/// have all finished. Sources and mappings stay alive until then. Dropping the value waits
/// for its copies.
pub struct PeerCopies {
    copies: RangeCopies,
}

impl PeerCopies {
    /// A stream for copies issued from `device` (the device whose memory is the source),
    /// with the best [`CopyMethod`] that works here ([`PeerCopies::with_method`] forces one).
    pub fn new(device: &Device) -> Result<PeerCopies, GpuMemError> {
        Ok(PeerCopies {
            copies: RangeCopies::new(device)?,
        })
    }

    /// A stream for copies issued from `device` with `method`; fails when this machine
    /// cannot do it (the kernel does not load, or the driver has no batched copy).
    pub fn with_method(device: &Device, method: CopyMethod) -> Result<PeerCopies, GpuMemError> {
        Ok(PeerCopies {
            copies: RangeCopies::with_method(device, method)?,
        })
    }

    /// How batches are issued.
    pub fn method(&self) -> CopyMethod {
        self.copies.method()
    }

    /// Why the copy kernel is not used, when it is not.
    pub fn method_note(&self) -> Option<&str> {
        self.copies.note()
    }

    /// How finished batches are learnt: `"word"` (the stream writes a word of host memory
    /// that polling reads, no driver call) or `"event"` (a CUDA event per batch, queried).
    pub fn completion(&self) -> &'static str {
        self.copies.completion()
    }

    /// Whether a batch is one driver call (kernel launch or batched copy).
    pub fn batched(&self) -> bool {
        self.copies.method() != CopyMethod::Memcpy
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` into `dst` at `dst_offset`
    /// (an offset in the peer's allocation). Both ranges are checked. Device sources are
    /// copied at [`submit`](Self::submit); host sources (pageable memory) are copied now, so
    /// the caller may reuse them once this returns.
    pub fn push(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        dst: &Arc<IpcMapping>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), GpuMemError> {
        check_range(src_offset, len, src.len() as u64)?;
        check_range(dst_offset, len, dst.size)?;
        if len == 0 {
            return Ok(());
        }
        let to = dst.base + dst_offset;
        match (src.location(), src.host_ptr()) {
            (MemoryLocation::Cuda { device }, _) => {
                // The copy kernel reads only this device's memory and writes only mappings
                // its kernels can reach; cuMemcpyAsync moves the rest.
                let kernel_ok = device == self.copies.device().ordinal() && dst.direct;
                self.copies
                    .queue(to, src.device_addr() + src_offset, len, kernel_ok);
            }
            (MemoryLocation::Host, Some(p)) => {
                self.copies.device().bind()?;
                check(
                    // SAFETY: p + src_offset .. + len lies in the live host region (checked
                    // above; host_ptr is valid per MemoryRegion's contract); the
                    // destination lies in the mapped allocation (checked above), kept alive
                    // until the copy's event completes; the context is current.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            to,
                            p.as_ptr().add(src_offset as usize).cast::<c_void>(),
                            len as usize,
                            self.copies.stream(),
                        )
                    },
                    |source| GpuMemError::Copy {
                        direction: CopyDirection::HostToDevice,
                        len,
                        source,
                    },
                )?;
            }
            (MemoryLocation::Host, None) => {
                return Err(GpuMemError::WrongMemory(
                    "host region without a host pointer".into(),
                ));
            }
        }
        self.copies.keep(src);
        self.copies.keep(dst);
        Ok(())
    }

    /// Queues the copies of a strided write: `rows` rows of `len` bytes, row `i` from `src`
    /// at `src_at.0 + i * src_at.1` into `dst` at `dst_at.0 + i * dst_at.1` (offset and
    /// stride on each side). The spans are checked once, not per row; device sources go
    /// into the batch's copy list (the kernel moves every row in the same launch), host
    /// sources row by row as [`push`](Self::push) copies them.
    pub fn push_rows(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        (src_offset, src_stride): (u64, u64),
        dst: &Arc<IpcMapping>,
        (dst_offset, dst_stride): (u64, u64),
        len: u64,
        rows: u64,
    ) -> Result<(), GpuMemError> {
        if rows == 0 || len == 0 {
            return Ok(());
        }
        let span = |stride: u64| {
            (rows - 1)
                .checked_mul(stride)
                .and_then(|v| v.checked_add(len))
                .ok_or(GpuMemError::OutOfBounds {
                    offset: src_offset,
                    len: u64::MAX,
                    size: src.len() as u64,
                })
        };
        check_range(src_offset, span(src_stride)?, src.len() as u64)?;
        check_range(dst_offset, span(dst_stride)?, dst.size)?;
        match src.location() {
            MemoryLocation::Cuda { device } => {
                let kernel_ok = device == self.copies.device().ordinal() && dst.direct;
                let (from, to) = (src.device_addr() + src_offset, dst.base + dst_offset);
                self.copies
                    .queue_rows((to, dst_stride), (from, src_stride), len, rows, kernel_ok);
                self.copies.keep(src);
                self.copies.keep(dst);
                Ok(())
            }
            MemoryLocation::Host => {
                for i in 0..rows {
                    self.push(
                        src,
                        src_offset + i * src_stride,
                        dst,
                        dst_offset + i * dst_stride,
                        len,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// Queues a copy of `len` bytes the other way: from the peer's allocation `src` at
    /// `src_offset` into local memory `dst` at `dst_offset` (a one-sided READ). Both ranges
    /// are checked. `dst` must not be touched by the caller until the copy's ticket has
    /// completed (device destinations are copied at [`submit`](Self::submit), host ones, in
    /// pageable memory, at once); it is kept alive until then.
    pub fn pull(
        &mut self,
        src: &Arc<IpcMapping>,
        src_offset: u64,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), GpuMemError> {
        check_range(src_offset, len, src.size)?;
        check_range(dst_offset, len, dst.len() as u64)?;
        if len == 0 {
            return Ok(());
        }
        let from = src.base + src_offset;
        match (dst.location(), dst.host_ptr()) {
            // The copy kernel, as for pushes the other way: it reads the mapping (which this
            // device's kernels reach when peer access is direct) and writes this device's
            // memory, a batch of pages in one launch; cuMemcpyAsync moves the rest.
            (MemoryLocation::Cuda { device }, _) => {
                let kernel_ok = device == self.copies.device().ordinal() && src.direct;
                self.copies
                    .queue(dst.device_addr() + dst_offset, from, len, kernel_ok);
            }
            (MemoryLocation::Host, Some(p)) => {
                self.copies.device().bind()?;
                check(
                    // SAFETY: p + dst_offset .. + len lies in the live host region (checked
                    // above; host_ptr is valid per MemoryRegion's contract, and the caller
                    // leaves it alone until the ticket completes); the source lies in the
                    // mapped allocation (checked above), kept alive until the copy's event
                    // completes; the context is current.
                    unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            p.as_ptr().add(dst_offset as usize).cast::<c_void>(),
                            from,
                            len as usize,
                            self.copies.stream(),
                        )
                    },
                    |source| GpuMemError::Copy {
                        direction: CopyDirection::DeviceToHost,
                        len,
                        source,
                    },
                )?;
            }
            (MemoryLocation::Host, None) => {
                return Err(GpuMemError::WrongMemory(
                    "host region without a host pointer".into(),
                ));
            }
        }
        self.copies.keep(src);
        self.copies.keep(dst);
        Ok(())
    }

    /// Starts every queued copy and returns the ticket that [`completed`](Self::completed)
    /// reports once they have all finished. On error none of the queued copies may be
    /// assumed done (nor assumed not done).
    pub fn submit(&mut self) -> Result<u64, GpuMemError> {
        let len = self.copies.queued_bytes();
        self.copies.submit().map_err(|e| match e {
            GpuMemError::Driver { source, .. } => GpuMemError::Copy {
                direction: CopyDirection::DeviceToDevice,
                len,
                source,
            },
            other => other,
        })
    }

    /// The highest ticket whose copies have all finished (0 before any), without waiting.
    /// An error means a copy failed on the device: treat every ticket not yet reported as
    /// failed.
    pub fn completed(&mut self) -> Result<u64, GpuMemError> {
        self.copies.completed()
    }

    /// Tickets submitted and not yet seen complete.
    pub fn in_flight(&self) -> usize {
        self.copies.in_flight()
    }

    /// Waits for every submitted copy.
    pub fn synchronize(&mut self) -> Result<u64, GpuMemError> {
        self.copies.synchronize()
    }
}

/// Whether the calling process can reach memory of device `to` from device `from` directly
/// (peer access, over NVLink or PCIe): `true` for the same device.
pub fn can_access_peer(from: &Device, to: &Device) -> Result<bool, GpuMemError> {
    if from.ordinal() == to.ordinal() {
        return Ok(true);
    }
    from.bind()?;
    let mut yes = 0;
    check_call(
        // SAFETY: yes is a valid out-pointer; both handles name existing devices (they are
        // open Devices).
        unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut yes,
                from.inner.ctx.cu_device(),
                to.inner.ctx.cu_device(),
            )
        },
        "cuDeviceCanAccessPeer",
    )?;
    Ok(yes != 0)
}

/// The reference for device-to-device speed: `total` bytes copied from a buffer on `from`
/// to a buffer on `to` with plain `cuMemcpyAsync` calls of `chunk` bytes each, on one stream,
/// timed from the first call to the end of the last copy. Returns Gbit/s.
pub fn plain_copy_gbps(
    from: &Device,
    to: &Device,
    chunk: usize,
    total: u64,
) -> Result<f64, GpuMemError> {
    let src = crate::DeviceBuffer::new(from, chunk)?;
    let dst = crate::DeviceBuffer::new(to, chunk)?;
    enable_peer_access(from, to)?;
    from.bind()?;
    let stream = new_nonblocking_stream()?;
    let run = |n: u64| -> Result<std::time::Duration, GpuMemError> {
        let start = std::time::Instant::now();
        for _ in 0..n {
            check(
                // SAFETY: both buffers are live allocations of `chunk` bytes (owned here);
                // the stream belongs to the current context.
                unsafe { sys::cuMemcpyAsync(dst.device_addr(), src.device_addr(), chunk, stream) },
                |source| GpuMemError::Copy {
                    direction: CopyDirection::DeviceToDevice,
                    len: chunk as u64,
                    source,
                },
            )?;
        }
        check_call(
            // SAFETY: the stream is live and belongs to the current context.
            unsafe { sys::cuStreamSynchronize(stream) },
            "cuStreamSynchronize",
        )?;
        Ok(start.elapsed())
    };
    // One warm-up copy (peer mappings, clocks), then the timed ones.
    let result = run(1).and_then(|_| run(total.div_ceil(chunk as u64).max(1)));
    // SAFETY: the stream was synchronised (or a call failed); it is destroyed once.
    unsafe { sys::cuStreamDestroy_v2(stream) };
    let took = result?;
    let bytes = total.div_ceil(chunk as u64).max(1) * chunk as u64;
    Ok(bytes as f64 * 8.0 / took.as_secs_f64() / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_their_bytes_and_print_briefly() {
        let mut b = [0u8; IPC_HANDLE_LEN];
        b[0] = 0xab;
        b[63] = 7;
        let h = IpcHandle::from_bytes(b);
        assert_eq!(h.as_bytes(), &b);
        assert_eq!(format!("{h:?}"), "IpcHandle(ab00000000000000..)");
        let s = h.to_sys();
        assert_eq!(s.reserved[0] as u8, 0xab);
        assert_eq!(s.reserved[63] as u8, 7);
    }

    /// Both ends of a socket pair are this process: the kernel says so. (Another process's
    /// end is refused in transport-cuda-ipc's hostile tests, with a child process.)
    #[test]
    fn a_socket_of_this_process_is_the_same_process() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(SameProcess::of_unix_peer(&a).unwrap().is_some());
        assert!(SameProcess::of_unix_peer(&b).unwrap().is_some());
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(SameProcess::of_unix_peer(&file).is_err(), "not a socket");
    }
}
