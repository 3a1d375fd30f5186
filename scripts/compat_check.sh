#!/usr/bin/env bash
# A run written by older code reads the same with this checkout: usage `scripts/compat_check.sh COMMIT [WORK]`.
#
# Why: the run's storage is the record of what is done, so a change to how documents are read or written must
# leave runs already on disk readable. This checks out COMMIT beside this tree (a git worktree), lays down two
# runs with that commit's own writers (tests.support.synthetic_run: an inline-capture run and a staged one,
# 4 shards each), then verifies and exports them in every format with both codes and compares: the exports
# byte for byte (`diff -r`), verify's JSON report less its timings. It prints one line per command and exits 1
# when anything differs (specforge-eagle3 is refused by both: the synthetic runs capture two auxiliary layers;
# the refusals are compared like every other output). Nothing here needs a broker, an engine or a GPU.
set -uo pipefail
commit=${1:?usage: scripts/compat_check.sh COMMIT [WORK]}
here=$(cd "$(dirname "$0")/.." && pwd)
work=${2:-$(mktemp -d)}
old="$work/old-tree"
rm -rf "$work/runs" "$work/out-old" "$work/out-new" "$old"
git -C "$here" worktree add -q --detach "$old" "$commit" || exit 2
trap 'git -C "$here" worktree remove --force "$old"' EXIT
mkdir -p "$work/runs"
(cd "$old" && PYTHONPATH="$old" python - "$work/runs" <<'PY'
import sys
from pathlib import Path
from tests.support.synthetic_run import Spec, build_run
build_run(Path(sys.argv[1]) / "inline", Spec(run_id="synth", shards=4))
build_run(Path(sys.argv[1]) / "staged", Spec(run_id="synth", shards=4, capture="staged"))
PY
) || exit 2
formats=$(cd "$here" && python -c "from app.data.export_formats import FORMATS; print(' '.join(FORMATS))")
failed=0
for code in old new; do
  tree=$old; [ "$code" = new ] && tree=$here
  for run in inline staged; do
    (cd "$tree" && PYTHONPATH="$tree" python -m app.cli verify synth --storage "$work/runs/$run" --json \
      > "$work/verify-$code-$run.json"); echo "verify $code $run: exit $?"
    for fmt in $formats; do
      (cd "$tree" && PYTHONPATH="$tree" python -m app.cli export synth --storage "$work/runs/$run" --format "$fmt" \
        --out "$work/out-$code/$run/$fmt" > "$work/export-$code-$run-$fmt.log" 2>&1)
      echo "export $code $run $fmt: exit $?"
    done
  done
done
for run in inline staged; do
  for fmt in $formats; do  # what each printed, less its progress bar (a clock) and its --out
    diff -q <(grep -v '━' "$work/export-old-$run-$fmt.log" | sed 's#out-old/#out-#') \
            <(grep -v '━' "$work/export-new-$run-$fmt.log" | sed 's#out-new/#out-#') > /dev/null \
      || { echo "export $run $fmt: the two codes said different things"; failed=1; }
  done
done
diff -r "$work/out-old" "$work/out-new" > "$work/exports.diff" && echo "exports: identical ($(find "$work/out-new" -type f | wc -l) files)" \
  || { echo "exports differ: $work/exports.diff"; failed=1; }
for run in inline staged; do
  python3 - "$work/verify-old-$run.json" "$work/verify-new-$run.json" "$run" <<'PY' || failed=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
timing = {"seconds", "elapsed_s", "started", "finished"}
same = {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
print(f"verify {sys.argv[3]}: reports {'equal' if same else 'DIFFER'}")
sys.exit(0 if same else 1)
PY
done
exit $failed
