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

/// `1` uses the MFMA output kernel without validating it, `0` forbids it; unset (or `auto`), it
/// is used where this device's verdict says so ([`OutputRule::ByVerdict`], `crate::validation`).
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

/// Dynamic LDS of `input_projection` for C channels: z `[64][C + 4]` f16 (`TM_HIP_IP_SMEM`).
pub fn input_projection_smem_bytes(c: usize) -> usize {
    crate::backend::params::geometry::TM_HIP_IP_SMEM(c)
}

/// How the output path of a layer is chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputRule {
    /// Settled without a verdict: by the setting, or because the MFMA kernel cannot take the
    /// arch or H. The string says why (for `info`).
    Fixed(HipKernelOutput, String),
    /// The MFMA kernel can run here and nothing forces a choice: it is used only where this
    /// device's verdict says it passed validation and won (`crate::validation`).
    ByVerdict,
}

/// The rule for `arch` and hidden width `h`; `env` is the value of [`MFMA_ENV`], if set.
/// `1` forces the MFMA kernel where it can run at all (a user's explicit choice, unvalidated).
pub fn output_rule(arch: &str, h: usize, env: Option<&str>) -> OutputRule {
    let forced = match env.map(str::trim) {
        Some("1") | Some("on") | Some("true") => true,
        Some("0") | Some("off") | Some("false") => {
            return OutputRule::Fixed(HipKernelOutput::Blas, format!("{MFMA_ENV}={}", env.unwrap_or_default()));
        }
        _ => false,
    };
    if !has_mfma(arch) {
        return OutputRule::Fixed(HipKernelOutput::Blas, format!("{arch} has no MFMA instructions"));
    }
    if h % 8 != 0 {
        return OutputRule::Fixed(HipKernelOutput::Blas, format!("H = {h} is not a multiple of 8 (MFMA K step)"));
    }
    if output_projection_smem_bytes(h) > LDS_BYTES {
        return OutputRule::Fixed(
            HipKernelOutput::Blas,
            format!("H = {h} needs more than 64 KiB of LDS in the MFMA kernel"),
        );
    }
    if forced {
        return OutputRule::Fixed(HipKernelOutput::Mfma, format!("{MFMA_ENV}=1: used without validation"));
    }
    OutputRule::ByVerdict
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
            OutputRule::Fixed(o, _) => Some(o),
            OutputRule::ByVerdict => None,
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
        assert!(output_projection_smem_bytes(248) <= LDS_BYTES && output_projection_smem_bytes(256) > LDS_BYTES);
        // H = 128: 16896 + 512 + 16896 bytes.
        assert_eq!(output_projection_smem_bytes(128), 34304);
    }
}
