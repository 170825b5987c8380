//! Content ids: the BLAKE3 hash of a stored object's bytes, as distinct types per object kind.
//!
//! Owns: `ObjectId` (32 bytes, lowercase hex on screen and in file names), and the typed
//! wrappers `ShardId` and `ManifestId` so a manifest id can never be passed where a shard id is
//! meant. Never: reads files or hashes anything larger than it is handed.

use std::fmt;

/// Bytes in an object id (a BLAKE3 digest).
pub const ID_BYTES: usize = 32;

/// The BLAKE3 hash of an object's complete bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId([u8; ID_BYTES]);

impl ObjectId {
    /// The id of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// Wraps a finished BLAKE3 digest.
    pub fn from_hash(hash: blake3::Hash) -> Self {
        Self(*hash.as_bytes())
    }

    /// Wraps raw digest bytes.
    pub const fn from_bytes(bytes: [u8; ID_BYTES]) -> Self {
        Self(bytes)
    }

    /// The raw digest bytes.
    pub const fn as_bytes(&self) -> &[u8; ID_BYTES] {
        &self.0
    }

    /// Parses exactly 64 lowercase or uppercase hex digits.
    pub fn parse_hex(text: &str) -> Option<Self> {
        let text = text.as_bytes();
        if text.len() != 2 * ID_BYTES {
            return None;
        }
        let mut bytes = [0u8; ID_BYTES];
        for (byte, pair) in bytes.iter_mut().zip(text.chunks_exact(2)) {
            *byte = (hex_value(pair[0])? << 4) | hex_value(pair[1])?;
        }
        Some(Self(bytes))
    }

    /// The first `n_digits` hex digits, for tables meant for people.
    pub fn short(&self, n_digits: usize) -> String {
        let mut text = self.to_string();
        text.truncate(n_digits);
        text
    }
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.short(16))
    }
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub ObjectId);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }
    };
}

typed_id!(
    /// The BLAKE3 hash of a whole shard file.
    ShardId
);
typed_id!(
    /// The BLAKE3 hash of a whole manifest file: the identity of one dataset version.
    ManifestId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips() {
        let id = ObjectId::of(b"granary");
        let text = id.to_string();
        assert_eq!(text.len(), 64);
        assert_eq!(ObjectId::parse_hex(&text), Some(id));
        assert_eq!(ObjectId::parse_hex(&text.to_uppercase()), Some(id));
        assert_eq!(ObjectId::parse_hex(&text[1..]), None);
        assert_eq!(ObjectId::parse_hex(&format!("{}g", &text[1..])), None);
        assert_eq!(id.short(12), text[..12]);
    }
}
