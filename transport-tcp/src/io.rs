//! The few places where this crate reaches registered memory, always through raw pointers.
//!
//! A registered region is shared with the network by design (RDMA semantics): peers' writes
//! land in it while the application, or another rail's thread, may read or write other
//! parts, or the same bytes. A Rust reference (`&[u8]`, `&mut [u8]`) over such memory would
//! assert that nobody else writes (or touches) it meanwhile, which nobody can promise, so
//! none is ever made: payloads go to `readv`/`writev` as [`RawIov`]s built from the
//! region's pointer, and staged bytes are copied in with `ptr::copy_nonoverlapping`. The
//! `MemoryRegion` contract keeps the bytes valid while the region lives; callers hold an
//! `Arc` of it for at least as long as the call.

use fabric_core::memory::{MemoryRegion, check_range};
use std::os::fd::RawFd;
use std::ptr::NonNull;

/// A position in the host memory of a registered region that something else keeps alive: a
/// batch being received (`Dest::Kept`, the batch's `keep`) or a frame being sent
/// (`Payload::Kept`, the frame's `keep`), so that no entry holds a reference count of its
/// own.
pub(crate) struct At(NonNull<u8>);

// SAFETY: the pointer is into a region whose `Arc` (of a `Send + Sync` region) the same
// batch or frame holds; an `At` moves between threads only with the connection owning both.
unsafe impl Send for At {}

impl At {
    /// `offset` bytes into the host memory of `mem`, with `len` bytes after it; `None` for
    /// memory the CPU cannot address or a range outside the region.
    pub(crate) fn of(mem: &dyn MemoryRegion, offset: u64, len: u64) -> Option<At> {
        check_range(offset, len, mem.len() as u64).ok()?;
        let base = mem.host_ptr()?;
        // SAFETY: offset + len <= the region's length (checked above): inside (or one past)
        // the memory host_ptr points to.
        Some(At(unsafe { base.add(offset as usize) }))
    }

    /// The address.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }

    /// Moves past `n` bytes that were placed or sent (inside the checked range).
    pub(crate) fn advance(&mut self, n: usize) {
        // SAFETY: callers advance past placed or sent bytes of the checked range, so the
        // result stays inside (or one past) the region.
        self.0 = unsafe { self.0.add(n) };
    }
}

/// One `iovec`: a pointer and a length, never a reference. Valid only for the call it is
/// built for (see [`readv`] and [`writev`]).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct RawIov(libc::iovec);

impl RawIov {
    /// Over bytes this crate owns (headers, buffers).
    pub fn of_slice(s: &[u8]) -> RawIov {
        RawIov(libc::iovec {
            iov_base: s.as_ptr() as *mut libc::c_void,
            iov_len: s.len(),
        })
    }

    /// Over bytes this crate owns, to be written by `readv`.
    pub fn of_slice_mut(s: &mut [u8]) -> RawIov {
        RawIov(libc::iovec {
            iov_base: s.as_mut_ptr().cast(),
            iov_len: s.len(),
        })
    }

    /// Over `len` bytes from `ptr` (staging memory that no reference covers).
    pub fn of_raw(ptr: *mut u8, len: usize) -> RawIov {
        RawIov(libc::iovec {
            iov_base: ptr.cast(),
            iov_len: len,
        })
    }

    /// Over the host bytes `offset..offset+len` of `region`, or `None` for memory the CPU
    /// cannot address or a range outside the region.
    pub fn of_region(region: &dyn MemoryRegion, offset: u64, len: usize) -> Option<RawIov> {
        At::of(region, offset, len as u64).map(|at| RawIov::of_raw(at.ptr(), len))
    }

    /// Bytes covered.
    pub fn len(&self) -> usize {
        self.0.iov_len
    }
}

/// `writev(2)` of `iov` on `fd`.
///
/// # Safety
/// Every entry must be readable for its length for the whole call (its memory alive: the
/// caller holds the buffers, or the `Arc` of their region).
pub unsafe fn writev(fd: RawFd, iov: &[RawIov]) -> std::io::Result<usize> {
    let n = iov.len().min(libc::c_int::MAX as usize) as libc::c_int;
    // SAFETY: RawIov is a transparent iovec; the entries are readable (the caller's
    // contract); the kernel only reads them.
    let r = unsafe { libc::writev(fd, iov.as_ptr().cast(), n) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// `readv(2)` into `iov` from `fd`.
///
/// # Safety
/// Every entry must be writable for its length for the whole call, and no Rust reference to
/// those bytes may be used during the call. Entries may overlap: `readv` fills one area
/// completely before the next (POSIX), so where two overlap the later one's bytes remain.
pub unsafe fn readv(fd: RawFd, iov: &[RawIov]) -> std::io::Result<usize> {
    let n = iov.len().min(libc::c_int::MAX as usize) as libc::c_int;
    // SAFETY: RawIov is a transparent iovec; the entries are writable and no reference
    // covers them (the caller's contract); the kernel writes them only during the call.
    let r = unsafe { libc::readv(fd, iov.as_ptr().cast(), n) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// Copies `src` into the host bytes of `region` at `offset`, through raw pointers; false
/// (nothing copied) for memory the CPU cannot address or a range outside the region.
pub fn copy_to_region(region: &dyn MemoryRegion, offset: u64, src: &[u8]) -> bool {
    let Some(dst) = RawIov::of_region(region, offset, src.len()) else {
        return false;
    };
    // SAFETY: the destination range lies inside the live region (checked by of_region),
    // valid for writes from any thread by the MemoryRegion contract; `src` is our own
    // buffer, which registered memory never overlaps.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0.iov_base.cast(), src.len()) };
    true
}

/// The CRC32C of `head` followed by the host bytes `offset..offset + len` of `region`,
/// read through `scratch` in pieces of its size (a copy into our own buffer, never a
/// reference over registered memory: see the module documentation).
pub fn checksum(
    head: &[u8],
    region: &dyn MemoryRegion,
    offset: u64,
    len: usize,
    scratch: &mut [u8],
) -> Result<u32, fabric_core::MemoryError> {
    let mut crc = crc32c::crc32c(head);
    let mut at = 0usize;
    while at < len {
        let n = (len - at).min(scratch.len());
        region.read_to_host(offset + at as u64, &mut scratch[..n])?;
        crc = crc32c::crc32c_append(crc, &scratch[..n]);
        at += n;
    }
    Ok(crc)
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

/// Whether a non-blocking connect of `stream` has completed: `Ok(true)` connected,
/// `Ok(false)` still under way, or why it failed.
pub fn connect_outcome(stream: &std::net::TcpStream) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut p = [libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    }];
    if ppoll_fds(&mut p, std::time::Duration::ZERO)? == 0 {
        return Ok(false);
    }
    if let Some(e) = stream.take_error()? {
        return Err(e);
    }
    if p[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
        return Err(std::io::ErrorKind::ConnectionRefused.into());
    }
    Ok(true)
}

/// Whether the kernel still has bytes of `fd` that the peer's kernel has not acknowledged
/// (TCP's own retransmission and `TCP_USER_TIMEOUT` then watch the connection). `None` if
/// the kernel does not say.
pub fn kernel_unacked(fd: RawFd) -> Option<bool> {
    // SAFETY: tcp_info is plain old data; all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: info is writable for len bytes; the kernel writes at most len and sets len.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(info.tcpi_unacked > 0)
}
