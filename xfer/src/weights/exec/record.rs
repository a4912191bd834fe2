//! What a rank publishes about itself to its peers ([`RankRecord`]: its side, rank and
//! layout) and, for a source, which version its memory holds ([`SourceState`]), in one small
//! region that peers READ (offered under [`RECORD_REGION`]).
//!
//! The directory's records carry an agent and its regions, and nothing else: a layout (tens
//! of kilobytes to megabytes for a large model) travels in a region of its own instead, read
//! by whoever needs it with the transports already connected. The region:
//!
//! | bytes | what |
//! |---|---|
//! | 0..4 | generation, u32 LE: even while the memory holds one version at rest, odd while it changes |
//! | 4..8 | that version, u32 LE |
//! | 8..16 | length of the JSON that follows, u64 LE |
//! | 16.. | the [`RankRecord`] as JSON |
//!
//! A pull reads the first 8 bytes before and after reading the weights, like a sequence
//! lock: the same even generation both times means that nothing changed in between.
//!
//! The region is memory of the agent's kind (host memory, or its GPU's for a CUDA agent,
//! whose cuda-ipc transport moves GPU memory only); so is the scratch memory a reader
//! reads into.

use super::SyncError;
use crate::agent::{Agent, Peer, Region};
use crate::weights::{Layout, Side};
use fabric_core::metadata::RegionDescriptor;
use fabric_core::{Access, HostBuffer, MemoryLocation, MemoryRegion};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The name a rank's record region is offered under.
pub const RECORD_REGION: &str = "xfer.weights.record";

/// The largest record a reader accepts (a layout of a trillion-parameter model's rank is a
/// few megabytes).
pub const MAX_RECORD_BYTES: u64 = 256 << 20;

/// Bytes before the JSON.
const HEAD: u64 = 16;

/// What a rank of a weight sync says about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRecord {
    /// Source (trainer) or destination (inference rank).
    pub side: Side,
    /// Its rank in the plan: a source's always; a destination's if it was planned with the
    /// others, `None` for one that joins later (planned in when sources see it).
    pub rank: Option<u32>,
    /// The number of sources of the sync.
    pub sources: u32,
    /// What it holds, and where: its regions are offered under their names
    /// ([`RegionSpec::name`](crate::weights::RegionSpec::name)).
    pub layout: Layout,
}

/// The version a source's memory holds, as its record region says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourceState {
    /// Even while one version is at rest, odd while the memory changes (or before the
    /// first push); it changes at every transition.
    pub generation: u32,
    /// The version last pushed.
    pub version: u32,
}

impl SourceState {
    /// The version held, if the memory is at rest.
    pub fn at_rest(&self) -> Option<u32> {
        self.generation.is_multiple_of(2).then_some(self.version)
    }

    fn to_bytes(self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&self.generation.to_le_bytes());
        b[4..].copy_from_slice(&self.version.to_le_bytes());
        b
    }

    fn from_bytes(b: [u8; 8]) -> SourceState {
        let [g0, g1, g2, g3, v0, v1, v2, v3] = b;
        SourceState {
            generation: u32::from_le_bytes([g0, g1, g2, g3]),
            version: u32::from_le_bytes([v0, v1, v2, v3]),
        }
    }
}

/// Memory of the agent's kind: host memory, or a buffer on its GPU.
pub(crate) fn scratch(agent: &Agent, len: usize) -> Result<Arc<dyn MemoryRegion>, SyncError> {
    let len = len.max(1);
    match agent.info().memory {
        MemoryLocation::Cuda { device } => {
            let cuda = gpu_mem::Cuda::probe()
                .map_err(|e| SyncError::agent(crate::Error::Cuda(e)))?
                .ok_or_else(|| {
                    SyncError::agent(crate::Error::Cuda(gpu_mem::GpuMemError::NoDriver))
                })?;
            let buf = cuda
                .device(device)
                .and_then(|d| d.alloc_zeroed(len))
                .map_err(|e| SyncError::agent(crate::Error::Cuda(e)))?;
            Ok(Arc::new(buf))
        }
        MemoryLocation::Host => Ok(HostBuffer::new_shared(len).map_err(SyncError::memory)?),
    }
}

/// A rank's own record region, registered with its agent (peers READ it).
pub(crate) struct OwnRecord {
    mem: Arc<dyn MemoryRegion>,
    region: Region,
    state: Mutex<SourceState>,
}

impl OwnRecord {
    /// Registers `record` (state: no version yet) with `agent`.
    pub fn new(agent: &Agent, record: &RankRecord) -> Result<OwnRecord, SyncError> {
        let json = serde_json::to_vec(record).map_err(|e| SyncError::Record {
            peer: agent.name().to_owned(),
            reason: format!("cannot serialise the record: {e}"),
        })?;
        let len = HEAD as usize + json.len();
        let mem = scratch(agent, len)?;
        let state = SourceState {
            generation: 1,
            version: 0,
        };
        let mut head = [0u8; HEAD as usize];
        head[..8].copy_from_slice(&state.to_bytes());
        head[8..].copy_from_slice(&(json.len() as u64).to_le_bytes());
        mem.write_from_host(0, &head).map_err(SyncError::memory)?;
        mem.write_from_host(HEAD, &json)
            .map_err(SyncError::memory)?;
        let region = agent
            .register(mem.clone(), Access::REMOTE_READ)
            .map_err(SyncError::agent)?;
        Ok(OwnRecord {
            mem,
            region,
            state: Mutex::new(state),
        })
    }

    /// The region (its descriptor is what peers read).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The state now.
    pub fn state(&self) -> SourceState {
        *self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Says the memory holds `version` at rest (a new generation if anything changed).
    pub fn at_rest(&self, version: u32) -> Result<(), SyncError> {
        self.set(|s| {
            if s.at_rest() == Some(version) {
                None
            } else {
                Some(SourceState {
                    generation: s.generation.wrapping_add(if s.generation % 2 == 0 {
                        2
                    } else {
                        1
                    }),
                    version,
                })
            }
        })
    }

    /// Says the memory is changing.
    pub fn changing(&self) -> Result<(), SyncError> {
        self.set(|s| {
            (s.generation % 2 == 0).then_some(SourceState {
                generation: s.generation.wrapping_add(1),
                version: s.version,
            })
        })
    }

    fn set(&self, f: impl FnOnce(SourceState) -> Option<SourceState>) -> Result<(), SyncError> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(next) = f(*s) {
            self.mem
                .write_from_host(0, &next.to_bytes())
                .map_err(SyncError::memory)?;
            *s = next;
        }
        Ok(())
    }

    /// Deregisters the region (at the end of its sync).
    pub fn close(&self, agent: &Agent) {
        // A reader may still be reading it: then the agent keeps the memory until the
        // transport lets go, which deregistering later would not improve on.
        let _ = agent.deregister(&self.region);
    }
}

/// Reads `len` bytes at `offset` of a peer's region into host memory with a READ.
fn read_remote(
    agent: &Agent,
    peer: &Peer,
    remote: &RegionDescriptor,
    offset: u64,
    len: u64,
    timeout: Duration,
) -> Result<Vec<u8>, SyncError> {
    let n = usize::try_from(len).map_err(|_| SyncError::Record {
        peer: peer.info().name.clone(),
        reason: format!("{len} bytes do not fit this machine's memory"),
    })?;
    let mem = scratch(agent, n)?;
    let local = agent
        .register(mem.clone(), Access::LOCAL_WRITE)
        .map_err(SyncError::agent)?;
    let read = crate::Transfer::segments(vec![(0, offset, len)])
        .read()
        .timeout(timeout);
    let done = agent
        .submit(peer, &local, remote, read)
        .map_err(|e| SyncError::submit(Side::Source, None, peer, e))
        .and_then(|h| {
            // The transfer's own timeout ends it; the wait is a little longer.
            h.wait(timeout + Duration::from_secs(5))
                .map_err(|e| match e {
                    crate::Error::Engine(fabric_core::Error::Op(op)) => SyncError::Transfer {
                        side: None,
                        rank: None,
                        peer: peer.info().name.clone(),
                        source: op,
                    },
                    e => SyncError::agent(e),
                })
        });
    let mut out = vec![0u8; n];
    let copied = done.and_then(|_| mem.read_to_host(0, &mut out).map_err(SyncError::memory));
    // While a timed-out READ is still in flight the region stays registered (and held).
    let _ = agent.deregister(&local);
    copied.map(|()| out)
}

/// Reads the state word of a source's record region.
pub(crate) fn read_state(
    agent: &Agent,
    peer: &Peer,
    record: &RegionDescriptor,
    timeout: Duration,
) -> Result<SourceState, SyncError> {
    let b = read_remote(agent, peer, record, 0, 8, timeout)?;
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    Ok(SourceState::from_bytes(w))
}

/// Reads a peer's record (refusing what is not one: too short, too long, not JSON of a
/// record, a layout that does not validate).
pub fn read_record(
    agent: &Agent,
    peer: &Peer,
    record: &RegionDescriptor,
    timeout: Duration,
) -> Result<(RankRecord, SourceState), SyncError> {
    let name = || peer.info().name.clone();
    if record.len < HEAD {
        return Err(SyncError::Record {
            peer: name(),
            reason: format!(
                "its record region is {} bytes, shorter than its head",
                record.len
            ),
        });
    }
    let head = read_remote(agent, peer, record, 0, HEAD, timeout)?;
    let mut w = [0u8; 8];
    w.copy_from_slice(&head[..8]);
    let state = SourceState::from_bytes(w);
    w.copy_from_slice(&head[8..16]);
    let len = u64::from_le_bytes(w);
    if len > MAX_RECORD_BYTES || len > record.len - HEAD {
        return Err(SyncError::Record {
            peer: name(),
            reason: format!(
                "it says its record is {len} bytes, in a region of {} (at most {MAX_RECORD_BYTES})",
                record.len
            ),
        });
    }
    let json = read_remote(agent, peer, record, HEAD, len, timeout)?;
    let rec: RankRecord = serde_json::from_slice(&json).map_err(|e| SyncError::Record {
        peer: name(),
        reason: format!("not a record: {e}"),
    })?;
    rec.layout.validate().map_err(|e| SyncError::Record {
        peer: name(),
        reason: format!("its layout is invalid: {e}"),
    })?;
    Ok((rec, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_and_say_when_at_rest() {
        let s = SourceState {
            generation: 4,
            version: 0xDEAD_BEEF,
        };
        assert_eq!(SourceState::from_bytes(s.to_bytes()), s);
        assert_eq!(s.at_rest(), Some(0xDEAD_BEEF));
        let busy = SourceState { generation: 5, ..s };
        assert_eq!(busy.at_rest(), None);
    }
}
