//! A layer's weights held on a GPU backend's device as plain f32 tensors, the way a framework or
//! GPU MODE's harness hands them over, with storage for preparing them there: the safe way to
//! drive [`Backend::prepare_device`] from owned buffers (the benchmark's `--fresh-weights`).

use super::Backend;
use crate::device_io::{DType, DeviceSpan, DeviceTensor, DeviceWeights};
use crate::error::{Error, Result};
use crate::weights::Weights;

/// Device copies of one layer's weight tensors and storage for their preparation.
pub struct DeviceWeightSet<B: Backend> {
    backend: B,
    _tensors: Vec<B::Buffer>,
    weights: DeviceWeights,
    storage: B::Buffer,
    span: DeviceSpan,
}

/// Weights prepared from a [`DeviceWeightSet`]; they read its storage, so they cannot outlive it.
pub struct PreparedOnDevice<'a, B: Backend> {
    prepared: B::Prepared,
    _set: std::marker::PhantomData<&'a DeviceWeightSet<B>>,
}

impl<B: Backend> PreparedOnDevice<'_, B> {
    /// The prepared weights, for [`Backend::forward`] and the workspace calls.
    pub fn get(&self) -> &B::Prepared {
        &self.prepared
    }
}

fn addr<B: Backend>(buf: &B::Buffer) -> Result<u64> {
    B::buffer_addr(buf).ok_or_else(|| Error::Internal("a device buffer without a device address".into()))
}

impl<B: Backend> DeviceWeightSet<B> {
    /// Uploads `w` as f32 device tensors (waits for the copies) and allocates the storage its
    /// preparation needs; `None` on a backend without device preparation (the CPU).
    pub fn upload(backend: &B, w: &Weights) -> Result<Option<Self>> {
        let Ok(bytes) = backend.prepared_device_bytes(&w.config(), w.has_biases()) else {
            return Ok(None);
        };
        let mut tensors = Vec::new();
        let weights = DeviceWeights::place(w, |v| {
            let mut buf = backend.alloc(v.len())?;
            backend.upload(v, &mut buf)?;
            let t = DeviceTensor::new(addr::<B>(&buf)?, DType::F32, v.len());
            tensors.push(buf);
            Ok(t)
        })?;
        let storage = backend.alloc(bytes.div_ceil(4) as usize)?;
        let span = DeviceSpan { ptr: addr::<B>(&storage)?, bytes: B::buffer_len(&storage) as u64 * 4 };
        Ok(Some(DeviceWeightSet { backend: backend.clone(), _tensors: tensors, weights, storage, span }))
    }

    /// The device descriptor of the uploaded tensors.
    pub fn weights(&self) -> &DeviceWeights {
        &self.weights
    }

    /// Prepares the weights into the storage with one kernel on the backend's own stream (no
    /// wait). Preparing again rewrites the same storage with the same values, ordered on that
    /// stream after the work already enqueued.
    pub fn prepare(&self) -> Result<PreparedOnDevice<'_, B>> {
        // SAFETY: the tensors and the storage are this set's own allocations, alive while the
        // result (which borrows the set) is; the storage is written by this set's preparations
        // only, all on the backend's stream, where the forwards that read it are ordered too.
        let prepared = unsafe { self.backend.prepare_device(&self.weights, self.span, self.backend.stream_handle())? };
        let _ = &self.storage;
        Ok(PreparedOnDevice { prepared, _set: std::marker::PhantomData })
    }
}
