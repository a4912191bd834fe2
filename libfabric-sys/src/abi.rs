//! Structs that libfabric grew after 1.17 and that we hand to the library, defined by hand
//! in their newest layout (libfabric 1.20 to 2.6), which older libraries read a prefix of.
//!
//! - [`fi_mr_attr`]: 1.20 put `mr_iov` in a union with `dmabuf` (same offset) and appended
//!   `hmem_data`, `page_size`, `base_mr`, `sub_mr_cnt`. The library reads as much of it as
//!   the API version the application asked for (`ofi_mr_update_attr`), so the larger
//!   struct is right for every version, zeroed where unused.
//! - [`fi_cq_err_entry`]: 1.20 appended `src_addr`, and a library asked for API 1.20 or
//!   later writes it (`ofi_cq_err_memcpy`): a 1.17-sized entry would be overrun.
#![allow(non_camel_case_types, missing_docs)]

use crate::bindings::{fi_hmem_iface, fid_mr, iovec};
use core::ffi::c_void;

/// `FI_MR_DMABUF` (1.20): the registration's memory is a dmabuf (`fi_mr_attr.mem.dmabuf`).
pub const FI_MR_DMABUF: u64 = 1 << 40;

/// `struct fi_mr_dmabuf` (1.20).
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct fi_mr_dmabuf {
    pub fd: i32,
    pub offset: u64,
    pub len: usize,
    pub base_addr: *mut c_void,
}

/// The first field of [`fi_mr_attr`]: `mr_iov`, or `dmabuf` with [`FI_MR_DMABUF`].
#[repr(C)]
#[derive(Copy, Clone)]
pub union fi_mr_attr_mem {
    pub mr_iov: *const iovec,
    pub dmabuf: *const fi_mr_dmabuf,
}

/// The device of [`fi_mr_attr`], by interface.
#[repr(C)]
#[derive(Copy, Clone)]
pub union fi_mr_attr_device {
    pub reserved: u64,
    pub cuda: i32,
    pub ze: i32,
    pub neuron: i32,
    pub synapseai: i32,
    pub rocr: i32,
}

/// `struct fi_mr_attr`, 1.20 layout.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct fi_mr_attr {
    pub mem: fi_mr_attr_mem,
    pub iov_count: usize,
    pub access: u64,
    pub offset: u64,
    pub requested_key: u64,
    pub context: *mut c_void,
    pub auth_key_size: usize,
    pub auth_key: *mut u8,
    pub iface: fi_hmem_iface,
    pub device: fi_mr_attr_device,
    pub hmem_data: *mut c_void,
    pub page_size: usize,
    pub base_mr: *const fid_mr,
    pub sub_mr_cnt: usize,
}

impl Default for fi_mr_attr {
    fn default() -> fi_mr_attr {
        fi_mr_attr {
            mem: fi_mr_attr_mem {
                mr_iov: core::ptr::null(),
            },
            iov_count: 0,
            access: 0,
            offset: 0,
            requested_key: 0,
            context: core::ptr::null_mut(),
            auth_key_size: 0,
            auth_key: core::ptr::null_mut(),
            iface: 0,
            device: fi_mr_attr_device { reserved: 0 },
            hmem_data: core::ptr::null_mut(),
            page_size: 0,
            base_mr: core::ptr::null(),
            sub_mr_cnt: 0,
        }
    }
}

/// `struct fi_mr_modify` (not used; here because the generated ops tables name it).
#[repr(C)]
#[derive(Copy, Clone)]
pub struct fi_mr_modify {
    pub flags: u64,
    pub attr: fi_mr_attr,
}

/// `struct fi_cq_err_entry`, 1.20 layout (with `src_addr`).
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct fi_cq_err_entry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
    pub tag: u64,
    pub olen: usize,
    pub err: i32,
    pub prov_errno: i32,
    pub err_data: *mut c_void,
    pub err_data_size: usize,
    pub src_addr: u64,
}

impl Default for fi_cq_err_entry {
    fn default() -> fi_cq_err_entry {
        fi_cq_err_entry {
            op_context: core::ptr::null_mut(),
            flags: 0,
            len: 0,
            buf: core::ptr::null_mut(),
            data: 0,
            tag: 0,
            olen: 0,
            err: 0,
            prov_errno: 0,
            err_data: core::ptr::null_mut(),
            err_data_size: 0,
            src_addr: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{offset_of, size_of};

    /// Offsets as in libfabric 2.6.0's `rdma/fi_domain.h` and `rdma/fi_eq.h` on x86-64 and
    /// aarch64 (LP64): the prefix is 1.17's layout.
    #[test]
    fn layouts_match_libfabric_2_6() {
        assert_eq!(offset_of!(fi_mr_attr, iov_count), 8);
        assert_eq!(offset_of!(fi_mr_attr, iface), 64);
        assert_eq!(offset_of!(fi_mr_attr, device), 72);
        assert_eq!(offset_of!(fi_mr_attr, hmem_data), 80);
        assert_eq!(size_of::<fi_mr_attr>(), 112);
        assert_eq!(offset_of!(fi_cq_err_entry, err), 56);
        assert_eq!(offset_of!(fi_cq_err_entry, err_data_size), 72);
        assert_eq!(size_of::<fi_cq_err_entry>(), 88);
        assert_eq!(size_of::<fi_mr_dmabuf>(), 32);
    }
}
