//! Byte sizes on the command line: `4096`, `64KiB`, `1GiB`, `8GB`, `1.5MiB`.

/// Parses a size; binary units (KiB, MiB, GiB, TiB, and K/M/G/T) or decimal (KB, MB, GB, TB).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("{s:?} is not a size (try 4096, 64KiB, 1GiB)"));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u => {
            return Err(format!(
                "unknown unit {u:?} in {s:?} (use KiB, MiB, GiB, KB, MB, GB)"
            ));
        }
    };
    let v: f64 = num.parse().map_err(|_| format!("{s:?} is not a size"))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 / 2.0 {
        return Err(format!("{s:?} is out of range"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!("{s:?} is not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// Formats a size with a binary unit, for messages.
pub fn format_size(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{v}{}", UNITS[u])
    } else {
        format!("{v:.2}{}", UNITS[u])
    }
}

/// A size as the command line takes it back exactly: with a unit when that is exact
/// (`8MiB`), else in bytes (`1000000`).
pub fn exact(b: u64) -> String {
    let f = format_size(b);
    if parse_size(&f) == Ok(b) {
        f
    } else {
        b.to_string()
    }
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
        assert_eq!(parse_size("4k"), Ok(4096));
        assert!(parse_size("KiB").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("0.5").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert_eq!(format_size(65536), "64KiB");
        assert_eq!(format_size(1536), "1.50KiB");
    }
}
