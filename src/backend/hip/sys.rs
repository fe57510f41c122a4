//! Raw run-time bindings to the three ROCm libraries the HIP backend drives: the HIP runtime
//! (`libamdhip64`), hipRTC (`libhiprtc`) and rocBLAS (`librocblas`).
//!
//! Nothing here is linked at build time: each library is opened with `libloading` on first use,
//! trying a list of candidate file names, and every symbol is resolved once into a table of
//! function pointers. A missing library is [`Error::LibraryNotFound`] (listing the names tried), a
//! missing symbol [`Error::MissingSymbol`]; neither panics. Only successful loads are cached, so a
//! caller who fixes `TRIMUL_HIP_LIBRARY` (or installs ROCm) can try again in the same process.
//!
//! We write these tables by hand rather than using `cubecl-hip-sys`: we need 29 HIP entry points
//! (plus 3 optional ones), 8 from hipRTC and 7 from rocBLAS (no crate offers rocBLAS without ROCm
//! at build time); the table compiles in a fraction of the time of a generated binding, does not
//! depend on `hipconfig` at build time, and its loader returns errors where we want them.
//! Signatures and constants were read from ROCm/HIP 6.3 `hip_runtime_api.h` and `hiprtc.h` and
//! ROCm/rocBLAS 4.3 `rocblas-types.h`/`rocblas-functions.h`. The one ABI change we know of in
//! this set, `hipDeviceProp_t` in ROCm 6.0, is handled in `result.rs::device_arch`; ROCm 7 keeps
//! the 6.0 property layout. Nothing here has yet been called against a real ROCm install.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_float, c_int, c_uint, c_void};
use std::sync::OnceLock;

use libloading::Library;

use crate::error::Error;

// ------------------------------------------------------------------------------------ HIP types

pub type hipError_t = c_int;
pub type hipStream_t = *mut c_void;
pub type hipModule_t = *mut c_void;
pub type hipFunction_t = *mut c_void;
pub type hipEvent_t = *mut c_void;
pub type hipDeviceptr_t = *mut c_void;

pub const HIP_SUCCESS: hipError_t = 0;
pub const HIP_ERROR_OUT_OF_MEMORY: hipError_t = 2;
pub const HIP_ERROR_NO_DEVICE: hipError_t = 100;

/// `hipDeviceAttribute_t` values (the CUDA-compatible block, stable since ROCm 5.0).
pub const HIP_ATTR_MULTIPROCESSOR_COUNT: c_int = 63;

/// Byte offset of `char gcnArchName[256]` in `hipDeviceProp_tR0600` (ROCm 6.0 to 7.x; the struct
/// is 1472 bytes on LP64). Computed with `offsetof` on the ROCm/HIP 6.3 header.
pub const PROP_R0600_GCN_ARCH_NAME: usize = 1160;
/// The same field in the pre-6.0 layout `hipDeviceProp_tR0000` (792 bytes on LP64).
pub const PROP_R0000_GCN_ARCH_NAME: usize = 396;
/// Size of the zeroed buffer we hand to `hipGetDeviceProperties*`: several times either layout,
/// so a future runtime that writes a longer struct still writes into our memory.
pub const PROP_BUFFER_BYTES: usize = 16 * 1024;

// ---------------------------------------------------------------------------------- hipRTC types

pub type hiprtcResult = c_int;
pub type hiprtcProgram = *mut c_void;
pub const HIPRTC_SUCCESS: hiprtcResult = 0;

// --------------------------------------------------------------------------------- rocBLAS types

pub type rocblas_handle = *mut c_void;
pub type rocblas_status = c_int;
pub type rocblas_operation = c_int;
pub type rocblas_datatype = c_int;
/// `rocblas_int` of the standard (LP64) rocBLAS build.
pub type rocblas_int = i32;
pub type rocblas_stride = i64;

pub const ROCBLAS_STATUS_SUCCESS: rocblas_status = 0;
pub const ROCBLAS_OPERATION_NONE: rocblas_operation = 111;
pub const ROCBLAS_OPERATION_TRANSPOSE: rocblas_operation = 112;
pub const ROCBLAS_DATATYPE_F16_R: rocblas_datatype = 150;
pub const ROCBLAS_DATATYPE_F32_R: rocblas_datatype = 151;
pub const ROCBLAS_DATATYPE_BF16_R: rocblas_datatype = 168;
pub const ROCBLAS_GEMM_ALGO_STANDARD: c_int = 0;
pub const ROCBLAS_GEMM_FLAGS_NONE: u32 = 0;

/// rocBLAS status names, for messages when `rocblas_status_to_string` is unavailable.
pub fn rocblas_status_name(status: rocblas_status) -> &'static str {
    match status {
        0 => "rocblas_status_success",
        1 => "rocblas_status_invalid_handle",
        2 => "rocblas_status_not_implemented",
        3 => "rocblas_status_invalid_pointer",
        4 => "rocblas_status_invalid_size",
        5 => "rocblas_status_memory_error",
        6 => "rocblas_status_internal_error",
        7 => "rocblas_status_perf_degraded",
        8 => "rocblas_status_size_query_mismatch",
        9 => "rocblas_status_size_increased",
        10 => "rocblas_status_size_unchanged",
        11 => "rocblas_status_invalid_value",
        12 => "rocblas_status_continue",
        13 => "rocblas_status_check_numerics_fail",
        14 => "rocblas_status_excluded_from_build",
        15 => "rocblas_status_arch_mismatch",
        _ => "rocblas_status_unknown",
    }
}

// ------------------------------------------------------------------------------------- loading

/// Environment variables naming one library file to load instead of the default candidates.
pub const HIP_LIBRARY_ENV: &str = "TRIMUL_HIP_LIBRARY";
pub const HIPRTC_LIBRARY_ENV: &str = "TRIMUL_HIPRTC_LIBRARY";
pub const ROCBLAS_LIBRARY_ENV: &str = "TRIMUL_ROCBLAS_LIBRARY";

/// File names tried for each library, newest soname last-but-unversioned first: the unversioned
/// name is what a ROCm install links to its current version.
pub const HIP_NAMES: &[&str] = &["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"];
pub const HIPRTC_NAMES: &[&str] = &["libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5"];
pub const ROCBLAS_NAMES: &[&str] = &["librocblas.so", "librocblas.so.5", "librocblas.so.4", "librocblas.so.3"];

/// The candidate paths for a library: only `$env_var` when it is set (an explicit choice should
/// not silently fall back); otherwise `$ROCM_PATH/lib`, `$HIP_PATH/lib`, the loader's search path
/// and `/opt/rocm/lib`, in that order.
pub fn candidates(env_var: &str, names: &[&str]) -> Vec<String> {
    if let Some(p) = std::env::var_os(env_var).filter(|p| !p.is_empty()) {
        return vec![p.to_string_lossy().into_owned()];
    }
    let mut out: Vec<String> = Vec::new();
    for root_var in ["ROCM_PATH", "HIP_PATH"] {
        if let Some(root) = std::env::var_os(root_var).filter(|p| !p.is_empty()) {
            let lib = std::path::Path::new(&root).join("lib");
            out.extend(names.iter().map(|n| lib.join(n).to_string_lossy().into_owned()));
        }
    }
    out.extend(names.iter().map(|n| n.to_string()));
    out.extend(names.iter().map(|n| format!("/opt/rocm/lib/{n}")));
    let mut seen = std::collections::HashSet::new();
    out.retain(|c| seen.insert(c.clone()));
    out
}

/// Opens the first candidate that loads. The error lists every name tried and the loader's
/// message for the first one (usually the most telling: "cannot open shared object file").
pub fn open_library(library: &str, candidates: &[String]) -> Result<(Library, String), Error> {
    let mut first_reason: Option<String> = None;
    for c in candidates {
        // SAFETY: opening a ROCm library runs its initialisers. libamdhip64, libhiprtc and
        // librocblas are built to be dlopen'ed (PyTorch and ONNX Runtime load them this way);
        // they register no callbacks into our code and we never unload them while a table that
        // points into them is alive (the table owns the `Library`).
        match unsafe { Library::new(c) } {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => {
                // libloading's Display says only "dlopen failed"; the loader's text is the source.
                let text = match std::error::Error::source(&e) {
                    Some(src) => format!("{e}: {src}"),
                    None => e.to_string(),
                };
                first_reason.get_or_insert(text);
            }
        }
    }
    Err(Error::LibraryNotFound {
        library: library.to_string(),
        tried: candidates.join(", "),
        reason: first_reason.unwrap_or_else(|| "no candidate file names".to_string()),
    })
}

/// Resolves `name` to a function pointer of type `T` (an `unsafe extern "C" fn`).
///
/// # Safety
/// `T` must be the C signature of the symbol; the pointer is valid while `lib` is loaded.
unsafe fn symbol<T: Copy>(lib: &Library, library: &str, name: &str) -> Result<T, Error> {
    let cname = format!("{name}\0");
    // SAFETY: the caller guarantees `T` matches the symbol's C signature.
    match unsafe { lib.get::<T>(cname.as_bytes()) } {
        Ok(s) => Ok(*s),
        Err(_) => Err(Error::MissingSymbol { library: library.to_string(), symbol: name.to_string() }),
    }
}

/// Like [`symbol`], `None` when absent (for entry points that exist only in some versions).
///
/// # Safety
/// As for [`symbol`].
unsafe fn optional_symbol<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    let cname = format!("{name}\0");
    // SAFETY: the caller guarantees `T` matches the symbol's C signature.
    unsafe { lib.get::<T>(cname.as_bytes()) }.ok().map(|s| *s)
}

// ------------------------------------------------------------------------------------ tables

/// Declares a table of a library's entry points and its loader from one list: each field is the
/// symbol of its name with the C signature written beside it, so a name and its signature are
/// written once. `required` symbols missing from the library are [`Error::MissingSymbol`]
/// (checked in the order listed); each `optional` one is the first of its names the library has,
/// or `None`.
macro_rules! symbol_table {
    (
        $(#[$doc:meta])*
        pub struct $table:ident for $library:literal;
        required {
            $( $(#[$rdoc:meta])* $req:ident: fn($($rarg:ty),* $(,)?) -> $rret:ty, )*
        }
        optional {
            $( $(#[$odoc:meta])* $opt:ident [$($alias:literal),+]: fn($($oarg:ty),* $(,)?) -> $oret:ty, )*
        }
    ) => {
        $(#[$doc])*
        #[allow(clippy::type_complexity)]
        pub struct $table {
            /// The file that loaded (for `trimul info`).
            pub path: String,
            $( $(#[$rdoc])* pub $req: unsafe extern "C" fn($($rarg),*) -> $rret, )*
            $( $(#[$odoc])* pub $opt: Option<unsafe extern "C" fn($($oarg),*) -> $oret>, )*
            // Last: the function pointers above point into this library, which must outlive them.
            _lib: Library,
        }

        impl $table {
            /// Loads the library from the first of `candidates` that opens and resolves every
            /// entry point. Not cached.
            pub fn load_from(candidates: &[String]) -> Result<$table, Error> {
                const LIB: &str = $library;
                let (lib, path) = open_library(LIB, candidates)?;
                // SAFETY: each field's type is the C signature that the table's declaration gives
                // for the symbol of the same name (from the headers its comment names), and the
                // pointers live as long as `lib`, which the table owns.
                unsafe {
                    Ok($table {
                        path,
                        $( $req: symbol(&lib, LIB, stringify!($req))?, )*
                        $( $opt: None $(.or_else(|| optional_symbol(&lib, $alias)))+, )*
                        _lib: lib,
                    })
                }
            }
        }
    };
}

// The C signatures of hip_runtime_api.h (ROCm 5.0 to 7.x).
symbol_table! {
    /// The HIP runtime entry points we use.
    pub struct HipApi for "HIP runtime (libamdhip64)";
    required {
        hipInit: fn(c_uint) -> hipError_t,
        hipGetDeviceCount: fn(*mut c_int) -> hipError_t,
        hipDeviceGetAttribute: fn(*mut c_int, c_int, c_int) -> hipError_t,
        hipDeviceGetName: fn(*mut c_char, c_int, c_int) -> hipError_t,
        hipDeviceGetPCIBusId: fn(*mut c_char, c_int, c_int) -> hipError_t,
        hipDeviceTotalMem: fn(*mut usize, c_int) -> hipError_t,
        hipSetDevice: fn(c_int) -> hipError_t,
        hipMalloc: fn(*mut *mut c_void, usize) -> hipError_t,
        hipFree: fn(*mut c_void) -> hipError_t,
        hipMemcpyHtoDAsync: fn(hipDeviceptr_t, *const c_void, usize, hipStream_t) -> hipError_t,
        hipMemcpyDtoHAsync: fn(*mut c_void, hipDeviceptr_t, usize, hipStream_t) -> hipError_t,
        hipMemcpyDtoDAsync: fn(hipDeviceptr_t, hipDeviceptr_t, usize, hipStream_t) -> hipError_t,
        hipMemsetAsync: fn(*mut c_void, c_int, usize, hipStream_t) -> hipError_t,
        hipStreamCreate: fn(*mut hipStream_t) -> hipError_t,
        hipStreamSynchronize: fn(hipStream_t) -> hipError_t,
        hipStreamDestroy: fn(hipStream_t) -> hipError_t,
        hipModuleLoadData: fn(*mut hipModule_t, *const c_void) -> hipError_t,
        hipModuleUnload: fn(hipModule_t) -> hipError_t,
        hipModuleGetFunction: fn(*mut hipFunction_t, hipModule_t, *const c_char) -> hipError_t,
        hipModuleLaunchKernel: fn(
            hipFunction_t,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            hipStream_t,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> hipError_t,
        hipEventCreate: fn(*mut hipEvent_t) -> hipError_t,
        hipEventRecord: fn(hipEvent_t, hipStream_t) -> hipError_t,
        hipEventSynchronize: fn(hipEvent_t) -> hipError_t,
        hipEventElapsedTime: fn(*mut c_float, hipEvent_t, hipEvent_t) -> hipError_t,
        hipEventDestroy: fn(hipEvent_t) -> hipError_t,
        hipMemGetInfo: fn(*mut usize, *mut usize) -> hipError_t,
        hipRuntimeGetVersion: fn(*mut c_int) -> hipError_t,
        hipDriverGetVersion: fn(*mut c_int) -> hipError_t,
        hipGetErrorName: fn(hipError_t) -> *const c_char,
    }
    optional {
        /// `hipGetDevicePropertiesR0600` (ROCm ≥ 6): fills a `hipDeviceProp_tR0600`.
        hipGetDevicePropertiesR0600 ["hipGetDevicePropertiesR0600"]: fn(*mut c_void, c_int) -> hipError_t,
        /// `hipGetDevicePropertiesR0000`, or plain `hipGetDeviceProperties` on ROCm 5: the old layout.
        /// (On ROCm ≥ 6 the plain symbol is the *old* layout too; the header renames calls by macro.)
        hipGetDevicePropertiesR0000 ["hipGetDevicePropertiesR0000", "hipGetDeviceProperties"]:
            fn(*mut c_void, c_int) -> hipError_t,
    }
}

// The C signatures of hiprtc.h.
symbol_table! {
    /// The hipRTC entry points we use.
    pub struct HiprtcApi for "hipRTC (libhiprtc)";
    required {
        hiprtcCreateProgram: fn(
            *mut hiprtcProgram,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> hiprtcResult,
        hiprtcCompileProgram: fn(hiprtcProgram, c_int, *const *const c_char) -> hiprtcResult,
        hiprtcGetCodeSize: fn(hiprtcProgram, *mut usize) -> hiprtcResult,
        hiprtcGetCode: fn(hiprtcProgram, *mut c_char) -> hiprtcResult,
        hiprtcGetProgramLogSize: fn(hiprtcProgram, *mut usize) -> hiprtcResult,
        hiprtcGetProgramLog: fn(hiprtcProgram, *mut c_char) -> hiprtcResult,
        hiprtcDestroyProgram: fn(*mut hiprtcProgram) -> hiprtcResult,
        hiprtcGetErrorString: fn(hiprtcResult) -> *const c_char,
    }
    optional {}
}

// The C signatures of rocblas-functions.h / rocblas-auxiliary.h of the LP64 build
// (rocblas_int = int32_t, rocblas_stride = int64_t).
symbol_table! {
    /// The rocBLAS entry points we use.
    pub struct RocblasApi for "rocBLAS (librocblas)";
    required {
        rocblas_create_handle: fn(*mut rocblas_handle) -> rocblas_status,
        rocblas_destroy_handle: fn(rocblas_handle) -> rocblas_status,
        rocblas_set_stream: fn(rocblas_handle, hipStream_t) -> rocblas_status,
        rocblas_gemm_ex: fn(
            rocblas_handle,
            rocblas_operation,
            rocblas_operation,
            rocblas_int,
            rocblas_int,
            rocblas_int,
            *const c_void,
            *const c_void,
            rocblas_datatype,
            rocblas_int,
            *const c_void,
            rocblas_datatype,
            rocblas_int,
            *const c_void,
            *const c_void,
            rocblas_datatype,
            rocblas_int,
            *mut c_void,
            rocblas_datatype,
            rocblas_int,
            rocblas_datatype,
            c_int,
            i32,
            u32,
        ) -> rocblas_status,
        rocblas_gemm_strided_batched_ex: fn(
            rocblas_handle,
            rocblas_operation,
            rocblas_operation,
            rocblas_int,
            rocblas_int,
            rocblas_int,
            *const c_void,
            *const c_void,
            rocblas_datatype,
            rocblas_int,
            rocblas_stride,
            *const c_void,
            rocblas_datatype,
            rocblas_int,
            rocblas_stride,
            *const c_void,
            *const c_void,
            rocblas_datatype,
            rocblas_int,
            rocblas_stride,
            *mut c_void,
            rocblas_datatype,
            rocblas_int,
            rocblas_stride,
            rocblas_int,
            rocblas_datatype,
            c_int,
            i32,
            u32,
        ) -> rocblas_status,
        rocblas_get_version_string: fn(*mut c_char, usize) -> rocblas_status,
    }
    optional {
        rocblas_status_to_string ["rocblas_status_to_string"]: fn(rocblas_status) -> *const c_char,
    }
}

// ---------------------------------------------------------------------------- process-wide cache

static HIP: OnceLock<HipApi> = OnceLock::new();
static HIPRTC: OnceLock<HiprtcApi> = OnceLock::new();
static ROCBLAS: OnceLock<RocblasApi> = OnceLock::new();

/// Loads `T` once per process; failures are not cached (see the module docs).
fn cached<T>(cell: &'static OnceLock<T>, load: impl FnOnce() -> Result<T, Error>) -> Result<&'static T, Error> {
    if let Some(t) = cell.get() {
        return Ok(t);
    }
    let t = load()?;
    // Two threads may both load; the loser's copy is dropped, which unloads nothing that the
    // winner uses (the OS reference-counts the library).
    Ok(cell.get_or_init(|| t))
}

/// The HIP runtime, loaded on first use.
pub fn hip() -> Result<&'static HipApi, Error> {
    cached(&HIP, || HipApi::load_from(&candidates(HIP_LIBRARY_ENV, HIP_NAMES)))
}

/// hipRTC, loaded on first use (only needed for archs without a prebuilt code object).
pub fn hiprtc() -> Result<&'static HiprtcApi, Error> {
    cached(&HIPRTC, || HiprtcApi::load_from(&candidates(HIPRTC_LIBRARY_ENV, HIPRTC_NAMES)))
}

/// rocBLAS, loaded on first use.
pub fn rocblas() -> Result<&'static RocblasApi, Error> {
    cached(&ROCBLAS, || RocblasApi::load_from(&candidates(ROCBLAS_LIBRARY_ENV, ROCBLAS_NAMES)))
}
