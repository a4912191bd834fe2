//! Python arguments as Rust values (sizes, seconds, segments, pages, immediate values), each
//! refused with an `InvalidArgument` that names the argument, and the GIL-free wait that
//! lets Python deliver signals.

use crate::errors::invalid;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use std::time::{Duration, Instant};

/// How often a long wait lets Python look at its signals.
pub const SIGNAL_EVERY: Duration = Duration::from_millis(50);

/// A size argument that must be positive (`what` names it in the error).
pub fn positive(v: i64, what: &str) -> PyResult<u64> {
    u64::try_from(v)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| invalid(format!("{what}={v}: expected a positive size")))
}

/// Seconds from Python (`None` stays `None`): finite and >= 0, else `InvalidArgument`.
pub fn seconds(t: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
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
pub fn wait_sliced<R>(
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

/// Segments as `(src_off, dst_off, len)` from Python (tuples, or an `(n, 3)` int64 numpy
/// array read through the buffer protocol), checked for negatives.
pub fn triples(segments: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64, u64)>> {
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
pub fn pages(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
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

/// An immediate value: 32 bits, and not the one the engine keeps for its warm-up writes.
pub fn imm_value(imm: Option<i64>) -> PyResult<Option<u32>> {
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
