//! Device faults and range on a real CUDA GPU (issue 25). Every test skips with a visible message
//! when the build has no `cuda` feature or no device opens (`TRIMUL_REQUIRE_DEVICE=1` makes that
//! a failure). On the GPU machine:
//!
//! ```sh
//! cargo test --release --features cuda --test cuda_faults -- --nocapture
//! ```
//!
//! What is checked:
//! - a forward whose kernel faults (an illegal address, which CUDA makes sticky: the context is
//!   dead for the rest of the process) returns an error, and every later call (a forward on the
//!   same layer, a new layer) is refused with an error: none returns Ok with a stale y. It runs
//!   in a child process of this test binary, so the dead context cannot touch other tests;
//! - a forward refused for memory (another allocation holds the device) is an error before any
//!   work, leaves the caller's y untouched, and the same layer works exactly once memory is free;
//! - weights large enough to overflow the f16 intermediates never give a silently wrong y: either
//!   y is finite and matches the f32 CPU result, or `trimul::finite::check_output` reports the
//!   overflow.
#![cfg(feature = "cuda")]

#[path = "support/cuda_device.rs"]
mod cuda_device;

use cuda_device::{cuda, MAX_REL_L2, TOL};
use trimul::finite::{self, NonFinite};
use trimul::suite::{self, Case, Dist};
use trimul::{reference, Backend, BackendKind, Device, Direction, Error, Formulation, Layer, Options, TriMul, Weights};

/// Set in the child process that runs the sticky-fault part.
const CHILD: &str = "TRIMUL_CUDA_FAULT_CHILD";

/// One test at a time: one holds nearly all device memory, another starts a process that needs
/// some.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn an_illegal_address_fails_the_forward_and_every_later_call() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let _serial = serial();
    let Some(b) = cuda() else { return };
    drop(b);
    let exe = std::env::current_exe().unwrap();
    let o = std::process::Command::new(exe)
        .args(["--exact", "sticky_fault_in_a_process_of_its_own", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    eprintln!("child process:\n{out}{err}");
    assert!(o.status.success(), "the child failed");
    assert!(out.contains("1 passed"), "the child ran no test: {out}");
}

/// The part of [`an_illegal_address_fails_the_forward_and_every_later_call`] that kills the
/// context; ignored so that it only runs in that test's child process.
#[test]
#[ignore = "run by an_illegal_address_fails_the_forward_and_every_later_call in a process of its own"]
fn sticky_fault_in_a_process_of_its_own() {
    if std::env::var_os(CHILD).is_none() {
        eprintln!("SKIPPED: only meaningful in the child process its parent test starts");
        return;
    }
    let b = cuda().expect("the parent saw a device");
    let case = Case::new(32, 1, 128, false, Dist::Normal);
    let problem = case.problem(Formulation::GpuMode, Direction::Outgoing).unwrap();
    let weights = Weights::random(problem.config, false, 3).unwrap();
    let inputs = suite::generate_inputs(&case, 4);
    let mut layer = Layer::new(&b, &weights, Options::default()).unwrap();
    let mut y = vec![f32::NAN; inputs.x.len()];
    layer.forward_into(&inputs.x, None, &mut y, case.shape()).unwrap();
    let cmp = reference::check(&weights, &problem, &inputs.x, None, &y, TOL, TOL).unwrap();
    assert!(cmp.passed(), "{cmp}");

    let yd = b.alloc(inputs.x.len()).unwrap();
    // Poisoning would fill y with a memset first: off, so that a kernel is what faults. A bad
    // y was refused before any kernel ran on the H100 (the poison memset, then cuBLASLt, which
    // borrows y as its workspace, reported CUDA_ERROR_INVALID_VALUE and
    // CUBLAS_STATUS_INVALID_VALUE: errors, but not sticky); a bad x is read by the first kernel.
    b.set_poison(false);
    // SAFETY: deliberately violated: x is an address no allocation has (16-byte aligned, so the
    // checks before the launch pass). The GPU's memory protection turns the input kernel's first
    // load there into CUDA_ERROR_ILLEGAL_ADDRESS; nothing of the host is touched.
    let enqueued = unsafe { layer.forward_on_stream(0x10, None, yd.ptr(), case.shape(), b.stream() as u64) };
    let synced = b.synchronize();
    let fault = enqueued.err().or(synced.err()).expect("a kernel loading from address 0x10 reported no error");
    eprintln!("the faulting forward: {fault}");
    assert!(matches!(fault, Error::Driver { .. }), "{fault:?}");

    // Every later call is refused; none hands back a y as valid.
    let mut y2 = vec![-7.25f32; inputs.x.len()];
    let later = layer.forward_into(&inputs.x, None, &mut y2, case.shape());
    eprintln!("the next forward on the same layer: {later:?}");
    assert!(later.is_err(), "a forward after a sticky fault returned Ok");
    match Layer::new(&b, &weights, Options::default()) {
        Err(e) => eprintln!("a new layer: {e}"),
        Ok(mut fresh) => {
            let r = fresh.forward_into(&inputs.x, None, &mut y2, case.shape());
            eprintln!("a forward on a new layer: {r:?}");
            assert!(r.is_err(), "a new layer's forward after a sticky fault returned Ok");
        }
    }
}

/// Another allocation holds all but 256 MiB of the device: a forward that needs more is refused
/// before any work (y untouched), and the same layer computes exactly once memory is free.
#[test]
fn a_forward_refused_for_memory_leaves_the_layer_usable() {
    let _serial = serial();
    let Some(b) = cuda() else { return };
    let small = Case::new(64, 1, 128, true, Dist::Normal);
    let big = Case::new(1024, 1, 128, false, Dist::Normal);
    let problem = big.problem(Formulation::Af3, Direction::Incoming).unwrap();
    let weights = Weights::random(problem.config, true, 8).unwrap();
    let options = Options::new(Direction::Incoming);
    let (si, bi) = (suite::generate_inputs(&small, 9), suite::generate_inputs(&big, 10));
    let mut layer = Layer::new(&b, &weights, options).unwrap();
    let mut want_small = vec![f32::NAN; si.x.len()];
    layer.forward_into(&si.x, si.mask.as_deref(), &mut want_small, small.shape()).unwrap();

    let free = b.memory_info().unwrap().unwrap().free;
    let hog = b.alloc_buffer::<u8>((free - (256 << 20)) as usize).unwrap();
    let mut y = vec![-7.25f32; bi.x.len()];
    match layer.forward_into(&bi.x, None, &mut y, big.shape()) {
        Err(e @ Error::OutOfMemory { .. }) => eprintln!("refused as it should be: {e}"),
        other => panic!("expected OutOfMemory with 256 MiB free, got {other:?}"),
    }
    assert!(y.iter().all(|&v| v == -7.25), "a refused forward wrote y");
    drop(hog);

    layer.forward_into(&bi.x, None, &mut y, big.shape()).unwrap();
    let cmp = reference::check(&weights, &problem, &bi.x, None, &y, TOL, TOL).unwrap();
    assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "{cmp}");
    let mut again = vec![f32::NAN; si.x.len()];
    layer.forward_into(&si.x, si.mask.as_deref(), &mut again, small.shape()).unwrap();
    assert!(again.iter().zip(&want_small).all(|(a, b)| a.to_bits() == b.to_bits()), "the small shape changed");
}

/// Weights scaled up until the f16 intermediates overflow: at every scale, y is either finite
/// and matches the f32 CPU result, or the separate output check reports the overflow.
#[test]
fn f16_overflow_never_gives_a_silently_wrong_y() {
    let _serial = serial();
    let Some(b) = cuda() else { return };
    let gpu = Device::Cuda(b);
    let case = Case::new(256, 1, 128, false, Dist::Normal);
    let problem = case.problem(Formulation::GpuMode, Direction::Outgoing).unwrap();
    let inputs = suite::generate_inputs(&case, 12);
    let x_count = NonFinite::count(&inputs.x);
    let mut overflowed = None;
    for scale in [1.0f32, 10.0, 100.0, 300.0, 1000.0, 3000.0] {
        let mut w = Weights::random(problem.config, false, 13).unwrap();
        for lin in [&mut w.left_proj, &mut w.right_proj] {
            lin.weight.iter_mut().for_each(|v| *v *= scale);
        }
        let y = match TriMul::new(&gpu, &w, Options::default()) {
            Ok(mut layer) => layer.forward(&inputs.x, None, case.shape()).unwrap(),
            Err(e) => {
                eprintln!("scale {scale}: weights refused when the layer is made: {e}");
                break;
            }
        };
        match finite::check_output(&x_count, &y, BackendKind::Cuda) {
            Ok(count) => {
                assert!(count.all_finite());
                let cmp = reference::check(&w, &problem, &inputs.x, None, &y, TOL, TOL).unwrap();
                eprintln!("scale {scale}: finite, {cmp}");
                assert!(cmp.passed(), "scale {scale}: a finite but wrong y: {cmp}");
            }
            Err(e) => {
                eprintln!("scale {scale}: {e}");
                assert!(e.to_string().contains("f16"), "{e}");
                // The CPU computes in f32 and has the range for it.
                let mut cpu = TriMul::new(&Device::cpu(), &w, Options::default()).unwrap();
                let y_cpu = cpu.forward(&inputs.x, None, case.shape()).unwrap();
                assert!(finite::check_output(&x_count, &y_cpu, BackendKind::Cpu).is_ok(), "scale {scale} on the CPU");
                overflowed.get_or_insert(scale);
            }
        }
    }
    eprintln!("first scale that overflowed f16: {overflowed:?}");
}
