//! [`EfaTransport`]: the [`Transport`] over one libfabric FI_EP_RDM endpoint.

use crate::FastMap;
use crate::address;
use crate::attrs::Policy;
use crate::config::EfaConfig;
use crate::fi::{FiError, InfoList, Owned, check};
use crate::info::{self, ProviderInfo};
use crate::mr::{self, Registered};
use crate::ops::{Followers, Op, OpTable, Slot};
use fabric_core::wake::{Wake, WakeFd};
use fabric_core::{
    Access, Completion, Error, LocalKey, LocalSlice, MemoryRegion, OpError, OpKind, PeerId,
    PostOutcome, Registration, RemoteSlice, Result, Transport, TransportLimits, WorkRequestId,
};
use libfabric_sys as sys;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod complete;
mod post;
mod wait;

use complete::failed;

/// A peer in the address vector.
struct Peer {
    fi_addr: sys::fi_addr_t,
    /// Whether the provider has accepted an operation for this peer yet. Until then its
    /// connection may still be coming up (rxm answers -FI_EAGAIN while it connects), and
    /// operations wait in `backlog` instead of being refused.
    ready: bool,
    /// Operations (slot indices) accepted by us but not yet by the provider, in order.
    backlog: VecDeque<usize>,
    /// Since when the provider's connection to the peer is known to be broken (the tcp
    /// provider closes it after any failure at the target, and needs ~20 ms to notice and
    /// connect again). Until [`RECONNECT_WINDOW`] has passed, operations that fail with
    /// FI_ENOTCONN (never sent) go back to the backlog instead of failing.
    broken_since: Option<Instant>,
}

/// How long operations to a peer whose connection broke are retried before they fail
/// with [`OpError::PeerUnreachable`].
pub(crate) const RECONNECT_WINDOW: Duration = Duration::from_secs(5);

/// A [`Transport`] over one libfabric reliable-datagram endpoint (FI_EP_RDM) with FI_MSG
/// and FI_RMA: SEND/RECV for control messages, `fi_writemsg` for data, remote CQ data for
/// immediate values.
///
/// Construct it in the thread that will poll it: the provider allocates the domain, CQ
/// and AV on the NUMA node of the thread that opens them (pin that thread first).
///
/// Operations posted to a peer whose connection is still coming up (the provider answers
/// `-FI_EAGAIN` before it ever accepted one for that peer) wait in a per-peer backlog of
/// up to `tx_size` operations and are handed to the provider inside [`poll`]; after that,
/// `-FI_EAGAIN` is [`PostOutcome::NoRoom`]. Operations that fail with FI_ENOTCONN (never
/// sent) while the provider re-establishes a broken connection are retried the same way
/// for up to 5 seconds.
///
/// A WRITE's completion means the bytes are in the peer's memory (FI_DELIVERY_COMPLETE,
/// with every provider; the crate docs say why no provider gets a weaker completion), and
/// a failure at the peer fails the write that caused it.
///
/// With a provider of manual data progress, the peer's bytes land only while it reads its
/// CQ: in [`poll`], or in [`wait`](Transport::wait), which sleeps on the CQ's descriptor
/// where the provider gives one (tcp) and wakes as soon as the provider has work.
///
/// Removing a peer fails its pending operations at once with
/// [`OpError::PeerRemoved`]; should the provider report them later anyway, those late
/// completions are dropped (each operation completes exactly once). Their local regions
/// stay registered until then.
///
/// [`poll`]: Transport::poll
pub struct EfaTransport {
    // Fields are dropped in declaration order, which is the order libfabric needs: the
    // endpoint first (nothing is in flight afterwards), then memory registrations (and the
    // memory they keep alive), then the operation contexts, the AV and CQ, the domain, and
    // the fabric last.
    ep: Owned<sys::fid_ep>,
    regs: FastMap<LocalKey, Registered>,
    /// The remote keys of `regs` (requested keys are never one of them).
    keys_in_use: mr::KeysInUse,
    ops: OpTable,
    av: Owned<sys::fid_av>,
    cq: Owned<sys::fid_cq>,
    /// Counts peers' writes into this endpoint's memory, where the provider offers it and
    /// gives no descriptor to sleep on (shm): see [`wait`].
    remote_writes: Option<Owned<sys::fid_cntr>>,
    domain: Owned<sys::fid_domain>,
    fabric: Owned<sys::fid_fabric>,

    info: ProviderInfo,
    /// What the provider's attributes decide (keys, addressing, immediate data, sizes).
    policy: Policy,
    /// Whether SENDs tag their CQ data (see [`SEND_IMM`]).
    tag_cq_data: bool,
    hmem: bool,
    /// Whether the library takes dmabuf registrations (API 1.20+).
    dmabuf: bool,
    /// [`EfaConfig::hmem_device_only`].
    device_only: bool,
    /// [`EfaConfig::idle_nap`].
    idle_nap: Duration,
    /// `remote_writes` when last read, and until when the endpoint counts as being written
    /// to (it then polls instead of napping).
    writes_seen: u64,
    written_until: Option<std::time::Instant>,
    /// How many operations one provider call carries at most ([`EfaConfig::max_gather`],
    /// capped by the provider's iovec limits); 1: each goes alone, as it is posted.
    gather: usize,
    addr_format: u32,
    /// What `fi_getname` returned.
    raw_address: Vec<u8>,
    peers: FastMap<PeerId, Peer>,
    /// Peers with a non-empty backlog.
    backlogged: Vec<PeerId>,
    next_peer: u64,
    next_local_key: u64,
    /// Completions decided locally (peer removal) or read from the CQ inside `wait`,
    /// reported by the next `poll`.
    ready: VecDeque<Completion>,
    /// The CQ's wait descriptor (providers with manual data progress that offer one).
    wait_fd: Option<wait::WaitFd>,
    /// Scratch space for the completions `wait` reads.
    waited: Vec<Completion>,
    /// Polled with the CQ's descriptor in `wait`: the engine makes it readable when it
    /// has work for us.
    wake: WakeFd,
    /// `wait` saw a wake-up from the engine.
    woken: bool,
    /// This endpoint in the process's list of shm endpoints (see [`crate::local`]).
    local: Option<crate::local::LocalEndpoint>,
}

impl std::fmt::Debug for EfaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EfaTransport")
            .field("provider", &self.info.provider)
            .field("fabric", &self.info.fabric)
            .field("domain", &self.info.domain)
            .field("peers", &self.peers.len())
            .field("registrations", &self.regs.len())
            .field("ops_in_flight", &self.ops.in_use())
            .finish()
    }
}

/// The provider that a request for `tcp` takes when libfabric lists it: libfabric 2.x
/// offers FI_EP_RDM over tcp both natively (`tcp`, listed first) and through rxm
/// (`tcp;ofi_rxm`, 1.x's only one). The native one was slow here (2.4 Gbps against rxm's
/// 12.8, `xfer demo --transport efa --provider tcp`, 2-core VM, libfabric 2.6) only because
/// its target napped between CQ reads (see [`progresses_only_when_read`]); sleeping on the
/// CQ's descriptor, it moves as much or more: H200, libfabric 2.6, one call, medians of 3,
/// native against rxm, 1 rail: 4 KiB WRITE 10.4 and 10.5 Gbps, READ 9.7 and 7.8; 64 KiB
/// WRITE 30.3 and 29.6, READ 32.6 and 34.0; 4 rails of 64 KiB WRITE 94.1 and 94.6, READ
/// 105.3 and 110.4. So `tcp` means the native endpoint where both exist, as libfabric's
/// own order has it; name `tcp;ofi_rxm` (or set `FI_PROVIDER`) for rxm.
const TCP_PREFERRED: &str = "tcp";

/// Whether the provider moves data only while its CQ is read. Manual data progress says
/// so; libfabric 2.x's native `tcp` (xnet) RDM endpoint says FI_PROGRESS_AUTO but starts its
/// progress thread only for counters and event queues, never for a CQ (`xnet_cq_open`,
/// `xnet_start_progress`), so it needs the same: through it, a target that napped between
/// CQ reads held WRITEs of 4 KiB pages at 0.43 Gbps (2-core VM) where READs, whose data the
/// busy initiator pulls, moved 7.2.
fn progresses_only_when_read(s: &ProviderInfo) -> bool {
    s.data_progress == info::Progress::Manual || s.provider == "tcp"
}

/// Picks the `fi_info` entry for `config` from a list.
fn choose<'a>(list: &'a InfoList, config: &EfaConfig) -> Result<&'a sys::fi_info> {
    if config.provider_name().as_deref() == Some("tcp")
        && let Some(e) = list.iter().find(|e| {
            let s = info::summarize(e, config.hmem);
            s.provider == TCP_PREFERRED && config.domain.as_ref().is_none_or(|d| *d == s.domain)
        })
    {
        return Ok(e);
    }
    let mut domains = Vec::new();
    for e in list.iter() {
        let s = info::summarize(e, config.hmem);
        match &config.domain {
            Some(d) if *d != s.domain => {
                if !domains.contains(&s.domain) {
                    domains.push(s.domain);
                }
            }
            _ => return Ok(e),
        }
    }
    Err(Error::Unsupported(format!(
        "provider {:?} has no domain {:?} here; its domains: {}",
        config.provider_name().unwrap_or_default(),
        config.domain.as_deref().unwrap_or_default(),
        domains.join(", ")
    )))
}

impl EfaTransport {
    /// Opens fabric, domain, address vector (FI_AV_TABLE), completion queue
    /// (FI_CQ_FORMAT_DATA) and endpoint for `config`.
    ///
    /// Fails with [`Error::Unsupported`] (listing the providers that exist) when no
    /// provider of that name offers FI_EP_RDM with FI_MSG | FI_RMA (| FI_HMEM), and with
    /// [`Error::Backend`] when a libfabric call fails.
    pub fn new(config: &EfaConfig) -> Result<EfaTransport> {
        let provider = config.provider_name();
        // shm lands a peer's small writes only inside this side's progress, and tells it
        // nothing of them: ask it for counters of peers' writes (FI_RMA_EVENT), so that an
        // idle target can see writes arriving (see `wait`). A library that cannot is asked
        // again without.
        let counted = provider.as_deref() == Some("shm");
        let with_counter = if counted {
            info::getinfo_with(config.hmem, provider.as_deref(), true)?
        } else {
            None
        };
        let list = match with_counter {
            Some(list) => Some(list),
            None => info::getinfo(config.hmem, provider.as_deref())?,
        };
        let Some(list) = list else {
            return Err(info::no_such_provider(
                provider.as_deref().unwrap_or("(FI_PROVIDER)"),
                config.hmem,
            ));
        };
        let entry = choose(&list, config)?;
        let summary = info::summarize(entry, config.hmem);
        // SAFETY: entries from fi_getinfo have valid attribute pointers.
        let dom_attr = unsafe { &*entry.domain_attr };
        let mr_mode = dom_attr.mr_mode as u32 as u64;
        let policy = Policy::of(&summary, mr_mode)?;
        let entry_ptr = std::ptr::from_ref(entry).cast_mut();

        let mut fabric = std::ptr::null_mut();
        // SAFETY: fabric_attr comes from a live fi_info of this library (getinfo loaded
        // it); fabric receives the new object.
        let rc = unsafe {
            crate::fi::lib()?.fi_fabric(entry.fabric_attr, &mut fabric, std::ptr::null_mut())
        };
        check("fi_fabric", rc as isize)?;
        let fabric = Owned::new("fi_fabric", fabric)?;

        let mut domain = std::ptr::null_mut();
        // SAFETY: fabric is open; entry is the fi_info it was opened from.
        let rc = unsafe {
            sys::fi_domain(
                fabric.as_ptr(),
                entry_ptr,
                &mut domain,
                std::ptr::null_mut(),
            )
        };
        check("fi_domain", rc as isize)?;
        let domain = Owned::new("fi_domain", domain)?;

        let mut av_attr = sys::fi_av_attr {
            type_: sys::FI_AV_TABLE,
            count: 64,
            ..Default::default()
        };
        let mut av = std::ptr::null_mut();
        // SAFETY: domain is open; av_attr is a valid attribute struct for the call.
        let rc = unsafe {
            sys::fi_av_open(domain.as_ptr(), &mut av_attr, &mut av, std::ptr::null_mut())
        };
        check("fi_av_open", rc as isize)?;
        let av = Owned::new("fi_av_open", av)?;

        // With manual data progress, bytes move only while someone reads the CQ: ask for a
        // descriptor to sleep on between reads (see `wait`).
        let (cq, wait_fd) = wait::open_cq(
            &domain,
            summary.tx_size + summary.rx_size,
            progresses_only_when_read(&summary),
        )?;

        let mut ep = std::ptr::null_mut();
        // SAFETY: domain is open and was made from entry.
        let rc =
            unsafe { sys::fi_endpoint(domain.as_ptr(), entry_ptr, &mut ep, std::ptr::null_mut()) };
        check("fi_endpoint", rc as isize)?;
        let ep = Owned::new("fi_endpoint", ep)?;
        // SAFETY: ep, av and cq are open objects of the same domain.
        let rc = unsafe { sys::fi_ep_bind(ep.as_ptr(), av.fid(), 0) };
        check("fi_ep_bind(av)", rc as isize)?;
        // SAFETY: as above.
        let rc = unsafe { sys::fi_ep_bind(ep.as_ptr(), cq.fid(), sys::FI_TRANSMIT | sys::FI_RECV) };
        check("fi_ep_bind(cq)", rc as isize)?;
        let remote_writes = if entry.caps & sys::FI_RMA_EVENT != 0 && wait_fd.is_none() {
            wait::open_write_counter(&domain, &ep)?
        } else {
            None
        };
        // SAFETY: ep is bound to its AV and CQ.
        let rc = unsafe { sys::fi_enable(ep.as_ptr()) };
        check("fi_enable", rc as isize)?;

        let raw_address = getname(&ep)?;
        let addr_format = entry.addr_format;
        let hmem = config.hmem && entry.caps & sys::FI_HMEM != 0;
        let summary_provider_is_shm = summary.provider == "shm";
        let local_address = address::encode(&summary.provider, &raw_address);
        let gather = gather_limit(config.max_gather, summary.iov_limit, summary.rma_iov_limit);
        drop(list);
        tracing::debug!(
            provider = %summary.provider, fabric = %summary.fabric, domain = %summary.domain,
            mr_mode = ?summary.mr_mode, progress = %summary.data_progress,
            wait_fd = wait_fd.is_some(), "libfabric endpoint open"
        );
        Ok(EfaTransport {
            ep,
            regs: FastMap::default(),
            keys_in_use: mr::KeysInUse::default(),
            ops: OpTable::default(),
            av,
            cq,
            domain,
            fabric,
            tag_cq_data: policy.tag_sends,
            policy,
            info: summary,
            hmem,
            dmabuf: crate::fi::lib().is_ok_and(info::has_dmabuf),
            device_only: config.hmem_device_only,
            idle_nap: config.idle_nap,
            writes_seen: 0,
            written_until: None,
            remote_writes,
            gather,
            addr_format,
            raw_address,
            peers: FastMap::default(),
            backlogged: Vec::new(),
            next_peer: 1,
            next_local_key: 1,
            ready: VecDeque::new(),
            wait_fd,
            waited: Vec::new(),
            wake: WakeFd::new().map_err(|e| Error::io("wake-up socket pair", e))?,
            woken: false,
            local: summary_provider_is_shm
                .then(|| crate::local::LocalEndpoint::list(local_address, hmem)),
        })
    }

    /// What the provider offers on this endpoint's domain (as [`info`](crate::info) lists it).
    pub fn provider_info(&self) -> &ProviderInfo {
        &self.info
    }

    /// The provider's name (`efa`, `tcp;ofi_rxm`, ...).
    pub fn provider(&self) -> &str {
        &self.info.provider
    }

    /// [`Transport::register`] with requested keys drawn from `draw` (random bits; tests
    /// script them). Keys held by this endpoint's live registrations are never requested.
    fn register_with(
        &mut self,
        mem: Arc<dyn MemoryRegion>,
        access: Access,
        draw: &mut dyn FnMut() -> u64,
    ) -> Result<Registration> {
        let in_use = &self.keys_in_use;
        let taken = |k: u64| in_use.contains(&k);
        let reg = mr::register(
            mr::Target {
                domain: &self.domain,
                ep: &self.ep,
                policy: self.policy,
                mr_key_size: self.info.mr_key_size,
                hmem: self.hmem,
                dmabuf: self.dmabuf,
                device_only: self.device_only,
                provider: &self.info.provider,
            },
            mem,
            access,
            mr::KeyChoice {
                draw,
                taken: &taken,
            },
        )?;
        let local = LocalKey(self.next_local_key);
        self.next_local_key += 1;
        let registration = Registration {
            local,
            remote: reg.remote(),
        };
        self.keys_in_use.insert(registration.remote.key.0);
        self.regs.insert(local, reg);
        Ok(registration)
    }

    fn peer(&self, peer: PeerId) -> Result<&Peer> {
        self.peers.get(&peer).ok_or(Error::UnknownPeer(peer))
    }

    /// Checks a local range for an operation that needs `need` and returns its address.
    fn local_range(&self, slice: LocalSlice, need: Access) -> Result<&Registered> {
        let reg = self
            .regs
            .get(&slice.key)
            .filter(|r| !r.deregistered)
            .ok_or(Error::Op(OpError::LocalKeyInvalid(slice.key)))?;
        if slice
            .offset
            .checked_add(slice.len)
            .is_none_or(|end| end > reg.len)
        {
            return Err(Error::Op(OpError::OutOfBounds {
                offset: slice.offset,
                len: slice.len,
                region_len: reg.len,
            }));
        }
        if !reg.access.contains(need) {
            return Err(Error::Op(OpError::PermissionDenied));
        }
        if slice.len > self.info.max_msg_size {
            return Err(fabric_core::Invalid::TooLarge {
                op: "message",
                len: slice.len,
                limit: self.info.max_msg_size,
                setting: "the provider's max_msg_size",
            }
            .into());
        }
        Ok(reg)
    }

    fn check_imm(&self, imm: Option<u32>) -> Result<()> {
        if imm.is_some() && !self.policy.imm {
            return Err(Error::Unsupported(format!(
                "immediate data needs 4 bytes of CQ data; provider {} offers {}",
                self.info.provider, self.info.cq_data_size
            )));
        }
        Ok(())
    }

    /// Inserts one raw address (checked by `add_peer`) into the AV.
    fn av_insert(&mut self, raw: &[u8]) -> Result<sys::fi_addr_t> {
        let mut fi_addr: sys::fi_addr_t = sys::FI_ADDR_NOTAVAIL;
        // SAFETY: av is open; raw holds one address of the AV's format (length checked by
        // add_peer); fi_addr receives its handle.
        let rc = unsafe {
            sys::fi_av_insert(
                self.av.as_ptr(),
                raw.as_ptr().cast(),
                1,
                &mut fi_addr,
                0,
                std::ptr::null_mut(),
            )
        };
        if rc == -sys::FI_EINVAL || rc == 0 || fi_addr == sys::FI_ADDR_NOTAVAIL {
            return Err(Error::InvalidAddress(format!(
                "the {} provider rejected the address ({})",
                self.info.provider,
                if rc < 0 {
                    FiError::new(rc).message()
                } else {
                    "not inserted".into()
                }
            )));
        }
        check("fi_av_insert", rc as isize)?;
        Ok(fi_addr)
    }

    /// Removes one AV entry.
    fn av_remove(&mut self, mut fi_addr: sys::fi_addr_t) -> Result<()> {
        // SAFETY: av is open (the endpoint too: fi_av_remove after closing the endpoint
        // crashes some providers); fi_addr is an entry we inserted and remove once.
        let rc = unsafe { sys::fi_av_remove(self.av.as_ptr(), &mut fi_addr, 1, 0) };
        if rc == -sys::FI_EINVAL {
            // The entry is ours and removed once, so this is not about the address: the
            // sockets provider answers EINVAL for a peer it never connected to (no
            // operation was ever handed over), after removing the entry all the same.
            tracing::debug!(
                provider = %self.info.provider,
                "fi_av_remove: EINVAL for a peer never connected to; the entry is gone"
            );
            return Ok(());
        }
        check("fi_av_remove", rc as isize)?;
        Ok(())
    }

    /// Submits a WRITE or READ of `remote`'s range. The descriptor says how long the
    /// region is: a range outside it fails as the peer would fail it, without a round trip
    /// (the peer checks again anyway).
    fn submit_in_bounds(&mut self, op: Op, remote: RemoteSlice) -> Result<PostOutcome> {
        if remote
            .offset
            .checked_add(remote.len)
            .is_none_or(|end| end > remote.region.len)
        {
            self.ready.push_back(failed(
                &op,
                OpError::OutOfBounds {
                    offset: remote.offset,
                    len: remote.len,
                    region_len: remote.region.len,
                },
            ));
            return Ok(PostOutcome::Posted);
        }
        self.submit(op)
    }

    /// Counts an operation on a registration (keeps it open while in flight).
    fn hold(&mut self, key: LocalKey) {
        if let Some(r) = self.regs.get_mut(&key) {
            r.inflight += 1;
        }
    }

    /// Frees slot `idx` and releases its hold on its registration.
    fn finish_slot(&mut self, idx: usize) -> Slot {
        let slot = self.ops.release(idx);
        let key = match &slot {
            Slot::Active(op) => Some(op.local),
            Slot::Orphaned(op, _) => Some(op.local),
            Slot::Free => None,
        };
        if let Some(key) = key {
            mr::release(&mut self.regs, &mut self.keys_in_use, key);
        }
        slot
    }
}

/// How many operations one provider call may carry: what the configuration asks, at
/// most [`MAX_GATHER`](crate::ops::MAX_GATHER) and the provider's iovec limits, at least 1.
fn gather_limit(asked: usize, iov_limit: usize, rma_iov_limit: usize) -> usize {
    asked
        .min(crate::ops::MAX_GATHER)
        .min(iov_limit)
        .min(rma_iov_limit)
        .max(1)
}

/// `fi_getname` of an endpoint.
fn getname(ep: &Owned<sys::fid_ep>) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; 64];
    loop {
        let mut len = buf.len();
        // SAFETY: ep is open; buf is writable for len bytes; len receives the size.
        let rc = unsafe { sys::fi_getname(ep.fid(), buf.as_mut_ptr().cast(), &mut len) };
        if rc == -(sys::FI_ETOOSMALL as i32) && len > buf.len() {
            buf.resize(len, 0);
            continue;
        }
        check("fi_getname", rc as isize)?;
        buf.truncate(len);
        return Ok(buf);
    }
}

impl Transport for EfaTransport {
    fn name(&self) -> &'static str {
        "efa"
    }

    fn address(&self) -> Vec<u8> {
        address::encode(&self.info.provider, &self.raw_address)
    }

    fn limits(&self) -> TransportLimits {
        // With a wait descriptor, `wait` sleeps until the provider has something to do;
        // without one (efa and sockets progress on their own, shm offers none), the CQ is
        // read in a busy loop while operations are in flight.
        self.policy
            .limits(self.info.tx_size, self.wait_fd.is_none())
    }

    fn add_peer(&mut self, addr: &[u8]) -> Result<PeerId> {
        let (provider, raw) = address::decode(addr)?;
        if provider != self.info.provider {
            return Err(Error::InvalidAddress(format!(
                "address of libfabric provider {provider:?}, but this endpoint uses {:?}",
                self.info.provider
            )));
        }
        if self.local.is_some()
            && let Some(peer_hmem) = crate::local::hmem_of(addr)
            && (self.hmem || peer_hmem)
        {
            return Err(Error::Unsupported(
                "libfabric's shm provider with GPU memory (FI_HMEM) between two endpoints of \
                 one process loses writes into device memory: run the two ends in two \
                 processes (xfer serve and xfer bench), or use the cuda-ipc or tcp transport \
                 within one process"
                    .into(),
            ));
        }
        // fi_av_insert reads as many bytes as the address format says: check the length
        // (a string address must carry its NUL) before handing it over.
        let mut raw = raw.to_vec();
        if self.addr_format == sys::FI_ADDR_STR {
            if raw.last() != Some(&0) {
                raw.push(0);
            }
            if raw[..raw.len() - 1].contains(&0) {
                return Err(Error::InvalidAddress(
                    "string address with a NUL inside".into(),
                ));
            }
        } else if raw.len() != self.raw_address.len() {
            return Err(Error::InvalidAddress(format!(
                "raw address of {} bytes; this endpoint's are {} (another address format?)",
                raw.len(),
                self.raw_address.len()
            )));
        }
        let fi_addr = self.av_insert(&raw)?;
        let id = PeerId(self.next_peer);
        self.next_peer += 1;
        self.peers.insert(
            id,
            Peer {
                fi_addr,
                ready: false,
                backlog: VecDeque::new(),
                broken_since: None,
            },
        );
        Ok(id)
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<()> {
        let mut p = self.peers.remove(&peer).ok_or(Error::UnknownPeer(peer))?;
        self.backlogged.retain(|&x| x != peer);
        for idx in p.backlog.drain(..) {
            if let Slot::Active(op) = self.finish_slot(idx) {
                self.ready
                    .push_back(failed(&op, OpError::PeerRemoved(peer)));
            }
        }
        // Operations the provider holds fail when it hands them back (see Slot::Orphaned):
        // reporting them now would give their memory back while the NIC may still use it.
        for idx in self.ops.posted_for(peer) {
            self.ops.orphan(idx, peer);
        }
        self.av_remove(p.fi_addr)
    }

    fn register(&mut self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Registration> {
        self.register_with(mem, access, &mut fabric_core::random_u64)
    }

    fn deregister(&mut self, key: LocalKey) -> Result<()> {
        mr::deregister(&mut self.regs, &mut self.keys_in_use, key)
    }

    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        self.peer(peer)?;
        self.check_imm(imm)?;
        self.local_range(src, Access::NONE)?;
        self.submit(Op {
            wr_id,
            kind: OpKind::Send,
            peer: Some(peer),
            local: src.key,
            offset: src.offset,
            len: src.len,
            remote_addr: 0,
            remote_key: fabric_core::RemoteKey(0),
            imm,
            read: false,
            posted: false,
            host: false,
            followers: Followers::default(),
        })
    }

    fn post_recv(&mut self, wr_id: WorkRequestId, dst: LocalSlice) -> Result<PostOutcome> {
        self.local_range(dst, Access::LOCAL_WRITE)?;
        self.submit(Op {
            wr_id,
            kind: OpKind::Recv,
            peer: None,
            local: dst.key,
            offset: dst.offset,
            len: dst.len,
            remote_addr: 0,
            remote_key: fabric_core::RemoteKey(0),
            imm: None,
            read: false,
            posted: false,
            host: false,
            followers: Followers::default(),
        })
    }

    /// `fi_writemsg` of one local iovec into one remote range. Its completion means
    /// *placed*: the bytes are in the peer's memory (FI_DELIVERY_COMPLETE, every provider;
    /// a zero-length write, which places nothing, asks for no more than the provider's
    /// default). A failure at the peer (unknown key, no permission, out of its range)
    /// fails this write. With `imm`, the peer's CQ reports it (FI_REMOTE_CQ_DATA) once
    /// this write's bytes have landed; writes posted earlier are not ordered before it
    /// unless they completed first (efa orders nothing), which is why the engine sends a
    /// transfer's immediate value only after its other writes completed.
    fn post_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        self.peer(peer)?;
        self.check_imm(imm)?;
        fabric_core::check_write_lengths(&src, &dst)?;
        let host = self.local_range(src, Access::NONE)?.host;
        let op = Op {
            wr_id,
            kind: OpKind::Write,
            peer: Some(peer),
            local: src.key,
            offset: src.offset,
            len: src.len,
            remote_addr: dst.region.addr.wrapping_add(dst.offset),
            remote_key: dst.region.key,
            imm,
            read: false,
            posted: false,
            host,
            followers: Followers::default(),
        };
        self.submit_in_bounds(op, dst)
    }

    /// `fi_readmsg` of one remote range into one local iovec (registered with
    /// `LOCAL_WRITE`, which is FI_READ access; the owner's region needs `REMOTE_READ`,
    /// FI_REMOTE_READ). Its completion, an [`OpKind::Read`], means every byte is in the local region. A failure at the owner (key, permission,
    /// range) fails it.
    fn post_read(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        dst: LocalSlice,
        src: RemoteSlice,
    ) -> Result<PostOutcome> {
        self.peer(peer)?;
        fabric_core::check_read_lengths(&dst, &src)?;
        let host = self.local_range(dst, Access::LOCAL_WRITE)?.host;
        let op = Op {
            wr_id,
            kind: OpKind::Read,
            peer: Some(peer),
            local: dst.key,
            offset: dst.offset,
            len: dst.len,
            remote_addr: src.region.addr.wrapping_add(src.offset),
            remote_key: src.region.key,
            imm: None,
            read: true,
            posted: false,
            host,
            followers: Followers::default(),
        };
        self.submit_in_bounds(op, src)
    }

    fn supports_read(&self) -> bool {
        true
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        let before = out.len();
        if !self.backlogged.is_empty() {
            self.flush_backlogs();
        }
        out.extend(self.ready.drain(..));
        self.read_cq(out)?;
        Ok(out.len() - before)
    }

    /// Returns when the next [`poll`](Transport::poll) has completions to report, or after
    /// `timeout`. Where the provider has manual data progress and gives its CQ a wait
    /// descriptor (tcp here), this reads the CQ, which moves peers' bytes into our memory
    /// even when no completion results, and sleeps on the descriptor in between, so an
    /// idle engine (a target) keeps the provider progressing without spinning. Elsewhere
    /// it sleeps briefly, as the trait's default does.
    fn wait(&mut self, timeout: Duration) -> Result<()> {
        self.wait_for_progress(timeout)
    }

    fn waker(&mut self) -> Arc<dyn Wake> {
        self.wake.waker()
    }
}

#[cfg(test)]
mod registration_tests;
#[cfg(test)]
mod tests;
