//! Seeds for the tests: fresh per run, printed, replayable. Shared by every test binary
//! (`#[path = "support/seed.rs"] mod seed;`) and by the library's own unit tests (included by
//! `src/lib.rs` under `cfg(test)`), so there is one copy and it is not part of the library's API.
// Each test binary uses one or both of the two functions.
#![allow(dead_code)]

/// A fresh seed for test `test` that a failing run can replay: one base per process, from
/// `TRIMUL_TEST_SEED` when set (a malformed value is an error, not a silent clock seed), else the
/// clock, mixed with the test's name so that tests draw different inputs. Prints the base with
/// how to replay it. Every test of the crate takes its seeds here.
pub fn test_seed(test: &str) -> u64 {
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(|| match std::env::var("TRIMUL_TEST_SEED") {
        Ok(s) => s.trim().parse().unwrap_or_else(|_| panic!("TRIMUL_TEST_SEED={s:?} is not a u64")),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64 ^ (d.as_secs() << 32)),
    });
    eprintln!("{test}: replay with TRIMUL_TEST_SEED={base}");
    // FNV-1a of the name: a fixed, well-spread mix.
    base ^ test.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// [`test_seed`] of the test running on this thread (libtest names each test's thread after the
/// test; with one test thread they share the name "main", and the base seed still replays them).
pub fn this_test_seed() -> u64 {
    test_seed(std::thread::current().name().unwrap_or("test"))
}
