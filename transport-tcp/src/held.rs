//! A registration's own handle on its memory.
//!
//! WRITEs that a connection sends or places hold their region alive while bytes are queued
//! for it or still arriving (it may be deregistered meanwhile): a batch or frame holds an
//! `Arc` of each region it touches. Wrapping the region once per registration makes that
//! count this transport's own, whoever else holds the caller's `Arc` (the engine's rail
//! group already gives each rail a view of its own; a caller that registers one `Arc` with
//! several transports gets the same separation). The wrapper also keeps the region's host
//! pointer and length, so the per-page bounds checks and address computations skip the
//! region's own (possibly chained: a `SubRegion` asks its parent) calls. Callgrind, `xfer
//! demo --transport tcp --page-size 4KiB --rails 2 --bytes 256MiB --region-size 16MiB`: the
//! rail workers 128.0 M -> 124.9 M instructions, all of it the cached pointer and length
//! (the rail views already kept the rails' counts apart).

use fabric_core::memory::DmabufHandle;
use fabric_core::{MemoryError, MemoryLocation, MemoryRegion};
use std::ptr::NonNull;
use std::sync::Arc;

/// A registered region, as this transport holds it.
pub(crate) struct Held {
    mem: Arc<dyn MemoryRegion>,
    /// `mem.host_ptr()`, which the trait's contract says never moves.
    host: Option<NonNull<u8>>,
    len: usize,
}

// SAFETY: `Held` only caches `host` from `mem`, which is `Send + Sync` by the trait's bound
// and keeps the bytes `host` points to alive and in place for as long as `Held` lives.
unsafe impl Send for Held {}
// SAFETY: as for `Send`: shared access to the pointer is what `mem` already allows.
unsafe impl Sync for Held {}

impl Held {
    /// Wraps `mem` for one registration.
    pub(crate) fn wrap(mem: Arc<dyn MemoryRegion>) -> Arc<dyn MemoryRegion> {
        Arc::new(Held {
            host: mem.host_ptr(),
            len: mem.len(),
            mem,
        })
    }
}

// SAFETY: every method answers for the wrapped region: `host_ptr` is the region's own
// pointer, taken once (the contract says it never moves), `len` its length, which never
// changes either; the wrapped `Arc` keeps the region alive as long as this value lives.
unsafe impl MemoryRegion for Held {
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> MemoryLocation {
        self.mem.location()
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        self.host
    }
    fn device_addr(&self) -> u64 {
        self.mem.device_addr()
    }
    fn dmabuf(&self) -> Option<DmabufHandle> {
        self.mem.dmabuf()
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.mem.read_to_host(offset, dst)
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.mem.write_from_host(offset, src)
    }
    fn read_many_to_host(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        self.mem.read_many_to_host(parts)
    }
    fn write_many_from_host(&self, parts: &[(u64, &[u8])]) -> Result<(), MemoryError> {
        self.mem.write_many_from_host(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::{HostBuffer, SubRegion};

    #[test]
    fn answers_for_the_wrapped_region() {
        let buf = HostBuffer::new_shared(8192).unwrap();
        let sub: Arc<dyn MemoryRegion> = Arc::new(SubRegion::new(buf.clone(), 4096, 100).unwrap());
        let held = Held::wrap(sub.clone());
        assert_eq!(held.len(), 100);
        assert_eq!(held.host_ptr(), sub.host_ptr());
        assert_eq!(held.device_addr(), sub.device_addr());
        assert_eq!(held.location(), MemoryLocation::Host);
        held.write_from_host(10, &[5; 20]).unwrap();
        assert_eq!(buf.to_vec(4106, 20).unwrap(), vec![5; 20]);
        // Bounds are the window's, not the parent's.
        assert!(held.write_from_host(90, &[1; 20]).is_err());
        let mut back = [0u8; 20];
        held.read_to_host(10, &mut back).unwrap();
        assert_eq!(back, [5; 20]);
    }

    #[test]
    fn counts_its_own_references() {
        let buf = HostBuffer::new_shared(4096).unwrap();
        let held = Held::wrap(buf.clone());
        let before = Arc::strong_count(&buf);
        let clones: Vec<_> = (0..10).map(|_| held.clone()).collect();
        // Clones of the handle leave the region's own count alone (the rails' threads do
        // not share a cache line per page) ...
        assert_eq!(Arc::strong_count(&buf), before);
        assert_eq!(Arc::strong_count(&held), 11);
        // ... and the region lives until the last handle goes.
        drop(clones);
        drop(held);
        assert_eq!(Arc::strong_count(&buf), before - 1);
    }
}
