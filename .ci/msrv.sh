#!/usr/bin/env bash
# The declared rust-version of each crate (the library at the root, the Python bindings in
# python/) is at least every rust-version its dependencies declare, with every feature on and
# the committed Cargo.lock. Only one toolchain is installed here, so this compares the metadata
# (`cargo metadata`) rather than building with the old compiler; it catches a dependency (or a
# `cargo update`) that raises the floor without the manifest saying so.
#
# Every package of the resolve counts: normal, build and dev dependencies, on every platform
# (a superset of what a dependent crate builds, so it can only err on the safe side).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
meta="$(mktemp)"
trap 'rm -f "$meta"' EXIT

status=0
for manifest in Cargo.toml python/Cargo.toml; do
  cargo metadata --format-version 1 --all-features --locked --manifest-path "$manifest" >"$meta"
  python3 - "$meta" <<'EOF' || status=1
import json, sys

def ver(s):
    parts = [int(p) for p in s.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

m = json.load(open(sys.argv[1]))
members = set(m["workspace_members"])
pkgs = {p["id"]: p for p in m["packages"]}
resolved = {n["id"] for n in m["resolve"]["nodes"]}
bad = False
for mid in sorted(members):
    me = pkgs[mid]
    name, declared = me["name"], me.get("rust_version")
    if not declared:
        print(f"msrv: {name} declares no rust-version", file=sys.stderr)
        bad = True
        continue
    deps = [pkgs[i] for i in resolved if i not in members and pkgs[i].get("rust_version")]
    over = sorted((p for p in deps if ver(p["rust_version"]) > ver(declared)), key=lambda p: p["name"])
    for p in over:
        print(f"msrv: {name} declares rust-version {declared}, but {p['name']} {p['version']} "
              f"needs {p['rust_version']}", file=sys.stderr)
    bad = bad or bool(over)
    if deps and not over:
        top = max(deps, key=lambda p: ver(p["rust_version"]))
        print(f"msrv: {name} rust-version {declared} >= every dependency's "
              f"(highest: {top['name']} {top['version']}, {top['rust_version']})")
sys.exit(1 if bad else 0)
EOF
done
exit "$status"
