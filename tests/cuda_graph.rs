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
use trimul::reference;
use trimul::suite::{self, Case, Dist};
use trimul::{Backend, Direction, Formulation, Layer, Options, Weights};

/// A forward on a caller's stream can be captured into a CUDA graph (as PyTorch and JAX do with
/// the layers they run): no allocation, synchronisation or host-side decision happens inside it
/// once the workspace exists. The graph is replayed on new contents of the same buffers.
#[test]
fn caller_stream_forward_captures_into_a_cuda_graph() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(b) = cuda() else { return };
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
