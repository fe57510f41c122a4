//! Device memory accounting shared by the GPU backends' allocation wrappers.

/// Bytes currently and at most allocated on one GPU backend's device (weights, workspaces and
/// buffers), for [`Backend::peak_memory`](crate::backend::Backend::peak_memory). Shared by the
/// CUDA and HIP allocation wrappers, which are FFI layers (`cuda/driver.rs`, `hip/result.rs`):
/// defined here, in a foundation module, so that they need not import the backend layer above
/// them.
#[derive(Debug, Default)]
pub(crate) struct AllocTracker {
    current: std::sync::atomic::AtomicU64,
    peak: std::sync::atomic::AtomicU64,
}

impl AllocTracker {
    pub(crate) fn add(&self, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = self.current.fetch_add(bytes, Relaxed) + bytes;
        self.peak.fetch_max(now, Relaxed);
    }

    pub(crate) fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts a new high-water mark at what is allocated now.
    pub(crate) fn reset_peak(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }
}
