//! safetensors I/O: every naming scheme both ways, files written by the safetensors crate itself
//! (so our writer cannot hide a reader bug), half-precision weights, prefixes, and each documented
//! error. C = 16 and H = 8 differ so that a swapped dimension cannot pass.

use std::borrow::Cow;
use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors, View};
use trimul::io::{read_input, read_output, write_input, write_output};
use trimul::{Config, Error, Formulation, Linear, NamingScheme, Norm, PairInput, Shape, Weights};

#[path = "support/safetensors_bytes.rs"]
mod safetensors_bytes;
use safetensors_bytes::with_tensor_named_twice;

const C: usize = 16;
const H: usize = 8;

// ---- helpers ---------------------------------------------------------------------------------

/// A raw tensor of any dtype, for files built with `safetensors::serialize` directly.
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn raw_f32(shape: &[usize], v: &[f32]) -> Raw {
    Raw { dtype: Dtype::F32, shape: shape.to_vec(), bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
}

fn raw_as(dtype: Dtype, shape: &[usize], v: &[f32]) -> Raw {
    let bytes = match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::F64 => v.iter().flat_map(|x| (*x as f64).to_le_bytes()).collect(),
        Dtype::I32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
        Dtype::I64 => v.iter().flat_map(|x| (*x as i64).to_le_bytes()).collect(),
        Dtype::U8 | Dtype::BOOL | Dtype::I8 => v.iter().map(|x| *x as u8).collect(),
        other => panic!("test helper has no encoder for {other}"),
    };
    Raw { dtype, shape: shape.to_vec(), bytes }
}

/// (name, shape, values) of a layer's tensors.
type Named = Vec<(String, Vec<usize>, Vec<f32>)>;

fn serialize(tensors: Vec<(String, Raw)>) -> Vec<u8> {
    safetensors::serialize(tensors, None).expect("serialize test tensors")
}

fn serialize_named(named: &Named, dtype: Dtype) -> Vec<u8> {
    serialize(named.iter().map(|(n, s, v)| (n.clone(), raw_as(dtype, s, v))).collect())
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("io-tests");
    std::fs::create_dir_all(&dir).expect("create test dir");
    dir.join(name)
}

fn gpumode() -> Weights {
    Weights::random(Config::new(Formulation::GpuMode, C, H).unwrap(), false, 11).unwrap()
}

fn af3(biases: bool) -> Weights {
    Weights::random(Config::new(Formulation::Af3, C, H).unwrap(), biases, 12).unwrap()
}

fn push_linear(out: &mut Named, weight: &str, bias: &str, l: &Linear) {
    out.push((weight.into(), vec![l.out_features, l.in_features], l.weight.clone()));
    if let Some(b) = &l.bias {
        out.push((bias.into(), vec![l.out_features], b.clone()));
    }
}

fn push_norm(out: &mut Named, weight: &str, bias: &str, n: &Norm) {
    out.push((weight.into(), vec![n.weight.len()], n.weight.clone()));
    out.push((bias.into(), vec![n.bias.len()], n.bias.clone()));
}

// The test's own spelling of each scheme (a second implementation of the mapping, written from
// SPEC.md, independent of src/io.rs).

fn gpumode_named(w: &Weights) -> Named {
    let mut o = Named::new();
    push_norm(&mut o, "norm.weight", "norm.bias", &w.norm_in);
    let projections = [&w.left_proj, &w.right_proj, &w.left_gate, &w.right_gate, &w.out_gate];
    for (name, l) in ["left_proj", "right_proj", "left_gate", "right_gate", "out_gate"].into_iter().zip(projections) {
        push_linear(&mut o, &format!("{name}.weight"), "-", l);
    }
    push_norm(&mut o, "to_out_norm.weight", "to_out_norm.bias", &w.norm_out);
    push_linear(&mut o, "to_out.weight", "-", &w.out_proj);
    o
}

/// cuEquivariance/Boltz names; `sep` is "." for modules and "_" for the functional API.
fn packed_named(w: &Weights, sep: &str) -> Named {
    let n = |m: &str, p: &str| format!("{m}{sep}{p}");
    let mut o = Named::new();
    push_norm(&mut o, &n("norm_in", "weight"), &n("norm_in", "bias"), &w.norm_in);
    for (m, a, b) in [("p_in", &w.left_proj, &w.right_proj), ("g_in", &w.left_gate, &w.right_gate)] {
        // Rows [a; b]: a's H rows first.
        let mut rows = a.weight.clone();
        rows.extend_from_slice(&b.weight);
        o.push((n(m, "weight"), vec![2 * H, C], rows));
        if let (Some(ba), Some(bb)) = (&a.bias, &b.bias) {
            let mut bias = ba.clone();
            bias.extend_from_slice(bb);
            o.push((n(m, "bias"), vec![2 * H], bias));
        }
    }
    push_norm(&mut o, &n("norm_out", "weight"), &n("norm_out", "bias"), &w.norm_out);
    push_linear(&mut o, &n("p_out", "weight"), &n("p_out", "bias"), &w.out_proj);
    push_linear(&mut o, &n("g_out", "weight"), &n("g_out", "bias"), &w.out_gate);
    o
}

fn openfold_named(w: &Weights) -> Named {
    let mut o = Named::new();
    let linear =
        |o: &mut Named, name: &str, l: &Linear| push_linear(o, &format!("{name}.weight"), &format!("{name}.bias"), l);
    push_norm(&mut o, "layer_norm_in.weight", "layer_norm_in.bias", &w.norm_in);
    let inputs = [&w.left_proj, &w.left_gate, &w.right_proj, &w.right_gate];
    for (name, l) in ["linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g"].into_iter().zip(inputs) {
        linear(&mut o, name, l);
    }
    push_norm(&mut o, "layer_norm_out.weight", "layer_norm_out.bias", &w.norm_out);
    linear(&mut o, "linear_z", &w.out_proj);
    linear(&mut o, "linear_g", &w.out_gate);
    o
}

fn named_for(w: &Weights, scheme: NamingScheme) -> Named {
    match scheme {
        NamingScheme::GpuMode => gpumode_named(w),
        NamingScheme::Packed => packed_named(w, "."),
        NamingScheme::CuEquivarianceFunctional => packed_named(w, "_"),
        NamingScheme::OpenFold => openfold_named(w),
        other => panic!("no writer for {other:?} in this test"),
    }
}

/// Every (weights, scheme) pair the writer supports: gpumode, and af3 with and without biases
/// under each af3 scheme.
fn all_cases() -> Vec<(Weights, NamingScheme)> {
    let mut cases = vec![(gpumode(), NamingScheme::GpuMode)];
    for biases in [false, true] {
        for s in [NamingScheme::Packed, NamingScheme::CuEquivarianceFunctional, NamingScheme::OpenFold] {
            cases.push((af3(biases), s));
        }
    }
    cases
}

/// The same weights with every value passed through `f` (to model a lossy dtype).
fn map_weights(w: &Weights, f: impl Fn(f32) -> f32) -> Weights {
    let v = |x: &Vec<f32>| x.iter().map(|&a| f(a)).collect::<Vec<f32>>();
    let lin = |l: &Linear| Linear::new(v(&l.weight), l.bias.as_ref().map(v), l.out_features, l.in_features);
    let norm = |n: &Norm| Norm { weight: v(&n.weight), bias: v(&n.bias) };
    Weights::new(
        w.config(),
        norm(&w.norm_in),
        lin(&w.left_proj),
        lin(&w.left_gate),
        lin(&w.right_proj),
        lin(&w.right_gate),
        lin(&w.out_gate),
        norm(&w.norm_out),
        lin(&w.out_proj),
    )
    .unwrap()
}

fn with(named: &Named, f: impl FnOnce(&mut Named)) -> Vec<u8> {
    let mut n = named.clone();
    f(&mut n);
    serialize_named(&n, Dtype::F32)
}

fn set_shape(named: &mut Named, name: &str, shape: &[usize]) {
    let t = named.iter_mut().find(|t| t.0 == name).unwrap_or_else(|| panic!("no {name}"));
    t.1 = shape.to_vec();
    t.2 = vec![0.25; shape.iter().product()];
}

fn weights_err(bytes: &[u8]) -> String {
    match Weights::from_safetensors_bytes(bytes) {
        Ok(_) => panic!("expected an error"),
        Err(Error::Weights(m)) => m,
        Err(other) => panic!("expected Error::Weights, got {other:?}"),
    }
}

// ---- weights ---------------------------------------------------------------------------------

#[test]
fn round_trip_every_scheme() {
    for (w, scheme) in all_cases() {
        let bytes = w.to_safetensors_bytes(scheme).unwrap();
        let back = Weights::from_safetensors_bytes(&bytes).unwrap();
        assert_eq!(back, w, "{scheme} biases={}", w.has_biases());
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(NamingScheme::detect(&st.names()).unwrap(), scheme);
    }
}

#[test]
fn round_trip_through_files() {
    for (i, (w, scheme)) in all_cases().into_iter().enumerate() {
        let path = tmp(&format!("weights-{i}-{scheme}.safetensors"));
        w.to_safetensors(&path, scheme).unwrap();
        assert_eq!(Weights::from_safetensors(&path).unwrap(), w, "{scheme}");
    }
}

#[test]
fn writer_uses_the_published_names_and_layout() {
    for (w, scheme) in all_cases() {
        let bytes = w.to_safetensors_bytes(scheme).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let expected = named_for(&w, scheme);
        let mut names = st.names();
        names.sort_unstable();
        let mut want: Vec<&str> = expected.iter().map(|t| t.0.as_str()).collect();
        want.sort_unstable();
        assert_eq!(names, want, "{scheme}");
        for (name, shape, values) in &expected {
            let t = st.tensor(name).unwrap();
            assert_eq!(t.dtype(), Dtype::F32, "{name}");
            assert_eq!(t.shape(), shape.as_slice(), "{name}");
            assert_eq!(t.data(), raw_f32(shape, values).bytes.as_slice(), "{name} values");
        }
    }
}

#[test]
fn files_built_by_the_safetensors_crate_load() {
    // Built with safetensors::serialize from the test's own mapping, not our writer.
    for (w, scheme) in all_cases() {
        let bytes = serialize_named(&named_for(&w, scheme), Dtype::F32);
        assert_eq!(Weights::from_safetensors_bytes(&bytes).unwrap(), w, "{scheme} biases={}", w.has_biases());
    }
}

#[test]
fn packed_rows_are_a_then_b() {
    // Distinct constant halves make the split visible without relying on any mapping helper.
    let w = af3(false);
    let mut named = packed_named(&w, ".");
    for (name, _, v) in named.iter_mut() {
        if name == "p_in.weight" || name == "g_in.weight" {
            let (a, b) = v.split_at_mut(H * C);
            a.fill(1.0);
            b.fill(-2.0);
        }
    }
    named.push(("p_in.bias".into(), vec![2 * H], (0..2 * H).map(|i| i as f32).collect()));
    let got = Weights::from_safetensors_bytes(&serialize_named(&named, Dtype::F32)).unwrap();
    assert!(got.left_proj.weight.iter().all(|&v| v == 1.0));
    assert!(got.left_gate.weight.iter().all(|&v| v == 1.0));
    assert!(got.right_proj.weight.iter().all(|&v| v == -2.0));
    assert!(got.right_gate.weight.iter().all(|&v| v == -2.0));
    assert_eq!(got.left_proj.bias.as_deref(), Some(&(0..H).map(|i| i as f32).collect::<Vec<_>>()[..]));
    assert_eq!(got.right_proj.bias.as_deref(), Some(&(H..2 * H).map(|i| i as f32).collect::<Vec<_>>()[..]));
    assert_eq!(got.left_gate.bias, None);
}

#[test]
fn half_precision_and_f64_weights_load() {
    let round_f16 = |v: f32| half::f16::from_f32(v).to_f32();
    let round_bf16 = |v: f32| half::bf16::from_f32(v).to_f32();
    let g = gpumode();
    let got = Weights::from_safetensors_bytes(&serialize_named(&gpumode_named(&g), Dtype::F16)).unwrap();
    assert_eq!(got, map_weights(&g, round_f16));
    assert_ne!(got, g, "f16 rounding should be visible, or this test checks nothing");

    let a = af3(true);
    let got = Weights::from_safetensors_bytes(&serialize_named(&packed_named(&a, "."), Dtype::BF16)).unwrap();
    assert_eq!(got, map_weights(&a, round_bf16));
    let got = Weights::from_safetensors_bytes(&serialize_named(&openfold_named(&a), Dtype::F64)).unwrap();
    assert_eq!(got, a);

    // One file, several dtypes.
    let named = openfold_named(&a);
    let tensors = named
        .iter()
        .enumerate()
        .map(|(i, (n, s, v))| (n.clone(), raw_as([Dtype::F32, Dtype::F16, Dtype::BF16][i % 3], s, v)))
        .collect();
    let got = Weights::from_safetensors_bytes(&serialize(tensors)).unwrap();
    assert_eq!(got.norm_in.weight, a.norm_in.weight); // index 0: F32
    assert_eq!(got.norm_in.bias, a.norm_in.bias.iter().map(|&v| round_f16(v)).collect::<Vec<_>>());
}

#[test]
fn common_prefix_is_stripped() {
    let a = af3(true);
    let prefix = "pairformer_module.layers.0.tri_mul_out.";
    let named: Named = packed_named(&a, ".").into_iter().map(|(n, s, v)| (format!("{prefix}{n}"), s, v)).collect();
    let bytes = serialize_named(&named, Dtype::F32);
    assert_eq!(Weights::from_safetensors_bytes(&bytes).unwrap(), a);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(NamingScheme::detect(&st.names()).unwrap(), NamingScheme::Packed);
    // The explicit prefix, with or without its trailing dot, gives the same.
    assert_eq!(Weights::from_safetensors_bytes_with_prefix(&bytes, prefix).unwrap(), a);
    assert_eq!(Weights::from_safetensors_bytes_with_prefix(&bytes, prefix.trim_end_matches('.')).unwrap(), a);

    // The functional spelling under a prefix too.
    let named: Named = packed_named(&a, "_").into_iter().map(|(n, s, v)| (format!("m.{n}"), s, v)).collect();
    assert_eq!(Weights::from_safetensors_bytes(&serialize_named(&named, Dtype::F32)).unwrap(), a);
}

#[test]
fn several_layers_need_a_prefix() {
    let out_w = af3(true);
    let in_w = Weights::random(Config::new(Formulation::Af3, C, H).unwrap(), true, 99).unwrap();
    let mut named = Named::new();
    for (p, w) in [("layers.0.tri_mul_out.", &out_w), ("layers.0.tri_mul_in.", &in_w)] {
        named.extend(openfold_named(w).into_iter().map(|(n, s, v)| (format!("{p}{n}"), s, v)));
    }
    named.push(("layers.0.attention.weight".into(), vec![4], vec![1.0; 4]));
    let bytes = serialize_named(&named, Dtype::F32);
    let e = weights_err(&bytes);
    assert!(e.contains("layers.0.tri_mul_out.") && e.contains("layers.0.tri_mul_in."), "{e}");
    assert!(e.contains("prefix"), "{e}");

    let path = tmp("two-layers.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(Weights::from_safetensors_with_prefix(&path, "layers.0.tri_mul_in").unwrap(), in_w);
    assert_eq!(Weights::from_safetensors_with_prefix(&path, "layers.0.tri_mul_out.").unwrap(), out_w);

    // A prefix that selects more than one layer, or nothing.
    let e = Weights::from_safetensors_bytes_with_prefix(&bytes, "layers.0").unwrap_err().to_string();
    assert!(e.contains("not TriMul weights") && e.contains("layers.0.tri_mul_in."), "{e}");
    let e = Weights::from_safetensors_bytes_with_prefix(&bytes, "nope.").unwrap_err().to_string();
    assert!(e.contains("no tensor name starts with the prefix `nope.`"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let named = packed_named(&af3(false), ".");
    let e = weights_err(&with(&named, |n| n.retain(|t| t.0 != "g_in.weight")));
    assert!(e.contains("missing") && e.contains("`g_in.weight`"), "{e}");
    // With a prefix, the full name is reported.
    let prefixed: Named = gpumode_named(&gpumode())
        .into_iter()
        .filter(|t| t.0 != "to_out.weight")
        .map(|(n, s, v)| (format!("blk.{n}"), s, v))
        .collect();
    let e = weights_err(&serialize_named(&prefixed, Dtype::F32));
    assert!(e.contains("`blk.to_out.weight`"), "{e}");
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let named = packed_named(&af3(false), ".");
    let e = weights_err(&with(&named, |n| set_shape(n, "p_out.weight", &[C, C])));
    assert!(e.contains("`p_out.weight`") && e.contains("[16, 16]") && e.contains("[16, 8]"), "{e}");

    let e = weights_err(&with(&gpumode_named(&gpumode()), |n| set_shape(n, "norm.weight", &[1, C])));
    assert!(e.contains("`norm.weight`") && e.contains("[1, 16]") && e.contains("[16]"), "{e}");

    let e = weights_err(&with(&gpumode_named(&gpumode()), |n| set_shape(n, "left_proj.weight", &[H, C, 1])));
    assert!(e.contains("`left_proj.weight`") && e.contains("rank 3"), "{e}");

    let e = weights_err(&with(&named, |n| set_shape(n, "p_in.weight", &[2 * H - 1, C])));
    assert!(e.contains("`p_in.weight`") && e.contains("odd"), "{e}");

    // A bias of the wrong length.
    let e = weights_err(&with(&openfold_named(&af3(true)), |n| set_shape(n, "linear_z.bias", &[H])));
    assert!(e.contains("`linear_z.bias`") && e.contains("[8]") && e.contains("[16]"), "{e}");
}

#[test]
fn mismatched_h_between_tensors() {
    let e = weights_err(&with(&openfold_named(&af3(true)), |n| set_shape(n, "linear_b_g.weight", &[H + 1, C])));
    assert!(e.contains("`linear_b_g.weight`") && e.contains("[9, 16]") && e.contains("[8, 16]"), "{e}");
    assert!(e.contains("linear_a_p.weight"), "should say where H came from: {e}");

    let e = weights_err(&with(&gpumode_named(&gpumode()), |n| set_shape(n, "to_out_norm.weight", &[H + 2])));
    assert!(e.contains("`to_out_norm.weight`") && e.contains("[10]") && e.contains("[8]"), "{e}");

    let e = weights_err(&with(&packed_named(&af3(false), "_"), |n| set_shape(n, "g_in_weight", &[2 * H + 2, C])));
    assert!(e.contains("`g_in_weight`") && e.contains("[18, 16]"), "{e}");
}

#[test]
fn mixed_schemes_are_rejected() {
    let mut named = gpumode_named(&gpumode());
    named.push(("p_in.weight".into(), vec![2 * H, C], vec![0.0; 2 * H * C]));
    let e = weights_err(&serialize_named(&named, Dtype::F32));
    assert!(e.contains("mixed") && e.contains("gpumode") && e.contains("packed: `p_in.weight`"), "{e}");

    // Module and functional spellings of cuEquivariance in one file.
    let mut named = packed_named(&af3(false), ".");
    named.push(("g_out_bias".into(), vec![C], vec![0.0; C]));
    let e = weights_err(&serialize_named(&named, Dtype::F32));
    assert!(e.contains("mixed") && e.contains("`g_out_bias`"), "{e}");
}

#[test]
fn unknown_tensors_are_rejected() {
    let mut named = openfold_named(&af3(false));
    named.push(("linear_x.weight".into(), vec![H, C], vec![0.0; H * C]));
    let e = weights_err(&serialize_named(&named, Dtype::F32));
    assert!(e.contains("unknown") && e.contains("`linear_x.weight`"), "{e}");

    let e = weights_err(&serialize_named(&vec![("foo".into(), vec![2], vec![1.0, 2.0])], Dtype::F32));
    assert!(e.contains("no TriMul weight names") && e.contains("`foo`"), "{e}");
}

#[test]
fn unsupported_dtype_names_tensor() {
    let named = gpumode_named(&gpumode());
    let tensors = named
        .iter()
        .map(|(n, s, v)| (n.clone(), raw_as(if n == "left_gate.weight" { Dtype::I32 } else { Dtype::F32 }, s, v)))
        .collect();
    match Weights::from_safetensors_bytes(&serialize(tensors)) {
        Err(Error::Dtype(m)) => assert!(m.contains("`left_gate.weight`") && m.contains("I32"), "{m}"),
        other => panic!("expected Error::Dtype, got {other:?}"),
    }
}

#[test]
fn gpumode_bias_is_rejected() {
    let mut named = gpumode_named(&gpumode());
    named.push(("left_proj.bias".into(), vec![H], vec![0.0; H]));
    let e = weights_err(&serialize_named(&named, Dtype::F32));
    assert!(e.contains("`left_proj.bias`") && e.contains("no linear biases"), "{e}");
}

#[test]
fn file_errors_name_the_path() {
    let missing = tmp("does-not-exist.safetensors");
    match Weights::from_safetensors(&missing) {
        Err(Error::File { path, .. }) => assert!(path.contains("does-not-exist"), "{path}"),
        other => panic!("expected Error::File, got {other:?}"),
    }
    let garbage = tmp("garbage.safetensors");
    std::fs::write(&garbage, b"definitely not a safetensors file").unwrap();
    assert!(matches!(Weights::from_safetensors(&garbage), Err(Error::File { .. })));
    assert!(matches!(Weights::from_safetensors_bytes(&[1, 2, 3]), Err(Error::File { .. })));

    // Content errors from a path carry the path too.
    let bad = tmp("bad-shape.safetensors");
    std::fs::write(&bad, with(&gpumode_named(&gpumode()), |n| set_shape(n, "to_out.weight", &[H, C]))).unwrap();
    let e = Weights::from_safetensors(&bad).unwrap_err().to_string();
    assert!(e.contains("bad-shape.safetensors") && e.contains("`to_out.weight`"), "{e}");
}

#[test]
fn writer_refuses_the_other_formulation() {
    assert!(matches!(af3(false).to_safetensors_bytes(NamingScheme::GpuMode), Err(Error::InvalidArgument(_))));
    for s in [NamingScheme::Packed, NamingScheme::CuEquivarianceFunctional, NamingScheme::OpenFold] {
        assert!(matches!(gpumode().to_safetensors_bytes(s), Err(Error::InvalidArgument(_))), "{s}");
    }
}

#[test]
fn packed_writer_fills_a_missing_half_bias_with_zeros() {
    let mut w = af3(false);
    w.left_proj.bias = Some(vec![0.5; H]);
    let back = Weights::from_safetensors_bytes(&w.to_safetensors_bytes(NamingScheme::Packed).unwrap()).unwrap();
    assert_eq!(back.left_proj.bias, Some(vec![0.5; H]));
    assert_eq!(back.right_proj.bias, Some(vec![0.0; H]));
    assert_eq!(back.left_gate.bias, None);
}

#[test]
fn scheme_names_parse() {
    for s in NamingScheme::ALL {
        assert_eq!(s.as_str().parse::<NamingScheme>().unwrap(), s);
    }
    assert_eq!("boltz".parse::<NamingScheme>().unwrap(), NamingScheme::Packed);
    assert!("keras".parse::<NamingScheme>().is_err());
    assert!(NamingScheme::detect(&["norm.weight", "p_in.weight"]).is_err());
    assert_eq!(NamingScheme::detect(&["a.b.linear_a_p.weight"]).unwrap(), NamingScheme::OpenFold);
}

// ---- pair tensors ----------------------------------------------------------------------------

fn sample_input(batch: usize, n: usize, c: usize, masked: bool) -> PairInput {
    let x: Vec<f32> = (0..batch * n * n * c).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let mask = masked.then(|| (0..batch * n * n).map(|i| ((i * 7 + 3) % 3 != 0) as u8 as f32).collect());
    PairInput::new(x, mask, batch, n, c).unwrap()
}

fn write_raw(name: &str, tensors: Vec<(String, Raw)>) -> PathBuf {
    let path = tmp(name);
    std::fs::write(&path, serialize(tensors)).unwrap();
    path
}

#[test]
fn input_and_output_round_trip() {
    for masked in [false, true] {
        let input = sample_input(2, 5, 3, masked);
        assert_eq!(input.shape(), Shape::new(2, 5));
        let path = tmp(&format!("input-{masked}.safetensors"));
        write_input(&path, &input).unwrap();
        assert_eq!(read_input(&path).unwrap(), input);
        // The file is a plain safetensors file with the documented names and shapes.
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("x").unwrap().shape(), &[2, 5, 5, 3]);
        assert_eq!(st.tensor("mask").ok().map(|t| t.shape().to_vec()), masked.then(|| vec![2, 5, 5]));
    }
    let y: Vec<f32> = (0..2 * 4 * 4 * 6).map(|i| i as f32 - 10.5).collect();
    let path = tmp("output.safetensors");
    write_output(&path, &y, 2, 4, 6).unwrap();
    assert_eq!(read_output(&path).unwrap(), (y, [2, 4, 4, 6]));
}

#[test]
fn large_tensors_cross_chunk_boundaries() {
    // 2 MiB of f32 and a mask over 1 MiB: several streaming chunks each.
    let input = sample_input(1, 64, 128, true);
    let path = tmp("large-input.safetensors");
    write_input(&path, &input).unwrap();
    assert_eq!(read_input(&path).unwrap(), input);

    let n = 1100; // N² = 1,210,000 one-byte mask values
    let mut mask = vec![1.0f32; n * n];
    let bad = 1_100_000 + 7; // past the first 1 MiB chunk
    mask[bad] = 2.0;
    let path = write_raw(
        "large-mask.safetensors",
        vec![("x".into(), raw_f32(&[n, n, 1], &vec![0.5; n * n])), ("mask".into(), raw_as(Dtype::U8, &[n, n], &mask))],
    );
    let e = read_input(&path).unwrap_err().to_string();
    assert!(e.contains("mask[0, 1000, 7] = 2"), "{e}");
}

#[test]
fn rank3_x_and_rank2_mask_mean_batch_one() {
    let (n, c) = (3, 2);
    let x: Vec<f32> = (0..n * n * c).map(|i| i as f32).collect();
    let mask = vec![1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0];
    let path = write_raw(
        "rank3.safetensors",
        vec![("x".into(), raw_f32(&[n, n, c], &x)), ("mask".into(), raw_f32(&[n, n], &mask))],
    );
    let got = read_input(&path).unwrap();
    assert_eq!((got.batch, got.n, got.c), (1, n, c));
    assert_eq!(got.x, x);
    assert_eq!(got.mask, Some(mask));
}

#[test]
fn half_precision_x_loads() {
    let x: Vec<f32> = (0..2 * 2 * 2 * 4).map(|i| i as f32 * 0.1 - 0.7).collect();
    for (dtype, round) in [
        (Dtype::F16, (|v: f32| half::f16::from_f32(v).to_f32()) as fn(f32) -> f32),
        (Dtype::BF16, |v: f32| half::bf16::from_f32(v).to_f32()),
    ] {
        let path = write_raw(&format!("x-{dtype}.safetensors"), vec![("x".into(), raw_as(dtype, &[2, 2, 2, 4], &x))]);
        let got = read_input(&path).unwrap();
        assert_eq!(got.x, x.iter().map(|&v| round(v)).collect::<Vec<_>>(), "{dtype}");
        assert_eq!(got.mask, None);
    }
}

#[test]
fn mask_dtypes_load() {
    let (b, n, c) = (2, 3, 2);
    let x = vec![0.5f32; b * n * n * c];
    let mask: Vec<f32> = (0..b * n * n).map(|i| (i % 2) as f32).collect();
    for dtype in [Dtype::BOOL, Dtype::U8, Dtype::I32, Dtype::I64, Dtype::F16, Dtype::BF16, Dtype::F64] {
        let path = write_raw(
            &format!("mask-{dtype}.safetensors"),
            vec![("x".into(), raw_f32(&[b, n, n, c], &x)), ("mask".into(), raw_as(dtype, &[b, n, n], &mask))],
        );
        assert_eq!(read_input(&path).unwrap().mask, Some(mask.clone()), "{dtype}");
    }
}

#[test]
fn mask_value_other_than_0_or_1_is_named() {
    let (b, n, c) = (2, 4, 1);
    let x = vec![0.5f32; b * n * n * c];
    let mut mask = vec![1.0f32; b * n * n];
    mask[n * n + 2 * n + 3] = 2.0; // [1, 2, 3]
    for dtype in [Dtype::U8, Dtype::I64, Dtype::I32, Dtype::F32, Dtype::BOOL] {
        let path = write_raw(
            &format!("mask-two-{dtype}.safetensors"),
            vec![("x".into(), raw_f32(&[b, n, n, c], &x)), ("mask".into(), raw_as(dtype, &[b, n, n], &mask))],
        );
        match read_input(&path) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("mask[1, 2, 3] = 2"), "{dtype}: {m}"),
            other => panic!("{dtype}: expected InvalidArgument, got {other:?}"),
        }
    }
    let mut half_mask = vec![0.0f32; b * n * n];
    half_mask[5] = 0.5;
    let path = write_raw(
        "mask-half.safetensors",
        vec![("x".into(), raw_f32(&[b, n, n, c], &x)), ("mask".into(), raw_f32(&[b, n, n], &half_mask))],
    );
    let e = read_input(&path).unwrap_err().to_string();
    assert!(e.contains("mask[0, 1, 1] = 0.5"), "{e}");

    // The writer refuses the same mask rather than produce a file the reader rejects.
    let bad = PairInput { x: x.clone(), mask: Some(half_mask), batch: b, n, c };
    assert!(matches!(write_input(tmp("never.safetensors"), &bad), Err(Error::InvalidArgument(_))));
}

#[test]
fn mask_of_wrong_shape_names_both_shapes() {
    let x = vec![0.5f32; 2 * 4 * 4 * 3];
    for (i, shape) in [vec![1, 4, 4], vec![4, 4], vec![2, 4, 5], vec![2, 16]].into_iter().enumerate() {
        let mask = vec![1.0f32; shape.iter().product()];
        let path = write_raw(
            &format!("mask-shape-{i}.safetensors"),
            vec![("x".into(), raw_f32(&[2, 4, 4, 3], &x)), ("mask".into(), raw_f32(&shape, &mask))],
        );
        match read_input(&path) {
            Err(Error::Shape(m)) => {
                let mask_shape = format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "));
                assert!(m.contains(&mask_shape) && m.contains("[2, 4, 4, 3]"), "{m}");
            }
            other => panic!("expected Error::Shape, got {other:?}"),
        }
    }
}

#[test]
fn bad_input_files_are_errors() {
    // Non-square pair dimensions.
    let path = write_raw("x-nonsquare.safetensors", vec![("x".into(), raw_f32(&[1, 4, 5, 3], &[0.0; 60]))]);
    assert!(matches!(read_input(&path), Err(Error::Shape(m)) if m.contains("[1, 4, 5, 3]")));
    // Wrong rank.
    let path = write_raw("x-rank2.safetensors", vec![("x".into(), raw_f32(&[4, 3], &[0.0; 12]))]);
    assert!(matches!(read_input(&path), Err(Error::Shape(m)) if m.contains("rank 2")));
    // Unsupported dtypes.
    let path = write_raw("x-i32.safetensors", vec![("x".into(), raw_as(Dtype::I32, &[2, 2, 1], &[1.0; 4]))]);
    assert!(matches!(read_input(&path), Err(Error::Dtype(m)) if m.contains("`x`") && m.contains("I32")));
    let path = write_raw(
        "mask-i8.safetensors",
        vec![("x".into(), raw_f32(&[2, 2, 1], &[1.0; 4])), ("mask".into(), raw_as(Dtype::I8, &[2, 2], &[1.0; 4]))],
    );
    assert!(matches!(read_input(&path), Err(Error::Dtype(m)) if m.contains("`mask`") && m.contains("I8")));
    // No `x`.
    let path = write_raw("no-x.safetensors", vec![("input".into(), raw_f32(&[2, 2, 1], &[1.0; 4]))]);
    assert!(
        matches!(read_input(&path), Err(Error::File { reason, .. }) if reason.contains("`x`") && reason.contains("`input`"))
    );
    // Truncated file.
    let full = tmp("input-full.safetensors");
    write_input(&full, &sample_input(1, 4, 2, true)).unwrap();
    let bytes = std::fs::read(&full).unwrap();
    let cut = tmp("input-cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
    assert!(matches!(read_input(&cut), Err(Error::File { reason, .. }) if reason.contains("truncated")));
    std::fs::write(&cut, &bytes[..5]).unwrap();
    assert!(matches!(read_input(&cut), Err(Error::File { .. })));
    // Missing file, and a directory that does not exist for writing.
    assert!(matches!(read_output(tmp("no-such-output.safetensors")), Err(Error::File { .. })));
    let nowhere = tmp("no-such-dir").join("y.safetensors");
    assert!(matches!(write_output(&nowhere, &[0.0; 4], 1, 2, 1), Err(Error::File { .. })));
}

#[test]
fn writers_check_lengths() {
    assert!(matches!(write_output(tmp("y-bad.safetensors"), &[0.0; 5], 1, 2, 1), Err(Error::Shape(_))));
    let mut input = sample_input(1, 3, 2, true);
    input.x.pop();
    assert!(matches!(write_input(tmp("x-bad.safetensors"), &input), Err(Error::Shape(_))));
    assert!(matches!(PairInput::new(vec![0.0; 8], Some(vec![1.0; 3]), 1, 2, 2), Err(Error::Shape(_))));
    assert!(matches!(PairInput::new(vec![], None, 0, 2, 2), Err(Error::Shape(_))));
}

/// Writing through a symbolic link keeps the link and fills its target; a directory is refused
/// by name; `/dev/null` (a device) is written into, never replaced by a regular file.
#[cfg(unix)]
#[test]
fn outputs_keep_links_and_devices() {
    let y: Vec<f32> = (0..2 * 4 * 4 * 6).map(|i| i as f32 * 0.5).collect();
    let target = tmp("link-target.safetensors");
    let link = tmp("link.safetensors");
    let _ = std::fs::remove_file(&target);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("link-target.safetensors", &link).unwrap();
    write_output(&link, &y, 2, 4, 6).unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    assert_eq!(read_output(&target).unwrap(), (y.clone(), [2, 4, 4, 6]));

    let dir = tmp("an-output-dir");
    std::fs::create_dir_all(&dir).unwrap();
    let e = write_output(&dir, &y, 2, 4, 6).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");

    let null = std::path::Path::new("/dev/null");
    if std::fs::metadata(null).is_ok_and(|m| !m.is_file()) {
        write_output(null, &y, 2, 4, 6).unwrap();
        assert!(!std::fs::metadata(null).unwrap().is_file(), "/dev/null was replaced by a file");
    }
}

// ---- issue 25: outputs cannot be redirected and keep what they had -------------------------------

fn mode_of(p: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

fn set_mode(p: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A fresh, empty directory for one test.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = tmp(name);
    if dir.exists() {
        let _ = std::process::Command::new("chmod").arg("-R").arg("u+w").arg(&dir).status();
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Someone who can write in the output's folder plants a symbolic link where the temporary file
/// will be. Before: the temporary file was `.<name>.<pid>.tmp`, opened with `File::create`, which
/// follows links: the victim file was overwritten with the output and the link then renamed over
/// the output. Now the name is unpredictable and the file is created exclusively.
#[cfg(unix)]
#[test]
fn a_planted_link_cannot_redirect_the_write() {
    let dir = fresh_dir("planted");
    let victim = dir.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let out = dir.join("y.safetensors");
    // The old name, and a few guesses around it.
    for name in [format!(".y.safetensors.{}.tmp", std::process::id()), ".y.safetensors.tmp".into()] {
        std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
    }
    let y = vec![1.5f32; 2 * 2 * 3];
    write_output(&out, &y, 1, 2, 3).unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(std::fs::symlink_metadata(&out).unwrap().is_file(), "the output is a file, not the planted link");
    assert_eq!(read_output(&out).unwrap().0, y);
    // Only the output and the planted links: no temporary file left.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 4);
}

/// Replacing a file by rename gives it a new inode. Before: a 0600 file came back 0644 (the
/// umask's default), a 0444 file was silently replaced, another hard link kept the old data while
/// this name got the new, and the owner became whoever ran trimul.
#[cfg(unix)]
#[test]
fn replacing_an_output_keeps_its_protections_or_refuses() {
    use std::os::unix::fs::MetadataExt;
    let dir = fresh_dir("protections");
    let y = vec![0.25f32; 2 * 2 * 3];
    let out = dir.join("y.safetensors");

    std::fs::write(&out, "old").unwrap();
    set_mode(&out, 0o600);
    write_output(&out, &y, 1, 2, 3).unwrap();
    assert_eq!(mode_of(&out), 0o600, "the mode is kept");
    set_mode(&out, 0o640);
    write_output(&out, &y, 1, 2, 3).unwrap();
    assert_eq!(mode_of(&out), 0o640);

    let ro = dir.join("read-only.safetensors");
    std::fs::write(&ro, "old").unwrap();
    set_mode(&ro, 0o444);
    let e = write_output(&ro, &y, 1, 2, 3).unwrap_err().to_string();
    assert!(e.contains("write-protected (mode 0444)"), "{e}");
    assert_eq!(std::fs::read_to_string(&ro).unwrap(), "old");
    assert!(trimul::io::check_output(&ro).is_err(), "the up-front check refuses it too");

    let linked = dir.join("linked.safetensors");
    let other = dir.join("other-name.safetensors");
    std::fs::write(&linked, "old").unwrap();
    std::fs::hard_link(&linked, &other).unwrap();
    let e = write_output(&linked, &y, 1, 2, 3).unwrap_err().to_string();
    assert!(e.contains("has 2 hard links"), "{e}");
    assert_eq!(std::fs::read_to_string(&linked).unwrap(), "old");

    // Owner and group: as root a replacement can be given them, so they are kept.
    let owned = dir.join("owned.safetensors");
    std::fs::write(&owned, "old").unwrap();
    let me = std::fs::metadata(&owned).unwrap().uid();
    if me == 0 {
        std::os::unix::fs::chown(&owned, Some(65534), Some(65534)).unwrap();
        set_mode(&owned, 0o664);
        write_output(&owned, &y, 1, 2, 3).unwrap();
        let m = std::fs::metadata(&owned).unwrap();
        assert_eq!((m.uid(), m.gid(), mode_of(&owned)), (65534, 65534, 0o664));
        assert_eq!(read_output(&owned).unwrap().0, y);
    } else {
        eprintln!("SKIPPED: keeping another owner needs root (tests/cli_reliability.rs covers refusing as a user)");
    }
    // A new file gets the umask's mode, as any new file does, and no temporary file is left.
    let fresh = dir.join("new.safetensors");
    write_output(&fresh, &y, 1, 2, 3).unwrap();
    assert_eq!(mode_of(&fresh) & 0o600, 0o600);
    let tmp_left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(tmp_left.is_empty(), "{tmp_left:?}");
}

/// Reads need a regular file and are bounded by the header. Before: a directory said "4096 bytes
/// is too short for a safetensors file", a pipe was read and then called "truncated or corrupt",
/// `Weights::from_safetensors` read any file whole with `fs::read` (`/dev/zero` until memory ran
/// out; `/dev/null` read as "not a valid safetensors file"), and a tensor named twice made the
/// file "truncated or corrupt".
#[cfg(unix)]
#[test]
fn safetensors_reads_name_what_is_wrong() {
    let dir = fresh_dir("reads");
    let e = read_input(&dir).unwrap_err().to_string();
    assert!(e.contains("is a directory, not a regular file"), "{e}");
    let e = Weights::from_safetensors(&dir).unwrap_err().to_string();
    assert!(e.contains("is a directory, not a regular file"), "{e}");
    // (/dev/null, not /dev/zero: should this regress, an empty read fails instead of filling memory.)
    let e = Weights::from_safetensors("/dev/null").unwrap_err().to_string();
    assert!(e.contains("is a character device, not a regular file"), "{e}");

    // Trailing bytes after the last tensor.
    let mut bytes = gpumode().to_safetensors_bytes(NamingScheme::GpuMode).unwrap();
    bytes.extend_from_slice(&[0; 5]);
    let e = Weights::from_safetensors_bytes(&bytes).unwrap_err().to_string();
    assert!(e.contains("5 bytes after the last tensor"), "{e}");

    // A header naming `norm.weight` twice (the second entry a copy of the first).
    let bytes = gpumode().to_safetensors_bytes(NamingScheme::GpuMode).unwrap();
    let dup = with_tensor_named_twice(&bytes, "norm.weight");
    let e = Weights::from_safetensors_bytes(&dup).unwrap_err().to_string();
    assert!(e.contains("names tensor `norm.weight` twice"), "{e}");
}

/// JSON readers are capped. Before: `read_to_string` read a file of any size whole.
#[test]
fn text_reads_are_capped() {
    let dir = fresh_dir("text");
    let big = dir.join("big.json");
    std::fs::File::create(&big).unwrap().set_len(1 << 30).unwrap();
    let e = trimul::io::read_text(&big, 1 << 20, "test document").unwrap_err().to_string();
    assert!(e.contains("is 1073741824 bytes, larger than any test document"), "{e}");
    let e = trimul::io::read_text("/dev/zero", 1 << 20, "test document").unwrap_err().to_string();
    assert!(e.contains("a character device yields more than 1048576 bytes"), "{e}");
    let e = trimul::io::read_text(&dir, 1 << 20, "test document").unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    std::fs::write(&big, b"{\"a\": \xff}").unwrap();
    let e = trimul::io::read_text(&big, 1 << 20, "test document").unwrap_err().to_string();
    assert!(e.contains("not UTF-8"), "{e}");
    #[cfg(feature = "cuda")]
    {
        // TRIMUL_CUDA_TUNING is read the same way.
        std::fs::File::create(&big).unwrap().set_len(1 << 30).unwrap();
        let e = trimul::backend::cuda::TuningTable::from_file(&big).unwrap_err().to_string();
        assert!(e.contains("larger than any tuning table"), "{e}");
    }
}

/// A tensor name with a control character in it (the fuzzer's `l\near_a_p.weight`) is shown
/// escaped: every message stays one line. Before, the name went into the message as it was and
/// the error printed over two lines.
#[test]
fn tensor_names_with_control_characters_stay_on_one_line() {
    let w = af3(true);
    let named = openfold_named(&w);
    for victim in ["linear_a_p.weight", "layer_norm_in.bias"] {
        let bytes = with(&named, |n| {
            let t = n.iter_mut().find(|t| t.0.ends_with(victim)).unwrap();
            t.0 = t.0.replacen("in", "i\nn", 1).replacen("ear", "\near", 1);
        });
        let e = Weights::from_safetensors_bytes(&bytes).unwrap_err().to_string();
        assert!(!e.contains('\n'), "multi-line message: {e:?}");
        assert!(e.contains("\\n"), "the name should show escaped: {e}");
    }
}
