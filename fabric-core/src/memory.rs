//! The memory layer: what a transport may register, and plain host buffers.
//!
//! A transport keeps an `Arc<dyn MemoryRegion>` for as long as the region is registered
//! (and for as long as any operation on it is in flight), so memory can never be freed
//! under the NIC or socket that writes into it.

use crate::error::MemoryError;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

/// Where a region's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum MemoryLocation {
    /// Host memory the CPU addresses directly.
    Host,
    /// Memory of a CUDA device (by ordinal).
    Cuda {
        /// The CUDA device ordinal.
        device: u32,
    },
}

/// A dmabuf file descriptor covering a device range, for NIC registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmabufHandle {
    /// The dmabuf file descriptor (owned by the region that exported it).
    pub fd: i32,
    /// Offset of the region's first byte inside the dmabuf.
    pub offset: u64,
}

/// Memory that a transport can register.
///
/// # Safety
/// Implementors guarantee that, for as long as the value lives:
/// - [`host_ptr`](MemoryRegion::host_ptr), when `Some`, points to `len()` bytes that are valid
///   for reads and writes from any thread, and never moves;
/// - [`device_addr`](MemoryRegion::device_addr) stays the address of the same `len()` bytes.
///
/// Writes arriving from the network land in this memory without synchronisation with the
/// application, exactly as RDMA NICs do: the application must not read a range until the
/// transfer that writes it has completed.
pub unsafe trait MemoryRegion: Send + Sync + 'static {
    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes live.
    fn location(&self) -> MemoryLocation;

    /// A pointer the CPU can use, for host memory (and host-mapped device memory).
    fn host_ptr(&self) -> Option<NonNull<u8>>;

    /// The address a NIC or device uses for the first byte (the virtual address for host
    /// memory, the device pointer for CUDA memory).
    fn device_addr(&self) -> u64;

    /// A dmabuf export of the region, where the memory layer can make one.
    fn dmabuf(&self) -> Option<DmabufHandle> {
        None
    }

    /// Copies `dst.len()` bytes starting at `offset` into host memory.
    ///
    /// The default works for host memory; device memory overrides it.
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        let src = checked_host_ptr(self, offset, dst.len() as u64)?;
        // SAFETY: checked_host_ptr proved offset+len lies inside the region, which the
        // trait's contract makes valid for reads; dst is a distinct &mut borrow.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// The default works for host memory; device memory overrides it.
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        let dst = checked_host_ptr(self, offset, src.len() as u64)?;
        // SAFETY: checked_host_ptr proved the range lies inside the region, valid for
        // writes per the trait's contract; src cannot overlap a region we own.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies several ranges out, `(offset, destination)` each. Device memory overrides it
    /// to queue all the copies and wait once: a transport moving many small pages of GPU
    /// memory pays one synchronisation per batch instead of one per page.
    fn read_many_to_host(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        for (offset, dst) in parts.iter_mut() {
            self.read_to_host(*offset, dst)?;
        }
        Ok(())
    }

    /// Copies several ranges in, `(offset, source)` each; batched like
    /// [`read_many_to_host`](MemoryRegion::read_many_to_host).
    fn write_many_from_host(&self, parts: &[(u64, &[u8])]) -> Result<(), MemoryError> {
        for (offset, src) in parts {
            self.write_from_host(*offset, src)?;
        }
        Ok(())
    }
}

/// Checks `offset..offset+len` against `region` and returns the host pointer to `offset`.
pub fn checked_host_ptr<R: MemoryRegion + ?Sized>(
    region: &R,
    offset: u64,
    len: u64,
) -> Result<*mut u8, MemoryError> {
    check_range(offset, len, region.len() as u64)?;
    let base = region.host_ptr().ok_or_else(|| {
        MemoryError::Unsupported(format!(
            "{:?} memory has no host pointer and no copy path",
            region.location()
        ))
    })?;
    // SAFETY: offset <= len() was checked, so the result stays inside (or one past) the
    // allocation that host_ptr points to.
    Ok(unsafe { base.as_ptr().add(offset as usize) })
}

/// Checks that `offset..offset+len` lies inside `size` bytes, without overflow.
pub fn check_range(offset: u64, len: u64, size: u64) -> Result<(), MemoryError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(MemoryError::OutOfBounds { offset, len, size }),
    }
}

/// Page-aligned, zero-initialised host memory.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostBuffer owns its allocation exclusively; all access goes through raw-pointer
// copies that the MemoryRegion contract already requires callers to synchronise.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; &HostBuffer exposes no references into the bytes, only copies.
unsafe impl Sync for HostBuffer {}

const HOST_ALIGN: usize = 4096;

impl HostBuffer {
    /// Allocates `len` zeroed bytes, aligned to 4096.
    pub fn new(len: usize) -> Result<HostBuffer, MemoryError> {
        if len == 0 {
            return Ok(HostBuffer {
                ptr: NonNull::<u8>::dangling(),
                len: 0,
            });
        }
        let layout =
            Layout::from_size_align(len, HOST_ALIGN).map_err(|_| MemoryError::Alloc(len as u64))?;
        // SAFETY: layout has a non-zero size (len > 0 checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(MemoryError::Alloc(len as u64))?;
        Ok(HostBuffer { ptr, len })
    }

    /// Allocates and wraps in an `Arc`, ready to register.
    pub fn new_shared(len: usize) -> Result<Arc<HostBuffer>, MemoryError> {
        Ok(Arc::new(Self::new(len)?))
    }

    /// Copies bytes out of the buffer.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.read_to_host(offset, dst)
    }

    /// Copies bytes into the buffer.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.write_from_host(offset, src)
    }

    /// Returns a copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), MemoryError> {
        let dst = checked_host_ptr(self, offset, len)?;
        // SAFETY: the range was checked to lie inside this allocation.
        unsafe { std::ptr::write_bytes(dst, byte, len as usize) };
        Ok(())
    }

    /// Fills the whole buffer with `f(offset_of_chunk, chunk)` over 64 KiB chunks, in place.
    pub fn fill_with(&self, mut f: impl FnMut(u64, &mut [u8])) {
        const CHUNK: usize = 1 << 16;
        let mut tmp = vec![0u8; CHUNK];
        let mut off = 0usize;
        while off < self.len {
            let n = CHUNK.min(self.len - off);
            f(off as u64, &mut tmp[..n]);
            // In bounds by construction: off + n <= len.
            let _ = self.write(off as u64, &tmp[..n]);
            off += n;
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let layout =
            Layout::from_size_align(self.len, HOST_ALIGN).expect("layout was valid at allocation");
        // SAFETY: ptr was returned by alloc_zeroed with this same layout and is freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer({:p}, {} bytes)", self.ptr, self.len)
    }
}

// SAFETY: ptr is a live allocation of len bytes owned by self (or dangling with len 0).
unsafe impl MemoryRegion for HostBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Host
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }
    fn device_addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

/// A window onto part of another region (for registering a sub-range, e.g. with canary
/// bytes around it in tests).
pub struct SubRegion {
    parent: Arc<dyn MemoryRegion>,
    offset: u64,
    len: u64,
}

impl SubRegion {
    /// A window of `len` bytes at `offset` of `parent`.
    pub fn new(
        parent: Arc<dyn MemoryRegion>,
        offset: u64,
        len: u64,
    ) -> Result<SubRegion, MemoryError> {
        check_range(offset, len, parent.len() as u64)?;
        Ok(SubRegion {
            parent,
            offset,
            len,
        })
    }
}

// SAFETY: the window lies inside the parent (checked in new), which upholds the contract
// and is kept alive by the Arc.
unsafe impl MemoryRegion for SubRegion {
    fn len(&self) -> usize {
        self.len as usize
    }
    fn location(&self) -> MemoryLocation {
        self.parent.location()
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        // SAFETY: offset <= parent.len() (checked in new), so the pointer stays in bounds.
        self.parent
            .host_ptr()
            .map(|p| unsafe { p.add(self.offset as usize) })
    }
    fn device_addr(&self) -> u64 {
        self.parent.device_addr() + self.offset
    }
    fn dmabuf(&self) -> Option<DmabufHandle> {
        self.parent.dmabuf().map(|d| DmabufHandle {
            fd: d.fd,
            offset: d.offset + self.offset,
        })
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        check_range(offset, dst.len() as u64, self.len)?;
        self.parent.read_to_host(self.offset + offset, dst)
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        check_range(offset, src.len() as u64, self.len)?;
        self.parent.write_from_host(self.offset + offset, src)
    }
    fn read_many_to_host(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        for (offset, dst) in parts.iter() {
            check_range(*offset, dst.len() as u64, self.len)?;
        }
        for (offset, _) in parts.iter_mut() {
            *offset += self.offset;
        }
        let r = self.parent.read_many_to_host(parts);
        for (offset, _) in parts.iter_mut() {
            *offset -= self.offset;
        }
        r
    }
    fn write_many_from_host(&self, parts: &[(u64, &[u8])]) -> Result<(), MemoryError> {
        let mut shifted = Vec::with_capacity(parts.len());
        for (offset, src) in parts {
            check_range(*offset, src.len() as u64, self.len)?;
            shifted.push((self.offset + offset, *src));
        }
        self.parent.write_many_from_host(&shifted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_round_trip_and_bounds() {
        let b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.to_vec(0, 16).unwrap(), vec![0; 16]);
        b.write(9_990, &[7; 10]).unwrap();
        assert_eq!(b.to_vec(9_990, 10).unwrap(), vec![7; 10]);
        assert!(matches!(
            b.write(9_991, &[7; 10]),
            Err(MemoryError::OutOfBounds { .. })
        ));
        assert!(matches!(
            b.read(u64::MAX, &mut [0; 2]),
            Err(MemoryError::OutOfBounds { .. })
        ));
        assert_eq!(b.device_addr() % 4096, 0);
    }

    #[test]
    fn sub_region_is_a_bounded_window() {
        let parent: Arc<dyn MemoryRegion> = HostBuffer::new_shared(100).unwrap();
        let sub = SubRegion::new(parent.clone(), 10, 20).unwrap();
        sub.write_from_host(0, &[1; 20]).unwrap();
        assert!(sub.write_from_host(1, &[1; 20]).is_err());
        let mut all = [0u8; 100];
        parent.read_to_host(0, &mut all).unwrap();
        assert!(all[..10].iter().all(|&b| b == 0));
        assert!(all[10..30].iter().all(|&b| b == 1));
        assert!(all[30..].iter().all(|&b| b == 0));
        assert!(SubRegion::new(parent, 90, 20).is_err());
    }

    #[test]
    fn many_part_copies_go_through_windows() {
        let parent: Arc<dyn MemoryRegion> = HostBuffer::new_shared(100).unwrap();
        let sub = SubRegion::new(parent.clone(), 10, 20).unwrap();
        sub.write_many_from_host(&[(0, &[1, 2]), (18, &[3, 4])])
            .unwrap();
        assert!(
            sub.write_many_from_host(&[(0, &[1]), (19, &[9, 9])])
                .is_err()
        );
        let (mut a, mut b) = ([0u8; 2], [0u8; 2]);
        sub.read_many_to_host(&mut [(0, &mut a[..]), (18, &mut b[..])])
            .unwrap();
        assert_eq!((a, b), ([1, 2], [3, 4]));
        let mut all = [0u8; 100];
        parent.read_to_host(0, &mut all).unwrap();
        assert_eq!((all[10], all[28], all[29], all[30]), (1, 3, 4, 0));
        let mut c = [0u8; 2];
        let mut parts = [(0, &mut a[..]), (19, &mut c[..])];
        assert!(sub.read_many_to_host(&mut parts).is_err());
        assert_eq!(parts[0].0, 0, "offsets are left as given");
    }

    #[test]
    fn empty_buffer_is_fine() {
        let b = HostBuffer::new(0).unwrap();
        assert!(b.is_empty());
        b.write(0, &[]).unwrap();
        assert!(b.write(0, &[1]).is_err());
    }
}
