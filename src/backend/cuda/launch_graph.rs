//! A one-pass forward's launches replayed from a CUDA graph: one `cuGraphLaunch` on the caller's
//! stream instead of two or three kernel launches and cuBLASLt's host path, which is most of a
//! small forward's host time (an N = 256 forward from PyTorch spends more time enqueuing than the
//! GPU spends running it).
//!
//! How: a forward first runs its launch code with the launches *recorded* instead of made
//! ([`record`]: [`super::kernels::Stage`] and [`super::blas::MatmulPlan`] consult [`recording`]).
//! The record's [`Shape`] (each kernel's function, grid, block, shared memory and programmatic
//! flag, each GEMM's plan and every address it takes) is what a graph captured from the same code
//! bakes in. Where the workspace's [`GraphCache`] holds a graph of that shape, the recorded
//! kernels' parameter structs (x, the mask, y, the weights: everything that changes from call to
//! call) are written into its kernel nodes (`cuGraphExecKernelNodeSetParams`, which affects only
//! later launches) and the graph is launched. A shape seen on two calls in a row is captured on a
//! private stream from the same launch code and instantiated; any other call runs the launches as
//! they are. So a graph never replays a GEMM whose addresses moved, and a kernel node always gets
//! this call's arguments.
//!
//! Not used while the caller's stream is itself being captured (the caller's graph gets the
//! launches), with poisoning or stage timing on, or when the backend's switch is off
//! ([`super::CudaBackend::set_launch_graphs`]). A capture that fails (another thread
//! synchronising the device meanwhile, say) leaves the call to run its launches as they are, and
//! that shape is not captured again.

use std::cell::RefCell;
use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUgraphNodeType, CUstream, CUstreamCaptureMode,
    CUstreamCaptureStatus,
};

use super::driver::DriverResult;
use crate::error::{Error, Result};

/// One launch of a forward, as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Launch {
    /// A kernel of ours: its launch, and its one by-value argument's bytes (in 8-byte words so
    /// that the driver reads them from an aligned address).
    Kernel { shape: KernelShape, args: Vec<u64> },
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

thread_local! {
    static RECORD: RefCell<Option<Vec<Launch>>> = const { RefCell::new(None) };
}

/// Whether this thread is recording launches instead of making them.
pub(super) fn recording() -> bool {
    RECORD.with(|r| r.borrow().is_some())
}

/// Adds a launch to this thread's record (a no-op when not recording).
pub(super) fn push(launch: Launch) {
    RECORD.with(|r| {
        if let Some(v) = r.borrow_mut().as_mut() {
            v.push(launch);
        }
    });
}

/// The bytes of a kernel's by-value argument, as [`Launch::Kernel`] keeps them.
pub(super) fn args_of<P: Copy>(params: &P) -> Vec<u64> {
    let size = std::mem::size_of::<P>();
    let mut words = vec![0u64; size.div_ceil(8)];
    // SAFETY: `words` holds at least `size` bytes; `P: Copy` is plain data (the kernels'
    // `#[repr(C)]` parameter structs), read here as bytes.
    unsafe { std::ptr::copy_nonoverlapping(params as *const P as *const u8, words.as_mut_ptr() as *mut u8, size) };
    words
}

/// Runs `launches` with every kernel launch and GEMM recorded instead of made; returns the
/// record (also when `launches` fails: the error is returned, the record dropped).
pub(super) fn record(launches: impl FnOnce() -> Result<()>) -> Result<Vec<Launch>> {
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            RECORD.with(|r| r.borrow_mut().take());
        }
    }
    RECORD.with(|r| *r.borrow_mut() = Some(Vec::new()));
    let stop = Stop;
    launches()?;
    let record = RECORD.with(|r| r.borrow_mut().take()).unwrap_or_default();
    drop(stop);
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

// SAFETY: a graph exec is a driver handle usable from any thread; the workspace that owns it is
// used by one call at a time (`&mut`).
unsafe impl Send for LaunchGraph {}
// SAFETY: shared references only read `shape`.
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
    pub(super) unsafe fn launch(&self, record: &[Launch], stream: CUstream) -> Result<()> {
        let kernels = record.iter().filter_map(|l| match l {
            Launch::Kernel { shape, args } => Some((shape, args)),
            Launch::Gemm(_) => None,
        });
        for (&node, (shape, args)) in self.nodes.iter().zip(kernels) {
            let mut words = args.clone();
            let mut arg = [words.as_mut_ptr() as *mut c_void];
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

/// Captures what `launches` enqueues on a private stream into a graph of `shape` (the shape of
/// the record those same launches made) and instantiates it.
pub(super) fn capture(shape: Shape, launches: impl FnOnce(CUstream) -> Result<()>) -> Result<LaunchGraph> {
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: creates a stream of the current context (the forward bound it).
    unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }
        .result()
        .ctx("cuStreamCreate")?;
    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream of ours, not being captured.
    let begun = unsafe { sys::cuStreamBeginCapture_v2(stream, mode) }.result().ctx("cuStreamBeginCapture");
    let graph = begun.and_then(|()| {
        let enqueued = launches(stream);
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (always, also after a failed launch).
        let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) }.result().ctx("cuStreamEndCapture");
        enqueued.and(ended).map(|()| graph).inspect_err(|_| {
            if !graph.is_null() {
                // SAFETY: a graph the capture made, used by nothing else.
                let _ = unsafe { sys::cuGraphDestroy(graph) };
            }
        })
    });
    // SAFETY: our stream; nothing was enqueued on it outside the capture.
    let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
    let graph = graph?;
    if graph.is_null() {
        return Err(Error::Internal("the forward's capture made no graph".into()));
    }
    // SAFETY: `graph` is the capture's, owned by the `LaunchGraph` made from it (or destroyed
    // here when instantiating fails).
    match unsafe { instantiate(graph, &shape) } {
        Ok((exec, nodes)) => Ok(LaunchGraph { shape, exec, graph, nodes }),
        Err(e) => {
            // SAFETY: as above; nothing was made from it.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            Err(e)
        }
    }
}

/// Instantiates `graph` and finds the exec's node for each of `shape`'s kernels, by function
/// (each must appear once among the graph's kernel nodes).
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
        let mut ty = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of `graph`.
        unsafe { sys::cuGraphNodeGetType(node, &mut ty) }.result().ctx("cuGraphNodeGetType")?;
        if ty != CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            continue;
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

/// A workspace's launch graph, the shape last seen without one, and the shapes whose capture
/// failed.
#[derive(Default)]
pub(crate) struct GraphCache {
    graph: Option<LaunchGraph>,
    last: Option<Shape>,
    failed: Vec<Shape>,
}

/// What a forward does with its record.
pub(super) enum Plan<'a> {
    /// Launch this graph with the record's arguments.
    Replay(&'a LaunchGraph),
    /// Capture the launches into a graph (second call in a row with this shape), then launch it.
    Capture,
    /// Make the launches as they are.
    Direct,
}

impl GraphCache {
    /// What to do for a call whose record has `shape`.
    pub(super) fn plan(&mut self, shape: &Shape) -> Plan<'_> {
        if self.graph.as_ref().is_some_and(|g| &g.shape == shape) {
            return Plan::Replay(self.graph.as_ref().expect("checked"));
        }
        if self.failed.contains(shape) {
            return Plan::Direct;
        }
        if self.last.as_ref() == Some(shape) {
            return Plan::Capture;
        }
        self.last = Some(shape.clone());
        Plan::Direct
    }

    /// Drops the graph of `shape` (its replay failed) and remembers not to capture it again.
    pub(super) fn forget(&mut self, shape: Shape) {
        self.graph = None;
        let _ = self.keep(shape, Err(Error::Internal("its replay failed".into())));
    }

    /// Keeps a captured graph (replacing the one before), or remembers that `shape`'s capture
    /// failed.
    pub(super) fn keep(&mut self, shape: Shape, graph: Result<LaunchGraph>) -> Option<&LaunchGraph> {
        self.last = None;
        match graph {
            Ok(g) => {
                self.graph = Some(g);
                self.graph.as_ref()
            }
            Err(_) => {
                if self.failed.len() >= 8 {
                    self.failed.remove(0);
                }
                self.failed.push(shape);
                None
            }
        }
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
    fn a_shape_is_captured_on_its_second_call_in_a_row() {
        let mut cache = GraphCache::default();
        let (s, t) = (shape(1, 10), shape(1, 11));
        assert!(matches!(cache.plan(&s), Plan::Direct));
        assert!(matches!(cache.plan(&t), Plan::Direct), "another shape restarts the count");
        assert!(matches!(cache.plan(&s), Plan::Direct));
        assert!(matches!(cache.plan(&s), Plan::Capture));
        assert!(cache.keep(s.clone(), Err(Error::Internal("capture failed".into()))).is_none());
        assert!(matches!(cache.plan(&s), Plan::Direct));
        assert!(matches!(cache.plan(&s), Plan::Direct), "a failed shape is not captured again");
    }

    #[test]
    fn a_record_keeps_launches_in_order_and_stops_on_error() {
        let args = args_of(&[1u32, 2, 3]);
        assert_eq!(args.len(), 2);
        assert_eq!(args[0], 1 | (2 << 32));
        let k = KernelShape { func: 7, grid: 1, block: 32, smem: 0, pdl: false };
        let r = record(|| {
            assert!(recording());
            push(Launch::Kernel { shape: k, args: args.clone() });
            push(Launch::Gemm(GemmShape { plan: 3, a: 1, b: 2, d: 3, bias: 0, workspace: 0, workspace_len: 0 }));
            Ok(())
        })
        .unwrap();
        assert!(!recording());
        assert_eq!(shape_of(&r).len(), 2);
        assert!(matches!(shape_of(&r)[0], Step::Kernel(s) if s == k));
        let failed = record(|| {
            push(Launch::Kernel { shape: k, args: Vec::new() });
            Err(Error::Internal("bad".into()))
        });
        assert!(failed.is_err());
        assert!(!recording(), "a failed record stops recording");
        push(Launch::Kernel { shape: k, args: Vec::new() });
    }
}
