//! Byte sizes on the command line (`4096`, `64KiB`, `1GiB`, `8GB`, `1.5MiB`) and in
//! messages (`64.0 KiB`, `4.3 GiB`), through `bytesize`.

use bytesize::ByteSize;

/// Parses a size: bytes, binary units (KiB, MiB, GiB, TiB) or decimal ones (KB, MB, GB, TB;
/// `K`, `M`, `G` alone are decimal too).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let b = s
        .trim()
        .parse::<ByteSize>()
        .map_err(|e| format!("{s:?} is not a size (try 4096, 64KiB, 1GiB): {e}"))?;
    // bytesize saturates what does not fit.
    if b.0 == u64::MAX {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(b.0)
}

/// Formats a size with a binary unit, for messages: `64.0 KiB`, `4.3 GiB`, `1000 B`.
pub fn format_size(b: u64) -> String {
    ByteSize(b).display().iec().to_string()
}

/// A size as the command line takes it back exactly: with a binary unit when it is a whole
/// number of them (`8MiB`), else in bytes (`1000000`).
pub fn exact(b: u64) -> String {
    [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
        .into_iter()
        .find(|(_, unit)| b > 0 && b.is_multiple_of(*unit))
        .map_or_else(
            || b.to_string(),
            |(name, unit)| format!("{}{name}", b / unit),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("8GB"), Ok(8_000_000_000));
        assert_eq!(parse_size("1.5MiB"), Ok(3 << 19));
        assert!(parse_size("KiB").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert_eq!(format_size(65536), "64.0 KiB");
        assert_eq!(format_size(4_593_090_560), "4.3 GiB");
        for b in [1 << 30, 8 << 20, 32 << 10, 1_000_000, 1000, 0] {
            assert_eq!(parse_size(&exact(b)), Ok(b), "{}", exact(b));
        }
        assert_eq!(exact(8 << 20), "8MiB");
        assert_eq!(exact(1_000_000), "1000000");
    }
}
