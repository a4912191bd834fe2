//! Python memory as agent regions: host buffers taken through the buffer protocol, CUDA
//! tensors through `__cuda_array_interface__`, and other tensors (CPU or CUDA) through
//! DLPack (`__dlpack__`).
//!
//! A region reaches the transports as a raw pointer and a length ([`MemoryRegion`]); what
//! keeps the memory alive is a [`Held`]: the buffer-protocol view (which holds the exporting
//! object and keeps numpy from resizing or freeing it) or a reference to the tensor (or its
//! DLPack capsule), and for a torch tensor its storage too. The `Held` goes to the agent
//! with the region (`xfer::Agent::register_kept`), which drops it only once the region is
//! deregistered and no transport holds it any more (for the whole process if a transport
//! never lets go), so deleting the array in Python while it is registered is safe.
//!
//! A torch tensor is not its memory: `t.set_(other)` points it at another storage (and the
//! old one is freed once nothing else holds it), and `t.resize_(bigger)` reallocates its
//! storage in place (the same storage object, new memory; the old memory freed). So a
//! tensor's registration holds its *storage* ([`StorageGuard`]), which makes `set_` and
//! `del` harmless, and records where the storage's memory was; torch has no Python call
//! that makes a storage non-resizable, so a resize is detected instead: before each local
//! use of the registration ([`StorageGuard::check`]) the storage's address and size are
//! compared with those recorded, and a change raises `xfer.RegionInvalidated`.
//!
//! Read-only memory is registered for peers' writes nowhere: the buffer protocol's and
//! `__cuda_array_interface__`'s read-only flags, and DLPack 1.x's
//! `DLPACK_FLAG_BITMASK_READ_ONLY` (asked for with `__dlpack__(max_version=(1, 0))`), make
//! `remote_write=True` an `InvalidArgument`. A producer that only speaks the unversioned
//! DLPack (no flags) is taken as writable.

use crate::errors::{RegionInvalidated, invalid};
use fabric_core::{MemoryLocation, MemoryRegion};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};
use std::ptr::NonNull;
use std::sync::Arc;

/// Host memory a Python object exports through the buffer protocol.
pub struct PyHostRegion {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is a plain address range; every access through it is a raw-pointer
// copy by a transport, which the MemoryRegion contract already makes the application
// synchronise (it reads a range only once the transfer writing it has completed).
unsafe impl Send for PyHostRegion {}
// SAFETY: as above; &PyHostRegion exposes no reference into the bytes.
unsafe impl Sync for PyHostRegion {}

// SAFETY: ptr and len come from a buffer-protocol view of a C-contiguous buffer, or from
// the DLPack capsule of a contiguous CPU tensor (both checked in `take`). The view (or the
// capsule, which holds the tensor) is the `Held` that `take` returns with the region, and
// the agent registers the two together (`Agent::register_kept`), which drops the `Held`
// only once the region's Arc is the last one (no transport holds the region), so for as
// long as any transport can reach this value the exporter keeps the bytes where they are
// (numpy refuses to resize an array with exported views).
unsafe impl MemoryRegion for PyHostRegion {
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Host
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }
    fn device_addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

/// Device memory of a CUDA tensor (torch, cupy, ...), by address.
pub struct CudaTensorRegion {
    ptr: u64,
    len: usize,
    device: u32,
}

// SAFETY: ptr..ptr+len is device memory on `device` (checked with the driver in
// `cuda_region`), allocated by the tensor's library; the tensor (or its capsule) is the
// `Held` registered with this region (`Agent::register_kept`), dropped only when no
// transport holds the region. host_ptr is None: transports reach the bytes with device
// copies only.
unsafe impl MemoryRegion for CudaTensorRegion {
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda {
            device: self.device,
        }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        self.ptr
    }
}

/// What keeps a registered region's memory alive, handed to the agent with the region
/// (`Agent::register_kept`). Never read: held for its drop, which gives the view (or the
/// references) back.
pub struct Held {
    /// The view, the tensor or its capsule.
    _what: Keep,
    /// A torch tensor's storage (the memory itself: the tensor may be pointed elsewhere
    /// with `set_` while this is held), released when dropped.
    _storage: Option<Py<PyAny>>,
}

/// The first half of a [`Held`].
enum Keep {
    /// The buffer-protocol view (it holds the exporting object).
    View {
        /// Released when dropped.
        _view: PyBuffer<u8>,
    },
    /// The tensor itself, or its DLPack capsule.
    Object {
        /// Released when dropped.
        _obj: Py<PyAny>,
    },
}

/// A torch tensor's storage as it was when the tensor was registered: the storage object
/// (held, so that its memory is not freed while the registration lives, whatever becomes
/// of the tensor) and where its memory was. [`check`](Self::check) tells whether it still
/// is there: `resize_` of the tensor (beyond its storage) or of the storage reallocates the
/// memory under the same storage object, which the registration cannot prevent.
pub struct StorageGuard {
    /// The `torch.UntypedStorage`.
    storage: Py<PyAny>,
    /// Its `data_ptr()` at registration.
    ptr: u64,
    /// Its `nbytes()` at registration.
    nbytes: u64,
    /// The registered object's type name, for messages.
    type_name: String,
}

impl StorageGuard {
    /// The storage of `obj` (anything with `untyped_storage()`: torch tensors), if it has
    /// one, checked to hold the registered bytes `ptr..ptr+len`; `None` for other objects.
    fn of(obj: &Bound<'_, PyAny>, ptr: u64, len: usize) -> PyResult<Option<StorageGuard>> {
        if !obj.hasattr("untyped_storage")? {
            return Ok(None);
        }
        let type_name = obj.get_type().name()?.to_string();
        let storage = obj.call_method0("untyped_storage").map_err(|e| {
            invalid(format!(
                "cannot take the {type_name}'s storage (untyped_storage() failed: {e}): \
                 register a dense tensor"
            ))
        })?;
        let (sp, sn) = storage_place(&storage).map_err(|e| {
            invalid(format!(
                "cannot tell where the {type_name}'s storage is (data_ptr()/nbytes() \
                 failed: {e})"
            ))
        })?;
        let end = ptr.checked_add(len as u64);
        let inside = sp <= ptr && end.is_some_and(|e| sp.checked_add(sn).is_some_and(|s| e <= s));
        if !inside {
            return Err(invalid(format!(
                "the {type_name}'s {len} bytes at {ptr:#x} are not inside its storage \
                 ({sn} bytes at {sp:#x}): register a tensor whose memory is its own storage's"
            )));
        }
        Ok(Some(StorageGuard {
            storage: storage.unbind(),
            ptr: sp,
            nbytes: sn,
            type_name,
        }))
    }

    /// Another handle on the same storage and record.
    pub fn clone_ref(&self, py: Python<'_>) -> StorageGuard {
        StorageGuard {
            storage: self.storage.clone_ref(py),
            ptr: self.ptr,
            nbytes: self.nbytes,
            type_name: self.type_name.clone(),
        }
    }

    /// `Ok` while the storage's memory is where it was at registration; else
    /// `RegionInvalidated` (`what` says what is refused, e.g. "this write") naming both
    /// places. A storage that cannot say where it is counts as changed.
    pub fn check(&self, py: Python<'_>, what: &str) -> PyResult<()> {
        let now = storage_place(self.storage.bind(py));
        if let Ok((ptr, nbytes)) = now
            && ptr == self.ptr
            && nbytes == self.nbytes
        {
            return Ok(());
        }
        let now = match now {
            Ok((ptr, nbytes)) => format!("{nbytes} bytes at {ptr:#x}"),
            Err(e) => format!("unreadable ({e})"),
        };
        Err(RegionInvalidated::new_err(format!(
            "{what}: the registered {t}'s storage was resized or replaced after registration \
             ({n} bytes at {p:#x} then, {now} now), so the memory registered may have been \
             freed: register the tensor again (and do not resize a registered tensor)",
            t = self.type_name,
            n = self.nbytes,
            p = self.ptr,
        )))
    }
}

/// A storage's `(data_ptr(), nbytes())`.
fn storage_place(storage: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    let ptr: u64 = storage.call_method0("data_ptr")?.extract()?;
    let nbytes: u64 = storage.call_method0("nbytes")?.extract()?;
    Ok((ptr, nbytes))
}

/// What [`take`] gives: the region, what keeps it alive, and for a torch tensor its
/// storage's record (for [`StorageGuard::check`] before each use).
pub struct Taken {
    /// The memory, for the agent.
    pub region: Arc<dyn MemoryRegion>,
    /// What keeps it alive, for the agent (`Agent::register_kept`).
    pub held: Held,
    /// A torch tensor's storage, held by `held` too.
    pub storage: Option<StorageGuard>,
}

/// What an agent accepts.
#[derive(Clone, Copy, Debug)]
pub struct Accept {
    /// The agent's GPU (CUDA memory must be there).
    pub gpu: u32,
    /// The agent offers cuda-ipc only (transport="cuda-ipc"): it moves GPU memory only.
    pub device_only: bool,
    /// The agent offers the in-process mem transport: it moves host memory only.
    pub host_only: bool,
}

/// Takes `obj`'s memory: a CUDA tensor by `__cuda_array_interface__`, anything else through
/// the buffer protocol (or DLPack). Returns the region, what keeps it alive and, for a
/// torch tensor, its storage's record (the storage is held too, and must hold the region).
/// Every way an object can be unfit is an `InvalidArgument` that names the fix; read-only
/// memory with `remote_write` is one.
pub fn take(obj: &Bound<'_, PyAny>, remote_write: bool, accept: Accept) -> PyResult<Taken> {
    let (region, what) = take_memory(obj, remote_write, accept)?;
    let storage = StorageGuard::of(obj, region.device_addr(), region.len())?;
    let held = Held {
        _what: what,
        _storage: storage.as_ref().map(|s| s.storage.clone_ref(obj.py())),
    };
    Ok(Taken {
        region,
        held,
        storage,
    })
}

/// [`take`] but for the storage.
fn take_memory(
    obj: &Bound<'_, PyAny>,
    remote_write: bool,
    accept: Accept,
) -> PyResult<(Arc<dyn MemoryRegion>, Keep)> {
    if obj.hasattr("__cuda_array_interface__")? {
        return cuda_region(obj, remote_write, accept);
    }
    let type_name = obj.get_type().name()?.to_string();
    if accept.device_only && !dlpack_on_cuda(obj)? {
        return Err(invalid(format!(
            "this agent (transport=\"cuda-ipc\") moves GPU memory only, and {type_name} is \
             host memory: register a CUDA tensor (tensor.cuda()), or make the agent with \
             transport=\"auto\" (cuda-ipc for GPU memory, tcp for host memory)"
        )));
    }
    let builtins = obj.py().import("builtins")?;
    let view = match builtins.getattr("memoryview")?.call1((obj,)) {
        Ok(v) => v,
        Err(_) if obj.hasattr("__dlpack__")? => return dlpack_region(obj, remote_write, accept),
        Err(_) => {
            if obj.hasattr("__dlpack_device__")? {
                return Err(invalid(format!(
                    "{type_name} offers __dlpack_device__ but no __dlpack__ nor the buffer \
                     protocol: for a CPU tensor register tensor.numpy() (host memory), for GPU \
                     memory move it with tensor.cuda() (cuda:{})",
                    accept.gpu
                )));
            }
            return Err(invalid(format!(
                "cannot register {type_name}: it offers neither the buffer protocol (numpy arrays, \
                 bytearray, memoryview) nor __cuda_array_interface__ or __dlpack__ (torch, cupy, \
                 jax tensors)"
            )));
        }
    };
    if !view.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(invalid(format!(
            "the {type_name} is not C-contiguous (a strided view or slice): register \
             numpy.ascontiguousarray(a), or register the whole base array and address the \
             pieces with offsets"
        )));
    }
    if remote_write && view.getattr("readonly")?.extract::<bool>()? {
        return Err(invalid(format!(
            "the {type_name} is read-only, and remote_write=True lets peers write into it: \
             register a writable buffer (bytearray(b), a.copy()), or pass remote_write=False \
             for memory that is only a source"
        )));
    }
    let nbytes: usize = view.getattr("nbytes")?.extract()?;
    if nbytes == 0 {
        return Err(invalid(format!(
            "the {type_name} is empty: register at least one byte"
        )));
    }
    let flat = view.call_method1("cast", ("B",)).map_err(|e| {
        invalid(format!(
            "the {type_name}'s items cannot be viewed as bytes ({e}): register a plain view of \
             it, e.g. a.view(numpy.uint8)"
        ))
    })?;
    let buf = PyBuffer::<u8>::get(&flat)?;
    let ptr = NonNull::new(buf.buf_ptr().cast::<u8>())
        .ok_or_else(|| invalid(format!("the {type_name} exports a null pointer")))?;
    let len = buf.len_bytes();
    Ok((
        Arc::new(PyHostRegion { ptr, len }),
        Keep::View { _view: buf },
    ))
}

/// Item sizes of `__cuda_array_interface__` type strings (`<f4`, `|u1`, `<c8`, ...).
fn item_size(typestr: &str) -> Option<usize> {
    typestr.get(2..)?.parse().ok().filter(|&n| n > 0)
}

/// A CUDA tensor's memory, from `__cuda_array_interface__`.
fn cuda_region(
    obj: &Bound<'_, PyAny>,
    remote_write: bool,
    accept: Accept,
) -> PyResult<(Arc<dyn MemoryRegion>, Keep)> {
    let type_name = obj.get_type().name()?.to_string();
    let iface = obj.getattr("__cuda_array_interface__")?;
    let iface = iface.cast::<PyDict>().map_err(|_| {
        invalid(format!(
            "{type_name}.__cuda_array_interface__ is not a dict"
        ))
    })?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        iface
            .get_item(k)?
            .ok_or_else(|| invalid(format!("{type_name}.__cuda_array_interface__ has no {k:?}")))
    };
    let (ptr, readonly): (u64, bool) = get("data")?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let item = item_size(&typestr).ok_or_else(|| {
        invalid(format!(
            "{type_name} has an item type {typestr:?} this build cannot size"
        ))
    })?;
    let count = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| invalid("the tensor's shape overflows"))?;
    let len = count
        .checked_mul(item)
        .ok_or_else(|| invalid("the tensor's size overflows"))?;
    if let Some(strides) = iface.get_item("strides")?
        && !strides.is_none()
    {
        let strides: Vec<i64> = strides.extract()?;
        if !c_contiguous(&shape, &strides, item) {
            return Err(invalid(format!(
                "the {type_name} is not contiguous (strides {strides:?}): register \
                 tensor.contiguous()"
            )));
        }
    }
    if remote_write && readonly {
        return Err(invalid(format!(
            "the {type_name} is read-only, and remote_write=True lets peers write into it: \
             register a writable tensor, or pass remote_write=False"
        )));
    }
    if len == 0 {
        return Err(invalid(format!(
            "the {type_name} is empty: register at least one byte"
        )));
    }
    cuda_held(obj, obj.clone().unbind(), ptr, len, accept)
}

/// Checks with the driver that `ptr..ptr+len` is device memory of the agent's GPU.
fn on_engine_gpu(obj: &Bound<'_, PyAny>, ptr: u64, len: usize, accept: Accept) -> PyResult<()> {
    let type_name = obj.get_type().name()?.to_string();
    let cuda = gpu_mem::Cuda::probe()
        .map_err(|e| crate::errors::Unsupported::new_err(format!("CUDA: {e}")))?
        .ok_or_else(|| {
            crate::errors::Unsupported::new_err(
                "a CUDA tensor, but no CUDA driver could be loaded in this process",
            )
        })?;
    let device = cuda.device(accept.gpu).map_err(|e| {
        invalid(format!(
            "the agent's gpu={} cannot be used: {e}",
            accept.gpu
        ))
    })?;
    let on_ours = obj
        .py()
        .detach(|| device.holds_range(ptr, len as u64))
        .map_err(|e| crate::errors::TransportFailed::new_err(e.to_string()))?;
    if !on_ours {
        return Err(invalid(format!(
            "the {type_name} is not memory of the agent's GPU (gpu={g}): move it with \
             tensor.to(\"cuda:{g}\"), or make the agent with the tensor's gpu",
            g = accept.gpu
        )));
    }
    Ok(())
}

/// A CUDA region of `len` bytes at `ptr` (of `obj`), kept alive by `keep`.
fn cuda_held(
    obj: &Bound<'_, PyAny>,
    keep: Py<PyAny>,
    ptr: u64,
    len: usize,
    accept: Accept,
) -> PyResult<(Arc<dyn MemoryRegion>, Keep)> {
    let type_name = obj.get_type().name()?.to_string();
    if accept.host_only {
        return Err(invalid(format!(
            "transport=\"mem\" moves host memory only, and this {type_name} is CUDA memory: \
             make the agent with transport=\"cuda-ipc\" or \"tcp\" and memory=\"cuda\""
        )));
    }
    on_engine_gpu(obj, ptr, len, accept)?;
    Ok((
        Arc::new(CudaTensorRegion {
            ptr,
            len,
            device: accept.gpu,
        }),
        Keep::Object { _obj: keep },
    ))
}

/// DLPack's device types this module reads.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

/// DLPack's `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut std::ffi::c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack's `DLManagedTensor` (the unversioned capsule, named "dltensor").
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut std::ffi::c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// DLPack's `DLPackVersion`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.x's `DLManagedTensorVersioned` (the capsule named "dltensor_versioned").
#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut std::ffi::c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the consumer must not write the memory.
const DL_FLAG_READ_ONLY: u64 = 1 << 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`: the producer exported a copy, not its own memory.
const DL_FLAG_IS_COPIED: u64 = 1 << 1;

/// The DLPack version this module asks producers for (`max_version`): 1.x, whose
/// versioned capsule carries the read-only flag.
const DL_MAX_VERSION: (u32, u32) = (1, 0);

/// Whether `obj` is a DLPack tensor on a CUDA device (asked without exporting it).
fn dlpack_on_cuda(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !obj.hasattr("__dlpack_device__")? {
        return Ok(false);
    }
    let (kind, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
    Ok(kind == DL_CUDA)
}

/// What a DLPack capsule describes, read while the capsule is alive.
struct DlView {
    ptr: u64,
    len: usize,
    device: DlDevice,
    contiguous: bool,
    /// The producer marked it read-only (DLPack 1.x; an unversioned capsule never is).
    read_only: bool,
}

/// `obj.__dlpack__(max_version=(1, 0))`, or `obj.__dlpack__()` where the producer does not
/// take `max_version` (a `TypeError`, as the DLPack protocol says to fall back on).
fn export_dlpack<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(obj.py());
    kwargs.set_item("max_version", DL_MAX_VERSION)?;
    match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => obj.call_method0("__dlpack__"),
        r => r,
    }
}

/// Reads the tensor description of an unused "dltensor_versioned" (DLPack 1.x) or
/// "dltensor" capsule.
fn read_capsule(capsule: &Bound<'_, PyCapsule>) -> PyResult<DlView> {
    use pyo3::types::PyCapsuleMethods;
    if capsule.is_valid_checked(Some(c"dltensor_versioned")) {
        let p = capsule.pointer_checked(Some(c"dltensor_versioned"))?;
        // SAFETY: a capsule named "dltensor_versioned" holds a DLManagedTensorVersioned
        // (DLPack 1.x), owned by the capsule and alive while it is (the caller holds
        // `capsule`); only its version and flags are read here, which every 1.x and later
        // version has at these places.
        let (version, flags) = unsafe {
            let m = &*p.as_ptr().cast::<DlManagedTensorVersioned>();
            (m.version, m.flags)
        };
        if version.major != 1 {
            return Err(invalid(format!(
                "__dlpack__ returned a DLPack {}.{} tensor, and this build reads DLPack 1.x \
                 (it asked for max_version={DL_MAX_VERSION:?})",
                version.major, version.minor
            )));
        }
        if flags & DL_FLAG_IS_COPIED != 0 {
            return Err(invalid(
                "__dlpack__ exported a copy of the tensor (DLPack's IS_COPIED flag), not its \
                 own memory: register memory the producer can export without a copy",
            ));
        }
        // SAFETY: as above, and the major version is 1, so the whole struct is DLPack 1's.
        let view = unsafe {
            let m = &*p.as_ptr().cast::<DlManagedTensorVersioned>();
            describe(&m.dl_tensor)?
        };
        return Ok(DlView {
            read_only: flags & DL_FLAG_READ_ONLY != 0,
            ..view
        });
    }
    let p = capsule.pointer_checked(Some(c"dltensor")).map_err(|_| {
        invalid(
            "__dlpack__ returned a capsule that is not an unused \"dltensor_versioned\" nor \
             \"dltensor\"",
        )
    })?;
    // SAFETY: a capsule named "dltensor" holds a DLManagedTensor (the DLPack protocol),
    // owned by the capsule and alive while it is (the caller holds `capsule`).
    unsafe {
        let m = &*p.as_ptr().cast::<DlManagedTensor>();
        describe(&m.dl_tensor)
    }
}

/// What `t` describes (`read_only` false: the caller sets it from the capsule's flags).
///
/// # Safety
///
/// `t` is a live DLTensor of a capsule: its shape and strides arrays hold `ndim` entries
/// each (strides may be null).
unsafe fn describe(t: &DlTensor) -> PyResult<DlView> {
    let n = usize::try_from(t.ndim).unwrap_or(0);
    // SAFETY: the caller's contract: `ndim` entries each, read only.
    let (shape, strides) = unsafe {
        let shape = if n == 0 || t.shape.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(t.shape, n).to_vec()
        };
        let strides = if n == 0 || t.strides.is_null() {
            None
        } else {
            Some(std::slice::from_raw_parts(t.strides, n).to_vec())
        };
        (shape, strides)
    };
    let (data, offset, device, dtype) = (t.data as u64, t.byte_offset, t.device, t.dtype);
    let item_bits = u64::from(dtype.bits) * u64::from(dtype.lanes.max(1));
    if item_bits == 0 || item_bits % 8 != 0 {
        return Err(invalid(format!(
            "the tensor's items are {item_bits} bits: only whole bytes can be registered"
        )));
    }
    let item = (item_bits / 8) as usize;
    let mut count = 1usize;
    for &d in &shape {
        let d = usize::try_from(d).map_err(|_| invalid("the tensor has a negative dimension"))?;
        count = count
            .checked_mul(d)
            .ok_or_else(|| invalid("the tensor's shape overflows"))?;
    }
    let len = count
        .checked_mul(item)
        .ok_or_else(|| invalid("the tensor's size overflows"))?;
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let contiguous = match strides {
        None => true,
        Some(s) => {
            let bytes: Vec<i64> = s.iter().map(|&x| x.saturating_mul(item as i64)).collect();
            c_contiguous(&dims, &bytes, item)
        }
    };
    Ok(DlView {
        ptr: data.wrapping_add(offset),
        len,
        device,
        contiguous,
        read_only: false,
    })
}

/// A tensor's memory through DLPack: host memory (CPU, CUDA-pinned) or the agent's GPU.
/// The capsule is kept (unconsumed, so its own destructor frees the tensor's reference
/// when the registration lets go of it). A DLPack 1.x producer's read-only flag refuses
/// `remote_write`.
fn dlpack_region(
    obj: &Bound<'_, PyAny>,
    remote_write: bool,
    accept: Accept,
) -> PyResult<(Arc<dyn MemoryRegion>, Keep)> {
    let type_name = obj.get_type().name()?.to_string();
    let capsule = export_dlpack(obj)?;
    let cap = capsule
        .cast::<PyCapsule>()
        .map_err(|_| invalid(format!("{type_name}.__dlpack__() did not return a capsule")))?;
    let v = read_capsule(cap)?;
    if remote_write && v.read_only {
        return Err(invalid(format!(
            "the {type_name} is read-only (its DLPack export says so), and remote_write=True \
             lets peers write into it: register a writable tensor (a copy), or pass \
             remote_write=False for memory that is only a source"
        )));
    }
    if !v.contiguous {
        return Err(invalid(format!(
            "the {type_name} is not contiguous: register tensor.contiguous()"
        )));
    }
    if v.len == 0 {
        return Err(invalid(format!(
            "the {type_name} is empty: register at least one byte"
        )));
    }
    match v.device.device_type {
        DL_CUDA => {
            if u32::try_from(v.device.device_id).ok() != Some(accept.gpu) {
                return Err(invalid(format!(
                    "the {type_name} is on cuda:{} and the agent's GPU is gpu={g}: move it with \
                     tensor.to(\"cuda:{g}\"), or make the agent with gpu={}",
                    v.device.device_id,
                    v.device.device_id,
                    g = accept.gpu
                )));
            }
            cuda_held(obj, capsule.clone().unbind(), v.ptr, v.len, accept)
        }
        DL_CPU | DL_CUDA_HOST => {
            if accept.device_only {
                return Err(invalid(format!(
                    "this agent (transport=\"cuda-ipc\") moves GPU memory only, and this \
                     {type_name} is a CPU tensor: move it with tensor.cuda() (cuda:{}), or make \
                     the agent with transport=\"auto\" (tcp for host memory)",
                    accept.gpu
                )));
            }
            let ptr = NonNull::new(v.ptr as *mut u8)
                .ok_or_else(|| invalid(format!("the {type_name} has a null data pointer")))?;
            Ok((
                Arc::new(PyHostRegion { ptr, len: v.len }),
                Keep::Object {
                    _obj: capsule.clone().unbind(),
                },
            ))
        }
        other => Err(invalid(format!(
            "the {type_name} lives on DLPack device type {other}, which xfer cannot move \
             (CPU and CUDA only)"
        ))),
    }
}

/// Whether `strides` (in bytes) are those of a C-contiguous array of `shape`.
fn c_contiguous(shape: &[usize], strides: &[i64], item: usize) -> bool {
    if shape.len() != strides.len() {
        return false;
    }
    let mut want = item as i64;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        // A dimension of length 1 may have any stride.
        if d != 1 && s != want {
            return false;
        }
        want = want.saturating_mul(d as i64);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_contiguity_from_strides() {
        assert!(c_contiguous(&[2, 3], &[12, 4], 4));
        assert!(!c_contiguous(&[2, 3], &[4, 8], 4), "Fortran order");
        assert!(
            !c_contiguous(&[2, 3], &[24, 4], 4),
            "a slice of every other row"
        );
        assert!(
            c_contiguous(&[1, 3], &[999, 4], 4),
            "length-1 dims have any stride"
        );
        assert!(!c_contiguous(&[3], &[4, 4], 4));
    }

    #[test]
    fn item_sizes_of_type_strings() {
        assert_eq!(item_size("<f4"), Some(4));
        assert_eq!(item_size("|u1"), Some(1));
        assert_eq!(item_size("<c16"), Some(16));
        assert_eq!(item_size("<f"), None);
        assert_eq!(item_size("<f0"), None);
    }
}
