//! The wire form of an endpoint address.
//!
//! ```text
//! b"efa1" | provider name length (1 byte) | provider name | raw length (2 bytes, LE) | raw
//! ```
//!
//! `raw` is what `fi_getname` returned (16 bytes for tcp and sockets on IPv4, 32 on EFA).
//! The tag tells an address of this backend from another transport's (`tcp://...`), and
//! the provider name tells an `efa` address from a `tcp;ofi_rxm` one, so a mismatch is a
//! clear [`Error::InvalidAddress`] instead of a provider failing on foreign bytes.

use fabric_core::Error;

/// The first bytes of every address of this backend (format version 1).
pub const ADDRESS_TAG: &[u8; 4] = b"efa1";

/// Longest raw address accepted (providers' names are far shorter).
const MAX_RAW: usize = 1024;

/// Encodes a raw `fi_getname` address of `provider`.
pub(crate) fn encode(provider: &str, raw: &[u8]) -> Vec<u8> {
    let name = &provider.as_bytes()[..provider.len().min(255)];
    let mut out = Vec::with_capacity(ADDRESS_TAG.len() + 3 + name.len() + raw.len());
    out.extend_from_slice(ADDRESS_TAG);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(&(raw.len() as u16).to_le_bytes());
    out.extend_from_slice(raw);
    out
}

/// Splits an address into its provider name and raw bytes, checking its shape.
pub(crate) fn decode(bytes: &[u8]) -> Result<(&str, &[u8]), Error> {
    let bad = |why: String| Error::InvalidAddress(why);
    let rest = bytes.strip_prefix(ADDRESS_TAG.as_slice()).ok_or_else(|| {
        bad(format!(
            "not a libfabric (efa backend) address: it does not start with {:?}{}",
            String::from_utf8_lossy(ADDRESS_TAG),
            describe_foreign(bytes)
        ))
    })?;
    let (&name_len, rest) = rest
        .split_first()
        .ok_or_else(|| bad("truncated after the tag".into()))?;
    let name_len = name_len as usize;
    if rest.len() < name_len + 2 {
        return Err(bad("truncated provider name".into()));
    }
    let name = std::str::from_utf8(&rest[..name_len])
        .map_err(|_| bad("provider name is not UTF-8".into()))?;
    let rest = &rest[name_len..];
    let raw_len = u16::from_le_bytes([rest[0], rest[1]]) as usize;
    let raw = &rest[2..];
    if raw_len == 0 || raw_len > MAX_RAW || raw.len() != raw_len {
        return Err(bad(format!(
            "raw address of {} bytes where the header says {raw_len}",
            raw.len()
        )));
    }
    Ok((name, raw))
}

/// A hint at what a foreign address is, for the error message.
fn describe_foreign(bytes: &[u8]) -> String {
    match bytes.iter().position(|&b| b == b':') {
        Some(i) if i > 0 && i < 16 && bytes[..i].iter().all(u8::is_ascii_alphanumeric) => {
            format!(
                " (it looks like an address of the {:?} transport)",
                String::from_utf8_lossy(&bytes[..i])
            )
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let raw = [1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
        let a = encode("tcp;ofi_rxm", &raw);
        assert_eq!(decode(&a).unwrap(), ("tcp;ofi_rxm", &raw[..]));
    }

    #[test]
    fn rejects_foreign_and_damaged_addresses() {
        let e = decode(b"tcp://127.0.0.1:1").unwrap_err().to_string();
        assert!(e.contains("\"tcp\" transport"), "{e}");
        assert!(decode(b"\xff\x00garbage").is_err());
        assert!(decode(b"efa1").is_err());
        let a = encode("efa", &[7; 32]);
        assert!(decode(&a[..a.len() - 1]).is_err());
        let mut longer = a.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
        assert!(decode(&encode("efa", &[])).is_err());
    }
}
