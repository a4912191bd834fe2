//! The one return-code helper, libfabric's error type, and owning wrappers of fids.

use fabric_core::{Error, Result};
use libfabric_sys as sys;
use std::ffi::CStr;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// A libfabric error number (`FI_E*`, positive) as returned, negated, by an `fi_*` call.
///
/// It is the `source` of every [`Error::Backend`] this crate returns; downcast to it to
/// read the number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FiError {
    code: i32,
}

impl FiError {
    /// Wraps a libfabric error number; the sign does not matter (calls return it negated).
    pub fn new(code: i32) -> FiError {
        FiError {
            code: code.saturating_abs(),
        }
    }

    /// The positive `FI_E*` number.
    pub fn code(&self) -> i32 {
        self.code
    }

    /// libfabric's description of the error (`fi_strerror`; the number alone if no
    /// libfabric is loaded).
    pub fn message(&self) -> String {
        match sys::loaded() {
            Some(lib) => lib.strerror(self.code),
            None => format!("libfabric error {}", self.code),
        }
    }
}

impl fmt::Display for FiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (FI error {})", self.message(), self.code)
    }
}

impl std::error::Error for FiError {}

/// The libfabric of this process, loaded on first use (see [`libfabric_sys::libfabric`]);
/// the error names every place looked at and how to install it.
pub(crate) fn lib() -> Result<&'static sys::Libfabric> {
    sys::libfabric().map_err(|e| Error::Backend {
        call: "loading libfabric",
        message: e.to_string(),
        source: Some(Arc::new(e)),
    })
}

/// The error of a failed `fi_*` call: [`Error::Backend`] with fi_strerror's text.
pub(crate) fn backend_error(call: &'static str, code: i32) -> Error {
    let e = FiError::new(code);
    Error::Backend {
        call,
        message: e.message(),
        source: Some(Arc::new(e)),
    }
}

/// Turns an `fi_*` return value into a `Result`: negative values are errors, others are
/// returned as counts. Every libfabric call of this crate goes through here.
pub(crate) fn check(call: &'static str, ret: isize) -> Result<usize> {
    if ret < 0 {
        Err(backend_error(call, i32::try_from(ret).unwrap_or(i32::MIN)))
    } else {
        Ok(ret as usize)
    }
}

/// What [`check_post`] saw: the call was accepted, or the provider has no room now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Posted {
    Yes,
    Again,
}

/// [`check`] for data-path calls, where `-FI_EAGAIN` ("no room now") is expected.
pub(crate) fn check_post(call: &'static str, ret: isize) -> Result<Posted> {
    if ret == -(sys::FI_EAGAIN as isize) {
        return Ok(Posted::Again);
    }
    check(call, ret).map(|_| Posted::Yes)
}

/// A libfabric object that is closed with `fi_close` on its embedded `struct fid`.
pub(crate) trait FidObject {
    /// What the object is, for error messages.
    const WHAT: &'static str;
    /// The embedded `struct fid` of `this`.
    ///
    /// # Safety
    /// `this` must point to a live object of this type.
    unsafe fn fid(this: *mut Self) -> *mut sys::fid;
}

macro_rules! fid_object {
    ($($ty:ident => $what:literal),* $(,)?) => {$(
        impl FidObject for sys::$ty {
            const WHAT: &'static str = $what;
            unsafe fn fid(this: *mut Self) -> *mut sys::fid {
                // SAFETY: the caller guarantees `this` is live; `fid` is its first field
                // and taking its address reads nothing.
                unsafe { &raw mut (*this).fid }
            }
        }
    )*};
}

fid_object!(
    fid_fabric => "fabric",
    fid_domain => "domain",
    fid_av => "address vector",
    fid_cq => "completion queue",
    fid_ep => "endpoint",
    fid_mr => "memory registration",
    fid_cntr => "counter",
);

/// Owns one libfabric object and closes it on drop.
///
/// Drop order between objects is the owner's job (endpoint, then memory registrations,
/// then AV and CQ, then domain, then fabric): see `EfaTransport`'s field order.
pub(crate) struct Owned<T: FidObject>(NonNull<T>);

// SAFETY: a libfabric object may be used from any thread as long as calls on it are not
// concurrent (we open domains with FI_THREAD_DOMAIN, which asks exactly that of us).
// `Owned` is not `Sync` and every call goes through `&mut` of its single owner (the
// transport), so moving it to another thread never makes calls concurrent.
unsafe impl<T: FidObject> Send for Owned<T> {}

impl<T: FidObject> Owned<T> {
    /// Takes ownership of an object that a successful `fi_*` open call wrote to `ptr`.
    pub(crate) fn new(call: &'static str, ptr: *mut T) -> Result<Owned<T>> {
        NonNull::new(ptr).map(Owned).ok_or_else(|| Error::Backend {
            call,
            message: format!("returned success but no {}", T::WHAT),
            source: None,
        })
    }

    /// The raw object, for `fi_*` calls. Valid while `self` lives.
    pub(crate) fn as_ptr(&self) -> *mut T {
        self.0.as_ptr()
    }

    /// The embedded `struct fid`, for `fi_*_bind` calls.
    pub(crate) fn fid(&self) -> *mut sys::fid {
        // SAFETY: the object is live while self exists.
        unsafe { T::fid(self.0.as_ptr()) }
    }
}

impl<T: FidObject> Owned<T> {
    /// Closes the object now and says whether libfabric did. After a failure the object may
    /// still be open (a memory registration may still be reachable by the NIC): what it
    /// refers to must then be kept (see `mr::Registered`'s drop).
    pub(crate) fn close(self) -> std::result::Result<(), FiError> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: we own the object and close it exactly once (`this` is never dropped);
        // nothing uses it afterwards.
        let rc = unsafe { sys::fi_close(T::fid(this.0.as_ptr())) };
        let rc = close_fault::apply(rc);
        if rc != 0 {
            Err(FiError::new(rc))
        } else {
            Ok(())
        }
    }
}

impl<T: FidObject> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: we own the object and close it exactly once; nothing uses it afterwards.
        let rc = unsafe { sys::fi_close(T::fid(self.0.as_ptr())) };
        if rc != 0 {
            tracing::warn!(
                "fi_close({}) failed: {}",
                T::WHAT,
                FiError::new(rc).message()
            );
        }
    }
}

/// A test's way to make the next [`Owned::close`] of this thread report a failure (after
/// closing for real), as a provider whose close fails would: nothing outside tests can set
/// it, so in other builds `apply` returns the call's own code.
pub(crate) mod close_fault {
    #[cfg(test)]
    thread_local! {
        static FAIL_NEXT: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
    }

    /// Makes this thread's next close report `-code`.
    #[cfg(test)]
    pub(crate) fn fail_next(code: i32) {
        FAIL_NEXT.with(|f| f.set(Some(code)));
    }

    /// The code a close reports: `rc`, or the injected failure.
    #[cfg(test)]
    pub(crate) fn apply(rc: i32) -> i32 {
        FAIL_NEXT.with(|f| f.take()).map_or(rc, |code| -code.abs())
    }

    /// The code a close reports: `rc`.
    #[cfg(not(test))]
    #[inline(always)]
    pub(crate) fn apply(rc: i32) -> i32 {
        rc
    }
}

/// A list of `fi_info` returned by `fi_getinfo` (or one made by `fi_allocinfo`), freed
/// with `fi_freeinfo`. Used only inside one call; never stored, so never sent.
pub(crate) struct InfoList(NonNull<sys::fi_info>, &'static sys::Libfabric);

impl InfoList {
    /// An empty `fi_info` (with its attribute structs allocated) to fill in as hints.
    pub(crate) fn alloc(lib: &'static sys::Libfabric) -> Result<InfoList> {
        let p = lib.fi_allocinfo();
        NonNull::new(p)
            .map(|p| InfoList(p, lib))
            .ok_or_else(|| Error::Backend {
                call: "fi_allocinfo",
                message: "out of memory".into(),
                source: None,
            })
    }

    /// Wraps a list that `lib`'s `fi_getinfo` returned (null means an empty list).
    pub(crate) fn from_raw(lib: &'static sys::Libfabric, p: *mut sys::fi_info) -> Option<InfoList> {
        NonNull::new(p).map(|p| InfoList(p, lib))
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::fi_info {
        self.0.as_ptr()
    }

    /// The entries of the list, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &sys::fi_info> {
        let mut next = self.0.as_ptr().cast_const();
        std::iter::from_fn(move || {
            // SAFETY: every `next` pointer of a list from fi_getinfo is null or points to a
            // live entry that lives as long as the list (borrowed through &self).
            let e = unsafe { next.as_ref()? };
            next = e.next;
            Some(e)
        })
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        // SAFETY: the list was allocated by this library and is freed once.
        unsafe { self.1.fi_freeinfo(self.0.as_ptr()) };
    }
}

/// Copies a C string owned by libfabric, or "" for null.
pub(crate) fn c_str(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric's attribute strings are NUL-terminated and live as long as the
    // fi_info they belong to, which the caller borrows.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A `malloc`ed copy of `s`, for fields that `fi_freeinfo` will `free`.
pub(crate) fn c_strdup(s: &str) -> Result<*mut std::ffi::c_char> {
    let c =
        std::ffi::CString::new(s).map_err(|_| fabric_core::Invalid::Nul { text: s.to_owned() })?;
    // SAFETY: c is a valid NUL-terminated string; strdup returns malloc'ed memory or null.
    let p = unsafe { libc::strdup(c.as_ptr()) };
    if p.is_null() {
        return Err(Error::io("strdup", std::io::Error::last_os_error()));
    }
    Ok(p)
}
