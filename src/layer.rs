//! The public layer API: weights prepared once on a device, forwards on host slices or on
//! backend buffers, workspaces reused across calls of the same shape.

use crate::backend::{cpu::CpuBackend, Backend, Device};
use crate::error::{BackendKind, Error, Result};
use crate::problem::{Config, Direction, Problem, Shape};
use crate::weights::Weights;

/// Precision of the input and output tensors. Intermediates are chosen by each backend
/// (f32 on the CPU, f16 between GPU stages with f32 accumulation).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Precision {
    /// f32 `x`, mask and `y`, as GPU MODE runs it.
    #[default]
    F32Io,
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32Io => "f32-io",
        }
    }
}

/// Per-layer options.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    pub direction: Direction,
    pub precision: Precision,
}

/// A layer on one statically known backend. Use this type to run on backend buffers
/// ([`Layer::forward_buffers`]); use [`TriMul`] when the backend is chosen at run time.
pub struct Layer<B: Backend> {
    backend: B,
    config: Config,
    options: Options,
    prepared: B::Prepared,
    workspace: Option<B::Workspace>,
}

impl<B: Backend> Layer<B> {
    /// Prepares (fuses, casts, uploads) the weights once.
    pub fn new(backend: &B, weights: &Weights, options: Options) -> Result<Self> {
        weights.validate()?;
        let prepared = backend.prepare(weights)?;
        Ok(Layer { backend: backend.clone(), config: weights.config(), options, prepared, workspace: None })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn config(&self) -> Config {
        self.config
    }

    pub fn options(&self) -> Options {
        self.options
    }

    /// The validated problem for one call of this layer.
    pub fn problem(&self, shape: Shape, masked: bool) -> Result<Problem> {
        Problem::new(self.config, shape, self.options.direction, masked)
    }

    /// Bytes of device workspace a call of this shape needs.
    pub fn workspace_bytes(&self, shape: Shape, masked: bool) -> Result<u64> {
        let p = self.problem(shape, masked)?;
        Ok(self.backend.workspace_bytes(&self.prepared, &p))
    }

    /// The backend, the prepared weights and a workspace that fits `problem`, made anew only
    /// when the shape changed.
    pub(crate) fn parts(&mut self, problem: &Problem) -> Result<(&B, &B::Prepared, &mut B::Workspace)> {
        let Layer { backend, prepared, workspace, .. } = self;
        let fits = matches!(workspace, Some(ws) if backend.workspace_fits(ws, problem));
        if !fits {
            // Free the old workspace before allocating the new one.
            *workspace = None;
            *workspace = Some(backend.workspace(prepared, problem)?);
        }
        let ws = workspace.as_mut().ok_or_else(|| Error::InvalidArgument("workspace missing".into()))?;
        Ok((backend, prepared, ws))
    }

    /// One forward on host slices (`x`: `[B,N,N,C]`, `mask`: `[B,N,N]`, `y`: `[B,N,N,C]`).
    /// Returns when `y` holds the result. `x` and `mask` are not modified.
    pub fn forward_into(&mut self, x: &[f32], mask: Option<&[f32]>, y: &mut [f32], shape: Shape) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?;
        problem.check_lengths(x.len(), mask.map(<[f32]>::len), y.len())?;
        let (backend, prepared, ws) = self.parts(&problem)?;
        backend.forward_host(prepared, ws, &problem, x, mask, y)
    }

    /// Enqueues one forward on backend buffers; call [`Backend::synchronize`] (or download)
    /// before reading `y`.
    pub fn forward_buffers(
        &mut self,
        x: &B::Buffer,
        mask: Option<&B::Buffer>,
        y: &mut B::Buffer,
        shape: Shape,
    ) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?;
        problem.check_lengths(B::buffer_len(x), mask.map(B::buffer_len), B::buffer_len(y))?;
        let (backend, prepared, ws) = self.parts(&problem)?;
        backend.forward(prepared, ws, &problem, x, mask, y)
    }
}

/// A layer on a backend chosen at run time: the type most callers want.
// A layer is created once and held; variant sizes do not matter, boxing would only add a hop.
#[allow(clippy::large_enum_variant)]
pub enum TriMul {
    Cpu(Layer<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Layer<crate::backend::cuda::CudaBackend>),
    #[cfg(feature = "rocm")]
    Hip(Layer<crate::backend::hip::HipBackend>),
}

macro_rules! with_layer {
    ($layer:expr, $l:ident => $body:expr) => {
        match $layer {
            TriMul::Cpu($l) => $body,
            #[cfg(feature = "cuda")]
            TriMul::Cuda($l) => $body,
            #[cfg(feature = "rocm")]
            TriMul::Hip($l) => $body,
        }
    };
}

impl TriMul {
    /// Prepares `weights` on `device` once; later forwards reuse them.
    pub fn new(device: &Device, weights: &Weights, options: Options) -> Result<Self> {
        Ok(match device {
            Device::Cpu(b) => TriMul::Cpu(Layer::new(b, weights, options)?),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => TriMul::Cuda(Layer::new(b, weights, options)?),
            #[cfg(feature = "rocm")]
            Device::Hip(b) => TriMul::Hip(Layer::new(b, weights, options)?),
        })
    }

    pub fn kind(&self) -> BackendKind {
        with_layer!(self, l => l.backend().kind())
    }

    pub fn device(&self) -> Device {
        match self {
            TriMul::Cpu(l) => Device::Cpu(l.backend().clone()),
            #[cfg(feature = "cuda")]
            TriMul::Cuda(l) => Device::Cuda(l.backend().clone()),
            #[cfg(feature = "rocm")]
            TriMul::Hip(l) => Device::Hip(l.backend().clone()),
        }
    }

    pub fn config(&self) -> Config {
        with_layer!(self, l => l.config())
    }

    pub fn options(&self) -> Options {
        with_layer!(self, l => l.options())
    }

    /// Bytes of device workspace a call of this shape needs.
    pub fn workspace_bytes(&self, shape: Shape, masked: bool) -> Result<u64> {
        with_layer!(self, l => l.workspace_bytes(shape, masked))
    }

    /// One forward on host slices into `y`. See [`Layer::forward_into`].
    pub fn forward_into(&mut self, x: &[f32], mask: Option<&[f32]>, y: &mut [f32], shape: Shape) -> Result<()> {
        with_layer!(self, l => l.forward_into(x, mask, y, shape))
    }

    /// One forward on host slices, returning a new `y` of the shape of `x`.
    pub fn forward(&mut self, x: &[f32], mask: Option<&[f32]>, shape: Shape) -> Result<Vec<f32>> {
        let mut y = vec![0.0f32; x.len()];
        self.forward_into(x, mask, &mut y, shape)?;
        Ok(y)
    }
}

impl std::fmt::Debug for TriMul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.config();
        write!(f, "TriMul({}, {}, C={}, H={}, {})", self.kind(), c.formulation, c.c, c.h, self.options().direction)
    }
}
