//! The HIP kernels embedded by `build.rs`, and the choice of what to load for a device.
//!
//! Each stage (`hip/<stage>.hip`) is embedded twice over: as linked code objects (ELF, `ET_DYN`,
//! loadable by `hipModuleLoadData`) for every arch `build.rs` compiled it for (gfx942 and gfx90a
//! when a clang with the AMDGPU target was found), and always as include-expanded source for
//! hipRTC. For a device, [`select`] returns the prebuilt object for its processor if there is one,
//! otherwise the source to compile with hipRTC; [`HipKernelOutput`] chooses how the output stage
//! runs.

#![forbid(unsafe_code)]

use super::arch::{has_mfma, normalize_arch};
use crate::error::{Error, Result};

pub use crate::kernels::{EmbeddedHipStage, HIP_BUILD, HIP_STAGES};

/// Stage names, as in `hip/`.
pub const INPUT_NORM: &str = "input_norm";
pub const INPUT_GATING: &str = "input_gating";
pub const OUTPUT_NORM: &str = "output_norm";
pub const OUTPUT_GATE: &str = "output_gate";
/// Weight preparation from device tensors (`common/prepare_weights.h`).
pub const PREPARE_WEIGHTS: &str = "prepare_weights";
/// The fused MFMA output stage (CDNA only).
pub const OUTPUT_PROJECTION: &str = "output_projection";
/// The fused MFMA input stage (CDNA only): LN_C, the input projections and the gating.
pub const INPUT_PROJECTION: &str = "input_projection";

/// Stages that use matrix-core builtins and exist only for [`has_mfma`] archs.
pub fn needs_mfma(stage: &str) -> bool {
    stage == OUTPUT_PROJECTION || stage == INPUT_PROJECTION
}

/// Set to `1` to compile the embedded sources with hipRTC even when a code object exists (to
/// check the hipRTC path on a machine that has prebuilt objects).
pub const FORCE_RTC_ENV: &str = "TRIMUL_HIP_FORCE_RTC";

/// What to load for one stage on one device.
#[derive(Debug, PartialEq, Eq)]
pub enum KernelImage {
    /// A code object compiled ahead of time for this processor.
    Prebuilt { stage: &'static str, arch: String, code: &'static [u8] },
    /// Source to compile at run time with hipRTC, with the options to pass.
    Compile { stage: &'static str, arch: String, source: &'static str, options: Vec<String> },
}

/// hipRTC options for `arch`: the same flags `build.rs` gives clang.
pub fn rtc_options(arch: &str) -> Vec<String> {
    vec![format!("--offload-arch={arch}"), "-O3".to_string(), "-std=c++17".to_string()]
}

/// Chooses the image of `stage` for the device whose arch (target id) is `device_arch`.
/// `rtc` says whether hipRTC can be used (`Err` carries why not, for the error message);
/// `force_rtc` prefers hipRTC over prebuilt objects.
pub fn select(
    stages: &'static [EmbeddedHipStage],
    stage: &str,
    device_arch: &str,
    rtc: std::result::Result<(), String>,
    force_rtc: bool,
) -> Result<KernelImage> {
    let arch = normalize_arch(device_arch).ok_or_else(|| Error::NoKernels {
        arch: device_arch.to_string(),
        reason: "not an AMD GPU target id (expected gfx…)".to_string(),
    })?;
    let embedded = stages.iter().find(|s| s.name == stage).ok_or_else(|| Error::NoKernels {
        arch: arch.clone(),
        reason: format!("stage {stage} is not embedded in this build"),
    })?;
    if needs_mfma(stage) && !has_mfma(&arch) {
        return Err(Error::NoKernels {
            arch,
            reason: format!("{stage} needs MFMA matrix instructions (CDNA: gfx908, gfx90a, gfx94x, gfx950)"),
        });
    }
    let prebuilt = embedded.code_objects.iter().find(|(a, _)| *a == arch).map(|(_, code)| *code);
    match (prebuilt, rtc) {
        (Some(code), Err(_)) => Ok(KernelImage::Prebuilt { stage: embedded.name, arch, code }),
        (Some(code), Ok(())) if !force_rtc => Ok(KernelImage::Prebuilt { stage: embedded.name, arch, code }),
        (_, Ok(())) => Ok(KernelImage::Compile {
            stage: embedded.name,
            options: rtc_options(&arch),
            arch,
            source: embedded.source,
        }),
        (None, Err(why)) => {
            let built: Vec<&str> = embedded.code_objects.iter().map(|(a, _)| *a).collect();
            Err(Error::NoKernels {
                arch,
                reason: format!(
                    "this build has code objects for [{}] only, and hipRTC is unavailable: {why}",
                    built.join(", ")
                ),
            })
        }
    }
}

/// How the output stage (LN_H, gate, output projection) runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HipKernelOutput {
    /// `output_norm` + rocBLAS `gemm_ex` (+ bias GEMM + `output_gate` for af3).
    Blas,
    /// The fused MFMA kernel `output_projection`.
    Mfma,
}

/// `1` uses the MFMA kernels (the fused input and output stages) without validating them, `0`
/// forbids them; unset (or `auto`), each is used where this device's verdict says so ([`PathRule::ByVerdict`], `crate::validation`).
pub const MFMA_ENV: &str = "TRIMUL_HIP_MFMA";

/// Positions per block of `output_projection` (`hip/output_projection.h`; it runs
/// [`crate::backend::params::STAGE_THREADS`] threads per block, as every stage does).
pub const OUTPUT_PROJECTION_ROWS: usize = crate::backend::params::geometry::TM_HIP_OP_ROWS;
/// LDS per workgroup on gfx90a and gfx942.
pub const LDS_BYTES: usize = 64 * 1024;

/// Dynamic LDS of `output_projection` for hidden width `h`: the f16 A tile `[64][h+4]`, mean and
/// rstd `[64]` f32 each, and the f16 t tile `[h][64+2]` (`TM_HIP_OP_SMEM` in `common/smem.h`).
pub fn output_projection_smem_bytes(h: usize) -> usize {
    crate::backend::params::geometry::TM_HIP_OP_SMEM(h)
}

/// Positions per block of `input_projection` (`hip/input_projection.h`, 256 threads).
pub const INPUT_PROJECTION_ROWS: usize = crate::backend::params::geometry::TM_HIP_IP_ROWS;

/// Channels of a hidden work item, and columns of a gate work item, of `input_projection`.
pub const INPUT_PROJECTION_TILE: usize = 32;

/// `input_projection`'s work items for H hidden channels and G gate columns: hidden tiles
/// `0 .. hidden`, then gate tiles `hidden .. hidden + gate` (a launch runs a range of them).
pub fn input_projection_items(h: usize, g: usize) -> (usize, usize) {
    (h.div_ceil(INPUT_PROJECTION_TILE), g.div_ceil(INPUT_PROJECTION_TILE))
}

/// Dynamic LDS of `input_projection` for C channels: z `[64][C + 4]` f16 (`TM_HIP_IP_SMEM`).
pub fn input_projection_smem_bytes(c: usize) -> usize {
    crate::backend::params::geometry::TM_HIP_IP_SMEM(c)
}

/// How a layer chooses between an MFMA fast path and its portable counterpart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathRule {
    /// Settled without a verdict: by the setting, or because the MFMA kernel cannot take the
    /// arch or the shape. `on`: the MFMA kernel runs. `why` says why (for `info`).
    Fixed { on: bool, why: String },
    /// The MFMA kernel can run here and nothing forces a choice: it is used only where this
    /// device's verdict says it passed validation and won (`crate::validation`).
    ByVerdict,
}

/// `TRIMUL_HIP_MFMA` as a choice: `Some(true)` forced on, `Some(false)` off, `None` the verdicts.
fn forced(env: Option<&str>) -> Option<bool> {
    match env.map(str::trim) {
        Some("1") | Some("on") | Some("true") => Some(true),
        Some("0") | Some("off") | Some("false") => Some(false),
        _ => None,
    }
}

/// The rule once the kernel's own limits (`limit`: why it cannot run, if it cannot) are known.
fn rule(arch: &str, env: Option<&str>, limit: Option<String>) -> PathRule {
    let fixed = |on: bool, why: String| PathRule::Fixed { on, why };
    match forced(env) {
        Some(false) => return fixed(false, format!("{MFMA_ENV}={}", env.unwrap_or_default())),
        _ if !has_mfma(arch) => return fixed(false, format!("{arch} has no MFMA instructions")),
        _ => {}
    }
    if let Some(why) = limit {
        return fixed(false, why);
    }
    match forced(env) {
        Some(true) => fixed(true, format!("{MFMA_ENV}=1: used without validation")),
        _ => PathRule::ByVerdict,
    }
}

/// Why the MFMA `kernel` cannot take the width `dim = v`, if it cannot: `v` must be a multiple
/// of `step` (for `reason`), and the LDS the kernel needs at `v` (`smem`) must fit.
fn width_limit(
    dim: &str,
    v: usize,
    step: usize,
    reason: &str,
    smem: fn(usize) -> usize,
    kernel: &str,
) -> Option<String> {
    if v % step != 0 {
        Some(format!("{dim} = {v} is not a multiple of {step} ({reason})"))
    } else if smem(v) > LDS_BYTES {
        Some(format!("{dim} = {v} needs more than 64 KiB of LDS in the MFMA {kernel} kernel"))
    } else {
        None
    }
}

/// The output stage's rule for `arch` and hidden width `h`; `env` is the value of [`MFMA_ENV`].
/// `1` forces the MFMA kernel where it can run at all (a user's explicit choice, unvalidated).
pub fn output_rule(arch: &str, h: usize, env: Option<&str>) -> PathRule {
    rule(arch, env, width_limit("H", h, 8, "MFMA K step", output_projection_smem_bytes, "output"))
}

/// The input stage's rule (the fused `input_projection` against `input_norm` + rocBLAS +
/// `input_gating`) for `arch` and C channels. It serves one-pass and chunked plans (a hidden
/// pass runs its channels' work items, the output stage's gate pass the gate's).
pub fn input_rule(arch: &str, c: usize, env: Option<&str>) -> PathRule {
    rule(arch, env, width_limit("C", c, 4, "8-byte operand loads", input_projection_smem_bytes, "input"))
}

/// The HIP backend's fast paths: MFMA kernels that replace portable stages once validated.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum HipFastPath {
    /// `output_projection`: LN_H, gate and output projection in one kernel, in place of
    /// `output_norm` + rocBLAS + `output_gate`.
    OutputProjection,
    /// `input_projection`: LN_C, the input projections and the gating in one kernel, in place of
    /// `input_norm` + rocBLAS + `input_gating` (one-pass plans).
    InputProjection,
}

impl HipFastPath {
    /// Every fast path.
    pub const ALL: [HipFastPath; 2] = [HipFastPath::InputProjection, HipFastPath::OutputProjection];

    /// The name verdicts and `info` use.
    pub fn name(self) -> &'static str {
        match self {
            HipFastPath::OutputProjection => "output_projection (MFMA)",
            HipFastPath::InputProjection => "input_projection (MFMA)",
        }
    }

    /// The rule for a layer of C and H on `arch` with the setting `env`.
    pub(crate) fn rule(self, arch: &str, c: usize, h: usize, env: Option<&str>) -> PathRule {
        match self {
            HipFastPath::OutputProjection => output_rule(arch, h, env),
            HipFastPath::InputProjection => input_rule(arch, c, env),
        }
    }
}

impl std::fmt::Display for HipFastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static FAKE: &[EmbeddedHipStage] = &[
        EmbeddedHipStage {
            name: "input_norm",
            source: "src-in",
            code_objects: &[("gfx942", b"co-942"), ("gfx90a", b"co-90a")],
        },
        EmbeddedHipStage { name: "output_projection", source: "src-op", code_objects: &[("gfx942", b"op-942")] },
    ];

    fn code(img: &KernelImage) -> &'static [u8] {
        match img {
            KernelImage::Prebuilt { code, .. } => code,
            other => panic!("expected a prebuilt object, got {other:?}"),
        }
    }

    #[test]
    fn prebuilt_objects_by_processor() {
        let no_rtc = || Err("libhiprtc missing".to_string());
        assert_eq!(code(&select(FAKE, "input_norm", "gfx942", no_rtc(), false).unwrap()), b"co-942");
        assert_eq!(code(&select(FAKE, "input_norm", "gfx942:sramecc+:xnack-", no_rtc(), false).unwrap()), b"co-942");
        assert_eq!(code(&select(FAKE, "input_norm", "gfx90a:xnack+", Ok(()), false).unwrap()), b"co-90a");
        // force_rtc with hipRTC present compiles; without hipRTC it still uses the object.
        assert!(matches!(select(FAKE, "input_norm", "gfx942", Ok(()), true).unwrap(), KernelImage::Compile { .. }));
        assert_eq!(code(&select(FAKE, "input_norm", "gfx942", no_rtc(), true).unwrap()), b"co-942");
    }

    #[test]
    fn other_archs_compile_or_fail_clearly() {
        match select(FAKE, "input_norm", "gfx1100", Ok(()), false).unwrap() {
            KernelImage::Compile { arch, source, options, .. } => {
                assert_eq!((arch.as_str(), source), ("gfx1100", "src-in"));
                assert!(options.contains(&"--offload-arch=gfx1100".to_string()), "{options:?}");
            }
            other => panic!("{other:?}"),
        }
        let e = select(FAKE, "input_norm", "gfx1100", Err("libhiprtc.so: not found".into()), false).unwrap_err();
        assert!(matches!(e, Error::NoKernels { .. }));
        let msg = e.to_string();
        assert!(msg.contains("gfx1100") && msg.contains("gfx942, gfx90a") && msg.contains("libhiprtc.so"), "{msg}");
        // MFMA stage: never for an arch without matrix cores, even with hipRTC.
        let e = select(FAKE, "output_projection", "gfx1100", Ok(()), false).unwrap_err().to_string();
        assert!(e.contains("MFMA"), "{e}");
        // gfx90a has MFMA but no object in FAKE: hipRTC.
        assert!(matches!(
            select(FAKE, "output_projection", "gfx90a", Ok(()), false).unwrap(),
            KernelImage::Compile { .. }
        ));
        assert!(select(FAKE, "nonexistent", "gfx942", Ok(()), false).is_err());
        assert!(select(FAKE, "input_norm", "sm_90", Ok(()), false).is_err());
    }

    #[test]
    fn output_path_choice() {
        use HipKernelOutput::*;
        // Default until validated on hardware: rocBLAS.
        let fixed = |arch, h, env| match output_rule(arch, h, env) {
            PathRule::Fixed { on, .. } => Some(if on { Mfma } else { Blas }),
            PathRule::ByVerdict => None,
        };
        assert_eq!(fixed("gfx942", 128, None), None, "left to the verdict");
        assert_eq!(fixed("gfx942", 128, Some("auto")), None, "left to the verdict");
        assert_eq!(fixed("gfx942", 128, Some("1")), Some(Mfma));
        assert_eq!(fixed("gfx90a", 128, Some("1")), Some(Mfma));
        assert_eq!(fixed("gfx942", 128, Some("0")), Some(Blas));
        assert_eq!(fixed("gfx1100", 128, Some("1")), Some(Blas));
        assert_eq!(fixed("gfx1100", 128, None), Some(Blas), "no MFMA: nothing to validate");
        assert_eq!(fixed("gfx942", 100, Some("1")), Some(Blas));
        assert_eq!(fixed("gfx942", 100, None), Some(Blas));
        assert_eq!(fixed("gfx942", 248, Some("1")), Some(Mfma));
        assert_eq!(fixed("gfx942", 256, Some("1")), Some(Blas));
        let input = |arch, c, env| match input_rule(arch, c, env) {
            PathRule::Fixed { on, .. } => Some(on),
            PathRule::ByVerdict => None,
        };
        assert_eq!(input("gfx942", 128, None), None);
        assert_eq!(input("gfx942", 508, Some("1")), Some(true));
        assert_eq!(input("gfx942", 512, Some("1")), Some(false), "LDS");
        assert_eq!(input("gfx942", 42, None), Some(false), "C % 4");
        assert_eq!(input("gfx942", 128, Some("0")), Some(false));
        assert_eq!(input("gfx1100", 128, Some("1")), Some(false));
        assert!(output_projection_smem_bytes(248) <= LDS_BYTES && output_projection_smem_bytes(256) > LDS_BYTES);
        // H = 128: 16896 + 512 + 16896 bytes.
        assert_eq!(output_projection_smem_bytes(128), 34304);
    }
}
