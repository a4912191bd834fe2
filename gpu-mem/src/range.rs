//! Pure arithmetic on ranges and identifiers: bounds checks, page rounding, PCI bus ids.
//! Nothing here touches the driver, so all of it is tested on machines without a GPU.

use crate::error::GpuMemError;

/// Checks that `offset..offset+len` lies inside `size` bytes, without overflow.
pub(crate) fn check_range(offset: u64, len: u64, size: u64) -> Result<(), GpuMemError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(GpuMemError::OutOfBounds { offset, len, size }),
    }
}

/// Checks a range against a buffer of `size` bytes and returns `offset` as a `usize`.
pub(crate) fn checked_offset(offset: u64, len: usize, size: usize) -> Result<usize, GpuMemError> {
    check_range(offset, len as u64, size as u64)?;
    // offset <= size, and size is a usize, so the conversion is lossless.
    Ok(offset as usize)
}

/// The page-aligned span `[start, end)` that covers `addr..addr+len`, and the offset of `addr`
/// inside it; `None` on overflow. `page` must be a power of two.
pub(crate) fn page_span(addr: u64, len: u64, page: u64) -> Option<(u64, u64, u64)> {
    debug_assert!(page.is_power_of_two());
    let start = addr & !(page - 1);
    let end = addr.checked_add(len)?.checked_add(page - 1)? & !(page - 1);
    Some((start, end, addr - start))
}

/// Normalises a PCI bus id as the driver prints it (`00000000:18:00.0`, upper-case hex) to
/// the form the topology crate uses: 4-digit domain, lower-case (`0000:18:00.0`).
/// Returns the input, lower-cased and trimmed, when it does not parse.
pub(crate) fn normalize_pci_bus_id(raw: &str) -> String {
    let raw = raw.trim().trim_end_matches('\0').to_ascii_lowercase();
    let parse = || -> Option<String> {
        let (domain, rest) = raw.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (dev, func) = rest.split_once('.')?;
        let domain = u32::from_str_radix(domain, 16).ok()?;
        let bus = u8::from_str_radix(bus, 16).ok()?;
        let dev = u8::from_str_radix(dev, 16).ok()?;
        let func = u8::from_str_radix(func, 16).ok()?;
        Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
    };
    parse().unwrap_or(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_inside_pass_and_outside_fail() {
        assert!(check_range(0, 0, 0).is_ok());
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(10, 0, 10).is_ok());
        assert!(check_range(9, 1, 10).is_ok());
        assert_eq!(
            check_range(9, 2, 10),
            Err(GpuMemError::OutOfBounds {
                offset: 9,
                len: 2,
                size: 10
            })
        );
        assert!(check_range(11, 0, 10).is_err());
        assert!(check_range(0, 1, 0).is_err());
    }

    #[test]
    fn overflowing_ranges_fail_instead_of_wrapping() {
        assert!(check_range(u64::MAX, 1, u64::MAX).is_err());
        assert!(check_range(1, u64::MAX, u64::MAX).is_err());
        assert!(check_range(u64::MAX, 0, u64::MAX).is_ok());
        assert!(checked_offset(u64::MAX, 1, usize::MAX).is_err());
        assert_eq!(checked_offset(4, 4, 8), Ok(4));
    }

    #[test]
    fn page_span_covers_the_range() {
        assert_eq!(page_span(0, 4096, 4096), Some((0, 4096, 0)));
        assert_eq!(page_span(0x1200, 10, 4096), Some((0x1000, 0x2000, 0x200)));
        assert_eq!(
            page_span(0x1200, 0x1000, 4096),
            Some((0x1000, 0x3000, 0x200))
        );
        assert_eq!(page_span(0x2000, 1, 4096), Some((0x2000, 0x3000, 0)));
        assert_eq!(page_span(u64::MAX - 10, 100, 4096), None);
    }

    #[test]
    fn pci_bus_ids_are_normalised() {
        assert_eq!(normalize_pci_bus_id("00000000:18:00.0"), "0000:18:00.0");
        assert_eq!(normalize_pci_bus_id("0000:9A:00.0"), "0000:9a:00.0");
        assert_eq!(normalize_pci_bus_id("0001:0A:1F.3\0"), "0001:0a:1f.3");
        assert_eq!(normalize_pci_bus_id("garbage"), "garbage");
    }
}
