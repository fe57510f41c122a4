//! Anchors: per-shape times measured elsewhere (PyTorch, other libraries, leaderboard code) that
//! a report shows beside its runs as reference columns and dashed lines.
//!
//! An anchors file is a JSON array of [`Anchor`] objects (a single object is accepted too):
//!
//! ```json
//! [{ "name": "PyTorch reference f32", "unit": "ms", "device": "NVIDIA H100 80GB HBM3",
//!    "formulation": "gpumode", "precision": "f32-io",
//!    "shapes": { "n256_b2_c128": 2.251, "n768_b1_c128": 15.01 } }]
//! ```
//!
//! Keys are [`ShapeResult::key`](super::ShapeResult::key) strings, `n{N}_b{B}_c{C}`.
//!
//! The report compares an anchor only with runs of its formulation and I/O precision (the
//! precision of x and y, as `trimul bench --precision` spells it), and, when the anchor names a
//! device, only with runs on that device. An anchor that does not say its formulation and
//! precision is shown but compared with nothing: a time of another computation or another
//! element type would make any ratio meaningless.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::schema::{short, MAX_MS, MIN_ANCHOR_MS};
use crate::error::{Error, Result};
use crate::problem::{Formulation, Precision};

/// An error's message without its variant's prefix.
fn strip(e: Error) -> String {
    match e {
        Error::InvalidArgument(m) => m,
        other => other.to_string(),
    }
}

/// One reference series of per-shape times.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Anchor {
    /// Column and legend name; unique among the anchors of one report.
    pub name: String,
    /// Unit of the values; only `ms` is accepted, so a file in µs cannot be misread by 1000×.
    pub unit: String,
    /// Device the times were measured on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Where the numbers come from and how they were taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// `gpumode` or `af3`: which computation was timed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub formulation: Option<String>,
    /// `f32-io`, `bf16-io` or `f16-io`: the element type of x and y (whatever the
    /// implementation computes in inside).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// Median time per shape key.
    pub shapes: BTreeMap<String, f64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum AnchorsFile {
    Many(Vec<Anchor>),
    One(Anchor),
}

impl Anchor {
    /// Parses an anchors document (array or single object). Errors are one line.
    pub fn list_from_json_str(text: &str) -> Result<Vec<Anchor>> {
        Anchor::parse(text).map_err(|m| Error::InvalidArgument(format!("anchors JSON: {m}")))
    }

    /// Reads an anchors file; errors are one line and name the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Vec<Anchor>> {
        let path = path.as_ref();
        let file_err = |reason: String| Error::File { path: path.display().to_string(), reason };
        // Bounded: a huge file or /dev/zero is refused, not read until memory runs out.
        let text = crate::io::read_text(path, crate::io::MAX_JSON_BYTES, "anchors JSON file")?;
        Anchor::parse(&text).map_err(file_err)
    }

    fn parse(text: &str) -> std::result::Result<Vec<Anchor>, String> {
        // Syntax first, so a truncated file says so rather than "did not match any variant".
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let anchors = match serde_json::from_value::<AnchorsFile>(value.clone()) {
            Ok(AnchorsFile::Many(v)) => v,
            Ok(AnchorsFile::One(a)) => vec![a],
            // Untagged enums hide the field error; re-run the shape the document has for it.
            Err(_) if value.is_array() => {
                serde_json::from_value::<Vec<Anchor>>(value).map_err(|e| format!("not an anchors list: {e}"))?
            }
            Err(_) => vec![serde_json::from_value::<Anchor>(value).map_err(|e| format!("not an anchor: {e}"))?],
        };
        for a in &anchors {
            a.validate().map_err(|e| match e {
                Error::InvalidArgument(m) => m,
                other => other.to_string(),
            })?;
        }
        Ok(anchors)
    }

    /// Pretty JSON of a list of anchors, with a trailing newline.
    pub fn list_to_json_string(anchors: &[Anchor]) -> Result<String> {
        let mut s = serde_json::to_string_pretty(anchors)
            .map_err(|e| Error::InvalidArgument(format!("anchors do not serialise: {e}")))?;
        s.push('\n');
        Ok(s)
    }

    /// The formulation and I/O precision, spelled as runs spell them (`gpumode`, `f32-io`);
    /// `None` unless the anchor gives both.
    pub fn class(&self) -> Option<(String, String)> {
        let f = self.formulation.as_deref()?.parse::<Formulation>().ok()?;
        let p = self.precision.as_deref()?.parse::<Precision>().ok()?;
        Some((f.as_str().to_string(), p.as_str().to_string()))
    }

    /// A non-empty name, unit `ms`, a known formulation and precision where given, and positive
    /// finite times.
    pub fn validate(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            return Err(Error::InvalidArgument("an anchor has an empty name".into()));
        }
        if let Some(f) = &self.formulation {
            f.parse::<Formulation>()
                .map_err(|e| Error::InvalidArgument(format!("anchor {:?}: {}", self.name, strip(e))))?;
        }
        if let Some(p) = &self.precision {
            p.parse::<Precision>()
                .map_err(|e| Error::InvalidArgument(format!("anchor {:?}: {}", self.name, strip(e))))?;
        }
        if self.unit != "ms" {
            return Err(Error::InvalidArgument(format!(
                "anchor {:?} has unit {:?}; only \"ms\" is accepted",
                self.name, self.unit
            )));
        }
        for (key, v) in &self.shapes {
            if !(MIN_ANCHOR_MS..=MAX_MS).contains(v) {
                return Err(Error::InvalidArgument(format!(
                    "anchor {:?}: {key} = {} ms is not a positive time ({MIN_ANCHOR_MS:e} to {MAX_MS:e} ms)",
                    self.name,
                    short(*v)
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_one_or_many() {
        let one = r#"{"name":"a","unit":"ms","shapes":{"n32_b1_c128":1.5}}"#;
        assert_eq!(Anchor::list_from_json_str(one).unwrap().len(), 1);
        let many = format!("[{one},{}]", one.replace("\"a\"", "\"b\""));
        let v = Anchor::list_from_json_str(&many).unwrap();
        assert_eq!(v[1].name, "b");
        assert_eq!(v[0].shapes["n32_b1_c128"], 1.5);
    }

    #[test]
    fn rejects_bad_units_values_and_syntax() {
        let e = Anchor::list_from_json_str(r#"{"name":"a","unit":"us","shapes":{}}"#).unwrap_err().to_string();
        assert!(e.contains("only \"ms\""), "{e}");
        let e = Anchor::list_from_json_str(r#"[{"name":"a","unit":"ms","shapes":{"k":-1}}]"#).unwrap_err().to_string();
        assert!(e.contains("not a positive time"), "{e}");
        let e = Anchor::list_from_json_str(r#"[{"name":"a","unit":"ms","shap"#).unwrap_err().to_string();
        assert!(e.contains("not valid JSON") && !e.contains('\n'), "{e}");
        let e = Anchor::list_from_json_str(r#"[{"name":"a","shapes":{}}]"#).unwrap_err().to_string();
        assert!(e.contains("unit"), "{e}");
        let e = Anchor::list_from_json_str(r#"{"name":"a","unit":"ms","formulation":"af2","shapes":{}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown formulation \"af2\"") && !e.contains('\n'), "{e}");
        let e = Anchor::list_from_json_str(r#"{"name":"a","unit":"ms","precision":"int8","shapes":{}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown precision \"int8\""), "{e}");
    }

    #[test]
    fn class_needs_both_and_is_normalised() {
        let a =
            |f: &str| Anchor::list_from_json_str(&format!(r#"{{"name":"a","unit":"ms",{f}"shapes":{{}}}}"#)).unwrap();
        assert_eq!(a(r#""formulation":"AF3","precision":"bf16","#)[0].class(), Some(("af3".into(), "bf16-io".into())));
        assert_eq!(a(r#""formulation":"gpumode","#)[0].class(), None);
        assert_eq!(a("")[0].class(), None);
    }
}
