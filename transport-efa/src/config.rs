//! How to choose the provider and domain of an [`EfaTransport`](crate::EfaTransport).

use std::time::Duration;

/// The default provider: AWS's Elastic Fabric Adapter.
pub const DEFAULT_PROVIDER: &str = "efa";

/// Configuration of an [`EfaTransport`](crate::EfaTransport).
///
/// ```
/// let mut cfg = transport_efa::EfaConfig::default();
/// cfg.provider = Some("tcp".into());
/// cfg.domain = Some("lo".into());
/// assert_eq!(cfg.provider_name().as_deref(), Some("tcp"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EfaConfig {
    /// The libfabric provider (`efa`, `tcp`, `sockets`, `shm`, `verbs`, ...), matched the
    /// way libfabric matches names (`tcp` finds libfabric 2.x's native tcp endpoint, or
    /// `tcp;ofi_rxm` where that is the only one, as in 1.x). `None`: the `FI_PROVIDER`
    /// environment variable if it names one provider, else [`DEFAULT_PROVIDER`].
    ///
    /// libfabric itself also honours `FI_PROVIDER`: when it is set, only the providers it
    /// names are visible at all, whatever this field says.
    pub provider: Option<String>,
    /// The domain (NIC or interface) to open, by name as `fi_info` shows it (`lo`,
    /// `eth0`, `rdmap0s31-rdm`). `None`: the first the provider lists.
    pub domain: Option<String>,
    /// Ask for FI_HMEM, needed to register device (CUDA) memory. Off by default: providers
    /// without it (tcp, sockets) answer nothing at all to a request that names it.
    pub hmem: bool,
    /// Register CUDA memory with FI_HMEM_DEVICE_ONLY (it is allocated with the device API):
    /// shm then moves it with CUDA IPC instead of bouncing it through host buffers. On by
    /// default.
    pub hmem_device_only: bool,
    /// How long [`wait`](fabric_core::Transport::wait) sleeps at most where the CQ has no
    /// descriptor to sleep on (shm, efa, sockets); 50 µs by default. Zero makes a provider
    /// of manual progress (shm) read its CQ without sleeping, yielding the core, which a
    /// target in the same process as its initiator needs for speed (see the crate docs).
    pub idle_nap: Duration,
    /// At most this many READs, or WRITEs without immediate data, of host memory to one
    /// peer's region go out in one provider call (`fi_readmsg` / `fi_writemsg` with one
    /// iovec per operation on each side), capped at 4 and at the provider's `iov_limit` and
    /// `rma_iov_limit`: efa takes one remote iovec, so there each goes alone; tcp, rxm and
    /// shm take 4. One request and one reply then carry four pages, which is what keeps
    /// small READs over tcp near WRITE's speed. 1 turns it off. Default 4.
    pub max_gather: usize,
}

impl Default for EfaConfig {
    fn default() -> EfaConfig {
        EfaConfig {
            provider: None,
            domain: None,
            hmem: false,
            hmem_device_only: true,
            idle_nap: Duration::from_micros(50),
            max_gather: 4,
        }
    }
}

impl EfaConfig {
    /// A configuration for `provider`, first domain, no HMEM.
    pub fn with_provider(provider: impl Into<String>) -> EfaConfig {
        EfaConfig {
            provider: Some(provider.into()),
            ..EfaConfig::default()
        }
    }

    /// Sets the domain to open.
    pub fn domain(mut self, domain: impl Into<String>) -> EfaConfig {
        self.domain = Some(domain.into());
        self
    }

    /// Sets whether to ask for FI_HMEM.
    pub fn hmem(mut self, hmem: bool) -> EfaConfig {
        self.hmem = hmem;
        self
    }

    /// Sets whether CUDA registrations say FI_HMEM_DEVICE_ONLY.
    pub fn hmem_device_only(mut self, on: bool) -> EfaConfig {
        self.hmem_device_only = on;
        self
    }

    /// Sets [`idle_nap`](EfaConfig::idle_nap).
    pub fn idle_nap(mut self, nap: Duration) -> EfaConfig {
        self.idle_nap = nap;
        self
    }

    /// Sets [`max_gather`](EfaConfig::max_gather).
    pub fn max_gather(mut self, ops: usize) -> EfaConfig {
        self.max_gather = ops;
        self
    }

    /// The provider name to ask libfabric for: the explicit choice, else `FI_PROVIDER`
    /// when it names exactly one provider, else [`DEFAULT_PROVIDER`]. `None` when
    /// `FI_PROVIDER` holds a list or an exclusion (`tcp,sockets`, `^efa`): libfabric
    /// applies it and the first provider it offers is taken.
    pub fn provider_name(&self) -> Option<String> {
        if let Some(p) = &self.provider {
            return Some(p.clone());
        }
        match std::env::var("FI_PROVIDER") {
            Ok(v) if v.is_empty() => Some(DEFAULT_PROVIDER.into()),
            Ok(v) if v.contains(',') || v.starts_with('^') => None,
            Ok(v) => Some(v),
            Err(_) => Some(DEFAULT_PROVIDER.into()),
        }
    }
}
