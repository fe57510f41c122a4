//! Host memory: what this process may still allocate, and allocations that fail with an error
//! instead of aborting the process.
//!
//! `MemAvailable` alone overstates what a process can use whenever it runs under a limit of its
//! own: a container's cgroup (`memory.max`, or `memory.limit_in_bytes` in cgroup v1) or an
//! address-space limit (`ulimit -v`, `RLIMIT_AS`). [`available`] takes the smallest of the three
//! (the cgroup's and every ancestor's limit less its usage, the address-space limit less this
//! process's mapped size), so memory plans and out-of-memory messages use the number that
//! actually binds.
//!
//! Rust's infallible allocations (`vec!`, `Vec::with_capacity`) abort the process when the
//! allocator refuses ("memory allocation of N bytes failed", exit 134). Every host allocation
//! whose size comes from the caller's input goes through [`try_vec`] or [`try_reserve`], which
//! return [`Error::OutOfMemory`] naming the bytes and what is [`available`].

use crate::error::{BackendKind, Error, Result};

/// Bytes this process can still allocate: the least of `MemAvailable`, the cgroup limits less
/// their usage, and the address-space limit less the mapped size; `None` when none is readable.
pub fn available() -> Option<u64> {
    let meminfo = read("/proc/meminfo").and_then(|t| meminfo_field(&t, "MemAvailable"));
    let rlimit = read("/proc/self/limits").and_then(|t| address_space_limit(&t)).map(|limit| {
        let mapped = read("/proc/self/status").and_then(|t| status_vm_size(&t)).unwrap_or(0);
        limit.saturating_sub(mapped)
    });
    [meminfo, cgroup_headroom(), rlimit].into_iter().flatten().min()
}

/// The most memory this process could ever use: the least of `MemTotal`, the cgroup limits and
/// the address-space limit; `None` when none is readable.
pub fn total() -> Option<u64> {
    let meminfo = read("/proc/meminfo").and_then(|t| meminfo_field(&t, "MemTotal"));
    let rlimit = read("/proc/self/limits").and_then(|t| address_space_limit(&t));
    let cgroup = cgroup_limits().into_iter().map(|(limit, _)| limit).min();
    [meminfo, cgroup, rlimit].into_iter().flatten().min()
}

/// A vector of `len` copies of `value`, or [`Error::OutOfMemory`] naming `what` when the host
/// cannot allocate it.
pub fn try_vec<T: Clone>(len: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    try_reserve(&mut v, len, what)?;
    v.resize(len, value);
    Ok(v)
}

/// Reserves room for `additional` more elements of `v`, or returns [`Error::OutOfMemory`]. Sizes
/// of a megabyte or more are first compared with [`available`]: the allocator reserves address
/// space, which a cgroup limit does not count, so an allocation beyond the cgroup's headroom
/// would succeed here and the process be killed when the pages are touched.
pub fn try_reserve<T>(v: &mut Vec<T>, additional: usize, what: &str) -> Result<()> {
    let bytes = additional as u128 * size_of::<T>() as u128;
    if bytes >= 1 << 20 && available().is_some_and(|a| bytes > u128::from(a)) {
        return Err(out_of_memory(what, bytes));
    }
    v.try_reserve_exact(additional).map_err(|_| out_of_memory(what, bytes))
}

/// The error for a host allocation of `bytes` that failed.
pub fn out_of_memory(what: &str, bytes: u128) -> Error {
    Error::OutOfMemory {
        backend: BackendKind::Cpu,
        what: format!("{what} (host memory)"),
        needed: u64::try_from(bytes).unwrap_or(u64::MAX),
        available: available().unwrap_or(0),
    }
}

/// Small files under /proc and /sys; anything larger is not what we are looking for.
fn read(path: &str) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path).ok()?.take(1 << 20).read_to_string(&mut text).ok()?;
    Some(text)
}

/// A `/proc/meminfo` field (`MemAvailable:  123 kB`) in bytes.
pub(crate) fn meminfo_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        kib.checked_mul(1024)
    })
}

/// The soft `Max address space` of `/proc/self/limits`, in bytes; `None` when unlimited.
pub(crate) fn address_space_limit(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max address space"))?;
    line["Max address space".len()..].split_whitespace().next()?.parse().ok()
}

/// `VmSize` of `/proc/self/status` (the mapped address space `RLIMIT_AS` counts), in bytes.
pub(crate) fn status_vm_size(text: &str) -> Option<u64> {
    meminfo_field(text, "VmSize")
}

/// A cgroup limit file's value: a byte count, or `max` (cgroup v2) / a huge number (v1) for none.
pub(crate) fn cgroup_value(text: &str) -> Option<u64> {
    let v: u64 = text.trim().parse().ok()?;
    // cgroup v1 writes "no limit" as the largest page-aligned i64.
    (v < 1 << 62).then_some(v)
}

/// The cgroup directories this process is in, from `/proc/self/cgroup`: the v2 path (`0::/a/b`)
/// under /sys/fs/cgroup and the v1 memory controller's path under /sys/fs/cgroup/memory, each
/// with its ancestors up to the mount point (every level's limit applies).
pub(crate) fn cgroup_dirs(proc_self_cgroup: &str) -> Vec<(std::path::PathBuf, bool)> {
    let mut dirs = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (root, v2) = if id == "0" && controllers.is_empty() {
            ("/sys/fs/cgroup", true)
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", false)
        } else {
            continue;
        };
        let mut p = std::path::PathBuf::from(root);
        dirs.push((p.clone(), v2));
        for comp in path.split('/').filter(|c| !c.is_empty() && *c != "..") {
            p.push(comp);
            dirs.push((p.clone(), v2));
        }
    }
    dirs
}

/// `(limit, usage)` of every cgroup level above this process that has a memory limit.
fn cgroup_limits() -> Vec<(u64, u64)> {
    let Some(text) = read("/proc/self/cgroup") else { return Vec::new() };
    cgroup_dirs(&text)
        .into_iter()
        .filter_map(|(dir, v2)| {
            let (max, current) =
                if v2 { ("memory.max", "memory.current") } else { ("memory.limit_in_bytes", "memory.usage_in_bytes") };
            let limit = cgroup_value(&read(dir.join(max).to_str()?)?)?;
            let usage = read(dir.join(current).to_str()?).and_then(|t| cgroup_value(&t)).unwrap_or(0);
            Some((limit, usage))
        })
        .collect()
}

/// The least headroom (limit less usage) of the cgroup levels with a limit.
fn cgroup_headroom() -> Option<u64> {
    cgroup_limits().into_iter().map(|(limit, usage)| limit.saturating_sub(usage)).min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_parse() {
        let meminfo = "MemTotal:       16310364 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(meminfo_field(meminfo, "MemAvailable"), Some(12_000_000 * 1024));
        assert_eq!(meminfo_field(meminfo, "MemTotal"), Some(16_310_364 * 1024));
        assert_eq!(meminfo_field(meminfo, "SwapTotal"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max stack size            8388608              unlimited            bytes     \n\
                      Max address space         157286400            unlimited            bytes     \n";
        assert_eq!(address_space_limit(limits), Some(157_286_400));
        assert_eq!(address_space_limit(&limits.replace("157286400", "unlimited")), None);
        assert_eq!(status_vm_size("Name:\ttrimul\nVmPeak:\t  9 kB\nVmSize:\t   20480 kB\n"), Some(20480 * 1024));
        assert_eq!(cgroup_value("262144000\n"), Some(262_144_000));
        assert_eq!(cgroup_value("max\n"), None);
        assert_eq!(cgroup_value("9223372036854771712"), None);
    }

    #[test]
    fn cgroup_paths_cover_every_level() {
        let v2 = cgroup_dirs("0::/user.slice/session-3.scope\n");
        let paths: Vec<_> = v2.iter().map(|(p, v)| (p.to_str().unwrap().to_string(), *v)).collect();
        assert_eq!(
            paths,
            [
                ("/sys/fs/cgroup".to_string(), true),
                ("/sys/fs/cgroup/user.slice".to_string(), true),
                ("/sys/fs/cgroup/user.slice/session-3.scope".to_string(), true)
            ]
        );
        let v1 = cgroup_dirs("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n");
        assert_eq!(
            v1.last().map(|(p, v)| (p.to_str().unwrap(), *v)),
            Some(("/sys/fs/cgroup/memory/docker/abc", false))
        );
        assert_eq!(v1.len(), 3);
        assert!(cgroup_dirs("garbage").is_empty());
    }

    #[test]
    fn available_never_exceeds_what_meminfo_says() {
        if let (Some(a), Some(m)) = (available(), read("/proc/meminfo").and_then(|t| meminfo_field(&t, "MemAvailable")))
        {
            assert!(a <= m, "{a} > {m}");
        }
        let v: Result<Vec<u8>> = try_vec(usize::MAX / 2, 0u8, "a test buffer");
        match v {
            Err(Error::OutOfMemory { needed, what, .. }) => {
                assert_eq!(needed, (usize::MAX / 2) as u64);
                assert!(what.contains("a test buffer"), "{what}");
            }
            other => panic!("expected OutOfMemory, got {:?}", other.map(|v| v.len())),
        }
    }
}
