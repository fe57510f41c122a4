//! Builds the fake ROCm (tests/hip_emu/fake_rocm.cpp) once per test process and points the
//! HIP backend's loaders at it. Shared by the test binaries that run the backend on the fake.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

pub fn skip(what: &str) {
    if std::env::var_os("TRIMUL_REQUIRE_HIP_CLANG").is_some() {
        panic!("TRIMUL_REQUIRE_HIP_CLANG is set but {what}");
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED: {what}");
}

/// Builds the fake once, points the loaders at it, and serialises the tests (they change the fake
/// device's arch through the environment).
pub fn fake() -> Option<MutexGuard<'static, ()>> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let built = BUILT.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let cxx = std::env::var_os("TRIMUL_HOST_CXX").map(PathBuf::from).unwrap_or_else(|| "clang++-19".into());
        let dir = std::env::temp_dir().join(format!("trimul-fake-rocm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let lib = dir.join("libtrimul_fake_rocm.so");
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", "-Wall", "-Wno-psabi"])
            .arg("-I")
            .arg(&root)
            .arg(root.join("tests/hip_emu/fake_rocm.cpp"))
            .arg("-o")
            .arg(&lib)
            .output()
            .map_err(|e| format!("no host C++ compiler {} to build the fake ROCm: {e}", cxx.display()))?;
        if !out.status.success() {
            // A compiler that exists but fails on our code is a real failure, not a skip.
            panic!("building the fake ROCm failed:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::env::set_var("TRIMUL_HIP_LIBRARY", &lib);
        std::env::set_var("TRIMUL_ROCBLAS_LIBRARY", &lib);
        // No hipRTC: archs without prebuilt objects must fail clearly.
        std::env::set_var("TRIMUL_HIPRTC_LIBRARY", dir.join("no-hiprtc-here.so"));
        // The rocBLAS output path unless a test chooses (`set_mfma_kernels`), so that each test
        // knows which path it checks; the default, the MFMA kernel where this device's
        // validation passed and it won, is the subject of a test of its own, which unsets this.
        std::env::set_var("TRIMUL_HIP_MFMA", "0");
        // Fast-path verdicts stay in this process's directory, and the timed shape is small: the
        // emulation runs on the host's CPU.
        std::env::set_var("TRIMUL_CACHE_DIR", dir.join("verdicts"));
        std::env::set_var("TRIMUL_VALIDATION_N", "16");
        std::env::remove_var("TRIMUL_HIP_FORCE_RTC");
        Ok(lib)
    });
    match built {
        Ok(_) => {
            let guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
            std::env::set_var("TRIMUL_FAKE_ROCM_ARCH", "gfx942:sramecc+:xnack-");
            Some(guard)
        }
        Err(why) => {
            skip(why);
            None
        }
    }
}

/// The fake's launch record: how many launches of `kernel` ran in this process so far.
#[allow(dead_code)] // not every binary that builds the fake reads the record
pub fn launches(kernel: &str) -> i64 {
    record(b"trimul_fake_launches", kernel)
}

/// The launches of `kernel` this thread made so far (a launch runs on the thread that makes it).
#[allow(dead_code)]
pub fn thread_launches(kernel: &str) -> i64 {
    record(b"trimul_fake_thread_launches", kernel)
}

fn record(symbol: &[u8], kernel: &str) -> i64 {
    let lib = std::env::var_os("TRIMUL_HIP_LIBRARY").expect("the fake is built (fake())");
    let name = std::ffi::CString::new(kernel).unwrap();
    // SAFETY: the fake ROCm exports both record readers as `long f(const char*)`, which read a
    // NUL-terminated name and touch nothing else; the library stays loaded (the backend holds it).
    unsafe {
        let lib = libloading::Library::new(lib).expect("the fake ROCm loads");
        let f: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char) -> std::ffi::c_long> =
            lib.get(symbol).expect("the fake exports its launch record");
        f(name.as_ptr()) as i64
    }
}
