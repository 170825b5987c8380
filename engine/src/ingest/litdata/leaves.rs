//! LitData's leaf serializers: what `data_format` names (`str`, `int`, `numpy`, `tensor`, ...),
//! the tree spec that names the leaves (`data_spec`), an item's leaf bytes, and what one leaf
//! becomes in a record or a sample's part.
//!
//! Owns: `Serializer`, `leaf_names`, `leaves_of`, `array` (a NumPy or tensor leaf's dtype, shape
//! and elements) and `leaf_into`. Never: reads a file, unpickles (`pickle` is refused), takes
//! a leaf whose sizes run outside its item, or a `str` leaf that is not UTF-8.

use serde_json::Value;

use crate::ingest::parts::{PartKind, push_npy, push_number_text, utf8_text};
use crate::shard::{Dtype, Layout};

/// How one leaf was serialized (`data_format`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Serializer {
    /// `str`: UTF-8.
    Str,
    /// `bytes`.
    Bytes,
    /// `int`: an int64.
    Int,
    /// `float`: a float64.
    Float,
    /// `bool`: one byte.
    Bool,
    /// `no_header_numpy:I` / `no_header_tensor:I`: a 1-D array of one dtype.
    Flat(Dtype),
    /// `numpy`: dtype index, rank and dims as `u32`, then the elements.
    Numpy,
    /// `tensor`: dtype index and rank as big-endian `u32`, the dims likewise, then the elements.
    Tensor,
}

impl Serializer {
    pub(super) fn parse(text: &str) -> std::result::Result<Self, String> {
        let (name, arg) = match text.split_once(':') {
            Some((name, arg)) => (name, Some(arg)),
            None => (text, None),
        };
        let index = || arg.and_then(|a| a.parse::<u32>().ok()).ok_or_else(|| text.to_owned());
        Ok(match name {
            "str" => Serializer::Str,
            "bytes" => Serializer::Bytes,
            "int" => Serializer::Int,
            "float" => Serializer::Float,
            "bool" => Serializer::Bool,
            "no_header_numpy" => Serializer::Flat(numpy_dtype(index()?).ok_or_else(|| text.to_owned())?),
            "no_header_tensor" => Serializer::Flat(torch_dtype(index()?).ok_or_else(|| text.to_owned())?),
            "numpy" => Serializer::Numpy,
            "tensor" => Serializer::Tensor,
            "pickle" => return Err("pickle (it runs code when it is read)".into()),
            _ => return Err(text.to_owned()),
        })
    }

    pub(super) fn part_kind(&self) -> PartKind {
        match self {
            Serializer::Str => PartKind::Text,
            Serializer::Bytes => PartKind::Bytes,
            Serializer::Int => PartKind::Integer,
            Serializer::Bool => PartKind::Json,
            Serializer::Float => PartKind::Float,
            Serializer::Flat(_) | Serializer::Numpy | Serializer::Tensor => PartKind::Array,
        }
    }
}

/// NumPy's types in LitData's order of them (`_NUMPY_SCTYPES`).
fn numpy_dtype(index: u32) -> Option<Dtype> {
    Some(match index {
        0 => Dtype::I8,
        1 => Dtype::I16,
        2 => Dtype::I32,
        3 => Dtype::I64,
        4 => Dtype::U8,
        5 => Dtype::U16,
        6 => Dtype::U32,
        7 => Dtype::U64,
        8 => Dtype::F16,
        9 => Dtype::F32,
        10 => Dtype::F64,
        _ => return None,
    })
}

/// torch's types by LitData's index of them (`_TORCH_DTYPES_MAPPING`).
fn torch_dtype(index: u32) -> Option<Dtype> {
    Some(match index {
        0 | 1 => Dtype::F32,
        2 | 3 => Dtype::F64,
        8 | 9 => Dtype::F16,
        10 => Dtype::Bf16,
        11 => Dtype::U8,
        12 => Dtype::I8,
        13 | 14 => Dtype::I16,
        15 | 16 => Dtype::I32,
        17 | 18 => Dtype::I64,
        20 => Dtype::U16,
        _ => return None,
    })
}

/// Each leaf's bytes in one item of `leaves`.
pub(super) fn leaves_of<'a>(
    leaves: &[(String, Serializer)],
    item: &'a [u8],
) -> std::result::Result<Vec<&'a [u8]>, String> {
    let n = leaves.len();
    let mut at = 4 * n;
    if item.len() < at {
        return Err(format!("{} bytes, too few for its {n} sizes", item.len()));
    }
    let mut values = Vec::with_capacity(n);
    for (i, size) in item[..4 * n].chunks_exact(4).enumerate() {
        let size = u32::from_le_bytes([size[0], size[1], size[2], size[3]]) as usize;
        let end = at
            .checked_add(size)
            .filter(|&end| end <= item.len())
            .ok_or_else(|| format!("leaf {:?} runs past the item's {} bytes", leaves[i].0, item.len()))?;
        values.push(&item[at..end]);
        at = end;
    }
    Ok(values)
}

/// The names of the leaves of a torch pytree spec as LitData stores it (`treespec_dumps`): a
/// single leaf (""), or one dict, tuple or list of leaves (the dict's keys, the positions).
pub(super) fn leaf_names(spec: &str) -> std::result::Result<Vec<String>, String> {
    let value: Value = serde_json::from_str(spec).map_err(|e| format!("not JSON: {e}"))?;
    let tree = value.get(1).ok_or("not a [version, tree] pair")?;
    let children = tree.get("children_spec").and_then(Value::as_array).ok_or("a node without children_spec")?;
    let kind = tree.get("type").and_then(Value::as_str);
    if kind.is_none() {
        return Ok(vec![String::new()]);
    }
    if children.iter().any(|c| !c.get("type").is_none_or(Value::is_null)) {
        return Err("items nested more than one level deep are not ingested".into());
    }
    match kind {
        Some("builtins.dict" | "collections.OrderedDict") => {
            let context = tree.get("context").and_then(Value::as_str).ok_or("a dict without its keys")?;
            let keys: Vec<Value> = serde_json::from_str(context).map_err(|e| format!("the dict's keys: {e}"))?;
            let keys: Vec<String> = keys
                .iter()
                .map(|k| match k {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect();
            if keys.len() != children.len() {
                return Err(format!("{} keys for {} leaves", keys.len(), children.len()));
            }
            Ok(keys)
        }
        Some("builtins.tuple" | "builtins.list") => Ok((0..children.len()).map(|i| i.to_string()).collect()),
        Some(other) => Err(format!("items of type {other} are not ingested (a dict, tuple, list or one value are)")),
        None => Ok(vec![String::new()]),
    }
}

/// An array leaf: its dtype, shape and elements.
fn array<'a>(serializer: &Serializer, value: &'a [u8]) -> std::result::Result<(Dtype, Vec<u64>, &'a [u8]), String> {
    let word = |at: usize, big: bool| {
        value.get(at..at + 4).map(|b| {
            let b = [b[0], b[1], b[2], b[3]];
            if big { big_endian_u32(b) } else { u32::from_le_bytes(b) }
        })
    };
    let (dtype, shape, at) = match serializer {
        Serializer::Flat(dtype) => {
            let n = value.len() as u64 / dtype.size_bytes();
            (*dtype, vec![n], 0)
        }
        Serializer::Numpy | Serializer::Tensor => {
            let big = *serializer == Serializer::Tensor;
            let (index, rank) = (word(0, big).ok_or("a truncated header")?, word(4, big).ok_or("a truncated header")?);
            let dtype = if big { torch_dtype(index) } else { numpy_dtype(index) }
                .ok_or_else(|| format!("an array of dtype index {index}"))?;
            let rank = rank as usize;
            if rank > 32 {
                return Err(format!("an array of {rank} dimensions"));
            }
            let shape = (0..rank)
                .map(|d| word(8 + 4 * d, big).map(u64::from))
                .collect::<Option<Vec<u64>>>()
                .ok_or("a truncated shape")?;
            (dtype, shape, 8 + 4 * rank)
        }
        _ => return Err("not an array".into()),
    };
    let elements = &value[at..];
    let expected = shape.iter().try_fold(dtype.size_bytes(), |n, &d| n.checked_mul(d));
    if expected != Some(elements.len() as u64) {
        return Err(format!("an array of shape {shape:?} and {} bytes of elements", elements.len()));
    }
    Ok((dtype, shape, elements))
}

/// A big-endian `u32`: LitData's tensor header is written with struct's `>II`.
#[allow(clippy::big_endian_bytes, reason = "a foreign format's header, read as its writer wrote it")]
fn big_endian_u32(bytes: [u8; 4]) -> u32 {
    u32::from_be_bytes(bytes)
}

/// Appends what one leaf becomes: a record of its own (`single`, of `layout`), or a part.
pub(super) fn leaf_into(
    serializer: &Serializer,
    value: &[u8],
    single: bool,
    layout: &Layout,
    out: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    let number = |dtype: Dtype, out: &mut Vec<u8>| {
        if value.len() as u64 != dtype.size_bytes() {
            return Err(format!("{} bytes for one {dtype:?}", value.len()));
        }
        if single {
            out.extend_from_slice(value);
        } else {
            push_number_text(dtype, value, out);
        }
        Ok(())
    };
    match serializer {
        Serializer::Str => {
            utf8_text(value)?;
            out.extend_from_slice(value);
        }
        Serializer::Bytes => out.extend_from_slice(value),
        Serializer::Int => number(Dtype::I64, out)?,
        Serializer::Float => number(Dtype::F64, out)?,
        // A bool's part is JSON (`true`/`false`): it reads back as a Python `bool`.
        Serializer::Bool if !single => match value {
            [0] => out.extend_from_slice(b"false"),
            [1] => out.extend_from_slice(b"true"),
            _ => return Err(format!("{} bytes for one bool", value.len())),
        },
        Serializer::Bool => number(Dtype::U8, out)?,
        Serializer::Flat(_) | Serializer::Numpy | Serializer::Tensor => {
            let (dtype, shape, elements) = array(serializer, value)?;
            if single {
                if *layout != Layout::Arrays(dtype) {
                    return Err(format!("an array of {dtype:?} among arrays of another dtype"));
                }
                out.extend_from_slice(elements);
            } else if !push_npy(dtype, &shape, elements, out) {
                return Err(format!("an array of {dtype:?}, which NumPy has no type for"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_spec_names_the_leaves() {
        let dict = r#"[1, {"type": "builtins.dict", "context": "[\"tokens\", \"text\"]", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(leaf_names(dict).unwrap(), ["tokens", "text"]);
        let leaf = r#"[1, {"type": null, "context": null, "children_spec": []}]"#;
        assert_eq!(leaf_names(leaf).unwrap(), [""]);
        let tuple = r#"[1, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(leaf_names(tuple).unwrap(), ["0", "1"]);
        let nested = r#"[1, {"type": "builtins.dict", "context": "[\"a\"]", "children_spec": [{"type": "builtins.list", "context": "null", "children_spec": []}]}]"#;
        assert!(leaf_names(nested).unwrap_err().contains("nested"));
        assert!(leaf_names("not json").is_err());
    }

    #[test]
    fn serializers_are_known_or_refused_by_name() {
        assert_eq!(Serializer::parse("no_header_numpy:2").unwrap(), Serializer::Flat(Dtype::I32));
        assert_eq!(Serializer::parse("no_header_tensor:18").unwrap(), Serializer::Flat(Dtype::I64));
        for bad in ["pickle", "jpeg", "no_header_numpy:13", "no_header_tensor", "video"] {
            assert!(Serializer::parse(bad).is_err(), "{bad}");
        }
        // numpy: int16 (index 1), 2 x 1.
        let value = [1, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 7, 0, 8, 0];
        let (dtype, shape, elements) = array(&Serializer::Numpy, &value).unwrap();
        assert_eq!((dtype, shape, elements), (Dtype::I16, vec![2, 1], &value[16..]));
        assert!(array(&Serializer::Numpy, &value[..19]).is_err());
        // tensor: big-endian header, int32 (16), 1-D of 1.
        let value = [0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 0, 1, 5, 0, 0, 0];
        assert_eq!(array(&Serializer::Tensor, &value).unwrap().1, [1]);
    }
}
