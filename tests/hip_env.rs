//! `TRIMUL_HIP_LIBRARY` names the one HIP runtime file to load. In a binary of its own because it
//! sets a process-wide environment variable.
#![cfg(feature = "rocm")]

use trimul::{BackendKind, Device, Error};

#[test]
fn an_explicit_library_path_is_the_only_one_tried_and_is_named_in_the_error() {
    let path = "/nonexistent/trimul-test/libamdhip64.so.6";
    std::env::set_var("TRIMUL_HIP_LIBRARY", path);
    let e = Device::hip(0).unwrap_err();
    match &e {
        Error::LibraryNotFound { tried, reason, .. } => {
            assert_eq!(tried, path, "an explicit choice must not fall back to other names");
            assert!(reason.contains("No such file"), "{reason}");
        }
        other => panic!("expected LibraryNotFound, got {other:?}"),
    }
    // Detection still works, on another backend, and says why HIP was not taken.
    assert_ne!(Device::detect_auto().kind(), BackendKind::Hip);
    let probe = Device::probe_all();
    let (_, hip) = probe.iter().find(|(k, _)| *k == BackendKind::Hip).unwrap();
    assert!(hip.as_ref().unwrap_err().to_string().contains(path));
    // `trimul`-level selection of the HIP backend by environment is an error, not a fallback.
    std::env::set_var("TRIMUL_BACKEND", "hip");
    assert!(Device::detect().is_err());
}
