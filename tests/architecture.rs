//! The module import graph of `src/` (issue 27): no import cycles and no module importing one of
//! a higher layer, beyond the debt listed in [`KNOWN_DEBT`]. The list may only shrink: an entry
//! that no longer occurs fails the check too, so that whoever pays a debt also deletes it.
//!
//! Layers, bottom to top ([`LAYERS`]): the foundation (error, problem, weights, device I/O
//! descriptors, byte counts, …), the FFI wrappers (`cuda/driver.rs`, `cuda/blas.rs`,
//! `hip/sys.rs`, `hip/result.rs`, `hip/blas.rs`), the backends, the public API (`lib.rs`,
//! `layer.rs`), and on top the report and the CLI. A module may import its own layer and those
//! below it. A third rule keeps the parts of a vendor backend ([`FACADES`]) from importing the
//! backend's root (`cuda/mod.rs`, `hip/mod.rs`): the root is what the rest of the crate sees, the
//! parts sit below it.
//!
//! The graph is built by plain text scanning, with no dependency: one node per file module
//! (inline `mod x { }` blocks belong to their file), found from `src/lib.rs` and `src/main.rs`
//! through `mod x;` declarations. Comments, string and character literals and every
//! `#[cfg(test)]` item (test modules, test-only files such as `hip/host_tests.rs`) are left out:
//! tests may import anything. An edge `a -> b` is a path in `a` that names module `b` or an item
//! in it: paths starting with `crate::`, `self::`, `super::`, a child module declared in the
//! same file (`cpu::CpuBackend` in `backend/mod.rs`) or, in the binary, `trimul::`; `use`
//! groups (`use crate::a::{b, c::{d, self}}`) are expanded. A path through `lib.rs`'s
//! re-exports (`crate::Result`) counts as an import of the module that defines the item
//! (`error`): the root is a facade of aliases. A path that names a parent module (`super::X`)
//! is an edge to the parent, since `X` is defined or re-exported there. What text scanning
//! cannot see are method calls: `cuda/mod.rs` calls `enqueue`, a method `cuda/forward.rs`
//! defines, without naming `forward`; such dependencies are not edges.
//!
//! `cargo test --test architecture -- --nocapture` prints the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layers, bottom to top: a module may import modules of its own layer and the layers below.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Layer {
    /// Used by all: errors, the problem's rules, weights, caller device-I/O descriptors, …
    Foundation,
    /// Thin wrappers over the vendor libraries (and the GEMM descriptions they take).
    Ffi,
    /// Plans: how a forward is split and laid out, independent of any backend.
    Plan,
    /// The `Backend` trait, the CPU backend and the vendor backends' plans and launches.
    Backend,
    /// The public API: the layer and the crate root's re-exports.
    Api,
    /// The benchmark report and the command line.
    Top,
}

/// Each module's layer: the entry naming the module or its longest-named ancestor. A module
/// that matches no entry fails the check (a new top-level module needs a layer).
const LAYERS: &[(&str, Layer)] = &[
    ("error", Layer::Foundation),
    ("problem", Layer::Foundation),
    ("weights", Layer::Foundation),
    ("gradients", Layer::Foundation),
    ("device_io", Layer::Foundation),
    ("hostmem", Layer::Foundation),
    ("rand", Layer::Foundation),
    ("named", Layer::Foundation),
    ("finite", Layer::Foundation),
    ("alloc_tracker", Layer::Foundation),
    ("units", Layer::Foundation),
    // Fast-path verdicts: their rule, key and file, independent of any backend.
    ("validation", Layer::Foundation),
    // Safetensors naming schemes: files to `Weights`, used by the CLI, the report and tests.
    ("io", Layer::Foundation),
    // The kernel sources and binaries build.rs embeds: data, no code of the backends.
    ("kernels", Layer::Foundation),
    // The f64 oracle and the GPU MODE cases: pure functions of problems and weights.
    ("reference", Layer::Foundation),
    ("reference::gradients", Layer::Foundation),
    ("suite", Layer::Foundation),
    ("backend::cuda::driver", Layer::Ffi),
    ("backend::cuda::blas", Layer::Ffi),
    // CUDA-graph capture and replay of launches, which the kernel and BLAS wrappers record into.
    ("backend::cuda::launch_graph", Layer::Ffi),
    ("backend::hip::sys", Layer::Ffi),
    ("backend::hip::result", Layer::Ffi),
    ("backend::hip::blas", Layer::Ffi),
    // The gfx names the HIP runtime reports, normalised: read by `hip/result.rs`.
    ("backend::hip::arch", Layer::Ffi),
    // The column-major GEMM descriptions both BLAS wrappers take.
    ("backend::gemm", Layer::Ffi),
    // NCCL communicators (loaded at run time) for the sharded forward.
    ("collective", Layer::Ffi),
    // Plans: budgets, passes, chunks and buffer layouts, for every backend.
    ("plan", Layer::Plan),
    ("backend", Layer::Backend),
    // The backend chosen at run time: names every backend, used by the layer and the CLI.
    ("device", Layer::Api),
    ("layer", Layer::Api),
    // The forward sharded across GPUs: ranks over the CUDA backend and a communicator each.
    ("sharded", Layer::Api),
    // Host staging for the layer's host forwards: above the backends, beside the layer.
    ("staging", Layer::Api),
    (LIB_ROOT, Layer::Api),
    ("report", Layer::Top),
    (BIN_ROOT, Layer::Top),
    ("cli", Layer::Top),
];

/// Modules whose descendants must not import them: a vendor backend's root, which its parts
/// (plans, launches, FFI wrappers) sit below.
const FACADES: &[&str] = &["backend::cuda", "backend::hip"];

/// Which rule an entry of [`KNOWN_DEBT`] breaks.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Rule {
    /// A strongly connected set of modules: `what` lists them, sorted, joined by ", ".
    Cycle,
    /// An import from a higher layer: `what` is `"a -> b"`.
    Upward,
    /// A part of a vendor backend importing the backend's root: `what` is `"a -> b"`.
    FacadeImport,
}

/// A known violation, to be removed by a later step of issue 27.
struct Debt {
    rule: Rule,
    what: &'static str,
    why: &'static str,
}

/// What the crate still breaks. Entries go away as they are fixed; nothing is added here
/// without a reason, and an entry that no longer occurs fails the check.
const KNOWN_DEBT: &[Debt] = &[];

const LIB_ROOT: &str = "lib";
const BIN_ROOT: &str = "main";

#[test]
fn module_graph_has_no_new_cycles_or_upward_imports() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let graph = Graph::build(&read_sources(root), &[("src/lib.rs", Crate::Lib), ("src/main.rs", Crate::Bin)]);
    eprintln!("{graph}");
    // The scan found the crate (a broken scan would otherwise pass with an empty graph).
    for m in ["layer", "backend::cuda::forward", "backend::hip::sys", "cli::bench", "report::schema", "units"] {
        assert!(graph.edges.contains_key(m), "module {m} not found; modules: {:?}", graph.edges.keys());
    }
    assert!(graph.edges["layer"].contains("backend::cpu"), "layer -> backend::cpu missing: {graph}");
    let problems = check(&graph, KNOWN_DEBT);
    assert!(problems.is_empty(), "module graph (issue 27, tests/architecture.rs):\n{}", problems.join("\n"));
}

#[test]
fn every_debt_entry_is_well_formed_and_gives_a_reason() {
    for d in KNOWN_DEBT {
        assert!(!d.why.trim().is_empty(), "{:?} {}: no reason", d.rule, d.what);
        match d.rule {
            Rule::Cycle => {
                let names: Vec<&str> = d.what.split(", ").collect();
                let mut sorted = names.clone();
                sorted.sort_unstable();
                assert!(names.len() > 1 && names == sorted, "a cycle lists its modules sorted: {}", d.what);
            }
            Rule::Upward | Rule::FacadeImport => assert!(d.what.contains(" -> "), "an edge is `a -> b`: {}", d.what),
        }
    }
}

// ----------------------------------------------------------------------------- the checks

/// Every violation of the rules that [`KNOWN_DEBT`]-like `debt` does not list, and every entry
/// of `debt` that no longer occurs; empty when the graph is as allowed.
fn check(graph: &Graph, debt: &[Debt]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut found: BTreeMap<(Rule, String), String> = BTreeMap::new();
    for scc in graph.cycles() {
        let inside: Vec<String> = scc
            .iter()
            .flat_map(|a| graph.edges[a].iter().filter(|b| scc.contains(*b)).map(move |b| format!("{a} -> {b}")))
            .collect();
        found.insert((Rule::Cycle, scc.join(", ")), format!("edges: {}", inside.join(", ")));
    }
    for (a, targets) in &graph.edges {
        let Some(la) = layer_of(a) else {
            problems.push(format!("module {a} has no layer: add it to LAYERS in tests/architecture.rs"));
            continue;
        };
        for b in targets {
            let Some(lb) = layer_of(b) else { continue };
            if lb > la {
                found.insert((Rule::Upward, format!("{a} -> {b}")), format!("{la:?} imports {lb:?}"));
            }
            if FACADES.contains(&b.as_str()) && a.starts_with(&format!("{b}::")) {
                found.insert((Rule::FacadeImport, format!("{a} -> {b}")), "a part imports its backend's root".into());
            }
        }
    }
    let listed: BTreeSet<(Rule, String)> = debt.iter().map(|d| (d.rule, d.what.to_string())).collect();
    for ((rule, what), detail) in &found {
        if !listed.contains(&(*rule, what.clone())) {
            problems.push(format!("new {rule:?}: {what} ({detail})"));
        }
    }
    for (rule, what) in &listed {
        if !found.contains_key(&(*rule, what.clone())) {
            problems.push(format!(
                "{rule:?} {what} no longer occurs: delete it from KNOWN_DEBT (or, if it changed shape, list it as it is now)"
            ));
        }
    }
    problems
}

/// The layer of `module`: its own entry in [`LAYERS`] or its nearest ancestor's.
fn layer_of(module: &str) -> Option<Layer> {
    LAYERS
        .iter()
        .filter(|(prefix, _)| module == *prefix || module.starts_with(&format!("{prefix}::")))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|&(_, layer)| layer)
}

// ------------------------------------------------------------------------------- the graph

/// Which crate of the package a module belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Crate {
    /// `src/lib.rs` and its modules.
    Lib,
    /// `src/main.rs` and its modules (the CLI); `trimul::` paths there name the library.
    Bin,
}

/// A file module: its crate and its path from the crate root (empty for the root).
type ModId = (Crate, Vec<String>);

fn display(id: &ModId) -> String {
    match (id.0, id.1.is_empty()) {
        (Crate::Lib, true) => LIB_ROOT.into(),
        (Crate::Bin, true) => BIN_ROOT.into(),
        _ => id.1.join("::"),
    }
}

/// One file module, scanned.
struct FileModule {
    /// Code tokens, comments, literals and `#[cfg(test)]` items removed.
    tokens: Vec<Tok>,
    /// Child modules it declares with `mod x;` (not those under `#[cfg(test)]`).
    children: BTreeSet<String>,
}

/// The file-level import graph, by module name (`backend::cuda`, `lib`, `main`, `cli::bench`).
struct Graph {
    edges: BTreeMap<String, BTreeSet<String>>,
}

impl Graph {
    /// Scans the crates rooted at `roots` (paths into `files`, which maps paths relative to the
    /// package root, `src/…`, to their text).
    fn build(files: &BTreeMap<PathBuf, String>, roots: &[(&str, Crate)]) -> Graph {
        let mut modules: BTreeMap<ModId, FileModule> = BTreeMap::new();
        for &(root, krate) in roots {
            let mut todo = vec![((krate, Vec::new()), PathBuf::from(root))];
            while let Some((id, path)) = todo.pop() {
                let text = files.get(&path).unwrap_or_else(|| panic!("{} not found", path.display()));
                let module = scan_file(text, &path);
                for child in &module.children {
                    let mut child_id = id.clone();
                    child_id.1.push(child.clone());
                    todo.push((child_id, child_file(files, &path, child)));
                }
                modules.insert(id, module);
            }
        }
        let mut names = BTreeSet::new();
        for id in modules.keys() {
            assert!(names.insert(display(id)), "two modules are both called {}", display(id));
        }
        let reexports = root_reexports(&modules);
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (id, module) in &modules {
            let from = display(id);
            let targets = edges.entry(from.clone()).or_default();
            for (scope, path) in references(&module.tokens, &module.children) {
                let mut cur = id.1.clone();
                cur.extend(scope);
                if let Some(target) = resolve(&modules, &reexports, id.0, &cur, &path, 0) {
                    let to = display(&target);
                    if to != from {
                        targets.insert(to);
                    }
                }
            }
        }
        Graph { edges }
    }

    /// The strongly connected sets of more than one module (Tarjan), each sorted.
    fn cycles(&self) -> Vec<Vec<String>> {
        struct State<'a> {
            graph: &'a Graph,
            index: BTreeMap<&'a str, usize>,
            low: BTreeMap<&'a str, usize>,
            stack: Vec<&'a str>,
            on_stack: BTreeSet<&'a str>,
            sccs: Vec<Vec<String>>,
        }
        fn visit<'a>(s: &mut State<'a>, v: &'a str) {
            let i = s.index.len();
            s.index.insert(v, i);
            s.low.insert(v, i);
            s.stack.push(v);
            s.on_stack.insert(v);
            let graph = s.graph;
            for w in graph.edges.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let lw = s.low[w];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if s.on_stack.contains(w) {
                    let iw = s.index[w];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if s.low[v] == s.index[v] {
                let mut scc = Vec::new();
                loop {
                    let w = s.stack.pop().unwrap();
                    s.on_stack.remove(w);
                    scc.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    s.sccs.push(scc);
                }
            }
        }
        let mut s = State {
            graph: self,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            sccs: Vec::new(),
        };
        for v in self.edges.keys() {
            if !s.index.contains_key(v.as_str()) {
                visit(&mut s, v);
            }
        }
        s.sccs.sort();
        s.sccs
    }
}

impl std::fmt::Display for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (a, targets) in &self.edges {
            let targets: Vec<&str> = targets.iter().map(String::as_str).collect();
            writeln!(f, "{a} -> {}", targets.join(", "))?;
        }
        Ok(())
    }
}

/// Every `.rs` file under `root/src`, by its path relative to `root`.
fn read_sources(root: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                out.insert(path.strip_prefix(root).unwrap().to_path_buf(), text);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, &root.join("src"), &mut out);
    out
}

/// The file of child module `name` declared in `parent`: `dir/name.rs` or `dir/name/mod.rs`,
/// where `dir` is the parent's directory for `mod.rs`, `lib.rs` and `main.rs`, else the
/// directory named after the parent file.
fn child_file(files: &BTreeMap<PathBuf, String>, parent: &Path, name: &str) -> PathBuf {
    let stem = parent.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    let dir = match stem {
        "mod" | "lib" | "main" => parent.parent().unwrap().to_path_buf(),
        _ => parent.with_extension(""),
    };
    let candidates = [dir.join(format!("{name}.rs")), dir.join(name).join("mod.rs")];
    let found: Vec<&PathBuf> = candidates.iter().filter(|p| files.contains_key(*p)).collect();
    match found.as_slice() {
        [one] => (*one).clone(),
        _ => panic!("mod {name} in {}: expected exactly one of {candidates:?}", parent.display()),
    }
}

/// What the crate root re-exports (`pub use backend::{Backend, Device}`): the name callers use,
/// and the path (relative to the root) it stands for.
fn root_reexports(modules: &BTreeMap<ModId, FileModule>) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let Some(root) = modules.get(&(Crate::Lib, Vec::new())) else { return out };
    let t = &root.tokens;
    for i in 0..t.len() {
        if t[i].is("use") && i > 0 && t[i - 1].is("pub") {
            let (paths, _) = parse_use_tree(t, i + 1, Vec::new());
            for u in paths {
                if let Some(name) = u.alias.clone().or_else(|| u.path.last().cloned()) {
                    out.insert(name, u.path);
                }
            }
        }
    }
    out
}

/// The file module `path` names, seen from module `cur` (the file's path and the inline
/// modules around the reference) of crate `krate`: the longest prefix of the absolute path that
/// is a file module, or, through the library root's re-exports, the module that defines the
/// item. `None` for paths that name no module of the package (`std::…`, a local variable).
fn resolve(
    modules: &BTreeMap<ModId, FileModule>,
    reexports: &BTreeMap<String, Vec<String>>,
    krate: Crate,
    cur: &[String],
    path: &[String],
    depth: usize,
) -> Option<ModId> {
    let (mut krate, mut abs, mut rest) = (krate, Vec::new(), path);
    match path.first()?.as_str() {
        "crate" => rest = &path[1..],
        "trimul" if krate == Crate::Bin => (krate, rest) = (Crate::Lib, &path[1..]),
        "self" | "super" => {
            abs = cur.to_vec();
            while let Some(first) = rest.first() {
                match first.as_str() {
                    "self" => {}
                    "super" => {
                        abs.pop().unwrap_or_else(|| panic!("`super` above the crate root in {path:?}"));
                    }
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        // A child module of the current one, named without `self::` (the caller passes only
        // names it declares).
        _ => abs = cur.to_vec(),
    }
    abs.extend(rest.iter().cloned());
    let k = (0..=abs.len()).rev().find(|&k| modules.contains_key(&(krate, abs[..k].to_vec())))?;
    if k == 0 && krate == Crate::Lib && !abs.is_empty() {
        if let Some(target) = reexports.get(&abs[0]) {
            assert!(depth < 8, "re-exports of the crate root loop at {path:?}");
            return resolve(modules, reexports, Crate::Lib, &[], target, depth + 1);
        }
    }
    Some((krate, abs[..k].to_vec()))
}

// ------------------------------------------------------------------------------ the scanner

/// A code token: an identifier (or keyword, or number), `::`, or one punctuation character.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

impl Tok {
    fn is(&self, word: &str) -> bool {
        matches!(self, Tok::Ident(s) if s == word)
    }

    fn ident(&self) -> Option<&str> {
        match self {
            Tok::Ident(s) => Some(s),
            _ => None,
        }
    }
}

/// Scans one file: its code tokens without `#[cfg(test)]` items, and the child modules it
/// declares.
fn scan_file(text: &str, path: &Path) -> FileModule {
    let tokens = without_test_items(tokenize(&code_only(text)));
    let mut children = BTreeSet::new();
    for i in 0..tokens.len() {
        if tokens[i].is("path") && i >= 2 && tokens[i - 1] == Tok::Punct('[') && tokens[i - 2] == Tok::Punct('#') {
            panic!("{}: #[path] outside test code is not supported by this scan", path.display());
        }
        if tokens[i].is("mod") && tokens.get(i + 2) == Some(&Tok::Punct(';')) {
            let name = tokens[i + 1].ident().unwrap_or_else(|| panic!("{}: odd `mod` declaration", path.display()));
            children.insert(name.to_string());
        }
    }
    FileModule { tokens, children }
}

/// `src` with comments removed and the contents of string and character literals blanked
/// (`"…"` becomes `""`, `'…'` becomes `' '`), so that neither can look like code.
fn code_only(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        // Whether an `r` here starts a token: after a non-identifier character, or after the `b`
        // or `c` of a raw byte or C string (`br"…"`, `cr#"…"#`) that itself starts one.
        let prev_ident =
            i > 0 && ident_char(c[i - 1]) && !(matches!(c[i - 1], 'b' | 'c') && (i < 2 || !ident_char(c[i - 2])));
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            // Block comments nest in Rust.
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c[i] == 'r' && !prev_ident && matches!(c.get(i + 1), Some('"' | '#')) && raw_string_start(&c, i + 1) {
            // r"…", r#"…"# (and br/cr forms, whose b/c was pushed as an identifier character).
            let mut j = i + 1;
            let mut hashes = 0;
            while c[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1; // the opening quote
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (1..=hashes).all(|h| c.get(j + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' && c.get(i + 1) == Some(&'\\') {
            // An escaped character literal: '\n', '\'', '\u{…}': the quote, the backslash and
            // the escaped character, then up to the closing quote.
            i += 3;
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else if c[i] == '\'' && c.get(i + 2) == Some(&'\'') {
            i += 3;
            out.push_str("' '");
        } else {
            // Anything else, lifetimes and labels ('a) included, is code.
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Whether `#`s from `c[i]` on end in a `"`: a raw string after an `r`, not a raw identifier.
fn raw_string_start(c: &[char], mut i: usize) -> bool {
    while c.get(i) == Some(&'#') {
        i += 1;
    }
    c.get(i) == Some(&'"')
}

fn tokenize(code: &str) -> Vec<Tok> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// `tokens` without the items marked `#[cfg(test)]` (or `#[cfg(all(test, …))]`): from the
/// attribute to the item's `;` or closing `}`.
fn without_test_items(tokens: Vec<Tok>) -> Vec<Tok> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        let Some(after) = test_attribute_end(&tokens, i) else {
            out.push(tokens[i].clone());
            i += 1;
            continue;
        };
        let mut j = after;
        // Further attributes of the same item.
        while tokens.get(j) == Some(&Tok::Punct('#')) && tokens.get(j + 1) == Some(&Tok::Punct('[')) {
            j = matching(&tokens, j + 1) + 1;
        }
        // The item: up to a `;` outside brackets, or through its first `{ … }`.
        while j < tokens.len() {
            match tokens[j] {
                Tok::Punct(';') => break,
                Tok::Punct('(' | '[') => j = matching(&tokens, j),
                Tok::Punct('{') => {
                    j = matching(&tokens, j);
                    break;
                }
                _ => {}
            }
            j += 1;
        }
        i = j + 1;
    }
    out
}

/// If `tokens[i..]` starts with `#[cfg(test)]` or `#[cfg(all(test, …))]`, the index after it.
fn test_attribute_end(tokens: &[Tok], i: usize) -> Option<usize> {
    let t = |k: usize| tokens.get(i + k);
    if t(0) != Some(&Tok::Punct('#')) || t(1) != Some(&Tok::Punct('[')) || !t(2)?.is("cfg") {
        return None;
    }
    let close = matching(tokens, i + 1);
    let inner: Vec<&Tok> = tokens[i + 4..close - 1].iter().collect();
    let test_only = match inner.as_slice() {
        [only] => only.is("test"),
        [all, Tok::Punct('('), first, ..] => all.is("all") && first.is("test"),
        _ => false,
    };
    test_only.then_some(close + 1)
}

/// The index of the bracket closing the one at `open`.
fn matching(tokens: &[Tok], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        match t {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    tokens.len() - 1
}

/// One path a `use` declaration brings in, expanded from its groups, and its `as` name.
#[derive(Debug, PartialEq, Eq)]
struct UsePath {
    path: Vec<String>,
    alias: Option<String>,
}

/// Parses the use tree at `tokens[i..]` with the path `prefix` before it: the paths it names
/// (`a::{b, c::{d, self}}` gives `a::b`, `a::c::d`, `a::c`; a glob gives its module) and the
/// index after the tree.
fn parse_use_tree(tokens: &[Tok], mut i: usize, mut prefix: Vec<String>) -> (Vec<UsePath>, usize) {
    if tokens.get(i) == Some(&Tok::PathSep) {
        i += 1; // `use ::std::…`
    }
    loop {
        match tokens.get(i) {
            Some(Tok::Ident(name)) if name == "self" && !prefix.is_empty() => i += 1,
            Some(Tok::Ident(name)) => {
                prefix.push(name.clone());
                i += 1;
            }
            Some(Tok::Punct('{')) => {
                let mut out = Vec::new();
                i += 1;
                while tokens.get(i).is_some_and(|t| *t != Tok::Punct('}')) {
                    let (paths, next) = parse_use_tree(tokens, i, prefix.clone());
                    out.extend(paths);
                    i = next;
                    if tokens.get(i) == Some(&Tok::Punct(',')) {
                        i += 1;
                    }
                }
                return (out, i + 1);
            }
            Some(Tok::Punct('*')) => return (vec![UsePath { path: prefix, alias: None }], i + 1),
            _ => return (Vec::new(), i),
        }
        match tokens.get(i) {
            Some(Tok::PathSep) => i += 1,
            Some(t) if t.is("as") => {
                let alias = tokens.get(i + 1).and_then(Tok::ident).map(str::to_string);
                return (vec![UsePath { path: prefix, alias }], i + 2);
            }
            _ => return (vec![UsePath { path: prefix, alias: None }], i),
        }
    }
}

/// Every path in `tokens` that may name a module of the package, with the inline modules it
/// sits in: `use` trees, and paths of two or more segments starting with `crate`, `self`,
/// `super`, `trimul` or a child module in `children` (only outside inline modules, where those
/// names are in scope).
fn references(tokens: &[Tok], children: &BTreeSet<String>) -> Vec<(Vec<String>, Vec<String>)> {
    let mut out = Vec::new();
    // Inline modules around the current token: name and the brace depth inside them.
    let mut scope: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let names = |scope: &[(String, usize)]| scope.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    while i < tokens.len() {
        match &tokens[i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                if scope.last().is_some_and(|&(_, d)| d == depth) {
                    scope.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(w) if w == "mod" && tokens.get(i + 2) == Some(&Tok::Punct('{')) => {
                if let Some(name) = tokens.get(i + 1).and_then(Tok::ident) {
                    scope.push((name.to_string(), depth + 1));
                }
            }
            Tok::Ident(w) if w == "use" => {
                let (paths, next) = parse_use_tree(tokens, i + 1, Vec::new());
                for u in paths {
                    if starts_module_path(&u.path, children, scope.is_empty()) {
                        out.push((names(&scope), u.path));
                    }
                }
                i = next;
                continue;
            }
            Tok::Ident(first) if tokens.get(i + 1) == Some(&Tok::PathSep) => {
                let preceded = i > 0 && matches!(tokens[i - 1], Tok::PathSep | Tok::Punct('$' | '.'));
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while tokens.get(j) == Some(&Tok::PathSep) {
                    match tokens.get(j + 1).and_then(Tok::ident) {
                        Some(seg) => path.push(seg.to_string()),
                        None => break,
                    }
                    j += 2;
                }
                if !preceded && starts_module_path(&path, children, scope.is_empty()) {
                    out.push((names(&scope), path));
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Whether a path may name a module of the package (see [`references`]).
fn starts_module_path(path: &[String], children: &BTreeSet<String>, at_file_level: bool) -> bool {
    match path.first().map(String::as_str) {
        Some("crate" | "self" | "super" | "trimul") => true,
        Some(name) => at_file_level && path.len() > 1 && children.contains(name),
        None => false,
    }
}

// ------------------------------------------------------------------- the scanner's own tests

fn files(list: &[(&str, &str)]) -> BTreeMap<PathBuf, String> {
    list.iter().map(|(p, t)| (PathBuf::from(p), t.to_string())).collect()
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn use_groups_expand_to_every_path() {
    let tokens = tokenize("crate::a::{b, c::{d, self}, e as f, g::*};");
    let (paths, next) = parse_use_tree(&tokens, 0, Vec::new());
    let got: Vec<(Vec<String>, Option<String>)> = paths.into_iter().map(|u| (u.path, u.alias)).collect();
    assert_eq!(
        got,
        vec![
            (strings(&["crate", "a", "b"]), None),
            (strings(&["crate", "a", "c", "d"]), None),
            (strings(&["crate", "a", "c"]), None),
            (strings(&["crate", "a", "e"]), Some("f".into())),
            (strings(&["crate", "a", "g"]), None),
        ]
    );
    assert_eq!(tokens[next], Tok::Punct(';'));
}

#[test]
fn comments_literals_and_test_items_are_not_code() {
    let text = r###"
        use crate::a; // use crate::b;
        /* use crate::c; /* nested */ use crate::d; */
        const S: &str = "crate::e::{";
        const R: &str = r#"crate::f "quoted" }"#;
        const C: char = '{';
        const Q: char = '\'';
        const U: char = '\u{7B}';
        const B: &[u8] = br#"crate::n { "#;
        fn f<'a>(x: &'a str) -> &'a str { crate::g::h(x) }
        #[cfg(test)]
        mod tests { use crate::i; }
        #[cfg(all(test, feature = "x"))]
        fn only_in_tests() { crate::j::k() }
        #[cfg(not(test))]
        fn not_in_tests() { crate::l::m() }
        #[cfg(test)]
        #[path = "elsewhere.rs"]
        mod fixtures;
    "###;
    let module = scan_file(text, Path::new("src/x.rs"));
    let found: Vec<String> =
        references(&module.tokens, &module.children).into_iter().map(|(_, p)| p[1].clone()).collect();
    assert_eq!(found, strings(&["a", "g", "l"]));
    assert!(module.children.is_empty(), "a test-only `mod` is no child: {:?}", module.children);
}

#[test]
fn paths_resolve_through_parents_children_inline_modules_and_root_reexports() {
    let graph = Graph::build(
        &files(&[
            ("src/lib.rs", "pub mod error; pub mod backend; pub use error::{Error, Result as R};"),
            ("src/error.rs", "pub struct Error; mod inner { use super::Error; }"),
            ("src/backend/mod.rs", "pub mod cpu; pub enum Device { Cpu(cpu::Cpu) } fn f() -> crate::R {}"),
            ("src/backend/cpu.rs", "use super::super::Error; pub struct Cpu; fn g(_: crate::backend::Device) {}"),
            ("src/main.rs", "mod cli; fn main() { cli::main() }"),
            ("src/cli/mod.rs", "use trimul::Error; pub fn main() { trimul::backend::cpu::Cpu; }"),
        ]),
        &[("src/lib.rs", Crate::Lib), ("src/main.rs", Crate::Bin)],
    );
    let edges = |m: &str| graph.edges[m].iter().cloned().collect::<Vec<_>>();
    assert_eq!(edges("lib"), strings(&["error"]));
    assert_eq!(edges("error"), Vec::<String>::new(), "inline `super` is the file itself");
    assert_eq!(edges("backend"), strings(&["backend::cpu", "error"]));
    assert_eq!(edges("backend::cpu"), strings(&["backend", "error"]));
    assert_eq!(edges("main"), strings(&["cli"]));
    assert_eq!(edges("cli"), strings(&["backend::cpu", "error"]));
    assert_eq!(graph.cycles(), vec![strings(&["backend", "backend::cpu"])]);
}

#[test]
fn a_new_upward_import_or_cycle_fails_and_so_does_paid_debt() {
    let layered = |error_rs: &str| {
        Graph::build(
            &files(&[
                ("src/lib.rs", "pub mod error; pub mod layer;"),
                ("src/error.rs", error_rs),
                ("src/layer.rs", "use crate::error::Error;"),
            ]),
            &[("src/lib.rs", Crate::Lib)],
        )
    };
    assert_eq!(check(&layered("pub struct Error;"), &[]), Vec::<String>::new());
    let problems = check(&layered("use crate::layer::Layer; pub struct Error;"), &[]);
    assert_eq!(
        problems,
        vec![
            "new Cycle: error, layer (edges: error -> layer, layer -> error)".to_string(),
            "new Upward: error -> layer (Foundation imports Api)".to_string(),
        ]
    );
    let debt = [Debt { rule: Rule::Upward, what: "error -> layer", why: "for this test" }];
    let problems = check(&layered("pub struct Error;"), &debt);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].starts_with("Upward error -> layer no longer occurs"), "{problems:?}");
}

#[test]
fn a_vendor_part_importing_its_root_fails() {
    let graph = Graph::build(
        &files(&[
            ("src/lib.rs", "pub mod backend;"),
            ("src/backend/mod.rs", "pub mod cuda;"),
            ("src/backend/cuda/mod.rs", "mod forward; pub struct CudaBackend;"),
            ("src/backend/cuda/forward.rs", "use super::CudaBackend;"),
        ]),
        &[("src/lib.rs", Crate::Lib)],
    );
    assert_eq!(
        check(&graph, &[]),
        vec![
            "new FacadeImport: backend::cuda::forward -> backend::cuda (a part imports its backend's root)".to_string()
        ]
    );
}
