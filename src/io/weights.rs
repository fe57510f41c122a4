//! One layer's weights read from a safetensors file (any scheme, `C` and `H` inferred from the
//! shapes) and written under a chosen scheme.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, Write};
use std::path::Path;

use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, View};

use super::files::write_atomically;
use super::messages::{file_err, in_file, shape_str, shown};
use super::names::{check_complete, find_layout, Layout, NamingScheme};
use super::tensor_file::{float_size, TensorFile, FLOAT_DTYPES, IN_MEMORY};
use crate::error::{Error, Result};
use crate::problem::{Config, Formulation};
use crate::weights::{Linear, Norm, Weights};

// ---------------------------------------------------------------------------------------------
// Weights: reading
// ---------------------------------------------------------------------------------------------

/// The module names of the gpumode scheme, which names every module on its own: LN_C, the five
/// input linears, LN_H and the output projection, in [`Weights::new`]'s order.
const GPUMODE_MODULES: [&str; 8] =
    ["norm", "left_proj", "left_gate", "right_proj", "right_gate", "out_gate", "to_out_norm", "to_out"];

/// [`GPUMODE_MODULES`] in OpenFold's names.
const OPENFOLD_MODULES: [&str; 8] =
    ["layer_norm_in", "linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g", "linear_g", "layer_norm_out", "linear_z"];

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
        match scheme {
            NamingScheme::GpuMode => self.separate(GPUMODE_MODULES, false),
            NamingScheme::Packed | NamingScheme::CuEquivarianceFunctional => {
                let k = |m: &str, p: &str| scheme.key(m, p);
                let d = self.anchor(&k("p_in", "weight"), 2)?;
                let config = self.config(&d)?;
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
            NamingScheme::OpenFold => self.separate(OPENFOLD_MODULES, true),
        }
    }

    /// The configuration of the scheme's formulation with the sizes in `d`.
    fn config(&self, d: &Dims) -> Result<Config> {
        Config::new(self.layout.scheme.formulation(), d.c, d.h)
            .map_err(|e| Error::Weights(format!("{}: {e}", d.source)))
    }

    /// A layer whose scheme names every module on its own, `<module>.weight` and `<module>.bias`
    /// ([`GPUMODE_MODULES`], [`OPENFOLD_MODULES`]); the linears' biases are read when `biases` (a
    /// gpumode bias is rejected as forbidden before this).
    fn separate(&self, modules: [&str; 8], biases: bool) -> Result<Weights> {
        let [norm_in, left_proj, left_gate, right_proj, right_gate, out_gate, norm_out, out_proj] = modules;
        let d = self.anchor(&format!("{left_proj}.weight"), 1)?;
        let config = self.config(&d)?;
        let norm = |m: &str, width| self.norm(&d, &format!("{m}.weight"), &format!("{m}.bias"), width);
        let lin = |m: &str, out, inp| {
            let bias = biases.then(|| format!("{m}.bias"));
            self.linear(&d, &format!("{m}.weight"), bias.as_deref(), out, inp)
        };
        // The output gate is `[H, C]` in the gpumode formulation, `[C, C]` in af3.
        let gate = if config.formulation == Formulation::GpuMode { Dim::H } else { Dim::C };
        Weights::new(
            config,
            norm(norm_in, Dim::C)?,
            lin(left_proj, Dim::H, Dim::C)?,
            lin(left_gate, Dim::H, Dim::C)?,
            lin(right_proj, Dim::H, Dim::C)?,
            lin(right_gate, Dim::H, Dim::C)?,
            lin(out_gate, gate, Dim::C)?,
            norm(norm_out, Dim::H)?,
            lin(out_proj, Dim::C, Dim::H)?,
        )
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
            NamingScheme::GpuMode => out.separate(GPUMODE_MODULES, self),
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
            NamingScheme::OpenFold => out.separate(OPENFOLD_MODULES, self),
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

    /// Every tensor of `w` under `modules` ([`GPUMODE_MODULES`], [`OPENFOLD_MODULES`]).
    fn separate(&mut self, modules: [&str; 8], w: &Weights) {
        let [norm_in, inputs @ .., norm_out, out_proj] = modules;
        self.norm(norm_in, &w.norm_in);
        for (module, l) in inputs.into_iter().zip(w.input_linears()) {
            self.linear(module, l);
        }
        self.norm(norm_out, &w.norm_out);
        self.linear(out_proj, &w.out_proj);
    }
}
