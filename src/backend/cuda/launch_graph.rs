//! A one-pass forward's launches replayed from a CUDA graph: one `cuGraphLaunch` on the caller's
//! stream instead of two or three kernel launches and cuBLASLt's host path, which is most of a
//! small forward's host time (an N = 256 forward from PyTorch spends more time enqueuing than the
//! GPU spends running it).
//!
//! How: a forward first runs its launch code with the launches *recorded* instead of made
//! ([`run_in`] [`Mode::Record`]: [`super::kernels::Stage`] and [`super::blas::MatmulPlan`]
//! consult [`note`]).
//! The record's [`Shape`] (each kernel's function, grid, block, shared memory and programmatic
//! flag, each GEMM's plan and every address it takes) is what a graph captured from the same code
//! bakes in. Where the workspace's [`GraphCache`] holds a graph of that shape, the recorded
//! kernels' parameter structs (x, the mask, y, the weights: everything that changes from call to
//! call) are written into its kernel nodes (`cuGraphExecKernelNodeSetParams`, which affects only
//! later launches) and the graph is launched. A shape seen on two calls in a row is captured on a
//! private stream from the same launch code, recorded again as it is captured, and kept only if
//! that record has the same shape and the graph holds nothing but kernel, memset and empty nodes
//! (no event, copy or host nodes); any other call runs the launches as they are. So a graph
//! never replays a GEMM whose addresses moved, and a kernel node always gets this call's
//! arguments.
//!
//! Not used while the caller's stream is itself being captured (the caller's graph gets the
//! launches), with poisoning or stage timing on, or when the backend's switch is off
//! ([`super::CudaBackend::set_launch_graphs`]). A capture or replay that fails (another thread
//! synchronising the device meanwhile, say) leaves the call to run its launches as they are, and
//! that shape is not captured again for the next [`RETRY_AFTER`] calls.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::{
    self, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUgraphNodeType, CUstream, CUstreamCaptureMode,
    CUstreamCaptureStatus,
};

use super::driver::DriverResult;
use crate::error::{Error, Result};

/// One launch of a forward, as recorded.
#[derive(Clone, Debug)]
pub(super) enum Launch {
    /// A kernel of ours: its launch, and its one by-value argument's bytes (in 8-byte words so
    /// that the driver reads them from an aligned address).
    Kernel { shape: KernelShape, args: Vec<MaybeUninit<u64>> },
    /// A cuBLASLt GEMM: everything about it is part of the shape.
    Gemm(GemmShape),
}

/// What a captured kernel node fixes: the function and the launch geometry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct KernelShape {
    pub(super) func: usize,
    pub(super) grid: u32,
    pub(super) block: u32,
    pub(super) smem: u32,
    pub(super) pdl: bool,
}

/// What a captured cuBLASLt call fixes: the plan (by its unique id) and every address.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct GemmShape {
    pub(super) plan: u64,
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) d: u64,
    pub(super) bias: u64,
    pub(super) workspace: u64,
    pub(super) workspace_len: usize,
}

/// A record's shape: what must match for a captured graph to serve a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Step {
    Kernel(KernelShape),
    Gemm(GemmShape),
}

pub(super) type Shape = Vec<Step>;

/// What this thread's kernel launches and GEMMs do ([`mode`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Launch (no graph involved).
    Launch,
    /// Record, launch nothing: the pass that decides what a forward does with a graph.
    Record,
    /// Record and launch: a capture, whose record is checked against the first.
    Capture,
    /// Launch, after a [`Mode::Record`] pass of the same forward decided against a graph.
    Again,
}

impl Mode {
    /// Whether a launch made in this mode counts as the forward's (the backend's launch
    /// counters): the plain launches and the record pass count, a capture or the launches made
    /// again after a record pass do not, so a forward counts once whatever path it takes.
    pub(super) fn counts(self) -> bool {
        matches!(self, Mode::Launch | Mode::Record)
    }

    fn records(self) -> bool {
        matches!(self, Mode::Record | Mode::Capture)
    }
}

thread_local! {
    static MODE: Cell<Mode> = const { Cell::new(Mode::Launch) };
    static RECORD: RefCell<Vec<Launch>> = const { RefCell::new(Vec::new()) };
}

/// This thread's launch mode.
pub(super) fn mode() -> Mode {
    MODE.with(Cell::get)
}

/// Adds one to a backend's launch counter where this thread's mode counts ([`Mode::counts`]).
pub(super) fn count(counter: &AtomicU64) {
    if mode().counts() {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Adds a launch to this thread's record where the mode records (else nothing); returns whether
/// the launch is to be made.
pub(super) fn note(launch: impl FnOnce() -> Launch) -> bool {
    let m = mode();
    if m.records() {
        let l = launch();
        RECORD.with(|r| r.borrow_mut().push(l));
    }
    m != Mode::Record
}

/// The bytes of a kernel's by-value argument, as [`Launch::Kernel`] keeps them (padding bytes
/// included, which is why they stay `MaybeUninit`).
pub(super) fn args_of<P: Copy>(params: &P) -> Vec<MaybeUninit<u64>> {
    let size = std::mem::size_of::<P>();
    let mut words = vec![MaybeUninit::new(0u64); size.div_ceil(8)];
    // SAFETY: `words` holds at least `size` bytes and is never read as integers; `P: Copy` is
    // plain data (the kernels' `#[repr(C)]` parameter structs), copied here as bytes.
    unsafe { std::ptr::copy_nonoverlapping(params as *const P as *const u8, words.as_mut_ptr() as *mut u8, size) };
    words
}

/// Runs `launches` in `mode` ([`Mode::Record`], [`Mode::Capture`] or [`Mode::Again`]) and
/// returns what it recorded (nothing for [`Mode::Again`]); the error of `launches` if it
/// failed. The thread is back in [`Mode::Launch`] afterwards, also after a panic.
pub(super) fn run_in(mode: Mode, launches: impl FnOnce() -> Result<()>) -> Result<Vec<Launch>> {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            MODE.with(|m| m.set(Mode::Launch));
            RECORD.with(|r| r.borrow_mut().clear());
        }
    }
    // A nested pass would put the outer one back in `Launch` when it ends: a record pass would
    // then really launch. Refused (release builds too), without touching the outer pass.
    if self::mode() != Mode::Launch {
        return Err(Error::Internal(format!("a {mode:?} pass inside a {:?} pass", self::mode())));
    }
    RECORD.with(|r| r.borrow_mut().clear());
    MODE.with(|m| m.set(mode));
    let restore = Restore;
    launches()?;
    let record = RECORD.with(|r| std::mem::take(&mut *r.borrow_mut()));
    drop(restore);
    Ok(record)
}

/// The shape of a record.
pub(super) fn shape_of(record: &[Launch]) -> Shape {
    record
        .iter()
        .map(|l| match l {
            Launch::Kernel { shape, .. } => Step::Kernel(*shape),
            Launch::Gemm(g) => Step::Gemm(*g),
        })
        .collect()
}

/// Whether `stream` is being captured into a graph (by the caller).
pub(super) fn is_capturing(stream: CUstream) -> Result<bool> {
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a query on a live stream (the caller's, by the forward's contract) writing one
    // plain value.
    unsafe { sys::cuStreamIsCapturing(stream, &mut status) }.result().ctx("cuStreamIsCapturing")?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// An instantiated graph of one shape, with its kernel nodes in the record's kernel order.
pub(super) struct LaunchGraph {
    shape: Shape,
    exec: CUgraphExec,
    /// The captured graph, kept while the exec lives: its node handles name the exec's nodes.
    graph: CUgraph,
    nodes: Vec<CUgraphNode>,
}

// SAFETY: a graph exec is a driver handle usable from any thread; writing its nodes' arguments
// and launching it take `&mut self`, so one thread at a time does.
unsafe impl Send for LaunchGraph {}
// SAFETY: a shared reference reads only `shape`: every driver call on the exec takes `&mut self`.
unsafe impl Sync for LaunchGraph {}

impl Drop for LaunchGraph {
    fn drop(&mut self) {
        // SAFETY: instantiated once in `capture`, destroyed once, then the graph it came from;
        // the driver keeps launched work alive until it has run.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

impl LaunchGraph {
    /// Writes `record`'s kernel arguments into the graph's kernel nodes and launches it on
    /// `stream`.
    ///
    /// # Safety
    /// `record` has this graph's shape and was made for this call: every address its kernels'
    /// arguments and its GEMMs hold is live until `stream` has run the work, as for the launches
    /// themselves.
    pub(super) unsafe fn launch(&mut self, record: &[Launch], stream: CUstream) -> Result<()> {
        let kernels = record.iter().filter_map(|l| match l {
            Launch::Kernel { shape, args } => Some((shape, args)),
            Launch::Gemm(_) => None,
        });
        for (&node, (shape, args)) in self.nodes.iter().zip(kernels) {
            // The driver only reads the argument bytes (kernelParams is `void**` by convention).
            let mut arg = [args.as_ptr() as *mut c_void];
            let params = node_params(shape, arg.as_mut_ptr());
            // SAFETY: a node of this exec whose function and geometry are `shape`'s (matched at
            // capture); the driver copies the argument bytes before returning.
            unsafe { sys::cuGraphExecKernelNodeSetParams_v2(self.exec, node, &params) }
                .result()
                .ctx("cuGraphExecKernelNodeSetParams")?;
        }
        // SAFETY: a live exec; its nodes' addresses are this call's (this function's contract).
        unsafe { sys::cuGraphLaunch(self.exec, stream) }.result().ctx("cuGraphLaunch")
    }
}

fn node_params(shape: &KernelShape, args: *mut *mut c_void) -> sys::CUDA_KERNEL_NODE_PARAMS {
    sys::CUDA_KERNEL_NODE_PARAMS {
        func: shape.func as CUfunction,
        gridDimX: shape.grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: shape.block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shape.smem,
        kernelParams: args,
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    }
}

/// Captures what `launches` enqueues on a private stream into a graph and instantiates it,
/// provided the launches recorded during the capture have `shape` (the record the same launch
/// code made this call) and the graph holds no event, copy, host or child-graph node.
pub(super) fn capture(shape: Shape, launches: impl FnOnce(CUstream) -> Result<()>) -> Result<LaunchGraph> {
    /// The private stream and its capture: ended (the graph destroyed) and the stream destroyed
    /// on every way out, a panic in the launch code included, so that the thread is never left
    /// capturing.
    struct Capturing {
        stream: CUstream,
        open: bool,
    }
    impl Capturing {
        fn end(&mut self) -> Result<CUgraph> {
            self.open = false;
            let mut graph: CUgraph = std::ptr::null_mut();
            // SAFETY: ends the capture begun on this stream.
            let ended = unsafe { sys::cuStreamEndCapture(self.stream, &mut graph) }.result();
            if let Err(e) = ended {
                if !graph.is_null() {
                    // SAFETY: a graph the failed capture handed back, used by nothing else.
                    let _ = unsafe { sys::cuGraphDestroy(graph) };
                }
                return Err::<CUgraph, _>(e).ctx("cuStreamEndCapture");
            }
            Ok(graph)
        }
    }
    impl Drop for Capturing {
        fn drop(&mut self) {
            if self.open {
                if let Ok(graph) = self.end() {
                    if !graph.is_null() {
                        // SAFETY: the capture's graph, used by nothing else.
                        let _ = unsafe { sys::cuGraphDestroy(graph) };
                    }
                }
            }
            // SAFETY: our stream; nothing was enqueued on it outside the capture.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: creates a stream of the current context (the forward bound it).
    unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }
        .result()
        .ctx("cuStreamCreate")?;
    let mut cap = Capturing { stream, open: false };
    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream of ours, not being captured.
    unsafe { sys::cuStreamBeginCapture_v2(stream, mode) }.result().ctx("cuStreamBeginCapture")?;
    cap.open = true;
    let recorded = run_in(Mode::Capture, || launches(stream));
    let graph = cap.end()?;
    drop(cap);
    // `graph` is the capture's: owned by the `LaunchGraph` made from it, or destroyed here.
    let made = match recorded {
        _ if graph.is_null() => return Err(Error::Internal("the forward's capture made no graph".into())),
        Err(e) => Err(e),
        Ok(r) if shape_of(&r) != shape => {
            Err(Error::Internal("the forward's launches changed between its record and its capture".into()))
        }
        // SAFETY: a live graph, the capture's.
        Ok(_) => unsafe { instantiate(graph, &shape) },
    };
    match made {
        Ok((exec, nodes)) => Ok(LaunchGraph { shape, exec, graph, nodes }),
        Err(e) => {
            // SAFETY: the capture's graph; nothing was made from it.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            Err(e)
        }
    }
}

/// Instantiates `graph` and finds the exec's node for each of `shape`'s kernels, by function
/// (each must appear once among the graph's kernel nodes). Refuses a graph with a node a forward's
/// launches and cuBLASLt do not make (events, copies, host calls, child graphs).
///
/// # Safety
/// `graph` is a live graph.
unsafe fn instantiate(graph: CUgraph, shape: &Shape) -> Result<(CUgraphExec, Vec<CUgraphNode>)> {
    let mut count = 0usize;
    // SAFETY: a count query on a live graph.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }.result().ctx("cuGraphGetNodes")?;
    let mut all = vec![std::ptr::null_mut(); count];
    // SAFETY: `all` holds `count` node handles.
    unsafe { sys::cuGraphGetNodes(graph, all.as_mut_ptr(), &mut count) }.result().ctx("cuGraphGetNodes")?;
    let mut funcs = Vec::with_capacity(count);
    for &node in &all[..count] {
        // As an integer: a newer driver may name node types these bindings' enum lacks.
        let mut ty = 0u32;
        // SAFETY: a node of `graph`; the driver writes a 32-bit enum value.
        unsafe { sys::cuGraphNodeGetType(node, &mut ty as *mut u32 as *mut CUgraphNodeType) }
            .result()
            .ctx("cuGraphNodeGetType")?;
        let is = |t: CUgraphNodeType| ty == t as u32;
        if is(CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET) || is(CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY) {
            continue;
        }
        if !is(CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) {
            return Err(Error::Internal(format!("the forward's captured graph holds a node of type {ty}")));
        }
        // SAFETY: plain data that the query overwrites.
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        // SAFETY: a kernel node of `graph`.
        unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) }.result().ctx("cuGraphKernelNodeGetParams")?;
        funcs.push((p.func as usize, node));
    }
    let mut nodes = Vec::new();
    for step in shape {
        if let Step::Kernel(k) = step {
            let mut found = funcs.iter().filter(|(f, _)| *f == k.func);
            match (found.next(), found.next()) {
                (Some(&(_, node)), None) => nodes.push(node),
                _ => return Err(Error::Internal("a kernel of the forward is not once in its captured graph".into())),
            }
        }
    }
    let mut exec: CUgraphExec = std::ptr::null_mut();
    // SAFETY: instantiates a live graph; `exec` receives the handle.
    unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result().ctx("cuGraphInstantiate")?;
    Ok((exec, nodes))
}

/// Calls after a failed capture or replay of a shape before that shape is captured again (the
/// failure may have been passing: another thread synchronising the device during the capture).
pub(super) const RETRY_AFTER: u32 = 256;

/// A workspace's launch graph, the shape last seen without one, and the shapes whose capture or
/// replay failed lately, with the calls left before each may be captured again.
#[derive(Default)]
pub(crate) struct GraphCache {
    graph: Option<LaunchGraph>,
    last: Option<Shape>,
    failed: Vec<(Shape, u32)>,
    /// The workspace's GEMM takes workspace memory, which the one-pass plan lends from y (or x
    /// in place): its graph would hold y's address, which moves from call to call, so this
    /// workspace makes its launches as they are without recording them first.
    ruled_out: bool,
}

/// What a forward does with its record.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// Launch the kept graph ([`GraphCache::graph`]) with the record's arguments.
    Replay,
    /// Capture the launches into a graph (second call in a row with this shape), then launch it.
    Capture,
    /// Make the launches as they are.
    Direct,
}

impl GraphCache {
    /// What to do for a call whose record has `shape`.
    pub(super) fn plan(&mut self, shape: &Shape) -> Plan {
        if self.graph.as_ref().is_some_and(|g| &g.shape == shape) {
            // A shape seen once between two replays is not "in a row" with its next call.
            self.last = None;
            return Plan::Replay;
        }
        for f in &mut self.failed {
            f.1 = f.1.saturating_sub(1);
        }
        self.failed.retain(|f| f.1 > 0);
        if self.failed.iter().any(|f| &f.0 == shape) {
            return Plan::Direct;
        }
        if self.last.as_ref() == Some(shape) {
            return Plan::Capture;
        }
        self.last = Some(shape.clone());
        Plan::Direct
    }

    /// Whether this workspace's forwards are not to go through graphs ([`GraphCache::rule_out`]).
    pub(super) fn ruled_out(&self) -> bool {
        self.ruled_out
    }

    /// Rules graphs out for this workspace when `record` has a GEMM that uses workspace memory
    /// (see the field's docs); returns whether it did.
    pub(super) fn rule_out(&mut self, record: &[Launch]) -> bool {
        self.ruled_out |= record.iter().any(|l| matches!(l, Launch::Gemm(g) if g.workspace_len > 0));
        self.ruled_out
    }

    /// The kept graph.
    pub(super) fn graph(&mut self) -> Option<&mut LaunchGraph> {
        self.graph.as_mut()
    }

    /// Keeps a captured graph (replacing the one before), or remembers that `shape`'s capture
    /// failed.
    pub(super) fn keep(&mut self, shape: Shape, graph: Result<LaunchGraph>) -> Option<&mut LaunchGraph> {
        self.last = None;
        match graph {
            Ok(g) => {
                self.graph = Some(g);
                self.graph.as_mut()
            }
            Err(_) => {
                if self.failed.len() >= 8 {
                    self.failed.remove(0);
                }
                self.failed.push((shape, RETRY_AFTER));
                None
            }
        }
    }

    /// Drops the graph of `shape` (its replay failed), as a failed capture.
    pub(super) fn forget(&mut self, shape: Shape) {
        self.graph = None;
        let _ = self.keep(shape, Err(Error::Internal("its replay failed".into())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(func: usize, d: u64) -> Shape {
        vec![
            Step::Kernel(KernelShape { func, grid: 2, block: 256, smem: 0, pdl: true }),
            Step::Gemm(GemmShape { plan: 1, a: 1, b: 2, d, bias: 0, workspace: 0, workspace_len: 0 }),
        ]
    }

    #[test]
    fn a_shape_is_captured_on_its_second_call_in_a_row_and_retried_long_after_a_failure() {
        let mut cache = GraphCache::default();
        let (s, t) = (shape(1, 10), shape(1, 11));
        assert_eq!(cache.plan(&s), Plan::Direct);
        assert_eq!(cache.plan(&t), Plan::Direct, "another shape restarts the count");
        assert_eq!(cache.plan(&s), Plan::Direct);
        assert_eq!(cache.plan(&s), Plan::Capture);
        assert!(cache.keep(s.clone(), Err(Error::Internal("capture failed".into()))).is_none());
        for call in 0..RETRY_AFTER {
            assert_eq!(cache.plan(&s), Plan::Direct, "call {call} after the failure");
        }
        assert_eq!(cache.plan(&s), Plan::Capture, "captured again once the failure is old");
    }

    #[test]
    fn a_shape_seen_once_between_replays_is_not_captured_on_its_next_call() {
        let mut cache = GraphCache::default();
        let (s, t) = (shape(1, 10), shape(1, 11));
        cache.graph = Some(LaunchGraph {
            shape: s.clone(),
            exec: std::ptr::null_mut(),
            graph: std::ptr::null_mut(),
            nodes: Vec::new(),
        });
        assert_eq!(cache.plan(&t), Plan::Direct);
        assert_eq!(cache.plan(&s), Plan::Replay);
        assert_eq!(cache.plan(&t), Plan::Direct, "not two calls in a row");
        assert_eq!(cache.plan(&t), Plan::Capture);
        // The kept graph's handles are not the driver's: forget it without destroying them.
        std::mem::forget(cache.graph.take());
    }

    #[test]
    fn modes_record_launch_and_count_as_they_say_and_end_in_launch() {
        let args = args_of(&[1u32, 2, 3]);
        assert_eq!(args.len(), 2);
        // SAFETY: the first 8 bytes are two initialised u32s.
        assert_eq!(unsafe { args[0].assume_init() }, 1 | (2 << 32));
        let k = KernelShape { func: 7, grid: 1, block: 32, smem: 0, pdl: false };
        let gemm = GemmShape { plan: 3, a: 1, b: 2, d: 3, bias: 0, workspace: 0, workspace_len: 0 };
        assert!(note(|| unreachable!("no record outside a recording mode")), "plain launches are made");
        assert!(mode().counts());
        for (m, launched, counts) in
            [(Mode::Record, false, true), (Mode::Capture, true, false), (Mode::Again, true, false)]
        {
            let r = run_in(m, || {
                assert_eq!(mode(), m);
                assert_eq!(mode().counts(), counts, "{m:?}");
                assert_eq!(note(|| Launch::Kernel { shape: k, args: args.clone() }), launched, "{m:?}");
                assert_eq!(note(|| Launch::Gemm(gemm)), launched, "{m:?}");
                Ok(())
            })
            .unwrap();
            assert_eq!(mode(), Mode::Launch);
            let want = if m.records() { vec![Step::Kernel(k), Step::Gemm(gemm)] } else { Vec::new() };
            assert_eq!(shape_of(&r), want, "{m:?}");
        }
        let failed = run_in(Mode::Record, || {
            note(|| Launch::Kernel { shape: k, args: Vec::new() });
            Err(Error::Internal("bad".into()))
        });
        assert!(failed.is_err());
        assert_eq!(mode(), Mode::Launch, "a failed record stops recording");
        let panicked = std::panic::catch_unwind(|| run_in(Mode::Capture, || panic!("in the launch code")));
        assert!(panicked.is_err());
        assert_eq!(mode(), Mode::Launch, "a panic stops recording");
        assert!(run_in(Mode::Record, || Ok(())).unwrap().is_empty(), "nothing left from the panicked record");
        let nested = run_in(Mode::Record, || {
            assert!(run_in(Mode::Capture, || Ok(())).is_err(), "a nested pass is refused");
            assert_eq!(mode(), Mode::Record, "and leaves the outer pass as it was");
            Ok(())
        });
        assert!(nested.is_ok());
    }
}
