#!/usr/bin/env bash
# The H200 ladder end to end on one GPU machine (`make h200-ladder`), or one phase of it:
#
#   bash experiments/h200_ladder.sh [all|data|rungs|forecast|hero|report|replicates|faults OUT|pack OUT_DIR]
#
#   data      the offline package corpus (engines.corpus) and its token shards, unless present
#   rungs     the rungs, one after another (ladder submit --local), finished ones skipped
#   forecast  the laws and curves fitted on the rungs, the hero's forecast (before the hero trains)
#   hero      the hero, after the rungs
#   report    the hero against the forecast (ladder compare) and the HTML report under ./report-h200
#   replicates  the hero at seeds 1-3 (healthy replicates: the monitor's calibration), one at a time
#   faults OUT [HEALTHY_DIR ...]  the fault suite on the hero (bench/faults.py): healthy replicates =
#          the hero's finished runs (or HEALTHY_DIRs), faults 3 at a time, judged against the forecast
#   pack   metrics.jsonl, status.json and spec.yaml of every run (no checkpoints) into
#          OUT_DIR/h200_ladder.tar.gz, with the corpus manifest and the plan
#
# Environment: LADDER (the ladder command; default .venv/bin/ladder, else python3 -m ladder.cli),
# PY (python for engines.corpus), MOE_LADDER_CORPUS (default ~/.cache/moe-ladder/corpus),
# MOE_LADDER_ROOT (default ./.ladder), TRACKING (set to 0 for --no-tracking, e.g. where MLflow is
# not installed; `ladder sync proxy_h200` uploads the run dirs later).
set -euo pipefail
cd "$(dirname "$0")/.."
EXP=experiments/proxy_h200.py
export MOE_LADDER_CORPUS="${MOE_LADDER_CORPUS:-$HOME/.cache/moe-ladder/corpus}"
if [ -z "${LADDER:-}" ]; then
  if [ -x .venv/bin/ladder ]; then LADDER=.venv/bin/ladder; else LADDER="python3 -m ladder.cli"; fi
fi
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
TRACK=()
[ "${TRACKING:-1}" = 0 ] && TRACK=(--no-tracking)
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

data() {
  if [ ! -f "$MOE_LADDER_CORPUS/manifest.json" ]; then
    stamp "building the corpus under $MOE_LADDER_CORPUS"
    $PY -m engines.corpus build --out "$MOE_LADDER_CORPUS"  # token counts come from the shards below
  fi
  stamp "token shards"
  $LADDER data prepare "$EXP"
  $LADDER plan "$EXP"
}

rungs() {  # ONLY=REGEX trains the rungs it matches (two phases with disjoint ONLY share one GPU)
  local only=()
  [ -n "${ONLY:-}" ] && only=(--only "$ONLY")
  stamp "rungs ${ONLY:-}"; $LADDER submit "$EXP" --local "${only[@]}" "${TRACK[@]}"
}
forecast() { stamp "forecast"; $LADDER forecast "$EXP" "${TRACK[@]}"; }
hero() { stamp "hero"; $LADDER submit "$EXP" --local --only '^hero-' "${TRACK[@]}"; }
report() {
  local root="${MOE_LADDER_ROOT:-.ladder}"
  stamp "report"
  $LADDER compare "$root"/runs/proxy_h200/hero-* --forecast "$root/analysis/proxy_h200/forecast.json" || true
  $LADDER report "$EXP" --out report-h200 "${TRACK[@]}"
}

replicates() { stamp "hero replicates"; $LADDER submit "$EXP" --local --only '^hero-d512-seed[123]$' "${TRACK[@]}"; }
faults() {
  local out="$1" root="${MOE_LADDER_ROOT:-.ladder}"; shift
  local healthy=("$@")
  [ ${#healthy[@]} -gt 0 ] || healthy=("$root"/runs/proxy_h200/hero-d512-*)
  stamp "fault suite into $out"
  $PY bench/faults.py "$EXP" --forecast "${FORECAST:-$root/analysis/proxy_h200/forecast.json}" \
    --healthy-runs "${healthy[@]}" --stop "${STOP:-0.17}" --onset "${ONSET:-0.05}" --jobs "${JOBS:-3}" --out "$out"
}

pack() {
  local out="$1" root="${MOE_LADDER_ROOT:-.ladder}"
  mkdir -p "$out"
  tar czf "$out/h200_ladder.tar.gz" --exclude=checkpoints --exclude='*.tmp' -C "$root/runs" proxy_h200
  cp "$MOE_LADDER_CORPUS/manifest.json" "$out/corpus_manifest.json"
  $LADDER plan "$EXP" --json > "$out/plan.json"
  stamp "packed into $out"
}

case "${1:-all}" in
  all) data; rungs; forecast; hero; report ;;
  data) data ;;
  rungs) rungs ;;
  forecast) forecast ;;
  hero) hero ;;
  report) report ;;
  replicates) replicates ;;
  faults) shift; faults "${@:?faults needs an output directory}" ;;
  pack) pack "${2:?pack needs an output directory}" ;;
  *) echo "usage: $0 [all|data|rungs|forecast|hero|report|replicates|faults OUT [RUN_DIR ...]|pack OUT_DIR]" >&2; exit 2 ;;
esac
