//! Buffers laid out in one span of device memory, the arithmetic the GPU backends share: a
//! workspace in caller memory (planned from address 0, then moved to each call's span by
//! `bind`) and the storage of weights prepared on the device ([`super::device_prepare`]).
//! Generic over the backend's buffer type; the backends make the views and move them.

use crate::device_io::{DeviceSpan, SPAN_ALIGN};
use crate::error::{BackendKind, Error, Result};
use crate::problem::Problem;

/// Consecutive regions of one span, each at an offset aligned to [`SPAN_ALIGN`], laid out from 0.
#[derive(Debug, Default)]
pub(crate) struct SpanCarver {
    end: u64,
}

impl SpanCarver {
    /// The offset of the next `bytes` (a region of none takes no room: it shares the next one's).
    pub(crate) fn take(&mut self, bytes: u64) -> u64 {
        let at = self.end;
        self.end = (at + bytes).div_ceil(SPAN_ALIGN) * SPAN_ALIGN;
        at
    }

    /// A view of the next `bytes` (at least one, so that no two views share an address), which
    /// `view` makes at its offset.
    pub(crate) fn carve<B>(&mut self, bytes: u64, view: impl FnOnce(u64) -> B) -> B {
        view(self.take(bytes.max(1)))
    }

    /// The bytes the regions so far span.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    /// [`SpanCarver::end`] for a caller-memory workspace of `problem`, or the error saying it
    /// does not fit `limit`.
    pub(crate) fn workspace_within(&self, backend: BackendKind, problem: &Problem, limit: Option<u64>) -> Result<u64> {
        match limit.filter(|&l| self.end > l) {
            None => Ok(self.end),
            Some(available) => Err(Error::OutOfMemory {
                backend,
                what: format!(
                    "the workspace for B={} N={} C={} H={} in caller memory",
                    problem.shape.batch, problem.shape.n, problem.config.c, problem.config.h
                ),
                needed: self.end,
                available,
            }),
        }
    }
}

/// The error for a caller-memory workspace of a layout planning never puts there (one pass,
/// and on CUDA the fused kernel's chunked plans, are the ones it does).
pub(crate) fn not_in_caller_memory() -> Error {
    Error::Internal("this workspace layout is never planned in caller memory".into())
}

/// A view into caller memory that [`bind`] moves with its span (CUDA's workspaces hold views
/// of two element types; HIP's one type, moved by a plain function).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) trait Rebase {
    /// Moves the view by the distance its memory moved (`from` → `to`).
    fn rebase(&mut self, from: u64, to: u64) -> Result<()>;
}

/// Moves the views of a caller-memory workspace into `span` (checked: aligned, large enough).
/// `caller_base` is the address the views are laid out from now and the bytes they span (`None`:
/// the layer owns the workspace, which takes no span); `views` lists them, and `rebase` moves
/// one by the distance its memory moved (`from` → `to`).
pub(crate) fn bind<'a, B: ?Sized + 'a, I: IntoIterator<Item = &'a mut B>>(
    caller_base: &mut Option<(u64, u64)>,
    span: DeviceSpan,
    views: impl FnOnce() -> Result<I>,
    rebase: impl Fn(&mut B, u64, u64) -> Result<()>,
) -> Result<()> {
    let Some((from, bytes)) = *caller_base else {
        return Err(Error::InvalidArgument("a workspace span was given to a workspace the layer owns".into()));
    };
    span.check("the workspace", bytes)?;
    if from == span.ptr {
        return Ok(());
    }
    for view in views()? {
        rebase(view, from, span.ptr)?;
    }
    *caller_base = Some((span.ptr, bytes));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_and_empty_views_take_room() {
        let mut s = SpanCarver::default();
        assert_eq!(s.take(0), 0);
        assert_eq!(s.take(1), 0);
        assert_eq!(s.take(SPAN_ALIGN), SPAN_ALIGN);
        assert_eq!(s.carve(0, |at| at), 2 * SPAN_ALIGN);
        assert_eq!(s.carve(3, |at| at), 3 * SPAN_ALIGN);
        assert_eq!(s.end(), 4 * SPAN_ALIGN);
    }

    #[test]
    fn bind_moves_every_view_once_and_checks_the_span() {
        let mut views = [0u64, 256, 512];
        let mut base = Some((0, 768));
        let moved = |v: &mut u64, from: u64, to: u64| {
            *v = *v - from + to;
            Ok(())
        };
        bind(&mut base, DeviceSpan { ptr: 4096, bytes: 768 }, || Ok(views.iter_mut()), moved).unwrap();
        assert_eq!((views, base), ([4096, 4352, 4608], Some((4096, 768))));
        // The same span again moves nothing; a short or misaligned one is refused.
        bind(&mut base, DeviceSpan { ptr: 4096, bytes: 768 }, || Ok(views.iter_mut()), moved).unwrap();
        assert_eq!(views, [4096, 4352, 4608]);
        assert!(bind(&mut base, DeviceSpan { ptr: 8192, bytes: 512 }, || Ok(views.iter_mut()), moved).is_err());
        assert!(bind(&mut base, DeviceSpan { ptr: 8193, bytes: 768 }, || Ok(views.iter_mut()), moved).is_err());
        assert_eq!(views, [4096, 4352, 4608]);
        // A workspace the layer owns takes no span.
        let mut owned = None;
        assert!(bind(&mut owned, DeviceSpan { ptr: 4096, bytes: 768 }, || Ok(views.iter_mut()), moved).is_err());
    }
}
