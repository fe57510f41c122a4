//! HIP backend (in progress).
