//! `xfer.Agent(...)`'s keyword arguments as the library's [`AgentOptions`]: conversions
//! only. What the options mean, which transports `auto` offers and how they are built is
//! the `xfer` crate's (`Agent::new`); what cannot be converted is an `InvalidArgument` naming
//! the argument, and what the library refuses is mapped by [`crate::errors::agent_error`].

use crate::args::seconds;
use crate::errors::invalid;
use pyo3::prelude::*;
use pyo3::types::PyString;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;
use xfer::Nics;
use xfer::PinMode;
use xfer::{AgentOptions, Congestion, MemoryKind, TransportChoice};

/// The keyword arguments of `xfer.Agent(...)`, as Python gave them.
pub struct EngineArgs<'a, 'py> {
    /// The agent's name (peers' notifications and the directory show it; None: one made
    /// of the process id and a counter).
    pub name: Option<String>,
    /// "auto", "tcp", "cuda-ipc", "efa" or "mem".
    pub transport: &'a str,
    /// The libfabric provider (efa).
    pub provider: Option<String>,
    /// Rails per transport (`None`: one per NIC chosen, else 1).
    pub rails: Option<i64>,
    /// "auto", a list of names, or None (auto).
    pub nics: Option<&'a Bound<'py, PyAny>>,
    /// "host" or "cuda".
    pub memory: &'a str,
    /// The CUDA device ordinal.
    pub gpu: i64,
    /// The tcp transport's shared secret.
    pub auth_token: Option<String>,
    /// A file holding the shared secret (read once, when the agent starts).
    pub auth_token_file: Option<PathBuf>,
    /// Refuse to start without a token when a tcp rail listens beyond loopback.
    pub require_auth: bool,
    /// Seconds: control calls' limit and that of setting up a tcp connection.
    pub timeout: f64,
    /// The IP address tcp rails listen on.
    pub listen: &'a str,
    /// How long a wait spins before it sleeps, in microseconds.
    pub wait_spin_us: Option<u64>,
    /// "off" (Python's default, see `Agent`'s docs) or "auto".
    pub pin: &'a str,
    /// The tcp connections' congestion control: "auto", "system" or an algorithm's name.
    pub tcp_congestion: &'a str,
    /// Seconds a transfer may make no progress before a wait raises PeerStalled.
    pub stall_timeout: Option<f64>,
    /// Seconds a peer's connection may go unanswered before it is declared dead.
    pub liveness_timeout: Option<f64>,
}

impl EngineArgs<'_, '_> {
    /// The agent's options, and its GPU.
    pub fn options(&self) -> PyResult<(AgentOptions, u32)> {
        let transport = TransportChoice::from_name(self.transport).ok_or_else(|| {
            invalid(format!(
                "unknown transport {:?}: expected \"auto\", \"tcp\", \"cuda-ipc\", \"efa\" or \
                 \"mem\"",
                self.transport
            ))
        })?;
        let memory = match self.memory {
            "host" => MemoryKind::Host,
            "cuda" => MemoryKind::Cuda,
            m => {
                return Err(invalid(format!(
                    "memory={m:?}: expected \"host\" or \"cuda\""
                )));
            }
        };
        let rails = self
            .rails
            .map(|r| {
                usize::try_from(r)
                    .map_err(|_| invalid(format!("rails={r}: expected a positive count")))
            })
            .transpose()?;
        let gpu = u32::try_from(self.gpu)
            .map_err(|_| invalid(format!("gpu={}: expected a device ordinal >= 0", self.gpu)))?;
        let timeout = seconds(Some(self.timeout), "timeout")?
            .filter(|t| !t.is_zero())
            .ok_or_else(|| invalid("timeout must be positive"))?;
        let listen: IpAddr = self
            .listen
            .parse()
            .map_err(|_| invalid(format!("listen={:?} is not an IP address", self.listen)))?;
        let pin = match self.pin {
            "auto" => PinMode::Auto,
            "off" => PinMode::Off,
            p => return Err(invalid(format!("pin={p:?}: expected \"auto\" or \"off\""))),
        };
        let mut o = AgentOptions {
            transport,
            memory,
            gpu,
            rails,
            nics: nics(self.nics)?,
            listen,
            pin,
            auth_token: self.auth_token.clone(),
            auth_token_file: self.auth_token_file.clone(),
            require_auth: self.require_auth,
            name: self.name.clone(),
            ..AgentOptions::default()
        };
        o.efa.provider = self.provider.clone();
        o.workers.control_timeout = Some(timeout);
        o.workers.wait_spin = self.wait_spin_us.map(Duration::from_micros);
        o.workers.stall_timeout = crate::args::seconds(self.stall_timeout, "stall_timeout")?;
        o.workers.liveness_timeout =
            crate::args::seconds(self.liveness_timeout, "liveness_timeout")?;
        o.tcp.congestion = Congestion::parse(self.tcp_congestion)
            .map_err(|e| invalid(format!("tcp_congestion={:?}: {e}", self.tcp_congestion)))?;
        Ok((o, gpu))
    }
}

/// `nics=`: "auto" (or None, or an empty list), or a list of names.
fn nics(arg: Option<&Bound<'_, PyAny>>) -> PyResult<Nics> {
    let Some(arg) = arg.filter(|a| !a.is_none()) else {
        return Ok(Nics::Auto);
    };
    if let Ok(s) = arg.cast::<PyString>() {
        return match s.to_str()? {
            "auto" => Ok(Nics::Auto),
            other => Err(invalid(format!(
                "nics={other:?}: expected \"auto\" or a list of names (nics=[{other:?}])"
            ))),
        };
    }
    let names: Vec<String> = arg
        .extract()
        .map_err(|_| invalid("nics: expected \"auto\" or a list of NIC names"))?;
    if names.is_empty() {
        return Ok(Nics::Auto);
    }
    if let Some(bad) = names.iter().find(|n| n.trim().is_empty()) {
        return Err(invalid(format!("nics: an empty name ({bad:?})")));
    }
    Ok(Nics::Named(names))
}
