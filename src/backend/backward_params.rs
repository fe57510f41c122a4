//! The host–device interface of the backward kernels (`common/backward.h`, compiled as CUDA by
//! `cuda/backward.cu` and as HIP by `hip/backward.hip`): the Rust mirrors of their argument
//! structs, their launch geometry and their shared-memory sizes, checked against the header by a
//! test. Shared by the backends that run the backward.

use crate::gradients::{Gradients, WEIGHT_NAMES};
use crate::problem::{Formulation, Precision};
use crate::weights::{Linear, Norm};

/// Threads per block of every backward kernel (`TM_BWD_THREADS`).
pub(crate) const THREADS: u32 = 256;
/// Positions per block of the warp-per-position kernels (`TM_BWD_ROWS_PER_BLOCK`), and warps
/// per block (`TM_BWD_WARPS`).
pub(crate) const ROWS_PER_BLOCK: usize = 8;
pub(crate) const WARPS: usize = 8;
/// Positions per block of the kernels that go through hidden-major tensors (`TM_BWD_TILE`).
pub(crate) const TILE: usize = 32;
/// Dynamic shared memory of the gating kernels (`TM_BWD_GATING_SMEM`) and of the column sums'
/// first pass (`TM_BWD_PARTIALS_SMEM`).
pub(crate) const GATING_SMEM: u32 = 2 * 32 * (TILE as u32 + 1) * 4;
pub(crate) const PARTIALS_SMEM: u32 = 8 * 32 * 8;
/// Most row blocks of a column sum's first pass (its partial sums: this × the widest matrix's
/// columns, f64).
pub(crate) const MAX_ROW_BLOCKS: usize = 1024;

/// The weight gradients' offsets (in floats) into one device buffer, downloaded in one copy at
/// the end. Each LayerNorm's weight and bias are adjacent: the LayerNorm backward kernels' sums
/// land as one `[γ | β]` row.
#[derive(Copy, Clone)]
pub(crate) struct Outputs {
    pub(crate) w_cat: usize,
    pub(crate) b_cat: usize,
    pub(crate) norm_in_w: usize,
    pub(crate) norm_in_b: usize,
    pub(crate) w_out: usize,
    pub(crate) b_out: usize,
    pub(crate) norm_out_w: usize,
    pub(crate) norm_out_b: usize,
    pub(crate) len: usize,
}

impl Outputs {
    pub(crate) fn new(c: usize, h: usize, f: usize) -> Outputs {
        let mut at = 0;
        let mut next = |len: usize| {
            let o = at;
            at += len;
            o
        };
        let o = Outputs {
            w_cat: next(f * c),
            b_cat: next(f),
            norm_in_w: next(c),
            norm_in_b: next(c),
            w_out: next(c * h),
            b_out: next(c),
            norm_out_w: next(h),
            norm_out_b: next(h),
            len: 0,
        };
        Outputs { len: at, ..o }
    }

    /// Where each weight's gradient lies in the sums, `(offset, floats)`, in the order of
    /// [`Gradients::tensors`] after x with every bias in its place (`None`: a bias the layer does
    /// not have, `biases` in [`Gradients::linears`]' order): norm_in's weight and bias, then each
    /// of left_proj, left_gate, right_proj, right_gate and out_gate's weight and bias, norm_out's,
    /// out_proj's.
    pub(crate) fn slots(&self, biases: [bool; 6], c: usize, h: usize) -> [Option<(usize, usize)>; 16] {
        let f = (self.b_cat - self.w_cat) / c;
        let fused = |i: usize, w0: usize, w1: usize| {
            [Some((self.w_cat + w0 * c, (w1 - w0) * c)), biases[i].then_some((self.b_cat + w0, w1 - w0))]
        };
        let [lp, lpb] = fused(0, 0, h);
        let [lg, lgb] = fused(1, h, 2 * h);
        let [rp, rpb] = fused(2, 2 * h, 3 * h);
        let [rg, rgb] = fused(3, 3 * h, 4 * h);
        let [og, ogb] = fused(4, 4 * h, f);
        [
            Some((self.norm_in_w, c)),
            Some((self.norm_in_b, c)),
            lp,
            lpb,
            lg,
            lgb,
            rp,
            rpb,
            rg,
            rgb,
            og,
            ogb,
            Some((self.norm_out_w, h)),
            Some((self.norm_out_b, h)),
            Some((self.w_out, c * h)),
            biases[5].then_some((self.b_out, c)),
        ]
    }

    /// The weight gradients from the downloaded `sums` (laid out as `self` says), with a bias
    /// gradient exactly where the layer has that bias (`biases`, in [`Gradients::linears`]'
    /// order), and an empty `x`.
    pub(crate) fn gradients(&self, sums: &[f32], biases: [bool; 6], c: usize, h: usize) -> Gradients {
        // w_cat is `[F, C]`, b_cat follows it.
        let f = (self.b_cat - self.w_cat) / c;
        let seg = |at: usize, len: usize| sums[at..at + len].to_vec();
        let fused = |i: usize, w0: usize, w1: usize| {
            let bias = biases[i].then(|| seg(self.b_cat + w0, w1 - w0));
            Linear::new(seg(self.w_cat + w0 * c, (w1 - w0) * c), bias, w1 - w0, c)
        };
        Gradients {
            x: Vec::new(),
            norm_in: Norm { weight: seg(self.norm_in_w, c), bias: seg(self.norm_in_b, c) },
            left_proj: fused(0, 0, h),
            left_gate: fused(1, h, 2 * h),
            right_proj: fused(2, 2 * h, 3 * h),
            right_gate: fused(3, 3 * h, 4 * h),
            out_gate: fused(4, 4 * h, f),
            norm_out: Norm { weight: seg(self.norm_out_w, h), bias: seg(self.norm_out_b, h) },
            out_proj: Linear::new(seg(self.w_out, c * h), biases[5].then(|| seg(self.b_out, c)), c, h),
        }
    }
}

/// The copies that put the weight gradients of `problem`'s backward where `grads` says (device
/// addresses in [`Outputs::slots`]' order, 0: not wanted; `biases` as there): `(destination,
/// offset into the sums, floats)`. A destination for a bias the layer does not have, or one not
/// 4-byte aligned, is an error.
pub(crate) fn gradient_copies(
    problem: &crate::problem::Problem,
    biases: [bool; 6],
    grads: [u64; 16],
) -> crate::error::Result<Vec<(u64, usize, usize)>> {
    let (c, h) = (problem.config.c, problem.config.h);
    let out = Outputs::new(c, h, problem.config.fused_proj_width());
    let mut copies = Vec::new();
    for ((dst, slot), name) in grads.into_iter().zip(out.slots(biases, c, h)).zip(WEIGHT_NAMES) {
        match (dst, slot) {
            (0, _) => {}
            (_, None) => {
                return Err(crate::error::Error::InvalidArgument(format!(
                    "a destination for the gradient of {name}, which this layer does not have"
                )))
            }
            (d, Some(_)) if d % 4 != 0 => {
                return Err(crate::error::Error::InvalidArgument(format!(
                    "the gradient of {name} must go to a 4-byte aligned address (got {d:#x})"
                )))
            }
            (d, Some((at, n))) => copies.push((d, at, n)),
        }
    }
    Ok(copies)
}

/// Positions per chunk of a weight gradient's sum over all `M` positions: about
/// [`WEIGHT_CHUNKS`] chunks, each one GEMM of a strided batch (a weight gradient is a small
/// matrix, one or a few output tiles: one GEMM over all `M` would run on that many SMs or CUs),
/// its f32 partial sums then added in f64.
pub(crate) fn chunk_rows(m: usize) -> usize {
    m.div_ceil(WEIGHT_CHUNKS).max(1)
}

/// Target chunks of a weight gradient's sum (about one per SM of an H100; not tuned for AMD GPUs).
pub(crate) const WEIGHT_CHUNKS: usize = 128;

/// What a kept backward block is laid out for: B, N, C, H, F, the formulation and the I/O
/// precision (16-bit I/O keeps smaller intermediates; gpumode's adds an f32 dy), everything the
/// layout's bytes follow from.
pub(crate) type BackwardSizes = (usize, usize, usize, usize, usize, Formulation, Precision);

/// The sizes of `problem`'s backward block.
pub(crate) fn backward_sizes(problem: &crate::problem::Problem) -> BackwardSizes {
    let cfg = problem.config;
    (problem.shape.batch, problem.shape.n, cfg.c, cfg.h, cfg.fused_proj_width(), cfg.formulation, problem.io)
}

/// `run` on the block a backward's buffers live in when the caller gives no workspace: the one
/// `kept` from the last backward when it was made for the same `sizes`, else a new one from
/// `alloc` (the other freed first, so that it does not count against the new). The block is
/// kept again whatever `run` returns.
pub(crate) fn in_kept_block<B, T>(
    kept: &mut Option<(BackwardSizes, B)>,
    sizes: BackwardSizes,
    alloc: impl FnOnce() -> crate::error::Result<B>,
    run: impl FnOnce(&B) -> crate::error::Result<T>,
) -> crate::error::Result<T> {
    let block = match kept.take() {
        Some((k, block)) if k == sizes => block,
        other => {
            drop(other);
            alloc()?
        }
    };
    let out = run(&block);
    *kept = Some((sizes, block));
    out
}

/// Positions per tile of CUDA's fused output side (`BO_BM` of `cuda/backward_output.cu`).
pub(crate) const OUTPUT_SIDE_ROWS: usize = 64;

/// Dynamic shared memory of CUDA's fused output side (`BO_SMEM`): Wz `[128][136]` and four
/// `[64][136]` tiles in 16 bits, then `(2 + 8)·64 + 8 + 8·96 + 4·128` floats (112160 bytes; the
/// kernel's `static_assert` holds the same number).
pub(crate) const OUTPUT_SIDE_SMEM: usize =
    (128 + 4 * OUTPUT_SIDE_ROWS) * 136 * 2 + (10 * OUTPUT_SIDE_ROWS + 8 + 8 * 96 + 4 * 128) * 4;

/// Positions per tile of CUDA's 16-byte-vector gating kernels (`BG_BM` of
/// `cuda/backward_gating.cu`).
pub(crate) const GATING_VEC_ROWS: usize = 64;

/// Dynamic shared memory of those kernels (`BG_SMEM`): two `[64][65]` float tiles (33280 bytes;
/// the kernel's `static_assert` holds the same number).
pub(crate) const GATING_VEC_SMEM: usize = 2 * 64 * (GATING_VEC_ROWS + 1) * 4;

/// Dynamic shared memory of `backward_input_norm_grad` (`TM_BWD_ACC_SMEM`): per-warp sums of
/// `2w` columns.
pub(crate) fn acc_smem(w: usize) -> usize {
    WARPS * 2 * w * 4
}

/// Dynamic shared memory of `backward_output_norm_grad` (`TM_BWD_T_ACC_SMEM`): a tile of t and
/// the sums (`backward_output_norm` needs less: the tile alone).
pub(crate) fn output_norm_grad_smem(h: usize) -> usize {
    h * (TILE + 1) * 4 + acc_smem(h)
}

/// `TmBackwardParams` of `common/backward.h`, field for field.
#[repr(C)]
#[derive(Copy, Clone, Default)]
pub(crate) struct BackwardParams {
    pub(crate) x: u64,
    pub(crate) dy: u64,
    pub(crate) mask: u64,
    pub(crate) norm_in_w: u64,
    pub(crate) norm_in_b: u64,
    pub(crate) norm_out_w: u64,
    pub(crate) norm_out_b: u64,
    pub(crate) proj_bias: u64,
    pub(crate) out_bias: u64,
    pub(crate) z: u64,
    pub(crate) z_bf16: u64,
    pub(crate) stats_x: u64,
    pub(crate) p: u64,
    pub(crate) left: u64,
    pub(crate) right: u64,
    pub(crate) t: u64,
    pub(crate) u: u64,
    pub(crate) left_bf16: u64,
    pub(crate) right_bf16: u64,
    pub(crate) stats_t: u64,
    pub(crate) e: u64,
    pub(crate) du: u64,
    pub(crate) dcat: u64,
    pub(crate) dz: u64,
    pub(crate) dx: u64,
    pub(crate) partial: u64,
    pub(crate) rows: i64,
    pub(crate) n2: i64,
    pub(crate) c: i32,
    pub(crate) h: i32,
    pub(crate) f: i32,
    pub(crate) af3: i32,
    pub(crate) eps: f32,
    pub(crate) blocks: i32,
    /// x's, dy's and dx's precision ([`io_code`]); with 16-bit I/O, z, P, left, right and t are
    /// f16, dt and dcat bf16 (`common/backward.h`).
    pub(crate) io: i32,
    pub(crate) pad: i32,
    /// The prepared f16 output projection `[C, H]` (the fused output side reads it).
    pub(crate) w_out: u64,
}

/// The kernels' code (`TM_IO_F32`, `TM_IO_BF16`, `TM_IO_F16`) of a precision.
pub(crate) fn io_code(p: Precision) -> i32 {
    match p {
        Precision::F32Io => 0,
        Precision::Bf16Io => 1,
        Precision::F16Io => 2,
    }
}

/// Bytes of one element of z, P, left, right, t, dt and dcat (`TM_BWD_F`, `TM_BWD_G`): f32 with
/// f32 I/O, 16-bit (f16 or bf16) with 16-bit I/O.
pub(crate) fn mid_bytes(p: Precision) -> usize {
    p.io_bytes()
}

/// `TmColumnSums`.
#[repr(C)]
#[derive(Copy, Clone)]
pub(crate) struct ColumnSums {
    pub(crate) a: u64,
    pub(crate) partial: u64,
    pub(crate) out: u64,
    pub(crate) rows: i64,
    pub(crate) cols: i32,
    pub(crate) ld: i32,
    pub(crate) row_blocks: i32,
    /// `a`'s precision ([`io_code`]).
    pub(crate) dtype: i32,
}

/// `TmConvert`.
#[repr(C)]
#[derive(Copy, Clone)]
pub(crate) struct Convert {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) n: i64,
    /// The precisions ([`io_code`]) of `src` and `dst`.
    pub(crate) from: i32,
    pub(crate) to: i32,
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    /// `slots` names, in order, exactly the ranges `gradients` reads for each tensor.
    #[test]
    fn slots_are_where_gradients_reads_each_weight() {
        for (c, h, g, biases) in [(8, 4, 8, [true; 6]), (6, 10, 10, [false, true, false, false, true, false])] {
            let out = Outputs::new(c, h, 4 * h + g);
            let sums: Vec<f32> = (0..out.len).map(|i| i as f32).collect();
            let grads = out.gradients(&sums, biases, c, h);
            let from_slots: Vec<Vec<f32>> =
                out.slots(biases, c, h).into_iter().flatten().map(|(at, n)| sums[at..at + n].to_vec()).collect();
            let tensors: Vec<Vec<f32>> = grads.tensors()[1..].iter().map(|(_, t)| t.to_vec()).collect();
            assert_eq!(from_slots, tensors, "C = {c}, H = {h}, biases {biases:?}");
            // The names, in the same order, of the weights the layer has.
            let names: Vec<String> = grads.tensors()[1..].iter().map(|(n, _)| n.clone()).collect();
            let slots = out.slots(biases, c, h);
            let want: Vec<&str> =
                WEIGHT_NAMES.iter().zip(slots).filter(|(_, s)| s.is_some()).map(|(n, _)| *n).collect();
            assert_eq!(names, want);
        }
    }
    use std::mem::{offset_of, size_of};
    use std::process::{Command, Stdio};

    use super::*;

    /// The Rust mirrors of `TmBackwardParams`, `TmColumnSums` and `TmConvert` equal the C structs
    /// field by field, and the geometry and shared-memory sizes the launches use equal the
    /// kernels' macros: a host clang checks `static_assert`s of every offset and size against
    /// `common/backward.h`, compiled with the CPU emulation's portability layer
    /// (`tests/hip_emu/emu.h`; the structs hold only pointers, 64- and 32-bit integers and floats,
    /// laid out alike by nvcc, hipcc and the host compiler). A test that cannot find clang prints
    /// `SKIPPED`, or fails under `TRIMUL_REQUIRE_HIP_CLANG` (CI).
    #[test]
    fn kernel_argument_structs_equal_their_rust_mirrors() {
        macro_rules! fields {
            ($c:literal, $t:ty, $($f:ident),*) => { vec![$(($c, stringify!($f), offset_of!($t, $f))),*] };
        }
        let mut v = fields! {
            "TmBackwardParams", BackwardParams, x, dy, mask, norm_in_w, norm_in_b, norm_out_w, norm_out_b,
            proj_bias, out_bias, z, z_bf16, stats_x, p, left, right, t, u, left_bf16, right_bf16, stats_t, e, du, dcat, dz, dx, partial, rows,
            n2, c, h, f, af3, eps, blocks, io, w_out
        };
        v.extend(fields! { "TmColumnSums", ColumnSums, a, partial, out, rows, cols, ld, row_blocks, dtype });
        v.extend(fields! { "TmConvert", Convert, src, dst, n, from, to });
        let mut src = String::from("#include \"tests/hip_emu/emu.h\"\n#include \"common/backward.h\"\n");
        for (st, f, off) in v {
            src += &format!("static_assert(__builtin_offsetof({st}, {f}) == {off}, \"{st}::{f}\");\n");
        }
        // The launch geometry and shared-memory sizes the Rust side uses, against the macros.
        for (mac, v) in [
            ("TM_BWD_THREADS", THREADS as usize),
            ("TM_BWD_TILE", TILE),
            ("TM_BWD_WARPS", WARPS),
            ("TM_BWD_ROWS_PER_BLOCK", ROWS_PER_BLOCK),
            ("TM_BWD_GATING_SMEM", GATING_SMEM as usize),
            ("TM_BWD_PARTIALS_SMEM", PARTIALS_SMEM as usize),
            ("TM_BWD_ACC_SMEM(40)", acc_smem(40)),
            ("TM_BWD_T_ACC_SMEM(24)", output_norm_grad_smem(24)),
        ] {
            src += &format!("static_assert({mac} == {v}, \"{mac}\");\n");
        }
        for (st, size) in [
            ("TmBackwardParams", size_of::<BackwardParams>()),
            ("TmColumnSums", size_of::<ColumnSums>()),
            ("TmConvert", size_of::<Convert>()),
        ] {
            src += &format!("static_assert(sizeof({st}) == {size}, \"{st} size\");\n");
        }
        let cxx = std::env::var_os("TRIMUL_HOST_CXX").map(std::path::PathBuf::from).or_else(|| {
            ["clang++-19", "clang++"].into_iter().map(std::path::PathBuf::from).find(|c| {
                Command::new(c)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
        });
        let Some(cxx) = cxx else {
            assert!(
                std::env::var_os("TRIMUL_REQUIRE_HIP_CLANG").is_none(),
                "TRIMUL_REQUIRE_HIP_CLANG is set but no clang++"
            );
            let _ =
                writeln!(std::io::stderr(), "SKIPPED: no host clang++ to check the backward's kernel argument structs");
            return;
        };
        let dir = std::env::temp_dir().join(format!("trimul-bwd-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("layout.cpp");
        std::fs::write(&file, src).unwrap();
        let root = env!("CARGO_MANIFEST_DIR");
        let out = Command::new(&cxx).args(["-std=c++20", "-fsyntax-only", "-I", root]).arg(&file).output().unwrap();
        assert!(
            out.status.success(),
            "the kernels' structs differ from the Rust mirrors:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
