//! The provider alone, for comparison with `efa_loopback_bw` and `xfer demo --transport efa`:
//! `fi_writemsg` of scattered pages between two FI_EP_RDM endpoints of one process, written
//! against libfabric-sys directly (none of this crate's code on the path).
//!
//! ```text
//! cargo run --release -p transport-efa --example fi_raw_bw -- [provider] [page KiB] [MiB total] [depth] [dc|default] [1|2]
//! cargo run --release -p transport-efa --example fi_raw_bw -- tcp 64 4096 64 dc 2
//! ```
//!
//! `dc` asks every write for FI_DELIVERY_COMPLETE (what `EfaTransport` does), `default`
//! for the provider's default completion. With `1` one thread drives both endpoints (as
//! `efa_loopback_bw` does); with `2` the target's CQ is read by a thread of its own, in a
//! busy loop (the best a target thread can do for a provider with manual progress).

use libfabric_sys as sys;
use std::ffi::{CString, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn check(call: &str, rc: isize) -> Res<isize> {
    if rc < 0 {
        let text = sys::loaded().map_or_else(|| format!("error {rc}"), |l| l.strerror(rc as i32));
        return Err(format!("{call}: {text}").into());
    }
    Ok(rc)
}

/// One endpoint with its fabric, domain, AV and CQ (leaked: the process ends with it).
struct Ep {
    ep: *mut sys::fid_ep,
    cq: *mut sys::fid_cq,
    av: *mut sys::fid_av,
    domain: *mut sys::fid_domain,
    mr_mode: u64,
}

// SAFETY: each endpoint is used by one thread at a time (FI_THREAD_DOMAIN).
unsafe impl Send for Ep {}

fn open(provider: &str, dc: bool) -> Res<Ep> {
    let lib = sys::libfabric()?;
    // fi_allocinfo returns a zeroed fi_info with its attribute structs allocated; strings
    // put in it are malloc'ed (strdup) as fi_freeinfo expects.
    let hints = lib.fi_allocinfo();
    let name = CString::new(provider)?;
    // SAFETY: hints is valid; see above.
    unsafe {
        (*hints).caps = sys::FI_MSG | sys::FI_RMA;
        (*hints).mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
        (*(*hints).ep_attr).type_ = sys::FI_EP_RDM;
        (*(*hints).domain_attr).mr_mode = (sys::FI_MR_LOCAL
            | sys::FI_MR_VIRT_ADDR
            | sys::FI_MR_ALLOCATED
            | sys::FI_MR_PROV_KEY
            | sys::FI_MR_ENDPOINT) as i32;
        (*(*hints).domain_attr).threading = sys::FI_THREAD_DOMAIN;
        (*(*hints).domain_attr).av_type = sys::FI_AV_TABLE;
        if dc {
            (*(*hints).tx_attr).op_flags = sys::FI_DELIVERY_COMPLETE;
        }
        (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
        if matches!(provider, "tcp" | "sockets") {
            (*(*hints).domain_attr).name = libc::strdup(c"lo".as_ptr());
        }
    }
    let mut info = std::ptr::null_mut();
    // SAFETY: hints is a valid fi_info; info receives a list.
    let rc = unsafe {
        lib.fi_getinfo(
            sys::FI_VERSION(1, 20).min(lib.version()),
            std::ptr::null(),
            std::ptr::null(),
            0,
            hints,
            &mut info,
        )
    };
    check("fi_getinfo", rc as isize)?;
    // SAFETY: info is a valid list entry; every object is opened from it in order.
    unsafe {
        let mut fabric = std::ptr::null_mut();
        check(
            "fi_fabric",
            lib.fi_fabric((*info).fabric_attr, &mut fabric, std::ptr::null_mut()) as isize,
        )?;
        let mut domain = std::ptr::null_mut();
        check(
            "fi_domain",
            sys::fi_domain(fabric, info, &mut domain, std::ptr::null_mut()) as isize,
        )?;
        let mut av_attr = sys::fi_av_attr {
            type_: sys::FI_AV_TABLE,
            count: 4,
            ..Default::default()
        };
        let mut av = std::ptr::null_mut();
        check(
            "fi_av_open",
            sys::fi_av_open(domain, &mut av_attr, &mut av, std::ptr::null_mut()) as isize,
        )?;
        let mut cq_attr = sys::fi_cq_attr {
            size: (*(*info).tx_attr).size + (*(*info).rx_attr).size,
            format: sys::FI_CQ_FORMAT_DATA,
            wait_obj: sys::FI_WAIT_NONE,
            ..Default::default()
        };
        let mut cq = std::ptr::null_mut();
        check(
            "fi_cq_open",
            sys::fi_cq_open(domain, &mut cq_attr, &mut cq, std::ptr::null_mut()) as isize,
        )?;
        let mut ep = std::ptr::null_mut();
        check(
            "fi_endpoint",
            sys::fi_endpoint(domain, info, &mut ep, std::ptr::null_mut()) as isize,
        )?;
        check(
            "fi_ep_bind",
            sys::fi_ep_bind(ep, &mut (*av).fid, 0) as isize,
        )?;
        check(
            "fi_ep_bind",
            sys::fi_ep_bind(ep, &mut (*cq).fid, sys::FI_TRANSMIT | sys::FI_RECV) as isize,
        )?;
        check("fi_enable", sys::fi_enable(ep) as isize)?;
        let mr_mode = (*(*info).domain_attr).mr_mode as u32 as u64;
        Ok(Ep {
            ep,
            cq,
            av,
            domain,
            mr_mode,
        })
    }
}

/// Registers `buf`; returns (mr, the address peers use for byte 0, key).
fn register(e: &Ep, buf: &mut [u8], access: u64, key: u64) -> Res<(*mut sys::fid_mr, u64, u64)> {
    let mut mr = std::ptr::null_mut();
    // SAFETY: domain is open; buf outlives the registration (the process ends first).
    unsafe {
        check(
            "fi_mr_reg",
            sys::fi_mr_reg(
                e.domain,
                buf.as_mut_ptr().cast(),
                buf.len(),
                access,
                0,
                key,
                0,
                &mut mr,
                std::ptr::null_mut(),
            ) as isize,
        )?;
        if e.mr_mode & sys::FI_MR_ENDPOINT != 0 {
            check(
                "fi_mr_bind",
                sys::fi_mr_bind(mr, &mut (*e.ep).fid, 0) as isize,
            )?;
            check("fi_mr_enable", sys::fi_mr_enable(mr) as isize)?;
        }
        let key = if e.mr_mode & sys::FI_MR_PROV_KEY != 0 {
            sys::fi_mr_key(mr)
        } else {
            key
        };
        let addr = if e.mr_mode & sys::FI_MR_VIRT_ADDR != 0 {
            buf.as_ptr() as u64
        } else {
            0
        };
        Ok((mr, addr, key))
    }
}

/// Reads `cq` once; returns completions, or an error for an error entry.
fn read(cq: *mut sys::fid_cq) -> Res<usize> {
    let mut entries = [sys::fi_cq_data_entry::default(); 64];
    // SAFETY: cq is open with FI_CQ_FORMAT_DATA; entries has room for 64.
    let rc = unsafe { sys::fi_cq_read(cq, entries.as_mut_ptr().cast(), 64) };
    if rc == -(sys::FI_EAGAIN as isize) {
        return Ok(0);
    }
    if rc == -(sys::FI_EAVAIL as isize) {
        let mut err = sys::fi_cq_err_entry::default();
        // SAFETY: as above; err is a zeroed entry.
        unsafe { sys::fi_cq_readerr(cq, &mut err, 0) };
        return Err(format!("completion error {}", err.err).into());
    }
    Ok(check("fi_cq_read", rc)? as usize)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let provider = args.first().map_or("tcp", String::as_str);
    let page: u64 = args.get(1).map_or(Ok(64), |s| s.parse())? * 1024;
    let total: u64 = args.get(2).map_or(Ok(1024), |s| s.parse())? << 20;
    let depth: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let dc = args.get(4).is_none_or(|s| s != "default");
    let threads: usize = args.get(5).map_or(Ok(1), |s| s.parse())?;
    let a = open(provider, dc)?;
    let b = open(provider, dc)?;
    let region = 64usize << 20;
    let mut src = vec![1u8; region];
    let mut dst = vec![0u8; region];
    let (src_mr, _, _) = register(&a, &mut src, sys::FI_WRITE | sys::FI_SEND, 1)?;
    let (_dst_mr, dst_addr, dst_key) = register(&b, &mut dst, sys::FI_REMOTE_WRITE, 2)?;
    let mut name = vec![0u8; 64];
    let mut len = name.len();
    // SAFETY: b.ep is open; name is writable for len bytes.
    check("fi_getname", unsafe {
        sys::fi_getname(&mut (*b.ep).fid, name.as_mut_ptr().cast(), &mut len)
    } as isize)?;
    let mut peer: sys::fi_addr_t = 0;
    // SAFETY: a.av is open; name holds one address of its format.
    check("fi_av_insert", unsafe {
        sys::fi_av_insert(
            a.av,
            name.as_ptr().cast(),
            1,
            &mut peer,
            0,
            std::ptr::null_mut(),
        )
    } as isize)?;

    // The target: polled in this thread, or in its own.
    let stop = Arc::new(AtomicBool::new(false));
    let target_cq = b.cq as usize;
    let target = (threads == 2).then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = read(target_cq as *mut sys::fid_cq);
            }
        })
    });

    let pages = region as u64 / page;
    let n = total / page;
    // SAFETY: src_mr is open.
    let desc = unsafe { sys::fi_mr_desc(src_mr) };
    let flags = sys::FI_COMPLETION | if dc { sys::FI_DELIVERY_COMPLETE } else { 0 };
    let mut contexts = vec![sys::fi_context2::default(); depth];
    let (mut posted, mut completed) = (0u64, 0u64);
    let mut start = None;
    while completed < n {
        while posted < n && posted - completed < depth as u64 {
            let i = (posted * 7919) % pages;
            let mut iov = libc::iovec {
                iov_base: src[(i * page) as usize..].as_mut_ptr().cast::<c_void>(),
                iov_len: page as usize,
            };
            let rma = sys::fi_rma_iov {
                addr: dst_addr + ((i * 31) % pages) * page,
                len: page as usize,
                key: dst_key,
            };
            let mut d = [desc];
            let msg = sys::fi_msg_rma {
                msg_iov: (&raw mut iov).cast(),
                desc: d.as_mut_ptr(),
                iov_count: 1,
                addr: peer,
                rma_iov: &rma,
                rma_iov_count: 1,
                context: (&raw mut contexts[(posted % depth as u64) as usize]).cast(),
                data: 0,
            };
            // SAFETY: msg describes registered buffers that outlive the write; its context
            // is not reused before the write completes (at most `depth` in flight).
            let rc = unsafe { sys::fi_writemsg(a.ep, &msg, flags) };
            if rc == -(sys::FI_EAGAIN as isize) {
                break;
            }
            check("fi_writemsg", rc)?;
            posted += 1;
        }
        let got = read(a.cq)? as u64;
        if got > 0 {
            start.get_or_insert_with(Instant::now);
        }
        completed += got;
        if target.is_none() {
            read(b.cq)?;
        }
    }
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = target {
        let _ = t.join();
    }
    println!(
        "{provider} (provider only, {}, {threads} thread(s)): {n} writes of {} KiB, depth {depth}: {:.2} Gbit/s",
        if dc {
            "FI_DELIVERY_COMPLETE"
        } else {
            "default completion"
        },
        page / 1024,
        ((n - 1) * page) as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}
