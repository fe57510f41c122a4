//! CUDA-graph capture of a forward, on a real GPU. A test binary of its own: while a stream is
//! being captured no other thread may synchronise the device, and the other GPU tests free
//! memory (`cuMemFree` synchronises) from their own threads all the time. Skips with a visible
//! message when the build has no `cuda` feature or no device opens.
#![cfg(feature = "cuda")]

#[path = "support/cuda_device.rs"]
mod cuda_device;

#[path = "support/seed.rs"]
mod test_seed;
use cuda_device::{cuda, MAX_REL_L2, TOL};
use trimul::backend::cuda::CudaBackend;
use trimul::reference;
use trimul::suite::{self, Case, Dist};
use trimul::{Backend, Direction, Formulation, Layer, Options, Weights};

/// A forward on a caller's stream can be captured into a CUDA graph (as PyTorch and JAX do with
/// the layers they run): no allocation, synchronisation or host-side decision happens inside it
/// once the workspace exists. The graph is replayed on new contents of the same buffers.
/// The tests here capture streams, which no other thread may synchronise the device during: one
/// at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The device, held by this test alone until the guard drops, or `None` (skipped) without one.
fn cuda_alone() -> Option<(std::sync::MutexGuard<'static, ()>, CudaBackend)> {
    let one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    Some((one, cuda()?))
}

#[test]
fn caller_stream_forward_captures_into_a_cuda_graph() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some((_one, b)) = cuda_alone() else { return };
    let case = Case::new(64, 2, 128, true, Dist::Cauchy);
    let problem = case.problem(Formulation::GpuMode, Direction::Outgoing).unwrap();
    let s = test_seed::test_seed("caller_stream_forward_captures_into_a_cuda_graph");
    let weights = Weights::random(problem.config, false, s).unwrap();
    let mut layer = Layer::new(&b, &weights, Options::default()).unwrap();
    let first = suite::generate_inputs(&case, s ^ 0x22);
    let (xl, ml) = (first.x.len(), first.mask.as_ref().unwrap().len());
    let (mut xd, mut md, yd) = (b.alloc(xl).unwrap(), b.alloc(ml).unwrap(), b.alloc(xl).unwrap());
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    // The workspace is made by a first, uncaptured forward (making it allocates).
    b.upload(&first.x, &mut xd).unwrap();
    b.upload(first.mask.as_ref().unwrap(), &mut md).unwrap();
    layer.forward_buffers(&xd, Some(&md), &mut b.alloc(xl).unwrap(), case.shape()).unwrap();
    b.synchronize().unwrap();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    // SAFETY: x, mask and y are live allocations of this backend's context sized for `case`, and
    // stay alive until the graph's last replay has been synchronised below.
    let captured =
        unsafe { layer.forward_on_stream(xd.ptr(), Some(md.ptr()), yd.ptr(), case.shape(), stream.cu_stream() as u64) };
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    captured.unwrap();
    let graph = graph.expect("the capture recorded work");
    for (k, inputs) in [first, suite::generate_inputs(&case, s ^ 0x23)].iter().enumerate() {
        b.upload(&inputs.x, &mut xd).unwrap();
        b.upload(inputs.mask.as_ref().unwrap(), &mut md).unwrap();
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        let mut y = vec![f32::NAN; xl];
        b.download(&yd, &mut y).unwrap();
        let cmp = reference::check(&weights, &problem, &inputs.x, inputs.mask.as_deref(), &y, TOL, TOL).unwrap();
        eprintln!("graph replay {k}: {cmp}");
        assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "graph replay {k}: {cmp}");
    }
}

/// With launch graphs on, forwards after the second of one shape replay a captured graph whose
/// kernel nodes get each call's arguments: every call's y, poisoned first, equals bit for bit the
/// one the same forward writes with plain launches, for inputs and outputs at other addresses
/// each call, and passes the f64 check.
#[test]
fn forwards_replay_a_launch_graph_with_each_calls_arguments() {
    let Some((_one, b)) = cuda_alone() else { return };
    b.set_poison(false);
    let s = test_seed::test_seed("forwards_replay_a_launch_graph_with_each_calls_arguments");
    let cases = [
        (Formulation::GpuMode, Direction::Outgoing, Case::new(64, 2, 128, true, Dist::Cauchy)),
        (Formulation::Af3, Direction::Incoming, Case::new(96, 1, 128, false, Dist::Normal)),
    ];
    for (f, dir, case) in cases {
        let problem = case.problem(f, dir).unwrap();
        let weights = Weights::random(problem.config, f == Formulation::Af3, s).unwrap();
        let inputs: Vec<_> = (0..3).map(|k| suite::generate_inputs(&case, s ^ (0x40 + k))).collect();
        let xl = inputs[0].x.len();
        let mut xs = Vec::new();
        let mut masks = Vec::new();
        let mut ys = Vec::new();
        for i in &inputs {
            let mut xd = b.alloc(xl).unwrap();
            b.upload(&i.x, &mut xd).unwrap();
            xs.push(xd);
            masks.push(i.mask.as_ref().map(|m| {
                let mut md = b.alloc(m.len()).unwrap();
                b.upload(m, &mut md).unwrap();
                md
            }));
            ys.push(b.alloc(xl).unwrap());
        }
        let mut run = |layer: &mut Layer<_>, k: usize| -> Vec<f32> {
            b.upload(&vec![f32::NAN; xl], &mut ys[k]).unwrap();
            let mask = masks[k].as_ref().map(|m| m.ptr());
            // SAFETY: x, mask and y are live allocations of this backend's context sized for
            // `case`, synchronised below before they are read or freed.
            unsafe { layer.forward_on_stream(xs[k].ptr(), mask, ys[k].ptr(), case.shape(), b.stream() as u64) }
                .unwrap();
            b.synchronize().unwrap();
            let mut y = vec![f32::NAN; xl];
            b.download(&ys[k], &mut y).unwrap();
            y
        };
        b.set_launch_graphs(false);
        let mut plain = Layer::new(&b, &weights, Options::new(dir)).unwrap();
        let want: Vec<Vec<f32>> = (0..3).map(|k| run(&mut plain, k)).collect();
        b.set_launch_graphs(true);
        let before = b.launch_graph_replays();
        let mut layer = Layer::new(&b, &weights, Options::new(dir)).unwrap();
        for call in 0..7 {
            let k = call % 3;
            let y = run(&mut layer, k);
            let what = format!("{f} {dir} call {call} (inputs {k})");
            let same = y.iter().zip(&want[k]).all(|(a, w)| a.to_bits() == w.to_bits());
            assert!(same, "{what}: not the plain launches' bits");
            let i = &inputs[k];
            let cmp = reference::check(&weights, &problem, &i.x, i.mask.as_deref(), &y, TOL, TOL).unwrap();
            assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "{what}: {cmp}");
        }
        let replays = b.launch_graph_replays() - before;
        eprintln!("{f} {dir}: {replays} of 7 forwards replayed a launch graph");
        // The first runs its launches, the second captures them; the rest replay.
        assert_eq!(replays, 6, "{f} {dir}");
    }
}

/// The same on caller memory with bf16 x and y, as the Python package calls it: x, the mask and
/// y at new addresses every call, the workspace at one, the output gate stored by the input stage
/// and made from x by the output stage (H100's kernel, where it applies).
#[test]
fn bf16_forwards_on_caller_memory_replay_a_launch_graph() {
    use trimul::backend::cuda::OutputGate;
    use trimul::{DeviceIo, DeviceSpan, Precision};
    let Some((_one, b)) = cuda_alone() else { return };
    b.set_poison(false);
    let s = test_seed::test_seed("bf16_forwards_on_caller_memory_replay_a_launch_graph");
    let case = Case::new(64, 1, 128, true, Dist::Normal);
    let problem = case.problem(Formulation::Af3, Direction::Outgoing).unwrap();
    let weights = Weights::random(problem.config, true, s).unwrap();
    let inputs: Vec<_> = (0..3).map(|k| suite::generate_inputs(&case, s ^ (0x50 + k))).collect();
    let bf16 = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect() };
    let upload = |bytes: &[u8]| {
        let mut buf = b.alloc_buffer::<u8>(bytes.len()).unwrap();
        b.upload_bytes(bytes, &mut buf).unwrap();
        buf
    };
    for gate in [OutputGate::Stored, OutputGate::FromX] {
        b.set_output_gate(gate);
        let run = |layer: &mut Layer<_>, ws: &trimul::backend::cuda::DeviceBuffer<u8>, k: usize| -> Vec<u8> {
            let i = &inputs[k];
            // New buffers every call: x, the mask and y move.
            let xd = upload(&bf16(&i.x));
            let md = upload(&i.mask.as_ref().unwrap().iter().flat_map(|m| m.to_le_bytes()).collect::<Vec<u8>>());
            let yd = upload(&vec![0xFF; i.x.len() * 2]);
            let dio = DeviceIo {
                x: xd.ptr(),
                mask: Some(md.ptr()),
                y: yd.ptr(),
                shape: case.shape(),
                io: Precision::Bf16Io,
                stream: b.stream() as u64,
                workspace: Some(DeviceSpan { ptr: ws.ptr(), bytes: ws.len() as u64 }),
            };
            // SAFETY: x, mask, y and the workspace are live allocations sized for the shape, and
            // the download below waits for the stream before they are freed.
            unsafe { layer.forward_device(&dio).unwrap() };
            let mut y = vec![0u8; i.x.len() * 2];
            b.download_bytes(&yd, &mut y).unwrap();
            y
        };
        let workspace = |layer: &mut Layer<_>| {
            let need = layer.device_workspace_bytes(case.shape(), true, Precision::Bf16Io).unwrap();
            b.alloc_buffer::<u8>(need as usize).unwrap()
        };
        b.set_launch_graphs(false);
        let mut plain = Layer::new(&b, &weights, Options::new(Direction::Outgoing)).unwrap();
        let ws = workspace(&mut plain);
        let want: Vec<Vec<u8>> = (0..3).map(|k| run(&mut plain, &ws, k)).collect();
        b.set_launch_graphs(true);
        let (before, from_x) = (b.launch_graph_replays(), b.gate_from_x_launches());
        let mut layer = Layer::new(&b, &weights, Options::new(Direction::Outgoing)).unwrap();
        let ws = workspace(&mut layer);
        for call in 0..5 {
            let k = call % 3;
            let y = run(&mut layer, &ws, k);
            assert!(y == want[k], "{gate:?} call {call}: not the plain launches' bits");
            let yf: Vec<f32> = y.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
            let i = &inputs[k];
            let cmp = reference::check(&weights, &problem, &i.x, i.mask.as_deref(), &yf, 2e-2, 2e-2).unwrap();
            assert!(cmp.passed(), "{gate:?} call {call}: {cmp}");
        }
        let replays = b.launch_graph_replays() - before;
        let counted = b.gate_from_x_launches() - from_x;
        eprintln!("{gate:?}: {replays} of 5 forwards launched a graph; the gate made from x in {counted}");
        assert_eq!(replays, 4, "{gate:?}");
        // Each forward counts its output kernel once, whether it ran, was captured or replayed.
        assert!(counted == 0 || counted == 5, "{gate:?}: gate-from-x launches counted {counted} times for 5 forwards");
    }
}
