//! `xfer.Handle`: a submitted transfer, waited on with the GIL released, or awaited.

use crate::args::{SIGNAL_EVERY, seconds, wait_sliced};
use crate::errors::op_error;
use pyo3::prelude::*;
use std::sync::Arc;
use xfer::Handle as AgentHandle;

/// A submitted transfer: wait(), done(), or `await` it. Dropping it does not cancel
/// the transfer. Until the handle reports a result, the source ranges belong to the
/// agent: do not change them.
#[pyclass(module = "xfer", frozen)]
pub struct Handle {
    handle: Arc<AgentHandle>,
}

impl Handle {
    /// The Python handle of `handle`.
    pub fn new(handle: AgentHandle) -> Handle {
        Handle {
            handle: Arc::new(handle),
        }
    }
}

#[pymethods]
impl Handle {
    /// Blocks (GIL released) until the transfer finishes, at most `timeout` seconds
    /// (None: until it finishes; Ctrl-C still interrupts). Returns the bytes moved, or
    /// raises the transfer's error (PeerUnreachable, RemoteKeyInvalid, ...). TimedOut
    /// from an expired wait ends only the wait: the transfer goes on. So does PeerStalled
    /// (a TimedOut), raised once the transfer made no progress for the agent's
    /// stall_timeout while its peer's connection stands: wait again or cancel.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let limit = seconds(timeout, "timeout")?;
        let h = self.handle.as_inner();
        let began = std::time::Instant::now();
        // Finished (its result), stalled (PeerStalled), or neither yet.
        let step = |slice| match h.finished_within(slice).then(|| h.try_result()).flatten() {
            Some(r) => Some(r.map_err(|e| op_error(&e))),
            None => self
                .handle
                .stalled(began.elapsed())
                .map(|e| Err(crate::errors::agent_error(&e))),
        };
        // Fast path: one wait with the GIL released covers the usual short transfer.
        let first = limit.unwrap_or(SIGNAL_EVERY).min(SIGNAL_EVERY);
        let r = match py.detach(|| step(first)) {
            Some(r) => Some(r),
            None => {
                let left = limit.map(|l| l.saturating_sub(first));
                if left.is_some_and(|l| l.is_zero()) {
                    None
                } else {
                    wait_sliced(py, left, step)?
                }
            }
        };
        match r {
            Some(r) => r.map(|stats| stats.bytes),
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
        self.handle.as_inner().failed().map(|e| op_error(&e))
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
        let state = match self.handle.as_inner().try_result() {
            None => "pending".to_string(),
            Some(Ok(s)) => format!("done, {} bytes", s.bytes),
            Some(Err(e)) => format!("failed: {e}"),
        };
        format!("xfer.Handle({state})")
    }
}
