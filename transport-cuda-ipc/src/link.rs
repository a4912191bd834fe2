//! The data path under the protocol: how a region is exported, how a peer's export is
//! opened, and how bytes are copied into it.
//!
//! [`CudaLink`] is the real one (CUDA IPC handles and device-to-device copies on a stream).
//! [`LoopbackLink`] moves host memory between transports of one process with plain copies:
//! it runs the whole protocol (reservations, grants, revocation, completions, faults) on
//! machines without a GPU, which is how CI tests it.

use fabric_core::{MemoryLocation, MemoryRegion};
use gpu_mem::{Cuda, Device, IpcExport, IpcHandle, IpcMapping, PeerCopies, SameProcess};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Why a [`Link`] could not export, open or copy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// The link cannot reach memory of this kind (host memory on the CUDA link).
    #[error("{0}")]
    Unsupported(&'static str),
    /// No region of this process is exported under the handle (never, or no longer).
    #[error("unknown or stale handle")]
    StaleHandle,
    /// The loopback link was handed a handle by a peer that is not this process: its
    /// handles name memory of this process only.
    #[error("a loopback handle from another process")]
    OtherProcess,
    /// The peer's region does not fit in the allocation its handle maps.
    #[error("the peer's region ({len} bytes at {offset}) exceeds its {mapped}-byte allocation")]
    BeyondMapping {
        /// The region's offset in the allocation.
        offset: u64,
        /// The region's length.
        len: u64,
        /// What the handle maps.
        mapped: u64,
    },
    /// The GPU layer failed (its source is the CUDA driver's error, with its code: a
    /// sticky fault says so through `GpuMemError::is_sticky`).
    #[error(transparent)]
    Device(#[from] gpu_mem::GpuMemError),
    /// A copy of the loopback link failed, or a range lay outside its region.
    #[error(transparent)]
    Memory(#[from] fabric_core::MemoryError),
}

impl From<LinkError> for fabric_core::Error {
    fn from(e: LinkError) -> fabric_core::Error {
        match e {
            LinkError::Unsupported(why) => fabric_core::Error::Unsupported(why.into()),
            LinkError::Memory(m) => fabric_core::Error::Memory(m),
            LinkError::Device(g) => fabric_core::Error::Memory(fabric_core::MemoryError::device(g)),
            other => fabric_core::Error::Backend {
                call: "cuda-ipc link",
                message: other.to_string(),
                source: Some(Arc::new(other)),
            },
        }
    }
}

/// An exported region, as the link reports it.
pub struct LinkExport {
    /// The 64-byte handle peers open.
    pub handle: [u8; 64],
    /// Where the region starts in what the handle maps.
    pub offset: u64,
    /// Keeps the export alive; dropping it withdraws the export.
    pub guard: Box<dyn Send + Sync>,
}

/// The data path of a [`CudaIpcTransport`](crate::CudaIpcTransport).
pub trait Link: Send + 'static {
    /// A peer's export, opened.
    type Mapping: Send + Sync + 'static;

    /// A name for logs and `xfer info`.
    fn name(&self) -> &'static str;

    /// The device ordinal this link copies from (its address names it).
    fn device(&self) -> u32;

    /// Exports a region peers may write; errors say why it cannot be.
    fn export(&mut self, mem: &Arc<dyn MemoryRegion>) -> Result<LinkExport, LinkError>;

    /// Opens a handle the peer sent. `same_process` is the kernel's word that the peer is
    /// this very process; only then may the handle be resolved through this process's own
    /// exports (else a hostile peer could aim our copies into our own memory).
    fn open(
        &mut self,
        handle: &[u8; 64],
        same_process: Option<&SameProcess>,
    ) -> Result<Arc<Self::Mapping>, LinkError>;

    /// Bytes the mapping covers.
    fn mapping_len(mapping: &Self::Mapping) -> u64;

    /// Queues a copy (both ranges checked).
    fn push(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        dst: &Arc<Self::Mapping>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), LinkError>;

    /// Queues the copies of a strided write: `rows` rows of `len` bytes, row `i` from
    /// `src` at `src.0 + i * src.1` into `dst` at `dst.0 + i * dst.1` (offset and stride on
    /// each side). Both spans are checked. The default queues each row with
    /// [`push`](Self::push).
    fn push_rows(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        (src_offset, src_stride): (u64, u64),
        dst: &Arc<Self::Mapping>,
        (dst_offset, dst_stride): (u64, u64),
        len: u64,
        rows: u64,
    ) -> Result<(), LinkError> {
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

    /// Queues a copy the other way, for a READ: `len` bytes of the peer's mapping `src` at
    /// `src_offset` into local memory `dst` at `dst_offset`; both ranges are checked. `dst`
    /// is written until the ticket of the next [`submit`](Self::submit) completes.
    fn pull(
        &mut self,
        src: &Arc<Self::Mapping>,
        src_offset: u64,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), LinkError>;

    /// Starts what was queued; returns its ticket.
    fn submit(&mut self) -> Result<u64, LinkError>;

    /// The highest ticket whose copies have finished, without waiting.
    fn completed(&mut self) -> Result<u64, LinkError>;

    /// Waits for every submitted copy; returns the last ticket.
    fn synchronize(&mut self) -> Result<u64, LinkError>;

    /// Whether a batch is one driver call.
    fn batched(&self) -> bool {
        false
    }

    /// How copies are made, for logs and `xfer info`.
    fn copy_method(&self) -> String {
        "cpu".into()
    }
}

/// CUDA IPC: device memory exported with `cuIpcGetMemHandle`, copies on a stream of the
/// transport's device.
pub struct CudaLink {
    device: Device,
    copies: PeerCopies,
}

impl CudaLink {
    /// A link on device `ordinal`, its copies issued with `method` (the best that works
    /// here when `None`).
    pub fn new(
        cuda: &Cuda,
        ordinal: u32,
        method: Option<gpu_mem::CopyMethod>,
    ) -> Result<CudaLink, gpu_mem::GpuMemError> {
        let device = cuda.device(ordinal)?;
        let copies = match method {
            Some(m) => PeerCopies::with_method(&device, m)?,
            None => PeerCopies::new(&device)?,
        };
        Ok(CudaLink { device, copies })
    }
}

impl Link for CudaLink {
    type Mapping = IpcMapping;

    fn name(&self) -> &'static str {
        "cuda-ipc"
    }

    fn device(&self) -> u32 {
        self.device.ordinal()
    }

    fn export(&mut self, mem: &Arc<dyn MemoryRegion>) -> Result<LinkExport, LinkError> {
        if mem.location() == MemoryLocation::Host {
            return Err(LinkError::Unsupported(
                "the cuda-ipc transport reaches only device memory: register host \
                 memory that peers write or read on the tcp transport",
            ));
        }
        let x: IpcExport = self.device.export_ipc(mem).map_err(LinkError::from)?;
        Ok(LinkExport {
            handle: *x.handle().as_bytes(),
            offset: x.offset(),
            guard: Box::new(x),
        })
    }

    fn open(
        &mut self,
        handle: &[u8; 64],
        same_process: Option<&SameProcess>,
    ) -> Result<Arc<IpcMapping>, LinkError> {
        self.device
            .open_peer_ipc(&IpcHandle::from_bytes(*handle), same_process)
            .map_err(LinkError::from)
    }

    fn mapping_len(mapping: &IpcMapping) -> u64 {
        mapping.len()
    }

    fn push(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        dst: &Arc<IpcMapping>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), LinkError> {
        self.copies
            .push(src, src_offset, dst, dst_offset, len)
            .map_err(LinkError::from)
    }

    fn push_rows(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_at: (u64, u64),
        dst: &Arc<IpcMapping>,
        dst_at: (u64, u64),
        len: u64,
        rows: u64,
    ) -> Result<(), LinkError> {
        self.copies
            .push_rows(src, src_at, dst, dst_at, len, rows)
            .map_err(LinkError::from)
    }

    fn pull(
        &mut self,
        src: &Arc<IpcMapping>,
        src_offset: u64,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), LinkError> {
        self.copies
            .pull(src, src_offset, dst, dst_offset, len)
            .map_err(LinkError::from)
    }

    fn submit(&mut self) -> Result<u64, LinkError> {
        self.copies.submit().map_err(LinkError::from)
    }

    fn completed(&mut self) -> Result<u64, LinkError> {
        self.copies.completed().map_err(LinkError::from)
    }

    fn synchronize(&mut self) -> Result<u64, LinkError> {
        self.copies.synchronize().map_err(LinkError::from)
    }

    fn batched(&self) -> bool {
        self.copies.batched()
    }

    fn copy_method(&self) -> String {
        let how = format!(
            "{}, completions by {}",
            self.copies.method().name(),
            self.copies.completion()
        );
        match self.copies.method_note() {
            Some(n) => format!("{how} ({n})"),
            None => how,
        }
    }
}

/// Host regions exported by loopback links of this process, by handle.
type LoopbackTable = Mutex<HashMap<[u8; 64], Arc<dyn MemoryRegion>>>;

fn loopback_table() -> &'static LoopbackTable {
    static T: OnceLock<LoopbackTable> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

struct LoopbackGuard([u8; 64]);

impl Drop for LoopbackGuard {
    fn drop(&mut self) {
        loopback_table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.0);
    }
}

/// One queued loopback copy: local region and offset, mapping and offset, length, and
/// whether it goes from the mapping into the region (a READ).
type LoopbackCopy = (
    Arc<dyn MemoryRegion>,
    u64,
    Arc<LoopbackMapping>,
    u64,
    u64,
    bool,
);

/// Host memory between transports of one process, copied with the CPU. Copies run when
/// [`completed`](Link::completed) is next called, not at submit, so completions are as
/// asynchronous as on a GPU.
#[derive(Default)]
pub struct LoopbackLink {
    queued: Vec<LoopbackCopy>,
    submitted: Vec<(u64, Vec<LoopbackCopy>)>,
    next: u64,
    done: u64,
}

/// A host region opened through a [`LoopbackLink`].
pub struct LoopbackMapping(Arc<dyn MemoryRegion>);

impl LoopbackLink {
    /// A loopback link.
    pub fn new() -> LoopbackLink {
        LoopbackLink {
            next: 1,
            ..LoopbackLink::default()
        }
    }

    fn run(&mut self) -> Result<u64, LinkError> {
        let mut buf = Vec::new();
        for (ticket, copies) in self.submitted.drain(..) {
            for (local, lo, mapping, mo, len, pull) in copies {
                buf.resize(len as usize, 0);
                if pull {
                    mapping.0.read_to_host(mo, &mut buf)?;
                    local.write_from_host(lo, &buf)?;
                } else {
                    local.read_to_host(lo, &mut buf)?;
                    mapping.0.write_from_host(mo, &buf)?;
                }
            }
            self.done = ticket;
        }
        Ok(self.done)
    }
}

impl Link for LoopbackLink {
    type Mapping = LoopbackMapping;

    fn name(&self) -> &'static str {
        "loopback"
    }

    fn device(&self) -> u32 {
        0
    }

    fn export(&mut self, mem: &Arc<dyn MemoryRegion>) -> Result<LinkExport, LinkError> {
        if mem.location() != MemoryLocation::Host {
            return Err(LinkError::Unsupported(
                "the loopback link exports only host memory",
            ));
        }
        let mut handle = [0u8; 64];
        handle[..8].copy_from_slice(&fabric_core::random_u64().to_le_bytes());
        handle[8..16].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
        loopback_table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle, mem.clone());
        Ok(LinkExport {
            handle,
            offset: 0,
            guard: Box::new(LoopbackGuard(handle)),
        })
    }

    /// Loopback handles name regions of this process's table: a peer that is not this
    /// process never resolves one (as the CUDA link's driver refuses a process its own
    /// handles).
    fn open(
        &mut self,
        handle: &[u8; 64],
        same_process: Option<&SameProcess>,
    ) -> Result<Arc<LoopbackMapping>, LinkError> {
        if same_process.is_none() {
            return Err(LinkError::OtherProcess);
        }
        loopback_table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(handle)
            .map(|m| Arc::new(LoopbackMapping(m.clone())))
            .ok_or(LinkError::StaleHandle)
    }

    fn mapping_len(mapping: &LoopbackMapping) -> u64 {
        mapping.0.len() as u64
    }

    fn push(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        dst: &Arc<LoopbackMapping>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), LinkError> {
        fabric_core::memory::check_range(src_offset, len, src.len() as u64)?;
        fabric_core::memory::check_range(dst_offset, len, dst.0.len() as u64)?;
        self.queued
            .push((src.clone(), src_offset, dst.clone(), dst_offset, len, false));
        Ok(())
    }

    fn pull(
        &mut self,
        src: &Arc<LoopbackMapping>,
        src_offset: u64,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), LinkError> {
        fabric_core::memory::check_range(src_offset, len, src.0.len() as u64)?;
        fabric_core::memory::check_range(dst_offset, len, dst.len() as u64)?;
        self.queued
            .push((dst.clone(), dst_offset, src.clone(), src_offset, len, true));
        Ok(())
    }

    fn submit(&mut self) -> Result<u64, LinkError> {
        let t = self.next;
        self.next += 1;
        self.submitted.push((t, std::mem::take(&mut self.queued)));
        Ok(t)
    }

    fn completed(&mut self) -> Result<u64, LinkError> {
        self.run()
    }

    fn synchronize(&mut self) -> Result<u64, LinkError> {
        self.run()
    }
}
