//! An MDS column's values: the encodings Streaming's writer names (`column_encodings`) and what
//! one value of each becomes, in a record of its own or as a sample's part (`ndarray` and `pil`
//! values as arrays of their dtype and shape, numbers as text or a 0-d `.npy`, lists of images
//! as one list part).
//!
//! Owns: `Encoding`, `Element`, `ndarray`, `value_into` and the layouts of `pil` and list values.
//! Never: reads a shard or the index (`mod.rs` does), decodes an image, or takes a value whose
//! sizes, shape or counts disagree with its bytes.

use crate::ingest::parts::{PartKind, push_npy, push_number_text, utf8_text};
use crate::shard::{Dtype, Layout};

/// How an MDS column's values are encoded (`column_encodings`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Encoding {
    Bytes,
    Str,
    /// `int`: an int64.
    Int,
    /// `uint8` ... `float64`: one number.
    Scalar(Dtype),
    /// `str_int`, `str_float`, `str_decimal`: a number's text.
    NumberText(PartKind),
    /// `ndarray[:dtype[:shape]]`.
    NdArray {
        dtype: Option<Dtype>,
        shape: Option<Vec<u64>>,
    },
    Json,
    Jpeg,
    Png,
    /// `pil`: a PIL image's raw pixels (`[width, height, mode length]` as `u32`s, the mode's
    /// name, then `Image.tobytes()`).
    Pil,
    /// `jpeg_array` (a `u32` count, each image's `u32` length, the JPEG files back to back) and
    /// `list[jpeg]`, `list[png]`, `list[pil]` (a `u32` Streaming reserves, then the same, each
    /// element as its own encoding writes it).
    List {
        element: Element,
        reserved_word: bool,
    },
}

/// What a list column's elements are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Element {
    Jpeg,
    Png,
    Pil,
}

impl Encoding {
    pub(super) fn parse(text: &str) -> std::result::Result<Self, String> {
        let scalar = |name: &str| -> Option<Dtype> {
            Some(match name {
                "uint8" => Dtype::U8,
                "uint16" => Dtype::U16,
                "uint32" => Dtype::U32,
                "uint64" => Dtype::U64,
                "int8" => Dtype::I8,
                "int16" => Dtype::I16,
                "int32" => Dtype::I32,
                "int64" => Dtype::I64,
                "float16" => Dtype::F16,
                "float32" => Dtype::F32,
                "float64" => Dtype::F64,
                _ => return None,
            })
        };
        Ok(match text {
            "bytes" => Encoding::Bytes,
            "str" => Encoding::Str,
            "int" => Encoding::Int,
            "str_int" => Encoding::NumberText(PartKind::Integer),
            "str_float" => Encoding::NumberText(PartKind::Float),
            "str_decimal" => Encoding::NumberText(PartKind::Decimal),
            "json" => Encoding::Json,
            "jpeg" => Encoding::Jpeg,
            "png" => Encoding::Png,
            "pil" => Encoding::Pil,
            "jpeg_array" | "jpegarray" => Encoding::List { element: Element::Jpeg, reserved_word: false },
            "list[jpeg]" => Encoding::List { element: Element::Jpeg, reserved_word: true },
            "list[png]" => Encoding::List { element: Element::Png, reserved_word: true },
            "list[pil]" => Encoding::List { element: Element::Pil, reserved_word: true },
            "pkl" => return Err("pkl (pickle runs code when it is read; Streaming refuses it by default too)".into()),
            other if other == "ndarray" || other.starts_with("ndarray:") => {
                let mut args = other.split(':').skip(1);
                let dtype = match args.next() {
                    None | Some("") => None,
                    Some(name) => Some(scalar(name).ok_or_else(|| format!("{other} (dtype {name})"))?),
                };
                let shape = match args.next() {
                    None => None,
                    Some(dims) => Some(
                        dims.split(',')
                            .map(|d| d.parse::<u64>().ok().filter(|&d| d > 0))
                            .collect::<Option<Vec<u64>>>()
                            .ok_or_else(|| format!("{other} (shape {dims})"))?,
                    ),
                };
                Encoding::NdArray { dtype, shape }
            }
            other => match scalar(other) {
                Some(dtype) => Encoding::Scalar(dtype),
                None => return Err(other.to_owned()),
            },
        })
    }

    /// The part kind it becomes in a sample.
    pub(super) fn part_kind(&self) -> PartKind {
        match self {
            Encoding::Bytes => PartKind::Bytes,
            Encoding::Str => PartKind::Text,
            Encoding::Int => PartKind::Integer,
            // A NumPy scalar (`np.uint8`, ...), as Streaming yields it: a 0-d array.
            Encoding::Scalar(_) => PartKind::Array,
            Encoding::NumberText(kind) => *kind,
            Encoding::NdArray { .. } | Encoding::Pil => PartKind::Array,
            Encoding::Json => PartKind::Json,
            Encoding::Jpeg => PartKind::Jpeg,
            Encoding::Png => PartKind::Png,
            Encoding::List { element: Element::Jpeg, .. } => PartKind::JpegList,
            Encoding::List { element: Element::Png, .. } => PartKind::PngList,
            Encoding::List { element: Element::Pil, .. } => PartKind::ArrayList,
        }
    }
}

/// An `ndarray` value: its dtype, its shape and its elements' bytes.
pub(super) fn ndarray<'a>(
    encoding: &Encoding,
    value: &'a [u8],
) -> std::result::Result<(Dtype, Vec<u64>, &'a [u8]), String> {
    let Encoding::NdArray { dtype, shape } = encoding else { return Err("not an ndarray".into()) };
    let mut at = 0;
    let dtype = match dtype {
        Some(dtype) => *dtype,
        None => {
            let code = *value.first().ok_or("an empty ndarray value")?;
            at = 1;
            match code {
                8 => Dtype::U8,
                9 => Dtype::I8,
                16 => Dtype::U16,
                17 => Dtype::I16,
                18 => Dtype::F16,
                32 => Dtype::U32,
                33 => Dtype::I32,
                34 => Dtype::F32,
                64 => Dtype::U64,
                65 => Dtype::I64,
                66 => Dtype::F64,
                other => return Err(format!("an ndarray of dtype code {other}")),
            }
        }
    };
    let shape = match shape {
        Some(shape) => shape.clone(),
        None => {
            let byte = *value.get(at).ok_or("an ndarray value without its shape")?;
            at += 1;
            let (ndim, width) = (usize::from(byte >> 2), 1usize << (byte & 3));
            let mut shape = Vec::with_capacity(ndim);
            for d in 0..ndim {
                let bytes = value.get(at + d * width..at + (d + 1) * width).ok_or("an ndarray's shape runs past it")?;
                let mut word = [0u8; 8];
                word[..width].copy_from_slice(bytes);
                shape.push(u64::from_le_bytes(word));
            }
            at += ndim * width;
            shape
        }
    };
    let elements = &value[at..];
    let expected = shape.iter().try_fold(dtype.size_bytes(), |n, &d| n.checked_mul(d));
    if expected != Some(elements.len() as u64) {
        return Err(format!("an ndarray of shape {shape:?} and {} bytes of elements", elements.len()));
    }
    Ok((dtype, shape, elements))
}

/// A `pil` value as an array: its dtype, its shape (`[height, width]`, and the channels when
/// there are several: what `np.asarray` makes of the image) and its pixels' bytes. Modes of
/// bytes per channel, `I;16` (little-endian `u16`), `I` (`i32`) and `F` (`f32`), as PIL lays
/// them out on a little-endian machine; bit-packed `1` and the rest are refused by name.
fn pil(value: &[u8]) -> std::result::Result<(Dtype, Vec<u64>, &[u8]), String> {
    let word = |i: usize| -> Option<u32> { Some(u32::from_le_bytes(value.get(4 * i..4 * i + 4)?.try_into().ok()?)) };
    let (Some(width), Some(height), Some(mode_len)) = (word(0), word(1), word(2)) else {
        return Err("an image value shorter than its header".into());
    };
    let pixels_at = 12 + usize::try_from(mode_len).map_err(|_| "an image's mode longer than memory")?;
    let mode = value
        .get(12..pixels_at)
        .and_then(|mode| std::str::from_utf8(mode).ok())
        .ok_or("an image's mode runs past it or is not text")?;
    let (dtype, channels) = match mode {
        "L" | "P" => (Dtype::U8, 1),
        "LA" | "La" | "PA" => (Dtype::U8, 2),
        "RGB" | "YCbCr" | "LAB" | "HSV" => (Dtype::U8, 3),
        "RGBA" | "RGBa" | "RGBX" | "CMYK" => (Dtype::U8, 4),
        "I;16" => (Dtype::U16, 1),
        "I" => (Dtype::I32, 1),
        "F" => (Dtype::F32, 1),
        other => return Err(format!("an image of mode {other:?} (not one array of one dtype: not ingested)")),
    };
    let pixels = &value[pixels_at..];
    let expected = u64::from(width) * u64::from(height) * channels * dtype.size_bytes();
    if pixels.len() as u64 != expected {
        return Err(format!("an image of {width} x {height} {mode} with {} bytes of pixels", pixels.len()));
    }
    let mut shape = vec![u64::from(height), u64::from(width)];
    if channels > 1 {
        shape.push(channels);
    }
    Ok((dtype, shape, pixels))
}

/// Appends what one column's value becomes: in a record of its own (`single`, of `layout`), or
/// as a sample's part.
pub(super) fn value_into(
    encoding: &Encoding,
    value: &[u8],
    single: bool,
    layout: &Layout,
    out: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    match encoding {
        Encoding::Int | Encoding::Scalar(_) => {
            let dtype = match *encoding {
                Encoding::Scalar(dtype) => dtype,
                _ => Dtype::I64,
            };
            if value.len() as u64 != dtype.size_bytes() {
                return Err(format!("{} bytes for one {dtype:?}", value.len()));
            }
            if single {
                out.extend_from_slice(value);
            } else if matches!(encoding, Encoding::Scalar(_)) {
                // A 0-d `.npy`: `granary.formats.decode` gives the NumPy scalar of its dtype.
                if !push_npy(dtype, &[], value, out) {
                    return Err(format!("a {dtype:?}, which NumPy has no type for"));
                }
            } else {
                push_number_text(dtype, value, out);
            }
        }
        Encoding::NdArray { .. } => {
            let (dtype, shape, elements) = ndarray(encoding, value)?;
            if single {
                if *layout != Layout::Arrays(dtype) {
                    return Err(format!("an array of {dtype:?} among arrays of another dtype"));
                }
                if shape.len() != 1 {
                    return Err(format!(
                        "an array of shape {shape:?} in a column of one-dimensional arrays (as its first sample's \
                         is): array records keep one dimension"
                    ));
                }
                out.extend_from_slice(elements);
            } else if !push_npy(dtype, &shape, elements, out) {
                return Err(format!("an array of {dtype:?}"));
            }
        }
        Encoding::Pil => {
            let (dtype, shape, pixels) = pil(value)?;
            if !push_npy(dtype, &shape, pixels, out) {
                return Err(format!("an image of {dtype:?}"));
            }
        }
        Encoding::List { element, reserved_word } => {
            let elements = list_elements(value, *reserved_word)?;
            if elements.is_empty() && !reserved_word {
                return Err("an empty jpeg_array (Streaming's reader refuses one)".into());
            }
            let mut converted = Vec::new();
            let elements: Vec<&[u8]> = match element {
                Element::Jpeg | Element::Png => elements,
                // Each image's pixels as `np.asarray` gives them, as a `pil` column's.
                Element::Pil => {
                    let mut ends = Vec::with_capacity(elements.len());
                    for (i, image) in elements.iter().enumerate() {
                        let (dtype, shape, pixels) = pil(image).map_err(|e| format!("image {i} of the list: {e}"))?;
                        if !push_npy(dtype, &shape, pixels, &mut converted) {
                            return Err(format!("image {i} of the list: an image of {dtype:?}"));
                        }
                        ends.push(converted.len());
                    }
                    let mut start = 0;
                    ends.iter()
                        .map(|&end| {
                            let array = &converted[start..end];
                            start = end;
                            array
                        })
                        .collect()
                }
            };
            out.extend_from_slice(&(elements.len() as u32).to_le_bytes());
            for element in &elements {
                let length = u32::try_from(element.len()).map_err(|_| "a list element of 4 GiB or more")?;
                out.extend_from_slice(&length.to_le_bytes());
            }
            for element in elements {
                out.extend_from_slice(element);
            }
        }
        // Streaming decodes these from UTF-8 (`json.loads`, `int`, `Decimal` of the text).
        Encoding::Str | Encoding::NumberText(_) | Encoding::Json => {
            utf8_text(value)?;
            out.extend_from_slice(value);
        }
        Encoding::Bytes | Encoding::Jpeg | Encoding::Png => out.extend_from_slice(value),
    }
    Ok(())
}

/// The elements of a list value (after Streaming's reserved `u32`, when it writes one): its count
/// and lengths checked against the value before anything is sized by them; they end where the
/// value does.
fn list_elements(value: &[u8], reserved_word: bool) -> std::result::Result<Vec<&[u8]>, String> {
    let value = if reserved_word { value.get(4..).ok_or("a list value shorter than its header")? } else { value };
    let word = |i: usize| -> Option<u32> { Some(u32::from_le_bytes(value.get(4 * i..4 * i + 4)?.try_into().ok()?)) };
    let count = word(0).ok_or("a list value shorter than its count")? as usize;
    if count > value.len() / 4 {
        return Err(format!("a list of {count} elements in {} bytes", value.len()));
    }
    let mut at = 4 + 4 * count;
    let mut elements = Vec::with_capacity(count);
    for i in 0..count {
        let length = word(1 + i).ok_or("a list value shorter than its lengths")? as usize;
        let element = at
            .checked_add(length)
            .and_then(|end| value.get(at..end))
            .ok_or_else(|| format!("element {i} of the list runs past its value"))?;
        elements.push(element);
        at += length;
    }
    if at != value.len() {
        return Err(format!("a list whose elements end at byte {at} of its {} bytes", value.len()));
    }
    Ok(elements)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ndarray_values_of_each_form_are_read_and_bad_ones_refused() {
        let dynamic = Encoding::parse("ndarray").unwrap();
        // int32 (code 33), 2 dims of one-byte sizes (2 << 2 | 0), shape (1, 2), elements.
        let value = [33, 8, 1, 2, 1, 0, 0, 0, 2, 0, 0, 0];
        let (dtype, shape, elements) = ndarray(&dynamic, &value).unwrap();
        assert_eq!((dtype, shape, elements.len()), (Dtype::I32, vec![1, 2], 8));
        assert!(ndarray(&dynamic, &value[..11]).unwrap_err().contains("shape [1, 2]"));
        assert!(ndarray(&dynamic, &[200, 4, 1, 0]).unwrap_err().contains("dtype code 200"));
        assert!(ndarray(&dynamic, &[]).is_err());
        let fixed = Encoding::parse("ndarray:uint16:2,3").unwrap();
        assert_eq!(ndarray(&fixed, &[0; 12]).unwrap().1, [2, 3]);
        assert!(ndarray(&fixed, &[0; 11]).is_err());
        for bad in ["pkl", "ndarray:complex64", "ndarray:int8:0", "list[str]", "list[jpeg"] {
            assert!(Encoding::parse(bad).is_err(), "{bad}");
        }
        for cut in 0..value.len() {
            let _ = ndarray(&dynamic, &value[..cut]);
        }
    }

    #[test]
    fn pil_images_become_arrays_of_their_mode_and_bad_ones_are_refused() {
        let image = |width: u32, height: u32, mode: &str, pixels: usize| {
            let mut value = [width, height, mode.len() as u32].map(u32::to_le_bytes).concat();
            value.extend_from_slice(mode.as_bytes());
            value.extend((0..pixels).map(|i| i as u8));
            value
        };
        let rgb = image(5, 3, "RGB", 45);
        let (dtype, shape, pixels) = pil(&rgb).unwrap();
        assert_eq!((dtype, shape, pixels.len()), (Dtype::U8, vec![3, 5, 3], 45));
        assert_eq!(pil(&image(5, 3, "L", 15)).unwrap().1, [3, 5]);
        assert_eq!(pil(&image(2, 2, "I;16", 8)).unwrap().0, Dtype::U16);
        assert_eq!(pil(&image(2, 2, "F", 16)).unwrap().0, Dtype::F32);
        assert!(pil(&image(5, 3, "RGB", 44)).is_err());
        assert!(pil(&image(8, 1, "1", 1)).unwrap_err().contains("mode \"1\""));
        for cut in 0..rgb.len() {
            assert!(pil(&rgb[..cut]).is_err(), "{cut} bytes");
        }
    }
}
