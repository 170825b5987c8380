//! What the records of a shard (and of a dataset version) are: opaque bytes, WebDataset-style
//! samples, or fixed-size typed records with a dtype and a shape.
//!
//! Owns: `Dtype`, `FixedLayout`, `Layout` and the 80-byte layout encoding shared by the shard
//! header and the manifest. Invariant: a decoded `Layout` is valid (known dtype, non-zero dims,
//! record size that fits in a u64), so code past the decoder never re-checks it. Never: reads a
//! record or a file (a layout only says what the records are).

use std::fmt;

use crate::error::FormatError;

/// Dimensions a fixed-size record's shape may have.
pub const SHAPE_DIMS_MAX: usize = 8;
/// Bytes of the encoded layout.
pub const LAYOUT_BYTES: usize = 80;
/// The largest fixed record accepted: 1 GiB. Larger records belong in the opaque layout.
pub const FIXED_RECORD_BYTES_MAX: u64 = 1 << 30;

/// The element type of fixed-size records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dtype {
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 16-bit integer (token ids of vocabularies up to 65536).
    U16,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
}

impl Dtype {
    /// Every dtype, in code order.
    pub const ALL: [Dtype; 12] = [
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::U32,
        Dtype::I32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::F64,
    ];

    /// Bytes of one element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// The lowercase name used on the command line and by numpy/torch ("bf16" is torch's).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::U8 => "u8",
            Dtype::I8 => "i8",
            Dtype::U16 => "u16",
            Dtype::I16 => "i16",
            Dtype::U32 => "u32",
            Dtype::I32 => "i32",
            Dtype::U64 => "u64",
            Dtype::I64 => "i64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
        }
    }

    /// Parses a name as printed by [`Dtype::name`].
    pub fn from_name(name: &str) -> Option<Dtype> {
        if let Some(dtype) = Self::ALL.into_iter().find(|dtype| dtype.name() == name) {
            return Some(dtype);
        }
        // NumPy's and PyTorch's names, so the CLI and Python take the same spellings.
        Some(match name.strip_prefix("torch.").unwrap_or(name) {
            "uint8" => Dtype::U8,
            "int8" => Dtype::I8,
            "uint16" => Dtype::U16,
            "int16" => Dtype::I16,
            "uint32" => Dtype::U32,
            "int32" => Dtype::I32,
            "uint64" => Dtype::U64,
            "int64" => Dtype::I64,
            "float16" | "half" => Dtype::F16,
            "bfloat16" => Dtype::Bf16,
            "float32" | "float" => Dtype::F32,
            "float64" | "double" => Dtype::F64,
            _ => return None,
        })
    }

    const fn code(self) -> u8 {
        match self {
            Dtype::U8 => 1,
            Dtype::I8 => 2,
            Dtype::U16 => 3,
            Dtype::I16 => 4,
            Dtype::U32 => 5,
            Dtype::I32 => 6,
            Dtype::U64 => 7,
            Dtype::I64 => 8,
            Dtype::F16 => 9,
            Dtype::Bf16 => 10,
            Dtype::F32 => 11,
            Dtype::F64 => 12,
        }
    }

    fn from_code(code: u8) -> Option<Dtype> {
        Self::ALL.into_iter().find(|dtype| dtype.code() == code)
    }
}

/// The type of fixed-size records: every record is one dense array of `shape` elements.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FixedLayout {
    dtype: Dtype,
    dims: Vec<u64>,
    record_bytes: u64,
}

impl FixedLayout {
    /// A fixed layout; fails for zero dims, too many dims or a record over 1 GiB.
    pub fn new(dtype: Dtype, dims: &[u64]) -> Result<Self, FormatError> {
        if dims.len() > SHAPE_DIMS_MAX {
            return Err(FormatError::Inconsistent {
                field: "shape",
                detail: format!("{} dims, at most {SHAPE_DIMS_MAX}", dims.len()),
            });
        }
        let mut record_bytes = dtype.size_bytes();
        for &dim in dims {
            if dim == 0 {
                return Err(FormatError::Inconsistent { field: "shape", detail: "a dim of 0".to_owned() });
            }
            record_bytes =
                record_bytes.checked_mul(dim).filter(|&bytes| bytes <= FIXED_RECORD_BYTES_MAX).ok_or_else(|| {
                    FormatError::Inconsistent {
                        field: "shape",
                        detail: format!("record larger than {FIXED_RECORD_BYTES_MAX} bytes"),
                    }
                })?;
        }
        Ok(Self { dtype, dims: dims.to_vec(), record_bytes })
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Shape of one record.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// Bytes of one record: the dtype size times the product of the dims.
    pub fn record_bytes(&self) -> u64 {
        self.record_bytes
    }
}

/// What the records of a shard or dataset version are.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Opaque variable-length byte strings (one file per record, for example).
    Bytes,
    /// Variable-length WebDataset samples in the sample encoding (see `shard::sample`).
    Samples,
    /// Fixed-size typed records: a batch is one dense array.
    Fixed(FixedLayout),
    /// Variable-length one-dimensional arrays of one dtype (token documents, as Megatron-LM's
    /// indexed datasets hold them): a record is a whole number of elements.
    Arrays(Dtype),
}

const KIND_BYTES: u8 = 1;
const KIND_SAMPLES: u8 = 2;
const KIND_FIXED: u8 = 3;
const KIND_ARRAYS: u8 = 4;

impl Layout {
    /// Bytes of every record, for the fixed layout.
    pub fn record_bytes(&self) -> Option<u64> {
        match self {
            Layout::Fixed(fixed) => Some(fixed.record_bytes()),
            Layout::Bytes | Layout::Samples | Layout::Arrays(_) => None,
        }
    }

    /// What a variable-length record's length must be a multiple of: the element size of
    /// arrays, 1 otherwise.
    pub fn element_bytes(&self) -> u64 {
        match self {
            Layout::Arrays(dtype) => dtype.size_bytes(),
            Layout::Fixed(fixed) => fixed.dtype.size_bytes(),
            Layout::Bytes | Layout::Samples => 1,
        }
    }

    /// Whether records carry their own length in the shard's record index.
    pub fn is_variable(&self) -> bool {
        !matches!(self, Layout::Fixed(_))
    }

    /// Encodes the layout into its 80 bytes:
    /// kind u8, dtype u8, ndim u8, 5 zero bytes, record_bytes u64, 8 dims u64 (arrays: kind and
    /// dtype, the rest zero).
    pub fn encode(&self) -> [u8; LAYOUT_BYTES] {
        let mut out = [0u8; LAYOUT_BYTES];
        match self {
            Layout::Bytes => out[0] = KIND_BYTES,
            Layout::Samples => out[0] = KIND_SAMPLES,
            Layout::Arrays(dtype) => {
                out[0] = KIND_ARRAYS;
                out[1] = dtype.code();
            }
            Layout::Fixed(fixed) => {
                out[0] = KIND_FIXED;
                out[1] = fixed.dtype.code();
                out[2] = u8::try_from(fixed.dims.len()).expect("FixedLayout::new caps dims at 8");
                out[8..16].copy_from_slice(&fixed.record_bytes.to_le_bytes());
                for (slot, dim) in out[16..].chunks_exact_mut(8).zip(&fixed.dims) {
                    slot.copy_from_slice(&dim.to_le_bytes());
                }
            }
        }
        out
    }

    /// Decodes and validates an encoded layout.
    pub fn decode(bytes: &[u8; LAYOUT_BYTES]) -> Result<Layout, FormatError> {
        let inconsistent = |detail: String| FormatError::Inconsistent { field: "layout", detail };
        let record_bytes = read_u64(bytes, 8);
        let dims: Vec<u64> = bytes[16..].chunks_exact(8).map(|d| read_u64(d, 0)).collect();
        if bytes[3..8].iter().any(|&b| b != 0) {
            return Err(inconsistent("reserved bytes are not zero".to_owned()));
        }
        match bytes[0] {
            KIND_BYTES | KIND_SAMPLES => {
                if bytes[1] != 0 || bytes[2] != 0 || record_bytes != 0 || dims.iter().any(|&d| d != 0) {
                    return Err(inconsistent("a variable layout with a dtype or shape".to_owned()));
                }
                Ok(if bytes[0] == KIND_BYTES { Layout::Bytes } else { Layout::Samples })
            }
            KIND_ARRAYS => {
                if bytes[2] != 0 || record_bytes != 0 || dims.iter().any(|&d| d != 0) {
                    return Err(inconsistent("an arrays layout with a shape".to_owned()));
                }
                let dtype = Dtype::from_code(bytes[1])
                    .ok_or_else(|| inconsistent(format!("unknown dtype code {}", bytes[1])))?;
                Ok(Layout::Arrays(dtype))
            }
            KIND_FIXED => {
                let dtype = Dtype::from_code(bytes[1])
                    .ok_or_else(|| inconsistent(format!("unknown dtype code {}", bytes[1])))?;
                let ndim = usize::from(bytes[2]);
                if ndim > SHAPE_DIMS_MAX || dims[ndim.min(SHAPE_DIMS_MAX)..].iter().any(|&d| d != 0) {
                    return Err(inconsistent(format!("bad shape rank {ndim}")));
                }
                let fixed = FixedLayout::new(dtype, &dims[..ndim])?;
                if fixed.record_bytes != record_bytes {
                    return Err(inconsistent(format!(
                        "record_bytes {record_bytes} but dtype and shape give {}",
                        fixed.record_bytes
                    )));
                }
                Ok(Layout::Fixed(fixed))
            }
            kind => Err(inconsistent(format!("unknown layout kind {kind}"))),
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::Bytes => f.write_str("bytes"),
            Layout::Samples => f.write_str("samples"),
            Layout::Arrays(dtype) => write!(f, "arrays {}", dtype.name()),
            Layout::Fixed(fixed) => {
                write!(f, "fixed {}[", fixed.dtype.name())?;
                for (i, dim) in fixed.dims.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{dim}")?;
                }
                write!(f, "] ({} B)", fixed.record_bytes)
            }
        }
    }
}

/// Reads a little-endian u64 at `at`; the caller has checked the length.
pub(crate) fn read_u64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// Reads a little-endian u32 at `at`; the caller has checked the length.
pub(crate) fn read_u32(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_round_trip() {
        let mut layouts = vec![Layout::Bytes, Layout::Samples];
        for dtype in Dtype::ALL {
            layouts.push(Layout::Fixed(FixedLayout::new(dtype, &[3, 1024]).unwrap()));
            layouts.push(Layout::Fixed(FixedLayout::new(dtype, &[]).unwrap()));
            layouts.push(Layout::Arrays(dtype));
            assert_eq!(Dtype::from_name(dtype.name()), Some(dtype));
        }
        for layout in layouts {
            assert_eq!(Layout::decode(&layout.encode()).unwrap(), layout);
        }
    }

    #[test]
    fn bad_layouts_are_refused() {
        assert!(FixedLayout::new(Dtype::U8, &[0]).is_err());
        assert!(FixedLayout::new(Dtype::U8, &[1; 9]).is_err());
        assert!(FixedLayout::new(Dtype::F64, &[1 << 20, 1 << 20]).is_err());
        let good = Layout::Fixed(FixedLayout::new(Dtype::U16, &[1024]).unwrap()).encode();
        for (at, value) in [(0, 9u8), (1, 99), (2, 9), (3, 1), (8, 7), (24, 1)] {
            let mut bad = good;
            bad[at] ^= value;
            assert!(Layout::decode(&bad).is_err(), "byte {at}");
        }
        let arrays = Layout::Arrays(Dtype::U16).encode();
        for (at, value) in [(1, 99u8), (2, 1), (8, 2), (16, 1)] {
            let mut bad = arrays;
            bad[at] ^= value;
            assert!(Layout::decode(&bad).is_err(), "arrays byte {at}");
        }
    }
}
