//! The layers under the [`Agent`](crate::Agent): reachable, not needed by most programs.
//!
//! A program holds an [`Agent`](crate::Agent) and the types at the crate root. What is
//! here is how an agent is built, for tools that report on it or build agents of their own
//! (the `xfer` command uses every part of it):
//!
//! - [`lanes`]: one transport of an agent as a rail group of that backend, built from
//!   [`AgentOptions`] (the one place where backends are made);
//! - [`nics`]: which NIC each rail runs on, and why;
//! - [`placement`]: where workers run (cores, NUMA nodes) from the machine's topology;
//! - [`raw_auth`]: the token check of the raw TCP streams the command's baselines open;
//! - [`AgentLayers`]: an agent's rail groups, NICs and home core, and agents built from
//!   placed rails or from rail groups made elsewhere.
//!
//! Below these are the workspace's own crates: `fabric-core` (the transfer engine, the
//! `Transport` trait and its conformance suite, the metadata format), the backends
//! (`transport-tcp`, `transport-efa`, `transport-cuda-ipc`, `fabric_core::mem`) and
//! `directory` (the cluster directory's backends and records).

use crate::{AgentOptions, Result};
use fabric_core::MemoryLocation;
use fabric_core::engine::RailGroup;
use fabric_core::metadata::TransportKind;
use std::sync::Arc;

pub mod lanes;
pub mod nics;
pub mod placement;
pub mod raw_auth;

/// An [`Agent`](crate::Agent)'s layers: import the trait (`use xfer::layers::AgentLayers`)
/// to reach them.
pub trait AgentLayers: Sized {
    /// As [`Agent::new`](crate::Agent::new), with each rail's core given (`pins[i]` for
    /// rail `i`; several agents of one process placed together, one per GPU, take distinct
    /// cores). Its
    /// [`home`](AgentLayers::home) is then the first rail's core.
    fn with_pins(o: AgentOptions, pins: Option<Vec<Option<placement::CorePin>>>) -> Result<Self>;

    /// An agent over rail groups made elsewhere (a transport of one's own, or engines with
    /// settings [`AgentOptions`] does not cover): `groups` are its transports, in the order
    /// they are preferred, each a rail group of that kind; `memory` is where the memory it
    /// registers lives. No NIC is chosen and no worker pinned here: the groups are as made.
    fn from_groups(
        name: &str,
        memory: MemoryLocation,
        groups: Vec<(TransportKind, RailGroup)>,
    ) -> Result<Self>;

    /// The rail group of transport `kind`, if the agent offers it (for what the agent does
    /// not wrap: per-rail counters, the engines themselves). A clone of it held past the
    /// agent's end keeps its rails running, and their regions held, until it goes.
    fn group(&self, kind: TransportKind) -> Option<&Arc<RailGroup>>;

    /// The NICs of transport `kind`'s rails and how they were chosen.
    fn nics(&self, kind: TransportKind) -> Option<&nics::NicChoice>;

    /// The core whose NUMA node this agent's workers run on: allocate its memory from a
    /// thread that prefers it ([`prefer_memory_here`](placement::CorePin::prefer_memory_here)).
    fn home(&self) -> Option<placement::CorePin>;
}
