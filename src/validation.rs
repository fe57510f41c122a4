//! Fast paths proved on the user's own GPU before they are used.
//!
//! Some kernels have never run on the device in front of the user: the HIP kernels on any AMD
//! GPU (no AMD GPU was reachable where they were written), or CUDA kernels on a generation nobody
//! here has run. Such a *fast path* is not used on trust. Before a layer uses it for a class of
//! shapes, the backend runs it on small cases against the f64 reference and times it against the
//! path it would replace; the result is a [`Verdict`]. The fast path is used only when it passed
//! every case (every element within `atol + rtol·|want|`, so a kernel wrong in a few elements
//! fails) **and** ran faster ([`Verdict::decide`]). A failed path is reported, never used.
//!
//! Verdicts are kept in memory per device and in one JSON file under the user's cache directory
//! ([`VerdictStore`]), keyed by everything that can change the answer ([`VerdictKey`]): the
//! device and its target, the driver, the vendor library the baseline uses, the kernel's own
//! bytes (a fingerprint of the code object or source that would run) and trimul's version. A
//! driver update, a new rocBLAS or a changed kernel therefore validates again.
//!
//! Validation runs when a layer is prepared from host weights, or on request (`trimul tune
//! --backend hip`), never inside a forward: a forward may be captured in a graph, and
//! validation allocates, synchronises and times. Weights prepared on the device (the Python
//! package's path, which may run under a capture) use a verdict only if one exists already.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Overrides where verdicts are kept: a directory, or `off` (or empty) to keep them in memory only.
pub const CACHE_DIR_ENV: &str = "TRIMUL_CACHE_DIR";
/// The sequence length of the shape a validation times both paths at (default
/// [`DEFAULT_TIMING_N`]); smaller values make validation cheaper where timing does not matter.
pub const TIMING_N_ENV: &str = "TRIMUL_VALIDATION_N";
/// Sequence length of the timed shape (B = 1, the layer's C and H).
pub const DEFAULT_TIMING_N: usize = 256;
/// The element rule of a validation case: `|got − want| ≤ ATOL + RTOL·|want|` for every element
/// (the rule of the GPU tests), and the case's relative L2 error at most [`MAX_REL_L2`].
pub const RTOL: f64 = 2e-2;
/// See [`RTOL`].
pub const ATOL: f64 = 2e-2;
/// See [`RTOL`].
pub const MAX_REL_L2: f64 = 5e-3;
/// Untimed forwards before each path's timed ones.
pub const TIMING_WARMUP: usize = 2;
/// Timed forwards per path (the verdict keeps the median).
pub const TIMING_REPEATS: usize = 5;
/// How much faster a fast path's median must be to be used: a tie within the timings' noise
/// keeps the portable path (and keeps verdicts from flipping between runs).
pub const MIN_GAIN: f64 = 0.03;
/// The validation procedure's version, part of every key: a changed procedure validates again.
pub const PROCEDURE_VERSION: u32 = 2;

/// The file format's version: a file of another version is ignored (and replaced on the next save).
const FILE_VERSION: u32 = 1;

/// What a verdict is about. Two verdicts with equal keys answer the same question; any field
/// changing (a new driver, a rebuilt kernel) asks it again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictKey {
    /// `hip` or `cuda`.
    pub backend: String,
    /// The device's name, e.g. `AMD Instinct MI300X`.
    pub device: String,
    /// The full target, e.g. `gfx942:sramecc+:xnack-`.
    pub target: String,
    /// The driver's version.
    pub driver: String,
    /// The vendor library the baseline path uses and its version, e.g. `rocBLAS 4.3.0`.
    pub library: String,
    /// The fast path, e.g. `output_projection (MFMA)`.
    pub path: String,
    /// A fingerprint of the bytes that would run ([`fingerprint`]).
    pub kernel: String,
    /// The class of shapes the verdict covers, e.g. `C=128 H=128`.
    pub class: String,
    /// trimul's version and source commit (the host code around the kernel matters too).
    pub trimul: String,
    /// The validation procedure: its version and the timed shape's N.
    pub procedure: String,
}

impl VerdictKey {
    /// The key as one string (the file's map key).
    pub fn id(&self) -> String {
        [
            &self.backend,
            &self.device,
            &self.target,
            &self.driver,
            &self.library,
            &self.path,
            &self.kernel,
            &self.class,
            &self.trimul,
            &self.procedure,
        ]
        .map(String::as_str)
        .join(" | ")
    }
}

/// One validation case's outcome against the f64 reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CaseOutcome {
    /// What ran, e.g. `af3 biases n19 b1 mask outgoing f32-io`.
    pub case: String,
    /// Every element within tolerance and no NaN or Inf where the reference has none.
    pub passed: bool,
    /// Elements outside tolerance.
    pub bad: usize,
    /// Elements compared.
    pub checked: usize,
    /// `‖got − want‖₂ / ‖want‖₂`.
    pub rel_l2: f64,
}

/// The outcome of validating one fast path for one class of shapes on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// What was validated, where.
    pub key: VerdictKey,
    /// Each case's comparison with the f64 reference.
    pub cases: Vec<CaseOutcome>,
    /// Whether every case passed.
    pub passed: bool,
    /// The fast path's median forward time at the timed shape (ms); absent when it failed a case
    /// (a wrong kernel is not timed).
    pub fast_ms: Option<f64>,
    /// The baseline path's median forward time at the same shape (ms).
    pub baseline_ms: Option<f64>,
    /// What was timed, e.g. `B=1 N=256`.
    pub timed_shape: String,
    /// Whether layers use the fast path: passed and faster.
    pub used: bool,
    /// Why (or why not), in words.
    pub reason: String,
    /// Seconds since the Unix epoch when the validation ran.
    pub when: u64,
}

impl Verdict {
    /// The rule: a fast path is used only when it passed every case and its median time beat
    /// the baseline's. Anything else keeps the baseline, and the reason says why.
    pub fn decide(
        key: VerdictKey,
        cases: Vec<CaseOutcome>,
        fast_ms: Option<f64>,
        baseline_ms: Option<f64>,
        timed_shape: String,
    ) -> Verdict {
        let failed: Vec<&CaseOutcome> = cases.iter().filter(|c| !c.passed).collect();
        let passed = !cases.is_empty() && failed.is_empty();
        let (used, reason) = if cases.is_empty() {
            (false, "no validation case ran".to_string())
        } else if !passed {
            let names: Vec<String> = failed
                .iter()
                .map(|c| format!("{} ({} of {} elements wrong, rel. L2 {:.1e})", c.case, c.bad, c.checked, c.rel_l2))
                .collect();
            (false, format!("failed against the f64 reference: {}", names.join("; ")))
        } else {
            match (fast_ms, baseline_ms) {
                (Some(f), Some(b)) if f.is_finite() && b.is_finite() && f < b * (1.0 - MIN_GAIN) => {
                    (true, format!("passed {} cases; {f:.3} ms against {b:.3} ms", cases.len()))
                }
                (Some(f), Some(b)) => {
                    (false, format!("passed, but not faster by {:.0}%: {f:.3} ms against {b:.3} ms", MIN_GAIN * 100.0))
                }
                _ => (false, "passed, but was not timed".to_string()),
            }
        };
        let when = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Verdict { key, cases, passed, fast_ms, baseline_ms, timed_shape, used, reason, when }
    }

    /// A verdict against a path whose validation could not run to the end (`reason` says why).
    pub fn not_run(key: VerdictKey, reason: String) -> Verdict {
        let mut v = Verdict::decide(key, Vec::new(), None, None, String::new());
        v.reason = reason;
        v
    }

    /// One line for `trimul info` and `trimul tune`.
    pub fn describe(&self) -> String {
        format!(
            "{} {}: {} ({})",
            self.key.path,
            self.key.class,
            if self.used { "used" } else { "not used" },
            self.reason
        )
    }
}

/// FNV-1a (64 bits) of the parts in order, as 16 hex digits: a fingerprint stable across Rust
/// versions and platforms (std's hasher is not), for keying verdicts on a kernel's bytes.
pub fn fingerprint(parts: &[&[u8]]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        // The length first, so that ("ab", "c") and ("a", "bc") differ.
        for b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

#[derive(Serialize, Deserialize, Default)]
struct File {
    version: u32,
    verdicts: BTreeMap<String, Verdict>,
}

/// Where verdicts are kept on disk: one JSON file, `verdicts.json`, in a directory. Reading is
/// forgiving (a missing, unreadable or foreign file holds no verdicts, so paths validate again);
/// writing goes through a temporary file and a rename, so a reader never sees half a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerdictStore {
    dir: Option<PathBuf>,
}

impl VerdictStore {
    /// The store the environment names: `$TRIMUL_CACHE_DIR` (`off` or empty: none), else
    /// `$XDG_CACHE_HOME/trimul`, else `$HOME/.cache/trimul` (`%LOCALAPPDATA%\trimul` on Windows).
    pub fn from_env() -> VerdictStore {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let dir = match std::env::var(CACHE_DIR_ENV) {
            Ok(v) if v.trim().is_empty() || v.trim() == "off" => None,
            Ok(v) => Some(PathBuf::from(v)),
            Err(_) => var("XDG_CACHE_HOME")
                .map(|d| d.join("trimul"))
                .or_else(|| var("HOME").map(|h| h.join(".cache").join("trimul")))
                .or_else(|| var("LOCALAPPDATA").map(|d| d.join("trimul"))),
        };
        VerdictStore { dir }
    }

    /// A store in `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> VerdictStore {
        VerdictStore { dir: Some(dir.into()) }
    }

    /// A store that keeps nothing.
    pub fn none() -> VerdictStore {
        VerdictStore { dir: None }
    }

    /// The file's path, if verdicts are kept on disk.
    pub fn path(&self) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join("verdicts.json"))
    }

    fn read(&self) -> File {
        let Some(path) = self.path() else { return File::default() };
        let Ok(text) = std::fs::read_to_string(&path) else { return File::default() };
        match serde_json::from_str::<File>(&text) {
            Ok(f) if f.version == FILE_VERSION => f,
            _ => File::default(),
        }
    }

    /// The verdict stored for `key`, if any.
    pub fn load(&self, key: &VerdictKey) -> Option<Verdict> {
        self.read().verdicts.remove(&key.id()).filter(|v| v.key == *key)
    }

    /// Every stored verdict.
    pub fn all(&self) -> Vec<Verdict> {
        self.read().verdicts.into_values().collect()
    }

    /// Stores `verdict`, replacing one of the same key. Without a directory, nothing is written.
    pub fn save(&self, verdict: &Verdict) -> Result<()> {
        let Some(dir) = self.dir.as_ref() else { return Ok(()) };
        let io = |what: &str, p: &Path, e: std::io::Error| {
            Error::InvalidArgument(format!(
                "{what} {}: {e} (set {CACHE_DIR_ENV}=off to keep verdicts in memory)",
                p.display()
            ))
        };
        std::fs::create_dir_all(dir).map_err(|e| io("cannot create the verdict directory", dir, e))?;
        let mut file = self.read();
        file.version = FILE_VERSION;
        file.verdicts.insert(verdict.key.id(), verdict.clone());
        let text = serde_json::to_string_pretty(&file);
        self.replace(file_text(text)?)
    }

    /// Takes the verdict of `key` out of the file, if it is there.
    pub fn remove(&self, key: &VerdictKey) -> Result<()> {
        if self.dir.is_none() {
            return Ok(());
        }
        let mut file = self.read();
        if file.verdicts.remove(&key.id()).is_none() {
            return Ok(());
        }
        file.version = FILE_VERSION;
        self.replace(file_text(serde_json::to_string_pretty(&file))?)
    }

    /// Writes `text` as the file: a temporary file of this writer's own (process, thread and a
    /// counter: concurrent writers never share one), flushed to disk, then renamed over the file,
    /// so a reader sees the old file or the new one. The last rename wins; a verdict lost that way
    /// is only validated again.
    fn replace(&self, text: String) -> Result<()> {
        use std::io::Write;
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let (Some(dir), Some(path)) = (self.dir.as_ref(), self.path()) else { return Ok(()) };
        let io = |what: &str, p: &Path, e: std::io::Error| {
            Error::InvalidArgument(format!(
                "{what} {}: {e} (set {CACHE_DIR_ENV}=off to keep verdicts in memory)",
                p.display()
            ))
        };
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!("verdicts.json.{}.{:?}.{n}.tmp", std::process::id(), std::thread::current().id()));
        let tmp = PathBuf::from(tmp.to_string_lossy().replace(['(', ')'], ""));
        let written = std::fs::File::create_new(&tmp)
            .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
            .map_err(|e| io("cannot write", &tmp, e));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io("cannot replace", &path, e)
        })
    }
}

fn file_text(text: serde_json::Result<String>) -> Result<String> {
    text.map_err(|e| Error::InvalidArgument(format!("cannot encode the verdicts: {e}")))
}

/// The timed shape's N: `$TRIMUL_VALIDATION_N` if it is a number from 8 to 4096, else
/// [`DEFAULT_TIMING_N`].
pub fn timing_n() -> usize {
    std::env::var(TIMING_N_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (8..=4096).contains(n))
        .unwrap_or(DEFAULT_TIMING_N)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(kernel: &str) -> VerdictKey {
        VerdictKey {
            backend: "hip".into(),
            device: "Fake".into(),
            target: "gfx942:sramecc+:xnack-".into(),
            driver: "6.3".into(),
            library: "rocBLAS 4.3.0".into(),
            path: "output_projection (MFMA)".into(),
            kernel: kernel.into(),
            class: "C=128 H=128".into(),
            trimul: "0.1.0".into(),
            procedure: "v1 N=256".into(),
        }
    }

    fn case(passed: bool, bad: usize) -> CaseOutcome {
        CaseOutcome { case: "af3 n19".into(), passed, bad, checked: 100, rel_l2: 1e-3 }
    }

    #[test]
    fn a_path_is_used_only_when_it_passed_every_case_and_won() {
        let d = |cases, f, b| Verdict::decide(key("k"), cases, f, b, "B=1 N=256".into());
        assert!(d(vec![case(true, 0), case(true, 0)], Some(1.0), Some(2.0)).used);
        let lost = d(vec![case(true, 0)], Some(2.0), Some(1.0));
        assert!(lost.passed && !lost.used && lost.reason.contains("not faster"), "{}", lost.reason);
        assert!(!d(vec![case(true, 0)], Some(0.99), Some(1.0)).used, "a 1% gain is within the noise");
        let wrong = d(vec![case(true, 0), case(false, 3)], Some(1.0), Some(2.0));
        assert!(!wrong.passed && !wrong.used && wrong.reason.contains("3 of 100"), "{}", wrong.reason);
        assert!(!d(vec![], Some(1.0), Some(2.0)).used, "no cases");
        let e = Verdict::not_run(key("k"), "the validation run failed: out of memory".into());
        assert!(!e.passed && !e.used && e.reason.contains("out of memory"), "{e:?}");
        assert!(!d(vec![case(true, 0)], None, Some(2.0)).used, "not timed");
        assert!(!d(vec![case(true, 0)], Some(f64::NAN), Some(2.0)).used, "NaN time");
    }

    #[test]
    fn fingerprints_depend_on_every_byte_and_the_split() {
        assert_eq!(fingerprint(&[b"abc"]), fingerprint(&[b"abc"]));
        assert_ne!(fingerprint(&[b"abc"]), fingerprint(&[b"abd"]));
        assert_ne!(fingerprint(&[b"ab", b"c"]), fingerprint(&[b"a", b"bc"]));
        assert_eq!(fingerprint(&[]).len(), 16);
    }

    #[test]
    fn the_store_keeps_verdicts_by_key_and_forgives_bad_files() {
        let dir = std::env::temp_dir().join(format!("trimul-verdicts-{}-{:x}", std::process::id(), rand_tag()));
        let store = VerdictStore::at(&dir);
        assert_eq!(store.load(&key("a")), None, "empty store");
        let v = Verdict::decide(key("a"), vec![case(true, 0)], Some(1.0), Some(2.0), "B=1 N=16".into());
        store.save(&v).unwrap();
        let w = Verdict::decide(key("b"), vec![case(false, 1)], None, Some(2.0), "B=1 N=16".into());
        store.save(&w).unwrap();
        assert_eq!(store.load(&key("a")), Some(v.clone()));
        assert_eq!(store.load(&key("b")), Some(w));
        assert_eq!(store.load(&key("c")), None, "another kernel asks again");
        assert_eq!(store.all().len(), 2);
        // A damaged or foreign file holds no verdicts; the next save replaces it.
        std::fs::write(store.path().unwrap(), "{ not json").unwrap();
        assert_eq!(store.load(&key("a")), None);
        store.save(&v).unwrap();
        assert_eq!(store.load(&key("a")), Some(v));
        store.remove(&key("a")).unwrap();
        assert_eq!(store.load(&key("a")), None, "removed");
        assert_eq!(store.all().len(), 0);
        store.remove(&key("a")).unwrap();
        let leftovers: Vec<_> =
            std::fs::read_dir(&dir).unwrap().filter(|e| e.as_ref().unwrap().path() != store.path().unwrap()).collect();
        assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
        assert_eq!(VerdictStore::none().load(&key("a")), None);
        VerdictStore::none().save(&Verdict::decide(key("a"), vec![], None, None, String::new())).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn rand_tag() -> u128 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
    }
}
