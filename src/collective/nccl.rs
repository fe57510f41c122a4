//! NCCL through cudarc's run-time-loaded bindings: communicators for the GPUs of this host and
//! the grouped in-place broadcasts and reductions the sharded forward enqueues.

use std::ffi::CStr;

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
        unsafe { nc::comm_init_all(comms.as_mut_ptr(), list.len() as i32, list.as_ptr()) }
            .map_err(|e| nccl_err("ncclCommInitAll", e))?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Communicator {
                comm,
                rank,
                ranks: devices.len(),
                device: devices[rank],
                aborted: false,
            })
            .collect())
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
    /// rank has joined. Each rank calls it from its own thread or process.
    pub fn join(unique_id: &[u8], ranks: usize, rank: usize, device: usize) -> Result<Communicator> {
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
        // SAFETY: `comm` receives the handle; `id` is a complete unique id passed by value.
        unsafe { nc::comm_init_rank(&mut comm, n, id, r) }.map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Communicator { comm, rank, ranks, device, aborted: false })
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
        let end = nc::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
        match first_err {
            Some(e) => Err(e),
            None => end.map(|_| ()),
        }
    }

    /// An error once [`Communicator::abort`] was called: nothing may be enqueued on it then.
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
        let end = nc::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
        match first_err {
            Some(e) => Err(e),
            None => end.map(|_| ()),
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

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.aborted {
            // SAFETY: created by ncclCommInitAll and destroyed once; destroy waits for this
            // rank's enqueued operations.
            let _ = unsafe { nc::comm_destroy(self.comm) };
        }
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
