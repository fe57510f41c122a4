//! Files: reads bounded by what a format allows, and outputs checked before the work and replaced
//! atomically.
//!
//! # Reading
//! Nothing is read whole without a bound. JSON documents (bench runs, anchors, tuning tables) are
//! read through [`read_text`] with a cap ([`MAX_JSON_BYTES`]); safetensors files are read through
//! their header (its length first, bounded, then the tensors it declares, checked against the
//! file's size), which needs a size, so they must be regular files ([`open_regular`]): a
//! directory, a pipe or a device is refused by name before anything is read.
//!
//! # Writing
//! A regular-file output is written to a temporary file in the same directory and renamed over
//! the output, so a failed write (a full disk) leaves the previous file as it was and never a
//! truncated one. The temporary file is created exclusively (`O_CREAT|O_EXCL`, which refuses a
//! symbolic link in its place) under an unpredictable name, so someone else who can write in the
//! directory cannot redirect the write by planting a link. The output path itself is followed
//! deliberately: a symbolic link stays a link and its target gets the file, and a device or a
//! pipe (`/dev/null`) is written into rather than replaced.
//!
//! A rename gives the output a new inode, so what belonged to the old one would be lost. The
//! replacement keeps the old file's permission bits, owner and group; a file whose owner or
//! group cannot be kept (another user's file), a file with other hard links (they would keep the
//! old data), and a write-protected file are refused with a message saying which.
//!
//! [`check_output`] runs the same checks (and creates and removes a probe file in the directory)
//! before a command starts its work, so a path that cannot be written fails in a second, not
//! after a benchmark; what only the write itself can find (a full disk) fails then, with the
//! previous file intact.

use std::ffi::OsStr;
use std::fs::{File, FileType, Metadata, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The largest JSON document trimul reads (bench runs, anchor lists, tuning tables). A bench run
/// of every suite shape is about 10 KB; a file a thousand times larger is not one.
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// Bytes per buffered write.
const WRITE_BUFFER: usize = 1 << 20;

fn file_err(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::File { path: path.display().to_string(), reason: reason.to_string() }
}

/// A test of a file's type, and the words for a file that passes it.
type FileKind = (fn(&FileType) -> bool, &'static str);

/// The kinds of file [`kind_of`] names, in the order it tries them.
const FILE_KINDS: [FileKind; 3] = [
    (FileType::is_dir, "a directory"),
    (FileType::is_file, "a regular file"),
    (FileType::is_symlink, "a symbolic link"),
];

/// The special files only Unix has, tried after [`FILE_KINDS`].
#[cfg(unix)]
const SPECIAL_FILE_KINDS: [FileKind; 4] = {
    use std::os::unix::fs::FileTypeExt;
    [
        (FileType::is_fifo, "a named pipe (FIFO)"),
        (FileType::is_char_device, "a character device"),
        (FileType::is_block_device, "a block device"),
        (FileType::is_socket, "a socket"),
    ]
};
#[cfg(not(unix))]
const SPECIAL_FILE_KINDS: [FileKind; 0] = [];

/// What kind of file `meta` describes, for messages: "a directory", "a named pipe (FIFO)", ...
pub(crate) fn kind_of(meta: &Metadata) -> &'static str {
    let ft = meta.file_type();
    FILE_KINDS.iter().chain(&SPECIAL_FILE_KINDS).find(|(is, _)| is(&ft)).map_or("not a regular file", |&(_, kind)| kind)
}

/// Reads a whole text file of at most `max_bytes` bytes; `what` names the document for messages
/// ("bench JSON file"). A regular file larger than the cap is refused from its size, before any
/// read; anything else (a pipe, `/dev/stdin`) is read up to the cap and refused past it, so
/// `/dev/zero` costs at most `max_bytes` of memory. A directory is refused by name.
pub fn read_text(path: impl AsRef<Path>, max_bytes: u64, what: &str) -> Result<String> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| file_err(path, format!("cannot open: {e}")))?;
    let meta = file.metadata().map_err(|e| file_err(path, format!("cannot stat: {e}")))?;
    if meta.is_dir() {
        return Err(file_err(path, format!("is a directory, not a {what}")));
    }
    if meta.is_file() && meta.len() > max_bytes {
        return Err(file_err(
            path,
            format!("is {} bytes, larger than any {what} (at most {max_bytes} bytes are read)", meta.len()),
        ));
    }
    let mut bytes = Vec::new();
    file.take(max_bytes + 1).read_to_end(&mut bytes).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    if bytes.len() as u64 > max_bytes {
        return Err(file_err(
            path,
            format!("{} yields more than {max_bytes} bytes, more than any {what}; stopped reading", kind_of(&meta)),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        file_err(
            path,
            format!("is not UTF-8 text (invalid byte at offset {}), so not a {what}", e.utf8_error().valid_up_to()),
        )
    })
}

/// Opens a regular file and returns it with its size. Anything else is refused by name before it
/// is opened (opening a FIFO would wait for a writer), with why a regular file is needed.
pub(crate) fn open_regular(path: &Path, what: &str) -> Result<(File, u64)> {
    let refuse = |meta: &Metadata| {
        file_err(
            path,
            format!(
                "is {}, not a regular file; a {what} is read through its header and offsets, which needs a \
                 file of known size (copy it to a file first)",
                kind_of(meta)
            ),
        )
    };
    let meta = std::fs::metadata(path).map_err(|e| file_err(path, format!("cannot open: {e}")))?;
    if !meta.is_file() {
        return Err(refuse(&meta));
    }
    let file = File::open(path).map_err(|e| file_err(path, format!("cannot open: {e}")))?;
    // The file opened may not be the one looked at, if the path changed in between.
    let meta = file.metadata().map_err(|e| file_err(path, format!("cannot stat: {e}")))?;
    if !meta.is_file() {
        return Err(refuse(&meta));
    }
    Ok((file, meta.len()))
}

// ---------------------------------------------------------------------------------------------
// Outputs
// ---------------------------------------------------------------------------------------------

/// Where an output path finally leads.
enum Target {
    /// A device, pipe or socket (`/dev/null`): written into, never replaced.
    Special(PathBuf),
    /// An existing regular file, replaced by rename; its metadata says what to keep.
    Replace(PathBuf, Metadata),
    /// Nothing there yet: created by rename.
    Create(PathBuf),
}

/// The file a path finally names: symbolic links followed (relative ones from their own folder)
/// up to 40 deep, as the kernel allows; a dangling link names its missing target.
fn follow_links(path: &Path) -> Result<PathBuf> {
    let mut t = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::read_link(&t) {
            Ok(next) if next.is_relative() => t = t.parent().unwrap_or(Path::new("")).join(next),
            Ok(next) => t = next,
            Err(_) => return Ok(t),
        }
    }
    Err(file_err(path, "too many levels of symbolic links"))
}

/// The directory a file path lives in (`.` for a bare name).
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Follows `path` to its target and classifies it, refusing what cannot be an output file.
fn resolve(path: &Path) -> Result<Target> {
    if path.as_os_str().as_encoded_bytes().last() == Some(&b'/') {
        return Err(file_err(path, "ends in '/', so it names a directory; give a file name"));
    }
    if path.file_name().is_none() {
        return Err(file_err(path, "names no file (it ends in '.' or '..'); give a file name"));
    }
    // The kernel's view first: it follows the magic links of /proc (`/dev/stdout` ->
    // /proc/self/fd/1 -> "pipe:[…]"), which read_link cannot, so a pipe is written into as such.
    if let Ok(m) = std::fs::metadata(path) {
        if !m.is_file() && !m.is_dir() {
            return Ok(Target::Special(path.to_path_buf()));
        }
    }
    let target = follow_links(path)?;
    let via =
        |t: &Path| if t == path { String::new() } else { format!(" (the symbolic link's target {})", t.display()) };
    match std::fs::symlink_metadata(&target) {
        Ok(m) if m.is_dir() => Err(file_err(path, format!("is a directory{}, not a file", via(&target)))),
        Ok(m) if m.is_file() => {
            check_replaceable(path, &m)?;
            Ok(Target::Replace(target, m))
        }
        Ok(_) => Ok(Target::Special(target)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let dir = dir_of(&target);
            match std::fs::metadata(dir) {
                Ok(d) if d.is_dir() => Ok(Target::Create(target)),
                Ok(d) => Err(file_err(path, format!("{} is {}, not a directory", dir.display(), kind_of(&d)))),
                Err(_) if target != path => Err(file_err(
                    path,
                    format!(
                        "is a symbolic link to {}, whose directory {} does not exist",
                        target.display(),
                        dir.display()
                    ),
                )),
                Err(_) => Err(file_err(path, format!("directory {} does not exist", dir.display()))),
            }
        }
        Err(e) => Err(file_err(path, format!("cannot inspect {}: {e}", target.display()))),
    }
}

/// Refuses an existing regular file that a rename would strip of something it has: write
/// protection, or its other names (hard links).
fn check_replaceable(path: &Path, meta: &Metadata) -> Result<()> {
    if meta.permissions().readonly() {
        return Err(file_err(
            path,
            format!(
                "is write-protected (mode {}); trimul does not replace a read-only file: make it writable or \
                 remove it first",
                mode_str(meta)
            ),
        ));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if meta.nlink() > 1 {
            return Err(file_err(
                path,
                format!(
                    "has {} hard links; writing it by rename would leave the other names with the old data, so \
                     trimul refuses: remove the other links or write to another name",
                    meta.nlink()
                ),
            ));
        }
    }
    Ok(())
}

fn mode_str(meta: &Metadata) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        format!("{:04o}", meta.permissions().mode() & 0o7777)
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        "read-only".to_string()
    }
}

/// A name no one can predict: SipHash under the per-process random keys of `RandomState`, over a
/// counter and the clock.
fn random_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.finish()
}

/// Creates `.<name>.<16 random hex digits>.tmp` in `dir` exclusively: `create_new` fails rather
/// than follow a symbolic link or open a file someone else made under that name. `private`
/// creates it 0600 (it will take an existing file's mode once written); otherwise the umask
/// applies, as for any new file.
fn create_temp(dir: &Path, name: &OsStr, private: bool) -> std::io::Result<(File, PathBuf)> {
    // Long names would push the temporary name past the file system's 255-byte limit.
    let stem: String = name.to_string_lossy().chars().take(64).collect();
    for _ in 0..16 {
        let tmp = dir.join(format!(".{stem}.{:016x}.tmp", random_suffix()));
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(if private { 0o600 } else { 0o666 });
        }
        #[cfg(not(unix))]
        let _ = private;
        match options.open(&tmp) {
            Ok(f) => return Ok((f, tmp)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "16 random temporary file names were all taken"))
}

/// Gives the new file `file` what the file it replaces had: owner and group (where they differ
/// from ours and we may change them), then the permission bits (after the owner, whose change
/// clears set-id bits). The error says what could not be kept.
fn adopt(file: &File, old: &Metadata) -> std::result::Result<(), String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let new = file.metadata().map_err(|e| format!("cannot stat the temporary file: {e}"))?;
        let uid = (new.uid() != old.uid()).then(|| old.uid());
        let gid = (new.gid() != old.gid()).then(|| old.gid());
        if uid.is_some() || gid.is_some() {
            std::os::unix::fs::fchown(file, uid, gid).map_err(|e| match uid {
                Some(u) => format!(
                    "is owned by uid {u}; the replacement, made by uid {}, cannot be given to that owner ({e}), and \
                     trimul does not take another user's file: write to another name",
                    new.uid()
                ),
                None => format!(
                    "belongs to group {}; the replacement cannot be given that group ({e}), so it would lose the \
                     group's access: write to another name",
                    old.gid()
                ),
            })?;
        }
    }
    file.set_permissions(old.permissions())
        .map_err(|e| format!("cannot give the replacement mode {}: {e}", mode_str(old)))
}

/// Checks that `path` can be written as an output, before the work that produces it: the checks
/// of the write itself (see the module docs of `io/files.rs`), and a probe file created and removed in
/// the directory, so a read-only directory or file system fails now.
pub fn check_output(path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    match resolve(path)? {
        Target::Special(_) => Ok(()),
        Target::Replace(target, old) => probe(path, &target, Some(&old)),
        Target::Create(target) => probe(path, &target, None),
    }
}

/// Creates and removes a temporary file beside `target`, giving it `old`'s owner and mode as the
/// real write will.
fn probe(path: &Path, target: &Path, old: Option<&Metadata>) -> Result<()> {
    let dir = dir_of(target);
    let name = target.file_name().unwrap_or(OsStr::new("output"));
    let (file, tmp) = create_temp(dir, name, old.is_some())
        .map_err(|e| file_err(path, format!("cannot create a file in {}: {e}", dir.display())))?;
    let kept = old.map_or(Ok(()), |old| adopt(&file, old));
    drop(file);
    // Best effort: the probe is ours and empty.
    let _ = std::fs::remove_file(&tmp);
    kept.map_err(|m| file_err(path, m))
}

/// Checks that `dir` is, or can be created as, a directory that files can be written in: an
/// existing non-directory is refused by name, and the nearest existing ancestor is probed.
pub fn check_output_dir(dir: impl AsRef<Path>) -> Result<()> {
    let dir = dir.as_ref();
    let mut probe_at = dir;
    loop {
        match std::fs::metadata(probe_at) {
            Ok(m) if m.is_dir() => break,
            Ok(m) if probe_at == dir => {
                return Err(file_err(dir, format!("is {}, not a directory", kind_of(&m))));
            }
            Ok(m) => {
                return Err(file_err(dir, format!("{} is {}, not a directory", probe_at.display(), kind_of(&m))));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                probe_at = match probe_at.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
            }
            Err(e) => return Err(file_err(dir, format!("cannot inspect {}: {e}", probe_at.display()))),
        }
    }
    let (file, tmp) = create_temp(probe_at, OsStr::new("probe"), true)
        .map_err(|e| file_err(dir, format!("cannot create a file in {}: {e}", probe_at.display())))?;
    drop(file);
    let _ = std::fs::remove_file(&tmp);
    Ok(())
}

/// Writes `path` as the [module docs](self) describe: `fill` writes the content into a buffered
/// writer; a regular file is replaced only once everything was written and synced.
pub(crate) fn write_atomically(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    let (target, old) = match resolve(path)? {
        Target::Special(target) => {
            let result = (|| {
                let mut w = BufWriter::with_capacity(WRITE_BUFFER, OpenOptions::new().write(true).open(&target)?);
                fill(&mut w)?;
                w.flush()
            })();
            return result.map_err(|e| file_err(path, format!("cannot write: {e}")));
        }
        Target::Replace(target, old) => (target, Some(old)),
        Target::Create(target) => (target, None),
    };
    let dir = dir_of(&target);
    let name = target.file_name().unwrap_or(OsStr::new("output"));
    let (file, tmp) = create_temp(dir, name, old.is_some())
        .map_err(|e| file_err(path, format!("cannot create a file in {}: {e}", dir.display())))?;
    let unchanged = if old.is_some() { "; the existing file is unchanged" } else { "" };
    let cleanup = |reason: String| {
        // Best effort: the temporary file is ours and useless after a failure.
        let _ = std::fs::remove_file(&tmp);
        file_err(path, reason)
    };
    if let Some(old) = &old {
        adopt(&file, old).map_err(cleanup)?;
    }
    let written = (|| {
        let mut w = BufWriter::with_capacity(WRITE_BUFFER, file);
        fill(&mut w)?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()
    })();
    written.map_err(|e| cleanup(format!("cannot write: {e}{unchanged}")))?;
    std::fs::rename(&tmp, &target)
        .map_err(|e| cleanup(format!("cannot rename the finished file into place: {e}{unchanged}")))?;
    // Best effort: makes the rename itself durable; some file systems cannot sync a directory.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically (see the module docs of `io/files.rs`).
pub fn write_file(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    write_atomically(path.as_ref(), |w| w.write_all(bytes))
}
