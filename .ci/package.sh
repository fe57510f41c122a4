#!/usr/bin/env bash
# `cargo package` as a release would run it, from a clean clone of the committed HEAD (uncommitted
# changes are not in it, and neither is anything git ignores, such as .tools/): the file list has
# what building needs and none of what it should not ship, and the packaged crate builds on its own
# with every feature (cargo's verify step; the kernels compiled with whatever NVCC and
# TRIMUL_HIP_CLANG the environment names, else embedded as sources).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD"
export CARGO_TERM_COLOR=never
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

git clone -q --no-checkout "$root" "$tmp/trimul"
git -C "$tmp/trimul" checkout -q --detach "$(git rev-parse HEAD)"
cd "$tmp/trimul"

list="$(cargo package --locked --list 2>/dev/null)"
fail=0
need() { grep -qx "$1" <<<"$list" || { echo "package: $1 is missing from the package" >&2; fail=1; }; }
for f in Cargo.toml Cargo.lock build.rs LICENSE README.md CHANGELOG.md src/lib.rs src/main.rs; do
  need "$f"
done
# Everything build.rs and the crate read: every tracked file under these directories.
for f in $(git ls-files src common cuda hip benches examples); do
  need "$f"
done
# Nothing else: not the Python package, docs (perf JSON, logs), tests and their data, scripts, CI.
extra="$(grep -vE '^(src|common|cuda|hip|benches|examples)/|^(Cargo\.toml|Cargo\.toml\.orig|Cargo\.lock|build\.rs|LICENSE|README\.md|CHANGELOG\.md|\.cargo_vcs_info\.json)$' <<<"$list" || true)"
if [ -n "$extra" ]; then
  echo "package: files that should not be shipped:" >&2
  echo "$extra" >&2
  fail=1
fi
[ "$fail" -eq 0 ] || exit 1
echo "package: $(wc -l <<<"$list") files, the expected ones"

# The real thing. Deps built in the checkout's target directory are reused. The tests are not
# packaged, so cargo notes each one it leaves out; those notes are filtered.
CARGO_TARGET_DIR="$root/target" cargo package --locked --all-features 2>&1 \
  | grep -v "^warning: ignoring test .* is not included in the published package$" \
  | grep -vE "^\s+(Compiling|Checking) "
ls -l "$root"/target/package/trimul-*.crate

# docs.rs builds the packaged crate with every feature, no nvcc and no AMDGPU clang, and DOCS_RS
# set: build.rs must fall back to embedding the sources rather than fail.
pkg="$(ls -d "$root"/target/package/trimul-*/ | head -1)"
env -u NVCC -u TRIMUL_HIP_CLANG -u TRIMUL_REQUIRE_NVCC -u TRIMUL_REQUIRE_HIP_CLANG DOCS_RS=1 \
  CARGO_TARGET_DIR="$root/target" cargo doc --locked --no-deps --all-features --manifest-path "$pkg/Cargo.toml" 2>&1 \
  | grep -E "^(error|warning: trimul@)|Generated|Finished"
