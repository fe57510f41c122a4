//! The report's fixed number formats: milliseconds, ratios and error norms, spelled the same in
//! every report so that committed JSONs reproduce a committed report byte for byte. Byte counts
//! are `crate::units::fmt_bytes` (the layer's messages use them too).

/// Milliseconds with three decimals, the precision of SPEC.md's tables.
pub(crate) fn fmt_ms(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.3}")
    } else {
        "n/a".into()
    }
}

/// A ratio such as a speedup or time/floor, with three significant digits: `2.35×`, `23.5×`,
/// `235×`, `0.0123×` (a CPU run against a GPU baseline lands far below 1).
pub(crate) fn fmt_ratio(v: f64) -> String {
    if !v.is_finite() || v <= 0.0 {
        return "n/a".into();
    }
    let decimals = (2.0 - (v.log10() + 1e-12).floor()).clamp(0.0, 12.0) as usize;
    format!("{v:.decimals$}×")
}

/// Error norms: `5.12e-4`, or `NaN` / `inf` spelled out because that is the finding.
pub fn fmt_err(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        "inf".into()
    } else if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.2e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::fmt_bytes;

    #[test]
    fn formatting_is_fixed() {
        assert_eq!(fmt_ms(0.0456), "0.046");
        assert_eq!(fmt_ms(f64::NAN), "n/a");
        assert_eq!(fmt_ratio(2.346), "2.35×");
        assert_eq!(fmt_ratio(23.46), "23.5×");
        assert_eq!(fmt_ratio(234.4), "234×");
        assert_eq!(fmt_ratio(0.0), "n/a");
        assert_eq!(fmt_ratio(0.01234), "0.0123×");
        assert_eq!(fmt_ratio(1.0), "1.00×");
        assert_eq!(fmt_err(5.123e-4), "5.12e-4");
        assert_eq!(fmt_err(f64::NAN), "NaN");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(80 * 1024 * 1024 * 1024), "80.0 GiB");
    }
}
