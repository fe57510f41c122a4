//! safetensors I/O: layer weights under four naming schemes, and the pair tensors `x`, `mask`
//! and `y`.
//!
//! # Weights
//!
//! [`Weights::from_safetensors`] reads one TriMul layer and infers the formulation, `C` and `H`
//! from the tensor names and shapes. Accepted names (shapes in SPEC.md's notation):
//!
//! | scheme ([`NamingScheme`]) | tensors |
//! |---|---|
//! | `GpuMode` (formulation gpumode) | `norm.weight [C]`, `norm.bias [C]`, `left_proj.weight`, `right_proj.weight`, `left_gate.weight`, `right_gate.weight`, `out_gate.weight` (each `[H, C]`), `to_out_norm.weight [H]`, `to_out_norm.bias [H]`, `to_out.weight [C, H]`. No linear biases: a `left_proj.bias` (or any `*.bias` of a linear layer) is an error. |
//! | `Packed` (af3; cuEquivariance modules, Boltz) | `norm_in.weight [C]`, `norm_in.bias [C]`, `p_in.weight [2H, C]`, `g_in.weight [2H, C]`, `norm_out.weight [H]`, `norm_out.bias [H]`, `p_out.weight [C, H]`, `g_out.weight [C, C]`; optional `p_in.bias [2H]`, `g_in.bias [2H]`, `p_out.bias [C]`, `g_out.bias [C]`. The rows of `p_in`/`g_in` are `[a; b]`: the first `H` rows are the left (`a`) projection/gate, the next `H` the right (`b`) one. |
//! | `CuEquivarianceFunctional` (af3) | the `Packed` names with the dot replaced by `_`: `norm_in_weight`, `norm_in_bias`, `p_in_weight`, `p_in_bias`, `g_in_weight`, `g_in_bias`, `norm_out_weight`, `norm_out_bias`, `p_out_weight`, `p_out_bias`, `g_out_weight`, `g_out_bias`. |
//! | `OpenFold` (af3) | `layer_norm_in.{weight,bias} [C]`, `linear_a_p`, `linear_a_g`, `linear_b_p`, `linear_b_g` (`.weight [H, C]`, optional `.bias [H]`), `layer_norm_out.{weight,bias} [H]`, `linear_z.weight [C, H]`, `linear_g.weight [C, C]` (optional `.bias [C]`). |
//!
//! Canonical mapping ([`Weights`]): `a_p`/`left_proj` → `left_proj`, `a_g` → `left_gate`,
//! `b_p` → `right_proj`, `b_g` → `right_gate`, `g_out`/`linear_g`/`out_gate` → `out_gate`,
//! `p_out`/`linear_z`/`to_out` → `out_proj`.
//!
//! Weight tensors may be F32, F16, BF16 or F64; they are converted to f32. Every tensor of a file
//! must belong to one layer of one scheme: unknown tensors, names of two schemes, a missing
//! tensor, a wrong rank or shape are errors that name the tensor. The names may carry a common
//! prefix ending in `.` (a layer cut out of a whole checkpoint, e.g.
//! `pairformer.layers.0.tri_mul_out.p_in.weight`); it is stripped. A file holding several layers
//! is an error listing their prefixes; pick one with [`Weights::from_safetensors_with_prefix`].
//!
//! # Pair tensors
//!
//! [`read_input`] reads `x` (`[B, N, N, C]`, or `[N, N, C]` meaning `B = 1`; F32, F16, BF16 or
//! F64) and the optional `mask` (`[B, N, N]`, or `[N, N]` when `B = 1`; F32, F16, BF16, F64,
//! BOOL, U8, I32 or I64, every value 0 or 1). [`write_output`] writes `y` (`[B, N, N, C]`, F32)
//! and [`read_output`] reads it back. Other tensors in these files are ignored, so one file may
//! carry `x`, `mask` and a reference `y`. These files reach gigabytes (`x` at N = 2048, C = 128
//! is 2 GiB in f32), so they are streamed in chunks rather than read whole: peak memory is the
//! f32 tensor plus one chunk.
//!
//! Files are written to a sibling temporary file and renamed into place, so a failed write never
//! leaves a truncated file under the requested name.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, View};

use crate::error::{Error, Result};
use crate::problem::{Config, Formulation, Shape};
use crate::weights::{Linear, Norm, Weights};

mod files;
use files::write_atomically;
pub use files::{check_output, check_output_dir, read_text, write_file, MAX_JSON_BYTES};

// ---------------------------------------------------------------------------------------------
// Naming schemes
// ---------------------------------------------------------------------------------------------

/// The checkpoint naming conventions this crate reads and writes (see the module docs for the
/// names and shapes of each).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NamingScheme {
    /// GPU MODE / lucidrains names (`left_proj.weight`, ...); formulation gpumode.
    GpuMode,
    /// cuEquivariance module and Boltz names with packed `[a; b]` input projections
    /// (`p_in.weight`, ...); formulation af3.
    Packed,
    /// cuEquivariance's functional-API argument names (`p_in_weight`, ...); formulation af3.
    CuEquivarianceFunctional,
    /// OpenFold names (`linear_a_p.weight`, ...); formulation af3.
    OpenFold,
}

/// Names a scheme knows: those a layer must have, those it may have, and those that are
/// recognised only to be rejected with a precise message (biases on gpumode linears).
struct SchemeNames {
    required: &'static [&'static str],
    optional: &'static [&'static str],
    forbidden: &'static [&'static str],
}

const GPUMODE: SchemeNames = SchemeNames {
    required: &[
        "norm.weight",
        "norm.bias",
        "left_proj.weight",
        "right_proj.weight",
        "left_gate.weight",
        "right_gate.weight",
        "out_gate.weight",
        "to_out_norm.weight",
        "to_out_norm.bias",
        "to_out.weight",
    ],
    optional: &[],
    forbidden: &[
        "left_proj.bias",
        "right_proj.bias",
        "left_gate.bias",
        "right_gate.bias",
        "out_gate.bias",
        "to_out.bias",
    ],
};

const PACKED: SchemeNames = SchemeNames {
    required: &[
        "norm_in.weight",
        "norm_in.bias",
        "p_in.weight",
        "g_in.weight",
        "norm_out.weight",
        "norm_out.bias",
        "p_out.weight",
        "g_out.weight",
    ],
    optional: &["p_in.bias", "g_in.bias", "p_out.bias", "g_out.bias"],
    forbidden: &[],
};

const FUNCTIONAL: SchemeNames = SchemeNames {
    required: &[
        "norm_in_weight",
        "norm_in_bias",
        "p_in_weight",
        "g_in_weight",
        "norm_out_weight",
        "norm_out_bias",
        "p_out_weight",
        "g_out_weight",
    ],
    optional: &["p_in_bias", "g_in_bias", "p_out_bias", "g_out_bias"],
    forbidden: &[],
};

const OPENFOLD: SchemeNames = SchemeNames {
    required: &[
        "layer_norm_in.weight",
        "layer_norm_in.bias",
        "linear_a_p.weight",
        "linear_a_g.weight",
        "linear_b_p.weight",
        "linear_b_g.weight",
        "layer_norm_out.weight",
        "layer_norm_out.bias",
        "linear_z.weight",
        "linear_g.weight",
    ],
    optional: &[
        "linear_a_p.bias",
        "linear_a_g.bias",
        "linear_b_p.bias",
        "linear_b_g.bias",
        "linear_z.bias",
        "linear_g.bias",
    ],
    forbidden: &[],
};

impl NamingScheme {
    /// Every scheme the loader recognises.
    pub const ALL: [NamingScheme; 4] =
        [NamingScheme::GpuMode, NamingScheme::Packed, NamingScheme::CuEquivarianceFunctional, NamingScheme::OpenFold];

    /// A short name of the scheme, for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            NamingScheme::GpuMode => "gpumode",
            NamingScheme::Packed => "packed",
            NamingScheme::CuEquivarianceFunctional => "functional",
            NamingScheme::OpenFold => "openfold",
        }
    }

    /// The formulation whose weights this scheme names.
    pub fn formulation(self) -> Formulation {
        match self {
            NamingScheme::GpuMode => Formulation::GpuMode,
            _ => Formulation::Af3,
        }
    }

    /// Tensors every layer in this scheme has.
    pub fn required_names(self) -> &'static [&'static str] {
        self.names().required
    }

    /// Tensors a layer in this scheme may have (linear biases of af3 layers).
    pub fn optional_names(self) -> &'static [&'static str] {
        self.names().optional
    }

    fn names(self) -> &'static SchemeNames {
        match self {
            NamingScheme::GpuMode => &GPUMODE,
            NamingScheme::Packed => &PACKED,
            NamingScheme::CuEquivarianceFunctional => &FUNCTIONAL,
            NamingScheme::OpenFold => &OPENFOLD,
        }
    }

    /// The scheme's own spelling of `<module>.<param>`: the functional API joins with `_`.
    fn key(self, module: &str, param: &str) -> String {
        match self {
            NamingScheme::CuEquivarianceFunctional => format!("{module}_{param}"),
            _ => format!("{module}.{param}"),
        }
    }

    /// If `local` is a name this scheme recognises, its `'static` spelling.
    fn recognise(self, local: &str) -> Option<&'static str> {
        let n = self.names();
        n.required.iter().chain(n.optional).chain(n.forbidden).copied().find(|k| *k == local)
    }

    /// Which scheme names a set of tensors (which may share a prefix, see the module docs).
    /// Errors when no scheme matches, when names of several schemes are mixed, when tensors
    /// unknown to the scheme are present, or when the names belong to several layers.
    pub fn detect<S: AsRef<str>>(names: &[S]) -> Result<NamingScheme> {
        let names: Vec<&str> = names.iter().map(|s| s.as_ref()).collect();
        Ok(find_layout(&names, None)?.scheme)
    }
}

impl fmt::Display for NamingScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for NamingScheme {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "gpumode" | "gpu-mode" | "gpu_mode" | "lucidrains" => Ok(NamingScheme::GpuMode),
            "packed" | "cuequivariance" | "cueq" | "boltz" => Ok(NamingScheme::Packed),
            "functional" | "cuequivariance-functional" | "cueq-functional" => {
                Ok(NamingScheme::CuEquivarianceFunctional)
            }
            "openfold" | "af2" => Ok(NamingScheme::OpenFold),
            other => Err(Error::InvalidArgument(format!(
                "unknown naming scheme {other:?}: expected gpumode, packed, functional or openfold"
            ))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Finding the layer in a file: prefix, scheme, names
// ---------------------------------------------------------------------------------------------

/// One layer's tensors in a file: the prefix shared by their names, their scheme and the
/// scheme-local names present.
struct Layout {
    prefix: String,
    scheme: NamingScheme,
    present: BTreeSet<&'static str>,
}

impl Layout {
    fn full(&self, local: &str) -> String {
        format!("{}{local}", self.prefix)
    }
}

/// Splits `name` into (prefix, scheme, local name) when it ends in a name some scheme
/// recognises, at a `.` boundary. No recognised name ends in `.` + another recognised name, so
/// the split is unique.
fn split_known(name: &str) -> Option<(&str, NamingScheme, &'static str)> {
    for scheme in NamingScheme::ALL {
        let n = scheme.names();
        for &local in n.required.iter().chain(n.optional).chain(n.forbidden) {
            if let Some(prefix) = name.strip_suffix(local) {
                if prefix.is_empty() || prefix.ends_with('.') {
                    return Some((prefix, scheme, local));
                }
            }
        }
    }
    None
}

/// At most `max` items, backtick-quoted and comma-separated, with a count of the rest.
fn list<S: AsRef<str>>(items: &[S], max: usize) -> String {
    let mut s = items.iter().take(max).map(|i| format!("`{}`", shown(i.as_ref()))).collect::<Vec<_>>().join(", ");
    if items.len() > max {
        s.push_str(&format!(" and {} more", items.len() - max));
    }
    s
}

/// A name from a file as a message shows it: control characters (a newline in a tensor name)
/// escaped, so that every message stays one line.
fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    if name.chars().any(char::is_control) {
        std::borrow::Cow::Owned(name.escape_debug().to_string())
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

/// Prefixes of every recognisable layer among `names`, for messages.
fn layer_prefixes<'a>(names: &[&'a str]) -> Vec<&'a str> {
    let set: BTreeSet<&str> = names.iter().filter_map(|n| split_known(n)).map(|(p, _, _)| p).collect();
    set.into_iter().collect()
}

fn prefix_label(p: &str) -> String {
    if p.is_empty() {
        "(no prefix)".to_string()
    } else {
        p.to_string()
    }
}

fn find_layout(names: &[&str], prefix: Option<&str>) -> Result<Layout> {
    // (scheme, local name, full name) of every tensor of the layer.
    let mut entries: Vec<(NamingScheme, &'static str, &str)> = Vec::new();
    let prefix = match prefix {
        Some(p) => {
            let mut p = p.trim().to_string();
            if !p.is_empty() && !p.ends_with('.') {
                p.push('.');
            }
            let mut unknown = Vec::new();
            for &name in names {
                let Some(local) = name.strip_prefix(p.as_str()) else { continue };
                match NamingScheme::ALL.iter().find_map(|s| s.recognise(local).map(|l| (*s, l))) {
                    Some((scheme, l)) => entries.push((scheme, l, name)),
                    None => unknown.push(name),
                }
            }
            let layers: Vec<String> = layer_prefixes(names).into_iter().map(prefix_label).collect();
            if entries.is_empty() && unknown.is_empty() {
                return Err(Error::Weights(format!(
                    "no tensor name starts with the prefix `{p}`; TriMul layers in this file are at {}",
                    if layers.is_empty() { "no prefix (none found)".to_string() } else { list(&layers, 8) }
                )));
            }
            if !unknown.is_empty() {
                return Err(Error::Weights(format!(
                    "tensors under the prefix `{p}` that are not TriMul weights: {}; TriMul layers in this file \
                     are at {}",
                    list(&unknown, 8),
                    if layers.is_empty() { "no prefix (none found)".to_string() } else { list(&layers, 8) }
                )));
            }
            p
        }
        None => {
            let mut by_prefix: BTreeMap<&str, Vec<(NamingScheme, &'static str, &str)>> = BTreeMap::new();
            let mut unknown = Vec::new();
            for &name in names {
                match split_known(name) {
                    Some((p, scheme, local)) => by_prefix.entry(p).or_default().push((scheme, local, name)),
                    None => unknown.push(name),
                }
            }
            if by_prefix.is_empty() {
                let mut found: Vec<&str> = names.to_vec();
                found.sort_unstable();
                return Err(Error::Weights(format!(
                    "no TriMul weight names found among {} tensor(s) ({}); expected one scheme's names, e.g. \
                     gpumode `left_proj.weight`, packed `p_in.weight`, functional `p_in_weight` or openfold \
                     `linear_a_p.weight`",
                    names.len(),
                    list(&found, 8)
                )));
            }
            if by_prefix.len() > 1 {
                let prefixes: Vec<String> = by_prefix.keys().map(|p| prefix_label(p)).collect();
                return Err(Error::Weights(format!(
                    "this file holds weights of {} layers, at the prefixes {}; extract one layer or pass its prefix \
                     (Weights::from_safetensors_with_prefix)",
                    prefixes.len(),
                    list(&prefixes, 8)
                )));
            }
            let (p, e) = by_prefix.into_iter().next().unwrap_or_default();
            if !unknown.is_empty() {
                unknown.sort_unstable();
                return Err(Error::Weights(format!(
                    "unknown tensor(s) {} next to the TriMul weights{}; a file must hold one layer and nothing else \
                     (or pass the layer's prefix to Weights::from_safetensors_with_prefix)",
                    list(&unknown, 8),
                    if p.is_empty() { String::new() } else { format!(" at the prefix `{p}`") }
                )));
            }
            entries = e;
            p.to_string()
        }
    };

    let schemes: BTreeSet<&str> = entries.iter().map(|(s, _, _)| s.as_str()).collect();
    if schemes.len() > 1 {
        let groups: Vec<String> = NamingScheme::ALL
            .iter()
            .filter_map(|s| {
                let mut names: Vec<&str> = entries.iter().filter(|e| e.0 == *s).map(|e| e.2).collect();
                names.sort_unstable();
                (!names.is_empty()).then(|| format!("{s}: {}", list(&names, 4)))
            })
            .collect();
        return Err(Error::Weights(format!(
            "tensor names of several naming schemes are mixed ({}); a layer must use one scheme",
            groups.join("; ")
        )));
    }
    let scheme = entries.first().map(|e| e.0).ok_or_else(|| Error::Weights("no TriMul weights found".into()))?;
    Ok(Layout { prefix, scheme, present: entries.iter().map(|e| e.1).collect() })
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

const FLOAT_DTYPES: &str = "F32, F16, BF16 or F64";

/// Size in bytes of the float dtypes we decode; `None` for everything else.
fn float_size(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::F16 | Dtype::BF16 => Some(2),
        Dtype::F64 => Some(8),
        _ => None,
    }
}

/// Appends the little-endian floats in `bytes` (whole elements of `dtype`) to `out` as f32.
/// `dtype` must be one `float_size` accepts; others append nothing.
fn decode_floats(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        Dtype::F32 => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        Dtype::F16 => {
            out.extend(bytes.chunks_exact(2).map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()))
        }
        Dtype::BF16 => {
            out.extend(bytes.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()))
        }
        Dtype::F64 => out.extend(
            bytes.chunks_exact(8).map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32),
        ),
        _ => {}
    }
}

fn shape_str(shape: &[usize]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

// ---------------------------------------------------------------------------------------------
// Weights: reading
// ---------------------------------------------------------------------------------------------

/// A weight tensor converted to f32, with its full name for messages.
struct Tensor {
    name: String,
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// Symbolic dimensions of a weight shape, resolved against the inferred `C` and `H`.
#[derive(Copy, Clone)]
enum Dim {
    C,
    H,
    TwoH,
}

/// `C` and `H` as inferred, and from which tensor, so shape errors can say why a size is expected.
struct Dims {
    c: usize,
    h: usize,
    source: String,
}

impl Dims {
    fn size(&self, d: Dim) -> usize {
        match d {
            Dim::C => self.c,
            Dim::H => self.h,
            Dim::TwoH => 2 * self.h,
        }
    }

    fn check(&self, t: &Tensor, dims: &[Dim]) -> Result<()> {
        let expected: Vec<usize> = dims.iter().map(|&d| self.size(d)).collect();
        if t.shape != expected {
            let sym: Vec<&str> = dims
                .iter()
                .map(|d| match d {
                    Dim::C => "C",
                    Dim::H => "H",
                    Dim::TwoH => "2H",
                })
                .collect();
            return Err(Error::Weights(format!(
                "`{}` has shape {}, expected [{}] = {} (C = {}, H = {} inferred from {})",
                t.name,
                shape_str(&t.shape),
                sym.join(", "),
                shape_str(&expected),
                self.c,
                self.h,
                self.source
            )));
        }
        Ok(())
    }
}

/// The tensors of one layer, decoded to f32 by local name.
struct LayerReader {
    layout: Layout,
    tensors: BTreeMap<&'static str, Tensor>,
}

/// Elements of the largest layer any scheme describes (`C = H =` [`MAX_CHANNELS`](crate::problem::MAX_CHANNELS):
/// five `[H, C]`-sized projections and gates, `[C, C]` or `[C, H]` outputs, norms and biases), with
/// room to spare. Tensors declaring more cannot be one layer's weights and are refused before
/// they are read.
const MAX_LAYER_VALUES: u64 = {
    let m = crate::problem::MAX_CHANNELS as u64;
    8 * m * m + 32 * m
};

impl LayerReader {
    /// Checks the layer is complete, then decodes every tensor it has (refusing non-float dtypes
    /// and sizes no layer has before reading any data).
    fn load<R: Read + Seek>(layout: Layout, source: &mut TensorFile<R>) -> Result<LayerReader> {
        check_complete(&layout)?;
        let mut described = Vec::with_capacity(layout.present.len());
        let mut total: u64 = 0;
        for &local in &layout.present {
            let name = layout.full(local);
            let TensorInfo { dtype, shape, .. } = source.require(&name)?;
            if float_size(dtype).is_none() {
                return Err(Error::Dtype(format!(
                    "weight `{}` is {dtype}; weights must be {FLOAT_DTYPES}",
                    shown(&name)
                )));
            }
            let values = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64)).unwrap_or(u64::MAX);
            total = total.saturating_add(values);
            described.push((local, name, shape));
        }
        if total > MAX_LAYER_VALUES {
            return Err(Error::Weights(format!(
                "the layer's tensors declare {total} values, more than any TriMul layer has (C and H are at most \
                 {}); not read",
                crate::problem::MAX_CHANNELS
            )));
        }
        let mut tensors = BTreeMap::new();
        for (local, name, shape) in described {
            let info = source.require(&name)?;
            let data = source.read_floats(&name, &info)?;
            tensors.insert(local, Tensor { name, shape, data });
        }
        Ok(LayerReader { layout, tensors })
    }

    fn get(&self, local: &str) -> Result<Option<Tensor>> {
        Ok(self.tensors.get(local).map(|t| Tensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            data: t.data.clone(),
        }))
    }

    fn req(&self, local: &str) -> Result<Tensor> {
        // Presence of every required name was checked up front; this guards the invariant.
        self.get(local)?.ok_or_else(|| Error::Weights(format!("missing tensor `{}`", shown(&self.layout.full(local)))))
    }

    /// Reads a `[out, in]` weight whose size defines `H` and `C`; `rows_per_h` is 2 for the
    /// packed `[a; b]` projections.
    fn anchor(&self, local: &str, rows_per_h: usize) -> Result<Dims> {
        let t = self.req(local)?;
        let what = if rows_per_h == 2 { "[2H, C]" } else { "[H, C]" };
        let &[rows, c] = t.shape.as_slice() else {
            return Err(Error::Weights(format!(
                "`{}` has shape {} (rank {}), expected {what} (rank 2)",
                t.name,
                shape_str(&t.shape),
                t.shape.len()
            )));
        };
        if rows % rows_per_h != 0 {
            return Err(Error::Weights(format!(
                "`{}` has shape {}: {rows} rows is odd, but it stacks the a and b halves as [a; b] and needs 2H rows",
                t.name,
                shape_str(&t.shape)
            )));
        }
        let h = rows / rows_per_h;
        let source = format!("`{}` {}", shown(&t.name), shape_str(&t.shape));
        Ok(Dims { c, h, source })
    }

    fn norm(&self, d: &Dims, weight: &str, bias: &str, width: Dim) -> Result<Norm> {
        let w = self.req(weight)?;
        d.check(&w, &[width])?;
        let b = self.req(bias)?;
        d.check(&b, &[width])?;
        Ok(Norm { weight: w.data, bias: b.data })
    }

    fn linear(&self, d: &Dims, weight: &str, bias: Option<&str>, out: Dim, inp: Dim) -> Result<Linear> {
        let w = self.req(weight)?;
        d.check(&w, &[out, inp])?;
        let b = match bias {
            Some(name) => self.get(name)?,
            None => None,
        };
        if let Some(b) = &b {
            d.check(b, &[out])?;
        }
        Ok(Linear::new(w.data, b.map(|b| b.data), d.size(out), d.size(inp)))
    }

    fn weights(&self) -> Result<Weights> {
        let scheme = self.layout.scheme;
        let config = |d: &Dims| {
            Config::new(scheme.formulation(), d.c, d.h).map_err(|e| Error::Weights(format!("{}: {e}", d.source)))
        };
        match scheme {
            NamingScheme::GpuMode => {
                let d = self.anchor("left_proj.weight", 1)?;
                let config = config(&d)?;
                let lin = |name: &str, out, inp| self.linear(&d, name, None, out, inp);
                Weights::new(
                    config,
                    self.norm(&d, "norm.weight", "norm.bias", Dim::C)?,
                    lin("left_proj.weight", Dim::H, Dim::C)?,
                    lin("left_gate.weight", Dim::H, Dim::C)?,
                    lin("right_proj.weight", Dim::H, Dim::C)?,
                    lin("right_gate.weight", Dim::H, Dim::C)?,
                    lin("out_gate.weight", Dim::H, Dim::C)?,
                    self.norm(&d, "to_out_norm.weight", "to_out_norm.bias", Dim::H)?,
                    lin("to_out.weight", Dim::C, Dim::H)?,
                )
            }
            NamingScheme::Packed | NamingScheme::CuEquivarianceFunctional => {
                let k = |m: &str, p: &str| scheme.key(m, p);
                let d = self.anchor(&k("p_in", "weight"), 2)?;
                let config = config(&d)?;
                let (left_proj, right_proj) = self.packed(&d, &k("p_in", "weight"), &k("p_in", "bias"))?;
                let (left_gate, right_gate) = self.packed(&d, &k("g_in", "weight"), &k("g_in", "bias"))?;
                Weights::new(
                    config,
                    self.norm(&d, &k("norm_in", "weight"), &k("norm_in", "bias"), Dim::C)?,
                    left_proj,
                    left_gate,
                    right_proj,
                    right_gate,
                    self.linear(&d, &k("g_out", "weight"), Some(&k("g_out", "bias")), Dim::C, Dim::C)?,
                    self.norm(&d, &k("norm_out", "weight"), &k("norm_out", "bias"), Dim::H)?,
                    self.linear(&d, &k("p_out", "weight"), Some(&k("p_out", "bias")), Dim::C, Dim::H)?,
                )
            }
            NamingScheme::OpenFold => {
                let d = self.anchor("linear_a_p.weight", 1)?;
                let config = config(&d)?;
                let lin =
                    |m: &str, out, inp| self.linear(&d, &format!("{m}.weight"), Some(&format!("{m}.bias")), out, inp);
                Weights::new(
                    config,
                    self.norm(&d, "layer_norm_in.weight", "layer_norm_in.bias", Dim::C)?,
                    lin("linear_a_p", Dim::H, Dim::C)?,
                    lin("linear_a_g", Dim::H, Dim::C)?,
                    lin("linear_b_p", Dim::H, Dim::C)?,
                    lin("linear_b_g", Dim::H, Dim::C)?,
                    lin("linear_g", Dim::C, Dim::C)?,
                    self.norm(&d, "layer_norm_out.weight", "layer_norm_out.bias", Dim::H)?,
                    lin("linear_z", Dim::C, Dim::H)?,
                )
            }
        }
    }

    /// Splits a packed `[2H, C]` weight (and its optional `[2H]` bias) into the `a` (first `H`
    /// rows) and `b` (next `H` rows) linears.
    fn packed(&self, d: &Dims, weight: &str, bias: &str) -> Result<(Linear, Linear)> {
        let both = self.linear(d, weight, Some(bias), Dim::TwoH, Dim::C)?;
        let (h, c) = (d.h, d.c);
        let mut w = both.weight;
        let wb = w.split_off(h * c);
        let (ba, bb) = match both.bias {
            Some(mut b) => {
                let bb = b.split_off(h);
                (Some(b), Some(bb))
            }
            None => (None, None),
        };
        Ok((Linear::new(w, ba, h, c), Linear::new(wb, bb, h, c)))
    }
}

/// Every required name of the layout's scheme is present, and no forbidden one.
fn check_complete(layout: &Layout) -> Result<()> {
    let names = layout.scheme.names();
    let missing: Vec<String> =
        names.required.iter().filter(|n| !layout.present.contains(*n)).map(|n| layout.full(n)).collect();
    if !missing.is_empty() {
        return Err(Error::Weights(format!(
            "missing tensor(s) {} of the {} naming scheme (it needs {})",
            list(&missing, 16),
            layout.scheme,
            list(names.required, 16)
        )));
    }
    if let Some(bias) = names.forbidden.iter().find(|n| layout.present.contains(*n)) {
        return Err(Error::Weights(format!(
            "`{}` is present, but the gpumode formulation has no linear biases",
            layout.full(bias)
        )));
    }
    Ok(())
}

/// Prefixes the message of a content error with where the content came from.
fn in_file(path: &str, e: Error) -> Error {
    match e {
        Error::Weights(m) => Error::Weights(format!("{path}: {m}")),
        Error::Dtype(m) => Error::Dtype(format!("{path}: {m}")),
        Error::Shape(m) => Error::Shape(format!("{path}: {m}")),
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{path}: {m}")),
        other => other,
    }
}

fn file_err(path: &str, reason: impl fmt::Display) -> Error {
    Error::File { path: path.to_string(), reason: reason.to_string() }
}

const IN_MEMORY: &str = "<in-memory safetensors>";

/// One layer out of an open safetensors file: only its tensors are read.
fn load_weights<R: Read + Seek>(mut file: TensorFile<R>, prefix: Option<&str>) -> Result<Weights> {
    let names = file.meta.offset_keys();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let layout = find_layout(&names, prefix)?;
    LayerReader::load(layout, &mut file)?.weights()
}

fn load_weights_from_path(path: &Path, prefix: Option<&str>) -> Result<Weights> {
    let origin = path.display().to_string();
    load_weights(TensorFile::open(path)?, prefix).map_err(|e| in_file(&origin, e))
}

fn load_weights_from_bytes(bytes: &[u8], prefix: Option<&str>) -> Result<Weights> {
    load_weights(TensorFile::from_bytes(bytes, IN_MEMORY)?, prefix)
}

// ---------------------------------------------------------------------------------------------
// Weights: writing
// ---------------------------------------------------------------------------------------------

/// An f32 tensor ready for `safetensors::serialize`.
struct F32Tensor {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl F32Tensor {
    fn new(shape: Vec<usize>, data: &[f32]) -> Self {
        F32Tensor { shape, bytes: data.iter().flat_map(|v| v.to_le_bytes()).collect() }
    }
}

impl View for F32Tensor {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Rows `[a; b]` of two `[H, C]` linears as one `[2H, C]` weight and, when either has a bias,
/// one `[2H]` bias. A missing half of the bias is written as zeros, which computes the same.
fn pack(a: &Linear, b: &Linear) -> (Vec<f32>, Option<Vec<f32>>) {
    let w = [a.weight.as_slice(), b.weight.as_slice()].concat();
    let bias = (a.bias.is_some() || b.bias.is_some()).then(|| {
        let half = |l: &Linear| l.bias.clone().unwrap_or_else(|| vec![0.0; l.out_features]);
        [half(a), half(b)].concat()
    });
    (w, bias)
}

impl Weights {
    /// Reads one layer from a safetensors file, inferring the naming scheme, formulation, `C`
    /// and `H` (see the [module docs](crate::io) for the accepted names).
    pub fn from_safetensors(path: impl AsRef<Path>) -> Result<Weights> {
        load_weights_from_path(path.as_ref(), None)
    }

    /// Reads the layer whose tensor names start with `prefix` (a trailing `.` is added when
    /// missing); tensors outside the prefix are ignored. For files holding several layers.
    pub fn from_safetensors_with_prefix(path: impl AsRef<Path>, prefix: &str) -> Result<Weights> {
        load_weights_from_path(path.as_ref(), Some(prefix))
    }

    /// [`Weights::from_safetensors`] on the bytes of a safetensors file.
    pub fn from_safetensors_bytes(bytes: &[u8]) -> Result<Weights> {
        load_weights_from_bytes(bytes, None)
    }

    /// [`Weights::from_safetensors_with_prefix`] on the bytes of a safetensors file.
    pub fn from_safetensors_bytes_with_prefix(bytes: &[u8], prefix: &str) -> Result<Weights> {
        load_weights_from_bytes(bytes, Some(prefix))
    }

    /// Writes these weights as F32 tensors under `scheme`, which must name this formulation.
    pub fn to_safetensors(&self, path: impl AsRef<Path>, scheme: NamingScheme) -> Result<()> {
        let bytes = self.to_safetensors_bytes(scheme)?;
        write_atomically(path.as_ref(), |w| w.write_all(&bytes))
    }

    /// The bytes of the safetensors file [`Weights::to_safetensors`] writes.
    pub fn to_safetensors_bytes(&self, scheme: NamingScheme) -> Result<Vec<u8>> {
        // Fields are public, so they may have changed since construction.
        self.validate()?;
        let tensors = self.named_tensors(scheme)?;
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize(tensors, Some(metadata))
            .map_err(|e| file_err(IN_MEMORY, format!("cannot serialize weights: {e}")))
    }

    fn named_tensors(&self, scheme: NamingScheme) -> Result<Vec<(String, F32Tensor)>> {
        if scheme.formulation() != self.formulation() {
            return Err(Error::InvalidArgument(format!(
                "the {scheme} naming scheme holds {} weights, these are {}",
                scheme.formulation(),
                self.formulation()
            )));
        }
        let Config { c, h, .. } = self.config();
        let mut out = Collector { scheme, tensors: Vec::new() };
        match scheme {
            NamingScheme::GpuMode => {
                out.norm("norm", &self.norm_in);
                out.linear("left_proj", &self.left_proj);
                out.linear("right_proj", &self.right_proj);
                out.linear("left_gate", &self.left_gate);
                out.linear("right_gate", &self.right_gate);
                out.linear("out_gate", &self.out_gate);
                out.norm("to_out_norm", &self.norm_out);
                out.linear("to_out", &self.out_proj);
            }
            NamingScheme::Packed | NamingScheme::CuEquivarianceFunctional => {
                out.norm("norm_in", &self.norm_in);
                for (module, a, b) in
                    [("p_in", &self.left_proj, &self.right_proj), ("g_in", &self.left_gate, &self.right_gate)]
                {
                    let (w, bias) = pack(a, b);
                    out.put(module, "weight", vec![2 * h, c], &w);
                    if let Some(bias) = bias {
                        out.put(module, "bias", vec![2 * h], &bias);
                    }
                }
                out.norm("norm_out", &self.norm_out);
                out.linear("p_out", &self.out_proj);
                out.linear("g_out", &self.out_gate);
            }
            NamingScheme::OpenFold => {
                out.norm("layer_norm_in", &self.norm_in);
                out.linear("linear_a_p", &self.left_proj);
                out.linear("linear_a_g", &self.left_gate);
                out.linear("linear_b_p", &self.right_proj);
                out.linear("linear_b_g", &self.right_gate);
                out.norm("layer_norm_out", &self.norm_out);
                out.linear("linear_z", &self.out_proj);
                out.linear("linear_g", &self.out_gate);
            }
        }
        Ok(out.tensors)
    }
}

/// Named tensors of one scheme, gathered for serialization.
struct Collector {
    scheme: NamingScheme,
    tensors: Vec<(String, F32Tensor)>,
}

impl Collector {
    fn put(&mut self, module: &str, param: &str, shape: Vec<usize>, data: &[f32]) {
        self.tensors.push((self.scheme.key(module, param), F32Tensor::new(shape, data)));
    }

    fn norm(&mut self, module: &str, n: &Norm) {
        self.put(module, "weight", vec![n.weight.len()], &n.weight);
        self.put(module, "bias", vec![n.bias.len()], &n.bias);
    }

    fn linear(&mut self, module: &str, l: &Linear) {
        self.put(module, "weight", vec![l.out_features, l.in_features], &l.weight);
        if let Some(b) = &l.bias {
            self.put(module, "bias", vec![l.out_features], b);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pair tensors: streamed files
// ---------------------------------------------------------------------------------------------

/// Bytes read or written per step when streaming a tensor.
const CHUNK_BYTES: usize = 1 << 20;

/// The safetensors crate's own header limit; a larger length means a corrupt file.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// An open safetensors file (or the bytes of one) whose header has been parsed (by the
/// safetensors crate's own `Metadata` deserializer, which also checks that offsets are contiguous
/// and sizes match the dtypes) and checked against the file's size; its data is read on demand.
/// Nothing is read that the header does not declare, and the header's own length is bounded.
struct TensorFile<R = File> {
    path: String,
    file: R,
    data_start: u64,
    meta: Metadata,
}

impl TensorFile<File> {
    fn open(path: &Path) -> Result<Self> {
        let (file, len) = files::open_regular(path, "safetensors file")?;
        TensorFile::new(file, len, path.display().to_string())
    }
}

impl<'a> TensorFile<std::io::Cursor<&'a [u8]>> {
    fn from_bytes(bytes: &'a [u8], label: &str) -> Result<Self> {
        TensorFile::new(std::io::Cursor::new(bytes), bytes.len() as u64, label.to_string())
    }
}

impl<R: Read + Seek> TensorFile<R> {
    /// Reads and checks the header of the `len`-byte file `file`, positioned at its start.
    fn new(mut file: R, len: u64, p: String) -> Result<Self> {
        if len < 8 {
            return Err(file_err(
                &p,
                format!("{len} bytes is too short for a safetensors file (it starts with an 8-byte header length)"),
            ));
        }
        let mut n8 = [0u8; 8];
        file.read_exact(&mut n8).map_err(|e| file_err(&p, format!("cannot read the header length: {e}")))?;
        let n = u64::from_le_bytes(n8);
        if n > MAX_HEADER_BYTES || n > len - 8 {
            return Err(file_err(&p, format!("not a safetensors file: header length {n} in a {len}-byte file")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(|e| file_err(&p, format!("cannot read the header: {e}")))?;
        check_unique_names(&header).map_err(|m| file_err(&p, m))?;
        let meta: Metadata = serde_json::from_slice(&header)
            .map_err(|e| file_err(&p, format!("not a safetensors file: bad header: {e}")))?;
        let data_start = 8 + n;
        let described = data_start.saturating_add(meta.data_len() as u64);
        if described > len {
            return Err(file_err(
                &p,
                format!("the header describes {described} bytes but the file has {len}: truncated or corrupt"),
            ));
        }
        if described < len {
            return Err(file_err(
                &p,
                format!(
                    "the header describes {described} bytes but the file has {len}: {} bytes after the last tensor \
                     (not a safetensors file, or a corrupt one)",
                    len - described
                ),
            ));
        }
        Ok(TensorFile { path: p, file, data_start, meta })
    }

    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.meta.info(name).cloned()
    }

    fn require(&self, name: &str) -> Result<TensorInfo> {
        self.info(name).ok_or_else(|| {
            let mut names = self.meta.offset_keys();
            names.sort_unstable();
            file_err(&self.path, format!("no tensor `{}` (tensors: {})", shown(name), list(&names, 8)))
        })
    }

    /// Feeds the tensor's bytes to `sink` in chunks of whole elements of `elem` bytes.
    fn stream(&mut self, info: &TensorInfo, elem: usize, mut sink: impl FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let (start, end) = info.data_offsets;
        let read_err = |e: std::io::Error| file_err(&self.path, format!("read failed: {e}"));
        self.file.seek(SeekFrom::Start(self.data_start + start as u64)).map_err(read_err)?;
        let step = (CHUNK_BYTES / elem).max(1) * elem;
        let mut remaining = end - start;
        let mut buf = vec![0u8; step.min(remaining)];
        while remaining > 0 {
            let k = step.min(remaining);
            self.file.read_exact(&mut buf[..k]).map_err(read_err)?;
            sink(&buf[..k])?;
            remaining -= k;
        }
        Ok(())
    }

    fn read_floats(&mut self, name: &str, info: &TensorInfo) -> Result<Vec<f32>> {
        let elem = float_size(info.dtype).ok_or_else(|| {
            Error::Dtype(format!("{}: tensor `{}` is {}; expected {FLOAT_DTYPES}", self.path, shown(name), info.dtype))
        })?;
        // The file's shape decides the size: a failed reservation is an error, not an abort.
        let len: usize = info.shape.iter().product();
        let mut out = Vec::new();
        reserve_values(&mut out, len, name, &self.path)?;
        self.stream(info, elem, |bytes| {
            decode_floats(info.dtype, bytes, &mut out);
            Ok(())
        })?;
        Ok(out)
    }
}

/// Reserves room for `len` f32 values of tensor `name`, or returns the out-of-memory error that
/// names them and what the host has available ([`crate::hostmem`]).
fn reserve_values(out: &mut Vec<f32>, len: usize, name: &str, path: &str) -> Result<()> {
    crate::hostmem::try_reserve(out, len, &format!("{path}: tensor `{}` ({len} values as f32)", shown(name)))
}

/// Refuses a header that names a tensor twice. The safetensors crate's map keeps the last of two
/// equal names, so the first one's bytes would be unaccounted for and the file would read as
/// truncated or corrupt. A header that is not a JSON object passes here and is refused by the
/// full parse with its own message.
fn check_unique_names(header: &[u8]) -> std::result::Result<(), String> {
    struct Keys(Vec<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some(k) = map.next_key::<String>()? {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(V)
        }
    }
    let Ok(Keys(mut keys)) = serde_json::from_slice::<Keys>(header) else { return Ok(()) };
    keys.sort_unstable();
    match keys.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(format!(
            "the header names tensor `{}` twice; a safetensors file names each tensor once (corrupt or hand-edited \
             header)",
            w[0]
        )),
        None => Ok(()),
    }
}

/// Writes f32 tensors, streaming their bytes. The header is the safetensors crate's own
/// `Metadata` serialization, padded to 8 bytes as the crate pads it.
fn write_f32_file(path: &Path, tensors: &[(&str, Vec<usize>, &[f32])]) -> Result<()> {
    let p = path.display().to_string();
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let bytes = data.len() * 4;
        infos.push((
            name.to_string(),
            TensorInfo { dtype: Dtype::F32, shape: shape.clone(), data_offsets: (offset, offset + bytes) },
        ));
        offset += bytes;
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let meta = Metadata::new(Some(metadata), infos).map_err(|e| file_err(&p, format!("bad tensor layout: {e}")))?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| file_err(&p, format!("cannot encode the header: {e}")))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    write_atomically(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut buf = Vec::with_capacity(CHUNK_BYTES);
        for (_, _, data) in tensors {
            for chunk in data.chunks(CHUNK_BYTES / 4) {
                buf.clear();
                buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                w.write_all(&buf)?;
            }
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Pair tensors: public API
// ---------------------------------------------------------------------------------------------

/// The input of a forward call: `x` `[B, N, N, C]` and the optional `mask` `[B, N, N]` of 0/1
/// values, row-major, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct PairInput {
    /// `[B, N, N, C]`.
    pub x: Vec<f32>,
    /// `[B, N, N]` of 0/1 values, when the file has one.
    pub mask: Option<Vec<f32>>,
    /// Batch size B.
    pub batch: usize,
    /// Sequence length N.
    pub n: usize,
    /// Pair channels C.
    pub c: usize,
}

/// `B·N·N` and `B·N·N·C`, or a shape error when they overflow.
fn pair_sizes(batch: usize, n: usize, c: usize) -> Result<(usize, usize)> {
    let rows = batch.checked_mul(n).and_then(|v| v.checked_mul(n));
    let elems = rows.and_then(|r| r.checked_mul(c));
    match (rows, elems) {
        (Some(r), Some(e)) => Ok((r, e)),
        _ => Err(Error::Shape(format!("B={batch} N={n} C={c} overflows the address space"))),
    }
}

/// Position `[b, i, j]` of flat mask index `k`.
fn mask_position(k: usize, n: usize) -> String {
    format!("[{}, {}, {}]", k / (n * n), (k / n) % n, k % n)
}

fn check_mask_values(mask: &[f32], n: usize) -> Result<()> {
    if let Some(k) = mask.iter().position(|&v| v != 0.0 && v != 1.0) {
        return Err(Error::InvalidArgument(format!(
            "mask{} = {}; mask values must be 0 or 1",
            mask_position(k, n),
            mask[k]
        )));
    }
    Ok(())
}

impl PairInput {
    /// Validated construction: lengths match the shape, the mask holds only 0 and 1.
    pub fn new(x: Vec<f32>, mask: Option<Vec<f32>>, batch: usize, n: usize, c: usize) -> Result<Self> {
        let input = PairInput { x, mask, batch, n, c };
        input.validate()?;
        Ok(input)
    }

    /// Checks lengths against `batch`, `n` and `c`, and that the mask holds only 0 and 1.
    pub fn validate(&self) -> Result<()> {
        let (b, n, c) = (self.batch, self.n, self.c);
        if b == 0 || n == 0 || c == 0 {
            return Err(Error::Shape(format!("B={b} N={n} C={c}: every dimension must be at least 1")));
        }
        let (rows, elems) = pair_sizes(b, n, c)?;
        if self.x.len() != elems {
            return Err(Error::Shape(format!(
                "x has {} elements, expected B·N·N·C = {b}·{n}·{n}·{c} = {elems}",
                self.x.len()
            )));
        }
        if let Some(m) = &self.mask {
            if m.len() != rows {
                return Err(Error::Shape(format!(
                    "mask has {} elements, expected B·N·N = {b}·{n}·{n} = {rows}",
                    m.len()
                )));
            }
            check_mask_values(m, n)?;
        }
        Ok(())
    }

    /// Batch and sequence length.
    pub fn shape(&self) -> Shape {
        Shape::new(self.batch, self.n)
    }
}

/// Reads `x` as `[B, N, N, C]` (rank 3 means `B = 1`) from `path`'s tensor `name`.
fn pair_shape(path: &str, name: &str, shape: &[usize]) -> Result<[usize; 4]> {
    let dims = match *shape {
        [b, n1, n2, c] => [b, n1, n2, c],
        [n1, n2, c] => [1, n1, n2, c],
        _ => {
            return Err(Error::Shape(format!(
                "{path}: `{name}` has shape {} (rank {}), expected [B, N, N, C] or [N, N, C]",
                shape_str(shape),
                shape.len()
            )))
        }
    };
    if dims[1] != dims[2] {
        return Err(Error::Shape(format!(
            "{path}: `{name}` has shape {}, whose pair dimensions {} and {} differ (expected N × N)",
            shape_str(shape),
            dims[1],
            dims[2]
        )));
    }
    if dims.contains(&0) {
        return Err(Error::Shape(format!(
            "{path}: `{}` has shape {}, with an empty dimension",
            shown(name),
            shape_str(shape)
        )));
    }
    Ok(dims)
}

/// Appends the 0/1 mask values in `bytes` to `out`; on any other value, returns its index in
/// `bytes`' elements and its printed form.
fn decode_mask(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> std::result::Result<(), (usize, String)> {
    fn push01<T: PartialEq + Default + fmt::Display>(
        out: &mut Vec<f32>,
        vals: impl Iterator<Item = T>,
        one: T,
    ) -> std::result::Result<(), (usize, String)> {
        for (k, v) in vals.enumerate() {
            if v == T::default() {
                out.push(0.0);
            } else if v == one {
                out.push(1.0);
            } else {
                return Err((k, v.to_string()));
            }
        }
        Ok(())
    }
    match dtype {
        Dtype::BOOL => push01(out, bytes.iter().copied(), 1u8).map_err(|(k, v)| (k, format!("{v} (not a valid bool)"))),
        Dtype::U8 => push01(out, bytes.iter().copied(), 1u8),
        Dtype::I32 => push01(out, bytes.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])), 1),
        Dtype::I64 => push01(
            out,
            bytes.chunks_exact(8).map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])),
            1,
        ),
        _ => {
            let mut vals = Vec::with_capacity(bytes.len() / 2);
            decode_floats(dtype, bytes, &mut vals);
            push01(out, vals.into_iter(), 1.0f32)
        }
    }
}

/// Element size of the dtypes a mask may have.
fn mask_elem_size(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::BOOL | Dtype::U8 => Some(1),
        Dtype::I32 => Some(4),
        Dtype::I64 => Some(8),
        d => float_size(d),
    }
}

/// Reads `x` and the optional `mask` from a safetensors file (shapes and dtypes in the
/// [module docs](crate::io)).
pub fn read_input(path: impl AsRef<Path>) -> Result<PairInput> {
    read_pair_input(TensorFile::open(path.as_ref())?)
}

/// [`read_input`] on the bytes of a safetensors file.
pub fn read_input_bytes(bytes: &[u8]) -> Result<PairInput> {
    read_pair_input(TensorFile::from_bytes(bytes, IN_MEMORY)?)
}

fn read_pair_input<R: Read + Seek>(mut f: TensorFile<R>) -> Result<PairInput> {
    let p = f.path.clone();
    let xi = f.require("x")?;
    let [batch, n, _, c] = pair_shape(&p, "x", &xi.shape)?;
    let mask_info = f.info("mask");
    // Check the mask's shape and dtype before reading gigabytes of `x`.
    let mask_elem = match &mask_info {
        Some(mi) => {
            let ok = match *mi.shape.as_slice() {
                [b, n1, n2] => b == batch && n1 == n && n2 == n,
                [n1, n2] => batch == 1 && n1 == n && n2 == n,
                _ => false,
            };
            if !ok {
                return Err(Error::Shape(format!(
                    "{p}: `mask` has shape {} but `x` has shape {}; the mask must be [B, N, N] = [{batch}, {n}, {n}]{}",
                    shape_str(&mi.shape),
                    shape_str(&xi.shape),
                    if batch == 1 { format!(" or [N, N] = [{n}, {n}]") } else { String::new() }
                )));
            }
            Some(mask_elem_size(mi.dtype).ok_or_else(|| {
                Error::Dtype(format!(
                    "{p}: tensor `mask` is {}; expected {FLOAT_DTYPES}, BOOL, U8, I32 or I64",
                    mi.dtype
                ))
            })?)
        }
        None => None,
    };
    let x = f.read_floats("x", &xi)?;
    let mask = match (mask_info, mask_elem) {
        (Some(mi), Some(elem)) => {
            let mut out = Vec::new();
            reserve_values(&mut out, batch * n * n, "mask", &p)?;
            f.stream(&mi, elem, |bytes| {
                let base = out.len();
                decode_mask(mi.dtype, bytes, &mut out).map_err(|(k, v)| {
                    Error::InvalidArgument(format!(
                        "{p}: mask{} = {v}; mask values must be 0 or 1",
                        mask_position(base + k, n)
                    ))
                })
            })?;
            Some(out)
        }
        _ => None,
    };
    let input = PairInput { x, mask, batch, n, c };
    input.validate().map_err(|e| in_file(&p, e))?;
    Ok(input)
}

/// Writes `x` (`[B, N, N, C]`, F32) and, when present, `mask` (`[B, N, N]`, F32).
pub fn write_input(path: impl AsRef<Path>, input: &PairInput) -> Result<()> {
    input.validate()?;
    let PairInput { batch: b, n, c, .. } = *input;
    let mut tensors: Vec<(&str, Vec<usize>, &[f32])> = vec![("x", vec![b, n, n, c], &input.x)];
    if let Some(m) = &input.mask {
        tensors.push(("mask", vec![b, n, n], m));
    }
    write_f32_file(path.as_ref(), &tensors)
}

/// Writes `y` (`[B, N, N, C]`, F32).
pub fn write_output(path: impl AsRef<Path>, y: &[f32], batch: usize, n: usize, c: usize) -> Result<()> {
    let (_, elems) = pair_sizes(batch, n, c)?;
    if y.len() != elems {
        return Err(Error::Shape(format!(
            "y has {} elements, expected B·N·N·C = {batch}·{n}·{n}·{c} = {elems}",
            y.len()
        )));
    }
    write_f32_file(path.as_ref(), &[("y", vec![batch, n, n, c], y)])
}

/// Reads `y` and its shape `[B, N, N, C]` (a rank-3 `[N, N, C]` tensor reads as `B = 1`).
pub fn read_output(path: impl AsRef<Path>) -> Result<(Vec<f32>, [usize; 4])> {
    let mut f = TensorFile::open(path.as_ref())?;
    let yi = f.require("y")?;
    let dims = pair_shape(&f.path, "y", &yi.shape)?;
    let y = f.read_floats("y", &yi)?;
    Ok((y, dims))
}
