//! Byte counts as people write and read them: [`fmt_bytes`] for messages and reports,
//! [`parse_bytes`] for budgets given on the command line or in Python.
//!
//! A foundation module: it depends on nothing but [`crate::error`], so every layer (the layer's
//! out-of-memory messages, the CLI, the report) can use it without importing a higher one.
//! `trimul::report::fmt_bytes` and `trimul::plan::parse_bytes` re-export these.

use crate::error::{Error, Result};

/// Bytes in binary units: `512 B`, `79.2 GiB`, `512.0 MiB` (shared by the layer's errors, the
/// report and the CLI).
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Parses a byte count: `123`, `24G`/`24GB` (10⁹), `24GiB` (2³⁰), with K/M/G/T and their binary
/// `Ki`/`Mi`/`Gi`/`Ti` forms, case-insensitive, fractions allowed (`1.5GB`).
pub fn parse_bytes(text: &str) -> Result<u64> {
    let t = text.trim();
    let bad = || {
        Error::InvalidArgument(format!("{text:?} is not a byte count: expected e.g. 24GB, 24GiB, 512MiB or 1000000"))
    };
    let split = t.find(|ch: char| !(ch.is_ascii_digit() || ch == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| bad())?;
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit.strip_suffix('b').unwrap_or(&unit);
    let scale: f64 = match unit {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024f64.powi(2),
        "gi" => 1024f64.powi(3),
        "ti" => 1024f64.powi(4),
        _ => return Err(bad()),
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_format_in_binary_units() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(1024), "1.0 KiB");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
        assert_eq!(fmt_bytes(80 * 1024 * 1024 * 1024), "80.0 GiB");
        assert_eq!(fmt_bytes(u64::MAX), "16777216.0 TiB");
    }

    #[test]
    fn byte_counts_parse_with_units() {
        assert_eq!(parse_bytes("24GB").unwrap(), 24_000_000_000);
        assert_eq!(parse_bytes("24g").unwrap(), 24_000_000_000);
        assert_eq!(parse_bytes("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        for bad in ["", "GB", "-1G", "12XB", "0", "1e999"] {
            let e = parse_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("byte count"), "{bad}: {e}");
        }
    }
}
