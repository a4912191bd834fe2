//! `xfer.weights`: the weight sync of [`xfer::weights`] from Python. `Layout` says what a
//! rank holds of each tensor and where (each region a registered tensor or array), `Plan`
//! is the static schedule between source and destination layouts, `Source` pushes a rank's
//! share and `Destination` waits for a pushed version or pulls its share (the library's
//! `weights::Source` and `weights::Destination`). Every blocking call runs with the GIL
//! released (a push takes it back only to call the prepare hook); failures are the package's exception classes
//! ([`crate::errors::sync_error`]), and a push reports each destination on its own.
//!
//! For GPU memory the push of a `Source` follows the caller's CUDA stream: its transfers
//! wait for the work queued on the stream (by default torch's current stream for the first
//! CUDA registration) when `push` is called, and for the stream a prepare hook returns for
//! the pieces it prepared.

use crate::args::{SIGNAL_EVERY, seconds, wait_sliced};
use crate::directory::Following;
use crate::engine::{Engine, Peer, Registration};
use crate::errors::{agent_error, invalid, member_wait_error, metadata_error, sync_error};
use fabric_core::Fence;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use xfer::RegionDescriptor;
use xfer::weights::SyncError;
use xfer::weights::exec::{Changes, Destination, Source, SourceInfo, SyncOptions};
use xfer::weights::{Holding, Layout, Piece, Plan, RegionSpec, TensorSpec, check};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What one rank holds of a model's tensors, and where: tensors (global name, shape,
/// element size), regions (name, bytes: one per registered tensor or array, in the order
/// the registrations are given), and pieces (part of a tensor: a box of its index space or
/// a flat range of its row-major order, stored contiguously at a byte offset of a region).
#[pyclass(module = "xfer.weights", name = "Layout")]
#[derive(Clone, Default)]
pub struct PyLayout {
    tensors: Vec<TensorSpec>,
    regions: Vec<RegionSpec>,
    pieces: Vec<Piece>,
}

impl PyLayout {
    /// The library's layout.
    fn layout(&self) -> Layout {
        Layout {
            regions: self.regions.clone(),
            tensors: Arc::from(self.tensors.clone()),
            pieces: self.pieces.clone(),
        }
    }

    fn from_layout(l: &Layout) -> PyLayout {
        PyLayout {
            tensors: l.tensors.to_vec(),
            regions: l.regions.clone(),
            pieces: l.pieces.clone(),
        }
    }

    /// A tensor or region given by name or index.
    fn index(what: &str, names: &[&str], key: &Bound<'_, PyAny>) -> PyResult<u32> {
        if let Ok(i) = key.extract::<u32>() {
            if (i as usize) < names.len() {
                return Ok(i);
            }
            return Err(invalid(format!(
                "no {what} {i}: the layout has {}",
                names.len()
            )));
        }
        let name: String = key.extract().map_err(|_| {
            invalid(format!(
                "a {what} is named by its name (str) or index (int)"
            ))
        })?;
        names
            .iter()
            .position(|n| *n == name)
            .map(|i| i as u32)
            .ok_or_else(|| invalid(format!("no {what} named {name:?} in the layout")))
    }
}

fn layouts(list: &[PyRef<'_, PyLayout>]) -> Vec<Layout> {
    list.iter().map(|l| l.layout()).collect()
}

#[pymethods]
impl PyLayout {
    /// An empty layout.
    #[new]
    fn new() -> PyLayout {
        PyLayout::default()
    }

    /// Declares tensor `name` (the same name on every rank) of global `shape` with
    /// elements of `elem_size` bytes; returns its index.
    fn add_tensor(&mut self, name: String, shape: Vec<u64>, elem_size: u32) -> PyResult<u32> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(invalid(format!("tensor {name:?} is declared twice")));
        }
        self.tensors.push(TensorSpec::new(name, shape, elem_size));
        Ok(self.tensors.len() as u32 - 1)
    }

    /// Declares region `name` of `nbytes` bytes (its registration comes in this position of
    /// the registrations given to Source or Destination); returns its index.
    fn add_region(&mut self, name: String, nbytes: u64) -> PyResult<u32> {
        if self.regions.iter().any(|r| r.name == name) {
            return Err(invalid(format!("region {name:?} is declared twice")));
        }
        self.regions.push(RegionSpec { name, len: nbytes });
        Ok(self.regions.len() as u32 - 1)
    }

    /// Adds a piece: part of `tensor` (name or index) stored at byte `offset` of `region`
    /// (name or index), either `box`, a `(start, end)` range per dimension stored row-major,
    /// or `flat`, a `(start, end)` range of the row-major elements. Returns its index.
    #[pyo3(signature = (tensor, region, offset=0, r#box=None, flat=None))]
    fn add_piece(
        &mut self,
        tensor: &Bound<'_, PyAny>,
        region: &Bound<'_, PyAny>,
        offset: u64,
        r#box: Option<Vec<(u64, u64)>>,
        flat: Option<(u64, u64)>,
    ) -> PyResult<u32> {
        let names: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        let tensor = PyLayout::index("tensor", &names, tensor)?;
        let names: Vec<&str> = self.regions.iter().map(|r| r.name.as_str()).collect();
        let region = PyLayout::index("region", &names, region)?;
        let holding = match (r#box, flat) {
            (Some(b), None) => Holding::Box(b.into_iter().map(|(s, e)| s..e).collect()),
            (None, Some((s, e))) => Holding::Flat(s..e),
            _ => return Err(invalid("give exactly one of box= and flat=")),
        };
        self.pieces.push(Piece {
            tensor,
            holding,
            region,
            offset,
        });
        Ok(self.pieces.len() as u32 - 1)
    }

    /// Checks the layout (pieces inside their tensors and regions, no two holding an
    /// element or a byte twice); raises InvalidArgument naming what is wrong.
    fn validate(&self) -> PyResult<()> {
        self.layout()
            .validate()
            .map_err(|e| invalid(format!("invalid layout: {e}")))
    }

    /// The layout as JSON (the library's serde form), to send to other ranks.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.layout()).map_err(|e| invalid(e.to_string()))
    }

    /// A layout from `to_json`'s text, validated.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<PyLayout> {
        let l: Layout =
            serde_json::from_str(text).map_err(|e| invalid(format!("not a layout: {e}")))?;
        l.validate()
            .map_err(|e| invalid(format!("invalid layout: {e}")))?;
        Ok(PyLayout::from_layout(&l))
    }

    /// `(name, shape, elem_size)` of each tensor declared.
    #[getter]
    fn tensors(&self) -> Vec<(String, Vec<u64>, u32)> {
        (self.tensors.iter())
            .map(|t| (t.name.clone(), t.shape.clone(), t.elem_size))
            .collect()
    }

    /// `(name, nbytes)` of each region.
    #[getter]
    fn regions(&self) -> Vec<(String, u64)> {
        (self.regions.iter())
            .map(|r| (r.name.clone(), r.len))
            .collect()
    }

    /// The number of pieces.
    #[getter]
    fn pieces(&self) -> usize {
        self.pieces.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "xfer.weights.Layout({} tensors, {} regions, {} pieces)",
            self.tensors.len(),
            self.regions.len(),
            self.pieces.len()
        )
    }
}

/// The static schedule of a sync from source layouts to destination layouts (rank `i` is
/// position `i` of each list): computed once, every destination byte planned exactly once.
#[pyclass(module = "xfer.weights", name = "Plan", frozen)]
pub struct PyPlan {
    plan: Mutex<Plan>,
}

#[pymethods]
impl PyPlan {
    /// Plans `sources` to `destinations` (GIL released).
    #[new]
    fn new(
        py: Python<'_>,
        sources: Vec<PyRef<'_, PyLayout>>,
        destinations: Vec<PyRef<'_, PyLayout>>,
    ) -> PyResult<PyPlan> {
        let (s, d) = (layouts(&sources), layouts(&destinations));
        let plan = py
            .detach(|| Plan::new(&s, &d))
            .map_err(|e| invalid(fabric_core::error::report(&e)))?;
        Ok(PyPlan {
            plan: Mutex::new(plan),
        })
    }

    /// Checks the plan against the layouts by other means than the planner's; returns the
    /// destination bytes written (each exactly once), or raises InvalidArgument.
    fn check(
        &self,
        py: Python<'_>,
        sources: Vec<PyRef<'_, PyLayout>>,
        destinations: Vec<PyRef<'_, PyLayout>>,
    ) -> PyResult<u64> {
        let (s, d) = (layouts(&sources), layouts(&destinations));
        let plan = lock(&self.plan).clone();
        py.detach(|| check(&s, &d, &plan))
            .map(|r| r.bytes)
            .map_err(|e| invalid(fabric_core::error::report(&e)))
    }

    /// Plans one more destination against `sources` without changing the others' pairs;
    /// returns its rank.
    fn add_destination(
        &self,
        py: Python<'_>,
        sources: Vec<PyRef<'_, PyLayout>>,
        layout: PyRef<'_, PyLayout>,
    ) -> PyResult<u32> {
        let (s, l) = (layouts(&sources), layout.layout());
        let plan = &self.plan;
        py.detach(|| lock(plan).add_destination(&s, &l))
            .map_err(|e| invalid(fabric_core::error::report(&e)))
    }

    /// Bytes moved.
    #[getter]
    fn bytes(&self) -> u64 {
        lock(&self.plan).bytes()
    }

    /// Contiguous segments the runs expand to.
    #[getter]
    fn segments(&self) -> u64 {
        lock(&self.plan).segment_count()
    }

    /// The number of sources.
    #[getter]
    fn sources(&self) -> u32 {
        lock(&self.plan).sources()
    }

    /// The number of destinations.
    #[getter]
    fn destinations(&self) -> u32 {
        lock(&self.plan).destinations()
    }

    /// Bytes each source sends.
    fn source_bytes(&self) -> Vec<u64> {
        lock(&self.plan).source_bytes()
    }

    /// Bytes each destination receives.
    fn destination_bytes(&self) -> Vec<u64> {
        lock(&self.plan).destination_bytes()
    }

    fn __repr__(&self) -> String {
        let p = lock(&self.plan);
        format!(
            "xfer.weights.Plan({} sources -> {} destinations, {} bytes, {} segments)",
            p.sources(),
            p.destinations(),
            p.bytes(),
            p.segment_count()
        )
    }
}

/// Regions (Python's `Region`s) as the library's, checked against the agent.
fn regions_of(
    py: Python<'_>,
    engine: &Engine,
    regs: &[Py<Registration>],
) -> PyResult<Vec<xfer::Region>> {
    regs.iter()
        .map(|r| {
            let r = r.get();
            engine.check_registration(py, r)?;
            Ok(r.region().clone())
        })
        .collect()
}

/// Descriptor bytes as the library's descriptors.
fn descriptors_of(list: &[Vec<u8>], what: &str) -> PyResult<Vec<RegionDescriptor>> {
    list.iter()
        .map(|b| RegionDescriptor::from_bytes(b).map_err(|e| metadata_error(what, &e)))
        .collect()
}

/// The sync's options from keyword arguments.
fn sync_options(
    chunk_bytes: Option<u64>,
    max_inflight_bytes: Option<u64>,
    max_inflight_transfers: Option<usize>,
    timeout: Option<f64>,
) -> PyResult<SyncOptions> {
    let mut o = SyncOptions::default();
    if let Some(b) = chunk_bytes {
        o = o.chunk_bytes(b);
    }
    if let Some(b) = max_inflight_bytes {
        o = o.max_inflight_bytes(b);
    }
    if let Some(n) = max_inflight_transfers {
        o = o.max_inflight_transfers(n);
    }
    if let Some(t) = seconds(timeout, "timeout")? {
        o = o.transfer_timeout(t);
    }
    Ok(o)
}

/// A refresh's changes as a dict: "attached" and "dropped" (lists of (rank, member name)),
/// "waiting" (list of (member name, why)).
fn changes_dict<'py>(py: Python<'py>, c: Changes) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("attached", c.attached)?;
    d.set_item("dropped", c.dropped)?;
    d.set_item("waiting", c.waiting)?;
    Ok(d)
}

/// One refresh of a member sync against `following`, with the GIL released; its changes.
fn refresh_members<'py, S: Send>(
    py: Python<'py>,
    following: &Following,
    sync: &Mutex<S>,
    refresh: impl FnOnce(&mut S, &xfer::discovery::Following) -> Result<Changes, SyncError> + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let c = following
        .with(py, |f| refresh(&mut lock(sync), f))?
        .map_err(|e| sync_error(&e))?;
    changes_dict(py, c)
}

/// Refreshes with `refresh` until `done`, sleeping between two refreshes until the cluster
/// changes (at most a slice of `wait_sliced`, so that Python signals are seen), for at most
/// `timeout`; then `give_up` (the library's own wait, with no time left) says why. Returns
/// every change seen.
fn wait_members<'py, S: Send>(
    py: Python<'py>,
    following: &Following,
    sync: &Mutex<S>,
    timeout: Duration,
    refresh: impl Fn(&mut S, &xfer::discovery::Following) -> Result<Changes, SyncError> + Sync,
    done: impl Fn(&S) -> bool + Sync,
    give_up: impl FnOnce(&mut S, &xfer::discovery::Following) -> Result<Changes, SyncError> + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let closed = || invalid("this Following was closed");
    let mut all = Changes::default();
    let got = wait_sliced(py, Some(timeout), |slice| {
        let guard = following.inner();
        let Some(f) = guard.as_ref() else {
            return Some(Err(None));
        };
        let mut s = lock(sync);
        match refresh(&mut s, f) {
            Err(e) => Some(Err(Some(e))),
            Ok(c) => {
                all.merge(c);
                if done(&s) {
                    return Some(Ok(()));
                }
                drop(s);
                let _ = f.next_event(slice);
                None
            }
        }
    })?;
    match got {
        Some(Ok(())) => changes_dict(py, all),
        Some(Err(Some(e))) => Err(sync_error(&e)),
        Some(Err(None)) => Err(closed()),
        None => {
            let last = py.detach(|| {
                let guard = following.inner();
                guard.as_ref().map(|f| give_up(&mut lock(sync), f))
            });
            match last {
                None => Err(closed()),
                Some(Err(e)) => Err(member_wait_error(&e)),
                Some(Ok(c)) => {
                    all.merge(c);
                    changes_dict(py, all)
                }
            }
        }
    }
}

fn version_of(v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| invalid(format!("version={v}: expected 0..2**32")))
}

/// A source rank of a sync: pushes its share of the plan to the destinations attached.
///
/// agent: its Agent; plan: the Plan; rank: its rank in it; layout: its Layout;
/// registrations: one Region per region of the layout, in order (with
/// remote_read=True if destinations are to pull; kept open while the source lives). chunk_bytes, max_inflight_bytes,
/// max_inflight_transfers: how pushes are cut and how much may be in flight; timeout: each
/// transfer's limit, in seconds. A push raises RegionInvalidated if a registered torch
/// tensor's storage was resized since it was registered (see Agent.register), and a
/// piece whose storage its prepare hook moved fails the destinations that need it.
#[pyclass(module = "xfer.weights", name = "Source", frozen)]
pub struct PySource {
    engine: Py<Engine>,
    /// The registrations, kept open while the source lives (a dropped one deregisters),
    /// and checked before each push (a torch tensor's storage must not have moved).
    registrations: Vec<Py<Registration>>,
    sync: Mutex<Source>,
    /// The registered objects (for stream order), and their CUDA device.
    objs: Vec<(Py<PyAny>, Option<u32>)>,
}

#[pymethods]
impl PySource {
    #[new]
    #[pyo3(signature = (agent, plan, rank, layout, registrations, chunk_bytes=None, max_inflight_bytes=None, max_inflight_transfers=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent: Py<Engine>,
        plan: &PyPlan,
        rank: u32,
        layout: PyRef<'_, PyLayout>,
        registrations: Vec<Py<Registration>>,
        chunk_bytes: Option<u64>,
        max_inflight_bytes: Option<u64>,
        max_inflight_transfers: Option<usize>,
        timeout: Option<f64>,
    ) -> PyResult<PySource> {
        let engine = agent;
        let agent = engine.get().agent_handle()?;
        let regions = regions_of(py, engine.get(), &registrations)?;
        let objs = registrations
            .iter()
            .filter_map(|r| r.get().object(py).map(|o| (o, r.get().cuda_device())))
            .collect();
        let l = layout.layout();
        let o = sync_options(
            chunk_bytes,
            max_inflight_bytes,
            max_inflight_transfers,
            timeout,
        )?;
        let plan = lock(&plan.plan).clone();
        let sync = py
            .detach(|| Source::new(&agent, &plan, rank, l, regions))
            .map_err(|e| sync_error(&e))?
            .with_options(o);
        Ok(PySource {
            engine,
            registrations,
            sync: Mutex::new(sync),
            objs,
        })
    }

    /// Attaches destination `rank`: pushes go to `peer` (a Peer of this source's agent),
    /// into `descriptors` (its registrations' descriptors, one per region of its layout, in
    /// order).
    fn attach(&self, rank: u32, peer: &Peer, descriptors: Vec<Vec<u8>>) -> PyResult<()> {
        self.engine.get().check_peer(peer)?;
        let d = descriptors_of(&descriptors, "descriptors")?;
        lock(&self.sync)
            .attach(rank, peer.inner().clone(), d)
            .map_err(|e| sync_error(&e))
    }

    /// Detaches destination `rank` (it stays planned).
    fn detach(&self, rank: u32) {
        lock(&self.sync).detach(rank);
    }

    /// Plans in a destination that was not in the plan (`sources`: every source's Layout in
    /// rank order); returns its rank, to attach next.
    fn add_destination(
        &self,
        py: Python<'_>,
        sources: Vec<PyRef<'_, PyLayout>>,
        layout: PyRef<'_, PyLayout>,
    ) -> PyResult<u32> {
        let (s, l) = (layouts(&sources), layout.layout());
        let sync = &self.sync;
        py.detach(|| lock(sync).add_destination(&s, &l))
            .map_err(|e| sync_error(&e))
    }

    /// Drops destination `rank` (it left).
    fn remove_destination(&self, rank: u32) {
        lock(&self.sync).remove_destination(rank);
    }

    /// Says that the weights are about to change (pulls meanwhile retry); the next push
    /// says which version they hold.
    fn begin_update(&self) -> PyResult<()> {
        lock(&self.sync).begin_update().map_err(|e| sync_error(&e))
    }

    /// Pushes `version` to every attached destination (or to `destinations`, a list of
    /// ranks: to redo one), GIL released. Returns a dict: rank -> a dict of what landed
    /// (bytes, transfers, segments, landed_s), or the exception that failed that
    /// destination alone (PeerUnreachable, PeerRemoved, TimedOut, ...: its message names
    /// the destination). Raises only for a version that cannot be signalled.
    ///
    /// prepare(piece, tensor_name, region): called once per piece of the layout, just
    /// before its first bytes are sent (with the GIL), where dtype conversion or FSDP
    /// gathering would write it into its registered tensor; it returns None, or the CUDA
    /// stream that writes it (the piece's transfers wait for the work queued there). It
    /// must not call this Source (the push holds it); an exception it raises fails the
    /// destinations that need the piece.
    /// stream: the stream whose queued work every transfer waits for (default: torch's
    /// current stream of the first CUDA registration; none for host memory).
    #[pyo3(signature = (version, destinations=None, prepare=None, stream=None))]
    fn push<'py>(
        &self,
        py: Python<'py>,
        version: i64,
        destinations: Option<Vec<u32>>,
        prepare: Option<Py<PyAny>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let version = version_of(version)?;
        Registration::check_storages(py, &self.registrations, "this push is refused")?;
        let cuda = self.objs.iter().find(|(_, d)| d.is_some());
        let base: Option<Arc<dyn Fence>> = match cuda {
            Some((obj, Some(device))) => {
                Some(crate::stream::fence_for(obj.bind(py), stream, *device)?)
            }
            _ if stream.is_some_and(|s| !s.is_none()) => {
                return Err(invalid(
                    "stream= orders pushes of GPU memory, and this source's registrations \
                     are host memory: leave stream out",
                ));
            }
            _ => None,
        };
        let cuda_obj = cuda.map(|(o, d)| (o.clone_ref(py), d.unwrap_or(0)));
        let (sync, registrations) = (&self.sync, &self.registrations);
        let report = py.detach(|| {
            let sync = lock(sync);
            let hook =
                |p: xfer::weights::exec::PieceToSend<'_>| -> xfer::weights::exec::PrepareResult {
                    let Some(f) = &prepare else {
                        return Ok(base.clone());
                    };
                    Python::attach(|py| {
                        let got = f
                            .call1(py, (p.index, p.tensor.name.as_str(), p.piece.region))
                            .map_err(|e| e.to_string())?;
                        // What prepare did may have reallocated the piece's tensor (a
                        // storage resized to gather it): its bytes are not sent from memory
                        // that was freed.
                        if let Some(r) = registrations.get(p.piece.region as usize) {
                            r.get()
                                .check_storage(py, &format!("piece {} after prepare", p.index))
                                .map_err(|e| e.to_string())?;
                        }
                        if got.is_none(py) {
                            return Ok(base.clone());
                        }
                        let Some((obj, device)) = &cuda_obj else {
                            return Err(
                                "prepare returned a stream, and this source holds host memory"
                                    .into(),
                            );
                        };
                        let fence =
                            crate::stream::fence_for(obj.bind(py), Some(got.bind(py)), *device)
                                .map_err(|e| e.to_string())?;
                        Ok(Some(fence))
                    })
                };
            match (&destinations, prepare.is_some() || base.is_some()) {
                (d, true) => sync.push_with(version, d.as_deref(), hook),
                (Some(d), false) => sync.push_to(version, d),
                (None, false) => sync.push(version),
            }
        });
        let report = report.map_err(|e| sync_error(&e))?;
        let out = PyDict::new(py);
        for (rank, r) in &report.destinations {
            match r {
                Ok(s) => {
                    let d = PyDict::new(py);
                    d.set_item("bytes", s.bytes)?;
                    d.set_item("transfers", s.transfers)?;
                    d.set_item("segments", s.segments)?;
                    d.set_item("landed_s", s.landed.as_secs_f64())?;
                    out.set_item(rank, d)?;
                }
                Err(e) => out.set_item(rank, sync_error(e).into_value(py))?,
            }
        }
        Ok(out)
    }

    /// Offers the layout's regions under their names and the record (for the directory:
    /// publish the agent after).
    fn offer(&self) -> PyResult<()> {
        lock(&self.sync).offer().map_err(|e| agent_error(&e))
    }

    /// Brings the destinations in line with the cluster `following` follows (see
    /// `Directory.follow`): every destination member (one that offered a destination's
    /// record and joined) is attached, under its planned rank, or planned in first if it
    /// joined later; every attached one that left is dropped. Returns the changes as a dict
    /// ("attached", "dropped": lists of (rank, name); "waiting": (name, why) for members
    /// that cannot be attached yet, which a later refresh tries again).
    fn refresh<'py>(&self, py: Python<'py>, following: &Following) -> PyResult<Bound<'py, PyDict>> {
        refresh_members(py, following, &self.sync, |s, f| s.refresh(f))
    }

    /// Refreshes until `count` destinations are attached (each change of the cluster
    /// wakes it), or fails with `TimedOut` after `timeout` seconds; returns the changes.
    #[pyo3(signature = (following, count, timeout=60.0))]
    fn wait_attached<'py>(
        &self,
        py: Python<'py>,
        following: &Following,
        count: usize,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = seconds(Some(timeout), "timeout")?.unwrap_or_default();
        wait_members(
            py,
            following,
            &self.sync,
            t,
            |s, f| s.refresh(f),
            |s| s.attached().len() >= count,
            |s, f| s.wait_attached(f, count, Duration::ZERO),
        )
    }

    /// Its rank.
    #[getter]
    fn rank(&self) -> u32 {
        lock(&self.sync).rank()
    }

    /// The destination ranks attached.
    #[getter]
    fn attached(&self) -> Vec<u32> {
        lock(&self.sync).attached()
    }

    /// The version its weights hold at rest (None before the first push and after
    /// begin_update).
    #[getter]
    fn version(&self) -> Option<u32> {
        lock(&self.sync).version()
    }

    /// Its record region's descriptor (bytes): what a pulling Destination attaches it with.
    #[getter]
    fn record<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = (lock(&self.sync).record().descriptor().to_bytes())
            .map_err(|e| metadata_error("the record's descriptor", &e))?;
        Ok(PyBytes::new(py, &b))
    }

    fn __repr__(&self) -> String {
        format!("xfer.weights.{:?}", lock(&self.sync))
    }
}

/// A destination rank of a sync: waits for pushed versions, or pulls its share.
///
/// agent: its Agent; layout: its Layout; registrations: one Region per region of
/// the layout, in order (writable; kept open while the destination lives); sources: how many sources the sync has; rank: its rank
/// in the plan (None for a destination that joins later). chunk_bytes,
/// max_inflight_bytes, max_inflight_transfers, timeout: as Source's, for pulls. Waits and
/// pulls raise RegionInvalidated if a registered torch tensor's storage was resized since
/// it was registered (see Agent.register).
#[pyclass(module = "xfer.weights", name = "Destination", frozen)]
pub struct PyDestination {
    engine: Py<Engine>,
    /// The registrations, kept open while the destination lives, and checked before each
    /// wait and pull (a torch tensor's storage must not have moved).
    registrations: Vec<Py<Registration>>,
    sync: Mutex<Destination>,
}

#[pymethods]
impl PyDestination {
    #[new]
    #[pyo3(signature = (agent, layout, registrations, sources, rank=None, chunk_bytes=None, max_inflight_bytes=None, max_inflight_transfers=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent: Py<Engine>,
        layout: PyRef<'_, PyLayout>,
        registrations: Vec<Py<Registration>>,
        sources: u32,
        rank: Option<u32>,
        chunk_bytes: Option<u64>,
        max_inflight_bytes: Option<u64>,
        max_inflight_transfers: Option<usize>,
        timeout: Option<f64>,
    ) -> PyResult<PyDestination> {
        let engine = agent;
        let agent = engine.get().agent_handle()?;
        let regions = regions_of(py, engine.get(), &registrations)?;
        let l = layout.layout();
        let o = sync_options(
            chunk_bytes,
            max_inflight_bytes,
            max_inflight_transfers,
            timeout,
        )?;
        let sync = py
            .detach(|| Destination::new(&agent, l, regions, sources, rank))
            .map_err(|e| sync_error(&e))?
            .with_options(o);
        Ok(PyDestination {
            engine,
            registrations,
            sync: Mutex::new(sync),
        })
    }

    /// Blocks (GIL released) until every source has signalled `version`: its bytes have
    /// landed. Raises TimedOut naming the sources not heard from after `timeout` seconds
    /// (None: no limit; Ctrl-C still interrupts); signals heard count for the next wait.
    #[pyo3(signature = (version, timeout=None))]
    fn wait(&self, py: Python<'_>, version: i64, timeout: Option<f64>) -> PyResult<()> {
        let version = version_of(version)?;
        let limit = seconds(timeout, "timeout")?;
        Registration::check_storages(py, &self.registrations, "this wait is refused")?;
        let sync = &self.sync;
        let done = wait_sliced(py, limit, |slice| {
            match lock(sync).wait(version, slice.max(Duration::from_millis(1))) {
                Ok(()) => Some(Ok(())),
                Err(xfer::weights::SyncError::NotLanded { .. }) => None,
                Err(e) => Some(Err(e)),
            }
        })?;
        match done {
            Some(r) => r.map_err(|e| sync_error(&e)),
            None => {
                // The last look, naming who is missing.
                let e = py.detach(|| lock(sync).wait(version, Duration::ZERO));
                match e {
                    Ok(()) => Ok(()),
                    Err(xfer::weights::SyncError::NotLanded { missing, .. }) => {
                        Err(crate::errors::TimedOut::new_err(format!(
                            "version {version} has not landed after {:?}: no signal from \
                             sources {missing:?}",
                            limit.unwrap_or(SIGNAL_EVERY)
                        )))
                    }
                    Err(e) => Err(sync_error(&e)),
                }
            }
        }
    }

    /// Attaches source `rank` for pulls: `peer` (a Peer of this agent), its `layout`, its
    /// registrations' `descriptors` (one per region of its layout) and its `record`
    /// (Source.record).
    fn attach_source(
        &self,
        rank: u32,
        peer: &Peer,
        layout: PyRef<'_, PyLayout>,
        descriptors: Vec<Vec<u8>>,
        record: Vec<u8>,
    ) -> PyResult<()> {
        self.engine.get().check_peer(peer)?;
        let info = SourceInfo {
            peer: peer.inner().clone(),
            layout: layout.layout(),
            regions: descriptors_of(&descriptors, "descriptors")?,
            record: RegionDescriptor::from_bytes(&record)
                .map_err(|e| metadata_error("record", &e))?,
        };
        lock(&self.sync)
            .attach_source(rank, info)
            .map_err(|e| sync_error(&e))
    }

    /// Reads this destination's share from the sources (all attached) with READs, GIL
    /// released: the version every source holds at rest (`version`, if given), looked at
    /// again while they change, up to `timeout` seconds. Returns the version read.
    #[pyo3(signature = (version=None, timeout=60.0))]
    fn pull(&self, py: Python<'_>, version: Option<i64>, timeout: f64) -> PyResult<u32> {
        let version = version.map(version_of).transpose()?;
        let t = seconds(Some(timeout), "timeout")?.unwrap_or_default();
        Registration::check_storages(py, &self.registrations, "this pull is refused")?;
        let sync = &self.sync;
        py.detach(|| lock(sync).pull(version, t))
            .map(|r| r.version)
            .map_err(|e| sync_error(&e))
    }

    /// Offers the layout's regions under their names and the record (for the directory).
    fn offer(&self) -> PyResult<()> {
        lock(&self.sync).offer().map_err(|e| agent_error(&e))
    }

    /// Attaches the sources among the members of the cluster `following` follows (see
    /// `Directory.follow`), for pulls, and drops those that left. Returns the changes as
    /// `Source.refresh` does.
    fn refresh<'py>(&self, py: Python<'py>, following: &Following) -> PyResult<Bound<'py, PyDict>> {
        refresh_members(py, following, &self.sync, |s, f| s.refresh(f))
    }

    /// Refreshes until every source is attached (each change of the cluster wakes it), or
    /// fails with `TimedOut` after `timeout` seconds; returns the changes.
    #[pyo3(signature = (following, timeout=60.0))]
    fn wait_sources<'py>(
        &self,
        py: Python<'py>,
        following: &Following,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = seconds(Some(timeout), "timeout")?.unwrap_or_default();
        wait_members(
            py,
            following,
            &self.sync,
            t,
            |s, f| s.refresh(f),
            |s| s.attached_sources().len() as u32 >= s.sources(),
            |s, f| s.wait_sources(f, Duration::ZERO),
        )
    }

    /// Its registrations' descriptors (bytes, one per region): what sources attach it with.
    #[getter]
    fn descriptors<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        (lock(&self.sync).descriptors().iter())
            .map(|d| {
                let b = d
                    .to_bytes()
                    .map_err(|e| metadata_error("a descriptor", &e))?;
                Ok(PyBytes::new(py, &b))
            })
            .collect()
    }

    /// Its rank in the plan, if it was planned with the others.
    #[getter]
    fn rank(&self) -> Option<u32> {
        lock(&self.sync).rank()
    }

    /// How many sources it hears from.
    #[getter]
    fn sources(&self) -> u32 {
        lock(&self.sync).sources()
    }

    fn __repr__(&self) -> String {
        format!("xfer.weights.{:?}", lock(&self.sync))
    }
}
