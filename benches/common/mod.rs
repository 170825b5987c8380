//! What the benches share: their input bytes.

/// `len` pseudo-random bytes (xorshift), the same on every run: incompressible input that is
/// cheap to make.
pub(crate) fn data(len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}
