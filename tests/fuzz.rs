//! Structure-aware fuzzing on stable Rust (proptest) of every parser that reads user files or
//! arguments: the safetensors weights loader under each naming scheme, the input/mask reader,
//! the bench JSON and anchors readers (with the report rendered from whatever they accept), and
//! the byte-count parser.
//!
//! Each target builds valid inputs from the formats' own rules, then damages them at the level
//! the parser works at (tensors renamed, dropped, duplicated, reshaped, retyped or rescaled;
//! JSON fields replaced with extreme or wrongly typed values; bytes flipped, cut or appended) and
//! checks what must hold for any input: no panic, an error is one non-empty line, and what is
//! accepted is valid (undamaged inputs round-trip exactly). The committed corpus
//! (tests/data/*.json, docs/perf/anchors-h100.json, and the weights/inputs the generators make)
//! seeds every run.
//!
//! Cases: [`CASES`] per target (10,000 each, about a minute in all on two cores with the test
//! profile's optimisation); `PROPTEST_CASES=N` changes it (`PROPTEST_CASES=1000000 cargo test
//! --release --test fuzz` for a long local run). The RNG is seeded afresh each run; a failure
//! prints its minimal input and its seed is written to `tests/fuzz/<target>.proptest-regressions`, which
//! is committed and replayed first on every later run. Every failure found also gets a named
//! regression test at the end of this file.

use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, FileFailurePersistence};
use safetensors::Dtype;
use trimul::report::{self, Anchor, BenchRun};
use trimul::{io, Config, Formulation, NamingScheme, Weights};

/// Cases per target unless `PROPTEST_CASES` says otherwise.
const CASES: u32 = 10_000;

fn runner_config(test_name: &'static str, regressions: &'static str) -> RunnerConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(CASES);
    RunnerConfig {
        cases,
        // Relative to the package root, where cargo runs tests.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(regressions))),
        source_file: Some(file!()),
        test_name: Some(test_name),
        // Shrinking a failure is worth a little time, not minutes of CI.
        max_shrink_time: 30_000,
        ..RunnerConfig::default()
    }
}

/// How the cases of one target ended: a target whose inputs are all refused (or all accepted)
/// tests less than it claims, so each target checks that it reaches both outcomes.
#[derive(Default)]
struct Outcomes {
    accepted: std::sync::atomic::AtomicUsize,
    refused: std::sync::atomic::AtomicUsize,
}

impl Outcomes {
    fn record<T, E>(&self, r: &Result<T, E>) {
        let c = if r.is_ok() { &self.accepted } else { &self.refused };
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Prints the counts and checks each outcome has at least `min_share` of the cases.
    fn check(&self, target: &str, min_share: f64) {
        let (a, r) = (
            self.accepted.load(std::sync::atomic::Ordering::Relaxed),
            self.refused.load(std::sync::atomic::Ordering::Relaxed),
        );
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            format!("{target}: {} cases, {a} accepted, {r} refused\n", a + r).as_bytes(),
        );
        let total = (a + r).max(1) as f64;
        assert!(a as f64 / total >= min_share && r as f64 / total >= min_share, "{target}: {a} accepted, {r} refused");
    }
}

/// Runs `check` on `CASES` values of `strategy`, as `proptest!` does (persisted failures
/// replayed first, the failing input shrunk and printed), then checks the outcome counts.
fn fuzz<S: Strategy>(
    name: &'static str,
    regressions: &'static str,
    strategy: S,
    min_share: f64,
    check: impl Fn(&S::Value, &Outcomes),
) where
    S::Value: std::fmt::Debug,
{
    let outcomes = Outcomes::default();
    let mut runner = proptest::test_runner::TestRunner::new(runner_config(name, regressions));
    if let Err(e) = runner.run(&strategy, |v| {
        check(&v, &outcomes);
        Ok(())
    }) {
        panic!("{name}: {e}");
    }
    outcomes.check(name, min_share);
}

/// An error the user sees: one non-empty line (the CLI prints it after `trimul: error: `).
fn assert_one_line(e: &trimul::Error) {
    let m = e.to_string();
    assert!(!m.trim().is_empty(), "empty error message");
    assert!(!m.contains('\n'), "multi-line error message: {m:?}");
}

// ---------------------------------------------------------------------------------------------
// safetensors files built tensor by tensor
// ---------------------------------------------------------------------------------------------

/// One tensor of a file under construction: raw little-endian bytes of `dtype`.
#[derive(Clone, Debug)]
struct RawTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

const ALL_DTYPES: [Dtype; 12] = [
    Dtype::F32,
    Dtype::F16,
    Dtype::BF16,
    Dtype::F64,
    Dtype::BOOL,
    Dtype::U8,
    Dtype::I8,
    Dtype::I16,
    Dtype::U16,
    Dtype::I32,
    Dtype::I64,
    Dtype::U64,
];

/// `values` encoded as `dtype` (integers and bools by rounding, as a mask file holds them).
fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::F64 => values.iter().flat_map(|v| (*v as f64).to_le_bytes()).collect(),
        Dtype::BOOL | Dtype::U8 => values.iter().map(|v| *v as u8).collect(),
        Dtype::I8 => values.iter().map(|v| *v as i8 as u8).collect(),
        Dtype::I16 => values.iter().flat_map(|v| (*v as i16).to_le_bytes()).collect(),
        Dtype::U16 => values.iter().flat_map(|v| (*v as u16).to_le_bytes()).collect(),
        Dtype::I32 => values.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect(),
        Dtype::I64 => values.iter().flat_map(|v| (*v as i64).to_le_bytes()).collect(),
        Dtype::U64 => values.iter().flat_map(|v| (*v as u64).to_le_bytes()).collect(),
        other => panic!("no encoder for {other}"),
    }
}

/// The value `v` becomes after a round trip through `dtype` (for the round-trip property).
fn rounded(dtype: Dtype, v: f32) -> f32 {
    match dtype {
        Dtype::F16 => half::f16::from_f32(v).to_f32(),
        Dtype::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// A safetensors file written by hand, so that it can hold what the safetensors crate's writer
/// never produces (a name twice, offsets of our choosing). Names are JSON-escaped by serde_json.
fn file_bytes(tensors: &[RawTensor]) -> Vec<u8> {
    let mut header = String::from("{");
    let mut data = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        let start = data.len();
        data.extend_from_slice(&t.bytes);
        header.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
            serde_json::to_string(&t.name).unwrap(),
            t.dtype,
            serde_json::to_string(&t.shape).unwrap(),
            start,
            data.len()
        ));
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    out
}

/// Damage at the level of bytes, after the file is assembled.
#[derive(Clone, Debug)]
enum ByteDamage {
    None,
    Flip { at: usize, mask: u8 },
    Truncate { keep: usize },
    Append { bytes: Vec<u8> },
    HeaderLength { value: u64 },
}

fn byte_damage() -> impl Strategy<Value = ByteDamage> {
    prop_oneof![
        6 => Just(ByteDamage::None),
        2 => (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| ByteDamage::Flip { at, mask }),
        1 => any::<usize>().prop_map(|keep| ByteDamage::Truncate { keep }),
        1 => prop::collection::vec(any::<u8>(), 1..24).prop_map(|bytes| ByteDamage::Append { bytes }),
        1 => prop_oneof![Just(0u64), Just(u64::MAX), Just(1 << 40), any::<u64>(), 0u64..4096]
            .prop_map(|value| ByteDamage::HeaderLength { value }),
    ]
}

fn apply_bytes(mut bytes: Vec<u8>, damage: &ByteDamage) -> Vec<u8> {
    match damage {
        ByteDamage::None => {}
        ByteDamage::Flip { at, mask } if !bytes.is_empty() => {
            let i = at % bytes.len();
            bytes[i] ^= mask;
        }
        ByteDamage::Flip { .. } => {}
        ByteDamage::Truncate { keep } => bytes.truncate(keep % (bytes.len() + 1)),
        ByteDamage::Append { bytes: more } => bytes.extend_from_slice(more),
        ByteDamage::HeaderLength { value } if bytes.len() >= 8 => bytes[..8].copy_from_slice(&value.to_le_bytes()),
        ByteDamage::HeaderLength { .. } => {}
    }
    bytes
}

/// Damage at the level of tensors, before the file is assembled.
#[derive(Clone, Debug)]
enum TensorDamage {
    None,
    Drop(usize),
    Rename(usize, String),
    Duplicate(usize),
    Reshape(usize, Vec<usize>),
    Retype(usize, Dtype),
    /// Multiply every value by this factor (overflowing f16/bf16 on the way, or making NaN).
    Scale(usize, f32),
    Extra(String, Vec<usize>),
}

/// Every name some scheme uses, plus near-misses.
fn known_names() -> Vec<String> {
    let mut v: Vec<String> = NamingScheme::ALL
        .iter()
        .flat_map(|s| s.required_names().iter().chain(s.optional_names()).map(|n| n.to_string()))
        .collect();
    v.extend(["left_proj.bias", "to_out.bias", "x", "mask", "y", "__metadata__", "", "."].map(String::from));
    v
}

fn tensor_name() -> impl Strategy<Value = String> {
    let names = known_names();
    prop_oneof![
        3 => prop::sample::select(names.clone()),
        1 => (prop::sample::select(vec!["trunk.0.", "a.", "tri_mul_out.", ".", "x."]), prop::sample::select(names))
            .prop_map(|(p, n)| format!("{p}{n}")),
        1 => "[a-z_.]{0,12}",
        1 => any::<String>(),
    ]
}

fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop_oneof![4 => 0usize..10, 1 => Just(1usize << 20)], 0..5)
}

fn tensor_damage() -> impl Strategy<Value = TensorDamage> {
    prop_oneof![
        5 => Just(TensorDamage::None),
        1 => any::<usize>().prop_map(TensorDamage::Drop),
        1 => (any::<usize>(), tensor_name()).prop_map(|(k, n)| TensorDamage::Rename(k, n)),
        1 => any::<usize>().prop_map(TensorDamage::Duplicate),
        1 => (any::<usize>(), shape()).prop_map(|(k, s)| TensorDamage::Reshape(k, s)),
        1 => (any::<usize>(), prop::sample::select(ALL_DTYPES.to_vec())).prop_map(|(k, d)| TensorDamage::Retype(k, d)),
        1 => (any::<usize>(), prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(1e30f32), Just(-1e5f32), Just(0.0f32)])
            .prop_map(|(k, f)| TensorDamage::Scale(k, f)),
        1 => (tensor_name(), shape()).prop_map(|(n, s)| TensorDamage::Extra(n, s)),
    ]
}

/// Tensors of `dtype` whose bytes match their shape, with `values` cycled to fill them.
fn raw(name: String, dtype: Dtype, shape: Vec<usize>, values: &[f32]) -> RawTensor {
    // Capped: a shape of 2^20 × 2^20 describes more than a test should allocate; the file is
    // then short of bytes, which is damage of its own.
    let len = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX).min(1 << 16);
    let filled: Vec<f32> = (0..len).map(|i| if values.is_empty() { 0.5 } else { values[i % values.len()] }).collect();
    RawTensor { name, dtype, shape, bytes: encode(dtype, &filled) }
}

fn decode_f32s(t: &RawTensor) -> Vec<f32> {
    match t.dtype {
        Dtype::F32 => t.bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        Dtype::F16 => t.bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => t.bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F64 => t.bytes.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32).collect(),
        Dtype::I16 => t.bytes.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]]) as f32).collect(),
        Dtype::U16 => t.bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]) as f32).collect(),
        Dtype::I32 => t.bytes.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as f32).collect(),
        Dtype::I64 => t.bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32).collect(),
        Dtype::U64 => t.bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as f32).collect(),
        Dtype::I8 => t.bytes.iter().map(|&b| b as i8 as f32).collect(),
        _ => t.bytes.iter().map(|&b| b as f32).collect(),
    }
}

fn apply_tensors(tensors: &mut Vec<RawTensor>, damage: &TensorDamage) {
    let n = tensors.len().max(1);
    match damage.clone() {
        TensorDamage::None => {}
        TensorDamage::Drop(k) if !tensors.is_empty() => {
            tensors.remove(k % n);
        }
        TensorDamage::Rename(k, name) if !tensors.is_empty() => tensors[k % n].name = name,
        TensorDamage::Duplicate(k) if !tensors.is_empty() => {
            let t = tensors[k % n].clone();
            tensors.push(t);
        }
        TensorDamage::Reshape(k, s) if !tensors.is_empty() => {
            let t = &tensors[k % n];
            let values = decode_f32s(t);
            tensors[k % n] = raw(t.name.clone(), t.dtype, s, &values);
        }
        TensorDamage::Retype(k, d) if !tensors.is_empty() => {
            let t = &tensors[k % n];
            let values = decode_f32s(t);
            tensors[k % n] = raw(t.name.clone(), d, t.shape.clone(), &values);
        }
        TensorDamage::Scale(k, f) if !tensors.is_empty() => {
            let t = &tensors[k % n];
            let values: Vec<f32> = decode_f32s(t).into_iter().map(|v| v * f).collect();
            tensors[k % n] = raw(t.name.clone(), t.dtype, t.shape.clone(), &values);
        }
        TensorDamage::Extra(name, s) => tensors.push(raw(name, Dtype::F32, s, &[1.0])),
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Target 1: the weights loader, every naming scheme
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct WeightsCase {
    scheme: NamingScheme,
    c: usize,
    h: usize,
    biases: bool,
    seed: u64,
    dtype: Dtype,
    prefix: Option<&'static str>,
    tensor_damage: Vec<TensorDamage>,
    byte_damage: ByteDamage,
    /// Read through a file on disk (the streamed path) rather than from bytes.
    via_file: bool,
}

fn weights_case() -> impl Strategy<Value = WeightsCase> {
    (
        prop::sample::select(NamingScheme::ALL.to_vec()),
        1usize..12,
        1usize..9,
        any::<bool>(),
        any::<u64>(),
        prop::sample::select(vec![Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F64]),
        prop::option::of(prop::sample::select(vec!["trunk.layers.0.tri_mul_out.", "m.", "0."])),
        prop::collection::vec(tensor_damage(), 0..3),
        byte_damage(),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(scheme, c, h, biases, seed, dtype, prefix, tensor_damage, byte_damage, via_file)| {
            WeightsCase { scheme, c, h, biases, seed, dtype, prefix, tensor_damage, byte_damage, via_file }
        })
}

/// The weights of a case and the tensors of their file in `dtype`, names under `prefix`.
fn weights_tensors(case: &WeightsCase) -> (Weights, Vec<RawTensor>) {
    let formulation = case.scheme.formulation();
    let biases = case.biases && formulation == Formulation::Af3;
    let weights = Weights::random(Config::new(formulation, case.c, case.h).unwrap(), biases, case.seed).unwrap();
    let bytes = weights.to_safetensors_bytes(case.scheme).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut named = st.tensors();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let tensors = named
        .into_iter()
        .map(|(name, view)| {
            let values: Vec<f32> =
                view.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            let name = format!("{}{name}", case.prefix.unwrap_or(""));
            RawTensor { name, dtype: case.dtype, shape: view.shape().to_vec(), bytes: encode(case.dtype, &values) }
        })
        .collect();
    (weights, tensors)
}

fn load_weights(case: &WeightsCase, bytes: &[u8]) -> trimul::Result<Weights> {
    if case.via_file {
        let path = scratch(&format!("weights-{}.safetensors", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        match case.prefix {
            Some(p) => Weights::from_safetensors_with_prefix(&path, p),
            None => Weights::from_safetensors(&path),
        }
    } else {
        match case.prefix {
            Some(p) => Weights::from_safetensors_bytes_with_prefix(bytes, p),
            None => Weights::from_safetensors_bytes(bytes),
        }
    }
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn check_weights_case(case: &WeightsCase, outcomes: &Outcomes) {
    let (weights, mut tensors) = weights_tensors(case);
    for d in &case.tensor_damage {
        apply_tensors(&mut tensors, d);
    }
    let bytes = apply_bytes(file_bytes(&tensors), &case.byte_damage);
    let undamaged = case.tensor_damage.iter().all(|d| matches!(d, TensorDamage::None))
        && matches!(case.byte_damage, ByteDamage::None);
    let result = load_weights(case, &bytes);
    outcomes.record(&result);
    match result {
        Ok(got) => {
            got.validate().expect("accepted weights are valid");
            assert_eq!((got.config().c, got.config().h), (weights.config().c, weights.config().h));
            if undamaged {
                let want = weights_rounded(&weights, case.dtype);
                assert!(same_weights(&got, &want), "an undamaged file must round-trip: {case:?}");
            }
        }
        Err(e) => {
            assert!(!undamaged, "an undamaged file was refused: {e} ({case:?})");
            assert_one_line(&e);
            // A name twice, and nothing else wrong, is named as such (it used to read as
            // "truncated or corrupt").
            let only_duplicates =
                case.tensor_damage.iter().all(|d| matches!(d, TensorDamage::None | TensorDamage::Duplicate(_)))
                    && case.tensor_damage.iter().any(|d| matches!(d, TensorDamage::Duplicate(_)))
                    && matches!(case.byte_damage, ByteDamage::None);
            if only_duplicates {
                assert!(e.to_string().contains("twice"), "{e}");
            }
        }
    }
}

fn weights_rounded(w: &Weights, dtype: Dtype) -> Weights {
    let mut w = w.clone();
    let r = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x = rounded(dtype, *x));
    for n in [&mut w.norm_in, &mut w.norm_out] {
        r(&mut n.weight);
        r(&mut n.bias);
    }
    for l in
        [&mut w.left_proj, &mut w.left_gate, &mut w.right_proj, &mut w.right_gate, &mut w.out_gate, &mut w.out_proj]
    {
        r(&mut l.weight);
        if let Some(b) = &mut l.bias {
            r(b);
        }
    }
    w
}

/// Equal, allowing a packed scheme's zero-filled missing bias halves.
fn same_weights(a: &Weights, b: &Weights) -> bool {
    let bias = |x: &Option<Vec<f32>>, y: &Option<Vec<f32>>| match (x, y) {
        (Some(x), Some(y)) => x == y,
        (Some(v), None) | (None, Some(v)) => v.iter().all(|&z| z == 0.0),
        (None, None) => true,
    };
    let lin = |x: &trimul::Linear, y: &trimul::Linear| x.weight == y.weight && bias(&x.bias, &y.bias);
    a.config() == b.config()
        && a.norm_in == b.norm_in
        && a.norm_out == b.norm_out
        && lin(&a.left_proj, &b.left_proj)
        && lin(&a.left_gate, &b.left_gate)
        && lin(&a.right_proj, &b.right_proj)
        && lin(&a.right_gate, &b.right_gate)
        && lin(&a.out_gate, &b.out_gate)
        && lin(&a.out_proj, &b.out_proj)
}

#[test]
fn fuzz_weights_loader() {
    fuzz(
        "fuzz_weights_loader",
        "tests/fuzz/fuzz_weights_loader.proptest-regressions",
        weights_case(),
        0.1,
        check_weights_case,
    );
}

// ---------------------------------------------------------------------------------------------
// Target 2: the input and mask reader
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct InputCase {
    batch: usize,
    n: usize,
    c: usize,
    rank3_x: bool,
    x_dtype: Dtype,
    /// Mask: dtype, whether its shape is the rank-2 form, and the values (cycled).
    mask: Option<(Dtype, bool, Vec<f32>)>,
    tensor_damage: Vec<TensorDamage>,
    byte_damage: ByteDamage,
}

fn input_case() -> impl Strategy<Value = InputCase> {
    let mask_value = prop_oneof![8 => Just(0.0f32), 8 => Just(1.0f32), 1 => Just(2.0f32), 1 => Just(0.5f32),
        1 => Just(-1.0f32), 1 => Just(f32::NAN), 1 => Just(255.0f32)];
    (
        1usize..4,
        1usize..7,
        1usize..5,
        any::<bool>(),
        prop::sample::select(vec![Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F64, Dtype::I32]),
        prop::option::of((
            prop::sample::select(ALL_DTYPES.to_vec()),
            any::<bool>(),
            prop::collection::vec(mask_value, 1..40),
        )),
        prop::collection::vec(tensor_damage(), 0..2),
        byte_damage(),
    )
        .prop_map(|(batch, n, c, rank3_x, x_dtype, mask, tensor_damage, byte_damage)| InputCase {
            batch,
            n,
            c,
            rank3_x,
            x_dtype,
            mask,
            tensor_damage,
            byte_damage,
        })
}

fn check_input_case(case: &InputCase, outcomes: &Outcomes) {
    let InputCase { batch, n, c, .. } = *case;
    // A rank-3 x or rank-2 mask means B = 1.
    let batch = if case.rank3_x || case.mask.as_ref().is_some_and(|m| m.1) { 1 } else { batch };
    let x: Vec<f32> = (0..batch * n * n * c).map(|i| (i as f32 * 0.37).sin()).collect();
    let x_shape = if case.rank3_x { vec![n, n, c] } else { vec![batch, n, n, c] };
    let mut tensors = vec![raw("x".into(), case.x_dtype, x_shape, &x)];
    let mut mask_values = None;
    if let Some((dtype, rank2, values)) = &case.mask {
        let shape = if *rank2 { vec![n, n] } else { vec![batch, n, n] };
        let full: Vec<f32> = (0..batch * n * n).map(|i| values[i % values.len()]).collect();
        // What the file will hold after encoding (2.0 as BOOL is the byte 2, NaN as U8 is 0).
        let t = raw("mask".into(), *dtype, shape, &full);
        mask_values = Some((*dtype, decode_f32s(&t)));
        tensors.push(t);
    }
    for d in &case.tensor_damage {
        apply_tensors(&mut tensors, d);
    }
    let bytes = apply_bytes(file_bytes(&tensors), &case.byte_damage);
    let undamaged = case.tensor_damage.iter().all(|d| matches!(d, TensorDamage::None))
        && matches!(case.byte_damage, ByteDamage::None);
    let result = io::read_input_bytes(&bytes);
    outcomes.record(&result);
    if let Ok(input) = &result {
        input.validate().expect("an accepted input is valid");
        if let Some(m) = &input.mask {
            assert!(m.iter().all(|&v| v == 0.0 || v == 1.0), "mask values are 0 or 1");
        }
    }
    if let Err(e) = &result {
        assert_one_line(e);
    }
    if !undamaged {
        return;
    }
    // Undamaged: the reader decides exactly as the format rules say.
    let float_x = matches!(case.x_dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64);
    let mask_ok = match &mask_values {
        None => true,
        Some((dtype, values)) => {
            let dtype_ok = matches!(
                dtype,
                Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64 | Dtype::BOOL | Dtype::U8 | Dtype::I32 | Dtype::I64
            );
            dtype_ok && values.iter().all(|&v| v == 0.0 || v == 1.0)
        }
    };
    match (&result, float_x && mask_ok) {
        (Ok(input), true) => {
            assert_eq!((input.batch, input.n, input.c), (batch, n, c));
            let want_x: Vec<f32> = x.iter().map(|&v| rounded(case.x_dtype, v)).collect();
            assert_eq!(input.x, want_x);
            assert_eq!(input.mask, mask_values.map(|(_, v)| v));
        }
        (Err(e), true) => panic!("a valid input was refused: {e} ({case:?})"),
        (Ok(_), false) => panic!("an invalid input was accepted ({case:?})"),
        (Err(e), false) => {
            if float_x {
                if let Some((dtype, values)) = &mask_values {
                    if let Some(k) = values.iter().position(|&v| v != 0.0 && v != 1.0) {
                        if !matches!(dtype, Dtype::I8 | Dtype::I16 | Dtype::U16 | Dtype::U64) {
                            let at = format!("mask[{}, {}, {}]", k / (n * n), (k / n) % n, k % n);
                            assert!(e.to_string().contains(&at), "{e} should name {at}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn fuzz_input_and_mask_reader() {
    fuzz(
        "fuzz_input_and_mask_reader",
        "tests/fuzz/fuzz_input_and_mask_reader.proptest-regressions",
        input_case(),
        0.1,
        check_input_case,
    );
}

// ---------------------------------------------------------------------------------------------
// Target 3: bench JSON and anchors, and the report rendered from what they accept
// ---------------------------------------------------------------------------------------------

fn corpus_json(rel: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Values a field may be replaced with: extremes, wrong types, the strings the lenient float
/// reader knows.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let numbers = prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(-0.0)),
        Just(json!(1e-300)),
        Just(json!(1.7e308)),
        Just(json!(1e9)),
        Just(json!(1.0000001e9)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(9007199254740993u64)),
        any::<f64>().prop_filter("JSON numbers are finite", |v| v.is_finite()).prop_map(|v| json!(v)),
        any::<u32>().prop_map(|v| json!(v)),
    ];
    let strings = prop_oneof![
        Just(json!("NaN")),
        Just(json!("inf")),
        Just(json!("-inf")),
        Just(json!("")),
        Just(json!("n256_b2_c128")),
        any::<String>().prop_map(Value::String),
    ];
    prop_oneof![4 => numbers, 2 => strings, 1 => Just(Value::Null), 1 => any::<bool>().prop_map(Value::Bool),
        1 => Just(json!([])), 1 => Just(json!({}))]
}

/// A change at a path chosen by `picks` (each pick selects a child, modulo their count).
#[derive(Clone, Debug)]
enum JsonDamage {
    Replace(Vec<usize>, serde_json::Value),
    Remove(Vec<usize>),
    /// Copy an array element next to itself (a shape twice, an anchor twice).
    Duplicate(Vec<usize>),
}

fn json_damage() -> impl Strategy<Value = JsonDamage> {
    let path = prop::collection::vec(any::<usize>(), 1..5);
    prop_oneof![
        4 => (path.clone(), json_value()).prop_map(|(p, v)| JsonDamage::Replace(p, v)),
        1 => path.clone().prop_map(JsonDamage::Remove),
        1 => path.prop_map(JsonDamage::Duplicate),
    ]
}

fn apply_json(value: &mut serde_json::Value, damage: &JsonDamage) {
    use serde_json::Value;
    let picks = match damage {
        JsonDamage::Replace(p, _) | JsonDamage::Remove(p) | JsonDamage::Duplicate(p) => p,
    };
    let mut node = value;
    for (depth, &pick) in picks.iter().enumerate() {
        let last = depth + 1 == picks.len();
        match node {
            Value::Object(map) if !map.is_empty() => {
                let key = map.keys().nth(pick % map.len()).unwrap().clone();
                if last {
                    match damage {
                        JsonDamage::Replace(_, v) => {
                            map.insert(key, v.clone());
                        }
                        JsonDamage::Remove(_) => {
                            map.remove(&key);
                        }
                        JsonDamage::Duplicate(_) => {}
                    }
                    return;
                }
                node = map.get_mut(&key).unwrap();
            }
            Value::Array(items) if !items.is_empty() => {
                let i = pick % items.len();
                if last {
                    match damage {
                        JsonDamage::Replace(_, v) => items[i] = v.clone(),
                        JsonDamage::Remove(_) => {
                            items.remove(i);
                        }
                        JsonDamage::Duplicate(_) => {
                            let copy = items[i].clone();
                            items.insert(i, copy);
                        }
                    }
                    return;
                }
                node = &mut items[i];
            }
            _ => return,
        }
    }
}

#[derive(Clone, Debug)]
struct JsonCase {
    base: usize,
    damage: Vec<JsonDamage>,
    /// Cut the text at this fraction (1.0: whole).
    cut: Option<f64>,
    anchors_damage: Vec<JsonDamage>,
}

fn json_case() -> impl Strategy<Value = JsonCase> {
    (
        0usize..3,
        prop::collection::vec(json_damage(), 0..4),
        prop::option::weighted(0.1, 0.0f64..1.0),
        prop::collection::vec(json_damage(), 0..3),
    )
        .prop_map(|(base, damage, cut, anchors_damage)| JsonCase { base, damage, cut, anchors_damage })
}

const RUN_CORPUS: [&str; 3] =
    ["tests/data/synthetic-cpu.json", "tests/data/synthetic-gpu.json", "docs/perf/h100-cuda-gpumode.json"];

fn check_json_case(
    case: &JsonCase,
    bases: &[serde_json::Value],
    anchors_base: &serde_json::Value,
    outcomes: &Outcomes,
) {
    let mut v = bases[case.base % bases.len()].clone();
    for d in &case.damage {
        apply_json(&mut v, d);
    }
    let mut text = serde_json::to_string_pretty(&v).unwrap();
    if let Some(f) = case.cut {
        let mut at = (text.len() as f64 * f) as usize;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
    }
    let mut a = anchors_base.clone();
    for d in &case.anchors_damage {
        apply_json(&mut a, d);
    }
    let anchors = Anchor::list_from_json_str(&a.to_string());
    if let Err(e) = &anchors {
        assert_one_line(e);
    }
    let anchors = anchors.unwrap_or_default();
    let result = BenchRun::from_json_str(&text);
    outcomes.record(&result);
    match result {
        Ok(run) => {
            run.validate().expect("an accepted run is valid");
            // Whatever the reader accepts, the report renders (or refuses in one line), and the
            // run survives a write and a read.
            match report::render(std::slice::from_ref(&run), &anchors, None) {
                Ok(r) => assert!(r.markdown.contains("| shape") || !r.markdown.is_empty()),
                Err(e) => assert_one_line(&e),
            }
            let again = BenchRun::from_json_str(&run.to_json_string().unwrap()).expect("a written run reads back");
            assert_eq!(again.shapes.len(), run.shapes.len());
        }
        Err(e) => assert_one_line(&e),
    }
}

#[test]
fn fuzz_bench_json_and_report() {
    let bases: Vec<serde_json::Value> = RUN_CORPUS.iter().map(|p| corpus_json(p)).collect();
    let anchors = corpus_json("docs/perf/anchors-h100.json");
    fuzz(
        "fuzz_bench_json_and_report",
        "tests/fuzz/fuzz_bench_json_and_report.proptest-regressions",
        json_case(),
        0.1,
        |case, outcomes| check_json_case(case, &bases, &anchors, outcomes),
    );
}

// ---------------------------------------------------------------------------------------------
// Target 4: the byte-count parser (--max-memory)
// ---------------------------------------------------------------------------------------------

fn byte_count_text() -> impl Strategy<Value = String> {
    prop_oneof![
        // Well-formed: digits, an optional fraction, an optional unit.
        3 => "[0-9]{1,22}(\\.[0-9]{0,12})? ?([kKmMgGtT][iI]?)?[bB]?",
        2 => "[-+0-9.eE _]{0,14}[a-zA-Z]{0,4}",
        1 => any::<String>(),
    ]
}

fn check_byte_count(text: &str, outcomes: &Outcomes) {
    let result = trimul::plan::parse_bytes(text);
    outcomes.record(&result);
    match result {
        Ok(v) => {
            assert!(v >= 1, "{text:?} parsed as {v}");
            // Cross-check the well-formed ones against a separate reading of the grammar.
            if let Some(want) = expected_bytes(text) {
                let err = (v as f64 - want).abs() / want;
                assert!(err < 1e-9 || (v as f64 - want).abs() < 1.0, "{text:?}: {v}, expected {want}");
            }
        }
        Err(e) => {
            assert_one_line(&e);
            if let Some(want) = expected_bytes(text) {
                assert!(!(1.0..1.8e19).contains(&want), "{text:?} ({want} bytes) was refused: {e}");
            }
        }
    }
}

/// `text`'s value when it is digits, an optional fraction and an optional unit.
fn expected_bytes(text: &str) -> Option<f64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.'))?.min(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() || num.matches('.').count() > 1 || num == "." {
        return None;
    }
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit.strip_suffix('b').unwrap_or(&unit);
    let scale = BTreeMap::from([
        ("", 1.0),
        ("k", 1e3),
        ("m", 1e6),
        ("g", 1e9),
        ("t", 1e12),
        ("ki", 1024.0),
        ("mi", 1048576.0),
        ("gi", 1073741824.0),
        ("ti", 1099511627776.0),
    ]);
    Some(num.parse::<f64>().ok()? * scale.get(unit)?)
}

#[test]
fn fuzz_byte_count_parser() {
    fuzz(
        "fuzz_byte_count_parser",
        "tests/fuzz/fuzz_byte_count_parser.proptest-regressions",
        byte_count_text(),
        0.1,
        |text, outcomes| check_byte_count(text, outcomes),
    );
}

// ---------------------------------------------------------------------------------------------
// The corpus, replayed as is on every run
// ---------------------------------------------------------------------------------------------

/// The committed seeds pass through each target undamaged (a corpus that stopped parsing would
/// make the fuzzing above damage garbage instead of files).
#[test]
fn corpus_parses() {
    for path in RUN_CORPUS {
        let run = BenchRun::from_path(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap();
        report::render(&[run], &[], None).unwrap();
    }
    Anchor::load(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/perf/anchors-h100.json")).unwrap();
    for scheme in NamingScheme::ALL {
        let case = WeightsCase {
            scheme,
            c: 5,
            h: 3,
            biases: true,
            seed: 1,
            dtype: Dtype::BF16,
            prefix: Some("m."),
            tensor_damage: vec![],
            byte_damage: ByteDamage::None,
            via_file: true,
        };
        check_weights_case(&case, &Outcomes::default());
    }
    for text in ["24GB", "1.5 GiB", "512MiB", "1", "0.5k", "18446744073709551615", "1e3", "GB", ""] {
        check_byte_count(text, &Outcomes::default());
    }
}
