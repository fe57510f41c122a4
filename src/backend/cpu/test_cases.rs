//! Test cases of the CPU backend's unit tests (forward and backward): a problem's shape and
//! options, and fresh random weights and inputs for it.

use crate::problem::{Config, Direction, Formulation, Problem, Shape};
use crate::rand::Rng;
use crate::weights::Weights;

pub(super) struct Case {
    pub f: Formulation,
    pub dir: Direction,
    pub b: usize,
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub masked: bool,
    pub biases: bool,
    pub cauchy: bool,
}

/// An unmasked case without biases and with normal inputs.
pub(super) fn case(f: Formulation, dir: Direction, b: usize, n: usize, c: usize, h: usize) -> Case {
    Case { f, dir, b, n, c, h, masked: false, biases: false, cauchy: false }
}

/// Weights, problem, x and mask of `cs`, and an `Rng` to draw more inputs from: fresh each run,
/// `seed` keeps a test's cases apart.
pub(super) fn inputs(cs: &Case, seed: u64) -> (Weights, Problem, Vec<f32>, Option<Vec<f32>>, Rng) {
    let seed = seed ^ crate::test_seed::this_test_seed();
    let cfg = Config::new(cs.f, cs.c, cs.h).unwrap();
    let w = Weights::random(cfg, cs.biases, seed).unwrap();
    let pr = Problem::new(cfg, Shape::new(cs.b, cs.n), cs.dir, cs.masked).unwrap();
    let mut rng = Rng::new(seed ^ 0xABCD);
    let x = if cs.cauchy { rng.cauchy_vec(pr.x_len(), 2.0) } else { rng.normal_vec(pr.x_len(), 1.0) };
    let mask = cs.masked.then(|| rng.mask_vec(pr.mask_len()));
    (w, pr, x, mask, rng)
}
