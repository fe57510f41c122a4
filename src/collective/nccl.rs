//! NCCL through cudarc's run-time-loaded bindings: communicators for the GPUs of this host and
//! the grouped in-place broadcasts and reductions the sharded forward enqueues.

use std::ffi::CStr;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUstream;
use cudarc::nccl::{result as nc, sys};

use crate::error::{BackendKind, Error, Result};

fn nccl_err(call: &str, e: nc::NcclError) -> Error {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) }.to_string_lossy().into_owned();
    Error::driver(BackendKind::Cuda, call, format!("{:?} ({text})", e.0))
}

fn loaded() -> Result<()> {
    // SAFETY: only tries to open the library under its candidate names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::LibraryNotFound {
            library: "NCCL (libnccl.so.2)".into(),
            tried: "cudarc's dynamic loader".into(),
            reason: "the sharded forward across GPUs needs NCCL; install it (e.g. the nvidia-nccl-cu13 wheel) \
                     and put it on the loader path"
                .into(),
        })
    }
}

/// NCCL's version as `major.minor.patch`, or why it cannot be loaded.
pub fn nccl_version() -> Result<String> {
    loaded()?;
    let v = nc::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))?;
    // NCCL ≥ 2.9 encodes major·10000 + minor·100 + patch.
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// One rank's NCCL communicator.
pub struct Communicator {
    comm: sys::ncclComm_t,
    rank: usize,
    ranks: usize,
    device: usize,
    /// Set by [`Communicator::abort`]: the handle is gone.
    aborted: bool,
    /// For a communicator joined with a deadline ([`Communicator::join_within`]), which NCCL
    /// runs non-blocking: how long its join, or the connections an exchange makes to its peers
    /// on first use, may take before the peers count as lost. `None`: blocking
    /// ([`Communicator::join`], and one process's [`Communicator::for_local_gpus`]).
    timeout: Option<Duration>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as one thread at a time
// enqueues on it; `&mut self` on every enqueueing method gives that.
unsafe impl Send for Communicator {}

impl Communicator {
    /// One communicator per GPU of this host, rank `r` on `devices[r]` (`ncclCommInitAll`).
    pub fn for_local_gpus(devices: &[usize]) -> Result<Vec<Communicator>> {
        if devices.len() < 2 {
            return Err(Error::InvalidArgument(format!(
                "a sharded forward needs at least two GPUs, {} given",
                devices.len()
            )));
        }
        let mut seen = devices.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != devices.len() {
            return Err(Error::InvalidArgument(format!("GPU list {devices:?} names a GPU twice")));
        }
        loaded()?;
        let list = devices
            .iter()
            .map(|&d| i32::try_from(d).map_err(|_| Error::InvalidArgument(format!("GPU number {d}"))))
            .collect::<Result<Vec<i32>>>()?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one handle per listed device; the list outlives the call.
        let status = unsafe { nc::comm_init_all(comms.as_mut_ptr(), list.len() as i32, list.as_ptr()) }
            .map_err(|e| nccl_err("ncclCommInitAll", e))?;
        let mut comms: Vec<Communicator> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Communicator {
                comm,
                rank,
                ranks: devices.len(),
                device: devices[rank],
                aborted: false,
                timeout: None,
            })
            .collect();
        if status == nc::NcclStatus::InProgress {
            // Only where NCCL_COMM_BLOCKING=0 in the environment made them non-blocking.
            for comm in &mut comms {
                comm.settle("ncclCommInitAll", String::new)?;
            }
        }
        Ok(comms)
    }

    /// A fresh NCCL unique id (`ncclGetUniqueId`), 128 bytes: one rank makes it and hands the
    /// same bytes to every rank (through `torch.distributed`, MPI, a file), which then calls
    /// [`Communicator::join`]. Ranks may live in different processes and on different hosts.
    pub fn unique_id() -> Result<Vec<u8>> {
        loaded()?;
        let id = nc::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        Ok(id.internal.iter().map(|&b| b as u8).collect())
    }

    /// Rank `rank` of `ranks`, on CUDA device `device`, of the communicator named by
    /// `unique_id` ([`Communicator::unique_id`]): `ncclCommInitRank`, which returns once every
    /// rank has joined. Each rank calls it from its own thread or process. A rank that never
    /// comes leaves this call waiting; [`Communicator::join_within`] gives the join a deadline.
    pub fn join(unique_id: &[u8], ranks: usize, rank: usize, device: usize) -> Result<Communicator> {
        Self::join_as(unique_id, ranks, rank, device, None)
    }

    /// As [`Communicator::join`], with a deadline: the communicator is NCCL's non-blocking kind
    /// (`ncclCommInitRankConfig`, `blocking = 0`; NCCL 2.14 or later). Where a rank never comes
    /// (its process died before joining, a wrong unique id or rank count), this rank's join
    /// fails after `timeout` with an error naming it, instead of waiting forever; the
    /// communicator is aborted then. Where NCCL connects to the peers on an exchange's first use
    /// (its default since 2.22, `NCCL_RUNTIME_CONNECT`), that exchange fails the same way when a
    /// peer is gone by then; with earlier NCCL the connections are made in the join.
    ///
    /// The price: NCCL runs each of a non-blocking communicator's exchanges from a thread of its
    /// own, which the rank waits for before launching its next kernel, so every sharded forward
    /// takes longer (`docs/multi-gpu.md` has the numbers). A rank that stops after the first
    /// exchanges is caught by [`crate::sharded::ShardedRank::wait`]'s deadline either way.
    /// Dropping the communicator finalizes it, waiting for its enqueued exchanges at most
    /// `timeout` before aborting it. The exchanges cannot go on the per-thread default stream
    /// (NCCL's thread would enqueue them on its own); `NCCL_COMM_BLOCKING=1` is refused.
    pub fn join_within(
        unique_id: &[u8],
        ranks: usize,
        rank: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<Communicator> {
        Self::join_as(unique_id, ranks, rank, device, Some(timeout))
    }

    /// [`Communicator::join`] (blocking, `timeout` `None`) or [`Communicator::join_within`].
    fn join_as(
        unique_id: &[u8],
        ranks: usize,
        rank: usize,
        device: usize,
        timeout: Option<Duration>,
    ) -> Result<Communicator> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if unique_id.len() != id.internal.len() {
            return Err(Error::InvalidArgument(format!(
                "an NCCL unique id has {} bytes, {} given",
                id.internal.len(),
                unique_id.len()
            )));
        }
        if rank >= ranks {
            return Err(Error::InvalidArgument(format!("rank {rank} of a communicator of {ranks} ranks")));
        }
        loaded()?;
        for (d, &b) in id.internal.iter_mut().zip(unique_id) {
            *d = b as std::ffi::c_char;
        }
        let count = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} {v} does not fit NCCL's int")))
        };
        let (n, r) = (count(ranks, "ranks")?, count(rank, "rank")?);
        // NCCL joins on the calling thread's current device: make `device`'s primary context
        // current (the one every other library call on that device uses).
        let ctx = cudarc::driver::CudaContext::new(device)
            .map_err(|e| Error::driver(BackendKind::Cuda, "cuDevicePrimaryCtxRetain", format!("{e:?}")))?;
        ctx.bind_to_thread().map_err(|e| Error::driver(BackendKind::Cuda, "cuCtxSetCurrent", format!("{e:?}")))?;
        let mut comm = std::ptr::null_mut();
        let Some(timeout) = timeout else {
            // SAFETY: `comm` receives the handle; `id` is a complete unique id passed by value.
            let status =
                unsafe { nc::comm_init_rank(&mut comm, n, id, r) }.map_err(|e| nccl_err("ncclCommInitRank", e))?;
            let mut joined = Communicator { comm, rank, ranks, device, aborted: false, timeout: None };
            if status == nc::NcclStatus::InProgress {
                // Only where NCCL_COMM_BLOCKING=0 in the environment made it non-blocking: wait
                // for the join as the blocking call would have (no deadline).
                joined.settle("ncclCommInitRank", String::new)?;
            }
            return Ok(joined);
        };
        if std::env::var("NCCL_COMM_BLOCKING").is_ok_and(|v| v.trim() == "1") {
            return Err(Error::InvalidArgument(
                "a join with a deadline needs NCCL's non-blocking communicator, and NCCL_COMM_BLOCKING=1 in the \
                 environment would make it blocking (and the deadline void): unset it, or join without a deadline"
                    .into(),
            ));
        }
        let mut config = non_blocking_config()?;
        // SAFETY: `comm` receives the handle; `id` is a complete unique id passed by value;
        // `config` is a whole config of the version it states, read during the call.
        let code = unsafe { sys::ncclCommInitRankConfig(&mut comm, n, id, r, &mut config) };
        if let Err(e) = code.result() {
            // Where NCCL failed to make the communicator it frees it and leaves `comm` null;
            // where it made one whose joining then failed at once, `comm` is set and is aborted.
            if !comm.is_null() {
                // SAFETY: a communicator NCCL made and returned, aborted once and not used after.
                let _ = unsafe { nc::comm_abort(comm) };
            }
            return Err(nccl_err("ncclCommInitRankConfig", e));
        }
        let mut joined = Communicator { comm, rank, ranks, device, aborted: false, timeout: Some(timeout) };
        joined.settle("joining the communicator", || {
            format!(
                "rank {rank} of {ranks} (GPU {device}): the other ranks did not join within {:.1} s (a rank \
                 that never started or died, or a different unique id or rank count); the communicator \
                 was aborted",
                timeout.as_secs_f64()
            )
        })?;
        Ok(joined)
    }

    /// For a non-blocking communicator: waits until NCCL has finished what the last call left in
    /// progress (`ncclCommGetAsyncError` reports `ncclSuccess`), aborting it on an error or when
    /// the timeout passes (with `late`'s message; no timeout: as long as it takes, as a blocking
    /// call would). Nothing else may be called on a non-blocking communicator meanwhile; an
    /// exchange's group is only on the stream once it has settled, so this comes before the
    /// caller launches anything after the exchange.
    fn settle(&mut self, what: &str, late: impl FnOnce() -> String) -> Result<()> {
        let timeout = self.timeout.unwrap_or(Duration::MAX);
        // NCCL hands a non-blocking group to its own thread, so every exchange's ncclGroupEnd
        // returns ncclInProgress and settles here, usually within microseconds: the first
        // millisecond yields instead of sleeping (a sleep costs ~60 µs or more, several per
        // forward), and only a wait past it (a peer's first connection) backs off to sleeps.
        const SPIN: Duration = Duration::from_millis(1);
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            let mut state = sys::ncclResult_t::ncclInProgress;
            // SAFETY: a live communicator (not aborted: every caller checks) and a place for the
            // result.
            let call = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            let failed = [call, state]
                .into_iter()
                .find(|r| !matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress));
            if let Some(code) = failed {
                self.abort();
                return Err(nccl_err(&format!("ncclCommGetAsyncError ({what})"), nc::NcclError(code)));
            }
            if state == sys::ncclResult_t::ncclSuccess {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                self.abort();
                return Err(Error::driver(BackendKind::Cuda, what, late()));
            }
            if start.elapsed() < SPIN {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    /// Closes an NCCL group this communicator's calls went into: `ncclGroupEnd`, then, for a
    /// non-blocking communicator (whose groups NCCL enqueues from a thread of its own, and whose
    /// first group also connects to the peers), [`Communicator::settle`].
    fn end_group(&mut self, call: &str) -> Result<()> {
        let status = nc::group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
        if status != nc::NcclStatus::InProgress {
            return Ok(());
        }
        let (rank, ranks, timeout) = (self.rank, self.ranks, self.timeout.unwrap_or_default());
        self.settle(call, || {
            format!(
                "rank {rank} of {ranks}: the exchange was not enqueued within {:.1} s (its peers could not be \
                 reached: one stopped or died); the communicator was aborted",
                timeout.as_secs_f64()
            )
        })
    }

    /// Aborts the communicator (`ncclCommAbort`): its uncompleted operations are dropped and
    /// every later call fails. What a group does when one rank failed partway through a
    /// forward whose exchanges the others already enqueued, so that no stream waits forever
    /// for a peer that will not come.
    pub fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: a live communicator, aborted once; the handle is not used afterwards.
            let _ = unsafe { nc::comm_abort(self.comm) };
        }
    }

    /// An error NCCL met on this communicator while its operations ran (`ncclCommGetAsyncError`:
    /// a peer's connection lost, a remote failure), or that it was aborted; `Ok` while neither.
    pub fn async_error(&self) -> Result<()> {
        self.check_live()?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and a place for the result.
        let call = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        for r in [call, state] {
            if !matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
                return Err(nccl_err("ncclCommGetAsyncError", nc::NcclError(r)));
            }
        }
        Ok(())
    }

    /// Whether [`Communicator::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted
    }

    /// This rank's number.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the communicator joins.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The CUDA device this rank runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Enqueues, in one NCCL group on `stream`, one broadcast of f16 elements per entry of
    /// `transfers`: `count` halves from `send` on rank `root` to `recv` on every rank (on the root
    /// itself too; `send == recv` there is in place). Every rank must make the same call with the
    /// same roots and counts, in the same order.
    ///
    /// # Safety
    /// On the root `send` holds `count` halves, on every rank `recv` has room for them, on this
    /// rank's device; they stay alive until the stream has run the group.
    pub(crate) unsafe fn broadcast(&mut self, transfers: &[Transfer], stream: CUstream) -> Result<()> {
        self.grouped("ncclBroadcast", transfers, |comm, t| {
            // SAFETY: as the caller guarantees.
            unsafe {
                nc::broadcast(
                    t.send as *const std::ffi::c_void,
                    t.recv as *mut std::ffi::c_void,
                    t.count,
                    sys::ncclDataType_t::ncclFloat16,
                    t.root as i32,
                    comm,
                    stream as sys::cudaStream_t,
                )
            }
        })
    }

    /// Enqueues, in one NCCL group on `stream`, one sum of f16 elements per entry of `transfers`:
    /// the `count` halves at `send` summed over every rank into `recv` on rank `root` (`recv` is
    /// only written there; `send == recv` on the root is in place). Every rank must make the
    /// same call with the same roots and counts, in the same order.
    ///
    /// # Safety
    /// As [`Communicator::broadcast`], with `send` holding `count` halves on every rank and
    /// `recv` room for them on the root.
    pub(crate) unsafe fn sum_to_roots(&mut self, transfers: &[Transfer], stream: CUstream) -> Result<()> {
        self.grouped("ncclReduce", transfers, |comm, t| {
            // SAFETY: as the caller guarantees.
            unsafe {
                nc::reduce(
                    t.send as *const std::ffi::c_void,
                    t.recv as *mut std::ffi::c_void,
                    t.count,
                    sys::ncclDataType_t::ncclFloat16,
                    sys::ncclRedOp_t::ncclSum,
                    t.root as i32,
                    comm,
                    stream as sys::cudaStream_t,
                )
            }
        })
    }

    /// Enqueues on `stream` the element-wise minimum and maximum over every rank of the
    /// `count` u64 at `values`, into `min` and `max` (this rank's device addresses). Every rank
    /// must make the same call.
    ///
    /// # Safety
    /// The three are device buffers of at least `count` u64 on this rank's device, alive until
    /// the stream has run the reductions.
    pub(crate) unsafe fn min_max_u64(
        &mut self,
        values: u64,
        min: u64,
        max: u64,
        count: usize,
        stream: CUstream,
    ) -> Result<()> {
        self.check_live()?;
        nc::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let mut first_err = None;
        for (out, op) in [(min, sys::ncclRedOp_t::ncclMin), (max, sys::ncclRedOp_t::ncclMax)] {
            // SAFETY: as the caller guarantees.
            let r = unsafe {
                nc::all_reduce(
                    values as *const std::ffi::c_void,
                    out as *mut std::ffi::c_void,
                    count,
                    sys::ncclDataType_t::ncclUint64,
                    op,
                    self.comm,
                    stream as sys::cudaStream_t,
                )
            };
            if let Err(e) = r {
                first_err.get_or_insert(nccl_err("ncclAllReduce", e));
            }
        }
        let end = self.end_group("ncclAllReduce");
        match first_err {
            Some(e) => Err(e),
            None => end,
        }
    }

    /// An error once [`Communicator::abort`] was called: nothing may be enqueued on it then.
    /// An error where this communicator cannot enqueue on `stream` in the caller's order: a
    /// non-blocking one ([`Communicator::join_within`]) with the per-thread default stream
    /// (`CU_STREAM_PER_THREAD`), which would be the stream of the NCCL thread that enqueues.
    pub(crate) fn check_stream(&self, stream: CUstream) -> Result<()> {
        const CU_STREAM_PER_THREAD: usize = 0x2;
        if self.timeout.is_some() && stream as usize == CU_STREAM_PER_THREAD {
            return Err(Error::InvalidArgument(
                "a communicator joined with a deadline (non-blocking) cannot exchange on the per-thread default \
                 stream: pass an explicit stream, or the legacy default stream (0)"
                    .into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_live(&self) -> Result<()> {
        if self.aborted {
            return Err(Error::InvalidArgument(format!(
                "rank {}'s communicator was aborted after an earlier failure; make a new one",
                self.rank
            )));
        }
        Ok(())
    }

    fn grouped(
        &mut self,
        call: &str,
        transfers: &[Transfer],
        mut op: impl FnMut(sys::ncclComm_t, &Transfer) -> std::result::Result<nc::NcclStatus, nc::NcclError>,
    ) -> Result<()> {
        self.check_live()?;
        if let Some(t) = transfers.iter().find(|t| t.root >= self.ranks) {
            return Err(Error::Internal(format!("{call} from rank {} of {} ranks", t.root, self.ranks)));
        }
        nc::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let mut first_err = None;
        for t in transfers {
            if let Err(e) = op(self.comm, t) {
                first_err = Some(nccl_err(call, e));
                break;
            }
        }
        // The group is closed whatever happened inside it, so NCCL is never left mid-group.
        let end = self.end_group(call);
        match first_err {
            Some(e) => Err(e),
            None => end,
        }
    }
}

/// One broadcast or reduction of [`Communicator::broadcast`] and [`Communicator::sum_to_roots`]:
/// device addresses on this rank, a count of f16 elements and the root rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Transfer {
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub root: usize,
}

/// NCCL's `NCCL_CONFIG_INITIALIZER` (every field "undefined": NCCL's defaults) with `blocking = 0`,
/// stating the version of the bindings' struct, or the loaded NCCL's where that is older (later
/// versions only append fields, so an older NCCL reads the ones it knows).
fn non_blocking_config() -> Result<sys::ncclConfig_t> {
    const UNDEF: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT
    const BINDINGS: u32 = 22800; // the nccl-02028 bindings' ncclConfig_v22800
    let loaded = nc::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))?;
    if loaded < 21400 {
        return Err(Error::Unsupported {
            backend: BackendKind::Cuda,
            what: format!(
                "joining a communicator with NCCL {}.{} (non-blocking communicators need NCCL 2.14 or later)",
                loaded / 10000,
                (loaded / 100) % 100
            ),
        });
    }
    Ok(sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: (loaded as u32).min(BINDINGS),
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    })
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        if self.timeout.is_some() {
            // A non-blocking communicator is finalized first (NCCL's order for that kind:
            // finalize, wait until it has settled, destroy), within its timeout; where that
            // fails it is aborted instead, and `settle` has done so.
            // SAFETY: a live communicator, finalized once.
            let finalized = unsafe { nc::comm_finalize(self.comm) };
            let settled = match finalized {
                Ok(_) => self.settle("ncclCommFinalize", || "the communicator's last operations did not finish".into()),
                Err(e) => Err(nccl_err("ncclCommFinalize", e)),
            };
            if settled.is_err() {
                self.abort();
                return;
            }
        }
        // SAFETY: a live communicator (made by ncclCommInitAll, or joined and finalized above),
        // destroyed once; for a blocking one, destroy waits for this rank's enqueued operations.
        let _ = unsafe { nc::comm_destroy(self.comm) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bad arguments are refused before NCCL is looked for; without NCCL (CI) every entry point
    /// says that NCCL is what is missing, and nothing panics.
    #[test]
    fn bad_arguments_and_a_missing_nccl_are_clear_errors() {
        let msg = |r: Result<Communicator>| r.err().map(|e| e.to_string()).unwrap_or_default();
        let many = |r: Result<Vec<Communicator>>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(many(Communicator::for_local_gpus(&[0])).contains("at least two GPUs"));
        assert!(many(Communicator::for_local_gpus(&[1, 1])).contains("twice"));
        assert!(msg(Communicator::join(&[0; 10], 2, 0, 0)).contains("128 bytes, 10 given"));
        assert!(msg(Communicator::join(&[0; 128], 2, 2, 0)).contains("rank 2 of a communicator of 2"));
        if loaded().is_ok() {
            return; // NCCL is here: the rest needs GPUs (tests/cuda_sharded.rs).
        }
        let errors = [
            nccl_version().unwrap_err(),
            Communicator::unique_id().unwrap_err(),
            Communicator::for_local_gpus(&[0, 1]).err().unwrap(),
            Communicator::join(&[0; 128], 2, 0, 0).err().unwrap(),
        ];
        for e in errors {
            assert!(matches!(e, Error::LibraryNotFound { .. }) && e.to_string().contains("NCCL"), "{e}");
        }
    }
}
