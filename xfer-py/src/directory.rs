//! `xfer.Directory`: the cluster directory ([`directory`]) from Python. An agent publishes
//! itself and named regions; peers look it up, list or watch the cluster, and get
//! members as dicts whose `address` and `regions` are the same bytes `Agent.connect` and
//! the write calls take: a record carries the library's metadata (the agent's
//! `AgentInfo`, under the member's name, and each region's `RegionDescriptor`), as bytes.

use crate::engine::{Engine, Registration};
use crate::errors::{agent_error, directory_error, invalid, metadata_error};
use directory::{Event, Member, Record};
use fabric_core::MemoryLocation;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// A cluster directory: `Directory("etcd://HOST:2379", cluster="default")` or
/// `Directory("file:///path/members.json")`.
#[pyclass(module = "xfer", frozen)]
pub struct Directory {
    dir: Box<dyn directory::Directory>,
    cluster: String,
}

/// A published record; `withdraw()` (or closing the directory's process) removes it.
#[pyclass(module = "xfer", frozen)]
pub struct Publication {
    inner: Mutex<Option<Published>>,
}

/// What a [`Publication`] holds: a record put together by `publish`, or an agent's own
/// (`join`), which `update` renews with what the agent offers then.
enum Published {
    Record(directory::Publication),
    Engine(xfer::discovery::Publication),
}

/// A cluster followed by an agent (`Directory.follow`): every other member is connected
/// as it joins and disconnected as it leaves, on a thread of the library's; weight-sync
/// members refresh against it (`Source.refresh`, `Destination.refresh`). `close()` (or
/// dropping it) stops following; the peers stay connected.
#[pyclass(module = "xfer", frozen)]
pub struct Following {
    inner: Mutex<Option<xfer::discovery::Following>>,
}

impl Following {
    /// The following, `None` once closed (for callers already without the GIL).
    pub(crate) fn inner(&self) -> std::sync::MutexGuard<'_, Option<xfer::discovery::Following>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the following with the GIL released, or fails if it was closed.
    pub(crate) fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&xfer::discovery::Following) -> R + Send,
    ) -> PyResult<R> {
        let inner = &self.inner;
        py.detach(|| {
            let g = inner.lock().unwrap_or_else(|p| p.into_inner());
            g.as_ref().map(f)
        })
        .ok_or_else(|| invalid("this Following was closed"))
    }
}

/// A cluster's joins, updates and leaves, in order, from `Directory.watch()`.
#[pyclass(module = "xfer", frozen)]
pub struct Watch {
    inner: Mutex<directory::Watch>,
}

/// A record's time to live: a positive, finite number of seconds.
fn ttl_of(ttl: f64) -> PyResult<Duration> {
    if !(ttl.is_finite() && ttl > 0.0) {
        return Err(invalid(format!(
            "ttl must be a positive number of seconds, not {ttl}"
        )));
    }
    Duration::try_from_secs_f64(ttl).map_err(|_| invalid(format!("ttl={ttl} is too large")))
}

/// A member as a dict: name, address (its info: bytes for Agent.connect), regions (name ->
/// descriptor bytes), transport, host, memory, gpu, nics, control, instance, age_s.
fn member_dict<'py>(py: Python<'py>, m: &Member) -> PyResult<Bound<'py, PyDict>> {
    let r = &m.record;
    let agent = &r.agent;
    let d = PyDict::new(py);
    d.set_item("name", &agent.name)?;
    let address = agent
        .to_bytes()
        .map_err(|e| metadata_error("the member's record", &e))?;
    d.set_item("address", PyBytes::new(py, &address))?;
    let regions = PyDict::new(py);
    for (name, desc) in &r.regions {
        let bytes = desc
            .to_bytes()
            .map_err(|e| metadata_error("the member's region", &e))?;
        regions.set_item(name, PyBytes::new(py, &bytes))?;
    }
    d.set_item("regions", regions)?;
    // As `Agent.transport`: the name where it offers one transport, else "auto".
    let transport = match agent.transports.as_slice() {
        [one] => one.kind.name(),
        _ => "auto",
    };
    d.set_item("transport", transport)?;
    d.set_item("host", &agent.hostname)?;
    let (memory, gpu) = match agent.memory {
        MemoryLocation::Cuda { device } => ("cuda", Some(device)),
        _ => ("host", None),
    };
    d.set_item("memory", memory)?;
    d.set_item("gpu", gpu)?;
    let nics: Vec<&String> = agent.transports.iter().flat_map(|t| &t.nics).collect();
    d.set_item("nics", nics)?;
    d.set_item("control", agent.control.clone())?;
    d.set_item("instance", agent.instance)?;
    d.set_item("age_s", r.age().as_secs_f64())?;
    Ok(d)
}

#[pymethods]
impl Directory {
    /// Opens the directory at `url` (etcd://HOST:PORT[,HOST:PORT...] or file://PATH) for
    /// `cluster`. An unreachable etcd raises DirectoryError naming it, within seconds.
    #[new]
    #[pyo3(signature = (url, cluster="default"))]
    fn new(py: Python<'_>, url: &str, cluster: &str) -> PyResult<Directory> {
        directory::record::check_name("cluster", cluster)
            .map_err(|e| directory_error(&e.into()))?;
        let url = url.to_string();
        let dir = py
            .detach(|| directory::open(&url))
            .map_err(|e| directory_error(&e))?;
        Ok(Directory {
            dir,
            cluster: cluster.to_string(),
        })
    }

    /// The directory's URL and the cluster.
    fn __repr__(&self) -> String {
        format!(
            "Directory({:?}, cluster={:?})",
            self.dir.endpoint(),
            self.cluster
        )
    }

    /// Publishes `agent` as member `name`, with `regions` (name -> Region) that
    /// peers may use, for `ttl` seconds past this process's last renewal.
    #[pyo3(signature = (name, agent, regions=None, ttl=10.0))]
    fn publish(
        &self,
        py: Python<'_>,
        name: &str,
        agent: &Engine,
        regions: Option<HashMap<String, PyRef<'_, Registration>>>,
        ttl: f64,
    ) -> PyResult<Publication> {
        let ttl = ttl_of(ttl)?;
        let mut info = agent.info(py)?;
        info.name = name.to_owned();
        let mut r = Record::new(&self.cluster, info);
        for (n, reg) in regions.unwrap_or_default() {
            r.regions.insert(n, reg.region_descriptor().clone());
        }
        r.ttl_ms = ttl.as_millis().try_into().unwrap_or(u64::MAX);
        let p = py
            .detach(|| self.dir.publish(r, ttl))
            .map_err(|e| directory_error(&e))?;
        Ok(Publication {
            inner: Mutex::new(Some(Published::Record(p))),
        })
    }

    /// Publishes `agent` under its own name (`Agent.name`) with every region it
    /// offers now (`Agent.offer`, and the weight sync's `Source.offer` and
    /// `Destination.offer`), for `ttl` seconds past this process's last renewal: how a
    /// weight-sync member makes itself known to the others. Offer more later, then call
    /// `Publication.update()`.
    #[pyo3(signature = (agent, ttl=10.0))]
    fn join(&self, py: Python<'_>, agent: &Engine, ttl: f64) -> PyResult<Publication> {
        let ttl = ttl_of(ttl)?;
        let agent = agent.agent_handle()?;
        let p = py
            .detach(|| agent.publish(&*self.dir, &self.cluster, ttl))
            .map_err(|e| agent_error(&e))?;
        Ok(Publication {
            inner: Mutex::new(Some(Published::Engine(p))),
        })
    }

    /// Follows the cluster with `agent`: every member but the agent itself (by
    /// name) is connected as it joins (the members there now first) and disconnected as it
    /// leaves.
    fn follow(&self, py: Python<'_>, agent: &Engine) -> PyResult<Following> {
        let agent = agent.agent_handle()?;
        let f = py
            .detach(|| agent.follow(&*self.dir, &self.cluster))
            .map_err(|e| agent_error(&e))?;
        Ok(Following {
            inner: Mutex::new(Some(f)),
        })
    }

    /// The member `name` as a dict, or None.
    fn lookup<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Option<Bound<'py, PyDict>>> {
        let found = py
            .detach(|| self.dir.lookup(&self.cluster, name))
            .map_err(|e| directory_error(&e))?;
        found.map(|m| member_dict(py, &m)).transpose()
    }

    /// Every member now, as dicts (records that are not valid are skipped, and logged).
    fn members<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let l = py
            .detach(|| self.dir.members(&self.cluster))
            .map_err(|e| directory_error(&e))?;
        l.members.iter().map(|m| member_dict(py, m)).collect()
    }

    /// Watches the cluster: every member now as "joined", then each change.
    fn watch(&self, py: Python<'_>) -> PyResult<Watch> {
        let w = py
            .detach(|| self.dir.watch(&self.cluster))
            .map_err(|e| directory_error(&e))?;
        Ok(Watch {
            inner: Mutex::new(w),
        })
    }
}

#[pymethods]
impl Publication {
    /// Removes the record now; watchers see "left".
    fn withdraw(&self, py: Python<'_>) -> PyResult<()> {
        let p = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        match p {
            Some(Published::Record(p)) => {
                py.detach(|| p.withdraw()).map_err(|e| directory_error(&e))
            }
            Some(Published::Engine(p)) => py.detach(|| p.withdraw()).map_err(|e| agent_error(&e)),
            None => Ok(()),
        }
    }

    /// Publishes the agent again with what it offers now (a `Directory.join`
    /// publication; one made by `publish` holds a fixed record: publish again instead).
    fn update(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| {
            let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
            match g.as_mut() {
                Some(Published::Engine(p)) => p.update().map_err(|e| agent_error(&e)),
                Some(Published::Record(_)) => Err(invalid(
                    "update() renews what Directory.join published; this record came from \
                     publish(): publish it again",
                )),
                None => Err(invalid("this publication was withdrawn")),
            }
        })
    }
}

#[pymethods]
impl Following {
    /// The names of the members connected now.
    fn peers(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.with(py, |f| {
            f.peers().iter().map(|c| c.name().to_owned()).collect()
        })
    }

    /// Stops following (the peers it connected stay connected).
    fn close(&self, py: Python<'_>) {
        let inner = &self.inner;
        let f = inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(|| drop(f));
    }

    fn __repr__(&self) -> String {
        match &*self.inner.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(f) => format!("Following(cluster={:?})", f.cluster()),
            None => "Following(closed)".into(),
        }
    }
}

#[pymethods]
impl Watch {
    /// The next change, waiting at most `timeout` seconds (GIL released): a tuple
    /// (kind, member) with kind "joined", "updated" or "left", or None if nothing came.
    #[pyo3(signature = (timeout=1.0))]
    fn next<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<Option<(&'static str, Bound<'py, PyDict>)>> {
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(invalid(format!(
                "timeout must be seconds >= 0, not {timeout}"
            )));
        }
        let until = std::time::Instant::now() + Duration::from_secs_f64(timeout);
        loop {
            let left = until.saturating_duration_since(std::time::Instant::now());
            let ev = py
                .detach(|| {
                    self.inner
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .next(left.min(Duration::from_millis(100)))
                })
                .map_err(|e| directory_error(&e))?;
            let (kind, m) = match ev {
                Some(Event::Joined(m)) => ("joined", m),
                Some(Event::Updated { new, .. }) => ("updated", *new),
                Some(Event::Left(m)) => ("left", m),
                // Skipped records were logged; the watch goes on.
                Some(_) => continue,
                None => {
                    // Ctrl-C between waits.
                    py.check_signals()?;
                    if left.is_zero() {
                        return Ok(None);
                    }
                    continue;
                }
            };
            return Ok(Some((kind, member_dict(py, &m)?)));
        }
    }
}
