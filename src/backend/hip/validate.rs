//! The MFMA kernels proved on this device before layers use them (`crate::validation`).
//!
//! No AMD GPU has run `output_projection` or `input_projection`. So where such a kernel can run
//! (a CDNA arch, a shape within its limits) and no setting forces a choice, a layer prepared from
//! host weights asks for this device's verdict on the kernel for its C and H: from memory, from
//! the verdict file, or by running the validation now. A validation runs five small forwards on
//! the fast path (both formulations, both directions, masks, biases, f32 and 16-bit x and y,
//! Cauchy inputs, odd N and B > 1; one in the narrowest chunked plan) against the f64 reference with every element checked, then
//! times the fast path against its portable counterpart on one shape (B = 1, N =
//! [`validation::timing_n`], the layer's C and H) with device events, alternating them. The
//! input kernel is validated with the rocBLAS output stage (and, for 16-bit x and y, which that
//! stage cannot write, with the MFMA output kernel where it can run; else those cases are left
//! out). Weights prepared on the device take a verdict that exists and the portable path
//! otherwise: they may be prepared inside a graph capture, where nothing may allocate or wait.

use super::context::{poisoned, HipBackend, HipPrepared, Stages, POISON_BYTE};
use super::kernels::{self, HipFastPath, HipKernelOutput, PathRule};
use super::result::{DeviceMem, Timer};
use crate::backend::Backend;
use crate::device_io::{DeviceIo, ForwardIo};
use crate::error::{Error, Result};
use crate::problem::{Config, Direction, Formulation, Precision, Problem};
use crate::reference;
use crate::suite::{self, Case, Dist};
use crate::validation::{self, CaseOutcome, Verdict, VerdictKey};
use crate::weights::Weights;

/// One validation case: formulation, biases, B, N, masked, direction, I/O precision, inputs,
/// and whether it runs the narrowest chunked plan (hidden passes and row chunks: the kernels'
/// windowed launches) instead of the one-pass plan.
type ValidationCase = (Formulation, bool, usize, usize, bool, Direction, Precision, Dist, bool);

/// The validation cases.
const CASES: [ValidationCase; 5] = [
    (Formulation::Af3, true, 1, 19, true, Direction::Outgoing, Precision::F32Io, Dist::Normal, false),
    (Formulation::Af3, true, 2, 9, false, Direction::Incoming, Precision::Bf16Io, Dist::Normal, false),
    (Formulation::GpuMode, false, 1, 16, true, Direction::Incoming, Precision::F32Io, Dist::Cauchy, false),
    (Formulation::GpuMode, false, 1, 11, false, Direction::Outgoing, Precision::F16Io, Dist::Normal, false),
    (Formulation::Af3, true, 2, 13, true, Direction::Outgoing, Precision::F32Io, Dist::Normal, true),
];

impl HipBackend {
    /// The stages a layer of `config` runs: each fast path fixed by the setting or the hardware,
    /// else its verdict's. `may_validate`: run a validation where no verdict exists (host
    /// preparation); otherwise (device preparation, maybe under a capture) no verdict means the
    /// portable path.
    pub(super) fn stages_for(&self, config: &Config, may_validate: bool) -> Result<Stages> {
        let on = |path| self.path_on(path, config.c, config.h, may_validate);
        let fused_input = on(HipFastPath::InputProjection)?;
        let output = if on(HipFastPath::OutputProjection)? { HipKernelOutput::Mfma } else { HipKernelOutput::Blas };
        Ok(Stages { fused_input, output })
    }

    fn path_on(&self, path: HipFastPath, c: usize, h: usize, may_validate: bool) -> Result<bool> {
        match path.rule(&self.ctx.arch, c, h, self.mfma_setting().as_deref()) {
            PathRule::Fixed { on, .. } => Ok(on),
            PathRule::ByVerdict => {
                let verdict = match self.verdict(path, c, h)? {
                    Some(v) => Some(v),
                    None if may_validate => Some(self.validate(path, c, h)?),
                    None => None,
                };
                Ok(verdict.is_some_and(|v| v.used))
            }
        }
    }

    /// Makes sure layers of C and H on this device can follow verdicts: for each fast path left
    /// to one, validates now where none exists. Returns those verdicts (none where settings or
    /// the hardware settle every path). For callers whose own preparation runs on the device (the
    /// Python package calls this when a layer is first made outside a graph capture); a layer
    /// prepared from host weights does this itself.
    pub fn ensure_verdicts(&self, c: usize, h: usize) -> Result<Vec<Verdict>> {
        let mut out = Vec::new();
        for path in HipFastPath::ALL {
            if let PathRule::ByVerdict = path.rule(&self.ctx.arch, c, h, self.mfma_setting().as_deref()) {
                let v = match self.verdict(path, c, h)? {
                    Some(v) => v,
                    None => self.validate(path, c, h)?,
                };
                // Loaded now, outside any capture: weights prepared on the device later (maybe
                // under one) then find the kernel ready instead of loading a module there.
                if v.used {
                    match path {
                        HipFastPath::InputProjection => self.mfma_input_kernel()?,
                        HipFastPath::OutputProjection => self.mfma_kernel()?,
                    };
                }
                out.push(v);
            }
        }
        Ok(out)
    }

    /// What this device knows about `path` for C and H, without running anything: the verdict
    /// made or read before in this process, else the verdict file's.
    pub fn verdict(&self, path: HipFastPath, c: usize, h: usize) -> Result<Option<Verdict>> {
        if let Some(known) = self.ctx.verdicts.lock().map_err(poisoned)?.get(&(path, c, h)) {
            return Ok(known.clone());
        }
        // The file is read once per path, C and H: a layer prepared on the device on every call
        // (weights being trained) must not read it each time. Absence is remembered too.
        let found = self.ctx.store.load(&self.key(path, c, h));
        // A verdict another thread made meanwhile wins over the file's.
        Ok(self.ctx.verdicts.lock().map_err(poisoned)?.entry((path, c, h)).or_insert(found).clone())
    }

    /// Validates `path` for C and H on this device now (again, if a verdict exists), keeps the
    /// verdict for this process and writes it to the verdict file. Layers prepared afterwards
    /// follow it. A path that cannot run here (no MFMA, a shape past its limits) is an error
    /// naming why.
    pub fn validate(&self, path: HipFastPath, c: usize, h: usize) -> Result<Verdict> {
        if let PathRule::Fixed { why, .. } = path.rule(&self.ctx.arch, c, h, None) {
            return Err(Error::InvalidArgument(format!("{path} cannot run here: {why}")));
        }
        let key = self.key(path, c, h);
        // A kernel that has never run here may take the process down (a memory fault aborts a
        // ROCm process) or hang it. So a verdict against it is written first and replaced when
        // the run ends: a process that dies in the validation leaves the kernel out of the next
        // ones, instead of each dying the same way. `trimul tune --backend hip` tries again.
        let pending = Verdict::not_run(
            key.clone(),
            format!(
                "a validation started by process {} did not finish (the process ended during it: a fault or a hang \
                 in the kernel?); `trimul tune --backend hip` runs it again",
                std::process::id()
            ),
        );
        // A file that cannot be written costs only a validation in the next process.
        let save = |v: &Verdict| {
            if let Err(e) = self.ctx.store.save(v) {
                eprintln!("trimul: {e}");
            }
        };
        save(&pending);
        let verdict = match self.run_validation(path, c, h) {
            Ok(v) => {
                save(&v);
                v
            }
            // A run that failed with an error (memory refused, a launch that failed) is a verdict
            // against the kernel for this process; it is not kept in the file, so a transient
            // failure is not remembered.
            Err(e) => {
                if let Err(e) = self.ctx.store.remove(&key) {
                    eprintln!("trimul: {e}");
                }
                Verdict::not_run(key, format!("the validation run failed: {e}"))
            }
        };
        self.ctx.verdicts.lock().map_err(poisoned)?.insert((path, c, h), Some(verdict.clone()));
        Ok(verdict)
    }

    /// The verdicts that hold for this device as it is now (the verdict file's and this
    /// process's): those made with this driver, rocBLAS, kernel build and trimul.
    pub fn verdicts(&self) -> Vec<Verdict> {
        let now: Vec<VerdictKey> = HipFastPath::ALL.iter().map(|&p| self.key(p, 0, 0)).collect();
        let holds = |v: &Verdict| now.iter().any(|k| VerdictKey { class: k.class.clone(), ..v.key.clone() } == *k);
        let mut all: Vec<Verdict> = self.ctx.store.all().into_iter().filter(holds).collect();
        if let Ok(known) = self.ctx.verdicts.lock() {
            for v in known.values().flatten() {
                if !all.iter().any(|w| w.key == v.key) {
                    all.push(v.clone());
                }
            }
        }
        all.sort_by(|a, b| (&a.key.path, &a.key.class, a.when).cmp(&(&b.key.path, &b.key.class, b.when)));
        all
    }

    /// Lines for [`Backend::info`]: each verdict that holds here.
    pub(super) fn verdict_lines(&self) -> Vec<(String, String)> {
        self.verdicts()
            .into_iter()
            .map(|v| {
                let verdict = if v.used { "used" } else { "not used" };
                (format!("{}, {}", v.key.path, v.key.class), format!("{verdict}: {}", v.reason))
            })
            .collect()
    }

    /// What a verdict depends on: the device, driver, rocBLAS, the kernel's bytes and trimul.
    fn key(&self, path: HipFastPath, c: usize, h: usize) -> VerdictKey {
        let version = |name: &str| {
            self.ctx.info.versions.iter().find(|(k, _)| k == name).map_or_else(String::new, |(_, v)| v.clone())
        };
        let arch = self.ctx.arch.as_str();
        let options = kernels::rtc_options(arch).join(" ");
        // The code objects that load here, or the sources hipRTC compiles, with their options: the
        // input kernel's validation runs its 16-bit cases with the output kernel, so its verdict
        // depends on both.
        let stages: &[&str] = match path {
            HipFastPath::OutputProjection => &[kernels::OUTPUT_PROJECTION],
            HipFastPath::InputProjection => &[kernels::INPUT_PROJECTION, kernels::OUTPUT_PROJECTION],
        };
        let mut parts: Vec<&[u8]> = vec![options.as_bytes()];
        for name in stages {
            let stage = crate::kernels::HIP_STAGES.iter().find(|s| s.name == *name);
            let object = stage.and_then(|s| s.code_objects.iter().find(|(a, _)| *a == arch).map(|(_, code)| *code));
            parts.push(stage.map_or(&b""[..], |s| s.source.as_bytes()));
            parts.push(if self.ctx.force_rtc { b"" } else { object.unwrap_or(b"") });
        }
        let kernel = validation::fingerprint(&parts);
        VerdictKey {
            backend: "hip".into(),
            device: self.ctx.info.name.clone(),
            target: self.ctx.target_id.clone(),
            driver: version("HIP driver"),
            library: format!("rocBLAS {}", version("rocBLAS")),
            path: path.name().into(),
            kernel,
            class: format!("C={c} H={h}"),
            // The host code around the kernels changes between commits of one version.
            trimul: format!("{} {}", env!("CARGO_PKG_VERSION"), option_env!("TRIMUL_GIT_COMMIT").unwrap_or("unknown")),
            procedure: format!("v{} N={}", validation::PROCEDURE_VERSION, validation::timing_n()),
        }
    }

    /// The stages a validation of `path` runs with the fast path on (`fast`) or off, for I/O
    /// precision `io` (`None`: that precision cannot be validated here).
    fn validation_stages(&self, path: HipFastPath, h: usize, io: Precision, fast: bool) -> Option<Stages> {
        match path {
            HipFastPath::OutputProjection => Some(Stages {
                fused_input: false,
                output: if fast { HipKernelOutput::Mfma } else { HipKernelOutput::Blas },
            }),
            HipFastPath::InputProjection => {
                // rocBLAS's output GEMM writes f32 y: 16-bit y needs the MFMA output kernel.
                let output = if io == Precision::F32Io {
                    HipKernelOutput::Blas
                } else if matches!(kernels::output_rule(&self.ctx.arch, h, None), PathRule::ByVerdict) {
                    HipKernelOutput::Mfma
                } else {
                    return None;
                };
                Some(Stages { fused_input: fast, output })
            }
        }
    }

    fn run_validation(&self, path: HipFastPath, c: usize, h: usize) -> Result<Verdict> {
        let mut cases = Vec::new();
        for (i, &(formulation, biases, b, n, masked, dir, io, dist, chunked)) in CASES.iter().enumerate() {
            let Some(stages) = self.validation_stages(path, h, io, true) else { continue };
            let config = Config::new(formulation, c, h)?;
            let case = Case { batch: b, n, c, h, masked, dist };
            let seed = 0x7A11_DA7E ^ (i as u64) ^ ((c as u64) << 20) ^ ((h as u64) << 40);
            let weights = Weights::random(config, biases, seed)?;
            let inputs = suite::generate_inputs(&case, seed ^ 0x5EED);
            let problem = Problem::new(config, case.shape(), dir, masked)?.with_io(io);
            let prepared = self.prepare_as(&weights, stages)?;
            let (x, y) = self.forward_checked(&prepared, &problem, &inputs.x, inputs.mask.as_deref(), chunked)?;
            let cmp = reference::check(
                &weights,
                &problem,
                &x,
                inputs.mask.as_deref(),
                &y,
                validation::RTOL,
                validation::ATOL,
            )?;
            cases.push(CaseOutcome {
                case: format!(
                    "{formulation}{} b{b} n{n} {} {dir} {io} {dist}{}",
                    if biases { " biases" } else { "" },
                    if masked { "mask" } else { "nomask" },
                    if chunked { " chunked" } else { "" }
                ),
                passed: cmp.passed() && cmp.rel_l2 <= validation::MAX_REL_L2,
                bad: cmp.bad,
                checked: cmp.checked,
                rel_l2: cmp.rel_l2,
            });
        }
        let n = validation::timing_n();
        let timed_shape = format!("af3 B=1 N={n} C={c} H={h} f32-io");
        let (fast, baseline) = if cases.iter().all(|c| c.passed) {
            let (f, b) = self.time_paths(path, c, h, n)?;
            (Some(f), Some(b))
        } else {
            (None, None)
        };
        Ok(Verdict::decide(self.key(path, c, h), cases, fast, baseline, timed_shape))
    }

    /// One forward of `problem` on device copies of x (rounded to the problem's I/O precision)
    /// and the mask, y poisoned with NaN first, in the one-pass plan or the narrowest chunked one.
    /// Returns x as the layer read it and y, as f32.
    fn forward_checked(
        &self,
        prepared: &HipPrepared,
        problem: &Problem,
        x: &[f32],
        mask: Option<&[f32]>,
        chunked: bool,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let io = problem.io;
        let stream = &self.ctx.stream;
        // 16-bit x and y as their words, which the layer reads and writes where they lie.
        let bits: Vec<u16> =
            if io == Precision::F32Io { Vec::new() } else { x.iter().map(|&v| io.encode_half(v)).collect() };
        let (x, xd) = if io == Precision::F32Io {
            (x.to_vec(), self.upload_plain(x)?)
        } else {
            (bits.iter().map(|&b| io.decode_half(b)).collect(), self.upload_plain(&bits)?)
        };
        let md = mask.map(|m| self.upload_plain(m)).transpose()?;
        let yd = self.alloc_mem(x.len() * io.io_bytes())?;
        // SAFETY: our own stream and allocation.
        unsafe { yd.memset(stream.raw(), POISON_BYTE)? };
        let mut ws = if chunked {
            self.narrowest_workspace(prepared, problem)?
        } else {
            self.one_pass_workspace(prepared, problem)?
        };
        let dio = DeviceIo {
            x: xd.addr(),
            mask: md.as_ref().map(DeviceMem::addr),
            y: yd.addr(),
            shape: problem.shape,
            io,
            stream: self.stream() as u64,
            workspace: None,
        };
        // SAFETY: x, the mask and y are live allocations of this device holding the problem's
        // elements in `io` (the mask in f32), y aliasing neither; the download below waits for
        // the stream before they are freed.
        self.forward(prepared, &mut ws, problem, unsafe { ForwardIo::device(&dio) })?;
        let y = if io == Precision::F32Io {
            let mut y = vec![0f32; x.len()];
            yd.download(stream, 0, &mut y)?;
            y
        } else {
            let mut words = vec![0u16; x.len()];
            yd.download(stream, 0, &mut words)?;
            words.into_iter().map(|b| io.decode_half(b)).collect()
        };
        Ok((x, y))
    }

    /// Median forward milliseconds with `path` on and off at B = 1, N = `n` (af3 with biases,
    /// unmasked, f32 x and y): warm-ups, then the two alternated.
    fn time_paths(&self, path: HipFastPath, c: usize, h: usize, n: usize) -> Result<(f64, f64)> {
        let config = Config::new(Formulation::Af3, c, h)?;
        let case = Case { batch: 1, n, c, h, masked: false, dist: Dist::Normal };
        let weights = Weights::random(config, true, 0x7131_0000 ^ n as u64)?;
        let x = suite::generate_inputs(&case, 0x7131).x;
        let problem = Problem::new(config, case.shape(), Direction::Outgoing, false)?;
        let xd = self.upload_plain(&x)?;
        let yd = self.alloc_mem(std::mem::size_of_val(x.as_slice()))?;
        let mut runs = Vec::new();
        for fast in [true, false] {
            let stages = self
                .validation_stages(path, h, Precision::F32Io, fast)
                .ok_or_else(|| Error::Internal("no f32 stages to time".into()))?;
            let prepared = self.prepare_as(&weights, stages)?;
            let ws = self.one_pass_workspace(&prepared, &problem)?;
            runs.push((prepared, ws, Vec::new()));
        }
        let dio = DeviceIo {
            x: xd.addr(),
            mask: None,
            y: yd.addr(),
            shape: problem.shape,
            io: Precision::F32Io,
            stream: self.stream() as u64,
            workspace: None,
        };
        let timer = Timer::new(self.ctx.api)?;
        for round in 0..validation::TIMING_WARMUP + validation::TIMING_REPEATS {
            for (prepared, ws, times) in runs.iter_mut() {
                timer.start(&self.ctx.stream)?;
                // SAFETY: x and y are live allocations of this device of the problem's elements in
                // f32, not aliasing; `elapsed_ms` waits for the stream before they are freed.
                self.forward(prepared, ws, &problem, unsafe { ForwardIo::device(&dio) })?;
                timer.stop(&self.ctx.stream)?;
                let ms = timer.elapsed_ms()?;
                if round >= validation::TIMING_WARMUP {
                    times.push(ms);
                }
            }
        }
        let median = |t: &mut Vec<f64>| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        Ok((median(&mut runs[0].2), median(&mut runs[1].2)))
    }
}

impl HipBackend {
    /// A one-pass workspace for `problem`, or an error: the validation checks and times the
    /// one-pass plan, which the free memory must allow.
    fn one_pass_workspace(&self, prepared: &HipPrepared, problem: &Problem) -> Result<<Self as Backend>::Workspace> {
        let ws = self.workspace(prepared, problem, None)?;
        if !ws.is_one_pass() {
            return Err(Error::InvalidArgument(format!(
                "the validation needs a one-pass workspace for {:?} and the free memory allows only a chunked one",
                problem.shape
            )));
        }
        Ok(ws)
    }
}
