//! Arrow's dates and times as records and parts: `timestamp` (every unit, with or without a
//! zone), `date32`/`date64`, `time32`/`time64` and `duration`. In a record, the number Arrow holds
//! (days, or counts of the type's unit; i32 or i64 as Arrow stores it); in a part, text that
//! `granary.formats.decode` turns into the value pyarrow's `to_pylist` gives: `.datetime` (ISO
//! 8601, nanoseconds kept; with a zone, the UTC instant and the zone's name), `.date`, `.time`
//! (microseconds, as Python's `time` holds), `.timedelta` (the count and its unit).
//!
//! Owns: `Temporal` and `append_temporal`. Never: converts between zones (the instant is kept,
//! the zone named), or writes a date Python's `datetime` cannot hold (years 1-9999: refused).

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Date32Type, Date64Type, DurationMicrosecondType, DurationMillisecondType, DurationNanosecondType,
    DurationSecondType, Time32MillisecondType, Time32SecondType, Time64MicrosecondType, Time64NanosecondType,
    TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType, TimestampSecondType,
};
use arrow_array::{Array, ArrowPrimitiveType};
use arrow_schema::{DataType, TimeUnit};

use super::parts::PartKind;
use crate::shard::Dtype;

/// A date or time column's type (a timestamp's zone is read from the column's type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Temporal {
    Timestamp(TimeUnit),
    Date32,
    Date64,
    /// `time32` (seconds, milliseconds) or `time64` (microseconds, nanoseconds).
    Time(TimeUnit),
    Duration(TimeUnit),
}

impl Temporal {
    pub(super) fn of(data_type: &DataType) -> Option<Temporal> {
        Some(match data_type {
            DataType::Timestamp(unit, _) => Temporal::Timestamp(*unit),
            DataType::Date32 => Temporal::Date32,
            DataType::Date64 => Temporal::Date64,
            DataType::Time32(unit) | DataType::Time64(unit) => Temporal::Time(*unit),
            DataType::Duration(unit) => Temporal::Duration(*unit),
            _ => return None,
        })
    }

    /// The number Arrow holds for it, as a record holds it.
    pub(super) fn dtype(self) -> Dtype {
        match self {
            Temporal::Date32 | Temporal::Time(TimeUnit::Second | TimeUnit::Millisecond) => Dtype::I32,
            _ => Dtype::I64,
        }
    }

    pub(super) fn part_kind(self) -> PartKind {
        match self {
            Temporal::Timestamp(_) => PartKind::Datetime,
            Temporal::Date32 | Temporal::Date64 => PartKind::Date,
            Temporal::Time(_) => PartKind::Time,
            Temporal::Duration(_) => PartKind::Timedelta,
        }
    }
}

/// Appends row `row` of a date or time column (`array`, of `temporal`'s type) to `out`: as a
/// sample's part when `part`, else as a record of its own.
pub(super) fn append_temporal(
    temporal: Temporal,
    array: &dyn Array,
    row: usize,
    part: bool,
    out: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    let raw = temporal_raw(array, row).ok_or_else(|| format!("{} read as {temporal:?}", array.data_type()))?;
    match (part, temporal.dtype()) {
        (true, _) => push_temporal(temporal, array.data_type(), raw, out)?,
        // The i32 types' values came from an i32.
        (false, Dtype::I32) => out.extend_from_slice(&(raw as i32).to_le_bytes()),
        (false, _) => out.extend_from_slice(&raw.to_le_bytes()),
    }
    Ok(())
}

/// The number a date or time column holds at `row` (None: not a date or time column).
fn temporal_raw(array: &dyn Array, row: usize) -> Option<i64> {
    fn at<T: ArrowPrimitiveType>(array: &dyn Array, row: usize) -> Option<i64>
    where
        T::Native: Into<i64>,
    {
        array.as_primitive_opt::<T>().map(|values| values.value(row).into())
    }
    match array.data_type() {
        DataType::Timestamp(TimeUnit::Second, _) => at::<TimestampSecondType>(array, row),
        DataType::Timestamp(TimeUnit::Millisecond, _) => at::<TimestampMillisecondType>(array, row),
        DataType::Timestamp(TimeUnit::Microsecond, _) => at::<TimestampMicrosecondType>(array, row),
        DataType::Timestamp(TimeUnit::Nanosecond, _) => at::<TimestampNanosecondType>(array, row),
        DataType::Date32 => at::<Date32Type>(array, row),
        DataType::Date64 => at::<Date64Type>(array, row),
        DataType::Time32(TimeUnit::Second) => at::<Time32SecondType>(array, row),
        DataType::Time32(_) => at::<Time32MillisecondType>(array, row),
        DataType::Time64(TimeUnit::Microsecond) => at::<Time64MicrosecondType>(array, row),
        DataType::Time64(_) => at::<Time64NanosecondType>(array, row),
        DataType::Duration(TimeUnit::Second) => at::<DurationSecondType>(array, row),
        DataType::Duration(TimeUnit::Millisecond) => at::<DurationMillisecondType>(array, row),
        DataType::Duration(TimeUnit::Microsecond) => at::<DurationMicrosecondType>(array, row),
        DataType::Duration(TimeUnit::Nanosecond) => at::<DurationNanosecondType>(array, row),
        _ => None,
    }
}

/// Counts of `unit` in a second.
fn per_second(unit: TimeUnit) -> i64 {
    match unit {
        TimeUnit::Second => 1,
        TimeUnit::Millisecond => 1_000,
        TimeUnit::Microsecond => 1_000_000,
        TimeUnit::Nanosecond => 1_000_000_000,
    }
}

/// The proleptic Gregorian date `days` after 1970-01-01 (negative: before): year, month, day.
fn civil_date(days: i64) -> (i64, u32, u32) {
    // Howard Hinnant's `civil_from_days`: eras of 400 years from 0000-03-01.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 } as u32;
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

/// `YYYY-MM-DD` of the date `days` after 1970-01-01; a year Python's `date` cannot hold is
/// refused.
fn push_date(days: i64, out: &mut Vec<u8>) -> std::result::Result<(), String> {
    use std::io::Write;
    let (year, month, day) = civil_date(days);
    if !(1..=9999).contains(&year) {
        return Err(format!("a date in the year {year}, outside the years 1-9999 Python's datetime holds"));
    }
    let _ = write!(out, "{year:04}-{month:02}-{day:02}");
    Ok(())
}

/// `HH:MM:SS.` and the fraction of the second (`count` of `per_second`): nine digits for
/// nanoseconds when `nanos`, else six.
fn push_clock(second_of_day: i64, count: i64, per_second: i64, nanos: bool, out: &mut Vec<u8>) {
    use std::io::Write;
    let (hours, minutes, seconds) = (second_of_day / 3_600, second_of_day / 60 % 60, second_of_day % 60);
    let _ = match nanos {
        true => write!(out, "{hours:02}:{minutes:02}:{seconds:02}.{:09}", count * (1_000_000_000 / per_second)),
        false => write!(out, "{hours:02}:{minutes:02}:{seconds:02}.{:06}", count * 1_000_000 / per_second),
    };
}

/// A date or time's part text (see `PartKind`), from the number `raw` its column of `data_type`
/// holds.
fn push_temporal(
    temporal: Temporal,
    data_type: &DataType,
    raw: i64,
    out: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    use std::io::Write;
    match temporal {
        Temporal::Timestamp(unit) => {
            let per = per_second(unit);
            let (seconds, count) = (raw.div_euclid(per), raw.rem_euclid(per));
            push_date(seconds.div_euclid(86_400), out)?;
            out.push(b'T');
            push_clock(seconds.rem_euclid(86_400), count, per, unit == TimeUnit::Nanosecond, out);
            if let DataType::Timestamp(_, Some(zone)) = data_type {
                let _ = write!(out, "+00:00[{zone}]");
            }
        }
        Temporal::Date32 => push_date(raw, out)?,
        // Milliseconds; Python's `date` is the day they fall in.
        Temporal::Date64 => push_date(raw.div_euclid(86_400_000), out)?,
        Temporal::Time(unit) => {
            let per = per_second(unit);
            let (seconds, count) = (raw.div_euclid(per), raw.rem_euclid(per));
            if !(0..86_400).contains(&seconds) {
                return Err(format!("a time of day {raw} {unit:?} after midnight, past the day's end"));
            }
            push_clock(seconds, count, per, false, out);
        }
        Temporal::Duration(unit) => {
            let unit = match unit {
                TimeUnit::Second => "s",
                TimeUnit::Millisecond => "ms",
                TimeUnit::Microsecond => "us",
                TimeUnit::Nanosecond => "ns",
            };
            let _ = write!(out, "{raw} {unit}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_times_are_written_as_python_reads_them() {
        use arrow_array::{
            Date32Array, Date64Array, DurationNanosecondArray, Time32SecondArray, Time64NanosecondArray,
            TimestampMicrosecondArray, TimestampNanosecondArray, TimestampSecondArray,
        };
        let appended = |array: &dyn Array, row, part| {
            let temporal = Temporal::of(array.data_type()).unwrap();
            let mut out = Vec::new();
            append_temporal(temporal, array, row, part, &mut out).map(|()| out)
        };
        let text = |array: &dyn Array, row| String::from_utf8(appended(array, row, true).unwrap()).unwrap();
        // Every day of 1600-2400 against a count of days kept by hand.
        let mut days = -135_140_i64; // 1600-01-01
        for year in 1600..2400_i64 {
            let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
            for month in 1..=12_u32 {
                let length = match month {
                    2 if leap => 29,
                    2 => 28,
                    4 | 6 | 9 | 11 => 30,
                    _ => 31,
                };
                for day in 1..=length {
                    assert_eq!(civil_date(days), (year, month, day), "{days}");
                    days += 1;
                }
            }
        }
        let dates = Date32Array::from(vec![0, -1, 19_723, 2_932_896]);
        assert_eq!(text(&dates, 0), "1970-01-01");
        assert_eq!(text(&dates, 1), "1969-12-31");
        assert_eq!(text(&dates, 2), "2024-01-01");
        assert_eq!(text(&dates, 3), "9999-12-31");
        assert_eq!(appended(&dates, 1, false).unwrap(), (-1_i32).to_le_bytes());
        let after = Date32Array::from(vec![2_932_897]);
        assert!(appended(&after, 0, true).unwrap_err().contains("year 10000"));
        // Milliseconds before the epoch fall in the day before.
        assert_eq!(text(&Date64Array::from(vec![-1]), 0), "1969-12-31");
        let stamps = TimestampMicrosecondArray::from(vec![-1, 1_700_000_000_123_456]);
        assert_eq!(text(&stamps, 0), "1969-12-31T23:59:59.999999");
        assert_eq!(text(&stamps, 1), "2023-11-14T22:13:20.123456");
        let zoned = TimestampSecondArray::from(vec![0]).with_timezone("Europe/Paris");
        assert_eq!(text(&zoned, 0), "1970-01-01T00:00:00.000000+00:00[Europe/Paris]");
        assert_eq!(text(&TimestampNanosecondArray::from(vec![1]), 0), "1970-01-01T00:00:00.000000001");
        assert_eq!(text(&Time32SecondArray::from(vec![3_601]), 0), "01:00:01.000000");
        // Python's `time` holds microseconds: pyarrow drops the rest.
        assert_eq!(text(&Time64NanosecondArray::from(vec![3_601_000_001_999]), 0), "01:00:01.000001");
        assert_eq!(text(&DurationNanosecondArray::from(vec![-1_001]), 0), "-1001 ns");
        let record = appended(&DurationNanosecondArray::from(vec![-1_001]), 0, false).unwrap();
        assert_eq!(record, (-1_001_i64).to_le_bytes());
    }
}
