//! libfabric's `static inline` calls, which the headers define as jumps through the
//! objects' ops tables (`fid->ops->close(fid)`, `ep->rma->writemsg(...)`, ...): the same
//! jumps, in Rust. A provider fills every entry of its tables (unsupported ones with
//! stubs that return `-FI_ENOSYS`); an empty entry returns `-FI_ENOSYS` here too.
//!
//! # Safety
//! Every function has the contract of the C call of the same name (`man fi_endpoint`,
//! `fi_cq`, `fi_rma`, ...): the objects are live and of the right kind, pointers point to
//! what the call reads or writes, and calls on one domain are not concurrent (we open
//! domains with FI_THREAD_DOMAIN).
#![allow(clippy::missing_safety_doc)]

use crate::FI_ENOSYS;
use crate::abi::{fi_cq_err_entry, fi_mr_attr};
use crate::bindings::*;
use core::ffi::{c_char, c_int, c_void};

/// Calls entry `$entry` of the ops table `$table` (a raw pointer), or returns -FI_ENOSYS.
macro_rules! jump {
    ($table:expr, $entry:ident ( $($arg:expr),* )) => {{
        // SAFETY: the caller guarantees the object is live, so its ops table is too.
        match unsafe { (*$table).$entry } {
            // SAFETY: the entry is the provider's implementation of this call; the caller
            // upholds the call's contract.
            Some(f) => unsafe { f($($arg),*) },
            None => -(FI_ENOSYS as i32) as _,
        }
    }};
}

/// `fi_close`.
pub unsafe fn fi_close(fid: *mut fid) -> c_int {
    jump!((*fid).ops, close(fid))
}

/// `fi_control`.
pub unsafe fn fi_control(fid: *mut fid, command: c_int, arg: *mut c_void) -> c_int {
    jump!((*fid).ops, control(fid, command, arg))
}

/// `fi_domain`.
pub unsafe fn fi_domain(
    fabric: *mut fid_fabric,
    info: *mut fi_info,
    domain: *mut *mut fid_domain,
    context: *mut c_void,
) -> c_int {
    jump!((*fabric).ops, domain(fabric, info, domain, context))
}

/// `fi_trywait`.
pub unsafe fn fi_trywait(fabric: *mut fid_fabric, fids: *mut *mut fid, count: c_int) -> c_int {
    jump!((*fabric).ops, trywait(fabric, fids, count))
}

/// `fi_endpoint`.
pub unsafe fn fi_endpoint(
    domain: *mut fid_domain,
    info: *mut fi_info,
    ep: *mut *mut fid_ep,
    context: *mut c_void,
) -> c_int {
    jump!((*domain).ops, endpoint(domain, info, ep, context))
}

/// `fi_av_open`.
pub unsafe fn fi_av_open(
    domain: *mut fid_domain,
    attr: *mut fi_av_attr,
    av: *mut *mut fid_av,
    context: *mut c_void,
) -> c_int {
    jump!((*domain).ops, av_open(domain, attr, av, context))
}

/// `fi_cq_open`.
pub unsafe fn fi_cq_open(
    domain: *mut fid_domain,
    attr: *mut fi_cq_attr,
    cq: *mut *mut fid_cq,
    context: *mut c_void,
) -> c_int {
    jump!((*domain).ops, cq_open(domain, attr, cq, context))
}

/// `fi_mr_regattr`.
pub unsafe fn fi_mr_regattr(
    domain: *mut fid_domain,
    attr: *const fi_mr_attr,
    flags: u64,
    mr: *mut *mut fid_mr,
) -> c_int {
    jump!(
        (*domain).mr,
        regattr(&raw mut (*domain).fid, attr, flags, mr)
    )
}

/// `fi_mr_reg`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_mr_reg(
    domain: *mut fid_domain,
    buf: *const c_void,
    len: usize,
    access: u64,
    offset: u64,
    requested_key: u64,
    flags: u64,
    mr: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    jump!(
        (*domain).mr,
        reg(
            &raw mut (*domain).fid,
            buf,
            len,
            access,
            offset,
            requested_key,
            flags,
            mr,
            context
        )
    )
}

/// `fi_mr_desc`: the registration's local descriptor.
pub unsafe fn fi_mr_desc(mr: *mut fid_mr) -> *mut c_void {
    // SAFETY: the caller guarantees mr is live.
    unsafe { (*mr).mem_desc }
}

/// `fi_mr_key`: the registration's remote key.
pub unsafe fn fi_mr_key(mr: *mut fid_mr) -> u64 {
    // SAFETY: the caller guarantees mr is live.
    unsafe { (*mr).key }
}

/// `fi_mr_bind`.
pub unsafe fn fi_mr_bind(mr: *mut fid_mr, bfid: *mut fid, flags: u64) -> c_int {
    jump!((*mr).fid.ops, bind(&raw mut (*mr).fid, bfid, flags))
}

/// `fi_mr_enable`.
pub unsafe fn fi_mr_enable(mr: *mut fid_mr) -> c_int {
    jump!(
        (*mr).fid.ops,
        control(
            &raw mut (*mr).fid,
            FI_ENABLE as c_int,
            core::ptr::null_mut()
        )
    )
}

/// `fi_ep_bind`.
pub unsafe fn fi_ep_bind(ep: *mut fid_ep, bfid: *mut fid, flags: u64) -> c_int {
    jump!((*ep).fid.ops, bind(&raw mut (*ep).fid, bfid, flags))
}

/// `fi_enable`.
pub unsafe fn fi_enable(ep: *mut fid_ep) -> c_int {
    jump!(
        (*ep).fid.ops,
        control(
            &raw mut (*ep).fid,
            FI_ENABLE as c_int,
            core::ptr::null_mut()
        )
    )
}

/// `fi_getname` of an endpoint (`fid` is the endpoint's embedded fid).
pub unsafe fn fi_getname(fid: *mut fid, addr: *mut c_void, addrlen: *mut usize) -> c_int {
    // `struct fid` is the first field of `struct fid_ep`.
    let ep = fid.cast::<fid_ep>();
    jump!((*ep).cm, getname(fid, addr, addrlen))
}

/// `fi_av_insert`.
pub unsafe fn fi_av_insert(
    av: *mut fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut fi_addr_t,
    flags: u64,
    context: *mut c_void,
) -> c_int {
    jump!((*av).ops, insert(av, addr, count, fi_addr, flags, context))
}

/// `fi_av_remove`.
pub unsafe fn fi_av_remove(
    av: *mut fid_av,
    fi_addr: *mut fi_addr_t,
    count: usize,
    flags: u64,
) -> c_int {
    jump!((*av).ops, remove(av, fi_addr, count, flags))
}

/// `fi_cntr_open`.
pub unsafe fn fi_cntr_open(
    domain: *mut fid_domain,
    attr: *mut fi_cntr_attr,
    cntr: *mut *mut fid_cntr,
    context: *mut c_void,
) -> c_int {
    jump!((*domain).ops, cntr_open(domain, attr, cntr, context))
}

/// `fi_cntr_read` (an empty ops entry reads as `u64::MAX - FI_ENOSYS + 1`, never a count a
/// caller waits for).
pub unsafe fn fi_cntr_read(cntr: *mut fid_cntr) -> u64 {
    jump!((*cntr).ops, read(cntr))
}

/// `fi_cq_read`.
pub unsafe fn fi_cq_read(cq: *mut fid_cq, buf: *mut c_void, count: usize) -> isize {
    jump!((*cq).ops, read(cq, buf, count))
}

/// `fi_cq_readerr` (into an entry of the 1.20 layout, see [`fi_cq_err_entry`]).
pub unsafe fn fi_cq_readerr(cq: *mut fid_cq, buf: *mut fi_cq_err_entry, flags: u64) -> isize {
    jump!((*cq).ops, readerr(cq, buf, flags))
}

/// `fi_cq_strerror`.
pub unsafe fn fi_cq_strerror(
    cq: *mut fid_cq,
    prov_errno: c_int,
    err_data: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    // SAFETY: the caller guarantees cq is live, so its ops table is too.
    match unsafe { (*(*cq).ops).strerror } {
        // SAFETY: the provider's implementation; the caller upholds the contract.
        Some(f) => unsafe { f(cq, prov_errno, err_data, buf, len) },
        None => core::ptr::null(),
    }
}

/// `fi_sendmsg`.
pub unsafe fn fi_sendmsg(ep: *mut fid_ep, msg: *const fi_msg, flags: u64) -> isize {
    jump!((*ep).msg, sendmsg(ep, msg, flags))
}

/// `fi_recvmsg`.
pub unsafe fn fi_recvmsg(ep: *mut fid_ep, msg: *const fi_msg, flags: u64) -> isize {
    jump!((*ep).msg, recvmsg(ep, msg, flags))
}

/// `fi_writemsg`.
pub unsafe fn fi_writemsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    jump!((*ep).rma, writemsg(ep, msg, flags))
}

/// `fi_readmsg`.
pub unsafe fn fi_readmsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    jump!((*ep).rma, readmsg(ep, msg, flags))
}
