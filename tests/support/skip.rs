//! A GPU test's device, or a visible skip. Shared by tests/support/cuda_device.rs, tests/hip_gpu.rs
//! and the conformance suite.

use std::io::Write;

/// The `what` device once `poison` has turned NaN poisoning on (every intermediate and y filled
/// with NaN before each forward, so that an element a backend fails to write cannot pass as a stale
/// correct value), or `None` after saying on stderr why the test is skipped. The skip is written
/// to the stderr handle, not through eprintln!, so the test harness does not capture it and it
/// shows in every run. With `TRIMUL_REQUIRE_DEVICE` set a missing device is a failure instead, for
/// machines that have one.
pub fn poisoned_or_skip<D>(what: &str, device: trimul::Result<D>, poison: impl FnOnce(&D)) -> Option<D> {
    match device {
        Ok(d) => {
            poison(&d);
            Some(d)
        }
        Err(e) if std::env::var_os("TRIMUL_REQUIRE_DEVICE").is_some() => {
            panic!("{what} device required (TRIMUL_REQUIRE_DEVICE is set) but unavailable: {e}")
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED: {what}: {e}");
            None
        }
    }
}
