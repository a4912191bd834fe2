//! Provider discovery: what `fi_getinfo` offers for FI_EP_RDM with FI_MSG | FI_RMA, the
//! hints this crate asks with, and the API version it requests.

use crate::fi::{InfoList, c_str, c_strdup, check, lib};
use fabric_core::{Error, Result};
use libfabric_sys as sys;
use serde::Serialize;
use std::fmt;

/// The libfabric this process loaded (see [`libfabric_sys::libfabric`] for where it is
/// looked for), for `xfer info`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Library {
    /// The file as it was named (`XFER_LIBFABRIC`'s value, an `/opt/amazon/efa` path, or
    /// `libfabric.so.1`).
    pub path: String,
    /// The file the loader mapped, with symbolic links resolved, where known.
    pub resolved: Option<String>,
    /// The library's version (`fi_version`), `(major, minor)`.
    pub version: (u32, u32),
    /// The API version this crate asks it for (see [`requested_api_version`]).
    pub api: (u32, u32),
    /// Whether its functions were found at the symbol versions the bindings describe.
    pub versioned: bool,
}

/// Loads libfabric (once per process) and says which file, version and API version.
///
/// Fails with [`Error::Backend`] (call `"loading libfabric"`) naming every place looked at
/// and how to install it.
pub fn library() -> Result<Library> {
    let lib = lib()?;
    let v = lib.version();
    let a = api_version(lib);
    Ok(Library {
        path: lib.path().to_string(),
        resolved: lib.resolved_path().map(|p| p.display().to_string()),
        version: (sys::FI_MAJOR(v), sys::FI_MINOR(v)),
        api: (sys::FI_MAJOR(a), sys::FI_MINOR(a)),
        versioned: lib.versioned(),
    })
}

/// The version of the libfabric library loaded at run time, as `(major, minor)`.
pub fn libfabric_version() -> Result<(u32, u32)> {
    library().map(|l| l.version)
}

/// The API version this crate asks `fi_getinfo` for: 1.20 (1.18 is the first where the EFA
/// provider uses the device's RDMA write instead of emulating it; 1.20 adds dmabuf
/// registration), but never above the library loaded at run time (a newer request fails
/// with `-FI_ENOSYS`). The structs passed to the library are those of 1.20 (see
/// `libfabric_sys`), which an older library reads a prefix of.
pub fn requested_api_version() -> Result<(u32, u32)> {
    library().map(|l| l.api)
}

/// The API version we request from `lib`.
pub(crate) fn api_version(lib: &sys::Libfabric) -> u32 {
    sys::FI_VERSION(1, 20).min(lib.version())
}

/// Whether `lib`, asked for our API version, takes dmabuf registrations (FI_MR_DMABUF).
pub(crate) fn has_dmabuf(lib: &sys::Libfabric) -> bool {
    api_version(lib) >= sys::FI_VERSION(1, 20)
}

/// A provider's progress model (`fi_progress`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Progress {
    /// The provider makes progress on its own (FI_PROGRESS_AUTO).
    Auto,
    /// The application must call into the provider (reading the CQ) for progress
    /// (FI_PROGRESS_MANUAL): a target must keep polling for writes to land.
    Manual,
    /// Not specified (FI_PROGRESS_UNSPEC) or unknown.
    Unspecified,
}

impl Progress {
    fn from_raw(p: sys::fi_progress) -> Progress {
        match p {
            sys::FI_PROGRESS_AUTO => Progress::Auto,
            sys::FI_PROGRESS_MANUAL => Progress::Manual,
            _ => Progress::Unspecified,
        }
    }
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Progress::Auto => "auto",
            Progress::Manual => "manual",
            Progress::Unspecified => "unspecified",
        })
    }
}

/// What one provider offers on one fabric and domain for FI_EP_RDM with FI_MSG | FI_RMA.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ProviderInfo {
    /// Provider name as libfabric reports it (`efa`, `tcp;ofi_rxm`, `sockets`, `shm`).
    pub provider: String,
    /// Fabric name (a subnet for socket providers, e.g. `127.0.0.1/32`).
    pub fabric: String,
    /// Domain name (a NIC or interface: `rdmap0s31-rdm`, `lo`, `eth0`).
    pub domain: String,
    /// Memory-registration mode bits, by name (`FI_MR_VIRT_ADDR`, `FI_MR_PROV_KEY`, ...).
    pub mr_mode: Vec<&'static str>,
    /// Size of a memory key in bytes.
    pub mr_key_size: usize,
    /// Bytes of remote CQ data (immediate data) a write or send can carry.
    pub cq_data_size: usize,
    /// Largest message or write in bytes.
    pub max_msg_size: u64,
    /// Local buffers per message.
    pub iov_limit: usize,
    /// Remote buffers per RMA operation.
    pub rma_iov_limit: usize,
    /// Largest inject (buffered) operation in bytes.
    pub inject_size: usize,
    /// Data progress model.
    pub data_progress: Progress,
    /// Control progress model.
    pub control_progress: Progress,
    /// Transmit queue depth.
    pub tx_size: usize,
    /// Receive queue depth.
    pub rx_size: usize,
    /// Whether the provider offers FI_HMEM here. Whether this libfabric was built with the
    /// CUDA interface shows only at registration: Debian's and Ubuntu's 1.17 offer FI_HMEM
    /// on shm but refuse CUDA memory (see `EfaTransport`'s `register`).
    pub hmem: bool,
}

const MR_MODE_NAMES: &[(u64, &str)] = &[
    (sys::FI_MR_LOCAL, "FI_MR_LOCAL"),
    (sys::FI_MR_RAW, "FI_MR_RAW"),
    (sys::FI_MR_VIRT_ADDR, "FI_MR_VIRT_ADDR"),
    (sys::FI_MR_ALLOCATED, "FI_MR_ALLOCATED"),
    (sys::FI_MR_PROV_KEY, "FI_MR_PROV_KEY"),
    (sys::FI_MR_MMU_NOTIFY, "FI_MR_MMU_NOTIFY"),
    (sys::FI_MR_RMA_EVENT, "FI_MR_RMA_EVENT"),
    (sys::FI_MR_ENDPOINT, "FI_MR_ENDPOINT"),
    (sys::FI_MR_HMEM, "FI_MR_HMEM"),
    (sys::FI_MR_COLLECTIVE, "FI_MR_COLLECTIVE"),
];

/// The names of the bits set in `mr_mode`.
pub(crate) fn mr_mode_names(mr_mode: u64) -> Vec<&'static str> {
    MR_MODE_NAMES
        .iter()
        .filter(|(bit, _)| mr_mode & bit != 0)
        .map(|&(_, name)| name)
        .collect()
}

/// The mr_mode bits this crate can live with (the others it cannot honour: FI_MR_RAW
/// needs raw keys, FI_MR_MMU_NOTIFY `fi_mr_refresh`, FI_MR_RMA_EVENT counters).
pub(crate) fn supported_mr_mode(hmem: bool) -> u64 {
    let base = sys::FI_MR_LOCAL
        | sys::FI_MR_VIRT_ADDR
        | sys::FI_MR_ALLOCATED
        | sys::FI_MR_PROV_KEY
        | sys::FI_MR_ENDPOINT;
    if hmem { base | sys::FI_MR_HMEM } else { base }
}

/// Builds the hints for FI_EP_RDM with FI_MSG | FI_RMA (and FI_HMEM when asked).
fn hints(
    lib: &'static sys::Libfabric,
    hmem: bool,
    provider: Option<&str>,
    rma_event: bool,
) -> Result<InfoList> {
    let hints = InfoList::alloc(lib)?;
    let p = hints.as_ptr();
    // SAFETY: fi_allocinfo returned an fi_info whose attribute pointers are all allocated;
    // we are its only user. Strings we put in are malloc'ed, as fi_freeinfo expects.
    unsafe {
        (*p).caps = sys::FI_MSG
            | sys::FI_RMA
            | if hmem { sys::FI_HMEM } else { 0 }
            | if rma_event { sys::FI_RMA_EVENT } else { 0 };
        // We give every operation a context of fi_context2 size, which satisfies both.
        (*p).mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
        (*(*p).ep_attr).type_ = sys::FI_EP_RDM;
        (*(*p).domain_attr).mr_mode = supported_mr_mode(hmem) as i32;
        (*(*p).domain_attr).threading = sys::FI_THREAD_DOMAIN;
        (*(*p).domain_attr).av_type = sys::FI_AV_TABLE;
        // SEND/RECV must be delivered in order; a WRITE's completion must mean the bytes
        // are in the target's memory.
        (*(*p).tx_attr).msg_order = sys::FI_ORDER_SAS;
        (*(*p).rx_attr).msg_order = sys::FI_ORDER_SAS;
        (*(*p).tx_attr).op_flags = sys::FI_DELIVERY_COMPLETE;
        if let Some(name) = provider {
            (*(*p).fabric_attr).prov_name = c_strdup(name)?;
        }
    }
    Ok(hints)
}

/// Calls `fi_getinfo` with our hints; `Ok(None)` when nothing matches (-FI_ENODATA).
pub(crate) fn getinfo(hmem: bool, provider: Option<&str>) -> Result<Option<InfoList>> {
    getinfo_with(hmem, provider, false)
}

/// As [`getinfo`], also asking for FI_RMA_EVENT (counters of peers' RMA) with `rma_event`.
pub(crate) fn getinfo_with(
    hmem: bool,
    provider: Option<&str>,
    rma_event: bool,
) -> Result<Option<InfoList>> {
    let lib = lib()?;
    let hints = hints(lib, hmem, provider, rma_event)?;
    let mut out: *mut sys::fi_info = std::ptr::null_mut();
    // SAFETY: hints is a valid fi_info of this library; out receives a list we own (freed
    // by InfoList).
    let rc = unsafe {
        lib.fi_getinfo(
            api_version(lib),
            std::ptr::null(),
            std::ptr::null(),
            0,
            hints.as_ptr(),
            &mut out,
        )
    };
    if rc == -(sys::FI_ENODATA) {
        return Ok(None);
    }
    check("fi_getinfo", rc as isize)?;
    Ok(InfoList::from_raw(lib, out))
}

/// Reads the attributes of one `fi_info` entry (hmem set to `hmem`).
pub(crate) fn summarize(e: &sys::fi_info, hmem: bool) -> ProviderInfo {
    // SAFETY: entries returned by fi_getinfo have all attribute pointers set and valid for
    // as long as the entry (borrowed here).
    let (fab, dom, ep, tx, rx) = unsafe {
        (
            &*e.fabric_attr,
            &*e.domain_attr,
            &*e.ep_attr,
            &*e.tx_attr,
            &*e.rx_attr,
        )
    };
    ProviderInfo {
        provider: c_str(fab.prov_name),
        fabric: c_str(fab.name),
        domain: c_str(dom.name),
        mr_mode: mr_mode_names(dom.mr_mode as u32 as u64),
        mr_key_size: dom.mr_key_size,
        cq_data_size: dom.cq_data_size,
        max_msg_size: ep.max_msg_size as u64,
        iov_limit: tx.iov_limit,
        rma_iov_limit: tx.rma_iov_limit,
        inject_size: tx.inject_size,
        data_progress: Progress::from_raw(dom.data_progress),
        control_progress: Progress::from_raw(dom.control_progress),
        tx_size: tx.size,
        rx_size: rx.size,
        hmem,
    }
}

/// The providers that offer FI_EP_RDM with FI_MSG | FI_RMA (| FI_HMEM) here, by name.
pub(crate) fn provider_names(hmem: bool) -> Vec<String> {
    let mut names: Vec<String> = match getinfo(hmem, None) {
        Ok(Some(list)) => list.iter().map(|e| summarize(e, false).provider).collect(),
        _ => Vec::new(),
    };
    names.dedup();
    let mut seen = Vec::new();
    names.retain(|n| {
        let fresh = !seen.contains(n);
        seen.push(n.clone());
        fresh
    });
    names
}

/// The error for "no provider of that name offers what we need".
pub(crate) fn no_such_provider(provider: &str, hmem: bool) -> Error {
    let names = provider_names(hmem);
    let mut known = if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    };
    if hmem {
        known.push_str(" (efa offers FI_HMEM on AWS, shm where CUDA is installed)");
    }
    let env = std::env::var("FI_PROVIDER")
        .map(|v| format!(" (FI_PROVIDER={v} also limits what libfabric reports)"))
        .unwrap_or_default();
    Error::Unsupported(format!(
        "libfabric provider {provider:?} offers no FI_EP_RDM endpoint with FI_MSG|FI_RMA{} \
         here{env}; providers that do: {known}",
        if hmem { "|FI_HMEM" } else { "" }
    ))
}

/// Lists, per provider, fabric and domain, what libfabric offers for FI_EP_RDM with
/// FI_MSG | FI_RMA, and whether FI_HMEM is offered too.
///
/// With `provider`, only that provider (matched the way libfabric matches `FI_PROVIDER`,
/// so `tcp` finds `tcp;ofi_rxm`); an unknown name is an [`Error::Unsupported`] that lists
/// the providers that exist. With `None`, every provider (an empty list if there is none).
pub fn info(provider: Option<&str>) -> Result<Vec<ProviderInfo>> {
    let Some(list) = getinfo(false, provider)? else {
        return match provider {
            Some(p) => Err(no_such_provider(p, false)),
            None => Ok(Vec::new()),
        };
    };
    let mut out: Vec<ProviderInfo> = Vec::new();
    for e in list.iter() {
        let s = summarize(e, false);
        if !out.contains(&s) {
            out.push(s);
        }
    }
    // Providers without FI_HMEM answer -FI_ENODATA to a request that names it, so ask
    // separately and mark the places that answered.
    if let Ok(Some(hmem)) = getinfo(true, provider) {
        for e in hmem.iter() {
            let h = summarize(e, true);
            for s in out.iter_mut().filter(|s| {
                s.provider == h.provider && s.fabric == h.fabric && s.domain == h.domain
            }) {
                s.hmem = true;
            }
        }
    }
    Ok(out)
}
