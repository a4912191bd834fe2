//! Finding and loading libfabric at run time.

use crate::bindings::{fi_fabric_attr, fi_info, fid_fabric};
use core::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The environment variable that names the libfabric file to load (a path, or a name the
/// dynamic loader resolves). When set, nothing else is tried.
pub const ENV_LIBFABRIC: &str = "XFER_LIBFABRIC";

/// Where AWS's EFA installer puts its libfabric (p5 keeps its newer libfabric there).
pub const AWS_EFA_PATHS: [&str; 2] = [
    "/opt/amazon/efa/lib64/libfabric.so.1",
    "/opt/amazon/efa/lib/libfabric.so.1",
];

/// The name the system's dynamic loader resolves last (`LD_LIBRARY_PATH`, the ld.so
/// cache, the default directories).
pub const SYSTEM_NAME: &str = "libfabric.so.1";

/// How to install libfabric, for error messages.
const INSTALL_HINT: &str = "install it (Debian/Ubuntu: apt-get install libfabric1; on AWS the \
                            EFA installer puts it in /opt/amazon/efa) or set XFER_LIBFABRIC \
                            to the libfabric.so.1 to use";

/// Why libfabric could not be loaded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No candidate could be opened; each is listed with the loader's reason.
    #[error("libfabric not found; looked for {}: {INSTALL_HINT}", tried_list(.tried))]
    NotFound {
        /// `(candidate, dlopen's error)`, in the order tried.
        tried: Vec<(String, String)>,
    },
    /// The file named by [`ENV_LIBFABRIC`] could not be opened.
    #[error("{ENV_LIBFABRIC}={path}: {reason}")]
    EnvFile {
        /// The value of the variable.
        path: String,
        /// dlopen's error.
        reason: String,
    },
    /// The library opened but lacks a function every libfabric exports.
    #[error("{path} is not a usable libfabric: {symbol} is missing ({reason})")]
    MissingSymbol {
        /// The file that was opened.
        path: String,
        /// The function looked for, with its symbol version.
        symbol: String,
        /// dlsym's error.
        reason: String,
    },
}

/// Why one candidate could not be opened (one step of [`load`]; what reaches callers is a
/// [`LoadError`], which lists each candidate with [`OpenError::reason`]).
#[derive(Debug, thiserror::Error)]
enum OpenError {
    /// `dlopen` refused the file (missing, not a shared object, unresolved symbols, a name
    /// with a NUL).
    #[error("dlopen of {candidate} failed")]
    Dlopen {
        /// The file or name tried.
        candidate: String,
        /// The loader's error (dlerror's text).
        #[source]
        source: libloading::Error,
    },
}

impl OpenError {
    /// The loader's reason, without the name tried: its text starts with that name, which
    /// a [`LoadError`] lists already.
    fn reason(&self) -> String {
        match self {
            OpenError::Dlopen { candidate, source } => {
                let text = source.to_string();
                match text.strip_prefix(&format!("{candidate}: ")) {
                    Some(rest) => rest.to_string(),
                    None => text,
                }
            }
        }
    }
}

fn tried_list(tried: &[(String, String)]) -> String {
    tried
        .iter()
        .map(|(what, why)| format!("{what} ({why})"))
        .collect::<Vec<_>>()
        .join(", ")
}

type GetinfoFn = unsafe extern "C" fn(
    u32,
    *const c_char,
    *const c_char,
    u64,
    *const fi_info,
    *mut *mut fi_info,
) -> c_int;
type FreeinfoFn = unsafe extern "C" fn(*mut fi_info);
type DupinfoFn = unsafe extern "C" fn(*const fi_info) -> *mut fi_info;
type FabricFn =
    unsafe extern "C" fn(*mut fi_fabric_attr, *mut *mut fid_fabric, *mut c_void) -> c_int;
type VersionFn = unsafe extern "C" fn() -> u32;
type StrerrorFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// A loaded libfabric: the exported functions the crate needs, bound at the symbol
/// versions whose structs [`bindings`](crate) describe.
///
/// libfabric versions its exported symbols; `fi_getinfo`, `fi_dupinfo` and `fi_freeinfo`
/// are bound at `FABRIC_1.3` (the ABI of 1.5 through 1.17, which 2.x still exports),
/// `fi_fabric` at `FABRIC_1.1`, `fi_version` and `fi_strerror` at `FABRIC_1.0`. A library
/// without symbol versions gets its default symbols: its structs only ever grow at the end,
/// and it allocates every `fi_info` itself, so reading the 1.17 prefix stays right.
#[derive(Debug)]
pub struct Libfabric {
    path: String,
    versioned: bool,
    getinfo: GetinfoFn,
    freeinfo: FreeinfoFn,
    dupinfo: DupinfoFn,
    fabric: FabricFn,
    version: VersionFn,
    strerror: StrerrorFn,
}

static LOADED: OnceLock<Result<Libfabric, LoadError>> = OnceLock::new();

/// The libfabric of this process, loaded on first use from, in order: the file named by
/// [`ENV_LIBFABRIC`] (alone, when set), [`AWS_EFA_PATHS`], then [`SYSTEM_NAME`] through
/// the dynamic loader. The outcome is kept: later calls return the same library or error.
pub fn libfabric() -> Result<&'static Libfabric, LoadError> {
    LOADED
        .get_or_init(|| load(std::env::var(ENV_LIBFABRIC).ok().as_deref()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The library if it is already loaded (never loads it).
pub fn loaded() -> Option<&'static Libfabric> {
    LOADED.get().and_then(|r| r.as_ref().ok())
}

/// The candidates tried for `env` (the value of [`ENV_LIBFABRIC`], if set), in order.
pub fn candidates(env: Option<&str>) -> Vec<String> {
    match env {
        Some(p) if !p.is_empty() => vec![p.to_string()],
        _ => AWS_EFA_PATHS
            .iter()
            .copied()
            .filter(|p| Path::new(p).exists())
            .chain([SYSTEM_NAME])
            .map(String::from)
            .collect(),
    }
}

fn load(env: Option<&str>) -> Result<Libfabric, LoadError> {
    let explicit = env.is_some_and(|p| !p.is_empty());
    let mut tried = Vec::new();
    for candidate in candidates(env) {
        match open(&candidate) {
            Ok(lib) => return bind(candidate, lib),
            Err(e) if explicit => {
                return Err(LoadError::EnvFile {
                    path: candidate,
                    reason: e.reason(),
                });
            }
            Err(e) => tried.push((candidate, e.reason())),
        }
    }
    for p in AWS_EFA_PATHS.iter().filter(|p| !Path::new(p).exists()) {
        tried.insert(tried.len() - 1, ((*p).to_string(), "no such file".into()));
    }
    Err(LoadError::NotFound { tried })
}

fn open(candidate: &str) -> Result<libloading::os::unix::Library, OpenError> {
    // RTLD_NOW: a broken library fails here, not at the first call. RTLD_LOCAL: its
    // symbols do not leak into the process's namespace (providers load their own).
    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL;
    // SAFETY: loading libfabric runs its constructors, which only initialise its own
    // state (locks, logging, provider tables); nothing of ours runs in them.
    unsafe { libloading::os::unix::Library::open(Some(candidate), flags) }.map_err(|source| {
        OpenError::Dlopen {
            candidate: candidate.to_string(),
            source,
        }
    })
}

fn bind(path: String, library: libloading::os::unix::Library) -> Result<Libfabric, LoadError> {
    // Never closed: providers start threads and keep state that must not be unmapped
    // under them, so the handle is leaked on purpose and lives as long as the process.
    let handle = library.into_raw();
    let mut versioned = true;
    let mut sym = |name: &str, version: &str| -> Result<*mut c_void, LoadError> {
        let cname = std::ffi::CString::new(name).expect("symbol names have no NUL");
        let cver = std::ffi::CString::new(version).expect("versions have no NUL");
        // SAFETY: handle comes from dlopen and is never closed; both strings are
        // NUL-terminated; dlvsym only looks the name up.
        let p = unsafe { libc::dlvsym(handle, cname.as_ptr(), cver.as_ptr()) };
        if !p.is_null() {
            return Ok(p);
        }
        versioned = false;
        // SAFETY: as above, for the default version of the symbol.
        let p = unsafe { libc::dlsym(handle, cname.as_ptr()) };
        if !p.is_null() {
            return Ok(p);
        }
        Err(LoadError::MissingSymbol {
            path: path.clone(),
            symbol: format!("{name}@{version}"),
            reason: dlerror().unwrap_or_else(|| "not exported".into()),
        })
    };
    let getinfo = sym("fi_getinfo", "FABRIC_1.3")?;
    let freeinfo = sym("fi_freeinfo", "FABRIC_1.3")?;
    let dupinfo = sym("fi_dupinfo", "FABRIC_1.3")?;
    let fabric = sym("fi_fabric", "FABRIC_1.1")?;
    let version = sym("fi_version", "FABRIC_1.0")?;
    let strerror = sym("fi_strerror", "FABRIC_1.0")?;
    // SAFETY: each of the six pointers is the address of the libfabric function of that
    // name and ABI version, whose C signature (fabric.h) is the one transmuted to.
    unsafe {
        Ok(Libfabric {
            path,
            versioned,
            getinfo: std::mem::transmute::<*mut c_void, GetinfoFn>(getinfo),
            freeinfo: std::mem::transmute::<*mut c_void, FreeinfoFn>(freeinfo),
            dupinfo: std::mem::transmute::<*mut c_void, DupinfoFn>(dupinfo),
            fabric: std::mem::transmute::<*mut c_void, FabricFn>(fabric),
            version: std::mem::transmute::<*mut c_void, VersionFn>(version),
            strerror: std::mem::transmute::<*mut c_void, StrerrorFn>(strerror),
        })
    }
}

/// The loader's last error text, if any.
fn dlerror() -> Option<String> {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl*
    // call on this thread, copied at once.
    let e = unsafe { libc::dlerror() };
    // SAFETY: non-null, NUL-terminated (see above).
    (!e.is_null()).then(|| unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned())
}

impl Libfabric {
    /// The file that was loaded (as it was named: a path, or `libfabric.so.1`).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The file the dynamic loader actually mapped, resolved through `dladdr` of
    /// `fi_version` (the real path behind `libfabric.so.1`), if known.
    pub fn resolved_path(&self) -> Option<PathBuf> {
        let mut info: libc::Dl_info = empty_dl_info();
        // SAFETY: fi_version is a function inside the loaded library; dladdr only reads
        // the loader's tables and fills `info`.
        let rc = unsafe { libc::dladdr(self.version as *const c_void, &mut info) };
        if rc == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while
        // the library stays loaded (for the life of the process).
        let name = unsafe { CStr::from_ptr(info.dli_fname) };
        std::fs::canonicalize(name.to_string_lossy().as_ref()).ok()
    }

    /// Whether every function was found at its symbol version (see [`Libfabric`]).
    pub fn versioned(&self) -> bool {
        self.versioned
    }

    /// `fi_version()`: the library's API version ([`FI_MAJOR`](crate::FI_MAJOR) /
    /// [`FI_MINOR`](crate::FI_MINOR) split it).
    pub fn version(&self) -> u32 {
        // SAFETY: fi_version takes no arguments and returns a constant.
        unsafe { (self.version)() }
    }

    /// `fi_strerror(code)` (the sign of `code` does not matter).
    pub fn strerror(&self, code: i32) -> String {
        // SAFETY: fi_strerror accepts any number and returns a static NUL-terminated
        // string, or null.
        let text = unsafe { (self.strerror)(code.saturating_abs()) };
        if text.is_null() {
            return format!("libfabric error {code}");
        }
        // SAFETY: non-null, static and NUL-terminated.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// `fi_getinfo`.
    ///
    /// # Safety
    /// As in C: `node` and `service` null or NUL-terminated, `hints` null or an `fi_info`
    /// from [`fi_dupinfo`](Self::fi_dupinfo) / [`fi_allocinfo`](Self::fi_allocinfo), `info`
    /// writable; the list it returns is freed with [`fi_freeinfo`](Self::fi_freeinfo).
    pub unsafe fn fi_getinfo(
        &self,
        version: u32,
        node: *const c_char,
        service: *const c_char,
        flags: u64,
        hints: *const fi_info,
        info: *mut *mut fi_info,
    ) -> c_int {
        // SAFETY: the caller upholds fi_getinfo's contract.
        unsafe { (self.getinfo)(version, node, service, flags, hints, info) }
    }

    /// `fi_freeinfo`.
    ///
    /// # Safety
    /// `info` is null or a list this library allocated, freed once.
    pub unsafe fn fi_freeinfo(&self, info: *mut fi_info) {
        // SAFETY: the caller upholds fi_freeinfo's contract.
        unsafe { (self.freeinfo)(info) }
    }

    /// `fi_dupinfo`.
    ///
    /// # Safety
    /// `info` is null or a valid `fi_info`.
    pub unsafe fn fi_dupinfo(&self, info: *const fi_info) -> *mut fi_info {
        // SAFETY: the caller upholds fi_dupinfo's contract.
        unsafe { (self.dupinfo)(info) }
    }

    /// `fi_allocinfo()`: `fi_dupinfo(NULL)`, an empty `fi_info` with its attribute structs
    /// allocated (null on failure).
    pub fn fi_allocinfo(&self) -> *mut fi_info {
        // SAFETY: fi_dupinfo(NULL) has no preconditions.
        unsafe { (self.dupinfo)(std::ptr::null()) }
    }

    /// `fi_fabric`.
    ///
    /// # Safety
    /// `attr` is the `fabric_attr` of a live `fi_info` of this library; `fabric` writable.
    pub unsafe fn fi_fabric(
        &self,
        attr: *mut fi_fabric_attr,
        fabric: *mut *mut fid_fabric,
        context: *mut c_void,
    ) -> c_int {
        // SAFETY: the caller upholds fi_fabric's contract.
        unsafe { (self.fabric)(attr, fabric, context) }
    }
}

fn empty_dl_info() -> libc::Dl_info {
    libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_file_is_the_only_candidate() {
        assert_eq!(candidates(Some("/x/libfabric.so.1")), ["/x/libfabric.so.1"]);
        let default = candidates(None);
        assert_eq!(default.last().map(String::as_str), Some(SYSTEM_NAME));
        assert_eq!(candidates(Some("")), default);
    }

    #[test]
    fn a_missing_explicit_file_names_the_variable() {
        let e = load(Some("/nonexistent/libfabric.so.1")).unwrap_err();
        assert!(matches!(e, LoadError::EnvFile { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.starts_with("XFER_LIBFABRIC=/nonexistent/libfabric.so.1: "),
            "{text}"
        );
    }

    #[test]
    fn a_refused_candidate_keeps_the_loaders_error_and_drops_the_name_it_repeats() {
        let path = "/nonexistent/libfabric.so.1";
        let e = open(path).unwrap_err();
        let OpenError::Dlopen { candidate, source } = &e;
        assert_eq!(candidate, path);
        assert!(
            matches!(source, libloading::Error::DlOpen { .. }),
            "{source:?}"
        );
        let reason = e.reason();
        assert!(!reason.starts_with(path), "{reason}");
        assert!(source.to_string().ends_with(&reason), "{source} / {reason}");
        let e = open("lib\0fabric.so.1").unwrap_err();
        assert!(!e.reason().is_empty(), "{e:?}");
    }

    #[test]
    fn a_library_that_is_not_libfabric_is_refused() {
        // libc opens fine but has no fi_getinfo.
        let e = load(Some("libc.so.6")).unwrap_err();
        match e {
            LoadError::MissingSymbol { symbol, .. } => assert_eq!(symbol, "fi_getinfo@FABRIC_1.3"),
            other => panic!("expected MissingSymbol, got {other:?}"),
        }
    }

    #[test]
    fn not_found_lists_every_place_and_says_how_to_install() {
        let e = LoadError::NotFound {
            tried: vec![
                (
                    "/opt/amazon/efa/lib64/libfabric.so.1".into(),
                    "no such file".into(),
                ),
                (
                    "libfabric.so.1".into(),
                    "cannot open shared object file".into(),
                ),
            ],
        };
        let text = e.to_string();
        assert!(
            text.contains("/opt/amazon/efa/lib64/libfabric.so.1 (no such file)"),
            "{text}"
        );
        assert!(text.contains("apt-get install libfabric1"), "{text}");
        assert!(text.contains("XFER_LIBFABRIC"), "{text}");
    }
}
