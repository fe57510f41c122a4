//! # trimul
//!
//! The triangle multiplicative update of AlphaFold3-style protein models (the O(N³) block that
//! updates the pair representation), on CPU, NVIDIA GPUs (`--features cuda`) and AMD GPUs
//! (`--features rocm`).
//!
//! ```no_run
//! use trimul::{Device, Options, Shape, TriMul, Weights};
//! # fn main() -> trimul::Result<()> {
//! let device = Device::detect()?; // HIP > CUDA > CPU, or TRIMUL_BACKEND=cpu|cuda|hip
//! let weights = Weights::from_safetensors("layer.safetensors")?;
//! let mut layer = TriMul::new(&device, &weights, Options::default())?;
//! let (b, n, c) = (1, 64, weights.config().c);
//! let x = vec![0.5f32; b * n * n * c];
//! let y = layer.forward(&x, None, Shape::new(b, n))?;
//! # Ok(()) }
//! ```
//!
//! Layers: [`problem`] holds the rules, [`weights`] the canonical parameters, [`io`] the
//! safetensors naming schemes, [`backend`] the trait and the three implementations,
//! [`reference`](mod@reference) the f64 oracle used only by tests and `trimul check`, [`suite`] the GPU MODE
//! cases, [`units`] byte counts as people write them. See `SPEC.md` (in the repository's shared docs) for the math.

#![warn(missing_docs)]
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod alloc_tracker;
pub mod backend;
#[cfg(feature = "cuda")]
pub mod collective;
pub mod device;
pub mod device_io;
pub mod error;
pub mod finite;
pub mod gradients;
pub mod hostmem;
pub mod io;
pub mod kernels;
pub mod layer;
mod named;
pub mod plan;
pub mod problem;
pub mod rand;
pub mod reference;
pub mod report;
#[cfg(feature = "cuda")]
pub mod sharded;
pub mod staging;
pub mod suite;
pub mod units;
pub mod validation;
pub mod weights;

#[cfg(test)]
#[path = "../tests/support/seed.rs"]
pub(crate) mod test_seed;

pub use backend::{Backend, Ceilings, DeviceInfo, MemoryInfo};
pub use device::Device;
pub use device_io::{
    BackwardDeviceIo, BackwardIo, DType, DeviceIo, DeviceLinear, DeviceNorm, DeviceOperands, DeviceSpan, DeviceTensor,
    DeviceWeights, ForwardIo, Operands,
};
pub use error::{BackendKind, Error, Result};
pub use gradients::{Gradients, WEIGHT_NAMES};
pub use io::{NamingScheme, PairInput};
pub use layer::{IoElement, Layer, Options, Precision, TriMul};
pub use plan::{ExecPlan, MemoryNeeds};
pub use problem::{Config, Direction, Formulation, Problem, Shape};
pub use weights::{Linear, Norm, Weights};
