//! Stream order for GPU memory: a transfer of a CUDA registration waits for the work the
//! caller has queued on its stream before any transport reads (or, for a READ, writes)
//! its memory.
//!
//! Which stream: the `stream=` argument of the transfer call (an int handle, a
//! `torch.cuda.Stream`, a `cupy.cuda.Stream`, or anything with `cuda_stream` or `ptr`);
//! else, for a torch tensor, torch's current stream on its device; else the `stream` of the
//! registered object's `__cuda_array_interface__`, where it gives one (cupy does); else the
//! legacy default stream, which follows the work of every blocking stream of the context.
//! The fence is an event recorded on that stream in the calling thread, at the call; the
//! engine's workers query it and start the transfer once it has passed.

use crate::errors::invalid;
use fabric_core::Fence;
use gpu_mem::{Device, StreamRef};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::{Arc, Mutex};

/// The devices opened so far (opening one retains its primary context: once per process).
static DEVICES: Mutex<Vec<Device>> = Mutex::new(Vec::new());

/// The device `ordinal`, opened once.
fn device(ordinal: u32) -> PyResult<Device> {
    let mut open = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = open.iter().find(|d| d.ordinal() == ordinal) {
        return Ok(d.clone());
    }
    let cuda = gpu_mem::Cuda::probe()
        .map_err(|e| crate::errors::Unsupported::new_err(format!("CUDA: {e}")))?
        .ok_or_else(|| {
            crate::errors::Unsupported::new_err("GPU memory, but no CUDA driver in this process")
        })?;
    let d = cuda
        .device(ordinal)
        .map_err(|e| invalid(format!("CUDA device {ordinal}: {e}")))?;
    open.push(d.clone());
    Ok(d)
}

/// A stream's handle from the `stream=` argument.
fn handle_of(stream: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(raw) = stream.extract::<u64>() {
        return Ok(raw);
    }
    for attr in ["cuda_stream", "ptr"] {
        if stream.hasattr(attr)? {
            return stream.getattr(attr)?.extract::<u64>().map_err(|_| {
                invalid(format!(
                    "stream.{attr} is not a stream handle (an int >= 0)"
                ))
            });
        }
    }
    Err(invalid(format!(
        "stream={}: expected a CUDA stream (torch.cuda.Stream, cupy.cuda.Stream) or its \
         handle as an int",
        stream.repr()?
    )))
}

/// The stream whose work a transfer of `obj` (a registered CUDA object) must follow when
/// the call names none.
fn current_stream_of(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let py = obj.py();
    let modules = py.import("sys")?.getattr("modules")?;
    if let Some(torch) = modules.get_item("torch").ok().filter(|m| !m.is_none()) {
        let tensor = torch.getattr("Tensor")?;
        if obj.is_instance(&tensor)? {
            let stream = torch
                .getattr("cuda")?
                .call_method1("current_stream", (obj.getattr("device")?,))?;
            return stream.getattr("cuda_stream")?.extract();
        }
    }
    if obj.hasattr("__cuda_array_interface__")? {
        let iface = obj.getattr("__cuda_array_interface__")?;
        if let Ok(d) = iface.cast::<PyDict>()
            && let Some(s) = d.get_item("stream")?
            && !s.is_none()
        {
            // The interface's 1 is the legacy default stream, 2 the per-thread one; 0 is
            // not allowed there and would mean the NULL (legacy) stream anyway.
            return s.extract();
        }
    }
    Ok(StreamRef::LEGACY.as_raw())
}

/// The fence a transfer of the CUDA registration `obj` on device `ordinal` carries: after
/// the work queued so far on `stream`, or on the object's current stream.
pub fn fence_for(
    obj: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
    ordinal: u32,
) -> PyResult<Arc<dyn Fence>> {
    let raw = match stream {
        Some(s) if !s.is_none() => handle_of(s)?,
        _ => current_stream_of(obj)?,
    };
    let gpu = device(ordinal)?;
    // SAFETY: the handle comes from the caller's framework (its current stream, or the
    // stream the caller passed): a live stream of the primary context of the registered
    // tensor's device, which is `gpu`'s (torch and cupy use primary contexts), or one of the
    // special handles 0, 1 and 2. A handle that is none of these is the caller's error, as
    // it is for torch.cuda.ExternalStream.
    let stream = unsafe { StreamRef::from_raw(raw) };
    let fence = gpu.fence_on(stream).map_err(|e| {
        crate::errors::TransportFailed::new_err(format!(
            "cannot order the transfer after stream {raw:#x} of CUDA device {ordinal}: {e}"
        ))
    })?;
    Ok(Arc::new(fence))
}
