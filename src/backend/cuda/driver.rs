//! Thin safe layer over the CUDA driver (through cudarc's dynamically loaded `sys`/`result`):
//! library probing, device buffers with allocation tracking, events, error mapping.
//!
//! cudarc's loader panics when a library is missing, so every entry point first checks the
//! library with `is_culib_present()` and turns absence into [`Error::LibraryNotFound`].

pub(crate) use crate::alloc_tracker::AllocTracker;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{self, CUdeviceptr, CUstream};

use crate::device_io::{HostWords, HostWordsMut};
use crate::error::{BackendKind, Error, Result};

/// A driver error with the failing call's name.
pub(crate) fn driver_err(call: &str, e: cu::DriverError) -> Error {
    if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
        return Error::OutOfMemory {
            backend: BackendKind::Cuda,
            what: call.to_string(),
            needed: 0,
            available: cu::mem_get_info().map(|(f, _)| f as u64).unwrap_or(0),
        };
    }
    let code = e.error_name().map(|c| c.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    Error::driver(BackendKind::Cuda, call, code)
}

pub(crate) trait DriverResult<T> {
    fn ctx(self, call: &str) -> Result<T>;
}

impl<T> DriverResult<T> for std::result::Result<T, cu::DriverError> {
    fn ctx(self, call: &str) -> Result<T> {
        self.map_err(|e| driver_err(call, e))
    }
}

/// The file names cudarc's loader tries for `lib` (e.g. `cuda` → `libcuda.so`, `libcuda.so.1`, …).
fn candidates(lib: &str) -> String {
    let mut names: Vec<String> = Vec::new();
    for c in cudarc::get_lib_name_candidates(lib) {
        if c.starts_with(&format!("lib{lib}")) && c.contains(".so") && !names.contains(&c) {
            names.push(c);
        }
    }
    names.join(", ")
}

/// Checks that libcuda and libcublasLt can be loaded, without letting cudarc panic.
pub(crate) fn probe_libraries() -> Result<()> {
    // SAFETY: `is_culib_present` only dlopen()s and dlclose()s candidate names; it runs no code
    // of the library beyond its initialisers.
    let (cuda, blaslt) = unsafe { (sys::is_culib_present(), cudarc::cublaslt::sys::is_culib_present()) };
    let missing = |lib: &str, what: &str| Error::LibraryNotFound {
        library: format!("lib{lib} ({what})"),
        tried: candidates(lib),
        reason: "not found on the loader path; install the NVIDIA driver / CUDA libraries or add their \
                 directory to LD_LIBRARY_PATH"
            .into(),
    };
    if !cuda {
        return Err(missing("cuda", "NVIDIA driver"));
    }
    if !blaslt {
        return Err(missing("cublasLt", "cuBLASLt 13"));
    }
    Ok(())
}

/// Whether NVRTC (run-time compilation, needed only when no prebuilt kernel fits) is loadable.
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: as in `probe_libraries`: dlopen/dlclose of candidate names only.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

pub(crate) fn nvrtc_missing() -> Error {
    Error::LibraryNotFound {
        library: "libnvrtc (CUDA run-time compiler)".into(),
        tried: candidates("nvrtc"),
        reason: "no prebuilt kernel matches this GPU and NVRTC is not on the loader path".into(),
    }
}

/// Device memory of `len` elements of `T`: owned by the backend and freed on drop, or (made by
/// `DeviceBuffer::borrowed`) a view of memory the caller owns, which is never freed here.
pub struct DeviceBuffer<T> {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<cudarc::driver::CudaContext>,
    tracker: Arc<AllocTracker>,
    owned: bool,
    _t: PhantomData<T>,
}

// SAFETY: the buffer is a plain device address plus bookkeeping; the driver allows using and
// freeing it from any thread once the owning context is bound, which every method does.
unsafe impl<T> Send for DeviceBuffer<T> {}
// SAFETY: shared references only read the address and length.
unsafe impl<T> Sync for DeviceBuffer<T> {}

impl<T> DeviceBuffer<T> {
    pub(crate) fn alloc(
        ctx: &Arc<cudarc::driver::CudaContext>,
        tracker: &Arc<AllocTracker>,
        len: usize,
    ) -> Result<Self> {
        let bytes =
            len.max(1).checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
                Error::Shape(format!("a device buffer of {len} elements is more bytes than memory holds"))
            })? as u64;
        ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: the context is current on this thread; the size is non-zero.
        let ptr = unsafe { cu::malloc_sync(bytes as usize) }.map_err(|e| {
            let free = cu::mem_get_info().map(|(f, _)| f as u64).unwrap_or(0);
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory {
                    backend: BackendKind::Cuda,
                    what: "a device buffer".into(),
                    needed: bytes,
                    available: free,
                }
            } else {
                driver_err("cuMemAlloc", e)
            }
        })?;
        tracker.add(bytes);
        Ok(DeviceBuffer { ptr, len, ctx: ctx.clone(), tracker: tracker.clone(), owned: true, _t: PhantomData })
    }

    /// A view of `len` elements at `ptr` in memory the caller owns (a PyTorch tensor, a caller's
    /// workspace): not counted in the tracker, never freed here. Whoever makes one keeps the
    /// memory alive while the view is used; the view itself dereferences nothing.
    pub(crate) fn borrowed(
        ctx: &Arc<cudarc::driver::CudaContext>,
        tracker: &Arc<AllocTracker>,
        ptr: CUdeviceptr,
        len: usize,
    ) -> Self {
        DeviceBuffer { ptr, len, ctx: ctx.clone(), tracker: tracker.clone(), owned: false, _t: PhantomData }
    }

    /// Moves a borrowed view by the same distance its caller memory moved (`from` → `to`);
    /// owned buffers never move.
    pub(crate) fn rebase(&mut self, from: u64, to: u64) -> Result<()> {
        if self.owned {
            return Err(Error::InvalidArgument("an owned device buffer cannot be rebased".into()));
        }
        self.ptr = self.ptr - from + to;
        Ok(())
    }

    /// Device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes (at least one element's).
    pub fn bytes(&self) -> u64 {
        (self.len.max(1) * std::mem::size_of::<T>()) as u64
    }

    /// Asynchronous copy from host memory of the same length on `stream`. The host slice must
    /// stay alive and unchanged until the stream reaches the copy; callers synchronise.
    pub(crate) fn upload_async(&mut self, src: &[T], stream: CUstream) -> Result<()> {
        if src.len() != self.len {
            return Err(Error::Shape(format!("upload of {} elements into a buffer of {}", src.len(), self.len)));
        }
        self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: lengths match; the destination is our allocation; callers synchronise the
        // stream before the host slice is released (see the doc comment).
        unsafe { cu::memcpy_htod_async(self.ptr, src, stream) }.ctx("cuMemcpyHtoDAsync")
    }

    /// Synchronous upload (waits for the copy).
    pub(crate) fn upload(&mut self, src: &[T], stream: CUstream) -> Result<()> {
        self.upload_async(src, stream)?;
        // SAFETY: `stream` belongs to this context.
        unsafe { cu::stream::synchronize(stream) }.ctx("cuStreamSynchronize")
    }

    /// Copy to host memory of the same length after all work on `stream`; waits.
    pub(crate) fn download(&self, dst: &mut [T], stream: CUstream) -> Result<()> {
        if dst.len() != self.len {
            return Err(Error::Shape(format!("download of a buffer of {} into {} elements", self.len, dst.len())));
        }
        self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: lengths match; we synchronise before returning, so `dst` outlives the copy.
        unsafe {
            cu::memcpy_dtoh_async(dst, self.ptr, stream).ctx("cuMemcpyDtoHAsync")?;
            cu::stream::synchronize(stream).ctx("cuStreamSynchronize")
        }
    }

    /// Asynchronous copy of host words (f32, or 16-bit in an f32 buffer: host staging) into the
    /// start of this buffer on `stream`. Checks that they fit.
    ///
    /// # Safety
    /// `src` stays alive and unchanged until `stream` has run the copy.
    pub(crate) unsafe fn upload_host_async(&mut self, src: HostWords<'_>, stream: CUstream) -> Result<()> {
        // SAFETY: this function's contract.
        unsafe { self.upload_host_at(0, src, stream) }
    }

    /// As [`DeviceBuffer::upload_host_async`], into the buffer from byte `offset`.
    ///
    /// # Safety
    /// As [`DeviceBuffer::upload_host_async`].
    pub(crate) unsafe fn upload_host_at(&mut self, offset: u64, src: HostWords<'_>, stream: CUstream) -> Result<()> {
        let bytes = match src {
            HostWords::F32(v) => std::mem::size_of_val(v),
            HostWords::Half(v) => std::mem::size_of_val(v),
        };
        let at = self.address_of(offset, bytes, "upload")?;
        // SAFETY: the bytes fit our allocation from `offset` (checked above); `src` outlives the
        // copy (this function's contract).
        unsafe {
            match src {
                HostWords::F32(v) => cu::memcpy_htod_async(at, v, stream),
                HostWords::Half(v) => cu::memcpy_htod_async(at, v, stream),
            }
        }
        .ctx("cuMemcpyHtoDAsync")
    }

    /// Copy of the start of this buffer into host words after all work on `stream`; waits.
    /// Checks that they fit.
    pub(crate) fn download_host(&self, dst: HostWordsMut<'_>, stream: CUstream) -> Result<()> {
        self.download_host_at(0, dst, stream)
    }

    /// As [`DeviceBuffer::download_host`], from byte `offset` of the buffer.
    pub(crate) fn download_host_at(&self, offset: u64, dst: HostWordsMut<'_>, stream: CUstream) -> Result<()> {
        let bytes = match &dst {
            HostWordsMut::F32(v) => std::mem::size_of_val(*v),
            HostWordsMut::Half(v) => std::mem::size_of_val(*v),
        };
        let at = self.address_of(offset, bytes, "download")?;
        // SAFETY: the bytes lie inside our allocation (checked above); `dst` is borrowed
        // exclusively and its types (f32, u16) are valid for any bit pattern; we synchronise
        // before returning, so `dst` outlives the copy.
        unsafe {
            match dst {
                HostWordsMut::F32(v) => cu::memcpy_dtoh_async(v, at, stream),
                HostWordsMut::Half(v) => cu::memcpy_dtoh_async(v, at, stream),
            }
            .ctx("cuMemcpyDtoHAsync")?;
            cu::stream::synchronize(stream).ctx("cuStreamSynchronize")
        }
    }

    /// The device address of byte `offset` of this buffer for a copy (`what`) of `bytes` from
    /// there, or the error when they do not fit; binds the context.
    fn address_of(&self, offset: u64, bytes: usize, what: &str) -> Result<CUdeviceptr> {
        if offset.checked_add(bytes as u64).is_none_or(|end| end > self.bytes()) {
            return Err(Error::Shape(format!(
                "{what} of {bytes} bytes from byte {offset} of a buffer of {}",
                self.bytes()
            )));
        }
        self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        Ok(self.ptr + offset)
    }

    /// Fill every byte with `value` on `stream` (used to poison outputs in tests and checks).
    pub(crate) fn memset_async(&mut self, value: u8, stream: CUstream) -> Result<()> {
        self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: the range is exactly our allocation.
        unsafe { cu::memset_d8_async(self.ptr, value, self.bytes() as usize, stream) }.ctx("cuMemsetD8Async")
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed exactly once.
            // cuMemFree waits for work using it to finish.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
        self.tracker.sub(self.bytes());
    }
}

/// A pair of events bracketing work on a stream.
pub(crate) struct EventPair {
    start: sys::CUevent,
    stop: sys::CUevent,
}

// SAFETY: event handles are plain driver handles usable from any thread with the context bound.
unsafe impl Send for EventPair {}

impl EventPair {
    pub(crate) fn new() -> Result<Self> {
        let start = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx("cuEventCreate")?;
        let stop = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx("cuEventCreate")?;
        Ok(EventPair { start, stop })
    }

    pub(crate) fn record_start(&self, stream: CUstream) -> Result<()> {
        // SAFETY: both handles are live events of the current context.
        unsafe { cu::event::record(self.start, stream) }.ctx("cuEventRecord")
    }

    pub(crate) fn record_stop(&self, stream: CUstream) -> Result<()> {
        // SAFETY: as above.
        unsafe { cu::event::record(self.stop, stream) }.ctx("cuEventRecord")
    }

    /// Waits for the stop event and returns the milliseconds between the two.
    pub(crate) fn elapsed_ms(&self) -> Result<f64> {
        // SAFETY: both events were recorded on a stream of this context.
        unsafe {
            cu::event::synchronize(self.stop).ctx("cuEventSynchronize")?;
            cu::event::elapsed(self.start, self.stop).map(|v| v as f64).ctx("cuEventElapsedTime")
        }
    }
}

impl Drop for EventPair {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = cu::event::destroy(self.start);
            let _ = cu::event::destroy(self.stop);
        }
    }
}

/// Events recorded between the stages of one forward, for a per-stage time breakdown.
#[derive(Default)]
pub(crate) struct Timeline {
    marks: Vec<(&'static str, sys::CUevent)>,
}

// SAFETY: event handles are plain driver handles usable from any thread with the context bound.
unsafe impl Send for Timeline {}

impl Timeline {
    /// Records an event named `name` on `stream` (the first mark is the start).
    pub(crate) fn mark(&mut self, name: &'static str, stream: CUstream) -> Result<()> {
        let ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx("cuEventCreate")?;
        // SAFETY: a live event of the current context recorded on a stream of that context.
        unsafe { cu::event::record(ev, stream) }.ctx("cuEventRecord")?;
        self.marks.push((name, ev));
        Ok(())
    }

    /// Waits for the last mark and returns each stage's milliseconds (time since the previous mark).
    pub(crate) fn stage_ms(&self) -> Result<Vec<(String, f64)>> {
        let Some(&(_, last)) = self.marks.last() else { return Ok(Vec::new()) };
        // SAFETY: every event was recorded in `mark`.
        unsafe { cu::event::synchronize(last) }.ctx("cuEventSynchronize")?;
        self.marks
            .windows(2)
            // SAFETY: both events were recorded and the last one has completed.
            .map(|w| {
                unsafe { cu::event::elapsed(w[0].1, w[1].1) }
                    .map(|ms| (w[1].0.to_string(), ms as f64))
                    .ctx("cuEventElapsedTime")
            })
            .collect()
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        for &(_, ev) in &self.marks {
            // SAFETY: created in `mark`, destroyed once.
            let _ = unsafe { cu::event::destroy(ev) };
        }
    }
}

/// A stream held back while work is enqueued on it ([`crate::backend::Backend::held_elapsed_ms`]): the
/// stream waits (`cuStreamWaitValue32`) for a word of pinned host memory that the host sets once
/// the work is in. A watchdog sets the word after [`StreamHold::LIMIT`], so that work which itself
/// waits for the stream (a synchronising copy) cannot hang the caller; such work is an error,
/// since its time would include the hold.
pub(crate) struct StreamHold {
    word: *mut u32,
    stream: CUstream,
}

/// The held word's address, for the watchdog thread.
struct Word(*mut u32);

// SAFETY: the address of pinned host memory that outlives the watchdog (joined before it is
// freed); every access is atomic.
unsafe impl Send for Word {}

impl Word {
    fn store(&self, value: u32) {
        // SAFETY: a live, page-aligned 4-byte pinned host allocation (see `Send` above), written
        // by the host only through atomics (the watchdog and the caller may both release it) and
        // read by the device over the bus. Release ordering: the work enqueued before is in first.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.0) }.store(value, std::sync::atomic::Ordering::Release);
    }

    fn release(&self) {
        self.store(1);
    }
}

impl StreamHold {
    /// How long the stream is held at most.
    const LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

    /// Holds `stream` (of the context bound to this thread) from now until [`StreamHold::enqueue`]
    /// has run, or until this is dropped. Keep it until the held work has run: the device reads
    /// the word until then.
    pub(crate) fn new(stream: CUstream) -> Result<Self> {
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: allocates 4 bytes of pinned, device-mapped host memory in the current context,
        // freed in `Drop`.
        unsafe { sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.result().ctx("cuMemHostAlloc")?;
        let hold = StreamHold { word: host as *mut u32, stream };
        Word(hold.word).store(0);
        let mut device: CUdeviceptr = 0;
        // SAFETY: `host` is device-mapped pinned memory of this context; one plain value written.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }.result().ctx("cuMemHostGetDevicePointer")?;
        let eq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32;
        // SAFETY: a live stream of the current context (the caller's contract) and a mapped word
        // that outlives the wait: `Drop` sets it before freeing it.
        unsafe { sys::cuStreamWaitValue32_v2(stream, device, 1, eq) }.result().ctx("cuStreamWaitValue32")?;
        Ok(hold)
    }

    /// Runs `enqueue` and then releases the stream (also when `enqueue` fails). Returns when the
    /// work is enqueued and the stream released, not when it has run. Once per hold: a second
    /// call would run unheld.
    pub(crate) fn enqueue(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<()> {
        let (done, expired) = std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let word = Word(self.word);
            let watchdog = scope.spawn(move || {
                let expired = rx.recv_timeout(Self::LIMIT) == Err(std::sync::mpsc::RecvTimeoutError::Timeout);
                if expired {
                    word.release();
                }
                expired
            });
            let done = enqueue();
            Word(self.word).release();
            drop(tx);
            (done, watchdog.join().unwrap_or(true))
        });
        done?;
        if expired {
            return Err(Error::driver(
                BackendKind::Cuda,
                "cuStreamWaitValue32 (the stream held while a timed call was enqueued)",
                format!(
                    "released by the watchdog after {} s: the call took that long to enqueue (work \
                     that waits for its own stream, a download or a cuMemFree, cannot be timed held)",
                    Self::LIMIT.as_secs()
                ),
            ));
        }
        Ok(())
    }
}

impl Drop for StreamHold {
    fn drop(&mut self) {
        // Released, then the stream drained, so that no pending wait reads the word once freed.
        Word(self.word).release();
        // SAFETY: the stream the hold was made on (alive while its work is enqueued, by the
        // caller's contract); the word was allocated in `new` with cuMemHostAlloc, freed once.
        unsafe {
            let _ = sys::cuStreamSynchronize(self.stream);
            let _ = sys::cuMemFreeHost(self.word as *mut std::ffi::c_void);
        }
    }
}
