//! Seeds of the random inputs and weights: one per run, from `--seed` or the clock, printed so
//! that a run can be replayed, and split into independent seeds for the parts of the run.

/// A seed from the clock, for runs that were not given one.
pub fn clock_seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    // Mixed so that runs a second apart get unrelated seeds, and cut to 9 digits to stay easy
    // to retype.
    trimul::rand::Rng::new(nanos as u64).next_u64() % 1_000_000_000
}

/// Derives independent seeds for the parts of one run (inputs and weights of each case) from
/// the one seed the user sees.
pub struct SeedStream(trimul::rand::Rng);

impl SeedStream {
    pub fn new(seed: u64) -> SeedStream {
        SeedStream(trimul::rand::Rng::new(seed))
    }

    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
}
