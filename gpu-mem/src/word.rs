//! A completion word: pinned, device-mapped host memory that a stream writes with
//! `cuStreamWriteValue64` after each submit's copies, so that a poller learns which submits
//! are done by reading memory instead of asking the driver.
//!
//! Why: a transport's worker polls for completions in a tight loop, and with one worker per
//! rail, eight or sixteen threads of one process each calling `cuEventQuery` millions of
//! times a second contend on the driver's context locks with the launches and copies of
//! every other rail. A read of host memory takes no lock. The driver is still asked, at most
//! every [`CHECK_EVERY`], so that a failed stream (whose word never moves) surfaces as the
//! error it is.
//!
//! The write runs in stream order after the submit's copies and, without
//! `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`, behind a system-wide memory fence: once the
//! word shows a ticket, that submit's bytes are in place for any reader.

use crate::device::Device;
use crate::error::{GpuMemError, check_call};
use crate::gather::DescList;
use cudarc::driver::sys;
use std::sync::OnceLock;
use std::time::Duration;

/// How often a poller whose word has not moved asks the driver about the stream.
pub(crate) const CHECK_EVERY: Duration = Duration::from_micros(200);

/// `cuStreamWriteValue64` (its `_v2` form where the driver has it).
type WriteValueFn =
    unsafe extern "C" fn(sys::CUstream, sys::CUdeviceptr, u64, std::ffi::c_uint) -> sys::CUresult;

/// The driver's `cuStreamWriteValue64`, when it has one.
fn write_value_fn() -> Option<WriteValueFn> {
    static F: OnceLock<Option<WriteValueFn>> = OnceLock::new();
    *F.get_or_init(|| {
        [
            &b"cuStreamWriteValue64_v2\0"[..],
            &b"cuStreamWriteValue64\0"[..],
        ]
        .into_iter()
        .find_map(|name| {
            // SAFETY: only reached through a Device, which exists only after
            // Cuda::probe found the driver library; looking a symbol up has no other
            // effect, and both names have this signature in the CUDA headers.
            unsafe { sys::culib().get::<WriteValueFn>(name).ok().map(|s| *s) }
        })
    })
}

/// One stream's completion word.
pub(crate) struct StreamWord {
    list: DescList,
    write: WriteValueFn,
}

impl StreamWord {
    /// A word `stream` can write, proven by a write and a read back; `Ok(None)` when the
    /// driver or device cannot (no stream memory operations): callers use events then.
    pub(crate) fn probe(
        device: &Device,
        stream: sys::CUstream,
    ) -> Result<Option<StreamWord>, GpuMemError> {
        let Some(write) = write_value_fn() else {
            return Ok(None);
        };
        let list = DescList::new(device, 1, crate::gather::PLAIN)?;
        // SAFETY: the word lies in the list's pinned memory, owned here and not yet shared
        // with any stream.
        unsafe { list.host_word().write_volatile(u64::MAX) };
        let word = StreamWord { list, write };
        // SAFETY: the stream belongs to the device's context (bound by DescList::new); the
        // word stays alive until the synchronisation below.
        let written = unsafe { word.write(stream, 0) };
        let synced = check_call(
            // SAFETY: the stream is a live handle of the current context.
            unsafe { sys::cuStreamSynchronize(stream) },
            "cuStreamSynchronize",
        );
        match (written, synced) {
            (Ok(()), Ok(())) if word.read() == 0 => Ok(Some(word)),
            (_, Err(e)) => Err(e),
            _ => Ok(None),
        }
    }

    /// Queues the write of `value` on `stream`, after everything queued on it before.
    ///
    /// # Safety
    /// `stream` must belong to the current context, and this word must stay alive until
    /// the stream has passed the write.
    pub(crate) unsafe fn write(
        &self,
        stream: sys::CUstream,
        value: u64,
    ) -> Result<(), GpuMemError> {
        check_call(
            // SAFETY: the caller vouches for the stream and the word's lifetime; the device
            // address is the mapped word's, from cuMemHostGetDevicePointer.
            unsafe { (self.write)(stream, self.list.device_word(), value, 0) },
            "cuStreamWriteValue64",
        )
    }

    /// The last value a stream wrote.
    pub(crate) fn read(&self) -> u64 {
        // SAFETY: the word lies in live pinned memory of this value; the device writes it
        // whole (an aligned 8-byte store), so a volatile read sees an old or a new value.
        let v = unsafe { self.list.host_word().read_volatile() };
        // What the stream wrote before the word is read after it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        v
    }
}
