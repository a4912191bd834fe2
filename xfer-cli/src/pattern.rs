//! The bytes a bench writes: a function of (seed, offset), so the target can check any page
//! without receiving the source.

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `buf` with the pattern bytes at `offset..offset + buf.len()` (offset multiple of 8).
pub fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    debug_assert!(offset.is_multiple_of(8));
    let first = offset / 8;
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = mix(seed ^ (first + i as u64)).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Whether `buf` holds the pattern bytes of `offset`.
pub fn matches(seed: u64, offset: u64, buf: &[u8]) -> bool {
    let first = offset / 8;
    buf.chunks(8).enumerate().all(|(i, chunk)| {
        let w = mix(seed ^ (first + i as u64)).to_le_bytes();
        chunk == &w[..chunk.len()]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_position_dependent_and_checkable() {
        let mut a = vec![0u8; 4096];
        fill(7, 8192, &mut a);
        assert!(matches(7, 8192, &a));
        assert!(!matches(7, 0, &a));
        assert!(!matches(8, 8192, &a));
        let mut b = vec![0u8; 4096];
        fill(7, 8192 + 2048, &mut b[..2048]);
        assert_eq!(&a[2048..], &b[..2048]);
    }
}
