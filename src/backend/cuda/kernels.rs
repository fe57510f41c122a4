//! Loading the embedded stage kernels and launching them.
//!
//! Each stage is a fatbin built by nvcc at build time (sm_80, sm_90a, compute_80 PTX); the driver
//! picks the matching machine code or JIT-compiles the PTX. When the build had no nvcc, or the
//! fatbin does not load on this device, the embedded source is compiled once with NVRTC for the
//! device's own arch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{self, CUfunction, CUstream};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::driver::{nvrtc_missing, nvrtc_present, DriverResult};
use super::launch_graph::{self, KernelShape, Launch};
use crate::backend::backward_steps::BackwardKernel;
use crate::backend::params::StageParams;
use crate::error::{Error, Result};
use crate::kernels::{find, EmbeddedStage, CUDA_STAGES};

/// The portable stages, loaded, and the fused kernels where the GPU has them.
pub(crate) struct Kernels {
    pub input_norm: Stage,
    pub input_gating: Stage,
    pub output_norm: Stage,
    pub output_gate: Stage,
    /// Weight preparation from device tensors (`common/prepare_weights.h`).
    pub prepare_weights: Stage,
    /// The fused LN + projection + gating kernel (sm_80+), with the dynamic shared memory
    /// limit raised to the device's opt-in maximum; `None` on older GPUs.
    pub input_projection: Option<Stage>,
    /// The same kernel compiled for one block per SM with uncapped registers (wide C).
    pub input_projection_wide: Option<Stage>,
    /// Both builds again with Hopper's warpgroup MMA (`wgmma`, sm_90a machine code); `None`
    /// on every other GPU.
    pub input_projection_sm90: Option<Stage>,
    pub input_projection_sm90_wide: Option<Stage>,
    /// The wgmma build in 64-position blocks, two per SM, for 128 < padded C ≤ 448.
    pub input_projection_sm90_mid: Option<Stage>,
    /// The wgmma build in 64-position blocks, three per SM, for padded C ≤ 128.
    pub input_projection_sm90_narrow64: Option<Stage>,
    /// The warp-specialised persistent wgmma build (C = H = 128, one block of 1024 threads per
    /// SM, weights resident).
    pub input_projection_sm90_ws: Option<Stage>,
    /// Its register-operand form for 16-bit x without the gate chunk (three warpgroups, z in
    /// registers as the wgmma A operand).
    pub input_projection_sm90_rs: Option<Stage>,
    /// LN_H + gate + output projection in one kernel (`cuda/output_projection.cu`); sm_80+.
    pub output_projection: Option<Stage>,
    /// Its resident form: Wout loaded once per block, blocks walking tiles with the next tile's
    /// t prefetched (H = 128, C ≤ 128, either formulation, any y precision).
    pub output_projection_resident: Option<Stage>,
    /// af3's output stage making the output gate from x (wgmma, sm_90a; 16-bit x, C = H = 128):
    /// the input stage then writes no gate.
    pub output_projection_sm90_xgate: Option<Stage>,
    /// The backward pass's kernels (`common/backward.h`).
    pub backward: BackwardKernels,
    /// Whether the fused kernels are launched as programmatic dependents of the kernel before
    /// them ([`Stage::launch_dependent`]): sm_90, unless `TRIMUL_CUDA_PDL=0`.
    pub pdl: bool,
    /// Largest dynamic shared memory a block may use (bytes).
    pub max_smem: usize,
    /// Where the loaded kernels came from, in words ("all 25 kernels prebuilt (nvcc fatbin)" on
    /// an H100, or which ones NVRTC compiled at run time), for `trimul info` ([`describe_origin`]).
    pub origin: String,
}

/// The entry points of the `backward` and `backward_output` stages, in
/// [`BackwardKernel::cuda_entries`]' order. Those with
/// a large tile ([`BackwardKernel::large_smem`]) have their shared-memory limit raised to the
/// opt-in maximum.
pub(crate) struct BackwardKernels(Vec<Stage>);

impl BackwardKernels {
    /// The entry point of one step's kernel (its 16-bit one when `sixteen`).
    pub(crate) fn stage(&self, kernel: BackwardKernel, sixteen: bool) -> &Stage {
        &self.0[kernel.index(sixteen)]
    }
}

pub(crate) struct Stage {
    // Keeps the module loaded for as long as the function is used.
    func: CudaFunction,
    raw: CUfunction,
}

// SAFETY: a CUfunction handle is immutable and valid on any thread with its context bound.
unsafe impl Send for Stage {}
// SAFETY: see above.
unsafe impl Sync for Stage {}

fn arch_flag(cc: (i32, i32)) -> String {
    // sm_90a unlocks Hopper-only instructions; the plain arch is right everywhere else.
    match cc {
        (9, 0) => "sm_90a".to_string(),
        (10, 0) => "sm_100a".to_string(),
        (ma, mi) => format!("sm_{ma}{mi}"),
    }
}

/// How one kernel was obtained: `None` from the prebuilt fatbin, `Some(arch)` compiled at run time
/// by NVRTC for `arch`.
type Origin = (String, Option<String>);

/// The kernels' origins in one plain line: all prebuilt, all compiled at run time, or which.
fn describe_origin(origin: &[Origin]) -> String {
    let n = origin.len();
    let prebuilt = origin.iter().filter(|(_, arch)| arch.is_none()).count();
    let mut archs: Vec<&str> = origin.iter().filter_map(|(_, a)| a.as_deref()).collect();
    archs.dedup();
    let nvrtc = format!("compiled at run time by NVRTC for {}", archs.join(", "));
    if prebuilt == n {
        format!("all {n} kernels prebuilt (nvcc fatbin)")
    } else if prebuilt == 0 {
        format!("all {n} kernels {nvrtc}")
    } else {
        let compiled: Vec<&str> = origin.iter().filter(|(_, a)| a.is_some()).map(|(e, _)| e.as_str()).collect();
        format!("{prebuilt} of {n} kernels prebuilt (nvcc fatbin), {} {nvrtc}: {}", n - prebuilt, compiled.join(", "))
    }
}

fn load_stage(
    ctx: &Arc<CudaContext>,
    stage: &EmbeddedStage,
    entry: &str,
    cc: (i32, i32),
    origin: &mut Vec<Origin>,
) -> Result<Stage> {
    let from_binary = stage
        .binary
        .and_then(|bin| ctx.load_module(Ptx::from_binary(bin.to_vec())).ok())
        .and_then(|m| m.load_function(entry).ok());
    let func = match from_binary {
        Some(f) => {
            origin.push((entry.to_string(), None));
            f
        }
        None => {
            if !nvrtc_present() {
                return Err(nvrtc_missing());
            }
            let arch = arch_flag(cc);
            let opts = CompileOptions {
                // `arch` is `&'static str` in cudarc's options; a handful of distinct strings per process.
                arch: Some(Box::leak(arch.clone().into_boxed_str())),
                options: vec!["-std=c++17".into(), "-default-device".into()],
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(stage.source, opts)
                .map_err(|e| Error::NoKernels { arch: arch.clone(), reason: format!("NVRTC on {entry}: {e:?}") })?;
            let module = ctx.load_module(ptx).ctx("cuModuleLoadData (NVRTC output)")?;
            origin.push((entry.to_string(), Some(arch)));
            module.load_function(entry).ctx("cuModuleGetFunction")?
        }
    };
    let raw = func.cu_function();
    Ok(Stage { func, raw })
}

impl Kernels {
    pub(crate) fn load(ctx: &Arc<CudaContext>, cc: (i32, i32)) -> Result<Self> {
        let mut origin = Vec::new();
        // `name` is the stage (file) and, unless given as `file:entry`, the kernel entry point.
        let mut get = |name: &str| -> Result<Stage> {
            let (file, entry) = name.split_once(':').unwrap_or((name, name));
            let stage = find(CUDA_STAGES, file).ok_or_else(|| Error::NoKernels {
                arch: arch_flag(cc),
                reason: format!("stage {file} not embedded"),
            })?;
            load_stage(ctx, stage, entry, cc, &mut origin)
        };
        let optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .ctx("cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")? as usize;
        let raise = |stage: Stage| -> Result<Stage> {
            // SAFETY: `stage.raw` is a live function of a loaded module; the attribute takes a
            // byte count no larger than the device's opt-in limit.
            unsafe {
                cu::function::set_function_attribute(
                    stage.raw,
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    optin as i32,
                )
            }
            .ctx("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")?;
            Ok(stage)
        };
        let mut backward = Vec::new();
        for (k, sixteen) in BackwardKernel::cuda_entries() {
            let stage = get(&format!("{}:{}", k.stage(), k.entry_name(sixteen)))?;
            backward.push(if k.large_smem() { raise(stage)? } else { stage });
        }
        let backward = BackwardKernels(backward);
        let k = Kernels {
            backward,
            input_norm: get("input_norm")?,
            input_gating: get("input_gating")?,
            output_norm: get("output_norm")?,
            output_gate: get("output_gate")?,
            prepare_weights: get("prepare_weights")?,
            input_projection: None,
            input_projection_wide: None,
            input_projection_sm90: None,
            input_projection_sm90_wide: None,
            input_projection_sm90_mid: None,
            input_projection_sm90_narrow64: None,
            input_projection_sm90_ws: None,
            input_projection_sm90_rs: None,
            output_projection: None,
            output_projection_resident: None,
            output_projection_sm90_xgate: None,
            pdl: false,
            max_smem: 48 * 1024,
            origin: String::new(),
        };
        let mut big_smem = |name: &str| -> Result<Option<Stage>> {
            if cc.0 < 8 {
                return Ok(None);
            }
            Ok(Some(raise(get(name)?)?))
        };
        let input_projection = big_smem("input_projection")?;
        let input_projection_wide = big_smem("input_projection:input_projection_wide")?;
        let output_projection = big_smem("output_projection")?;
        let output_projection_resident = big_smem("output_projection:output_projection_resident")?;
        let output_projection_sm90_xgate =
            if cc == (9, 0) { big_smem("output_projection:output_projection_sm90_xgate")? } else { None };
        // wgmma exists only in sm_90a code: the fatbin's sm_90a image, or NVRTC for sm_90a.
        let mut sm90 = |entry: &str| {
            if cc == (9, 0) {
                big_smem(&format!("input_projection:input_projection_sm90{entry}"))
            } else {
                Ok(None)
            }
        };
        let input_projection_sm90 = sm90("")?;
        let input_projection_sm90_wide = sm90("_wide")?;
        let input_projection_sm90_mid = sm90("_mid")?;
        let input_projection_sm90_narrow64 = sm90("_narrow64")?;
        let input_projection_sm90_ws = sm90("_ws")?;
        let input_projection_sm90_rs = sm90("_rs")?;
        let k = Kernels {
            input_projection,
            input_projection_wide,
            input_projection_sm90,
            input_projection_sm90_wide,
            input_projection_sm90_mid,
            input_projection_sm90_narrow64,
            input_projection_sm90_ws,
            input_projection_sm90_rs,
            output_projection,
            output_projection_resident,
            output_projection_sm90_xgate,
            // Hopper only: there the kernels come from the sm_90a image (or NVRTC for the device),
            // both built with pdl_wait(). Newer GPUs would JIT the compute_80 PTX, which has no
            // wait, so launching those early would race. `TRIMUL_CUDA_PDL=0` launches them as
            // plain stream successors, to compare.
            pdl: cc == (9, 0) && std::env::var("TRIMUL_CUDA_PDL").map_or(true, |v| v.trim() != "0"),
            max_smem: optin,
            ..k
        };
        Ok(Kernels { origin: describe_origin(&origin), ..k })
    }
}

impl Stage {
    /// Launches the stage with `params` by value.
    ///
    /// # Safety
    /// `P` is the struct the stage declares (`TmInputParams` for the input stage's kernels,
    /// `TmOutputParams` for the output stage's); every pointer in `params` that the stage
    /// dereferences must be a live device allocation of the size the params' shape implies, until
    /// the stream has run the kernel.
    pub(crate) unsafe fn launch<P: StageParams>(
        &self,
        grid: u32,
        block: u32,
        smem: u32,
        stream: CUstream,
        params: &P,
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.launch_dependent(grid, block, smem, stream, params, false) }
    }

    /// [`Stage::launch`], as a programmatic dependent of the kernel before it in `stream` when
    /// `pdl` is set (sm_90+): its blocks may start as that kernel's blocks exit, and run what
    /// comes before `pdl_wait()` in the kernel (the weights' loads; `cuda/mma.h` says what is
    /// allowed there) under that kernel's tail. `pdl` only for kernels that call `pdl_wait()`
    /// before touching anything another kernel writes or reads.
    ///
    /// # Safety
    /// As [`Stage::launch`].
    pub(crate) unsafe fn launch_dependent<P: StageParams>(
        &self,
        grid: u32,
        block: u32,
        smem: u32,
        stream: CUstream,
        params: &P,
        pdl: bool,
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract: P is the stage's parameter struct.
        unsafe { self.launch_with(grid, block, smem, stream, params, pdl) }
    }

    /// [`Stage::launch_dependent`] for a kernel whose one argument is a `P` by value (a
    /// `#[repr(C)]` mirror of the kernel's parameter struct, e.g. `PrepareParams`).
    ///
    /// # Safety
    /// As [`Stage::launch`], and `P` is the struct the kernel declares.
    pub(crate) unsafe fn launch_with<P: Copy>(
        &self,
        grid: u32,
        block: u32,
        smem: u32,
        stream: CUstream,
        params: &P,
        pdl: bool,
    ) -> Result<()> {
        if grid == 0 {
            return Ok(());
        }
        let recorded = || {
            let shape = KernelShape { func: self.raw as usize, grid, block, smem, pdl };
            Launch::Kernel { shape, args: launch_graph::args_of(params) }
        };
        if !launch_graph::note(recorded) {
            return Ok(());
        }
        let _keep = &self.func;
        let mut p = *params;
        let mut args = [&mut p as *mut P as *mut c_void];
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream,
            attrs: &mut attr,
            // Without the attribute this is a plain launch (cuLaunchKernel's semantics).
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `config` and `attr` outlive the call, which copies them; the one argument is a
        // `P` by value as the kernel declares (this function's contract), its pointers valid per
        // that contract; the function handle belongs to a module kept loaded by `self.func`.
        unsafe { sys::cuLaunchKernelEx(&config, self.raw, args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .ctx("cuLaunchKernelEx")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_in_words() {
        let pre = |e: &str| (e.to_string(), None);
        let rtc = |e: &str| (e.to_string(), Some("sm_90a".to_string()));
        assert_eq!(describe_origin(&[pre("a"), pre("b")]), "all 2 kernels prebuilt (nvcc fatbin)");
        assert_eq!(describe_origin(&[rtc("a"), rtc("b")]), "all 2 kernels compiled at run time by NVRTC for sm_90a");
        assert_eq!(
            describe_origin(&[pre("a"), rtc("b")]),
            "1 of 2 kernels prebuilt (nvcc fatbin), 1 compiled at run time by NVRTC for sm_90a: b"
        );
    }
}
