//! rocBLAS argument construction from [`GemmSpec`], the column-major layout math shared with the
//! CUDA backend. Pure data, so it is tested here without a GPU; the call itself is in
//! `result.rs`.
//!
//! rocBLAS (like cuBLASLt) is column-major, as `GemmSpec` is, so a spec maps one to one:
//! `trans_a`/`trans_b` become `rocblas_operation_transpose`/`_none`, `m, n, k, lda, ldb, ldd` pass
//! through, C aliases D (`ldc = ldd`, `beta = 0` except for the bias update), and a spec with
//! `batch > 1` becomes `rocblas_gemm_strided_batched_ex` with its strides. Operands are f16, the
//! output f16 or f32, compute f32 (rocBLAS "HHS"/"HSS").

#![forbid(unsafe_code)]

use super::sys::{
    rocblas_datatype, rocblas_int, rocblas_operation, rocblas_stride, ROCBLAS_DATATYPE_BF16_R, ROCBLAS_DATATYPE_F16_R,
    ROCBLAS_DATATYPE_F32_R, ROCBLAS_OPERATION_NONE, ROCBLAS_OPERATION_TRANSPOSE,
};
use crate::backend::gemm::GemmSpec;
use crate::error::{Error, Result};

/// Element types of a GEMM's operands and output.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DataType {
    F16,
    Bf16,
    F32,
}

impl DataType {
    pub fn rocblas(self) -> rocblas_datatype {
        match self {
            DataType::F16 => ROCBLAS_DATATYPE_F16_R,
            DataType::Bf16 => ROCBLAS_DATATYPE_BF16_R,
            DataType::F32 => ROCBLAS_DATATYPE_F32_R,
        }
    }
}

/// The arguments rocBLAS takes for each matrix operand: its element type, its leading dimension
/// and (in `rocblas_gemm_strided_batched_ex` only) the stride between batches.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Operand {
    pub ty: rocblas_datatype,
    pub ld: rocblas_int,
    pub stride: rocblas_stride,
}

impl Operand {
    /// `ld_name` names the leading dimension in the error when it exceeds `rocblas_int`.
    fn new(ty: DataType, ld_name: &str, ld: usize, batch_stride: usize) -> Result<Self> {
        Ok(Operand { ty: ty.rocblas(), ld: int(ld_name, ld)?, stride: stride(batch_stride)? })
    }
}

/// Every scalar argument of one `rocblas_gemm_ex` / `rocblas_gemm_strided_batched_ex` call.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RocblasGemm {
    pub trans_a: rocblas_operation,
    pub trans_b: rocblas_operation,
    pub m: rocblas_int,
    pub n: rocblas_int,
    pub k: rocblas_int,
    pub a: Operand,
    pub b: Operand,
    /// C aliases D: the same operand.
    pub c: Operand,
    pub d: Operand,
    pub batch: rocblas_int,
    pub compute_type: rocblas_datatype,
    /// `rocblas_gemm_strided_batched_ex` when true, `rocblas_gemm_ex` otherwise.
    pub strided_batched: bool,
    /// Elements each operand spans in memory (for bounds checks before the call).
    pub a_elems: usize,
    pub b_elems: usize,
    pub d_elems: usize,
}

fn int(what: &str, v: usize) -> Result<rocblas_int> {
    rocblas_int::try_from(v).map_err(|_| {
        Error::Shape(format!("GEMM {what} = {v} exceeds rocBLAS's 32-bit rocblas_int; use smaller chunks"))
    })
}

fn stride(v: usize) -> Result<rocblas_stride> {
    rocblas_stride::try_from(v).map_err(|_| Error::Shape(format!("GEMM stride {v} exceeds 64 bits")))
}

/// Elements a column-major `rows × cols` matrix with leading dimension `ld` spans.
fn span(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (cols - 1) * ld + rows
    }
}

impl RocblasGemm {
    /// The rocBLAS call for `spec` with f16/f32 operands `ab` and output `d`, f32 compute.
    /// Rejects specs rocBLAS would reject (leading dimensions too small, sizes over `i32`).
    pub fn from_spec(spec: &GemmSpec, ab: DataType, d: DataType) -> Result<Self> {
        let (a_rows, a_cols) = spec.a_dims();
        let (b_rows, b_cols) = spec.b_dims();
        for (name, ld, rows) in [("lda", spec.lda, a_rows), ("ldb", spec.ldb, b_rows), ("ldd", spec.ldd, spec.m)] {
            if ld < rows.max(1) {
                return Err(Error::Shape(format!("GEMM {name} = {ld} is smaller than the {rows} rows it must hold")));
            }
        }
        if spec.batch == 0 {
            return Err(Error::Shape("GEMM batch count is 0".into()));
        }
        let op = |t: bool| if t { ROCBLAS_OPERATION_TRANSPOSE } else { ROCBLAS_OPERATION_NONE };
        let batched = |one: usize, s: usize| (spec.batch - 1) * s + one;
        let (m, n, k) = (int("m", spec.m)?, int("n", spec.n)?, int("k", spec.k)?);
        let a = Operand::new(ab, "lda", spec.lda, spec.stride_a)?;
        let b = Operand::new(ab, "ldb", spec.ldb, spec.stride_b)?;
        let cd = Operand::new(d, "ldd", spec.ldd, spec.stride_d)?;
        Ok(RocblasGemm {
            trans_a: op(spec.trans_a),
            trans_b: op(spec.trans_b),
            m,
            n,
            k,
            a,
            b,
            c: cd,
            d: cd,
            batch: int("batch", spec.batch)?,
            compute_type: ROCBLAS_DATATYPE_F32_R,
            strided_batched: spec.batch > 1,
            a_elems: batched(span(a_rows, a_cols, spec.lda), spec.stride_a),
            b_elems: batched(span(b_rows, b_cols, spec.ldb), spec.stride_b),
            d_elems: batched(span(spec.m, spec.n, spec.ldd), spec.stride_d),
        })
    }
}

/// The af3 output bias as a rank-1 update `y[rows, c] += bout[c] · 1`: in column-major terms
/// `Yᵀ (c × rows) += bout (c × 1) · onesᵀ (1 × rows)`, called with beta = 1 and C = D = y.
/// rocBLAS has no bias epilogue for `gemm_ex` (cuBLASLt's BIAS epilogue does this on CUDA), and a
/// k = 1 GEMM adds the bias in f32 without a kernel of its own.
pub fn bias_update_spec(rows: usize, c: usize) -> GemmSpec {
    GemmSpec {
        m: c,
        n: rows,
        k: 1,
        trans_a: false,
        trans_b: false,
        lda: c,
        ldb: 1,
        ldd: c,
        batch: 1,
        stride_a: 0,
        stride_b: 0,
        stride_d: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Direction;

    const T: rocblas_operation = ROCBLAS_OPERATION_TRANSPOSE;
    const N: rocblas_operation = ROCBLAS_OPERATION_NONE;
    const H16: rocblas_datatype = ROCBLAS_DATATYPE_F16_R;
    const S32: rocblas_datatype = ROCBLAS_DATATYPE_F32_R;

    #[test]
    fn projection_call() {
        // P[rows, 5H] = z[rows, C]·Wcatᵀ for C = 384, H = 128 (gpumode), a chunk of 4096 rows.
        let g = RocblasGemm::from_spec(&GemmSpec::projection(4096, 384, 640), DataType::F16, DataType::F16).unwrap();
        assert_eq!((g.trans_a, g.trans_b), (T, N));
        assert_eq!((g.m, g.n, g.k), (640, 4096, 384));
        assert_eq!((g.a.ld, g.b.ld, g.c.ld, g.d.ld), (384, 384, 640, 640));
        assert_eq!((g.a.ty, g.b.ty, g.c.ty, g.d.ty, g.compute_type), (H16, H16, H16, H16, S32));
        assert!(!g.strided_batched);
        assert_eq!((g.a_elems, g.b_elems, g.d_elems), (640 * 384, 4096 * 384, 4096 * 640));
    }

    #[test]
    fn contraction_calls_both_directions() {
        let (b, h, n) = (2, 128, 256);
        let out =
            RocblasGemm::from_spec(&GemmSpec::contraction(Direction::Outgoing, b * h, n), DataType::F16, DataType::F16)
                .unwrap();
        assert_eq!((out.trans_a, out.trans_b), (T, N));
        let inc =
            RocblasGemm::from_spec(&GemmSpec::contraction(Direction::Incoming, b * h, n), DataType::F16, DataType::F16)
                .unwrap();
        assert_eq!((inc.trans_a, inc.trans_b), (N, T));
        for g in [out, inc] {
            assert!(g.strided_batched);
            assert_eq!((g.m, g.n, g.k, g.batch), (256, 256, 256, 256));
            assert_eq!((g.a.ld, g.b.ld, g.c.ld, g.d.ld), (256, 256, 256, 256));
            let nn = (n * n) as i64;
            assert_eq!((g.a.stride, g.b.stride, g.c.stride, g.d.stride), (nn, nn, nn, nn));
            assert_eq!(g.d_elems, b * h * n * n);
        }
        // One matrix (B·H = 1): plain gemm_ex, strides 0.
        let one =
            RocblasGemm::from_spec(&GemmSpec::contraction(Direction::Incoming, 1, 8), DataType::F16, DataType::F16)
                .unwrap();
        assert!(!one.strided_batched);
        assert_eq!((one.a.stride, one.batch), (0, 1));
    }

    #[test]
    fn output_and_bias_calls() {
        let g = RocblasGemm::from_spec(&GemmSpec::output(65536, 128, 128), DataType::F16, DataType::F32).unwrap();
        assert_eq!((g.trans_a, g.trans_b), (T, N));
        assert_eq!((g.m, g.n, g.k), (128, 65536, 128));
        assert_eq!((g.a.ld, g.b.ld, g.d.ld), (128, 128, 128));
        assert_eq!((g.a.ty, g.c.ty, g.d.ty, g.compute_type), (H16, S32, S32, S32));
        let bias = RocblasGemm::from_spec(&bias_update_spec(65536, 384), DataType::F32, DataType::F32).unwrap();
        assert_eq!((bias.trans_a, bias.trans_b, bias.m, bias.n, bias.k), (N, N, 384, 65536, 1));
        assert_eq!((bias.a.ld, bias.b.ld, bias.c.ld, bias.d.ld), (384, 1, 384, 384));
        assert_eq!((bias.a_elems, bias.b_elems, bias.d_elems), (384, 65536, 65536 * 384));
    }

    #[test]
    fn bias_update_adds_the_bias_to_every_row() {
        let (rows, c) = (5, 3);
        let bias = [0.5f32, -2.0, 7.25];
        let ones = vec![1.0f32; rows];
        let mut y = vec![0f32; rows * c];
        bias_update_spec(rows, c).run_host(&bias, &ones, &mut y);
        for r in 0..rows {
            assert_eq!(&y[r * c..r * c + c], &bias, "row {r}");
        }
    }

    #[test]
    fn rejects_what_rocblas_would() {
        let mut s = GemmSpec::projection(10, 8, 16);
        s.lda = 4;
        assert!(RocblasGemm::from_spec(&s, DataType::F16, DataType::F16).is_err());
        let big = GemmSpec::output(1 << 31, 8, 8);
        let e = RocblasGemm::from_spec(&big, DataType::F16, DataType::F32).unwrap_err().to_string();
        assert!(e.contains("n = 2147483648"), "{e}");
        let mut z = GemmSpec::contraction(Direction::Outgoing, 2, 4);
        z.batch = 0;
        assert!(RocblasGemm::from_spec(&z, DataType::F16, DataType::F16).is_err());
    }
}
