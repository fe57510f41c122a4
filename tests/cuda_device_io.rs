//! Forwards on caller device memory (`trimul::device_io`) on a real GPU: weights prepared by the
//! `prepare_weights` kernel from device tensors (f32, bf16, f16; af3's packed `p_in`/`g_in` as
//! addresses inside one tensor), the workspace in caller memory and moved between calls, the
//! caller's stream. Each result is checked against the f64 reference and bit for bit against
//! the host-prepared layer on the same inputs. Skips visibly without a CUDA device.
#![cfg(feature = "cuda")]

use trimul::backend::cuda::{CudaBackend, DeviceBuffer};
use trimul::reference;
use trimul::suite::{self, Case, Dist};

#[path = "support/seed.rs"]
mod test_seed;
use test_seed::this_test_seed as seed;
use trimul::{
    Backend, DType, DeviceIo, DeviceSpan, DeviceTensor, DeviceWeights, Direction, Formulation, Layer, Linear, Options,
    Precision, Shape, Weights,
};

#[path = "support/cuda_device.rs"]
mod cuda_device;
#[path = "support/forward.rs"]
mod forward;

use cuda_device::{cuda, MAX_REL_L2, TOL};
use forward::forward_io;

/// Device copies of a layer's weights in one element type, and their descriptor.
struct DeviceCopy {
    _keep: Vec<DeviceBuffer<u8>>,
    weights: DeviceWeights,
}

fn round(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::Bf16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// `w` with every value rounded to `dtype`: what the device copy holds.
fn rounded(w: &Weights, dtype: DType) -> Weights {
    let mut w = w.clone();
    let lin = |l: &mut Linear| {
        l.weight.iter_mut().for_each(|v| *v = round(*v, dtype));
        l.bias.iter_mut().flatten().for_each(|v| *v = round(*v, dtype));
    };
    for l in
        [&mut w.left_proj, &mut w.left_gate, &mut w.right_proj, &mut w.right_gate, &mut w.out_gate, &mut w.out_proj]
    {
        lin(l);
    }
    for n in [&mut w.norm_in, &mut w.norm_out] {
        n.weight.iter_mut().chain(n.bias.iter_mut()).for_each(|v| *v = round(*v, dtype));
    }
    w
}

/// Bytes of `v` in `dtype`.
fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::Bf16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
    }
}

fn upload_bytes(b: &CudaBackend, bytes: &[u8]) -> DeviceBuffer<u8> {
    let mut buf = b.alloc_buffer::<u8>(bytes.len()).unwrap();
    b.upload_bytes(bytes, &mut buf).unwrap();
    buf
}

/// Uploads `w` in `dtype`. With `packed` (af3), left/right value rows share one `[2H, C]` tensor
/// and the gates another, as cuEquivariance's `p_in`/`g_in`: the descriptor points inside them.
fn to_device(b: &CudaBackend, w: &Weights, dtype: DType, packed: bool) -> DeviceCopy {
    let mut keep = Vec::new();
    let mut put = |v: &[f32]| -> DeviceTensor {
        let buf = upload_bytes(b, &encode(v, dtype));
        let t = DeviceTensor::new(buf.ptr(), dtype, v.len());
        keep.push(buf);
        t
    };
    let mut weights = DeviceWeights::place(w, |v| Ok(put(v))).unwrap();
    if packed {
        let halves = |a: &Linear, b: &Linear| -> Vec<f32> { a.weight.iter().chain(&b.weight).copied().collect() };
        let p_in = put(&halves(&w.left_proj, &w.right_proj));
        let g_in = put(&halves(&w.left_gate, &w.right_gate));
        let n = w.left_proj.weight.len();
        let at =
            |t: DeviceTensor, row_half: u64| DeviceTensor::new(t.ptr + row_half * (n * dtype.bytes()) as u64, dtype, n);
        weights.left_proj.weight = at(p_in, 0);
        weights.right_proj.weight = at(p_in, 1);
        weights.left_gate.weight = at(g_in, 0);
        weights.right_gate.weight = at(g_in, 1);
    }
    DeviceCopy { _keep: keep, weights }
}

fn span(buf: &DeviceBuffer<u8>) -> DeviceSpan {
    DeviceSpan { ptr: buf.ptr(), bytes: buf.len() as u64 }
}

/// y of one device forward of `layer` on `x` (host values, sent in `io`), with the workspace
/// in `ws`, on the backend's stream; as f32 values and raw bits.
fn device_forward(
    b: &CudaBackend,
    layer: &mut Layer<CudaBackend>,
    x: &[f32],
    mask: Option<&[f32]>,
    shape: Shape,
    io: Precision,
    ws: &DeviceBuffer<u8>,
) -> (Vec<f32>, Vec<u32>) {
    let dtype = match io {
        Precision::Bf16Io => DType::Bf16,
        Precision::F16Io => DType::F16,
        _ => DType::F32,
    };
    let xd = upload_bytes(b, &encode(x, dtype));
    let md = mask.map(|m| upload_bytes(b, &encode(m, DType::F32)));
    let yd = upload_bytes(b, &vec![0xFF; x.len() * dtype.bytes()]);
    let dio = DeviceIo {
        x: xd.ptr(),
        mask: md.as_ref().map(|m| m.ptr()),
        y: yd.ptr(),
        shape,
        io,
        stream: b.stream() as u64,
        workspace: Some(span(ws)),
    };
    // SAFETY: x, mask, y and the workspace are live allocations sized for `shape` (the workspace
    // by device_workspace_bytes), and the download below waits for the stream.
    unsafe { layer.forward_device(&dio).unwrap() };
    let mut bytes = vec![0u8; x.len() * dtype.bytes()];
    b.download_bytes(&yd, &mut bytes).unwrap();
    let words: Vec<u16> = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    match dtype {
        DType::F32 => {
            let v: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let bits = v.iter().map(|f| f.to_bits()).collect();
            (v, bits)
        }
        _ => {
            let v = words.iter().map(|&w| io.decode_half(w)).collect();
            (v, words.iter().map(|&w| w as u32).collect())
        }
    }
}

#[test]
fn device_prepared_weights_and_caller_workspace_match_host_layer_bit_for_bit() {
    let Some(b) = cuda() else { return };
    let s = seed();
    let cases = [
        // (formulation, case, direction, biases, weight dtype, af3's packed p_in/g_in)
        (
            Formulation::GpuMode,
            Case::new(64, 1, 128, true, Dist::Normal),
            Direction::Outgoing,
            false,
            DType::F32,
            false,
        ),
        (Formulation::Af3, Case::new(64, 2, 128, true, Dist::Cauchy), Direction::Incoming, true, DType::Bf16, true),
        (Formulation::Af3, Case::new(33, 1, 64, false, Dist::Normal), Direction::Outgoing, true, DType::F16, true),
        (
            Formulation::GpuMode,
            Case::new(32, 1, 768, true, Dist::Normal),
            Direction::Outgoing,
            false,
            DType::Bf16,
            false,
        ),
    ];
    for (i, (f, case, dir, biases, dtype, packed)) in cases.into_iter().enumerate() {
        let mut problem = case.problem(f, dir).unwrap();
        if case.c == 64 {
            // An odd hidden width: padding rows in the fused layout.
            problem.config = trimul::Config::new(f, 64, 40).unwrap();
        }
        let weights = rounded(&Weights::random(problem.config, biases, s ^ i as u64).unwrap(), dtype);
        let inputs = suite::generate_inputs(&case, s ^ 0xD1 ^ i as u64);
        let copy = to_device(&b, &weights, dtype, packed);
        let cfg = problem.config;
        let storage_bytes = Layer::prepared_device_bytes(&b, &cfg, biases).unwrap();
        let storage = b.alloc_buffer::<u8>(storage_bytes as usize).unwrap();
        // SAFETY: the weight copies and the storage live until the end of this iteration, after
        // the downloads that wait for the stream.
        let mut dev = unsafe {
            Layer::from_device_weights(&b, &copy.weights, Options::new(dir), span(&storage), b.stream() as u64).unwrap()
        };
        let mut host = Layer::new(&b, &weights, Options::new(dir)).unwrap();
        // 16-bit x and y need the fused kernels: C a multiple of 8 up to 512, H a multiple of 16.
        let ios: &[Precision] = if cfg.c > 512 || cfg.h % 16 != 0 {
            &[Precision::F32Io]
        } else {
            &[Precision::F32Io, Precision::Bf16Io, Precision::F16Io]
        };
        for &io in ios {
            let x: Vec<f32> = inputs.x.iter().map(|&v| io.round(v)).collect();
            let mask = inputs.mask.as_deref();
            let need = dev.device_workspace_bytes(case.shape(), mask.is_some(), io).unwrap();
            let ws_a = b.alloc_buffer::<u8>(need as usize).unwrap();
            let ws_b = b.alloc_buffer::<u8>(need as usize + 4096).unwrap();
            let (y, bits) = device_forward(&b, &mut dev, &x, mask, case.shape(), io, &ws_a);
            let p = problem.with_io(io);
            let cmp = reference::check(&weights, &p, &x, mask, &y, TOL, TOL).unwrap();
            eprintln!("{f} C={} {dir} {dtype} weights, {io}: {cmp}", cfg.c);
            assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "{f} C={} {io}: {cmp}", cfg.c);
            let (_, _, want) = forward_io(&mut host, &x, mask, case.shape(), io).unwrap();
            assert!(bits == want, "{f} C={} {io}: device-prepared y differs from the host-prepared layer's", cfg.c);
            // The same workspace plan bound to another span gives the same bits.
            let (_, again) = device_forward(&b, &mut dev, &x, mask, case.shape(), io, &ws_b);
            assert!(again == bits, "{f} C={} {io}: moving the workspace changed y", cfg.c);
            // Too small a span is refused before any work.
            let small = b.alloc_buffer::<u8>(need as usize - 256).unwrap();
            let dio = DeviceIo {
                x: ws_a.ptr(),
                mask: None,
                y: ws_b.ptr(),
                shape: case.shape(),
                io,
                stream: b.stream() as u64,
                workspace: Some(span(&small)),
            };
            // SAFETY: refused before anything is enqueued.
            let e = unsafe { dev.forward_device(&dio) }.unwrap_err().to_string();
            assert!(e.contains("workspace"), "{e}");
        }
        b.synchronize().unwrap();
    }
}

/// The LayerNorm epsilon reaches the kernels: eps = 1e-2 on x scaled to variance ~1e-4 matches the
/// reference with that eps (host and device preparation), and differs from the default's.
#[test]
fn layer_norm_eps_reaches_the_kernels() {
    let Some(b) = cuda() else { return };
    let s = seed();
    let case = Case::new(64, 1, 128, true, Dist::Normal);
    for f in [Formulation::GpuMode, Formulation::Af3] {
        let problem = case.problem(f, Direction::Outgoing).unwrap();
        let weights = Weights::random(problem.config, f == Formulation::Af3, s).unwrap();
        let inputs = suite::generate_inputs(&case, s ^ 0xE5);
        let x: Vec<f32> = inputs.x.iter().map(|v| v * 1e-2).collect();
        let mask = inputs.mask.as_deref();
        let mut layer = Layer::new(&b, &weights, Options::new(Direction::Outgoing).with_eps(1e-2)).unwrap();
        let mut y = vec![f32::NAN; x.len()];
        layer.forward_into(&x, mask, &mut y, case.shape()).unwrap();
        let wide = problem.with_eps(1e-2);
        let cmp = reference::check(&weights, &wide, &x, mask, &y, TOL, TOL).unwrap();
        eprintln!("{f} eps 1e-2: {cmp}");
        assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "{f}: {cmp}");
        let default = reference::check(&weights, &problem, &x, mask, &y, TOL, TOL).unwrap();
        assert!(default.rel_l2 > 1e-2, "{f}: eps 1e-2 should move y away from the default eps's: {default}");
    }
}

/// A layer re-prepared with new device weights (GPU MODE's protocol: new weights every call)
/// computes with them, keeping its workspace plan.
#[test]
fn re_prepared_device_weights_replace_the_old_ones() {
    let Some(b) = cuda() else { return };
    let s = seed();
    let case = Case::new(64, 2, 128, true, Dist::Normal);
    let problem = case.problem(Formulation::GpuMode, Direction::Outgoing).unwrap();
    let cfg = problem.config;
    let inputs = suite::generate_inputs(&case, s ^ 0x77);
    let bytes = Layer::prepared_device_bytes(&b, &cfg, false).unwrap() as usize;
    let w1 = Weights::random(cfg, false, s ^ 1).unwrap();
    let w2 = Weights::random(cfg, false, s ^ 2).unwrap();
    let (c1, c2) = (to_device(&b, &w1, DType::F32, false), to_device(&b, &w2, DType::F32, false));
    let (st1, st2) = (b.alloc_buffer::<u8>(bytes).unwrap(), b.alloc_buffer::<u8>(bytes).unwrap());
    // SAFETY: copies and storage outlive every forward below, each followed by a download.
    let mut layer = unsafe {
        Layer::from_device_weights(&b, &c1.weights, Options::default(), span(&st1), b.stream() as u64).unwrap()
    };
    let mask = inputs.mask.as_deref();
    let need = layer.device_workspace_bytes(case.shape(), true, Precision::F32Io).unwrap();
    let ws = b.alloc_buffer::<u8>(need as usize).unwrap();
    let (y1, _) = device_forward(&b, &mut layer, &inputs.x, mask, case.shape(), Precision::F32Io, &ws);
    assert!(reference::check(&w1, &problem, &inputs.x, mask, &y1, TOL, TOL).unwrap().passed());
    // SAFETY: as above.
    unsafe { layer.prepare_device_weights(&c2.weights, span(&st2), b.stream() as u64).unwrap() };
    let (y2, _) = device_forward(&b, &mut layer, &inputs.x, mask, case.shape(), Precision::F32Io, &ws);
    let cmp = reference::check(&w2, &problem, &inputs.x, mask, &y2, TOL, TOL).unwrap();
    assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "{cmp}");
    // Weights of another configuration are refused.
    let other = Weights::random(trimul::Config::new(Formulation::GpuMode, 256, 128).unwrap(), false, 3).unwrap();
    let c3 = to_device(&b, &other, DType::F32, false);
    // SAFETY: refused before anything is enqueued.
    let e = unsafe { layer.prepare_device_weights(&c3.weights, span(&st1), 0) }.unwrap_err().to_string();
    assert!(e.contains("given to a layer of"), "{e}");
}

/// A weight beyond f16's range makes the device-prepared result NaN rather than a plausible
/// wrong answer (the host path refuses such weights with an error).
#[test]
fn out_of_range_weight_gives_nan_not_garbage() {
    let Some(b) = cuda() else { return };
    let case = Case::new(32, 1, 128, false, Dist::Normal);
    let problem = case.problem(Formulation::Af3, Direction::Outgoing).unwrap();
    let mut w = Weights::random(problem.config, false, seed()).unwrap();
    w.left_proj.weight[5] = 1e6;
    assert!(Layer::new(&b, &w, Options::default()).is_err(), "the host path refuses it");
    let copy = to_device(&b, &w, DType::F32, false);
    let bytes = Layer::prepared_device_bytes(&b, &problem.config, false).unwrap() as usize;
    let st = b.alloc_buffer::<u8>(bytes).unwrap();
    // SAFETY: copy and storage outlive the forward, which is followed by a download.
    let mut layer = unsafe {
        Layer::from_device_weights(&b, &copy.weights, Options::default(), span(&st), b.stream() as u64).unwrap()
    };
    let inputs = suite::generate_inputs(&case, 9);
    let need = layer.device_workspace_bytes(case.shape(), false, Precision::F32Io).unwrap();
    let ws = b.alloc_buffer::<u8>(need as usize).unwrap();
    let (y, _) = device_forward(&b, &mut layer, &inputs.x, None, case.shape(), Precision::F32Io, &ws);
    assert!(y.iter().all(|v| v.is_nan()), "every output depends on left_proj's channel 0");
}

/// Where the one-pass workspace does not fit the limit the caller gives, the workspace in
/// caller memory is a chunked plan (hidden passes and row chunks), bound to the call's span and
/// moved between calls like a one-pass one; its y passes the f64 check and agrees with the
/// one-pass y. Below the narrowest chunked plan, planning fails with an out-of-memory error.
#[test]
fn caller_workspace_within_a_tight_limit_is_chunked() {
    let Some(b) = cuda() else { return };
    let s = seed();
    let case = Case::new(128, 2, 128, true, Dist::Normal);
    for (f, dir, io) in [
        (Formulation::Af3, Direction::Incoming, Precision::Bf16Io),
        (Formulation::GpuMode, Direction::Outgoing, Precision::F32Io),
    ] {
        let problem = case.problem(f, dir).unwrap().with_io(io);
        let w = Weights::random(problem.config, f == Formulation::Af3, s ^ 5).unwrap();
        let inputs = suite::generate_inputs(&case, s ^ 6);
        let x: Vec<f32> = inputs.x.iter().map(|&v| io.round(v)).collect();
        let mask = inputs.mask.as_deref();
        let copy = to_device(&b, &w, DType::F32, false);
        let bytes = Layer::prepared_device_bytes(&b, &problem.config, f == Formulation::Af3).unwrap() as usize;
        let st = b.alloc_buffer::<u8>(bytes).unwrap();
        let layer = || {
            // SAFETY: copy and storage outlive every forward below, each followed by a download.
            let options = Options::new(dir);
            unsafe { Layer::from_device_weights(&b, &copy.weights, options, span(&st), b.stream() as u64).unwrap() }
        };
        let (mut whole, mut chunked) = (layer(), layer());
        let one_pass = whole.device_workspace_bytes(case.shape(), true, io).unwrap();
        let ws = b.alloc_buffer::<u8>(one_pass as usize).unwrap();
        let (want, _) = device_forward(&b, &mut whole, &x, mask, case.shape(), io, &ws);
        let limit = one_pass / 3;
        let need = chunked.device_workspace_bytes_within(case.shape(), true, io, Some(limit)).unwrap();
        assert!(need <= limit, "{f} {dir}: {need} bytes planned within {limit}");
        let (ws_a, ws_b) = (b.alloc_buffer::<u8>(need as usize).unwrap(), b.alloc_buffer::<u8>(need as usize).unwrap());
        let (y, bits) = device_forward(&b, &mut chunked, &x, mask, case.shape(), io, &ws_a);
        let cmp = reference::check(&w, &problem, &x, mask, &y, TOL, TOL).unwrap();
        eprintln!("{f} {dir} {io}, workspace {need} of {one_pass} bytes: {cmp}");
        assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "{f} {dir}: {cmp}");
        let worst = y.iter().zip(&want).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0f32, f32::max);
        assert!(worst <= 2e-2, "{f} {dir}: chunked y differs from one pass by {worst:e} (relative)");
        let (_, again) = device_forward(&b, &mut chunked, &x, mask, case.shape(), io, &ws_b);
        assert!(again == bits, "{f} {dir}: moving the chunked workspace changed y");
        // Another shape in between, then this one again in the span its chunked plan was sized
        // for: the layer plans it again within that span (a one-pass plan would not fit it).
        let other = Case::new(64, 1, 128, true, Dist::Normal);
        let oi = suite::generate_inputs(&other, s ^ 7);
        let ox: Vec<f32> = oi.x.iter().map(|&v| io.round(v)).collect();
        let ws_o =
            b.alloc_buffer::<u8>(chunked.device_workspace_bytes(other.shape(), true, io).unwrap() as usize).unwrap();
        let (oy, _) = device_forward(&b, &mut chunked, &ox, oi.mask.as_deref(), other.shape(), io, &ws_o);
        let op = other.problem(f, dir).unwrap().with_io(io);
        assert!(reference::check(&w, &op, &ox, oi.mask.as_deref(), &oy, TOL, TOL).unwrap().passed());
        let (_, third) = device_forward(&b, &mut chunked, &x, mask, case.shape(), io, &ws_a);
        assert!(third == bits, "{f} {dir}: the shape planned again in its span gave another y");
        let e = layer().device_workspace_bytes_within(case.shape(), true, io, Some(4096)).unwrap_err();
        assert!(matches!(e, trimul::Error::OutOfMemory { .. }), "{f} {dir}: {e}");
    }
}
