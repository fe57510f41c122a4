//! The public types a caller shares across threads (the Python package holds layers behind a
//! mutex and devices in a global table) are `Send + Sync` under every feature set: features are
//! additive, so turning on `cuda` or `rocm` must not take a trait away.

fn send_sync<T: Send + Sync>() {}

#[test]
fn public_types_are_send_and_sync_under_every_feature_set() {
    send_sync::<trimul::TriMul>();
    send_sync::<trimul::Device>();
    send_sync::<trimul::Weights>();
    send_sync::<trimul::Error>();
    send_sync::<trimul::Options>();
    send_sync::<trimul::Problem>();
    send_sync::<trimul::DeviceIo>();
    send_sync::<trimul::DeviceWeights>();
    send_sync::<trimul::Layer<trimul::backend::cpu::CpuBackend>>();
    #[cfg(feature = "cuda")]
    {
        send_sync::<trimul::backend::cuda::CudaBackend>();
        send_sync::<trimul::Layer<trimul::backend::cuda::CudaBackend>>();
        send_sync::<trimul::backend::cuda::DeviceBuffer<f32>>();
    }
    #[cfg(feature = "rocm")]
    {
        send_sync::<trimul::backend::hip::HipBackend>();
        send_sync::<trimul::Layer<trimul::backend::hip::HipBackend>>();
        send_sync::<trimul::backend::hip::HipBuffer>();
    }
}
