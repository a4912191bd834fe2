//! What the transport takes from a provider's attributes, decided in one place so that the
//! attributes p5's `efa` provider publishes can be checked here without the hardware.
//!
//! From the `fi_info` entry the endpoint is opened from: who picks memory keys
//! (FI_MR_PROV_KEY), how peers address a region (FI_MR_VIRT_ADDR: by virtual address; else
//! by offset), whether local buffers need descriptors (FI_MR_LOCAL) and registrations an
//! endpoint binding (FI_MR_ENDPOINT), how much immediate data a write can carry
//! (`cq_data_size`: 4 bytes are enough, and SENDs tag theirs only where there are 8), the
//! largest write (`max_msg_size`: the engine's planner cuts longer writes), and that one
//! iovec per side fits (`iov_limit`, `rma_iov_limit`). We never inject, so `inject_size`
//! only matters as a limit we stay under.

use crate::info::ProviderInfo;
use fabric_core::{Error, Result, TransportLimits};
use libfabric_sys as sys;

/// The decisions (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Policy {
    /// The provider picks keys (`fi_mr_key`), else we request unique ones.
    pub provider_keys: bool,
    /// Peers address a region by its virtual address, else by offset (descriptor addr 0).
    pub virtual_addresses: bool,
    /// Registrations are bound to the endpoint and enabled.
    pub bind_to_endpoint: bool,
    /// Immediate data (4 bytes) can ride on writes and sends.
    pub imm: bool,
    /// SENDs carry tagged 8-byte CQ data (see `post::SEND_IMM`).
    pub tag_sends: bool,
    /// The largest single write or message.
    pub max_msg_size: u64,
}

impl Policy {
    /// Decides for a provider with these attributes and `mr_mode` bits; refuses one whose
    /// limits cannot carry one iovec per side.
    pub(crate) fn of(p: &ProviderInfo, mr_mode: u64) -> Result<Policy> {
        if p.iov_limit == 0 || p.rma_iov_limit == 0 {
            return Err(Error::Unsupported(format!(
                "provider {} reports iov_limit {} / rma_iov_limit {}: every operation needs one \
                 iovec on each side",
                p.provider, p.iov_limit, p.rma_iov_limit
            )));
        }
        if p.max_msg_size == 0 {
            return Err(Error::Unsupported(format!(
                "provider {} reports max_msg_size 0",
                p.provider
            )));
        }
        Ok(Policy {
            provider_keys: mr_mode & sys::FI_MR_PROV_KEY != 0,
            virtual_addresses: mr_mode & sys::FI_MR_VIRT_ADDR != 0,
            bind_to_endpoint: mr_mode & sys::FI_MR_ENDPOINT != 0,
            imm: p.cq_data_size >= 4,
            tag_sends: p.cq_data_size >= 8,
            max_msg_size: p.max_msg_size,
        })
    }

    /// The address peers put in a write to byte 0 of a region at `base`.
    pub(crate) fn remote_addr(&self, base: u64) -> u64 {
        if self.virtual_addresses { base } else { 0 }
    }

    /// The limits the engine plans with (`tx_size` operations in flight).
    pub(crate) fn limits(&self, tx_size: usize, busy_poll: bool) -> TransportLimits {
        TransportLimits {
            max_msg_size: self.max_msg_size,
            max_outstanding: tx_size.max(1),
            write_imm: self.imm,
            busy_poll,
            strided_writes: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::info::{Progress, mr_mode_names};
    use fabric_core::plan::{Segment, plan_transfer};
    use fabric_core::{LocalKey, RemoteKey, RemoteRegion};

    /// The `efa` provider on p5 as `fi_info` shows it (published with the reference demo,
    /// libfabric 2.0): RDM, mr_mode VIRT_ADDR | ALLOCATED | PROV_KEY | HMEM, rma_iov_limit 1,
    /// iov_limit 4, cq_data_size 4, inject_size 4096, max_msg_size about 1 GiB.
    fn p5_efa() -> (ProviderInfo, u64) {
        let mr_mode =
            sys::FI_MR_VIRT_ADDR | sys::FI_MR_ALLOCATED | sys::FI_MR_PROV_KEY | sys::FI_MR_HMEM;
        let info = ProviderInfo {
            provider: "efa".into(),
            fabric: "efa".into(),
            domain: "rdmap79s0-rdm".into(),
            mr_mode: mr_mode_names(mr_mode),
            mr_key_size: 4,
            cq_data_size: 4,
            max_msg_size: (1 << 30) - 64,
            iov_limit: 4,
            rma_iov_limit: 1,
            inject_size: 4096,
            data_progress: Progress::Auto,
            control_progress: Progress::Auto,
            tx_size: 4096,
            rx_size: 8192,
            hmem: true,
        };
        (info, mr_mode)
    }

    #[test]
    fn p5_efa_keys_come_from_the_provider_and_addresses_are_virtual() {
        let (info, mr_mode) = p5_efa();
        let p = Policy::of(&info, mr_mode).unwrap();
        assert!(p.provider_keys, "PROV_KEY: fi_mr_key gives the key");
        assert!(p.virtual_addresses);
        assert_eq!(p.remote_addr(0x7f00_dead_0000), 0x7f00_dead_0000);
        assert!(!p.bind_to_endpoint, "no FI_MR_ENDPOINT on efa");
    }

    #[test]
    fn p5_efa_carries_four_bytes_of_immediate_data_and_sends_are_untagged() {
        let (info, mr_mode) = p5_efa();
        let p = Policy::of(&info, mr_mode).unwrap();
        assert!(p.imm && p.limits(info.tx_size, false).write_imm);
        assert!(
            !p.tag_sends,
            "4 bytes of CQ data leave no room for the send tag"
        );
    }

    #[test]
    fn p5_efa_writes_are_split_at_the_providers_maximum() {
        let (info, mr_mode) = p5_efa();
        let limits = Policy::of(&info, mr_mode)
            .unwrap()
            .limits(info.tx_size, false);
        let seg = Segment {
            src: LocalKey(1),
            src_offset: 0,
            dst: RemoteRegion {
                addr: 0x1000,
                len: 4 << 30,
                key: RemoteKey(9),
            },
            dst_offset: 0,
            len: 3 << 30,
        };
        let plan = plan_transfer(&[seg], limits.max_msg_size).unwrap();
        assert!(
            plan.writes.iter().all(|w| w.src.len <= info.max_msg_size),
            "every write fits max_msg_size"
        );
        assert_eq!(
            plan.writes.iter().map(|w| w.src.len).sum::<u64>(),
            3 << 30,
            "nothing lost in the split"
        );
        assert_eq!(plan.writes.len(), 4, "3 GiB at just under 1 GiB a write");
        assert_eq!(limits.max_outstanding, info.tx_size);
    }

    #[test]
    fn offsets_without_virt_addr_and_providers_without_iovecs_are_refused() {
        let (mut info, _) = p5_efa();
        let p = Policy::of(&info, sys::FI_MR_PROV_KEY).unwrap();
        assert_eq!(p.remote_addr(0x7f00_0000), 0, "offset addressing");
        info.rma_iov_limit = 0;
        let e = Policy::of(&info, 0).unwrap_err();
        assert!(e.to_string().contains("rma_iov_limit 0"), "{e}");
    }
}
