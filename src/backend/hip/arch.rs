//! AMD GPU architecture names: the one place they are parsed and normalised.
//!
//! The runtime reports a *target id* such as `gfx942:sramecc+:xnack-`: a processor name and
//! feature settings. Code objects built by `build.rs` name no features ("any"), so they load on
//! every setting of the same processor; kernel selection and the code-object table therefore key
//! on the processor alone, which [`normalize_arch`] returns.

#![forbid(unsafe_code)]

/// A parsed target id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetId {
    /// `gfx942`, `gfx90a`, ... (lower case).
    pub processor: String,
    /// Features with their setting, in the order given: `[("sramecc", true), ("xnack", false)]`.
    pub features: Vec<(String, bool)>,
}

/// Parses `gfx942`, `gfx942:sramecc+:xnack-` or a full triple `amdgcn-amd-amdhsa--gfx942:xnack-`.
/// `None` when it does not name a gfx processor (empty, garbage, a feature without `+`/`-`).
pub fn parse_target_id(s: &str) -> Option<TargetId> {
    let s = s.trim().trim_end_matches('\0');
    let s = s.rsplit_once("--").map_or(s, |(_, tail)| tail);
    let mut parts = s.split(':');
    let processor = parts.next()?.trim().to_ascii_lowercase();
    let digits = processor.strip_prefix("gfx")?;
    if !(3..=4).contains(&digits.len()) || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut features = Vec::new();
    for f in parts {
        let f = f.trim();
        let (name, on) = if let Some(n) = f.strip_suffix('+') {
            (n, true)
        } else if let Some(n) = f.strip_suffix('-') {
            (n, false)
        } else {
            return None;
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric()) {
            return None;
        }
        features.push((name.to_ascii_lowercase(), on));
    }
    Some(TargetId { processor, features })
}

/// The processor of a target id: `gfx942:sramecc+:xnack-` → `gfx942`.
pub fn normalize_arch(s: &str) -> Option<String> {
    parse_target_id(s).map(|t| t.processor)
}

/// Processors with the `v_mfma_f32_32x32x8f16` matrix instruction (CDNA1-3, CDNA4 keeps it).
pub const MFMA_ARCHS: &[&str] = &["gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"];

/// Whether the MFMA kernels can run on `arch` (a normalised processor name).
pub fn has_mfma(arch: &str) -> bool {
    MFMA_ARCHS.contains(&arch)
}

/// HIP encodes versions as `major·10⁷ + minor·10⁵ + patch` (`HIP_VERSION`), e.g. 60342134 is
/// 6.3.42134. Non-positive values are shown raw.
pub fn format_hip_version(v: i32) -> String {
    if v <= 0 {
        return v.to_string();
    }
    format!("{}.{}.{}", v / 10_000_000, (v / 100_000) % 100, v % 100_000)
}

/// Finds the arch name in a `hipDeviceProp_t` image: first at the documented offset of
/// `gcnArchName`, and, if that does not hold a target id (a layout we do not know), by scanning
/// for the first NUL-terminated target id after the 256-byte `name` field. Returns the raw
/// target id (features included).
pub fn arch_from_props(props: &[u8], documented_offset: usize) -> Option<String> {
    let at = |off: usize| -> Option<String> {
        let field = props.get(off..off.checked_add(256)?.min(props.len()))?;
        let end = field.iter().position(|&b| b == 0)?;
        let s = std::str::from_utf8(&field[..end]).ok()?;
        parse_target_id(s).map(|_| s.to_string())
    };
    if let Some(s) = at(documented_offset) {
        return Some(s);
    }
    // A target id starts with "gfx" right after a NUL or at an aligned offset.
    (256..props.len().saturating_sub(3))
        .filter(|&i| &props[i..i + 3] == b"gfx" && (props[i - 1] == 0 || i % 4 == 0))
        .find_map(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_target_ids() {
        assert_eq!(normalize_arch("gfx942").as_deref(), Some("gfx942"));
        assert_eq!(normalize_arch("gfx942:sramecc+:xnack-").as_deref(), Some("gfx942"));
        assert_eq!(normalize_arch("GFX90A:xnack+").as_deref(), Some("gfx90a"));
        assert_eq!(normalize_arch("amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-").as_deref(), Some("gfx90a"));
        assert_eq!(normalize_arch(" gfx1100 ").as_deref(), Some("gfx1100"));
        for bad in ["", "sm_90", "gfx", "gfx9", "gfx94z", "gfx942:sramecc", "gfx942:+", "gfx12345"] {
            assert_eq!(normalize_arch(bad), None, "{bad:?}");
        }
        let t = parse_target_id("gfx942:sramecc+:xnack-").unwrap();
        assert_eq!(t.features, vec![("sramecc".to_string(), true), ("xnack".to_string(), false)]);
    }

    #[test]
    fn mfma_table() {
        assert!(has_mfma("gfx942") && has_mfma("gfx90a") && has_mfma("gfx908"));
        assert!(!has_mfma("gfx1100") && !has_mfma("gfx906") && !has_mfma("gfx942:sramecc+"));
    }

    #[test]
    fn hip_versions() {
        assert_eq!(format_hip_version(60342134), "6.3.42134");
        assert_eq!(format_hip_version(70025331), "7.0.25331");
        assert_eq!(format_hip_version(0), "0");
    }

    #[test]
    fn arch_found_in_property_images() {
        let mut img = vec![0u8; 4096];
        img[..19].copy_from_slice(b"AMD Instinct MI300X");
        let id = b"gfx942:sramecc+:xnack-";
        img[1160..1160 + id.len()].copy_from_slice(id);
        assert_eq!(arch_from_props(&img, 1160).as_deref(), Some("gfx942:sramecc+:xnack-"));
        // Unknown layout: the field sits elsewhere; the scan finds it.
        let mut moved = vec![0u8; 4096];
        moved[2000..2000 + id.len()].copy_from_slice(id);
        assert_eq!(arch_from_props(&moved, 1160).as_deref(), Some("gfx942:sramecc+:xnack-"));
        // Nothing there: None rather than garbage.
        let mut junk = vec![0u8; 4096];
        junk[1160..1166].copy_from_slice(b"gfxzzz");
        assert_eq!(arch_from_props(&junk, 1160), None);
        assert_eq!(arch_from_props(&[0u8; 100], 1160), None);
    }
}
