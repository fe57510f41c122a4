//! Host staging: forwards on host slices, done once above the backends.
//!
//! A backend computes on its own memory ([`Backend::forward`] takes a [`ForwardIo`] of it); the
//! layer's host forwards ([`Layer::forward_into`](crate::Layer::forward_into),
//! [`Layer::forward_in_place`](crate::Layer::forward_in_place)) reach it through here:
//! 1. the slices are checked against the problem (lengths, mask, in place, element type), once;
//! 2. 16-bit x and y are widened to f32 host copies where the backend's kernels for these
//!    weights read and write f32 only ([`Backend::half_io_native`]), and y rounded back after;
//! 3. a backend that computes on host memory (the CPU, [`Backend::host_io_staged`] false) gets
//!    the slices themselves: no copy of x or y;
//! 4. a GPU backend gets device buffers: x and the mask uploaded into buffers this staging keeps
//!    across calls (made on first use, remade only when the size changes, so a forward allocates
//!    nothing), the forward enqueued on them, y downloaded (in place, x's buffer holds y). A
//!    16-bit tensor of `n` words lies in a buffer of `n.div_ceil(2)` f32 slots, its bytes.
//!
//! [`Layer`](crate::Layer) keeps one [`HostStaging`] beside its workspace and drops it with the
//! workspace, so that the buffers never hold memory a new workspace plan counts as free.

use crate::backend::{Backend, HostWords, HostWordsMut};
use crate::device_io::{check_in_place, check_io_precision, ForwardIo};
use crate::error::{Error, Result};
use crate::problem::{Precision, Problem};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// Element types `x` and `y` can be passed in: `f32` ([`Precision::F32Io`]), [`half::bf16`]
/// ([`Precision::Bf16Io`]) and [`half::f16`] ([`Precision::F16Io`]). The mask is always `f32`.
/// How a backend runs each: see the [module docs](self).
pub trait IoElement: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// The I/O precision this element type stands for.
    const PRECISION: Precision;

    #[doc(hidden)]
    fn words(s: &[Self]) -> HostWords<'_>;

    #[doc(hidden)]
    fn words_mut(s: &mut [Self]) -> HostWordsMut<'_>;
}

impl IoElement for f32 {
    const PRECISION: Precision = Precision::F32Io;

    fn words(s: &[f32]) -> HostWords<'_> {
        HostWords::F32(s)
    }

    fn words_mut(s: &mut [f32]) -> HostWordsMut<'_> {
        HostWordsMut::F32(s)
    }
}

macro_rules! half_io_element {
    ($t:ty, $p:expr) => {
        impl IoElement for $t {
            const PRECISION: Precision = $p;

            fn words(s: &[$t]) -> HostWords<'_> {
                use half::slice::HalfFloatSliceExt;
                HostWords::Half(s.reinterpret_cast())
            }

            fn words_mut(s: &mut [$t]) -> HostWordsMut<'_> {
                use half::slice::HalfFloatSliceExt;
                HostWordsMut::Half(s.reinterpret_cast_mut())
            }
        }
    };
}

half_io_element!(half::bf16, Precision::Bf16Io);
half_io_element!(half::f16, Precision::F16Io);

/// Checks host slices against `problem`: `x_len` `None` in place (y holds x), x and y of
/// element type `given`. The checks [`ForwardIo::check`] makes, for slices not yet staged.
pub(crate) fn check_host(
    problem: &Problem,
    given: Precision,
    x_len: Option<usize>,
    mask: Option<&[f32]>,
    y_len: usize,
) -> Result<()> {
    problem.check_lengths(x_len.unwrap_or(y_len), mask.map(<[f32]>::len), y_len)?;
    check_in_place(x_len.is_none(), problem)?;
    check_io_precision(given, problem.io)
}

/// Device copies of one forward's host x, mask and y, kept across calls (see the module docs).
pub struct HostStaging<B: Backend> {
    x: Option<B::Buffer>,
    mask: Option<B::Buffer>,
    y: Option<B::Buffer>,
}

impl<B: Backend> Default for HostStaging<B> {
    fn default() -> Self {
        HostStaging { x: None, mask: None, y: None }
    }
}

impl<B: Backend> HostStaging<B> {
    /// No buffers yet: they are made by the first forward that needs them.
    pub fn new() -> Self {
        Self::default()
    }

    /// Frees the buffers.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// One forward on host slices through `backend` with a workspace of its own (see the module
    /// docs): `x` (`None` in place: `y` holds x, for a problem made in place), the mask and `y`.
    /// Returns when `y` holds the result.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T: IoElement>(
        &mut self,
        backend: &B,
        prepared: &B::Prepared,
        workspace: &mut B::Workspace,
        problem: &Problem,
        x: Option<&[T]>,
        mask: Option<&[f32]>,
        y: &mut [T],
    ) -> Result<()> {
        check_host(problem, T::PRECISION, x.map(<[T]>::len), mask, y.len())?;
        let on = On { backend, prepared, workspace, problem };
        self.run(on, Host { x: x.map(T::words), mask, y: T::words_mut(y) })
    }

    /// The forward `on` a backend, on slices already checked ([`check_host`]).
    pub(crate) fn run(&mut self, on: On<'_, B>, host: Host<'_>) -> Result<()> {
        if on.problem.io != Precision::F32Io && !on.backend.half_io_native(on.prepared) {
            return self.widened(on, host);
        }
        if on.backend.host_io_staged() {
            return self.staged(on, host);
        }
        // The backend computes on host memory: the slices are its operands as they lie.
        let Host { x, mask, y } = host;
        let io = match (x, y) {
            (Some(HostWords::F32(x)), HostWordsMut::F32(y)) => ForwardIo::host(x, mask, y),
            (None, HostWordsMut::F32(y)) => ForwardIo::host_in_place(y, mask),
            _ => {
                return Err(Error::Internal(format!(
                    "the {} backend computes on host memory in f32, yet says it keeps {} x and y",
                    on.backend.kind(),
                    on.problem.io
                )))
            }
        };
        on.backend.forward(on.prepared, on.workspace, on.problem, io)
    }

    /// 16-bit x widened to an f32 copy, the forward in f32 (same math: the kernels round nothing
    /// at the I/O), y rounded back to 16 bits.
    fn widened(&mut self, on: On<'_, B>, Host { x, mask, y }: Host<'_>) -> Result<()> {
        let io = on.problem.io;
        let wide = on.problem.with_io(Precision::F32Io);
        let on = On { problem: &wide, ..on };
        let decode = |bits: &[u16]| -> Result<Vec<f32>> {
            let mut v = crate::hostmem::try_vec(bits.len(), 0f32, "f32 copy of x")?;
            v.iter_mut().zip(bits).for_each(|(d, &b)| *d = io.decode_half(b));
            Ok(v)
        };
        let encode = |from: &[f32], to: &mut [u16]| to.iter_mut().zip(from).for_each(|(d, &v)| *d = io.encode_half(v));
        match (x, y) {
            (Some(HostWords::Half(x)), HostWordsMut::Half(y)) => {
                let xf = decode(x)?;
                let mut yf = crate::hostmem::try_vec(y.len(), 0f32, "f32 y")?;
                self.run(on, Host { x: Some(HostWords::F32(&xf)), mask, y: HostWordsMut::F32(&mut yf) })?;
                encode(&yf, y);
                Ok(())
            }
            (None, HostWordsMut::Half(xy)) => {
                let mut f = decode(xy)?;
                self.run(on, Host { x: None, mask, y: HostWordsMut::F32(&mut f) })?;
                encode(&f, xy);
                Ok(())
            }
            _ => Err(Error::Internal(format!("{io} host slices handed to the staging as f32"))),
        }
    }

    /// x and the mask uploaded into the kept buffers, the forward enqueued on them, y downloaded.
    fn staged(&mut self, on: On<'_, B>, Host { x, mask, y }: Host<'_>) -> Result<()> {
        let On { backend, prepared, workspace, problem } = on;
        // Checked before any staging is made or kept: a workspace of another problem would leave
        // buffers of the wrong size behind for the calls that fit it.
        if !backend.workspace_fits(workspace, problem) {
            return Err(Error::InvalidArgument("workspace was made for another problem shape".into()));
        }
        let (len, bytes) = match &y {
            HostWordsMut::F32(v) => (v.len(), std::mem::size_of_val(*v)),
            HostWordsMut::Half(v) => (v.len(), std::mem::size_of_val(*v)),
        };
        let slots = bytes.div_ceil(4);
        keep(backend, &mut self.x, slots, "a device copy of x")?;
        if x.is_some() {
            keep(backend, &mut self.y, slots, "a device copy of y")?;
        }
        if let Some(m) = mask {
            keep(backend, &mut self.mask, m.len(), "a device copy of the mask")?;
        }
        let HostStaging { x: Some(xd), mask: md, y: yd } = self else {
            return Err(Error::Internal("host staging lost its copy of x".into()));
        };
        let mut md = if mask.is_some() { md.as_mut() } else { None };
        let yd = if x.is_some() { yd.as_mut() } else { None };
        let result = (|| {
            let x_words = x.unwrap_or(match &y {
                HostWordsMut::F32(v) => HostWords::F32(v),
                HostWordsMut::Half(v) => HostWords::Half(v),
            });
            // SAFETY: x's (or xy's) and the mask's slices are borrowed for this whole call, and
            // every way out of it waits for the backend's stream (the download below, or the
            // synchronize after a failure), so they outlive the copies.
            unsafe {
                backend.upload_async(x_words, xd)?;
                if let (Some(m), Some(md)) = (mask, md.as_deref_mut()) {
                    backend.upload_async(HostWords::F32(m), md)?;
                }
            }
            let addr = |b: &B::Buffer| {
                B::buffer_addr(b).ok_or_else(|| Error::Internal("a staged backend's buffer has no address".into()))
            };
            let x_arg = (addr(xd)?, len);
            let mask_arg = match (mask, md.as_deref()) {
                (Some(m), Some(md)) => Some((addr(md)?, m.len())),
                _ => None,
            };
            let y_arg = match yd.as_deref() {
                Some(yd) => (addr(yd)?, len),
                None => x_arg,
            };
            // SAFETY: the staging buffers are this backend's allocations of at least the problem's
            // element counts in its I/O precision (sized above), apart from each other except x
            // and y in place, borrowed for this call; the download below (or the synchronize
            // after a failure) waits for the work before they could be freed.
            let io = unsafe { ForwardIo::device_buffers(yd.is_some().then_some(x_arg), mask_arg, y_arg, problem.io) };
            backend.forward(prepared, workspace, problem, io)?;
            backend.download_words(yd.as_deref().unwrap_or(xd), y)
        })();
        if result.is_err() {
            // Copies from the host slices may still be queued behind the failed step; they must
            // not outlive this call's borrows.
            let _ = backend.synchronize();
        }
        result
    }
}

/// What a forward runs on: the backend, its prepared weights and workspace, and the problem.
pub(crate) struct On<'a, B: Backend> {
    pub(crate) backend: &'a B,
    pub(crate) prepared: &'a B::Prepared,
    pub(crate) workspace: &'a mut B::Workspace,
    pub(crate) problem: &'a Problem,
}

/// One forward's host slices: x (`None` in place: y holds x), the mask and y.
pub(crate) struct Host<'a> {
    pub(crate) x: Option<HostWords<'a>>,
    pub(crate) mask: Option<&'a [f32]>,
    pub(crate) y: HostWordsMut<'a>,
}

/// Makes `slot` a buffer of `slots` f32 slots unless it is one; `what` names it in an error.
fn keep<B: Backend>(backend: &B, slot: &mut Option<B::Buffer>, slots: usize, what: &str) -> Result<()> {
    if slot.as_ref().is_some_and(|b| B::buffer_len(b) == slots) {
        return Ok(());
    }
    // The old buffer goes before the new one is made.
    *slot = None;
    *slot = Some(backend.alloc(slots).map_err(|e| match e {
        Error::OutOfMemory { backend, needed, available, .. } => {
            Error::OutOfMemory { backend, what: what.into(), needed, available }
        }
        other => other,
    })?);
    Ok(())
}
