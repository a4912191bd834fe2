//! Pinning the calling thread to a CPU and steering its memory to a NUMA
//! node, with raw Linux system calls (no hwloc topology needed).

use std::io;

use crate::TopologyError;

/// Bits in the masks we hand the kernel: glibc's `CPU_SETSIZE`, which is
/// also far above any NUMA node count we expect.
const MASK_BITS: u32 = 1024;
/// Bits per mask word.
const WORD_BITS: u32 = libc::c_ulong::BITS;
/// Words per mask.
const MASK_WORDS: usize = (MASK_BITS / WORD_BITS) as usize;

/// A mask with only bit `bit` set; `bit < MASK_BITS`.
fn single_bit_mask(bit: u32) -> [libc::c_ulong; MASK_WORDS] {
    let mut mask = [0; MASK_WORDS];
    // Lossless: bit / WORD_BITS < MASK_WORDS, which is small.
    mask[(bit / WORD_BITS) as usize] = 1 << (bit % WORD_BITS);
    mask
}

/// Pins the calling thread to one CPU: the Linux CPU number (hwloc PU OS
/// index) such as [`WorkerPlacement::core`](crate::WorkerPlacement::core).
///
/// Call it at the start of a worker thread, before opening its transports
/// and touching its buffers, so that the provider's queues and first-touch
/// pages land on the CPU's NUMA node.
///
/// # Errors
/// [`TopologyError::CpuOutOfRange`] for a CPU number of 1024 or more,
/// [`TopologyError::PinThread`] when the kernel refuses it (no such CPU,
/// offline, or outside this process's cpuset).
pub fn pin_current_thread(cpu: u32) -> Result<(), TopologyError> {
    if cpu >= MASK_BITS {
        return Err(TopologyError::CpuOutOfRange {
            cpu,
            limit: MASK_BITS,
        });
    }
    pin_with_syscall(cpu).map_err(|source| TopologyError::PinThread { cpu, source })
}

#[cfg(target_os = "linux")]
fn pin_with_syscall(cpu: u32) -> io::Result<()> {
    let mask = single_bit_mask(cpu);
    // SAFETY: pid 0 is the calling thread; the pointer and length describe
    // `mask`, a live, initialised array of `size_of_val(&mask)` bytes (128,
    // the size of `cpu_set_t`) that the kernel only reads; `c_ulong` words
    // are the layout and alignment of `cpu_set_t`.
    let rc = unsafe {
        libc::sched_setaffinity(
            0,
            size_of_val(&mask),
            mask.as_ptr().cast::<libc::cpu_set_t>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_with_syscall(_cpu: u32) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

/// Makes the calling thread's future allocations prefer one NUMA node
/// (`set_mempolicy(MPOL_PREFERRED)`): pages come from `node` while it has
/// free memory, and from elsewhere instead of failing when it has not.
/// Already touched pages do not move.
///
/// # Errors
/// [`TopologyError::NumaNodeOutOfRange`] for a node number of 1024 or more,
/// [`TopologyError::BindMemory`] when the kernel refuses it (no such node,
/// or a kernel built without NUMA support).
pub fn prefer_memory_node(node: u32) -> Result<(), TopologyError> {
    if node >= MASK_BITS {
        return Err(TopologyError::NumaNodeOutOfRange {
            node,
            limit: MASK_BITS,
        });
    }
    set_preferred_node(node).map_err(|source| TopologyError::BindMemory { node, source })
}

#[cfg(target_os = "linux")]
fn set_preferred_node(node: u32) -> io::Result<()> {
    /// `MPOL_PREFERRED` from `<linux/mempolicy.h>` (not in the libc crate).
    const MPOL_PREFERRED: libc::c_int = 1;
    let mask = single_bit_mask(node);
    // The kernel reads `maxnode - 1` bits (a long-standing off-by-one that
    // libnuma also compensates for).
    let maxnode = libc::c_ulong::from(MASK_BITS) + 1;
    // SAFETY: set_mempolicy(mode, nodemask, maxnode) reads `maxnode - 1`
    // bits, i.e. exactly the `MASK_BITS` bits of `mask`, a live initialised
    // array; it changes only the calling thread's memory policy.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            MPOL_PREFERRED,
            mask.as_ptr(),
            maxnode,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_preferred_node(_node: u32) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_set_one_bit() {
        let mask = single_bit_mask(0);
        assert_eq!(mask[0], 1);
        let mask = single_bit_mask(MASK_BITS - 1);
        assert_eq!(mask[MASK_WORDS - 1], 1 << (WORD_BITS - 1));
        assert_eq!(mask.iter().map(|word| word.count_ones()).sum::<u32>(), 1);
    }
}
