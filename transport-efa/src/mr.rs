//! Memory registration, honouring the provider's `mr_mode` bits generically:
//!
//! - FI_MR_PROV_KEY: the provider picks the key (`fi_mr_key`); else each registration asks
//!   for a key of its own: random within the provider's `mr_key_size`, never one of the
//!   domain's registrations in use, and drawn again when the provider refuses it as taken
//!   (-FI_ENOKEY, -FI_EKEYREJECTED). A counter would let anyone who can reach the endpoint
//!   guess the keys of regions it was never given (and a stale key the next region's);
//! - FI_MR_VIRT_ADDR: peers address the region by virtual address ([`RemoteRegion::addr`]
//!   is its base); else by offset (`addr` is 0);
//! - FI_MR_LOCAL: local buffers need their descriptor (`fi_mr_desc`), which every
//!   operation passes (providers without the bit ignore it);
//! - FI_MR_ENDPOINT: the registration is bound to the endpoint and enabled;
//! - FI_MR_HMEM / FI_HMEM: device memory is registered with its interface (CUDA) and
//!   device, from a dmabuf where the headers and the memory offer one.

use crate::fi::{FiError, Owned, check};
use fabric_core::{
    Access, Error, LocalKey, MemoryLocation, MemoryRegion, OpError, RemoteKey, RemoteRegion, Result,
};
use libfabric_sys as sys;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Registrations whose `fi_close` failed since the process started: their memory is kept
/// for good (see [`Registered`]'s drop).
static LEAKED: AtomicU64 = AtomicU64::new(0);

/// How many memory registrations of this process failed to close, so that their memory was
/// kept alive for good instead of being freed while the NIC might still reach it.
pub fn leaked_registrations() -> u64 {
    LEAKED.load(Ordering::Relaxed)
}

/// One registered region.
///
/// Dropping it closes the registration before the memory may go; when `fi_close` fails the
/// registration may still be open (a NIC may still write or read the memory), so the memory
/// is kept alive for good instead, logged and counted ([`leaked_registrations`]).
pub(crate) struct Registered {
    /// Closed (taken) in `drop`, before `mem` is released.
    mr: ManuallyDrop<Owned<sys::fid_mr>>,
    mem: Arc<dyn MemoryRegion>,
    /// The address of byte 0 for local iovecs (host pointer, or device pointer).
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    /// Host memory (not device memory): only such regions share provider calls (see
    /// `Op::host`).
    pub(crate) host: bool,
    key: RemoteKey,
    remote_addr: u64,
    /// Local operations in flight that use it: it stays open until they finish.
    pub(crate) inflight: usize,
    /// Deregistered by the user while operations were in flight: closed when they end.
    pub(crate) deregistered: bool,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: `mr` is taken exactly once, here, and never used again.
        let mr = unsafe { ManuallyDrop::take(&mut self.mr) };
        if let Err(e) = mr.close() {
            LEAKED.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                len = self.len,
                key = self.key.0,
                "fi_close(memory registration) failed: {e}; its memory is kept for good (the \
                 NIC may still reach it)"
            );
            std::mem::forget(self.mem.clone());
        }
    }
}

impl Registered {
    /// The descriptor local operations pass (FI_MR_LOCAL).
    pub(crate) fn desc(&self) -> *mut c_void {
        // SAFETY: the registration is open while self lives.
        unsafe { sys::fi_mr_desc(self.mr.as_ptr()) }
    }

    /// What peers need to write into the region.
    pub(crate) fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.remote_addr,
            len: self.len,
            key: self.key,
        }
    }
}

/// Where and how to register.
pub(crate) struct Target<'a> {
    pub domain: &'a Owned<sys::fid_domain>,
    pub ep: &'a Owned<sys::fid_ep>,
    pub policy: crate::attrs::Policy,
    pub mr_key_size: usize,
    /// Whether the endpoint was opened with FI_HMEM.
    pub hmem: bool,
    /// Whether the library takes FI_MR_DMABUF registrations (API 1.20+).
    pub dmabuf: bool,
    /// Whether CUDA registrations say FI_HMEM_DEVICE_ONLY ([`crate::EfaConfig::hmem_device_only`]).
    pub device_only: bool,
    pub provider: &'a str,
}

/// libfabric access bits for `access`. Every region may be the source of sends and
/// writes; LOCAL_WRITE adds receives (and local read targets).
fn fi_access(access: Access) -> u64 {
    let mut bits = sys::FI_SEND | sys::FI_WRITE;
    if access.contains(Access::LOCAL_WRITE) {
        bits |= sys::FI_RECV | sys::FI_READ;
    }
    if access.contains(Access::REMOTE_WRITE) {
        bits |= sys::FI_REMOTE_WRITE;
    }
    if access.contains(Access::REMOTE_READ) {
        bits |= sys::FI_REMOTE_READ;
    }
    bits
}

/// Fits a requested key into the provider's key size.
fn fit_key(key: u64, mr_key_size: usize) -> u64 {
    if mr_key_size == 0 || mr_key_size >= 8 {
        key
    } else {
        key & ((1u64 << (8 * mr_key_size)) - 1)
    }
}

/// How many keys a registration draws before it gives up: each is refused only when it is
/// in use, which for 64 random bits (or even 16) means the domain is full, not unlucky.
pub(crate) const KEY_ATTEMPTS: usize = 16;

/// Where requested keys come from, and which are taken (see the module docs).
pub(crate) struct KeyChoice<'a> {
    /// 64 random bits per call ([`fabric_core::random_u64`]; tests script it).
    pub draw: &'a mut dyn FnMut() -> u64,
    /// Whether a key is held by a registration of this domain.
    pub taken: &'a dyn Fn(u64) -> bool,
}

impl KeyChoice<'_> {
    /// A key within `mr_key_size` bytes that is neither 0 nor taken, or `None` after
    /// [`KEY_ATTEMPTS`] draws.
    fn next(&mut self, mr_key_size: usize) -> Option<u64> {
        (0..KEY_ATTEMPTS)
            .map(|_| fit_key((self.draw)(), mr_key_size))
            .find(|&k| k != 0 && !(self.taken)(k))
    }
}

/// Whether the provider refused a registration because its requested key is in use.
fn key_refused(e: &Error) -> bool {
    let Error::Backend {
        source: Some(source),
        ..
    } = e
    else {
        return false;
    };
    source
        .downcast_ref::<FiError>()
        .is_some_and(|f| f.code() == sys::FI_ENOKEY as i32 || f.code() == sys::FI_EKEYREJECTED)
}

/// The error of a registration that found no free key.
fn no_free_key(provider: &str, mr_key_size: usize) -> Error {
    Error::Backend {
        call: "fi_mr_regattr",
        message: format!(
            "no free memory key after {KEY_ATTEMPTS} random draws of {mr_key_size} bytes \
             (provider {provider}): the domain's keys are exhausted"
        ),
        source: None,
    }
}

/// Registers `mem` with `access`; unless FI_MR_PROV_KEY, with a requested key from `keys`.
pub(crate) fn register(
    t: Target<'_>,
    mem: Arc<dyn MemoryRegion>,
    access: Access,
    mut keys: KeyChoice<'_>,
) -> Result<Registered> {
    let len = mem.len() as u64;
    let (iface, device, base) = match mem.location() {
        MemoryLocation::Host => {
            let base = mem
                .host_ptr()
                .map_or_else(|| mem.device_addr(), |p| p.as_ptr() as u64);
            (sys::FI_HMEM_SYSTEM, 0, base)
        }
        MemoryLocation::Cuda { device } => {
            if !t.hmem {
                return Err(Error::Unsupported(format!(
                    "registering CUDA memory needs FI_HMEM: this endpoint (provider {}) was \
                     opened without it; set EfaConfig::hmem and use a provider that offers \
                     it (efa; shm on one host)",
                    t.provider
                )));
            }
            (sys::FI_HMEM_CUDA, device, mem.device_addr())
        }
    };
    let iov = sys::iovec {
        iov_base: base as *mut c_void,
        iov_len: len as usize,
    };
    let mut attr = sys::fi_mr_attr {
        iov_count: 1,
        access: fi_access(access),
        iface,
        ..Default::default()
    };
    attr.device.cuda = device as i32;
    let mut attempts = 0;
    let mr = loop {
        if !t.policy.provider_keys {
            attr.requested_key = keys
                .next(t.mr_key_size)
                .ok_or_else(|| no_free_key(t.provider, t.mr_key_size))?;
        }
        attempts += 1;
        match regattr(&t, &mut attr, &iov, &*mem, len) {
            Err(e) if !t.policy.provider_keys && key_refused(&e) && attempts < KEY_ATTEMPTS => {
                tracing::debug!(
                    key = attr.requested_key,
                    "memory key taken; drawing another"
                );
            }
            Err(e) if !t.policy.provider_keys && key_refused(&e) => {
                return Err(no_free_key(t.provider, t.mr_key_size));
            }
            r => break r?,
        }
    };
    let mr = Owned::new("fi_mr_regattr", mr)?;
    // From here on the registration is closed through `Registered`'s drop, which keeps the
    // memory should the close fail, whether registering finishes or not.
    let host = matches!(mem.location(), MemoryLocation::Host);
    let mut reg = Registered {
        mr: ManuallyDrop::new(mr),
        mem,
        base,
        len,
        access,
        host,
        key: RemoteKey(attr.requested_key),
        remote_addr: t.policy.remote_addr(base),
        inflight: 0,
        deregistered: false,
    };
    if t.policy.bind_to_endpoint {
        // SAFETY: mr and ep are open objects of the same domain.
        let rc = unsafe { sys::fi_mr_bind(reg.mr.as_ptr(), t.ep.fid(), 0) };
        check("fi_mr_bind", rc as isize)?;
        // SAFETY: mr is open and bound.
        let rc = unsafe { sys::fi_mr_enable(reg.mr.as_ptr()) };
        check("fi_mr_enable", rc as isize)?;
    }
    if t.policy.provider_keys {
        // SAFETY: mr is open.
        let k = unsafe { sys::fi_mr_key(reg.mr.as_ptr()) };
        if k == sys::FI_KEY_NOTAVAIL {
            return Err(Error::Unsupported(format!(
                "provider {} gives no key for this registration (FI_MR_RAW keys are not \
                 supported)",
                t.provider
            )));
        }
        reg.key = RemoteKey(k);
    }
    Ok(reg)
}

/// `fi_mr_regattr` of one iovec. Device memory with a dmabuf export is registered
/// through it (FI_MR_DMABUF, libfabric 1.20+) first; if the provider refuses, through its
/// address.
fn regattr(
    t: &Target<'_>,
    attr: &mut sys::fi_mr_attr,
    iov: &sys::iovec,
    mem: &dyn MemoryRegion,
    len: u64,
) -> Result<*mut sys::fid_mr> {
    if let (MemoryLocation::Cuda { .. }, Some(d), true) = (mem.location(), mem.dmabuf(), t.dmabuf) {
        let dmabuf = sys::fi_mr_dmabuf {
            fd: d.fd,
            offset: d.offset,
            len: len as usize,
            base_addr: iov.iov_base,
        };
        attr.mem.dmabuf = &dmabuf;
        match mr_regattr(t, attr, sys::FI_MR_DMABUF | device_only(t, mem)) {
            Ok(mr) => {
                tracing::debug!(
                    len,
                    provider = t.provider,
                    "CUDA memory registered from its dmabuf"
                );
                return Ok(mr);
            }
            Err(e) => tracing::warn!("dmabuf registration failed ({e}); registering by address"),
        }
    }
    attr.mem.mr_iov = iov;
    let mr = mr_regattr(t, attr, device_only(t, mem))?;
    if attr.iface != sys::FI_HMEM_SYSTEM {
        tracing::debug!(
            len,
            provider = t.provider,
            "CUDA memory registered by address"
        );
    }
    Ok(mr)
}

/// FI_HMEM_DEVICE_ONLY for device memory: it is allocated with the device API (not managed
/// nor host-allocated), which lets shm move it with the device's IPC (a copy engine)
/// instead of bouncing it through host buffers, unless the configuration leaves it out.
fn device_only(t: &Target<'_>, mem: &dyn MemoryRegion) -> u64 {
    match mem.location() {
        MemoryLocation::Cuda { .. } if t.device_only => sys::FI_HMEM_DEVICE_ONLY,
        _ => 0,
    }
}

fn mr_regattr(t: &Target<'_>, attr: &sys::fi_mr_attr, flags: u64) -> Result<*mut sys::fid_mr> {
    let mut mr = std::ptr::null_mut();
    // SAFETY: domain is open; attr describes memory that the MemoryRegion contract keeps
    // valid for as long as the registration (which holds the Arc) lives; pointers inside
    // attr outlive this call.
    let rc = unsafe { sys::fi_mr_regattr(t.domain.as_ptr(), attr, flags, &mut mr) };
    if attr.iface != sys::FI_HMEM_SYSTEM && (rc == -sys::FI_ENOSYS || rc == -sys::FI_EOPNOTSUPP) {
        // The provider offers FI_HMEM but libfabric has no support for this device
        // interface (e.g. a distribution build without CUDA: "uninitialized iface").
        return Err(Error::Unsupported(format!(
            "provider {} cannot register device memory of interface {}: this libfabric was \
             built without support for it (fi_mr_regattr: {}); use a libfabric built with \
             CUDA, such as AWS's in /opt/amazon/efa",
            t.provider,
            attr.iface,
            crate::fi::FiError::new(rc).message()
        )));
    }
    check("fi_mr_regattr", rc as isize)?;
    Ok(mr)
}

/// The requested keys held by live registrations (see the module docs): never requested
/// again while their registration lives.
pub(crate) type KeysInUse = rustc_hash::FxHashSet<u64>;

/// Drops registration `key` (closing it) and frees its remote key for later registrations.
fn remove(regs: &mut crate::FastMap<LocalKey, Registered>, keys: &mut KeysInUse, key: LocalKey) {
    if let Some(r) = regs.remove(&key) {
        keys.remove(&r.key.0);
    }
}

/// Deregisters `key`: at once, or when its last operation in flight finishes.
pub(crate) fn deregister(
    regs: &mut crate::FastMap<LocalKey, Registered>,
    keys: &mut KeysInUse,
    key: LocalKey,
) -> Result<()> {
    match regs.get_mut(&key) {
        Some(r) if !r.deregistered => {
            if r.inflight == 0 {
                remove(regs, keys, key);
            } else {
                r.deregistered = true;
            }
            Ok(())
        }
        _ => Err(Error::Op(OpError::LocalKeyInvalid(key))),
    }
}

/// Releases one in-flight operation's hold on `key`.
pub(crate) fn release(
    regs: &mut crate::FastMap<LocalKey, Registered>,
    keys: &mut KeysInUse,
    key: LocalKey,
) {
    if let Some(r) = regs.get_mut(&key) {
        r.inflight = r.inflight.saturating_sub(1);
        if r.deregistered && r.inflight == 0 {
            remove(regs, keys, key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_bits() {
        let none = fi_access(Access::NONE);
        assert_eq!(none, sys::FI_SEND | sys::FI_WRITE);
        assert_ne!(fi_access(Access::LOCAL_WRITE) & sys::FI_RECV, 0);
        assert_eq!(fi_access(Access::LOCAL_WRITE) & sys::FI_REMOTE_WRITE, 0);
        assert_ne!(fi_access(Access::ALL) & sys::FI_REMOTE_READ, 0);
    }

    #[test]
    fn keys_fit_the_key_size() {
        assert_eq!(fit_key(0x1_0000_0005, 4), 5);
        assert_eq!(fit_key(u64::MAX, 8), u64::MAX);
        assert_eq!(fit_key(7, 0), 7);
    }
}
