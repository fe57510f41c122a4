//! The naming schemes of layer weights ([`NamingScheme`], names and shapes in the
//! [module docs](crate::io)) and finding one layer among a file's tensor names: its prefix, its
//! scheme and which of the scheme's names are present.

use std::collections::{BTreeMap, BTreeSet};

use super::messages::list;
use crate::error::{Error, Result};
use crate::named::named_enum;
use crate::problem::Formulation;

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
pub(super) struct SchemeNames {
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
    pub(super) fn key(self, module: &str, param: &str) -> String {
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

named_enum!(NamingScheme, "naming scheme", [
    GpuMode => "gpumode" | "gpu-mode" | "gpu_mode" | "lucidrains",
    Packed => "packed" | "cuequivariance" | "cueq" | "boltz",
    CuEquivarianceFunctional => "functional" | "cuequivariance-functional" | "cueq-functional",
    OpenFold => "openfold" | "af2",
]);

// ---------------------------------------------------------------------------------------------
// Finding the layer in a file: prefix, scheme, names
// ---------------------------------------------------------------------------------------------

/// One layer's tensors in a file: the prefix shared by their names, their scheme and the
/// scheme-local names present.
pub(super) struct Layout {
    pub(super) prefix: String,
    pub(super) scheme: NamingScheme,
    pub(super) present: BTreeSet<&'static str>,
}

impl Layout {
    pub(super) fn full(&self, local: &str) -> String {
        format!("{}{local}", self.prefix)
    }
}

/// Splits `name` into (prefix, scheme, local name) when it ends in a name some scheme
/// recognises, at a `.` boundary. No recognised name ends in `.` + another recognised name, so
/// the split is unique.
pub(super) fn split_known(name: &str) -> Option<(&str, NamingScheme, &'static str)> {
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

pub(super) fn find_layout(names: &[&str], prefix: Option<&str>) -> Result<Layout> {
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

/// Every required name of the layout's scheme is present, and no forbidden one.
pub(super) fn check_complete(layout: &Layout) -> Result<()> {
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
