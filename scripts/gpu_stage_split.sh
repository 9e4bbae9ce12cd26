#!/usr/bin/env bash
# Split the staged model's first part in two, so that each device call carries less than 64 MiB with the tree.
#
#   (once, before: the model staged in .gpu/p1 (part00, ~50 MB) and .gpu/p2 (part01, ~48 MB))
#   bash scripts/gpu_stage_split.sh             # .gpu/p1a and .gpu/p1b (~25 MB each)
#
# The device carries the tracked tree with every call; once it passed ~16.5 MB, the tree plus .gpu/p1 no longer
# fit the 64 MiB a call carries (2026-11-26). Stage with three calls back to back on one warm machine:
#
#   carry .gpu/p1a: bash .gpu/p1a/stash.sh
#   carry .gpu/p1b: bash .gpu/p1b/stash.sh       # joins the halves into /root/models/part00
#   carry .gpu/p2:  source .gpu/p2/unstash.sh && <command>
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
src=.gpu/p1/part00
[ -f "$src" ] || { echo "stage the model first: $src is missing" >&2; exit 1; }
size=$(stat -c %s "$src")
half=$(( size / 2 ))
mkdir -p .gpu/p1a .gpu/p1b
head -c "$half" "$src" > .gpu/p1a/part00a
tail -c +"$(( half + 1 ))" "$src" > .gpu/p1b/part00b
cat .gpu/p1a/part00a .gpu/p1b/part00b | cmp -s - "$src" || { echo "the halves do not join back to $src" >&2; exit 1; }
cat > .gpu/p1a/stash.sh <<'SH'
mkdir -p /root/models && cp .gpu/p1a/part00a /root/models/ && echo "stashed part 1a"
SH
cat > .gpu/p1b/stash.sh <<'SH'
[ -f /root/models/part00a ] || { echo "part 1a is missing: the machine went cold; stash .gpu/p1a again"; exit 1; }
cat /root/models/part00a .gpu/p1b/part00b > /root/models/part00 && rm /root/models/part00a && echo "stashed part 1"
SH
echo "split $src ($size bytes) into .gpu/p1a ($half) and .gpu/p1b ($(( size - half ))); tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
