//! Memory registration, honouring the provider's `mr_mode` bits generically:
//!
//! - FI_MR_PROV_KEY: the provider picks the key (`fi_mr_key`); else each registration asks
//!   for a key of its own (a counter, unique within the domain, never reused);
//! - FI_MR_VIRT_ADDR: peers address the region by virtual address ([`RemoteRegion::addr`]
//!   is its base); else by offset (`addr` is 0);
//! - FI_MR_LOCAL: local buffers need their descriptor (`fi_mr_desc`), which every
//!   operation passes (providers without the bit ignore it);
//! - FI_MR_ENDPOINT: the registration is bound to the endpoint and enabled;
//! - FI_MR_HMEM / FI_HMEM: device memory is registered with its interface (CUDA) and
//!   device, from a dmabuf where the headers and the memory offer one.

use crate::fi::{Owned, check};
use fabric_core::{
    Access, Error, LocalKey, MemoryLocation, MemoryRegion, OpError, RemoteKey, RemoteRegion, Result,
};
use libfabric_sys as sys;
use std::ffi::c_void;
use std::sync::Arc;

/// One registered region.
pub(crate) struct Registered {
    // Dropped in this order: the registration closes before the memory may go.
    mr: Owned<sys::fid_mr>,
    _mem: Arc<dyn MemoryRegion>,
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

/// Registers `mem` with `access`; `requested_key` is used unless FI_MR_PROV_KEY.
pub(crate) fn register(
    t: Target<'_>,
    mem: Arc<dyn MemoryRegion>,
    access: Access,
    requested_key: u64,
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
    let requested_key = if t.policy.provider_keys {
        0
    } else {
        fit_key(requested_key, t.mr_key_size)
    };
    let iov = sys::iovec {
        iov_base: base as *mut c_void,
        iov_len: len as usize,
    };
    let mut attr = sys::fi_mr_attr {
        iov_count: 1,
        access: fi_access(access),
        requested_key,
        iface,
        ..Default::default()
    };
    attr.device.cuda = device as i32;
    let mr = regattr(&t, &mut attr, &iov, &*mem, len)?;
    let mr = Owned::new("fi_mr_regattr", mr)?;
    if t.policy.bind_to_endpoint {
        // SAFETY: mr and ep are open objects of the same domain.
        let rc = unsafe { sys::fi_mr_bind(mr.as_ptr(), t.ep.fid(), 0) };
        check("fi_mr_bind", rc as isize)?;
        // SAFETY: mr is open and bound.
        let rc = unsafe { sys::fi_mr_enable(mr.as_ptr()) };
        check("fi_mr_enable", rc as isize)?;
    }
    let key = if t.policy.provider_keys {
        // SAFETY: mr is open.
        let k = unsafe { sys::fi_mr_key(mr.as_ptr()) };
        if k == sys::FI_KEY_NOTAVAIL {
            return Err(Error::Unsupported(format!(
                "provider {} gives no key for this registration (FI_MR_RAW keys are not \
                 supported)",
                t.provider
            )));
        }
        k
    } else {
        requested_key
    };
    let remote_addr = t.policy.remote_addr(base);
    let host = matches!(mem.location(), MemoryLocation::Host);
    Ok(Registered {
        mr,
        _mem: mem,
        base,
        len,
        access,
        host,
        key: RemoteKey(key),
        remote_addr,
        inflight: 0,
        deregistered: false,
    })
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

/// Deregisters `key`: at once, or when its last operation in flight finishes.
pub(crate) fn deregister(
    regs: &mut crate::FastMap<LocalKey, Registered>,
    key: LocalKey,
) -> Result<()> {
    match regs.get_mut(&key) {
        Some(r) if !r.deregistered => {
            if r.inflight == 0 {
                regs.remove(&key);
            } else {
                r.deregistered = true;
            }
            Ok(())
        }
        _ => Err(Error::Op(OpError::LocalKeyInvalid(key))),
    }
}

/// Releases one in-flight operation's hold on `key`.
pub(crate) fn release(regs: &mut crate::FastMap<LocalKey, Registered>, key: LocalKey) {
    if let Some(r) = regs.get_mut(&key) {
        r.inflight = r.inflight.saturating_sub(1);
        if r.deregistered && r.inflight == 0 {
            regs.remove(&key);
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
