//! The Python classes `Agent`, `Region` and `Peer`: handles on one [`xfer::Agent`], named
//! as the library names them (the Rust structs here are [`Engine`] and [`Registration`];
//! `xfer.Engine`, `xfer.Registration` and `xfer.EngineClosed` are the package's deprecated
//! aliases, in `xfer/__init__.py`).
//!
//! An `Agent` holds the agent (built by the library from the keyword arguments,
//! [`crate::options`]); a `Region` holds the library's region and the registered
//! object, a `Peer` the library's peer. What keeps registered memory alive goes to the agent
//! (`Agent::register_kept`), which lets go of it only once no transport can touch it.
//!
//! Every call into the agent runs with the GIL released (and so does the drop of a handle
//! on it, which may be its last); long waits wake every 50 ms to let Python deliver signals
//! (Ctrl-C), and a transfer's completion is decided on the transfer engine's workers, never
//! in Python.

use crate::args::{imm_value, pages, positive, seconds, triples, wait_sliced};
use crate::errors::{AgentClosed, agent_error, invalid, metadata_error};
use crate::handle::Handle;
use crate::memory::{self, Accept};
use crate::options::EngineArgs;
use fabric_core::{Access, Fence, MemoryLocation};
use pyo3::exceptions::{PyDeprecationWarning, PyUserWarning};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::ffi::CString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use xfer::layers::AgentLayers;
use xfer::{Agent, AgentInfo, RegionDescriptor, Transfer, TransportKind};

/// What an agent, its regions and its peers share.
struct Shared {
    /// The agent; `None` once it is closed.
    agent: Mutex<Option<Agent>>,
    /// The objects of open registrations, by registration (what `Region.obj`
    /// returns, and where a transfer finds the tensor whose stream it follows), with their
    /// torch storage's record.
    objs: Mutex<HashMap<u64, Kept>>,
    next_reg: AtomicU64,
    /// What memory the agent takes.
    accept: Accept,
    /// The agent's metadata, as bytes (`Agent.info`).
    info: Vec<u8>,
    /// Rendezvous servers started by `Agent.serve`, stopped by `close`.
    servers: Mutex<Vec<Arc<ServerCell>>>,
}

/// An open registration's object, and a torch tensor's storage as it was registered
/// (checked before each local use of the registration).
struct Kept {
    obj: Py<PyAny>,
    storage: Option<memory::StorageGuard>,
}

/// A rendezvous server; `None` once stopped.
type ServerCell = Mutex<Option<xfer::rendezvous::Server>>;

/// A direct-rendezvous server of an agent, from `Agent.serve`: peers'
/// `Agent.rendezvous(address)` reach the agent through it and get its offered regions by
/// name. It stops with `stop()` or when the agent closes.
#[pyclass(module = "xfer", frozen)]
pub struct Server {
    cell: Arc<ServerCell>,
    address: String,
}

#[pymethods]
impl Server {
    /// Where it listens, "IP:PORT".
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// Stops accepting: the port closes, clients already served keep their connections.
    /// Stopping twice is fine.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let s = lock(&self.cell).take();
        match s {
            Some(s) => py
                .detach(|| s.stop())
                .map_err(|e| invalid(format!("the rendezvous server had failed: {e}"))),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        let state = if lock(&self.cell).is_some() {
            "serving"
        } else {
            "stopped"
        };
        format!("xfer.Server({:?}, {state})", self.address)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `AgentClosed`: a call on an agent after its close.
fn agent_closed() -> PyErr {
    AgentClosed::new_err("the agent is closed")
}

/// A `DeprecationWarning` that `old` is now `new`, raised at the caller's line (an error
/// where the warnings filter makes it one).
fn deprecated(py: Python<'_>, old: &str, new: &str) -> PyResult<()> {
    let msg = CString::new(format!(
        "{old} is deprecated: use {new}, the name the xfer library gives it"
    ))
    .expect("no NUL in names");
    PyErr::warn(py, &py.get_type::<PyDeprecationWarning>(), &msg, 1)
}

impl Shared {
    /// A handle on the agent, or `AgentClosed`.
    fn agent(&self) -> PyResult<Agent> {
        lock(&self.agent).clone().ok_or_else(agent_closed)
    }

    /// Runs `f` on the agent with the GIL released. The handle is dropped there too: if the
    /// agent was closed meanwhile it is the agent's last, and its drop stops the workers.
    fn with_agent<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Agent) -> xfer::Result<R> + Send,
    ) -> PyResult<R> {
        let agent = self.agent()?;
        py.detach(move || {
            let r = f(&agent);
            drop(agent);
            r
        })
        .map_err(|e| agent_error(&e))
    }
}

/// An agent of the `xfer` library (Rust's `xfer::Agent`): it registers memory, connects to
/// peers and moves bytes between them. Keyword arguments mirror the `xfer` command's flags.
/// (`xfer.Engine` is its old name, deprecated.)
///
/// - transport: "auto" (the default: every transport that can work here, the best chosen
///   for each peer from what both offer: "cuda-ipc" between GPU memory of one host, "efa"
///   where the placement plan gives EFA NICs, "tcp" otherwise; so two GPU hosts reach each
///   other over tcp and two GPU processes of one host over cuda-ipc), or one transport only:
///   "tcp" (any two hosts, host or GPU memory), "cuda-ipc" (GPU memory between processes of
///   one host), "efa" (libfabric: EFA on AWS, or the provider named by `provider`), "mem"
///   (agents of one process).
/// - provider: the libfabric provider of the efa transport ("efa" by default; "tcp",
///   "sockets", "shm" elsewhere).
/// - rails: worker threads of each transport, each with its own connection or NIC;
///   transfers spread over them. Default: one per NIC chosen, else 1.
/// - nics: the NICs the rails run on (rail i on nics[i % len]): a list of names (tcp
///   interfaces, or efa libfabric domains), or "auto" (the default): the placement plan's
///   NICs for the agent's GPU, the route toward a non-loopback `listen` address for tcp,
///   none on loopback.
/// - memory: "host" or "cuda", what this agent registers; gpu: the CUDA device ordinal.
/// - auth_token: a shared secret that tcp peers must know (both ends prove it).
///   auth_token_file: a file holding it instead (read once, here; one final newline
///   trimmed), so that it is not in the process's arguments or environment for every
///   local user to read in /proc; unreadable, empty, or given with auth_token:
///   InvalidArgument. Without a token, an agent whose tcp rails listen beyond loopback
///   (listen="0.0.0.0" or a host address) lets whoever reaches them read and write the
///   memory it registers for remote access: it warns (a UserWarning, and the library's
///   log), or with require_auth=True refuses to start (InvalidArgument).
/// - timeout: seconds; the limit of control calls and of setting up a tcp connection.
/// - liveness_timeout: seconds a peer may leave its connection unanswered (stopped,
///   descheduled, cut off) before it is declared dead and its transfers fail with
///   PeerUnreachable (tcp; None, the default: 30). Shorter stalls are stall_timeout's.
/// - listen: the IP address tcp rails listen on (e.g. "0.0.0.0" or the host's address
///   for peers on other hosts).
/// - wait_spin_us: how long a wait spins before it sleeps (default 200): lower latency for
///   short transfers, at the cost of the waiting thread's core.
/// - pin: "off" (the default: workers run where the OS puts them) or "auto": pinned to the
///   placement plan's cores. The library pins every agent to the cores of the plan's first
///   worker, whatever its gpu and process: right for one agent on a host, but several
///   agents (one per GPU, or a prefill and a decode process) would share those cores, so
///   it is off unless asked for.
/// - tcp_congestion: the tcp connections' congestion control: "auto" (the default) takes
///   connections over loopback off BBR, whose pacing halves a stream between processes of
///   one host, and leaves the rest to the system; "system" never changes it; a name
///   ("cubic", "reno", "bbr") sets it on every connection (unprivileged: those in
///   net.ipv4.tcp_allowed_congestion_control; a name the kernel refuses fails the agent).
/// - stall_timeout: seconds a transfer may make no progress, its peer's connection
///   standing (a stopped or descheduled process), before Handle.wait raises PeerStalled
///   (the transfer goes on: wait again or cancel). None (the default): never.
///
/// `info` is the agent's metadata (the library's `AgentInfo`, as bytes): peers pass it to
/// connect, which picks the transport for that peer (Peer.transport).
///
/// An agent is a context manager; close() (or leaving the `with` block) stops it and
/// gives back every registered buffer.
#[pyclass(module = "xfer", name = "Agent", frozen)]
pub struct Engine {
    shared: Arc<Shared>,
}

/// Memory registered with an agent (Rust's `xfer::Region`): the object stays alive (and
/// is not freed or resized) until the region is closed, by close(), a `with` block, or the
/// agent's close; for a torch tensor, its storage too (set_() and del cannot free it),
/// and a storage resized meanwhile makes the region's next use raise RegionInvalidated
/// (see Agent.register). `descriptor` is the library's region descriptor, as bytes.
/// (`xfer.Registration` is its old name, deprecated.)
#[pyclass(module = "xfer", name = "Region", frozen)]
pub struct Registration {
    shared: Arc<Shared>,
    id: u64,
    region: xfer::Region,
    descriptor: Vec<u8>,
    location: MemoryLocation,
    closed: AtomicBool,
}

/// A peer of an agent (Rust's `xfer::Peer`), from Agent.connect, reached over one
/// transport (`transport`).
#[pyclass(module = "xfer", frozen)]
pub struct Peer {
    peer: xfer::Peer,
    removed: AtomicBool,
}

/// Arrivals of a peer's immediate data (Rust's `xfer::Notification`): `imm` (the 32-bit
/// immediate value), `count` (how many arrivals of this sender and value: 1 from
/// next_notification), `sender` (the sending agent's name where this agent knows it, from
/// connect or know; else None) and `message` (the bytes the sender attached with message=,
/// else None). `value` is the old name of `imm`, deprecated.
#[pyclass(module = "xfer", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct Notification {
    #[pyo3(get)]
    sender: Option<String>,
    #[pyo3(get)]
    imm: u32,
    #[pyo3(get)]
    count: u64,
    message: Option<Vec<u8>>,
}

#[pymethods]
impl Notification {
    /// The bytes the sender attached (message=), or None.
    #[getter]
    fn message<'py>(&self, py: Python<'py>) -> Option<Bound<'py, pyo3::types::PyBytes>> {
        self.message
            .as_deref()
            .map(|m| pyo3::types::PyBytes::new(py, m))
    }

    /// Deprecated: the old name of `imm` (a DeprecationWarning, then `imm`).
    #[getter]
    fn value(&self, py: Python<'_>) -> PyResult<u32> {
        deprecated(py, "Notification.value", "Notification.imm")?;
        Ok(self.imm)
    }

    fn __repr__(&self) -> String {
        format!(
            "Notification(sender={}, imm={}, count={}, message={})",
            self.sender
                .as_deref()
                .map_or("None".into(), |s| format!("{s:?}")),
            self.imm,
            self.count,
            self.message
                .as_deref()
                .map_or("None".into(), |m| format!("{} bytes", m.len())),
        )
    }
}

impl From<xfer::Notification> for Notification {
    fn from(n: xfer::Notification) -> Self {
        Notification {
            sender: n.sender,
            imm: n.imm,
            count: n.count,
            message: n.message,
        }
    }
}

/// `t` with its immediate value, message and timeout, where given.
fn with_extras(
    t: Transfer,
    imm: Option<u32>,
    message: Option<Vec<u8>>,
    timeout: Option<Duration>,
) -> Transfer {
    let t = match imm {
        Some(v) => t.imm(v),
        None => t,
    };
    let t = match message {
        Some(m) => t.message(m),
        None => t,
    };
    match timeout {
        Some(d) => t.timeout(d),
        None => t,
    }
}

/// Pages of `write_pages` / `read_pages` as a transfer: `(pages, stride, side)` for each
/// side, `side` naming the arguments in errors (`{side}_pages`, `{side}_stride`); strides
/// default to `page_size`. A WRITE; `read_pages` turns it around.
fn paged(
    page_size: i64,
    (local_pages, local_stride, local): (&Bound<'_, PyAny>, Option<i64>, &str),
    (remote_pages, remote_stride, remote): (&Bound<'_, PyAny>, Option<i64>, &str),
) -> PyResult<Transfer> {
    let len = positive(page_size, "page_size")?;
    let ls = positive(
        local_stride.unwrap_or(page_size),
        &format!("{local}_stride"),
    )?;
    let rs = positive(
        remote_stride.unwrap_or(page_size),
        &format!("{remote}_stride"),
    )?;
    let lp = pages(local_pages, &format!("{local}_pages"))?;
    let rp = pages(remote_pages, &format!("{remote}_pages"))?;
    Transfer::pages(&lp, ls, &rp, rs, len).map_err(|e| agent_error(&e))
}

/// The tcp rails of `info` whose addresses are beyond loopback, "IP:PORT" each: what the
/// library's start-up check (`xfer::layers::lanes`, its warning or `require_auth`) counts as
/// exposed, for the agent's Python warning.
fn exposed_rails(info: &AgentInfo) -> Vec<String> {
    info.transports
        .iter()
        .filter(|t| t.kind == TransportKind::Tcp)
        .flat_map(|t| &t.rails)
        .filter_map(|a| {
            let s = std::str::from_utf8(a).ok()?;
            let at: SocketAddr = s.strip_prefix("tcp://").unwrap_or(s).parse().ok()?;
            (!at.ip().is_loopback()).then(|| at.to_string())
        })
        .collect()
}

impl Engine {
    /// The Python agent over `agent`, whose CUDA memory is on device `gpu`.
    pub(crate) fn from_agent(agent: Agent, gpu: u32) -> PyResult<Engine> {
        let info = agent
            .info()
            .to_bytes()
            .map_err(|e| metadata_error("the agent's own metadata", &e))?;
        let kinds = agent.transports();
        let accept = Accept {
            gpu,
            // Host memory goes over another transport where the agent has one beside
            // cuda-ipc (memory="cuda" with auto: tcp too).
            device_only: kinds.iter().all(|&k| k == TransportKind::CudaIpc),
            host_only: kinds.contains(&TransportKind::Mem),
        };
        Ok(Engine {
            shared: Arc::new(Shared {
                agent: Mutex::new(Some(agent)),
                objs: Mutex::new(HashMap::new()),
                next_reg: AtomicU64::new(1),
                accept,
                info,
                servers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// What a transfer of `reg` waits for: for GPU memory, the work queued so far on the
    /// caller's stream (see [`crate::stream`]); nothing for host memory.
    fn fence(
        &self,
        py: Python<'_>,
        reg: &Registration,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Arc<dyn Fence>>> {
        let given = stream.filter(|s| !s.is_none());
        match reg.location {
            MemoryLocation::Cuda { device } => {
                let obj = lock(&self.shared.objs)
                    .get(&reg.id)
                    .map(|k| k.obj.clone_ref(py))
                    .ok_or_else(|| {
                        invalid("this registration is closed: register the memory again")
                    })?;
                Ok(Some(crate::stream::fence_for(obj.bind(py), given, device)?))
            }
            _ if given.is_some() => Err(invalid(
                "stream= orders transfers of GPU memory after a CUDA stream's work, and this \
                 registration is host memory: leave stream out",
            )),
            _ => Ok(None),
        }
    }

    /// What the agent says about itself (for a directory record).
    pub(crate) fn info(&self, py: Python<'_>) -> PyResult<AgentInfo> {
        self.shared.with_agent(py, |a| Ok(a.info().clone()))
    }

    fn submit(
        &self,
        py: Python<'_>,
        peer: &Peer,
        reg: &Registration,
        remote_descriptor: &[u8],
        t: Transfer,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Handle> {
        if peer.removed.load(Ordering::Acquire) {
            return Err(invalid("this peer was removed: add it again"));
        }
        if reg.closed.load(Ordering::Acquire) {
            return Err(invalid(
                "this registration is closed: register the memory again",
            ));
        }
        reg.check_storage(py, "this transfer is refused")?;
        let remote = RegionDescriptor::from_bytes(remote_descriptor)
            .map_err(|e| metadata_error("remote_descriptor", &e))?;
        let t = match self.fence(py, reg, stream)? {
            Some(f) => t.after(f),
            None => t,
        };
        let handle = self
            .shared
            .with_agent(py, |a| a.submit(&peer.peer, &reg.region, &remote, t))?;
        Ok(Handle::new(handle))
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (transport="auto", provider=None, rails=None, nics=None, memory="host", gpu=0, auth_token=None, timeout=10.0, listen="127.0.0.1", wait_spin_us=None, pin="off", tcp_congestion="auto", name=None, stall_timeout=None, auth_token_file=None, require_auth=false, liveness_timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        transport: &str,
        provider: Option<String>,
        rails: Option<i64>,
        nics: Option<&Bound<'_, PyAny>>,
        memory: &str,
        gpu: i64,
        auth_token: Option<String>,
        timeout: f64,
        listen: &str,
        wait_spin_us: Option<u64>,
        pin: &str,
        tcp_congestion: &str,
        name: Option<String>,
        stall_timeout: Option<f64>,
        auth_token_file: Option<PathBuf>,
        require_auth: bool,
        liveness_timeout: Option<f64>,
    ) -> PyResult<Engine> {
        let tokenless = auth_token.is_none() && auth_token_file.is_none();
        let (o, gpu) = EngineArgs {
            name,
            transport,
            provider,
            rails,
            nics,
            memory,
            gpu,
            auth_token,
            timeout,
            listen,
            wait_spin_us,
            pin,
            tcp_congestion,
            stall_timeout,
            liveness_timeout,
            auth_token_file,
            require_auth,
        }
        .options()?;
        let agent = py
            .detach(move || Agent::new(o))
            .map_err(|e| agent_error(&e))?;
        let exposed = if tokenless {
            exposed_rails(agent.info())
        } else {
            Vec::new()
        };
        let engine = Engine::from_agent(agent, gpu)?;
        if !exposed.is_empty() {
            let msg = format!(
                "this agent has no auth token and its tcp rails listen beyond loopback ({}): \
                 whoever reaches them can read and write the memory it registers for remote \
                 access; set auth_token_file (or auth_token), listen on 127.0.0.1, or pass \
                 require_auth=True to refuse to start so",
                exposed.join(", ")
            );
            let msg = CString::new(msg).expect("no NUL in addresses");
            let category = py.get_type::<PyUserWarning>();
            // An error here is the warnings filter turning it into an exception: raised, and
            // the agent (dropped) stops.
            PyErr::warn(py, &category, &msg, 1)?;
        }
        Ok(engine)
    }

    /// This agent's info (bytes: the library's `AgentInfo`: name, host, memory, and each
    /// transport it offers with its rails' addresses). Give it to peers, who pass it to
    /// connect.
    #[getter(info)]
    fn info_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        if self.closed() {
            return Err(agent_closed());
        }
        Ok(PyBytes::new(py, &self.shared.info))
    }

    /// Deprecated: the old name of `info` (a DeprecationWarning, then the same bytes).
    #[getter]
    fn address<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        deprecated(py, "Agent.address", "Agent.info")?;
        self.info_bytes(py)
    }

    /// The transport: its name when the agent offers exactly one ("tcp", "cuda-ipc",
    /// "efa", "mem"), else "auto" (see `transports`, and `Peer.transport` for the one a peer
    /// is reached by).
    #[getter]
    fn transport(&self, py: Python<'_>) -> PyResult<&'static str> {
        let kinds = self.shared.with_agent(py, |a| Ok(a.transports()))?;
        Ok(match kinds.as_slice() {
            [one] => one.name(),
            _ => "auto",
        })
    }

    /// The agent's name: what peers see, and the member name `Directory.join` publishes
    /// it under.
    #[getter]
    fn name(&self, py: Python<'_>) -> PyResult<String> {
        self.shared.with_agent(py, |a| Ok(a.name().to_owned()))
    }

    /// The transports the agent offers, in the order they are preferred for a peer.
    #[getter]
    fn transports(&self, py: Python<'_>) -> PyResult<Vec<&'static str>> {
        let kinds = self.shared.with_agent(py, |a| Ok(a.transports()))?;
        Ok(kinds.into_iter().map(TransportKind::name).collect())
    }

    /// The number of rails of each transport (the largest, where they differ).
    #[getter]
    fn rails(&self, py: Python<'_>) -> PyResult<usize> {
        self.shared.with_agent(py, |a| {
            Ok(a.transports()
                .into_iter()
                .filter_map(|k| a.group(k).map(|g| g.rails().len()))
                .max()
                .unwrap_or(0))
        })
    }

    /// Whether the agent is closed.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.shared.agent).is_none()
    }

    /// Registers `obj`'s memory and returns its Region.
    ///
    /// obj: a numpy array, bytearray, memoryview or any C-contiguous buffer-protocol
    /// object (host memory), a torch / cupy CUDA tensor (__cuda_array_interface__) on
    /// the agent's gpu, or a DLPack tensor (__dlpack__: CPU, or CUDA on the agent's
    /// gpu). No copy is made. remote_write: whether peers may write into it (needs a writable
    /// buffer; such a region can also be the destination of this agent's reads); a
    /// source-only region may be read-only. remote_read: whether peers may read it.
    ///
    /// Read-only memory (bytes, a read-only memoryview, a numpy array with writeable=False,
    /// a __cuda_array_interface__ or DLPack 1.x export marked read-only) with
    /// remote_write=True raises InvalidArgument; with remote_write=False (a source, and with
    /// remote_read=True readable by peers) it is taken. A producer that only speaks the
    /// unversioned DLPack (no read-only flag) is taken as writable.
    ///
    /// A torch tensor: the region holds its storage (the memory itself), checked to
    /// contain the registered bytes, so tensor.set_(other) or del tensor leaves the
    /// registered memory valid. resize_() beyond the storage's size reallocates that
    /// storage's memory and frees the old one, and torch offers no way to make a storage
    /// non-resizable: the region records where the storage was, and the next local
    /// use of it (write, read, their pages, a weights or KV push, pull or wait, offer,
    /// close) raises RegionInvalidated (an InvalidArgument) once it moved; register the
    /// tensor again. What cannot be caught: a peer's write into the region after the resize
    /// and before that next call lands in memory that was freed (the receiver learns of it
    /// only at its next call). Resizing a registered tensor is an error of the program.
    #[pyo3(signature = (obj, remote_write=true, remote_read=false))]
    pub(crate) fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        remote_write: bool,
        remote_read: bool,
    ) -> PyResult<Registration> {
        if self.closed() {
            return Err(agent_closed());
        }
        let memory::Taken {
            region,
            held,
            storage,
        } = memory::take(obj, remote_write, self.shared.accept)?;
        // A writable region may also receive this agent's READs (LOCAL_WRITE).
        let mut access = if remote_write {
            Access::REMOTE_WRITE | Access::LOCAL_WRITE
        } else {
            Access::NONE
        };
        if remote_read {
            access = access | Access::REMOTE_READ;
        }
        let location = region.location();
        let keep: Box<dyn Send> = Box::new(held);
        let region = self
            .shared
            .with_agent(py, move |a| a.register_kept(region, access, Some(keep)))?;
        let descriptor = region
            .descriptor()
            .to_bytes()
            .map_err(|e| metadata_error("the registration's descriptor", &e))?;
        let id = self.shared.next_reg.fetch_add(1, Ordering::Relaxed);
        lock(&self.shared.objs).insert(
            id,
            Kept {
                obj: obj.clone().unbind(),
                storage,
            },
        );
        Ok(Registration {
            shared: self.shared.clone(),
            id,
            region,
            descriptor,
            location,
            closed: AtomicBool::new(false),
        })
    }

    /// Connects to a peer by its info (the bytes of its Agent.info) and returns a Peer,
    /// reached over the best transport both agents offer (Peer.transport). Bytes that are
    /// not an agent's info raise InvalidArgument naming what is wrong with them.
    fn connect(&self, py: Python<'_>, info: &[u8]) -> PyResult<Peer> {
        if self.closed() {
            return Err(agent_closed());
        }
        let info = AgentInfo::from_bytes(info).map_err(|e| metadata_error("info", &e))?;
        let peer = self.shared.with_agent(py, |a| a.connect(&info))?;
        Ok(Peer {
            peer,
            removed: AtomicBool::new(false),
        })
    }

    /// Deprecated: the old name of `connect` (a DeprecationWarning, then connect(address)).
    fn add_peer(&self, py: Python<'_>, address: &[u8]) -> PyResult<Peer> {
        deprecated(py, "Agent.add_peer", "Agent.connect")?;
        self.connect(py, address)
    }

    /// Offers `registration` (a Region) to peers under `name`: a peer that meets this agent
    /// through `serve`/`rendezvous` (or the directory) finds its descriptor by that name.
    fn offer(&self, py: Python<'_>, name: &str, registration: &Registration) -> PyResult<()> {
        self.check_registration(py, registration)?;
        if name.is_empty() {
            return Err(invalid("offer: the name is empty"));
        }
        self.shared
            .agent()?
            .offer(name, registration.region())
            .map_err(|e| agent_error(&e))
    }

    /// Serves the direct rendezvous on `listen` ("IP:PORT"; port 0 picks a free one) on a
    /// thread of its own: a peer's `Agent.rendezvous(server.address)` connects to this
    /// agent and gets the regions it offered. With `auth_token`, clients must prove they
    /// know it. Returns the Server; it stops with `Server.stop()` or `close()`.
    #[pyo3(signature = (listen="127.0.0.1:0", auth_token=None))]
    fn serve(&self, py: Python<'_>, listen: &str, auth_token: Option<String>) -> PyResult<Server> {
        let agent = self.shared.agent()?;
        let at: std::net::SocketAddr = listen
            .parse()
            .map_err(|e| invalid(format!("listen: {listen:?} is not IP:PORT ({e})")))?;
        let server = py
            .detach(move || {
                let l = std::net::TcpListener::bind(at)?;
                xfer::rendezvous::Server::start(
                    l,
                    vec![agent],
                    xfer::rendezvous::ServeLimits::default(),
                    Arc::new(xfer::rendezvous::ServeStats::default()),
                    auth_token,
                    Arc::new(xfer::rendezvous::NoService),
                )
            })
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("serve on {listen}: {e}")))?;
        let address = server.local_addr().to_string();
        let cell = Arc::new(Mutex::new(Some(server)));
        lock(&self.shared.servers).push(cell.clone());
        Ok(Server { cell, address })
    }

    /// The direct rendezvous: connects to the agent serving at `address` ("HOST:PORT",
    /// from its `Agent.serve`), over the best transport both offer, within `timeout`
    /// seconds. Returns (Peer, regions): what it offered, name -> descriptor bytes for
    /// write/read.
    #[pyo3(signature = (address, auth_token=None, timeout=20.0))]
    fn rendezvous<'py>(
        &self,
        py: Python<'py>,
        address: &str,
        auth_token: Option<String>,
        timeout: f64,
    ) -> PyResult<(Peer, Bound<'py, pyo3::types::PyDict>)> {
        use std::net::ToSocketAddrs;
        if self.closed() {
            return Err(agent_closed());
        }
        let within = seconds(Some(timeout), "timeout")?.unwrap_or_default();
        let at = address
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| invalid(format!("address: {address:?} is not HOST:PORT")))?;
        let (peer, welcome) = self
            .shared
            .with_agent(py, |a| a.rendezvous(at, auth_token.as_deref(), within))?;
        let regions = pyo3::types::PyDict::new(py);
        for (name, d) in &welcome.regions {
            let bytes = d
                .to_bytes()
                .map_err(|e| metadata_error("the server's region", &e))?;
            regions.set_item(name, PyBytes::new(py, &bytes))?;
        }
        Ok((
            Peer {
                peer,
                removed: AtomicBool::new(false),
            },
            regions,
        ))
    }

    /// Removes a peer; its pending transfers fail with PeerRemoved.
    fn remove_peer(&self, py: Python<'_>, peer: &Peer) -> PyResult<()> {
        // Another agent's peer is refused before it is marked removed (in its agent).
        self.shared
            .agent()?
            .check_peer(&peer.peer)
            .map_err(|e| agent_error(&e))?;
        if peer.removed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.shared.with_agent(py, |a| a.disconnect(&peer.peer))
    }

    /// Writes ranges of a local region into a peer's region.
    ///
    /// segments: (src_offset, dst_offset, length) in bytes; remote_descriptor: the
    /// peer's Region.descriptor; imm: a 32-bit value the peer sees (wait_imm) once
    /// every byte has landed; message: bytes (at most 4096) the peer then takes as a
    /// Notification's message, with imm (or 0) as its imm; timeout: seconds, after
    /// which the transfer fails with TimedOut. Returns a Handle.
    ///
    /// GPU memory: the transfer reads the source only after the work queued so far on
    /// `stream` (a torch.cuda.Stream, cupy.cuda.Stream, or a handle as an int) has run; by
    /// default torch's current stream for a torch tensor, the stream of the object's
    /// __cuda_array_interface__ where it gives one, else the legacy default stream. So a
    /// kernel that computes the source may be launched just before the call.
    #[pyo3(signature = (peer, registration, remote_descriptor, segments, imm=None, timeout=None, stream=None, message=None))]
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
        message: Option<Vec<u8>>,
    ) -> PyResult<Handle> {
        let t = with_extras(
            Transfer::segments(triples(segments)?),
            imm_value(imm)?,
            message,
            seconds(timeout, "timeout")?,
        );
        self.submit(py, peer, registration, remote_descriptor, t, stream)
    }

    /// Writes pages: local page src_pages[i] goes to the peer's page dst_pages[i],
    /// page_size bytes each, at offsets page * stride (strides default to page_size).
    /// Pages are lists of ints or 1-D int64 numpy arrays. See write for the rest (stream
    /// order of GPU memory included).
    #[pyo3(signature = (peer, registration, remote_descriptor, src_pages, dst_pages, page_size, src_stride=None, dst_stride=None, imm=None, timeout=None, stream=None, message=None))]
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
        message: Option<Vec<u8>>,
    ) -> PyResult<Handle> {
        let t = paged(
            page_size,
            (src_pages, src_stride, "src"),
            (dst_pages, dst_stride, "dst"),
        )?;
        let t = with_extras(t, imm_value(imm)?, message, seconds(timeout, "timeout")?);
        self.submit(py, peer, registration, remote_descriptor, t, stream)
    }

    /// Reads ranges of a peer's region into a local region (one-sided: the peer
    /// does nothing but progress).
    ///
    /// segments: (local_offset, remote_offset, length) in bytes; registration: local, made
    /// with remote_write=True (a writable buffer); remote_descriptor: the peer's
    /// Region.descriptor, registered with remote_read=True; timeout: seconds;
    /// message (with imm, its value): bytes the peer takes as a Notification once every
    /// byte was read (so it knows its memory is free again). Returns a Handle, done once
    /// every byte is in the local memory (and the message, if any, was delivered).
    ///
    /// GPU memory: nothing lands in the local memory before the work queued so far on
    /// `stream` has run (see write for which stream by default).
    #[pyo3(signature = (peer, registration, remote_descriptor, segments, timeout=None, stream=None, message=None, imm=None))]
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
        message: Option<Vec<u8>>,
        imm: Option<i64>,
    ) -> PyResult<Handle> {
        let t = with_extras(
            Transfer::segments(triples(segments)?).read(),
            imm_value(imm)?,
            message,
            seconds(timeout, "timeout")?,
        );
        self.submit(py, peer, registration, remote_descriptor, t, stream)
    }

    /// Reads pages: the peer's page remote_pages[i] lands in local page local_pages[i],
    /// page_size bytes each, at offsets page * stride (strides default to page_size). See
    /// read for the rest.
    #[pyo3(signature = (peer, registration, remote_descriptor, local_pages, remote_pages, page_size, local_stride=None, remote_stride=None, timeout=None, stream=None, message=None, imm=None))]
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
        message: Option<Vec<u8>>,
        imm: Option<i64>,
    ) -> PyResult<Handle> {
        let t = paged(
            page_size,
            (local_pages, local_stride, "local"),
            (remote_pages, remote_stride, "remote"),
        )?
        .read();
        let t = with_extras(t, imm_value(imm)?, message, seconds(timeout, "timeout")?);
        self.submit(py, peer, registration, remote_descriptor, t, stream)
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
        let what = format!("{count} transfer(s) with immediate value {value}");
        self.wait_agent(py, seconds(timeout, "timeout")?, &what, |a, slice| {
            a.wait_imm(value, count, slice)
        })
    }

    /// The next notification (one arrival of a peer's immediate data, oldest sender and
    /// value first): blocks (GIL released) up to `timeout` seconds (None: no limit; Ctrl-C
    /// still interrupts), then raises TimedOut. Arrivals are counted where they land and
    /// never dropped; wait_imm, next_notification, notifications and
    /// next_notification_async take from the same counts, each arrival once.
    #[pyo3(signature = (timeout=None))]
    fn next_notification(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Notification> {
        let n = self.wait_agent(
            py,
            seconds(timeout, "timeout")?,
            "a notification",
            |a, slice| a.next_notification(slice),
        )?;
        Ok(Notification::from(n))
    }

    /// next_notification for asyncio: an awaitable (the wait runs on the event loop's
    /// default executor, the GIL released) that gives the next Notification or raises
    /// TimedOut. Must be called from a running event loop.
    #[pyo3(signature = (timeout=None))]
    fn next_notification_async<'py>(
        slf: &Bound<'py, Self>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        seconds(timeout, "timeout")?;
        let lp = py.import("asyncio")?.call_method0("get_running_loop")?;
        let wait = slf.getattr("next_notification")?;
        lp.call_method1("run_in_executor", (py.None(), wait, timeout))
    }

    /// Every notification not yet taken, without waiting: a list of Notification, each
    /// sender and value once with its count, oldest first.
    fn notifications(&self, py: Python<'_>) -> PyResult<Vec<Notification>> {
        let all = self.shared.with_agent(py, |a| Ok(a.notifications()))?;
        Ok(all.into_iter().map(Notification::from).collect())
    }

    /// Tells this agent of a peer (its `info` bytes) without connecting to it, so that
    /// its notifications name it (Notification.sender). connect does this too.
    fn know(&self, address: &[u8]) -> PyResult<()> {
        let info = AgentInfo::from_bytes(address).map_err(|e| metadata_error("address", &e))?;
        self.shared.agent()?.know(&info);
        Ok(())
    }

    /// The agent's figures in the Prometheus text exposition format (version 0.0.4), for
    /// an exporter of the application's own (prometheus_client's, a web framework's): per
    /// rail bytes, operations, errors, notifications, per peer connections, per transport
    /// the transfers' latency histogram. The same names as `xfer serve --metrics`.
    fn metrics(&self, py: Python<'_>) -> PyResult<String> {
        self.shared.with_agent(py, |a| Ok(a.metrics()))
    }

    /// Sums of the rails' counters (of every transport): bytes, ops, reposts, errors,
    /// transfers.
    fn counters(&self, py: Python<'_>) -> PyResult<HashMap<&'static str, u64>> {
        let c = self.shared.with_agent(py, |a| Ok(a.counters()))?;
        Ok(HashMap::from([
            ("bytes", c.bytes),
            ("ops", c.ops),
            ("reposts", c.reposts),
            ("errors", c.errors),
            ("transfers", c.transfers),
        ]))
    }

    /// Stops the agent: pending transfers fail, and every region's memory is
    /// given back. Closing twice is fine.
    ///
    /// Memory a transport still holds is not given back: a rail whose worker does not stop
    /// within its shutdown timeout (stuck in its transport) keeps its transport, and the
    /// transport may still write the memory. Such memory stays held, with a
    /// ResourceWarning, until the transport lets go (or for the rest of the process).
    fn close(&self, py: Python<'_>) {
        let Some(agent) = lock(&self.shared.agent).take() else {
            return;
        };
        // Servers first: each holds a handle on the agent.
        let servers = std::mem::take(&mut *lock(&self.shared.servers));
        py.detach(move || {
            for s in servers {
                // Its error, if it had one, was the caller's to see through Server.stop().
                if let Some(s) = lock(&s).take() {
                    let _ = s.stop();
                }
            }
        });
        // The registered objects go first (with the GIL, outside the lock); what keeps
        // their memory alive is the agent's, given back as its transports let go.
        let objs = std::mem::take(&mut *lock(&self.shared.objs));
        drop(objs);
        // Stops every rail (each waits for its worker); the GIL is not needed meanwhile.
        // `None`: another thread runs a call on the agent, and the agent stops when it
        // returns.
        let held = py.detach(move || agent.close()).unwrap_or(0);
        if held > 0 {
            let _ = PyErr::warn(
                py,
                &py.get_type::<pyo3::exceptions::PyResourceWarning>(),
                &std::ffi::CString::new(format!(
                    "xfer.Agent.close: {held} registered buffer(s) are still held by a \
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

    fn __repr__(&self, py: Python<'_>) -> String {
        let what = self.shared.with_agent(py, |a| {
            let kinds: Vec<&str> = a
                .transports()
                .into_iter()
                .map(TransportKind::name)
                .collect();
            let rails = a
                .transports()
                .into_iter()
                .filter_map(|k| a.group(k).map(|g| g.rails().len()))
                .max()
                .unwrap_or(0);
            Ok((a.name().to_owned(), kinds, rails))
        });
        match what {
            Ok((name, kinds, rails)) => {
                let transport = match kinds.as_slice() {
                    [one] => format!("{one:?}"),
                    _ => format!("\"auto\" ({})", kinds.join(", ")),
                };
                format!("xfer.Agent({name:?}, transport={transport}, rails={rails})")
            }
            Err(_) => "xfer.Agent(closed)".into(),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        Python::attach(|py| self.close(py));
    }
}

impl Engine {
    /// Runs `step` on the agent in slices of a wait of at most `limit` (None: no limit),
    /// the GIL released and signals checked between slices: its result, `AgentClosed` if
    /// the agent closes meanwhile (a handle on the agent per slice, so a close from
    /// another thread stops it within a slice), `TimedOut` naming `what` after `limit`.
    fn wait_agent<R: Send>(
        &self,
        py: Python<'_>,
        limit: Option<Duration>,
        what: &str,
        step: impl Fn(&Agent, Duration) -> xfer::Result<R> + Send + Sync,
    ) -> PyResult<R> {
        self.shared.agent()?;
        let shared = &self.shared;
        let done = wait_sliced(py, limit, |slice| {
            let Some(agent) = lock(&shared.agent).clone() else {
                return Some(Err(xfer::Error::Closed));
            };
            match step(&agent, slice) {
                Ok(r) => Some(Ok(r)),
                Err(xfer::Error::Engine(fabric_core::Error::TimedOut(..))) => None,
                Err(e) => Some(Err(e)),
            }
        })?;
        match done {
            Some(Ok(r)) => Ok(r),
            Some(Err(xfer::Error::Closed)) => Err(AgentClosed::new_err(format!(
                "the agent was closed while waiting for {what}"
            ))),
            Some(Err(e)) => Err(agent_error(&e)),
            None => Err(crate::errors::TimedOut::new_err(format!(
                "timed out after {:?} waiting for {what}",
                limit.unwrap_or_default()
            ))),
        }
    }

    /// A handle on the agent (for `xfer.weights`), or `AgentClosed`.
    pub(crate) fn agent_handle(&self) -> PyResult<Agent> {
        self.shared.agent()
    }

    /// Whether `reg` is a region of this agent and open (else `InvalidArgument`),
    /// its torch storage where it was registered (else `RegionInvalidated`).
    pub(crate) fn check_registration(&self, py: Python<'_>, reg: &Registration) -> PyResult<()> {
        self.shared
            .agent()?
            .check_region(&reg.region)
            .map_err(|e| agent_error(&e))?;
        if reg.closed.load(Ordering::Acquire) {
            return Err(invalid(
                "this registration is closed: register the memory again",
            ));
        }
        reg.check_storage(py, "this registration cannot be used")
    }

    /// Whether `peer` is a peer of this agent and not removed (else `InvalidArgument`).
    pub(crate) fn check_peer(&self, peer: &Peer) -> PyResult<()> {
        self.shared
            .agent()?
            .check_peer(&peer.peer)
            .map_err(|e| agent_error(&e))?;
        if peer.removed.load(Ordering::Acquire) {
            return Err(invalid("this peer was removed: add it again"));
        }
        Ok(())
    }
}

impl Peer {
    /// The library's peer.
    pub(crate) fn inner(&self) -> &xfer::Peer {
        &self.peer
    }
}

impl Registration {
    /// The library's descriptor of this region (for a directory record).
    pub(crate) fn region_descriptor(&self) -> &RegionDescriptor {
        self.region.descriptor()
    }

    /// The library's region.
    pub(crate) fn region(&self) -> &xfer::Region {
        &self.region
    }

    /// The CUDA device of this memory, if it is GPU memory.
    pub(crate) fn cuda_device(&self) -> Option<u32> {
        match self.location {
            MemoryLocation::Cuda { device } => Some(device),
            _ => None,
        }
    }

    /// The registered object, while the registration is open.
    pub(crate) fn object(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        lock(&self.shared.objs)
            .get(&self.id)
            .map(|k| k.obj.clone_ref(py))
    }

    /// `RegionInvalidated` (its message beginning with `what`) if the registered object is
    /// a torch tensor whose storage was resized or replaced since it was registered; `Ok`
    /// for other memory, and once the registration is closed.
    pub(crate) fn check_storage(&self, py: Python<'_>, what: &str) -> PyResult<()> {
        // Out of the lock first: the check calls Python, which may let other threads run.
        let guard = lock(&self.shared.objs)
            .get(&self.id)
            .and_then(|k| k.storage.as_ref().map(|g| g.clone_ref(py)));
        match guard {
            Some(g) => g.check(py, what),
            None => Ok(()),
        }
    }

    /// [`check_storage`](Self::check_storage) of each of `regs`.
    pub(crate) fn check_storages(
        py: Python<'_>,
        regs: &[Py<Registration>],
        what: &str,
    ) -> PyResult<()> {
        regs.iter()
            .try_for_each(|r| r.get().check_storage(py, what))
    }

    /// Deregisters; on success lets go of the object (the agent gives the memory back now,
    /// or once no transport holds it). A torch tensor's storage resized meanwhile closes
    /// all the same, then raises `RegionInvalidated`: transfers may have used memory that
    /// had been freed.
    fn close_inner(&self, py: Python<'_>) -> PyResult<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // A closed agent gave the memory back already.
        if lock(&self.shared.agent).is_none() {
            return Ok(());
        }
        let moved = self
            .check_storage(py, "the registration is closed, but")
            .err();
        let done = self.shared.with_agent(py, |a| a.deregister(&self.region));
        match done {
            Ok(()) => {}
            Err(e) if e.is_instance_of::<AgentClosed>(py) => return Ok(()),
            Err(e) => {
                self.closed.store(false, Ordering::Release);
                return Err(e);
            }
        }
        let obj = lock(&self.shared.objs).remove(&self.id);
        drop(obj);
        moved.map_or(Ok(()), Err)
    }
}

#[pymethods]
impl Registration {
    /// What a peer needs to reach this memory (bytes: the library's region descriptor,
    /// with its keys on every transport of the agent): send it to the peer.
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.descriptor)
    }

    /// The registered object, or None once the region is closed (it no longer
    /// holds the object then).
    #[getter]
    fn obj(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        lock(&self.shared.objs)
            .get(&self.id)
            .map(|k| k.obj.clone_ref(py))
    }

    /// Length of the registered memory in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.region.len()
    }

    /// Whether this is CUDA device memory.
    #[getter]
    fn is_cuda(&self) -> bool {
        matches!(self.location, MemoryLocation::Cuda { .. })
    }

    /// Whether the region is closed.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Deregisters the memory and lets go of the object. Raises RegionInUse while
    /// transfers that use it have not finished (wait for their handles first). A torch
    /// tensor whose storage was resized since it was registered is closed all the same,
    /// then RegionInvalidated is raised: transfers may have used memory that was freed.
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
            "xfer.Region({} bytes of {} memory{})",
            self.nbytes(),
            if self.is_cuda() { "cuda" } else { "host" },
            if self.closed() { ", closed" } else { "" }
        )
    }
}

impl Drop for Registration {
    /// A region dropped while open is closed; if that fails (transfers still use
    /// it) its memory stays held until the agent closes.
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

    /// The transport this peer is reached by ("tcp", "cuda-ipc", "efa", "mem"): the best
    /// that both agents offer.
    #[getter]
    fn transport(&self) -> &'static str {
        self.peer.transport().name()
    }

    /// The peer's name (its agent's, as its info says).
    #[getter]
    fn name(&self) -> &str {
        &self.peer.info().name
    }

    fn __repr__(&self) -> String {
        format!(
            "xfer.Peer({:?}, transport={:?}{})",
            self.peer.info().name,
            self.peer.transport().name(),
            if self.removed() { ", removed" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::engine::{EngineConfig, RailGroup};
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
        let agent = Agent::from_groups(
            "stuck",
            MemoryLocation::Host,
            vec![(TransportKind::Mem, group)],
        )
        .expect("an agent");
        Engine::from_agent(agent, 0).expect("an engine")
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
            assert_eq!(xfer::release_kept(), 1, "kept while the transport holds it");
            // The transport lets go: the worker returns from poll, sees the shutdown and
            // drops its transport with the region.
            gate.open();
            py.detach(|| {
                eventually(
                    "the stuck transport to let go",
                    Duration::from_secs(10),
                    || Python::attach(|_| xfer::release_kept() == 0),
                )
            });
            assert!(resizable(py, &buf), "given back once no transport holds it");
        });
    }
}
