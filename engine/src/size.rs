//! Sizes as people write them: `4096`, `64K`, `64KiB`, `512MiB`, `1.5GiB`, `2G` (units binary,
//! case ignored, `B` optional), the one grammar of the command line's options and of
//! `GRANARY_TIER_BYTES` and the tier's options.
//!
//! Owns `parse_bytes`. Never: guesses (a unit it does not know, a fraction of a byte, a size
//! past `u64` or a negative one is an error that says which), or uses floating point (a
//! decimal is exact to the byte, rounded down).

/// The bytes `text` names; an error says what is wrong with it.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    if trimmed.starts_with('-') {
        return Err(format!("{text:?}: a size is not negative"));
    }
    let split = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("{text:?}: unknown size unit {:?} (B, KiB, MiB, GiB, TiB)", unit.trim())),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(format!("{text:?} is not a size (such as 4096, 64KiB, 1.5GiB)"));
    }
    let too_large = || format!("{text:?} is too large");
    let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
    let mut bytes = whole.checked_mul(1 << shift).ok_or_else(too_large)?;
    if !fraction.is_empty() {
        // fraction / 10^digits of the unit, exact: the digits past 19 cannot add a byte below
        // 2^40 and are dropped.
        let digits = &fraction[..fraction.len().min(19)];
        let numerator: u128 = digits.parse().map_err(|_| format!("{text:?} is not a size"))?;
        let part = (numerator << shift) / 10u128.pow(digits.len() as u32);
        if shift == 0 && numerator != 0 {
            return Err(format!("{text:?}: a size in bytes has no fraction"));
        }
        bytes = bytes.checked_add(u64::try_from(part).map_err(|_| too_large())?).ok_or_else(too_large)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_exactly_and_mistakes_are_named() {
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes(" 512 mib "), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("0.1KiB"), Ok(102));
        assert_eq!(parse_bytes(".5M"), Ok(1 << 19));
        assert_eq!(parse_bytes("16TiB"), Ok(16 << 40));
        // Exact where a float would not be.
        assert_eq!(parse_bytes("9007199254740993"), Ok(9_007_199_254_740_993));
        for (bad, says) in [
            ("12 parsecs", "unknown size unit"),
            ("1.5", "no fraction"),
            ("-1", "not negative"),
            ("", "not a size"),
            ("1.2.3M", "not a size"),
            ("99999999999TiB", "too large"),
            ("99999999999999999999", "too large"),
        ] {
            let error = parse_bytes(bad).unwrap_err();
            assert!(error.contains(says), "{bad:?}: {error}");
        }
    }
}
