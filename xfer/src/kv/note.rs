//! The notification a KV transfer carries ([`KvNote`]): which request, which layer, and how
//! many such notifications make the layer whole at the receiver.

/// The immediate value of every KV notification (its bytes say the rest).
pub const KV_IMM: u32 = 0x6b76_0001;

/// The longest request id a KV notification carries.
pub const MAX_REQUEST_ID: usize = 1024;

const MAGIC: &[u8; 4] = b"xkv1";
const HEADER: usize = 4 + 1 + 4 + 4 + 4 + 2;

/// What a KV transfer's notification says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NoteKind {
    /// Prefill wrote a layer's share into decode's cache (a push).
    Landed,
    /// Decode read a layer's share from prefill's cache (a pull): prefill's blocks of it
    /// are free as far as this reader goes.
    Read,
}

/// One KV notification, as sent with a transfer's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvNote {
    /// Push or pull.
    pub kind: NoteKind,
    /// The request's id.
    pub request: Vec<u8>,
    /// The layer this transfer moved.
    pub layer: u32,
    /// Layers of the request.
    pub layers: u32,
    /// Transfers (from all peers) that make `layer` whole at the receiver.
    pub expected: u32,
}

impl KvNote {
    /// Its bytes: `xkv1`, kind, layer, layers, expected (little endian), the id's length
    /// and the id.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER + self.request.len());
        b.extend_from_slice(MAGIC);
        b.push(match self.kind {
            NoteKind::Landed => 0,
            NoteKind::Read => 1,
        });
        b.extend_from_slice(&self.layer.to_le_bytes());
        b.extend_from_slice(&self.layers.to_le_bytes());
        b.extend_from_slice(&self.expected.to_le_bytes());
        // Ids are at most MAX_REQUEST_ID bytes (checked where they enter).
        b.extend_from_slice(&(self.request.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.request);
        b
    }

    /// The note in `b`, or `None` for bytes that are not one (another message, or a
    /// malformed one: never a panic).
    pub fn decode(b: &[u8]) -> Option<KvNote> {
        if b.len() < HEADER || &b[..4] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let kind = match b[4] {
            0 => NoteKind::Landed,
            1 => NoteKind::Read,
            _ => return None,
        };
        let (layer, layers, expected) = (u32_at(5), u32_at(9), u32_at(13));
        let len = u16::from_le_bytes([b[17], b[18]]) as usize;
        if b.len() != HEADER + len || layer >= layers || expected == 0 {
            return None;
        }
        Some(KvNote {
            kind,
            request: b[HEADER..].to_vec(),
            layer,
            layers,
            expected,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_survives_its_bytes_and_garbage_is_no_note() {
        let n = KvNote {
            kind: NoteKind::Read,
            request: b"cmpl-42".to_vec(),
            layer: 3,
            layers: 32,
            expected: 2,
        };
        let b = n.encode();
        assert_eq!(KvNote::decode(&b), Some(n));
        for cut in 0..b.len() {
            assert_eq!(KvNote::decode(&b[..cut]), None, "cut at {cut}");
        }
        let mut bad = b.clone();
        bad[4] = 7;
        assert_eq!(KvNote::decode(&bad), None);
        let mut past = b.clone();
        past[5] = 40; // layer 40 of 32
        assert_eq!(KvNote::decode(&past), None);
        assert_eq!(KvNote::decode(b"request 7"), None);
    }
}
