#!/usr/bin/env bash
# Stage a side-by-side GPU run of the working tree against an older commit (a GPU machine that has no git).
#
#   (once, before: the model staged in .gpu/p1 and .gpu/p2)
#   bash scripts/gpu_ab_stage.sh OLD_COMMIT         # .gpu/p2/old/ and .gpu/p2/ab.sh
#
# It writes into .gpu/p2 (git-ignored, carried by the second device run): old/, the files that differ between
# OLD_COMMIT and HEAD as they were at OLD_COMMIT; old.deleted, the files OLD_COMMIT did not have; ab.sh, which
# rebuilds OLD_COMMIT's tree on the GPU machine and runs a command in both trees in turn. On the device:
#
#   source .gpu/p2/unstash.sh && bash .gpu/p2/ab.sh 2 \
#     'python3 -m bench.fused_bench --prompts $P --per-category 1 --configs S5K4N16 --ways ar,fused \
#      --out $OUT --tag=-$AB$AB_REP'   # with '=': argparse takes a bare -old1 for an option
#
# runs the command old, new, old, new (2 rounds) on one warm GPU, each in its own tree with `speccycle`
# importing from that tree; $AB is old or new, $AB_REP the round, $P the carried Spec-Bench prompts
# (.gpu/p2/spec_bench_dev.jsonl), $SPECCYCLE_COMMIT the measured commit (the JSONs record it); the old tree is
# built under $AB_DIR (default /tmp/ab) once per machine and old commit (e307a59 found a warm machine's tree
# from an earlier staging measured under the new label: now it is rebuilt when the old commit changes). Commit first: uncommitted changes count as HEAD's and are labelled
# with HEAD's commit.
set -euo pipefail
old=${1:?usage: bash scripts/gpu_ab_stage.sh OLD_COMMIT}
cd "$(git rev-parse --show-toplevel)"
[ -d .gpu/p2 ] || { echo "stage the model first: .gpu/p2 is missing" >&2; exit 1; }
old=$(git rev-parse --short "$old")
new=$(git rev-parse --short HEAD)
rm -rf .gpu/p2/old && mkdir -p .gpu/p2/old && : > .gpu/p2/old.deleted
git diff --name-status --no-renames "$old" HEAD | while read -r status path; do
  if [ "$status" = A ]; then
    echo "$path" >> .gpu/p2/old.deleted
  else
    mkdir -p ".gpu/p2/old/$(dirname "$path")" && git show "$old:$path" > ".gpu/p2/old/$path"
  fi
done
[ -f .gpu/p2/spec_bench_dev.jsonl ] || cp "${SPEC_BENCH_DEV:?.gpu/p2 has no spec_bench_dev.jsonl: set SPEC_BENCH_DEV to the Spec-Bench dev prompts}" .gpu/p2/
cat > .gpu/p2/ab.sh <<'SH'
# written by scripts/gpu_ab_stage.sh: old @OLD@, new @NEW@
set -u
rounds=${1:?usage: bash .gpu/p2/ab.sh ROUNDS 'COMMAND'}; shift
root=$PWD
dir=${AB_DIR:-/tmp/ab}  # the old tree and the two import roots; built once per machine and old commit
export PYTHONUNBUFFERED=1 SPECCYCLE_DEFAULT_MODEL=${SMOLLM2_GGUF:-} P=$root/.gpu/p2/spec_bench_dev.jsonl
if [ "$(cat "$dir/old/COMMIT" 2>/dev/null)" != @OLD@ ]; then  # built for another old commit (or not yet)
  rm -rf "$dir/old" && mkdir -p "$dir/old" "$dir/new" && cp -r "$root" "$dir/old/tree" && cp -r .gpu/p2/old/. "$dir/old/tree/"
  echo @OLD@ > "$dir/old/COMMIT"
  (cd "$dir/old/tree" && xargs -r rm -f < .gpu/p2/old.deleted)
  ln -sfn "$dir/old/tree" "$dir/old/speccycle" && ln -sfn "$root" "$dir/new/speccycle"
fi
for AB_REP in $(seq 1 "$rounds"); do
  for AB in old new; do
    if [ "$AB" = old ]; then tree=$dir/old/tree commit=@OLD@; else tree=$root commit=@NEW@; fi
    echo "== $AB ($commit) round $AB_REP"
    (cd "$tree" && AB=$AB AB_REP=$AB_REP SPECCYCLE_COMMIT=$commit PYTHONPATH=$dir/$AB:${PYTHONPATH:-} bash -c "$*")
  done
done
SH
sed -i "s/@OLD@/$old/g; s/@NEW@/$new/g" .gpu/p2/ab.sh
echo "staged: old $old ($(find .gpu/p2/old -type f | wc -l) files, $(wc -l < .gpu/p2/old.deleted) added since), new $new"
du -sh .gpu/p2
