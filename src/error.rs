//! One error type for the whole crate.
//!
//! Every failure a caller can cause or meet (bad shapes, missing weights, a missing vendor
//! library, a driver error, device memory exhausted) is a variant here with enough context to act
//! on. Nothing in the library panics on bad input.

use std::fmt;

use crate::named::named_enum;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which backend an error or a choice refers to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum BackendKind {
    /// The CPU backend.
    Cpu,
    /// The NVIDIA backend.
    Cuda,
    /// The AMD backend.
    Hip,
}

impl BackendKind {
    /// Every backend, in detection order (HIP, CUDA, CPU).
    pub const ALL: [BackendKind; 3] = [BackendKind::Hip, BackendKind::Cuda, BackendKind::Cpu];

    /// The cargo feature that compiles this backend in (CPU is always built).
    pub fn feature(self) -> Option<&'static str> {
        match self {
            BackendKind::Cpu => None,
            BackendKind::Cuda => Some("cuda"),
            BackendKind::Hip => Some("rocm"),
        }
    }
}

named_enum!(BackendKind, "backend", [Cpu => "cpu", Cuda => "cuda" | "nvidia", Hip => "hip" | "rocm" | "amd"]);

/// Everything that can go wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shape, size or configuration value is wrong. The message names the tensor or field.
    #[error("shape error: {0}")]
    Shape(String),

    /// A weight tensor is missing, misnamed, of the wrong shape or inconsistent with the others.
    #[error("weights error: {0}")]
    Weights(String),

    /// A tensor has a dtype this operation does not accept.
    #[error("unsupported dtype: {0}")]
    Dtype(String),

    /// A caller-supplied value is out of range or contradictory.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The backend was asked for but not compiled into this build.
    #[error("backend `{backend}` is not compiled into this build: rebuild with `--features {feature}`")]
    NotCompiled {
        /// The backend asked for.
        backend: BackendKind,
        /// The cargo feature that compiles it in.
        feature: &'static str,
    },

    /// A vendor library could not be loaded; `tried` lists the names given to the loader.
    #[error("{library} could not be loaded (tried {tried}): {reason}")]
    LibraryNotFound {
        /// The library, e.g. `libcuda (NVIDIA driver)`.
        library: String,
        /// The file names given to the loader.
        tried: String,
        /// What the loader said, or what to do about it.
        reason: String,
    },

    /// A library loaded but lacks a symbol we need (usually too old a version).
    #[error("{library} has no symbol `{symbol}` (library too old?)")]
    MissingSymbol {
        /// The library's file.
        library: String,
        /// The missing entry point.
        symbol: String,
    },

    /// The backend's libraries loaded but there is no usable device.
    #[error("no {backend} device: {reason}")]
    NoDevice {
        /// The backend whose device is missing.
        backend: BackendKind,
        /// Why: no device, a device number out of range, a too-old GPU.
        reason: String,
    },

    /// A driver or runtime call failed; `call` names it, `code` is the vendor's error name.
    #[error("{backend} call {call} failed: {code}")]
    Driver {
        /// The backend whose driver or runtime failed.
        backend: BackendKind,
        /// The failing call.
        call: String,
        /// The vendor's error name (e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`).
        code: String,
    },

    /// A BLAS library call returned a failure status.
    #[error("{library} {call} failed with status {status}")]
    Blas {
        /// `cuBLASLt` or `rocBLAS`.
        library: &'static str,
        /// The failing call.
        call: String,
        /// The status the library returned.
        status: String,
    },

    /// No kernel for this device's architecture was built and runtime compilation failed or is
    /// unavailable.
    #[error("no kernels for {arch}: {reason}")]
    NoKernels {
        /// The device's architecture.
        arch: String,
        /// Why no kernel could be loaded or compiled.
        reason: String,
    },

    /// The work does not fit in device (or budgeted) memory. Raised before anything is allocated.
    #[error("out of memory on {backend}: {what} needs {needed} bytes, {available} bytes available")]
    OutOfMemory {
        /// Where the memory was wanted (the host: [`BackendKind::Cpu`]).
        backend: BackendKind,
        /// What needed it.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes available (or the budget).
        available: u64,
    },

    /// A broken internal invariant of the library: a bug to report, not something the caller did.
    #[error("internal error (please report): {0}")]
    Internal(String),

    /// The operation exists, but this backend does not implement it (yet).
    #[error("{what} is not available on the {backend} backend yet")]
    Unsupported {
        /// The backend asked.
        backend: BackendKind,
        /// The operation, e.g. `the backward pass`.
        what: String,
    },

    /// A forward on finite inputs gave NaN or infinite outputs: an intermediate overflowed the
    /// precision it is held in (see [`crate::finite`]). Raised by [`crate::finite::check_output`],
    /// never by a forward itself.
    #[error("{count} of {len} outputs are NaN or infinite although x is finite: {reason}")]
    NonFinite {
        /// Non-finite outputs.
        count: usize,
        /// Outputs in all.
        len: usize,
        /// The likely cause and what to do.
        reason: String,
    },

    /// File or tensor-container problems.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An I/O error without a file name to attach.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Shorthand for a driver/runtime error.
    pub fn driver(backend: BackendKind, call: impl Into<String>, code: impl fmt::Display) -> Self {
        Error::Driver { backend, call: call.into(), code: code.to_string() }
    }
}
