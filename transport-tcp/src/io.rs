//! The few places where this crate turns registered memory into byte slices.
//!
//! A registered region is shared with the network by design (RDMA semantics): peers' writes
//! land in it while the application may hold other parts of it. The `MemoryRegion` contract
//! makes its bytes valid for reads and writes from any thread for as long as the region
//! lives; callers here hold an `Arc` of the region for at least as long as the slice.

use fabric_core::memory::{MemoryRegion, check_range};

/// The host bytes `offset..offset+len` of `region`, or `None` for memory the CPU cannot
/// address or a range outside the region.
pub fn host_slice(region: &dyn MemoryRegion, offset: u64, len: usize) -> Option<&[u8]> {
    check_range(offset, len as u64, region.len() as u64).ok()?;
    let base = region.host_ptr()?;
    // SAFETY: the range lies inside the region (checked above), whose bytes the
    // MemoryRegion contract keeps valid while `region` is borrowed.
    Some(unsafe { std::slice::from_raw_parts(base.as_ptr().add(offset as usize), len) })
}

/// Mutable host bytes of `region`, as [`host_slice`].
///
/// The slice aliases memory that other threads may read (RDMA semantics): the engine only
/// reports a range as written after this slice is gone.
#[allow(clippy::mut_from_ref)]
pub fn host_slice_mut(region: &dyn MemoryRegion, offset: u64, len: usize) -> Option<&mut [u8]> {
    check_range(offset, len as u64, region.len() as u64).ok()?;
    let base = region.host_ptr()?;
    // SAFETY: the range lies inside the region (checked above); the contract makes it valid
    // for writes from any thread while `region` lives. No other slice of this transport
    // covers the range at the same time: one connection places one frame at a time.
    Some(unsafe { std::slice::from_raw_parts_mut(base.as_ptr().add(offset as usize), len) })
}

/// Waits for readiness on `fds` for at most `timeout` (ppoll(2): microsecond resolution).
pub fn ppoll_fds(fds: &mut [libc::pollfd], timeout: std::time::Duration) -> std::io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: fds is a valid, exclusively borrowed array of pollfd of the given length; ts
    // is a valid timespec; a null signal mask leaves the mask unchanged.
    let r = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(r as usize)
}

/// Whether the peer of `fd` has closed its side (or the connection failed), without reading.
pub fn peer_hung_up(fd: std::os::fd::RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    }];
    matches!(ppoll_fds(&mut p, std::time::Duration::ZERO), Ok(n) if n > 0)
        && p[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}
