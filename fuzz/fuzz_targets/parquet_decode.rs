//! Fuzzes the Parquet reader: the `.parquet` files of a directory (footers, pages, encodings,
//! codecs) give records or an error, and never a panic, a hang, or an allocation past what the
//! files allow. The flags choose the columns among `a` ... `h` (bit i: the i-th letter; none:
//! a file's only column), as `--column` would; nulls are skipped on odd inputs, refused on even.
#![no_main]

use granary::ingest::{Nulls, ParquetInput, records_from_parquet};
use granary_fuzz::{Count, unpack};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (dir, flags) = unpack(data);
    let columns: Vec<String> =
        (0..8u8).filter(|i| flags & (1 << i) != 0).map(|i| char::from(b'a' + i).to_string()).collect();
    let nulls = if data.len() % 2 == 1 { Nulls::Skip } else { Nulls::Refuse };
    let Ok(input) = ParquetInput::open(&[dir.display().to_string()], &columns, nulls) else { return };
    let mut count = Count::default();
    let _ = records_from_parquet(&mut count, &input, &());
});
