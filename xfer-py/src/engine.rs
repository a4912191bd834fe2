//! The Python classes: `Engine`, `Registration`, `Peer` and `Handle`.
//!
//! Every call that waits (starting or closing an engine, adding a peer, registering,
//! submitting, waiting) releases the GIL; long waits wake every 50 ms to let Python
//! deliver signals (Ctrl-C), and a transfer's completion is decided on the engine's workers,
//! never in Python.

use crate::backend::{EngineOptions, MemoryKind, TransportKind};
use crate::errors::{EngineClosed, build_error, engine_error, invalid, op_error, wire_error};
use crate::memory::{self, Accept, Held};
use crate::wire::{self, EngineAddress};
use fabric_core::Access;
use fabric_core::engine::{GroupHandle, GroupPeer, GroupRegistration, GroupTransfer, RailGroup};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a long wait lets Python look at its signals.
const SIGNAL_EVERY: Duration = Duration::from_millis(50);

/// A running engine: its rails and what it was made with.
struct Core {
    group: RailGroup,
    kind: TransportKind,
    accept: Accept,
    address: Vec<u8>,
}

/// What an engine and its registrations share.
struct Shared {
    /// `None` once closed.
    core: Mutex<Option<Arc<Core>>>,
    /// Open registrations: what keeps their memory alive.
    regs: Mutex<HashMap<u64, Held>>,
    /// Memory deregistered while a transport still held it, given back once none does.
    released_later: Mutex<Vec<Held>>,
    next_reg: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn core(&self) -> PyResult<Arc<Core>> {
        lock(&self.core)
            .clone()
            .ok_or_else(|| EngineClosed::new_err("the engine is closed"))
    }

    /// Gives back the memory of `held` now if no transport holds it, else later.
    fn release(&self, held: Held) {
        let mut later = lock(&self.released_later);
        if let Err(h) = held.release() {
            later.push(h);
        }
        // Earlier ones may be free by now.
        let pending = std::mem::take(&mut *later);
        for h in pending {
            if let Err(h) = h.release() {
                later.push(h);
            }
        }
        drop(later);
        // So may the memory of engines that are gone.
        memory::release_kept();
    }
}

impl Drop for Shared {
    /// Memory a transport still holds (a worker that did not stop in time keeps its
    /// transport) is never given back to its owner here: it is kept for the rest of the
    /// process, or until no transport holds it ([`memory::release_kept`]).
    fn drop(&mut self) {
        let later = std::mem::take(&mut *lock(&self.released_later));
        let open = lock(&self.regs).drain().map(|(_, h)| h).collect::<Vec<_>>();
        for h in later.into_iter().chain(open) {
            if let Err(h) = h.release() {
                memory::keep_for_good(h);
            }
        }
    }
}

/// A size argument that must be positive (`what` names it in the error).
fn positive(v: i64, what: &str) -> PyResult<u64> {
    u64::try_from(v)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| invalid(format!("{what}={v}: expected a positive size")))
}

fn seconds(t: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Duration::try_from_secs_f64(s)
            .map(Some)
            .map_err(|_| invalid(format!("{what}={s} is too large"))),
        Some(s) => Err(invalid(format!(
            "{what}={s}: expected seconds >= 0, or None"
        ))),
    }
}

/// Waits in slices of [`SIGNAL_EVERY`] with the GIL released, up to `timeout` (forever for
/// `None`); `step(slice)` returns `Some` once done. Python signals end the wait with their
/// exception.
fn wait_sliced<R>(
    py: Python<'_>,
    timeout: Option<Duration>,
    mut step: impl FnMut(Duration) -> Option<R> + Send,
) -> PyResult<Option<R>>
where
    R: Send,
{
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = match deadline {
            Some(d) => d
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_EVERY),
            None => SIGNAL_EVERY,
        };
        if let Some(r) = py.detach(|| step(slice)) {
            return Ok(Some(r));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

/// The transfer engine. Keyword arguments mirror the `xfer` command's flags.
///
/// - transport: "tcp" (any two hosts, host or GPU memory), "cuda-ipc" (GPU memory between
///   processes of one host), "efa" (libfabric: EFA on AWS, or the provider named by
///   `provider`), "mem" (engines of one process), or "auto": "cuda-ipc" when
///   memory="cuda" and a CUDA driver is present, "tcp" otherwise. "auto" does not look at
///   the peer: for GPU memory on two hosts, pass transport="tcp".
/// - provider: the libfabric provider of transport="efa" ("efa" by default; "tcp",
///   "sockets", "shm" elsewhere).
/// - rails: worker threads, each with its own connection; transfers spread over them.
/// - nics: the NICs the rails run on (rail i on nics[i % len]): tcp interfaces, or efa
///   libfabric domains.
/// - memory: "host" or "cuda", what this engine registers; gpu: the CUDA device ordinal.
/// - auth_token: a shared secret that tcp peers must know.
/// - timeout: seconds; the limit of control calls and how long a silent tcp peer is given
///   before its transfers fail with PeerUnreachable.
/// - listen: the IP address tcp rails listen on (e.g. "0.0.0.0" or the host's address
///   for peers on other hosts).
/// - wait_spin_us: how long a wait spins before it sleeps (default 200): lower latency for
///   short transfers, at the cost of the waiting thread's core.
///
/// An engine is a context manager; close() (or leaving the `with` block) stops it and
/// gives back every registered buffer.
#[pyclass(module = "xfer", frozen)]
pub struct Engine {
    shared: Arc<Shared>,
}

/// Memory registered with an engine: the object stays alive (and is not freed or
/// resized) until the registration is closed, by close(), a `with` block, or the
/// engine's close.
#[pyclass(module = "xfer", frozen)]
pub struct Registration {
    shared: Arc<Shared>,
    id: u64,
    reg: GroupRegistration,
    descriptor: Vec<u8>,
    nbytes: u64,
    cuda: bool,
    closed: AtomicBool,
}

/// A peer of an engine, from Engine.add_peer.
#[pyclass(module = "xfer", frozen)]
pub struct Peer {
    shared: Arc<Shared>,
    peer: GroupPeer,
    removed: AtomicBool,
}

/// A submitted transfer: wait(), done(), or `await` it. Dropping it does not cancel
/// the transfer. Until the handle reports a result, the source ranges belong to the
/// engine: do not change them.
#[pyclass(module = "xfer", frozen)]
pub struct Handle {
    handle: Arc<GroupHandle>,
}

/// Segments as `(src_off, dst_off, len)` from Python (tuples, or an `(n, 3)` int64 numpy
/// array read through the buffer protocol), checked for negatives.
fn triples(segments: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64, u64)>> {
    let raw: Vec<(i64, i64, i64)> = match PyBuffer::<i64>::get(segments) {
        Ok(b) if b.dimensions() == 2 && b.shape()[1] == 3 => b
            .to_vec(segments.py())?
            .chunks_exact(3)
            .map(|c| (c[0], c[1], c[2]))
            .collect(),
        _ => segments.extract().map_err(|_| {
            invalid(
                "segments must be a sequence of (src_offset, dst_offset, length) int tuples, \
                 or an (n, 3) int64 numpy array",
            )
        })?,
    };
    raw.into_iter()
        .enumerate()
        .map(|(i, (s, d, l))| {
            if s < 0 || d < 0 || l < 0 {
                Err(invalid(format!(
                    "segment {i} ({s}, {d}, {l}) has a negative offset or length"
                )))
            } else {
                Ok((s as u64, d as u64, l as u64))
            }
        })
        .collect()
}

/// Page indices from a list or a numpy int64 array (read through the buffer protocol, no
/// per-item Python calls), checked for negatives.
fn pages(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    let raw: Vec<i64> = match PyBuffer::<i64>::get(obj) {
        Ok(b) if b.dimensions() == 1 => b.to_vec(obj.py())?,
        _ => obj.extract().map_err(|_| {
            invalid(format!(
                "{what} must be a sequence of ints (a list, or a 1-D int64 numpy array)"
            ))
        })?,
    };
    raw.into_iter()
        .map(|p| u64::try_from(p).map_err(|_| invalid(format!("{what} holds a negative page {p}"))))
        .collect()
}

fn imm_value(imm: Option<i64>) -> PyResult<Option<u32>> {
    match imm {
        None => Ok(None),
        Some(v) => match u32::try_from(v) {
            Ok(u32::MAX) => Err(invalid(format!(
                "imm={v} is reserved for the engine's warm-up writes: use 0..{}",
                u32::MAX
            ))),
            Ok(x) => Ok(Some(x)),
            Err(_) => Err(invalid(format!(
                "imm={v}: immediate data is a 32-bit unsigned value (0..{})",
                u32::MAX - 1
            ))),
        },
    }
}

impl Engine {
    /// What a transfer of `reg` waits for: for GPU memory, the work queued so far on the
    /// caller's stream (see [`crate::stream`]); nothing for host memory.
    fn fence(
        &self,
        py: Python<'_>,
        reg: &Registration,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Arc<dyn fabric_core::Fence>>> {
        let given = stream.filter(|s| !s.is_none());
        let found = lock(&self.shared.regs)
            .get(&reg.id)
            .map(|h| (h.obj().clone_ref(py), h.region().location()));
        match found {
            Some((obj, fabric_core::MemoryLocation::Cuda { device })) => {
                Ok(Some(crate::stream::fence_for(obj.bind(py), given, device)?))
            }
            _ if given.is_some() => Err(invalid(
                "stream= orders transfers of GPU memory after a CUDA stream's work, and this \
                 registration is host memory: leave stream out",
            )),
            _ => Ok(None),
        }
    }

    /// Stops the rails and gives back every registration's memory that no transport holds;
    /// the rest waits in `released_later`.
    fn close_engine(&self, py: Python<'_>) {
        let Some(core) = lock(&self.shared.core).take() else {
            return;
        };
        // Stops every rail (each waits for its worker); the GIL is not needed meanwhile.
        let stopped = py.detach(move || Arc::try_unwrap(core).map(drop).is_ok());
        let held: Vec<Held> = lock(&self.shared.regs).drain().map(|(_, h)| h).collect();
        if stopped {
            for h in held {
                self.shared.release(h);
            }
        } else {
            // Another thread still runs a call on the engine: its rails stop when that
            // call returns, so the memory stays held (given back only by a later release).
            lock(&self.shared.released_later).extend(held);
        }
    }

    /// The transport's name and each rail's address, for a directory record.
    pub(crate) fn published(&self) -> PyResult<(&'static str, Vec<Vec<u8>>)> {
        let core = self.shared.core()?;
        Ok((core.kind.name(), core.group.addresses()))
    }

    fn check_own(&self, shared: &Arc<Shared>, what: &str) -> PyResult<()> {
        if Arc::ptr_eq(shared, &self.shared) {
            Ok(())
        } else {
            Err(invalid(format!("this {what} belongs to another engine")))
        }
    }

    fn submit(
        &self,
        py: Python<'_>,
        peer: &Peer,
        reg: &Registration,
        mut t: GroupTransfer,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Handle> {
        self.check_own(&peer.shared, "peer")?;
        self.check_own(&reg.shared, "registration")?;
        if peer.removed.load(Ordering::Acquire) {
            return Err(invalid("this peer was removed: add it again"));
        }
        if reg.closed.load(Ordering::Acquire) {
            return Err(invalid(
                "this registration is closed: register the memory again",
            ));
        }
        let core = self.shared.core()?;
        t.after = self.fence(py, reg, stream)?;
        let handle = py
            .detach(|| core.group.submit(&peer.peer, t))
            .map_err(|e| engine_error(&e))?;
        Ok(Handle {
            handle: Arc::new(handle),
        })
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (transport="auto", provider=None, rails=1, nics=None, memory="host", gpu=0, auth_token=None, timeout=10.0, listen="127.0.0.1", wait_spin_us=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        transport: &str,
        provider: Option<String>,
        rails: i64,
        nics: Option<Vec<String>>,
        memory: &str,
        gpu: i64,
        auth_token: Option<String>,
        timeout: f64,
        listen: &str,
        wait_spin_us: Option<u64>,
    ) -> PyResult<Engine> {
        let memory = match memory {
            "host" => MemoryKind::Host,
            "cuda" => MemoryKind::Cuda,
            m => {
                return Err(invalid(format!(
                    "memory={m:?}: expected \"host\" or \"cuda\""
                )));
            }
        };
        let rails = usize::try_from(rails)
            .map_err(|_| invalid(format!("rails={rails}: expected a positive count")))?;
        let gpu = u32::try_from(gpu)
            .map_err(|_| invalid(format!("gpu={gpu}: expected a device ordinal >= 0")))?;
        let timeout = seconds(Some(timeout), "timeout")?.unwrap_or_default();
        let listen: IpAddr = listen
            .parse()
            .map_err(|_| invalid(format!("listen={listen:?} is not an IP address")))?;
        let opts = EngineOptions {
            transport: transport.to_string(),
            provider,
            rails,
            nics: nics.unwrap_or_default(),
            memory,
            gpu,
            auth_token,
            timeout,
            listen,
            wait_spin: wait_spin_us.map(Duration::from_micros),
        };
        let (kind, group) = py
            .detach(|| opts.spawn("xfer-py"))
            .map_err(|e| build_error(&e))?;
        let address = EngineAddress {
            process: std::process::id(),
            transport: kind.name().into(),
            rails: group.addresses(),
        }
        .encode();
        let core = Core {
            group,
            kind,
            accept: Accept { kind, gpu },
            address,
        };
        Ok(Engine {
            shared: Arc::new(Shared {
                core: Mutex::new(Some(Arc::new(core))),
                regs: Mutex::new(HashMap::new()),
                released_later: Mutex::new(Vec::new()),
                next_reg: AtomicU64::new(1),
            }),
        })
    }

    /// This engine's address (bytes): give it to peers, who pass it to add_peer.
    #[getter]
    fn address<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.shared.core()?.address))
    }

    /// The transport in use: "tcp", "cuda-ipc", "efa" or "mem" ("auto" resolved).
    #[getter]
    fn transport(&self) -> PyResult<&'static str> {
        Ok(self.shared.core()?.kind.name())
    }

    /// The number of rails.
    #[getter]
    fn rails(&self) -> PyResult<usize> {
        Ok(self.shared.core()?.group.rails().len())
    }

    /// Whether the engine is closed.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.shared.core).is_none()
    }

    /// Registers `obj`'s memory and returns its Registration.
    ///
    /// obj: a numpy array, bytearray, memoryview or any C-contiguous buffer-protocol
    /// object (host memory), a torch / cupy CUDA tensor (__cuda_array_interface__) on
    /// the engine's gpu, or a DLPack tensor (__dlpack__: CPU, or CUDA on the engine's
    /// gpu). No copy is made. remote_write: whether peers may write into it (needs a writable
    /// buffer; such a registration can also be the destination of this engine's reads); a
    /// source-only region may be read-only. remote_read: whether peers may read it.
    #[pyo3(signature = (obj, remote_write=true, remote_read=false))]
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        remote_write: bool,
        remote_read: bool,
    ) -> PyResult<Registration> {
        let core = self.shared.core()?;
        let held = memory::take(obj, remote_write, core.accept)?;
        // A writable registration may also receive this engine's READs (LOCAL_WRITE).
        let mut access = if remote_write {
            Access::REMOTE_WRITE | Access::LOCAL_WRITE
        } else {
            Access::NONE
        };
        if remote_read {
            access = access | Access::REMOTE_READ;
        }
        let region = held.region();
        let nbytes = region.len() as u64;
        let cuda = held.is_cuda();
        let reg = match py.detach(|| core.group.register(region, access)) {
            Ok(r) => r,
            Err(e) => {
                self.shared.release(held);
                return Err(engine_error(&e));
            }
        };
        let id = self.shared.next_reg.fetch_add(1, Ordering::Relaxed);
        lock(&self.shared.regs).insert(id, held);
        Ok(Registration {
            shared: self.shared.clone(),
            id,
            descriptor: wire::encode_descriptor(&reg.remote),
            reg,
            nbytes,
            cuda,
            closed: AtomicBool::new(false),
        })
    }

    /// Adds a peer by its address (the bytes of its Engine.address) and returns a Peer.
    fn add_peer(&self, py: Python<'_>, address: &[u8]) -> PyResult<Peer> {
        let core = self.shared.core()?;
        let a = EngineAddress::decode(address).map_err(|e| wire_error(&e))?;
        if a.transport != core.kind.name() {
            return Err(invalid(format!(
                "the peer's address is of transport {:?} and this engine's is {:?}: make both \
                 engines with the same transport",
                a.transport,
                core.kind.name()
            )));
        }
        if core.kind == TransportKind::Mem && a.process != std::process::id() {
            return Err(invalid(format!(
                "transport=\"mem\" connects engines of one process, and this address is from \
                 process {}: use transport=\"tcp\" between processes",
                a.process
            )));
        }
        let peer = py
            .detach(|| core.group.add_peer(&a.rails))
            .map_err(|e| engine_error(&e))?;
        Ok(Peer {
            shared: self.shared.clone(),
            peer,
            removed: AtomicBool::new(false),
        })
    }

    /// Removes a peer; its pending transfers fail with PeerRemoved.
    fn remove_peer(&self, py: Python<'_>, peer: &Peer) -> PyResult<()> {
        self.check_own(&peer.shared, "peer")?;
        if peer.removed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let core = self.shared.core()?;
        py.detach(|| core.group.remove_peer(&peer.peer))
            .map_err(|e| engine_error(&e))
    }

    /// Writes ranges of a local registration into a peer's region.
    ///
    /// segments: (src_offset, dst_offset, length) in bytes; remote_descriptor: the
    /// peer's Registration.descriptor; imm: a 32-bit value the peer sees (wait_imm) once
    /// every byte has landed; timeout: seconds, after which the transfer fails with
    /// TimedOut. Returns a Handle.
    ///
    /// GPU memory: the transfer reads the source only after the work queued so far on
    /// `stream` (a torch.cuda.Stream, cupy.cuda.Stream, or a handle as an int) has run; by
    /// default torch's current stream for a torch tensor, the stream of the object's
    /// __cuda_array_interface__ where it gives one, else the legacy default stream. So a
    /// kernel that computes the source may be launched just before the call.
    #[pyo3(signature = (peer, registration, remote_descriptor, segments, imm=None, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        peer: &Peer,
        registration: &Registration,
        remote_descriptor: &[u8],
        segments: &Bound<'_, PyAny>,
        imm: Option<i64>,
        timeout: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Handle> {
        let dst = wire::decode_descriptor(remote_descriptor).map_err(|e| wire_error(&e))?;
        let t = GroupTransfer {
            src: registration.reg.clone(),
            dst,
            segments: triples(segments)?,
            imm: imm_value(imm)?,
            timeout: seconds(timeout, "timeout")?,
            direction: fabric_core::engine::Direction::Write,
            after: None,
        };
        self.submit(py, peer, registration, t, stream)
    }

    /// Writes pages: local page src_pages[i] goes to the peer's page dst_pages[i],
    /// page_size bytes each, at offsets page * stride (strides default to page_size).
    /// Pages are lists of ints or 1-D int64 numpy arrays. See write for the rest (stream
    /// order of GPU memory included).
    #[pyo3(signature = (peer, registration, remote_descriptor, src_pages, dst_pages, page_size, src_stride=None, dst_stride=None, imm=None, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_pages(
        &self,
        py: Python<'_>,
        peer: &Peer,
        registration: &Registration,
        remote_descriptor: &[u8],
        src_pages: &Bound<'_, PyAny>,
        dst_pages: &Bound<'_, PyAny>,
        page_size: i64,
        src_stride: Option<i64>,
        dst_stride: Option<i64>,
        imm: Option<i64>,
        timeout: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Handle> {
        let mut t = paged(
            registration,
            remote_descriptor,
            page_size,
            (src_pages, src_stride, "src"),
            (dst_pages, dst_stride, "dst"),
        )?;
        t.imm = imm_value(imm)?;
        t.timeout = seconds(timeout, "timeout")?;
        self.submit(py, peer, registration, t, stream)
    }

    /// Reads ranges of a peer's region into a local registration (one-sided: the peer
    /// does nothing but progress).
    ///
    /// segments: (local_offset, remote_offset, length) in bytes; registration: local, made
    /// with remote_write=True (a writable buffer); remote_descriptor: the peer's
    /// Registration.descriptor, registered with remote_read=True; timeout: seconds. Returns
    /// a Handle, done once every byte is in the local memory.
    ///
    /// GPU memory: nothing lands in the local memory before the work queued so far on
    /// `stream` has run (see write for which stream by default).
    #[pyo3(signature = (peer, registration, remote_descriptor, segments, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        py: Python<'_>,
        peer: &Peer,
        registration: &Registration,
        remote_descriptor: &[u8],
        segments: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Handle> {
        let remote = wire::decode_descriptor(remote_descriptor).map_err(|e| wire_error(&e))?;
        let t = GroupTransfer {
            src: registration.reg.clone(),
            dst: remote,
            segments: triples(segments)?,
            imm: None,
            timeout: seconds(timeout, "timeout")?,
            direction: fabric_core::engine::Direction::Read,
            after: None,
        };
        self.submit(py, peer, registration, t, stream)
    }

    /// Reads pages: the peer's page remote_pages[i] lands in local page local_pages[i],
    /// page_size bytes each, at offsets page * stride (strides default to page_size). See
    /// read for the rest.
    #[pyo3(signature = (peer, registration, remote_descriptor, local_pages, remote_pages, page_size, local_stride=None, remote_stride=None, timeout=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn read_pages(
        &self,
        py: Python<'_>,
        peer: &Peer,
        registration: &Registration,
        remote_descriptor: &[u8],
        local_pages: &Bound<'_, PyAny>,
        remote_pages: &Bound<'_, PyAny>,
        page_size: i64,
        local_stride: Option<i64>,
        remote_stride: Option<i64>,
        timeout: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Handle> {
        let mut t = paged(
            registration,
            remote_descriptor,
            page_size,
            (local_pages, local_stride, "local"),
            (remote_pages, remote_stride, "remote"),
        )?
        .read();
        t.timeout = seconds(timeout, "timeout")?;
        self.submit(py, peer, registration, t, stream)
    }

    /// The receiver's side: blocks (GIL released) until `count` transfers carrying
    /// immediate value `value` have landed here, or raises TimedOut after `timeout`
    /// seconds (None: no limit; Ctrl-C still interrupts). Other values seen meanwhile
    /// are kept for their own waits.
    #[pyo3(signature = (value, count=1, timeout=None))]
    fn wait_imm(
        &self,
        py: Python<'_>,
        value: i64,
        count: i64,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let value = imm_value(Some(value))?.unwrap_or_default();
        let count = u64::try_from(count)
            .map_err(|_| invalid(format!("count={count}: expected a count >= 0")))?;
        let limit = seconds(timeout, "timeout")?;
        let core = self.shared.core()?;
        let mut failure = None;
        let done = wait_sliced(py, limit, |slice| {
            match core.group.wait_imm(value, count, slice) {
                Ok(()) => Some(()),
                Err(fabric_core::Error::TimedOut(..)) => None,
                Err(e) => {
                    failure = Some(e);
                    Some(())
                }
            }
        })?;
        if let Some(e) = failure {
            return Err(engine_error(&e));
        }
        match done {
            Some(()) => Ok(()),
            None => Err(crate::errors::TimedOut::new_err(format!(
                "timed out after {:?} waiting for {count} transfer(s) with immediate value {value}",
                limit.unwrap_or_default()
            ))),
        }
    }

    /// Sums of the rails' counters: bytes, ops, reposts, errors, transfers.
    fn counters(&self) -> PyResult<HashMap<&'static str, u64>> {
        let c = self.shared.core()?.group.counters();
        Ok(HashMap::from([
            ("bytes", c.bytes),
            ("ops", c.ops),
            ("reposts", c.reposts),
            ("errors", c.errors),
            ("transfers", c.transfers),
        ]))
    }

    /// Stops the engine: pending transfers fail, and every registration's memory is
    /// given back. Closing twice is fine.
    ///
    /// Memory a transport still holds is not given back: a rail whose worker does not stop
    /// within its shutdown timeout (stuck in its transport) keeps its transport, and the
    /// transport may still write the memory. Such memory stays held, with a
    /// ResourceWarning, until the transport lets go (or for the rest of the process).
    fn close(&self, py: Python<'_>) {
        self.close_engine(py);
        let held = lock(&self.shared.released_later).len();
        if held > 0 {
            let _ = PyErr::warn(
                py,
                &py.get_type::<pyo3::exceptions::PyResourceWarning>(),
                &std::ffi::CString::new(format!(
                    "xfer.Engine.close: {held} registered buffer(s) are still held by a \
                     transport that did not stop in time; they stay alive (and unusable to \
                     Python's allocator) until it lets go, or until the process exits"
                ))
                .unwrap_or_default(),
                1,
            );
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        match lock(&self.shared.core).as_ref() {
            Some(c) => format!(
                "xfer.Engine(transport={:?}, rails={})",
                c.kind.name(),
                c.group.rails().len()
            ),
            None => "xfer.Engine(closed)".into(),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        Python::attach(|py| self.close(py));
    }
}

impl Registration {
    /// The descriptor peers write with, for a directory record.
    pub(crate) fn remote(&self) -> fabric_core::engine::RemoteDescriptor {
        self.reg.remote.clone()
    }

    /// Deregisters; on success gives the memory back (now, or once no transport holds it).
    fn close_inner(&self, py: Python<'_>) -> PyResult<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let core = match self.shared.core() {
            Ok(c) => c,
            // The engine's close gave the memory back already.
            Err(_) => return Ok(()),
        };
        if let Err(e) = py.detach(|| core.group.deregister(&self.reg)) {
            self.closed.store(false, Ordering::Release);
            return Err(engine_error(&e));
        }
        drop(core);
        if let Some(h) = lock(&self.shared.regs).remove(&self.id) {
            self.shared.release(h);
        }
        Ok(())
    }
}

#[pymethods]
impl Registration {
    /// What a peer needs to write into this memory (bytes): send it to the peer.
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.descriptor)
    }

    /// The registered object, or None once the registration is closed (it no longer
    /// holds the object then).
    #[getter]
    fn obj(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        lock(&self.shared.regs)
            .get(&self.id)
            .map(|h| h.obj().clone_ref(py))
    }

    /// Length of the registered memory in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Whether this is CUDA device memory.
    #[getter]
    fn is_cuda(&self) -> bool {
        self.cuda
    }

    /// Whether the registration is closed.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Deregisters the memory and lets go of the object. Raises RegionInUse while
    /// transfers that use it have not finished (wait for their handles first).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.close_inner(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close_inner(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "xfer.Registration({} bytes of {} memory{})",
            self.nbytes,
            if self.cuda { "cuda" } else { "host" },
            if self.closed() { ", closed" } else { "" }
        )
    }
}

impl Drop for Registration {
    /// A registration dropped while open is closed; if that fails (transfers still use
    /// it) its memory stays held until the engine closes.
    fn drop(&mut self) {
        Python::attach(|py| {
            let _ = self.close_inner(py);
        });
    }
}

#[pymethods]
impl Peer {
    /// Whether the peer was removed.
    #[getter]
    fn removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    fn __repr__(&self) -> String {
        format!(
            "xfer.Peer(rails={}{})",
            self.peer.rails.len(),
            if self.removed() { ", removed" } else { "" }
        )
    }
}

#[pymethods]
impl Handle {
    /// Blocks (GIL released) until the transfer finishes, at most `timeout` seconds
    /// (None: until it finishes; Ctrl-C still interrupts). Returns the bytes moved, or
    /// raises the transfer's error (PeerUnreachable, RemoteKeyInvalid, ...). TimedOut
    /// from an expired wait ends only the wait: the transfer goes on.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let limit = seconds(timeout, "timeout")?;
        // Fast path: one wait with the GIL released covers the usual short transfer.
        let first = limit.unwrap_or(SIGNAL_EVERY).min(SIGNAL_EVERY);
        let h = &self.handle;
        let r = match py.detach(|| h.finished_within(first).then(|| h.try_result()).flatten()) {
            Some(r) => Some(r),
            None => {
                let left = limit.map(|l| l.saturating_sub(first));
                if left.is_some_and(|l| l.is_zero()) {
                    None
                } else {
                    wait_sliced(py, left, |slice| {
                        h.finished_within(slice).then(|| h.try_result()).flatten()
                    })?
                }
            }
        };
        match r {
            Some(Ok(stats)) => Ok(stats.bytes),
            Some(Err(e)) => Err(op_error(&e)),
            None => Err(crate::errors::TimedOut::new_err(format!(
                "the transfer did not finish within {:?} (it goes on: wait again)",
                limit.unwrap_or_default()
            ))),
        }
    }

    /// Whether the transfer has finished (either way); never blocks.
    fn done(&self) -> bool {
        self.handle.is_finished()
    }

    /// The transfer's error if it finished and failed, else None; never blocks.
    fn exception(&self) -> Option<PyErr> {
        self.handle.failed().map(|e| op_error(&e))
    }

    /// `await handle`: waits in the running loop's default executor (a thread with the
    /// GIL released), so the event loop keeps running; returns the bytes moved.
    fn __await__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let lp = py.import("asyncio")?.call_method0("get_running_loop")?;
        let fut = lp.call_method1("run_in_executor", (py.None(), slf.getattr("wait")?))?;
        fut.call_method0("__await__")
    }

    fn __repr__(&self) -> String {
        let state = match self.handle.try_result() {
            None => "pending".to_string(),
            Some(Ok(s)) => format!("done, {} bytes", s.bytes),
            Some(Err(e)) => format!("failed: {e}"),
        };
        format!("xfer.Handle({state})")
    }
}

/// The local and remote pages of `write_pages` / `read_pages`: `(pages, stride, side)`,
/// `side` naming the arguments in errors (`{side}_pages`, `{side}_stride`); strides default
/// to `page_size`. A WRITE; `read_pages` turns it around.
fn paged(
    registration: &Registration,
    remote_descriptor: &[u8],
    page_size: i64,
    (local_pages, local_stride, local): (&Bound<'_, PyAny>, Option<i64>, &str),
    (remote_pages, remote_stride, remote): (&Bound<'_, PyAny>, Option<i64>, &str),
) -> PyResult<GroupTransfer> {
    let len = positive(page_size, "page_size")?;
    let ls = positive(
        local_stride.unwrap_or(page_size),
        &format!("{local}_stride"),
    )?;
    let rs = positive(
        remote_stride.unwrap_or(page_size),
        &format!("{remote}_stride"),
    )?;
    let desc = wire::decode_descriptor(remote_descriptor).map_err(|e| wire_error(&e))?;
    let lp = pages(local_pages, &format!("{local}_pages"))?;
    let rp = pages(remote_pages, &format!("{remote}_pages"))?;
    GroupTransfer::paged(registration.reg.clone(), desc, &lp, ls, &rp, rs, len)
        .map_err(|e| engine_error(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::engine::EngineConfig;
    use fabric_core::testing::{StuckGate, StuckTransport, eventually};

    /// An engine of one rail over a transport whose poll hangs while `gate` is shut; its
    /// worker is given up 100 ms into a shutdown.
    fn stuck_engine(gate: &Arc<StuckGate>) -> Engine {
        let g = gate.clone();
        let cfg = EngineConfig {
            shutdown_timeout: Duration::from_millis(100),
            ..EngineConfig::default()
        };
        let group =
            RailGroup::spawn(1, move |_| Ok(StuckTransport::new(g.clone())), cfg).expect("a rail");
        let kind = TransportKind::Mem;
        Engine {
            shared: Arc::new(Shared {
                core: Mutex::new(Some(Arc::new(Core {
                    group,
                    kind,
                    accept: Accept { kind, gpu: 0 },
                    address: Vec::new(),
                }))),
                regs: Mutex::new(HashMap::new()),
                released_later: Mutex::new(Vec::new()),
                next_reg: AtomicU64::new(1),
            }),
        }
    }

    /// Whether the bytearray `buf` can be resized: not while a view of it is exported
    /// (held by a registration, or kept while a transport may still write it).
    fn resizable(py: Python<'_>, buf: &Bound<'_, PyAny>) -> bool {
        match buf.call_method1("extend", (PyBytes::new(py, b"x"),)) {
            Ok(_) => {
                buf.call_method1("pop", ()).expect("undo the extend");
                true
            }
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyBufferError>(py) => false,
            Err(e) => panic!("extend failed otherwise: {e}"),
        }
    }

    #[test]
    fn closing_an_engine_stuck_in_its_transport_keeps_the_memory_until_the_transport_lets_go() {
        Python::initialize();
        Python::attach(|py| {
            let gate = Arc::new(StuckGate::default());
            let engine = Py::new(py, stuck_engine(&gate)).expect("engine");
            let buf = py
                .eval(c"bytearray(4096)", None, None)
                .expect("a bytearray");
            let reg = engine
                .borrow(py)
                .register(py, &buf, true, false)
                .expect("register");
            assert!(!resizable(py, &buf), "registered memory is held");
            gate.shut();
            py.detach(|| {
                eventually(
                    "the worker to hang in its transport",
                    Duration::from_secs(10),
                    || gate.hanging(),
                )
            });
            // Close from Python, recording its warnings: the rail's worker stays stuck past
            // its shutdown timeout, and its transport still holds the region.
            let locals = pyo3::types::PyDict::new(py);
            locals.set_item("engine", &engine).unwrap();
            py.run(
                c"import warnings\nwith warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n    engine.close()\nkinds = [x.category.__name__ for x in w]\n",
                None,
                Some(&locals),
            )
            .expect("close");
            let kinds: Vec<String> = locals
                .get_item("kinds")
                .unwrap()
                .unwrap()
                .extract()
                .unwrap();
            assert_eq!(
                kinds,
                ["ResourceWarning"],
                "close says the memory stays held"
            );
            assert!(
                !resizable(py, &buf),
                "given back while a stuck transport may still write it"
            );
            // The engine and its registration are gone from Python; the memory is not.
            drop(reg);
            drop(locals);
            drop(engine);
            assert!(!resizable(py, &buf), "given back when the engine went away");
            assert_eq!(
                memory::release_kept(),
                1,
                "kept while the transport holds it"
            );
            // The transport lets go: the worker returns from poll, sees the shutdown and
            // drops its transport with the region.
            gate.open();
            py.detach(|| {
                eventually(
                    "the stuck transport to let go",
                    Duration::from_secs(10),
                    || Python::attach(|_| memory::release_kept() == 0),
                )
            });
            assert!(resizable(py, &buf), "given back once no transport holds it");
        });
    }
}
