//! Weights prepared on the device for the CUDA backend: [`CudaPrepared`]'s buffers as views into
//! the caller's storage, laid out and filled as [`crate::backend::device_prepare`] says, with one
//! `prepare_weights` launch on the caller's stream.

use cudarc::driver::sys::CUstream;

use super::context::CudaBackend;
use super::driver::{DeviceBuffer, DriverResult};
use super::workspace::{CudaPrepared, FusedInput};
use crate::backend::device_prepare::{params, PreparedLayout};
use crate::backend::params::PREP_THREADS;
use crate::backend::prepared::PreparedTensors;
use crate::device_io::{DeviceSpan, DeviceWeights};
use crate::error::Result;
use crate::problem::Config;

impl CudaBackend {
    /// The storage layout of a layer of `config` prepared on the device.
    pub(super) fn prepared_layout(&self, config: &Config, input_bias: bool, out_bias: bool) -> PreparedLayout {
        PreparedLayout::new(config, self.fused_layout(config), input_bias, out_bias)
    }

    /// See [`Backend::prepare_device`](crate::Backend::prepare_device).
    ///
    /// # Safety
    /// As that method.
    pub(super) unsafe fn prepare_on_device(
        &self,
        w: &DeviceWeights,
        storage: DeviceSpan,
        stream: CUstream,
    ) -> Result<CudaPrepared> {
        w.validate()?;
        let cfg = w.config;
        let input_bias = w.input_linears().iter().any(|l| l.bias.is_some());
        let layout = self.prepared_layout(&cfg, input_bias, w.out_proj.bias.is_some());
        storage.check("the prepared-weight storage", layout.bytes)?;
        let inner = &self.inner;
        let grid = (layout.bytes / 2)
            .div_ceil(u64::from(PREP_THREADS))
            .clamp(1, 2 * u64::from(inner.info.compute_units)) as u32;
        let kp = params(w, &layout, storage.ptr, grid)?;
        inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: every source in `kp` is a weight tensor of the length `validate` checked, live
        // until the stream runs the launch (this function's contract); every destination lies
        // inside `storage` (the layout's bytes, checked above); the kernel takes a
        // TmPrepareParams, which `PrepareParams` mirrors.
        unsafe { inner.kernels.prepare_weights.launch_with(grid, PREP_THREADS, 0, stream, &kp, false)? };
        fn view<T>(be: &CudaBackend, at: u64, len: usize) -> DeviceBuffer<T> {
            DeviceBuffer::borrowed(&be.inner.ctx, &be.inner.tracker, at, len)
        }
        let base = storage.ptr;
        Ok(CudaPrepared {
            config: cfg,
            id: super::super::next_weights_id(),
            fused: layout.fused.map(|f| FusedInput {
                layout: f,
                w: view(self, base + layout.fused_w, f.rows() * f.k_pad),
                bias: layout.fused_b.map(|off| view(self, base + off, f.rows())),
            }),
            tensors: PreparedTensors::views(
                w,
                &layout,
                base,
                |at, len| view(self, at, len),
                |at, len| view(self, at, len),
            ),
        })
    }
}
