//! The CPU backend's prepared weights: the layout its GEMMs read, shared by the forward and
//! the backward.

use crate::error::Result;
use crate::problem::Config;
use crate::weights::Weights;

/// Weights laid out for the CPU GEMMs.
#[derive(Clone, Debug)]
pub struct CpuPrepared {
    pub(super) config: Config,
    pub(super) norm_in_w: Vec<f32>,
    pub(super) norm_in_b: Vec<f32>,
    /// `Wcat`, `[4H + G, C]` row-major: rows are left value, left gate, right value, right gate
    /// (H each) and the output gate (G). The GEMM reads it as `Wcatᵀ` with unit row stride,
    /// the layout `gemm` packs fastest for this product (measured: ~5% over `[C, 4H+G]`).
    pub(super) w_cat: Vec<f32>,
    /// Fused projection biases `[4H + G]`; zeros where a layer has none.
    pub(super) b_cat: Vec<f32>,
    pub(super) norm_out_w: Vec<f32>,
    pub(super) norm_out_b: Vec<f32>,
    /// `Woutᵀ`, `[H, C]` row-major.
    pub(super) w_out_t: Vec<f32>,
    /// Output projection bias `[C]` (af3 `bz`); zeros when absent.
    pub(super) b_out: Vec<f32>,
    /// Which linear layers have a bias, in [`Weights::linears`] order: the backward returns a
    /// bias gradient exactly for those.
    pub(super) biases: [bool; 6],
}

impl CpuPrepared {
    /// Validates `weights` and lays them out for the CPU GEMMs.
    pub(super) fn new(weights: &Weights) -> Result<CpuPrepared> {
        weights.validate()?;
        let config = weights.config();
        let Config { c, h, .. } = config;
        let (w_cat, b_cat) = weights.fused_input()?;
        let b_cat = b_cat.unwrap_or_else(|| vec![0.0; config.fused_proj_width()]);
        let mut w_out_t = crate::hostmem::try_vec(h * c, 0.0f32, "transposed output weights")?;
        for (o, row) in weights.out_proj.weight.chunks_exact(h).enumerate() {
            for (k, &v) in row.iter().enumerate() {
                w_out_t[k * c + o] = v;
            }
        }
        Ok(CpuPrepared {
            config,
            norm_in_w: weights.norm_in.weight.clone(),
            norm_in_b: weights.norm_in.bias.clone(),
            w_cat,
            b_cat,
            norm_out_w: weights.norm_out.weight.clone(),
            norm_out_b: weights.norm_out.bias.clone(),
            w_out_t,
            b_out: weights.out_proj.bias.clone().unwrap_or_else(|| vec![0.0; c]),
            biases: weights.linears().map(|(_, l)| l.bias.is_some()),
        })
    }

    /// Bytes the prepared weights hold.
    pub(super) fn bytes(&self) -> u64 {
        let p = self;
        let floats = p.norm_in_w.len()
            + p.norm_in_b.len()
            + p.w_cat.len()
            + p.b_cat.len()
            + p.norm_out_w.len()
            + p.norm_out_b.len()
            + p.w_out_t.len()
            + p.b_out.len();
        floats as u64 * 4
    }
}
