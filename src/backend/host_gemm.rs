//! A safe, bounds-checked front to the `gemm` crate's f32 matrix product.
//!
//! `gemm::gemm` takes raw pointers and strides; this module is the one place on the host side
//! that calls it, so the CPU backend itself can `forbid(unsafe_code)`. Every view is checked
//! against the slice it borrows before the call: all addressed elements lie inside the slice,
//! and the destination addresses no element twice (so parallel writes inside `gemm` never race).
//! Aliasing between destination and sources is ruled out by the borrow checker (`&mut` vs `&`).

use crate::error::{Error, Result};

pub use ::gemm::Parallelism;

/// A read-only strided matrix view: element `(i, j)` is `data[i·rs + j·cs]`.
#[derive(Copy, Clone, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// A writable strided matrix view: element `(i, j)` is `data[i·rs + j·cs]`.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// Index one past the last element a `rows × cols` view with strides `rs`, `cs` touches
/// (0 for an empty view), or an error if that does not fit in `len` or overflows.
fn extent(what: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Result<usize> {
    if rows == 0 || cols == 0 {
        return Ok(0);
    }
    let end = (rows - 1)
        .checked_mul(rs)
        .and_then(|a| (cols - 1).checked_mul(cs).and_then(|b| a.checked_add(b)))
        .and_then(|e| e.checked_add(1));
    match end {
        Some(e) if e <= len && isize::try_from(rs).is_ok() && isize::try_from(cs).is_ok() => Ok(e),
        _ => Err(Error::InvalidArgument(format!(
            "gemm {what} view {rows}x{cols} with strides ({rs}, {cs}) exceeds its buffer of {len} elements"
        ))),
    }
}

impl<'a> MatRef<'a> {
    pub fn new(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Result<Self> {
        extent("input", data.len(), rows, cols, rs, cs)?;
        Ok(MatRef { data, rows, cols, rs, cs })
    }
}

impl<'a> MatMut<'a> {
    /// Besides the bounds, requires that distinct `(i, j)` map to distinct elements: one of the
    /// two strides must step over the whole extent of the other dimension.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Result<Self> {
        extent("output", data.len(), rows, cols, rs, cs)?;
        let disjoint = rows <= 1 && (cols <= 1 || cs >= 1)
            || cols <= 1 && rs >= 1
            || cs >= 1 && rs >= cols.saturating_mul(cs)
            || rs >= 1 && cs >= rows.saturating_mul(rs);
        if !disjoint {
            return Err(Error::InvalidArgument(format!(
                "gemm output view {rows}x{cols} with strides ({rs}, {cs}) addresses some element twice"
            )));
        }
        Ok(MatMut { data, rows, cols, rs, cs })
    }
}

/// `dst = lhs · rhs`, overwriting `dst` (its previous contents are never read).
pub fn matmul(dst: MatMut<'_>, lhs: MatRef<'_>, rhs: MatRef<'_>, parallelism: Parallelism) -> Result<()> {
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    if lhs.rows != m || rhs.rows != k || rhs.cols != n {
        return Err(Error::InvalidArgument(format!(
            "gemm shapes disagree: dst {}x{}, lhs {}x{}, rhs {}x{}",
            dst.rows, dst.cols, lhs.rows, lhs.cols, rhs.rows, rhs.cols
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // An empty sum; `gemm` would do the same, but there is nothing to call it for.
        for i in 0..m {
            for j in 0..n {
                dst.data[i * dst.rs + j * dst.cs] = 0.0;
            }
        }
        return Ok(());
    }
    // The constructors checked that the strides fit in isize.
    let s = |v: usize| v as isize;
    // SAFETY: `MatRef::new`/`MatMut::new` checked that every element (i, j) with i < rows and
    // j < cols of each view lies inside its slice, and that the destination maps distinct
    // (i, j) to distinct elements; the shapes agree (checked above), so `gemm` reads only
    // lhs[0..m, 0..k] and rhs[0..k, 0..n] and writes only dst[0..m, 0..n]. `dst` is borrowed
    // mutably and the sources shared, so they cannot overlap. With `read_dst = false` the
    // destination's old contents are not read. All pointers stay valid for the call, which
    // returns only when every worker thread it started has finished.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            s(dst.cs),
            s(dst.rs),
            false,
            lhs.data.as_ptr(),
            s(lhs.cs),
            s(lhs.rs),
            rhs.data.as_ptr(),
            s(rhs.cs),
            s(rhs.rs),
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(
        m: usize,
        n: usize,
        k: usize,
        a: impl Fn(usize, usize) -> f32,
        b: impl Fn(usize, usize) -> f32,
    ) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|l| a(i, l) as f64 * b(l, j) as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn strided_products_match_naive() {
        let (m, n, k) = (7, 5, 9);
        let a: Vec<f32> = (0..m * k).map(|v| (v as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|v| (v as f32 * 0.11).cos()).collect();
        // lhs row-major, rhs given transposed (column-major), dst column-major.
        let want = naive(m, n, k, |i, l| a[i * k + l], |l, j| b[j * k + l]);
        let mut d = vec![0.0; m * n];
        matmul(
            MatMut::new(&mut d, m, n, 1, m).unwrap(),
            MatRef::new(&a, m, k, k, 1).unwrap(),
            MatRef::new(&b, k, n, 1, k).unwrap(),
            Parallelism::None,
        )
        .unwrap();
        for i in 0..m {
            for j in 0..n {
                assert!((d[i + j * m] - want[i * n + j]).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn rejects_out_of_bounds_and_overlap() {
        let a = vec![0.0; 12];
        assert!(MatRef::new(&a, 3, 4, 4, 1).is_ok());
        assert!(MatRef::new(&a, 3, 5, 4, 1).is_err());
        assert!(MatRef::new(&a, 0, 5, 4, 1).is_ok());
        let mut d = vec![0.0; 12];
        assert!(MatMut::new(&mut d, 3, 4, 2, 1).is_err());
        assert!(MatMut::new(&mut d, 3, 4, 1, 3).is_ok());
        assert!(MatMut::new(&mut d, 1, 4, 0, 1).is_ok());
        let mut d = vec![0.0; 6];
        let e = matmul(
            MatMut::new(&mut d, 2, 3, 3, 1).unwrap(),
            MatRef::new(&a, 2, 4, 4, 1).unwrap(),
            MatRef::new(&a, 3, 3, 3, 1).unwrap(),
            Parallelism::None,
        );
        assert!(e.is_err());
    }
}
