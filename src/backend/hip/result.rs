//! Status codes to `Result`, and thin owning wrappers over HIP, hipRTC and rocBLAS objects.
//!
//! Every call into the tables of `sys.rs` happens here. HIP errors become
//! [`Error::Driver`] with the runtime's own name for the code (`hipErrorOutOfMemory`), rocBLAS
//! failures [`Error::Blas`]. Handles free themselves on drop. Functions whose soundness depends
//! on device pointers the type system cannot see (kernel launches, GEMMs) are `unsafe fn`; the
//! rest check their arguments and are safe.

pub(crate) use crate::alloc_tracker::AllocTracker;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::Arc;

use super::blas::RocblasGemm;
use super::sys::{self, HipApi, HiprtcApi, RocblasApi};
use crate::error::{BackendKind, Error, Result};

// -------------------------------------------------------------------------------------- errors

/// The runtime's name for a HIP error code.
pub fn error_name(api: &HipApi, code: sys::hipError_t) -> String {
    // SAFETY: hipGetErrorName accepts any code and returns a pointer to a static string (or
    // "hipErrorUnknown"); we check for null anyway and copy the text out.
    let p = unsafe { (api.hipGetErrorName)(code) };
    if p.is_null() {
        return format!("hipError({code})");
    }
    // SAFETY: non-null, NUL-terminated static string owned by the runtime.
    let name = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    format!("{name} ({code})")
}

/// `Ok` for `hipSuccess`, otherwise a driver error naming `call`.
pub fn check(api: &HipApi, code: sys::hipError_t, call: &str) -> Result<()> {
    if code == sys::HIP_SUCCESS {
        Ok(())
    } else {
        Err(Error::driver(BackendKind::Hip, call, error_name(api, code)))
    }
}

/// `Ok` for `rocblas_status_success`, otherwise a BLAS error naming `call`.
pub fn check_blas(api: &RocblasApi, status: sys::rocblas_status, call: &str) -> Result<()> {
    if status == sys::ROCBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    let name = api
        .rocblas_status_to_string
        .map(|f| {
            // SAFETY: rocblas_status_to_string returns a static string for any value.
            let p = unsafe { f(status) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, NUL-terminated static string.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| sys::rocblas_status_name(status).to_string());
    Err(Error::Blas { library: "rocBLAS", call: call.to_string(), status: format!("{name} ({status})") })
}

fn rtc_error(api: &HiprtcApi, code: sys::hiprtcResult) -> String {
    // SAFETY: hiprtcGetErrorString returns a static string for any value.
    let p = unsafe { (api.hiprtcGetErrorString)(code) };
    if p.is_null() {
        format!("hiprtcResult({code})")
    } else {
        // SAFETY: non-null, NUL-terminated static string.
        format!("{} ({code})", unsafe { CStr::from_ptr(p) }.to_string_lossy())
    }
}

// ------------------------------------------------------------------------------ device queries

pub fn init(api: &HipApi) -> Result<()> {
    // SAFETY: hipInit takes flags (must be 0) and may be called repeatedly.
    check(api, unsafe { (api.hipInit)(0) }, "hipInit")
}

pub fn device_count(api: &HipApi) -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: writes one int to a valid local.
    let code = unsafe { (api.hipGetDeviceCount)(&mut n) };
    if code == sys::HIP_ERROR_NO_DEVICE {
        return Ok(0);
    }
    check(api, code, "hipGetDeviceCount")?;
    Ok(n.max(0) as usize)
}

pub fn set_device(api: &HipApi, ordinal: i32) -> Result<()> {
    // SAFETY: plain value argument; an invalid ordinal is reported as an error code.
    check(api, unsafe { (api.hipSetDevice)(ordinal) }, "hipSetDevice")
}

pub fn device_attribute(api: &HipApi, attr: c_int, ordinal: i32) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: writes one int to a valid local.
    check(api, unsafe { (api.hipDeviceGetAttribute)(&mut v, attr, ordinal) }, "hipDeviceGetAttribute")?;
    Ok(v)
}

/// Copies a NUL-terminated string out of a buffer the runtime filled.
fn c_buf_to_string(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).trim().to_string()
}

pub fn device_name(api: &HipApi, ordinal: i32) -> Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the runtime writes at most `len` bytes (NUL included) into our buffer.
    let code = unsafe { (api.hipDeviceGetName)(buf.as_mut_ptr().cast::<c_char>(), buf.len() as c_int - 1, ordinal) };
    check(api, code, "hipDeviceGetName")?;
    Ok(c_buf_to_string(&buf))
}

pub fn pci_bus_id(api: &HipApi, ordinal: i32) -> Result<String> {
    let mut buf = [0u8; 64];
    // SAFETY: as for hipDeviceGetName.
    let code =
        unsafe { (api.hipDeviceGetPCIBusId)(buf.as_mut_ptr().cast::<c_char>(), buf.len() as c_int - 1, ordinal) };
    check(api, code, "hipDeviceGetPCIBusId")?;
    Ok(c_buf_to_string(&buf))
}

pub fn device_total_mem(api: &HipApi, ordinal: i32) -> Result<u64> {
    let mut bytes: usize = 0;
    // SAFETY: writes one size_t to a valid local.
    check(api, unsafe { (api.hipDeviceTotalMem)(&mut bytes, ordinal) }, "hipDeviceTotalMem")?;
    Ok(bytes as u64)
}

/// The device's target id (`gfx942:sramecc+:xnack-`) from `hipDeviceProp_t.gcnArchName`.
///
/// `hipDeviceGetAttribute` has no arch name, so the property struct it is. Its layout changed in
/// ROCm 6.0 (`hipGetDevicePropertiesR0600`), and ROCm keeps the old entry point with the old
/// layout, so we call the newest entry point that exists with a zeroed buffer far larger than any
/// known layout, read the field at the offset documented for that layout, and fall back to a
/// scan for a target id when the offset does not hold one (a layout we do not know).
pub fn device_arch(api: &HipApi, ordinal: i32) -> Result<String> {
    let (f, offset, call) = match (api.hipGetDevicePropertiesR0600, api.hipGetDevicePropertiesR0000) {
        (Some(f), _) => (f, sys::PROP_R0600_GCN_ARCH_NAME, "hipGetDevicePropertiesR0600"),
        (None, Some(f)) => (f, sys::PROP_R0000_GCN_ARCH_NAME, "hipGetDeviceProperties"),
        (None, None) => {
            return Err(Error::MissingSymbol { library: api.path.clone(), symbol: "hipGetDeviceProperties".into() })
        }
    };
    let mut props = vec![0u8; sys::PROP_BUFFER_BYTES];
    // SAFETY: the buffer is 16 KiB, zeroed and 8-byte aligned enough for the runtime's writes
    // (Vec<u8> of this size comes from the global allocator, 16-byte aligned on our targets);
    // both property layouts are under 1.5 KiB.
    let code = unsafe { f(props.as_mut_ptr().cast::<c_void>(), ordinal) };
    check(api, code, call)?;
    super::arch::arch_from_props(&props, offset).ok_or_else(|| Error::NoKernels {
        arch: "unknown".into(),
        reason: format!("{call} returned no gcnArchName this build can read"),
    })
}

pub fn runtime_version(api: &HipApi) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: writes one int to a valid local.
    check(api, unsafe { (api.hipRuntimeGetVersion)(&mut v) }, "hipRuntimeGetVersion")?;
    Ok(v)
}

pub fn driver_version(api: &HipApi) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: writes one int to a valid local.
    check(api, unsafe { (api.hipDriverGetVersion)(&mut v) }, "hipDriverGetVersion")?;
    Ok(v)
}

/// Free and total memory of the current device.
pub fn mem_get_info(api: &HipApi) -> Result<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two size_t to valid locals.
    check(api, unsafe { (api.hipMemGetInfo)(&mut free, &mut total) }, "hipMemGetInfo")?;
    Ok((free as u64, total as u64))
}

pub fn rocblas_version(api: &RocblasApi) -> Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: rocBLAS writes at most `len` bytes, NUL included, into our buffer.
    let status = unsafe { (api.rocblas_get_version_string)(buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
    check_blas(api, status, "rocblas_get_version_string")?;
    Ok(c_buf_to_string(&buf))
}

// ------------------------------------------------------------------------------------- memory

/// Types that may be copied to and from device memory as raw bytes: no padding, every bit
/// pattern valid.
pub trait Plain: Copy + 'static {}
impl Plain for f32 {}
impl Plain for u16 {}
impl Plain for u8 {}

/// One device allocation, freed on drop.
pub struct DeviceMem {
    api: &'static HipApi,
    tracker: Arc<AllocTracker>,
    ptr: *mut c_void,
    bytes: usize,
    /// False for a view of memory the caller owns ([`DeviceMem::borrowed`]): never freed here.
    owned: bool,
}

// SAFETY: a device allocation is a plain address valid in every thread of the process (HIP has
// one address space per process); the struct holds no thread-affine state.
unsafe impl Send for DeviceMem {}
// SAFETY: shared references only read the address and size.
unsafe impl Sync for DeviceMem {}

impl DeviceMem {
    /// `bytes` of device memory on the current device (at least 1 byte is requested, so the
    /// address is never null), counted in `tracker`.
    pub(crate) fn alloc(api: &'static HipApi, tracker: &Arc<AllocTracker>, bytes: usize) -> Result<DeviceMem> {
        let mut ptr: *mut c_void = ptr::null_mut();
        // SAFETY: hipMalloc writes a device address into our local on success.
        let code = unsafe { (api.hipMalloc)(&mut ptr, bytes.max(1)) };
        if code == sys::HIP_ERROR_OUT_OF_MEMORY {
            return Err(Error::OutOfMemory {
                backend: BackendKind::Hip,
                what: "a device buffer".into(),
                needed: bytes as u64,
                available: mem_get_info(api).map_or(0, |(free, _)| free),
            });
        }
        check(api, code, "hipMalloc")?;
        tracker.add(bytes as u64);
        Ok(DeviceMem { api, tracker: tracker.clone(), ptr, bytes, owned: true })
    }

    /// A view of `bytes` at device address `addr` in memory the caller owns (a PyTorch tensor, a
    /// caller's workspace): not counted in the tracker, never freed here. Whoever makes one keeps
    /// the memory alive while the view is used; the view itself dereferences nothing.
    pub(crate) fn borrowed(api: &'static HipApi, tracker: &Arc<AllocTracker>, addr: u64, bytes: usize) -> DeviceMem {
        DeviceMem { api, tracker: tracker.clone(), ptr: addr as *mut c_void, bytes, owned: false }
    }

    /// Moves a borrowed view by the distance its caller memory moved (`from` → `to`).
    pub(crate) fn rebase(&mut self, from: u64, to: u64) -> Result<()> {
        if self.owned {
            return Err(Error::InvalidArgument("an owned device buffer cannot be rebased".into()));
        }
        self.ptr = (self.ptr as u64 - from + to) as *mut c_void;
        Ok(())
    }

    /// The device address, for kernel parameters and BLAS calls.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn range_check(&self, offset: usize, len: usize, what: &str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "{what}: {len} bytes at offset {offset} do not fit a {}-byte device buffer",
                self.bytes
            ))),
        }
    }

    /// Copies `src` to `offset` bytes into this buffer and waits for the copy.
    pub fn upload<T: Plain>(&self, stream: &Stream, offset: usize, src: &[T]) -> Result<()> {
        let len = std::mem::size_of_val(src);
        self.range_check(offset, len, "upload")?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the destination range lies inside our allocation (checked above) and the
        // source is a live host slice of `len` bytes; the stream is synchronised before we
        // return, so `src` outlives the copy even when the runtime stages pageable memory
        // asynchronously.
        let code = unsafe {
            (self.api.hipMemcpyHtoDAsync)(
                self.ptr.cast::<u8>().add(offset).cast::<c_void>(),
                src.as_ptr().cast::<c_void>(),
                len,
                stream.raw,
            )
        };
        check(self.api, code, "hipMemcpyHtoDAsync")?;
        stream.synchronize()
    }

    /// Copies `dst.len()` elements from `offset` bytes into this buffer into `dst`, after all work
    /// queued on `stream` before it.
    pub fn download<T: Plain>(&self, stream: &Stream, offset: usize, dst: &mut [T]) -> Result<()> {
        let len = std::mem::size_of_val(dst);
        self.range_check(offset, len, "download")?;
        if len == 0 {
            return stream.synchronize();
        }
        // SAFETY: the source range lies inside our allocation; `dst` is a live, exclusively
        // borrowed host slice of `len` bytes of a type valid for any bit pattern, and we
        // synchronise before returning, so the borrow outlives the copy.
        let code = unsafe {
            (self.api.hipMemcpyDtoHAsync)(
                dst.as_mut_ptr().cast::<c_void>(),
                self.ptr.cast::<u8>().add(offset).cast::<c_void>(),
                len,
                stream.raw,
            )
        };
        check(self.api, code, "hipMemcpyDtoHAsync")?;
        stream.synchronize()
    }

    /// Sets every byte to `value`, ordered on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this allocation's device.
    pub unsafe fn memset(&self, stream: sys::hipStream_t, value: u8) -> Result<()> {
        // SAFETY: exactly our allocation; the stream is the caller's promise.
        unsafe { memset_async(self.api, self.addr(), value, self.bytes, stream) }
    }
}

/// Sets `bytes` bytes at device address `addr` to `value`, ordered on `stream`.
///
/// # Safety
/// `addr .. addr + bytes` must be device memory of the current device that stays allocated until
/// the work completes; `stream` must be a live stream of that device.
pub unsafe fn memset_async(api: &HipApi, addr: u64, value: u8, bytes: usize, stream: sys::hipStream_t) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { (api.hipMemsetAsync)(addr as *mut c_void, c_int::from(value), bytes, stream) };
    check(api, code, "hipMemsetAsync")
}

/// Copies `bytes` bytes between device addresses, ordered on `stream`.
///
/// # Safety
/// Both ranges must be device memory that stays allocated until the work completes, and must not
/// overlap; `stream` as for [`memset_async`].
pub unsafe fn copy_dtod_async(api: &HipApi, dst: u64, src: u64, bytes: usize, stream: sys::hipStream_t) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    let code = unsafe { (api.hipMemcpyDtoDAsync)(dst as *mut c_void, src as *mut c_void, bytes, stream) };
    check(api, code, "hipMemcpyDtoDAsync")
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: we own the allocation; hipFree waits for work that may still use it. An error
        // here cannot be reported from drop and leaks at worst.
        let _ = unsafe { (self.api.hipFree)(self.ptr) };
        self.tracker.sub(self.bytes as u64);
    }
}

// ------------------------------------------------------------------------------------- stream

pub struct Stream {
    api: &'static HipApi,
    raw: sys::hipStream_t,
}

// SAFETY: HIP streams may be used from any thread of the process; the runtime serialises access.
unsafe impl Send for Stream {}
// SAFETY: as above; every method takes &self and the runtime is thread-safe for stream calls.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(api: &'static HipApi) -> Result<Stream> {
        let mut raw: sys::hipStream_t = ptr::null_mut();
        // SAFETY: writes a stream handle into our local on success.
        check(api, unsafe { (api.hipStreamCreate)(&mut raw) }, "hipStreamCreate")?;
        Ok(Stream { api, raw })
    }

    /// The raw handle, for launches and for callers that interoperate with other HIP code.
    pub fn raw(&self) -> sys::hipStream_t {
        self.raw
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream we created.
        check(self.api, unsafe { (self.api.hipStreamSynchronize)(self.raw) }, "hipStreamSynchronize")
    }
}

/// Waits for the work queued on `stream` (a raw handle: the caller's, ours, or 0).
///
/// # Safety
/// `stream` must be a live stream of the current device, or 0 (the null stream).
pub unsafe fn stream_synchronize(api: &HipApi, stream: sys::hipStream_t) -> Result<()> {
    // SAFETY: the caller's promise.
    check(api, unsafe { (api.hipStreamSynchronize)(stream) }, "hipStreamSynchronize")
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: we own the stream; pending work completes before the runtime releases it.
        let _ = unsafe { (self.api.hipStreamDestroy)(self.raw) };
    }
}

// ------------------------------------------------------------------------------------- events

/// A pair of events timing the work enqueued between [`Timer::start`] and [`Timer::stop`].
pub struct Timer {
    api: &'static HipApi,
    start: sys::hipEvent_t,
    stop: sys::hipEvent_t,
}

// SAFETY: events are process-wide handles usable from any thread.
unsafe impl Send for Timer {}

impl Timer {
    pub fn new(api: &'static HipApi) -> Result<Timer> {
        let (mut start, mut stop): (sys::hipEvent_t, sys::hipEvent_t) = (ptr::null_mut(), ptr::null_mut());
        // SAFETY: each call writes an event handle into our local on success.
        check(api, unsafe { (api.hipEventCreate)(&mut start) }, "hipEventCreate")?;
        // Owned from here on, so an error below still destroys `start`.
        let mut timer = Timer { api, start, stop: ptr::null_mut() };
        // SAFETY: as above.
        check(api, unsafe { (api.hipEventCreate)(&mut stop) }, "hipEventCreate")?;
        timer.stop = stop;
        Ok(timer)
    }

    pub fn start(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream.
        check(self.api, unsafe { (self.api.hipEventRecord)(self.start, stream.raw) }, "hipEventRecord")
    }

    pub fn stop(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream.
        check(self.api, unsafe { (self.api.hipEventRecord)(self.stop, stream.raw) }, "hipEventRecord")
    }

    /// Milliseconds between the two records; waits for the second.
    pub fn elapsed_ms(&self) -> Result<f64> {
        let mut ms: f32 = 0.0;
        // SAFETY: live events; the result is written to a valid local.
        unsafe {
            check(self.api, (self.api.hipEventSynchronize)(self.stop), "hipEventSynchronize")?;
            check(self.api, (self.api.hipEventElapsedTime)(&mut ms, self.start, self.stop), "hipEventElapsedTime")?;
        }
        Ok(f64::from(ms))
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        for e in [self.start, self.stop] {
            if !e.is_null() {
                // SAFETY: we created the event and nothing else holds it.
                let _ = unsafe { (self.api.hipEventDestroy)(e) };
            }
        }
    }
}

// ------------------------------------------------------------------------------------ modules

/// A loaded code object and one kernel in it.
pub struct Kernel {
    api: &'static HipApi,
    module: sys::hipModule_t,
    function: sys::hipFunction_t,
    name: String,
    // Kept alive for as long as the module: the runtime may reference the image after loading.
    // u64 words: ELF readers cast the headers in place, so the image must be 8-byte aligned,
    // which neither include_bytes! nor Vec<u8> promises.
    _image: Vec<u64>,
}

// SAFETY: modules and functions are process-wide handles; launching from several threads is
// allowed by the runtime.
unsafe impl Send for Kernel {}
// SAFETY: as above; &self methods only launch.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Loads `code` (an ELF code object) on the current device and finds `name` in it.
    pub fn load(api: &'static HipApi, code: &[u8], name: &str) -> Result<Kernel> {
        let cname = CString::new(name).map_err(|_| Error::InvalidArgument(format!("kernel name {name:?}")))?;
        let mut image = vec![0u64; code.len().div_ceil(8)];
        for (word, chunk) in image.iter_mut().zip(code.chunks(8)) {
            let mut bytes = [0u8; 8];
            bytes[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_ne_bytes(bytes);
        }
        let mut module: sys::hipModule_t = ptr::null_mut();
        // SAFETY: `image` is a complete code object in host memory that lives as long as the
        // returned Kernel; the runtime validates it and reports a bad image as an error code.
        check(
            api,
            unsafe { (api.hipModuleLoadData)(&mut module, image.as_ptr().cast::<c_void>()) },
            "hipModuleLoadData",
        )?;
        let mut function: sys::hipFunction_t = ptr::null_mut();
        // SAFETY: live module, NUL-terminated name, result written to a valid local.
        let code = unsafe { (api.hipModuleGetFunction)(&mut function, module, cname.as_ptr()) };
        if let Err(e) = check(api, code, &format!("hipModuleGetFunction({name})")) {
            // SAFETY: we own the module and nothing references it yet.
            let _ = unsafe { (api.hipModuleUnload)(module) };
            return Err(e);
        }
        Ok(Kernel { api, module, function, name: name.to_string(), _image: image })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Launches a 1-D grid of `grid` blocks of `block` threads with `smem` bytes of dynamic LDS.
    /// `args` holds one pointer per kernel parameter, each to a value of the parameter's type.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every device address reachable from
    /// them must be valid for all the accesses the kernel makes for this launch geometry until
    /// the work completes on `stream`.
    pub unsafe fn launch(
        &self,
        stream: sys::hipStream_t,
        grid: u32,
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if grid == 0 {
            return Ok(());
        }
        // SAFETY: the caller guarantees the arguments; the geometry is passed by value.
        let code = unsafe {
            (self.api.hipModuleLaunchKernel)(
                self.function,
                grid,
                1,
                1,
                block,
                1,
                1,
                smem,
                stream,
                args.as_mut_ptr(),
                ptr::null_mut(),
            )
        };
        check(self.api, code, &format!("hipModuleLaunchKernel({})", self.name))
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: we own the module; launches already enqueued keep their own references.
        let _ = unsafe { (self.api.hipModuleUnload)(self.module) };
    }
}

/// Compiles `source` with hipRTC and returns the code object.
pub fn rtc_compile(api: &HiprtcApi, source: &str, name: &str, options: &[String]) -> Result<Vec<u8>> {
    let arch = options.iter().find_map(|o| o.strip_prefix("--offload-arch=")).unwrap_or("unknown arch");
    let fail = |reason: String| Error::NoKernels { arch: arch.to_string(), reason };
    let csrc = CString::new(source).map_err(|_| fail("kernel source contains a NUL byte".into()))?;
    let cname = CString::new(format!("{name}.hip")).map_err(|_| fail("bad kernel name".into()))?;
    let copts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<Result<_, _>>()
        .map_err(|_| fail("bad option".into()))?;
    let opt_ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::hiprtcProgram = ptr::null_mut();
    // SAFETY: NUL-terminated source and name that outlive the call; no headers.
    let code =
        unsafe { (api.hiprtcCreateProgram)(&mut prog, csrc.as_ptr(), cname.as_ptr(), 0, ptr::null(), ptr::null()) };
    if code != sys::HIPRTC_SUCCESS {
        return Err(fail(format!("hiprtcCreateProgram: {}", rtc_error(api, code))));
    }
    let result = (|| {
        // SAFETY: live program; `opt_ptrs` points at CStrings alive for the call.
        let code = unsafe { (api.hiprtcCompileProgram)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        if code != sys::HIPRTC_SUCCESS {
            let mut log_len = 0usize;
            // SAFETY: live program; sizes and log are written to buffers we own of the size the
            // runtime reported.
            let log = unsafe {
                if (api.hiprtcGetProgramLogSize)(prog, &mut log_len) == sys::HIPRTC_SUCCESS && log_len > 0 {
                    let mut buf = vec![0u8; log_len];
                    if (api.hiprtcGetProgramLog)(prog, buf.as_mut_ptr().cast::<c_char>()) == sys::HIPRTC_SUCCESS {
                        c_buf_to_string(&buf)
                    } else {
                        String::new()
                    }
                } else {
                    String::new()
                }
            };
            return Err(fail(format!("hipRTC failed to compile {name}: {}\n{log}", rtc_error(api, code))));
        }
        let mut size = 0usize;
        // SAFETY: live, compiled program; writes the size to a valid local.
        let code = unsafe { (api.hiprtcGetCodeSize)(prog, &mut size) };
        if code != sys::HIPRTC_SUCCESS || size == 0 {
            return Err(fail(format!("hiprtcGetCodeSize: {}", rtc_error(api, code))));
        }
        let mut out = vec![0u8; size];
        // SAFETY: `out` holds exactly the size hipRTC reported.
        let code = unsafe { (api.hiprtcGetCode)(prog, out.as_mut_ptr().cast::<c_char>()) };
        if code != sys::HIPRTC_SUCCESS {
            return Err(fail(format!("hiprtcGetCode: {}", rtc_error(api, code))));
        }
        Ok(out)
    })();
    // SAFETY: we created the program and destroy it once.
    let _ = unsafe { (api.hiprtcDestroyProgram)(&mut prog) };
    result
}

// ------------------------------------------------------------------------------------ rocBLAS

/// A rocBLAS handle bound to one stream. Not thread-safe: the backend keeps it in a `Mutex`.
pub struct BlasHandle {
    api: &'static RocblasApi,
    raw: sys::rocblas_handle,
}

// SAFETY: a rocBLAS handle may move between threads; concurrent use is what it forbids, and
// the backend serialises it with a Mutex.
unsafe impl Send for BlasHandle {}

impl BlasHandle {
    /// A handle on the current device whose work goes to `stream`.
    pub fn new(api: &'static RocblasApi, stream: &Stream) -> Result<BlasHandle> {
        let mut raw: sys::rocblas_handle = ptr::null_mut();
        // SAFETY: writes a handle to our local on success.
        check_blas(api, unsafe { (api.rocblas_create_handle)(&mut raw) }, "rocblas_create_handle")?;
        let handle = BlasHandle { api, raw };
        // SAFETY: `stream` is live; the backend drops the handle before the stream.
        unsafe { handle.set_stream(stream.raw)? };
        Ok(handle)
    }

    /// Sends subsequent calls to `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the handle's device for as long as GEMMs are enqueued
    /// on it (rocBLAS only records it here).
    pub unsafe fn set_stream(&self, stream: sys::hipStream_t) -> Result<()> {
        // SAFETY: live handle; the stream's liveness is the caller's promise.
        check_blas(self.api, unsafe { (self.api.rocblas_set_stream)(self.raw, stream) }, "rocblas_set_stream")
    }

    /// Enqueues `D = alpha·op(A)·op(B) + beta·C` with `C = D` (host-side f32 scalars, rocBLAS's
    /// default pointer mode).
    ///
    /// # Safety
    /// `a`, `b` and `d` must be device addresses of at least `g.a_elems`, `g.b_elems` and
    /// `g.d_elems` elements of the types in `g`, valid until the work completes on the stream set
    /// last with [`BlasHandle::set_stream`], which must be live.
    pub unsafe fn gemm(&self, g: &RocblasGemm, alpha: f32, a: u64, b: u64, beta: f32, d: u64) -> Result<()> {
        let (pa, pb) = (a as *const c_void, b as *const c_void);
        let pd = d as *mut c_void;
        let (palpha, pbeta) = ((&alpha as *const f32).cast::<c_void>(), (&beta as *const f32).cast::<c_void>());
        // SAFETY: the caller guarantees the operands; scalars are read during the call.
        let status = unsafe {
            if g.strided_batched {
                (self.api.rocblas_gemm_strided_batched_ex)(
                    self.raw,
                    g.trans_a,
                    g.trans_b,
                    g.m,
                    g.n,
                    g.k,
                    palpha,
                    pa,
                    g.a.ty,
                    g.a.ld,
                    g.a.stride,
                    pb,
                    g.b.ty,
                    g.b.ld,
                    g.b.stride,
                    pbeta,
                    pd,
                    g.c.ty,
                    g.c.ld,
                    g.c.stride,
                    pd,
                    g.d.ty,
                    g.d.ld,
                    g.d.stride,
                    g.batch,
                    g.compute_type,
                    sys::ROCBLAS_GEMM_ALGO_STANDARD,
                    0,
                    sys::ROCBLAS_GEMM_FLAGS_NONE,
                )
            } else {
                (self.api.rocblas_gemm_ex)(
                    self.raw,
                    g.trans_a,
                    g.trans_b,
                    g.m,
                    g.n,
                    g.k,
                    palpha,
                    pa,
                    g.a.ty,
                    g.a.ld,
                    pb,
                    g.b.ty,
                    g.b.ld,
                    pbeta,
                    pd,
                    g.c.ty,
                    g.c.ld,
                    pd,
                    g.d.ty,
                    g.d.ld,
                    g.compute_type,
                    sys::ROCBLAS_GEMM_ALGO_STANDARD,
                    0,
                    sys::ROCBLAS_GEMM_FLAGS_NONE,
                )
            }
        };
        let call = if g.strided_batched { "rocblas_gemm_strided_batched_ex" } else { "rocblas_gemm_ex" };
        check_blas(self.api, status, call)
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: we own the handle.
        let _ = unsafe { (self.api.rocblas_destroy_handle)(self.raw) };
    }
}
