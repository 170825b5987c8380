//! The hashes other formats' writers record of their files, computed as those writers compute
//! them, so an ingest can refuse a file that is not what its writer wrote.
//!
//! Owns: `hex_digest`, by the names Mosaic Streaming gives its algorithms (`sha1`, `sha224`,
//! `sha256`, `sha384`, `sha512`, `md5`, `blake2b`, `blake2s`, `xxh32`, `xxh64`, `xxh128`,
//! `xxh3_64`, `xxh3_128`), each in the text Python's `hexdigest()` gives (an xxHash as its
//! big-endian hex, with seed 0). Never: decides what a mismatch means (the source does), or
//! answers for an algorithm it does not compute (`sha3_*`: `None`).

use std::fmt::Write;

/// The lowercase hex digest of `data` by `algorithm`, or `None` for an algorithm not computed.
pub(super) fn hex_digest(algorithm: &str, data: &[u8]) -> Option<String> {
    use sha2::Digest as _;
    fn hex(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len() * 2);
        for byte in bytes {
            let _ = write!(out, "{byte:02x}");
        }
        out
    }
    Some(match algorithm {
        "sha1" => hex(&sha1::Sha1::digest(data)),
        "sha224" => hex(&sha2::Sha224::digest(data)),
        "sha256" => hex(&sha2::Sha256::digest(data)),
        "sha384" => hex(&sha2::Sha384::digest(data)),
        "sha512" => hex(&sha2::Sha512::digest(data)),
        "blake2b" => hex(&blake2::Blake2b512::digest(data)),
        "blake2s" => hex(&blake2::Blake2s256::digest(data)),
        "md5" => hex(&<md5::Md5 as md5::Digest>::digest(data)),
        "xxh32" => format!("{:08x}", twox_hash::XxHash32::oneshot(0, data)),
        "xxh64" => format!("{:016x}", twox_hash::XxHash64::oneshot(0, data)),
        "xxh3_64" => format!("{:016x}", twox_hash::XxHash3_64::oneshot(data)),
        "xxh128" | "xxh3_128" => format!("{:032x}", twox_hash::XxHash3_128::oneshot(data)),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::hex_digest;

    #[test]
    fn digests_are_the_ones_python_prints() {
        // hashlib and xxhash of b"abc", as Python's hexdigest() prints them.
        let cases = [
            ("sha1", "a9993e364706816aba3e25717850c26c9cd0d89d"),
            ("sha256", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
            ("md5", "900150983cd24fb0d6963f7d28e17f72"),
            ("blake2s", "508c5e8c327c14e2e1a72ba34eeb452f37458b209ed63a294d999b4c86675982"),
            ("xxh32", "32d153ff"),
            ("xxh64", "44bc2cf5ad770999"),
            ("xxh3_64", "78af5f94892f3950"),
            ("xxh128", "06b05ab6733a618578af5f94892f3950"),
        ];
        for (algorithm, expected) in cases {
            assert_eq!(hex_digest(algorithm, b"abc").as_deref(), Some(expected), "{algorithm}");
        }
        assert_eq!(hex_digest("sha3_256", b"abc"), None);
    }
}
