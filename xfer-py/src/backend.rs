//! Building an engine from the options Python passes (the CLI's `--transport`, `--rails`,
//! `--nics`, `--memory`, `--gpus`, `--auth-token` flags, as keyword arguments).
//!
//! The `xfer` command's own builder lives in its binary crate (no library target), so this
//! is a small one over the same backend crates: tcp, cuda-ipc, efa (cargo feature `efa`,
//! on by default; libfabric is loaded at run time) and the in-process `mem` transport.

use fabric_core::engine::{EngineConfig, RailGroup};
use fabric_core::mem::MemTransport;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport};
use transport_tcp::{TcpConfig, TcpTransport};

/// The transports the package can build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// RDMA semantics over TCP sockets (host or GPU memory, any two hosts).
    Tcp,
    /// Device-to-device copies through CUDA IPC, between processes of one host.
    CudaIpc,
    /// In-process copies: engines of one process (tests, measuring the engine itself).
    Mem,
    /// libfabric FI_EP_RDM: EFA on AWS, or the provider named by `provider`.
    Efa,
}

impl TransportKind {
    /// The name Python uses.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::CudaIpc => "cuda-ipc",
            TransportKind::Mem => "mem",
            TransportKind::Efa => "efa",
        }
    }
}

/// Where the memory an engine registers lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory (numpy, bytearray, ...).
    Host,
    /// CUDA device memory (torch or cupy tensors on the engine's GPU).
    Cuda,
}

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The options do not make sense (unknown transport, zero rails, ...).
    #[error("{0}")]
    Usage(String),
    /// The options name something this build cannot do.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// CUDA is needed but cannot be used.
    #[error("CUDA: {0}")]
    Cuda(#[from] gpu_mem::GpuMemError),
    /// The engine failed to start.
    #[error(transparent)]
    Engine(#[from] fabric_core::Error),
}

/// The options of `xfer.Engine(...)`.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// "auto", "tcp", "cuda-ipc", "mem" (or "efa", refused by this build).
    pub transport: String,
    /// libfabric provider (efa only).
    pub provider: Option<String>,
    /// Rails (engines, each a worker thread with its transport).
    pub rails: usize,
    /// Network interfaces the tcp rails bind to (rail i on `nics[i % n]`); each rail
    /// listens on its interface's address of `listen`'s family.
    pub nics: Vec<String>,
    /// What memory the engine registers.
    pub memory: MemoryKind,
    /// The CUDA device ordinal for cuda memory.
    pub gpu: u32,
    /// Shared secret for tcp peers.
    pub auth_token: Option<String>,
    /// Control calls' limit and the tcp peer timeout.
    pub timeout: Duration,
    /// The IP address tcp rails listen on.
    pub listen: IpAddr,
    /// How long a wait spins before it sleeps (the engine's `wait_spin`).
    pub wait_spin: Option<Duration>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            transport: "auto".into(),
            provider: None,
            rails: 1,
            nics: Vec::new(),
            memory: MemoryKind::Host,
            gpu: 0,
            auth_token: None,
            timeout: Duration::from_secs(10),
            listen: IpAddr::from([127, 0, 0, 1]),
            wait_spin: None,
        }
    }
}

/// Most rails an engine may have.
pub const MAX_RAILS: usize = 64;

impl EngineOptions {
    /// The transport `transport` names; `auto` is cuda-ipc for cuda memory when a CUDA
    /// driver is present, tcp otherwise.
    pub fn kind(&self) -> Result<TransportKind, BuildError> {
        match self.transport.as_str() {
            "tcp" => Ok(TransportKind::Tcp),
            "cuda-ipc" => Ok(TransportKind::CudaIpc),
            "mem" => Ok(TransportKind::Mem),
            "auto" if self.memory == MemoryKind::Cuda && gpu_mem::driver_present() => {
                Ok(TransportKind::CudaIpc)
            }
            "auto" => Ok(TransportKind::Tcp),
            "efa" if cfg!(feature = "efa") => Ok(TransportKind::Efa),
            "efa" => Err(BuildError::Unsupported(
                "this build of the xfer package has no efa transport (built without the cargo \
                 feature efa): use transport=\"tcp\""
                    .into(),
            )),
            other => Err(BuildError::Usage(format!(
                "unknown transport {other:?}: expected \"auto\", \"tcp\", \"cuda-ipc\" or \"mem\""
            ))),
        }
    }

    /// Checks the options that do not depend on the machine.
    fn check(&self, kind: TransportKind) -> Result<(), BuildError> {
        if self.rails == 0 || self.rails > MAX_RAILS {
            return Err(BuildError::Usage(format!(
                "rails={} : an engine has 1..={MAX_RAILS} rails",
                self.rails
            )));
        }
        if self.provider.is_some() && kind != TransportKind::Efa {
            return Err(BuildError::Usage(
                "provider applies to transport=\"efa\" only".into(),
            ));
        }
        if self.auth_token.is_some() && kind != TransportKind::Tcp {
            return Err(BuildError::Usage(
                "auth_token applies to transport=\"tcp\" only".into(),
            ));
        }
        if !self.nics.is_empty() && !matches!(kind, TransportKind::Tcp | TransportKind::Efa) {
            return Err(BuildError::Usage(
                "nics applies to transport=\"tcp\" and \"efa\" only".into(),
            ));
        }
        if kind == TransportKind::CudaIpc && self.memory != MemoryKind::Cuda {
            return Err(BuildError::Usage(
                "transport=\"cuda-ipc\" moves GPU memory: pass memory=\"cuda\" (or use transport=\"tcp\" for host memory)"
                    .into(),
            ));
        }
        if self.timeout.is_zero() {
            return Err(BuildError::Usage("timeout must be positive".into()));
        }
        Ok(())
    }

    /// Starts the engine's rails.
    pub fn spawn(&self, name: &str) -> Result<(TransportKind, RailGroup), BuildError> {
        let kind = self.kind()?;
        self.check(kind)?;
        let d = EngineConfig::default();
        let cfg = EngineConfig {
            name: name.into(),
            control_timeout: self.timeout,
            wait_spin: self.wait_spin.unwrap_or(d.wait_spin),
            ..d
        };
        let group = match kind {
            TransportKind::Tcp => {
                let nics = Arc::new(nic_addresses(&self.nics, self.listen)?);
                let base = TcpConfig {
                    listen: SocketAddr::new(self.listen, 0),
                    auth_token: self.auth_token.clone(),
                    peer_timeout: self.timeout,
                    ..TcpConfig::default()
                };
                RailGroup::spawn(
                    self.rails,
                    move |i| match nics.get(i % nics.len().max(1)) {
                        Some((name, ip)) => TcpTransport::new(TcpConfig {
                            interface: Some(name.clone()),
                            listen: SocketAddr::new(*ip, 0),
                            ..base.clone()
                        }),
                        None => TcpTransport::new(base.clone()),
                    },
                    cfg,
                )?
            }
            TransportKind::Mem => RailGroup::spawn(self.rails, |_| Ok(MemTransport::new()), cfg)?,
            TransportKind::Efa => self.spawn_efa(cfg)?,
            TransportKind::CudaIpc => {
                let cuda = gpu_mem::Cuda::probe()?.ok_or_else(|| {
                    BuildError::Unsupported(
                        "no CUDA driver on this machine: use memory=\"host\" and transport=\"tcp\""
                            .into(),
                    )
                })?;
                let device = self.gpu;
                // Fails early (and clearly) for a GPU that is not there.
                cuda.device(device)?;
                RailGroup::spawn(
                    self.rails,
                    move |_| {
                        CudaIpcTransport::new(
                            &cuda,
                            CudaIpcConfig {
                                device,
                                ..CudaIpcConfig::default()
                            },
                        )
                    },
                    cfg,
                )?
            }
        };
        Ok((kind, group))
    }
}

impl EngineOptions {
    /// Starts efa rails: rail i opens NIC `nics[i % n]` as its libfabric domain.
    #[cfg(feature = "efa")]
    fn spawn_efa(&self, cfg: EngineConfig) -> Result<RailGroup, BuildError> {
        use transport_efa::{EfaConfig, EfaTransport};
        let ec = match &self.provider {
            Some(p) => EfaConfig::with_provider(p.clone()),
            None => EfaConfig::default(),
        }
        .hmem(self.memory == MemoryKind::Cuda);
        let nics = self.nics.clone();
        Ok(RailGroup::spawn(
            self.rails,
            move |i| match nics.get(i % nics.len().max(1)) {
                Some(n) => EfaTransport::new(&ec.clone().domain(n.clone())),
                None => EfaTransport::new(&ec),
            },
            cfg,
        )?)
    }

    /// Unreachable: `kind` refuses "efa" without the feature.
    #[cfg(not(feature = "efa"))]
    fn spawn_efa(&self, _cfg: EngineConfig) -> Result<RailGroup, BuildError> {
        Err(BuildError::Unsupported(
            "built without the efa transport".into(),
        ))
    }
}

/// Each interface of `nics` with its first address of `toward`'s family (IPv4 or IPv6).
fn nic_addresses(nics: &[String], toward: IpAddr) -> Result<Vec<(String, IpAddr)>, BuildError> {
    if nics.is_empty() {
        return Ok(Vec::new());
    }
    let addrs = if_addrs::get_if_addrs()
        .map_err(|e| BuildError::Usage(format!("nics: cannot list the interfaces: {e}")))?;
    nics.iter()
        .map(|name| {
            addrs
                .iter()
                .find(|a| &a.name == name && a.ip().is_ipv4() == toward.is_ipv4())
                .map(|a| (name.clone(), a.ip()))
                .ok_or_else(|| {
                    BuildError::Usage(format!(
                        "nics: {name:?} is not an interface of this machine with an {} address",
                        if toward.is_ipv4() { "IPv4" } else { "IPv6" }
                    ))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_tcp_for_host_memory_and_unknown_names_are_refused() {
        let o = EngineOptions::default();
        assert_eq!(o.kind().unwrap(), TransportKind::Tcp);
        let efa = EngineOptions {
            transport: "efa".into(),
            ..EngineOptions::default()
        };
        assert_eq!(efa.kind().is_ok(), cfg!(feature = "efa"));
        let bad = EngineOptions {
            transport: "carrier-pigeon".into(),
            ..EngineOptions::default()
        };
        assert!(matches!(bad.kind(), Err(BuildError::Usage(_))));
    }

    #[test]
    fn options_that_do_not_fit_the_transport_are_usage_errors() {
        for o in [
            EngineOptions {
                rails: 0,
                ..EngineOptions::default()
            },
            EngineOptions {
                transport: "mem".into(),
                auth_token: Some("s".into()),
                ..EngineOptions::default()
            },
            EngineOptions {
                transport: "cuda-ipc".into(),
                ..EngineOptions::default()
            },
            EngineOptions {
                provider: Some("efa".into()),
                ..EngineOptions::default()
            },
        ] {
            assert!(
                matches!(o.spawn("t"), Err(BuildError::Usage(_))),
                "{o:?} was accepted"
            );
        }
    }

    #[test]
    fn nics_are_interfaces_with_an_address() {
        let lo = nic_addresses(&["lo".into()], IpAddr::from([127, 0, 0, 1])).unwrap();
        assert_eq!(lo, vec![("lo".to_string(), IpAddr::from([127, 0, 0, 1]))]);
        assert!(matches!(
            nic_addresses(&["no-such-nic0".into()], IpAddr::from([127, 0, 0, 1])),
            Err(BuildError::Usage(_))
        ));
    }

    #[test]
    fn a_mem_engine_with_two_rails_starts() {
        let o = EngineOptions {
            transport: "mem".into(),
            rails: 2,
            ..EngineOptions::default()
        };
        let (kind, g) = o.spawn("t").unwrap();
        assert_eq!(kind, TransportKind::Mem);
        assert_eq!(g.rails().len(), 2);
    }
}
