//! A small deterministic random source for weights, test inputs and reference sampling.
//!
//! splitmix64 for the bits, Box–Muller for normals, the inverse CDF for Cauchy. Deterministic
//! per seed on every platform, so a failing check can be replayed from its seed.

/// splitmix64 generator.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
    spare: Option<f64>,
}

impl Rng {
    /// A generator seeded with `seed` (the same seed, the same stream).
    pub fn new(seed: u64) -> Self {
        Rng { state: seed ^ 0x5DEE_CE66_D1CE_4E5B, spare: None }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in the open interval (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let th = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(r * th.sin());
        r * th.cos()
    }

    /// Cauchy with location 0 and the given scale.
    pub fn cauchy(&mut self, scale: f64) -> f64 {
        scale * (std::f64::consts::PI * (self.uniform() - 0.5)).tan()
    }

    /// `len` samples of N(0, scale²).
    pub fn normal_vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| (self.normal() as f32) * scale).collect()
    }

    /// `len` samples of Cauchy(0, scale).
    pub fn cauchy_vec(&mut self, len: usize, scale: f64) -> Vec<f32> {
        (0..len).map(|_| self.cauchy(scale) as f32).collect()
    }

    /// Each element 0 or 1 with equal probability.
    pub fn mask_vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| (self.next_u64() >> 63) as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_moments_and_cauchy_median() {
        let mut r = Rng::new(7);
        let v: Vec<f64> = (0..200_000).map(|_| r.normal()).collect();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01 && (var - 1.0).abs() < 0.02, "mean {mean} var {var}");
        let mut c: Vec<f64> = (0..100_001).map(|_| r.cauchy(2.0).abs()).collect();
        c.sort_by(f64::total_cmp);
        // median of |Cauchy(0, s)| is s
        assert!((c[50_000] - 2.0).abs() < 0.1, "{}", c[50_000]);
        let m = r.mask_vec(10_000);
        let ones = m.iter().filter(|&&x| x == 1.0).count();
        assert!(m.iter().all(|&x| x == 0.0 || x == 1.0) && (4_500..5_500).contains(&ones));
    }
}
