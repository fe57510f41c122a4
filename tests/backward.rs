//! The backward pass through the public API (issue 28): `TriMul::backward` on the CPU against
//! the f64 reference, and its argument checks. The backend's own unit tests
//! (`backend::cpu::backward`) cover the formulations, directions, masks and Cauchy inputs; this
//! file checks what a caller sees.

use trimul::rand::Rng;
use trimul::{reference, Config, Device, Direction, Error, Formulation, Options, Problem, Shape, TriMul, Weights};

fn setup(f: Formulation, biases: bool, seed: u64) -> (Weights, Vec<f32>, Vec<f32>, Vec<f32>) {
    let w = Weights::random(Config::new(f, 24, 16).unwrap(), biases, seed).unwrap();
    let len = 2 * 9 * 9 * 24;
    let mut rng = Rng::new(seed ^ 77);
    let x = rng.normal_vec(len, 1.0);
    let mask = rng.mask_vec(2 * 9 * 9);
    let dy = rng.normal_vec(len, 1.0);
    (w, x, mask, dy)
}

#[test]
fn trimul_backward_matches_the_f64_reference() {
    let shape = Shape::new(2, 9);
    for (f, biases, dir) in
        [(Formulation::Af3, true, Direction::Incoming), (Formulation::GpuMode, false, Direction::Outgoing)]
    {
        let (w, x, mask, dy) = setup(f, biases, 3);
        let mut layer = TriMul::new(&Device::cpu(), &w, Options::new(dir).with_eps(1e-3)).unwrap();
        let got = layer.backward(&x, Some(&mask), &dy, shape).unwrap();
        let problem = Problem::new(w.config(), shape, dir, true).unwrap().with_eps(1e-3);
        let want = reference::backward(&w, &problem, &x, Some(&mask), &dy).unwrap();
        for ((name, g), (_, r)) in got.tensors().iter().zip(want.tensors()) {
            let e = reference::compare(g, r, 0.0, f64::INFINITY).rel_l2;
            assert!(e > 0.0 && e < 1e-4, "{f:?} {name}: rel L2 {e:.2e}");
        }
        got.check_against(&w, x.len()).unwrap();
        // Every gradient is linear in dy, and doubling is exact in binary floating point.
        let dy2: Vec<f32> = dy.iter().map(|v| 2.0 * v).collect();
        let got2 = layer.backward(&x, Some(&mask), &dy2, shape).unwrap();
        for ((name, a), (_, b)) in got.tensors().iter().zip(got2.tensors()) {
            assert!(a.iter().zip(b).all(|(a, b)| 2.0 * a == *b), "{name} is not linear in dy");
        }
    }
}

#[test]
fn backward_names_what_is_wrong() {
    let (w, x, mask, dy) = setup(Formulation::Af3, false, 4);
    let mut layer = TriMul::new(&Device::cpu(), &w, Options::new(Direction::Outgoing)).unwrap();
    let shape = Shape::new(2, 9);
    let msg = |r: trimul::Result<trimul::Gradients>| match r {
        Err(e @ Error::Shape(_)) => e.to_string(),
        other => panic!("expected a shape error, got {other:?}"),
    };
    assert!(msg(layer.backward(&x, Some(&mask), &dy[1..], shape)).contains("dy has"));
    assert!(msg(layer.backward(&x[1..], Some(&mask), &dy, shape)).contains("x has"));
    assert!(msg(layer.backward(&x, Some(&mask[1..]), &dy, shape)).contains("mask"));
    assert!(layer.backward(&x, None, &dy, Shape::new(2, 0)).is_err(), "N = 0");
    // The layer still works after the refusals.
    assert!(layer.backward(&x, None, &dy, shape).is_ok());
}
