#!/usr/bin/env bash
# The GPU checks of a checkout, on a CUDA machine that has torch (with CUDA), transformers and
# triton but no package index: installs the pinned wheels that ci/gpu/fetch-wheels.sh put in
# .whl/ (WHEELS=...) into a temporary folder of their own (the machine's Python is untouched),
# then runs
#   1. tests/gpu (what is missing there, e.g. transformer-engine, SGLang or Ray, is skipped, named),
#   2. bench/train_step.py: the train-step MFU table on this GPU (BENCH_ARGS adds options),
#   3. an RL run of the demo task in bf16 on this GPU, in this process (no Ray): RL_STEPS steps,
#   4. the workflow HF model -> megarl sft -> RL from its checkpoint -> generate -> evaluate,
#      in bf16 on this GPU, without Ray (--in-process; each command under WORKFLOW_S),
#   5. only when STAGES names it: ci/gpu/probe_cluster_paths.py, the cluster paths (CUDA init in
#      the ranks, the CUDA-IPC push, offload, the weight-update group, the packed-rope step), sized
#      for a short lease: under 5 minutes (PROBE_S, default 300, bounds it; ci/gpu/README.md),
# each under a time limit (TESTS_S, BENCH_S, RL_S seconds); STAGES (default "tests bench rl workflow";
# "probe" for the probe alone) picks which run, and a stage left out counts as passed. Logs, the
# environment and the bench's and probe's results go to $1 (default: $OUT when set, else ci/gpu/out;
# the checkout is not written): copy train_step.json (the checkout's entries plus this GPU's) over
# bench/results/ to keep them. Exit code: the first stage that failed, else 0.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-${OUT:-$here/out}}"
python="${PYTHON:-python3}"
device="${DEVICE:-cuda}"  # cpu: a dry run of the RL and workflow stages on a machine without a GPU
for stage in ${STAGES:-}; do  # a misspelt stage would be skipped and counted as passed
  case "$stage" in
    tests | bench | rl | workflow | probe) ;;
    *) echo "ci/gpu: unknown stage '$stage' in STAGES; the stages are tests bench rl workflow probe" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
"$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  --find-links "${WHEELS:-$root/.whl}" --target "$site" -r "$here/requirements.txt" || {
  echo "ci/gpu: the wheels of ci/gpu/requirements.txt are not all in ${WHEELS:-$root/.whl}; run ci/gpu/fetch-wheels.sh where pip reaches PyPI" >&2
  exit 2
}
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  "$python" -c 'import sys, torch, transformers, megatron.core, pydantic
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| megatron-core", megatron.core.__version__,
      "| pydantic", pydantic.VERSION, "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
} 2>&1 | tee "$out/env.txt"
stages=" ${STAGES:-tests bench rl workflow} "
tests=0 bench=0 rl=0
if [[ $stages == *" tests "* ]]; then
  timeout "${TESTS_S:-300}" "$python" -m pytest tests/gpu -p no:cacheprovider -q -rs --durations=10 2>&1 \
    | tee "$out/gpu_tests.log"
  tests=${PIPESTATUS[0]}
fi
if [[ $stages == *" bench "* ]]; then
  # The entries of other devices are kept: the bench merges this GPU's into a copy of the checkout's file.
  rm -f "$out/train_step.json"
  cp bench/results/train_step.json "$out/train_step.json" 2>/dev/null
  # shellcheck disable=SC2086  # BENCH_ARGS: options, split on purpose
  timeout "${BENCH_S:-360}" "$python" bench/train_step.py --results "$out/train_step.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$out/train_step.log"
  bench=${PIPESTATUS[0]}
  [ "$bench" -eq 0 ] || mv "$out/train_step.json" "$out/train_step.json.not-updated" 2>/dev/null
fi
if [[ $stages == *" rl "* ]]; then
  demo="$(mktemp -d)"
  "$python" -c 'import sys; from megarl.commands.demo import prepare_demo; prepare_demo(sys.argv[1])' "$demo" &&
  timeout "${RL_S:-300}" "$python" -m megarl.cli launch configs/tiny_grpo.yaml --in-process cluster.device=$device \
    cluster.gpus_per_node=1 model.dtype=bfloat16 "model.path=$demo/model" "data.train_files=[$demo/data/train.parquet]" \
    "data.val_files=[$demo/data/val.parquet]" "trainer.output_dir=$demo/run" "trainer.total_steps=${RL_STEPS:-20}" \
    2>&1 | tee "$out/rl_bf16.log"
  rl=${PIPESTATUS[0]}
  cp "$demo/run/metrics.jsonl" "$out/rl_bf16_metrics.jsonl" 2>/dev/null
  rm -rf "$demo"
fi
# HF model -> SFT -> RL from its checkpoint -> generate -> evaluate on the demo task, without Ray.
run_workflow() {
  local wf on_gpu
  wf="$(mktemp -d)"
  on_gpu=(cluster.device=$device cluster.gpus_per_node=1 model.dtype=bfloat16 trainer.loggers=[jsonl])
  "$python" -c 'import sys; from megarl.commands.demo import prepare_demo; prepare_demo(sys.argv[1])' "$wf" &&
  timeout "${WORKFLOW_S:-300}" "$python" -m megarl.cli sft --in-process configs/tiny_grpo.yaml "${on_gpu[@]}" \
    "model.path=$wf/model" "sft.train_files=[$wf/data/train.parquet]" "sft.val_files=[$wf/data/val.parquet]" \
    "sft.output_dir=$wf/sft" sft.total_steps=100 sft.eval_freq=50 &&
  timeout "${WORKFLOW_S:-300}" "$python" -m megarl.cli launch --in-process configs/tiny_grpo.yaml "${on_gpu[@]}" \
    "model.path=$wf/sft/model" "data.train_files=[$wf/data/train.parquet]" "data.val_files=[$wf/data/val.parquet]" \
    "trainer.output_dir=$wf/rl" trainer.total_steps=5 &&
  timeout "${WORKFLOW_S:-300}" "$python" -m megarl.cli generate configs/tiny_grpo.yaml "${on_gpu[@]}" \
    --model "$wf/rl/checkpoints/step_000005" --data "$wf/data/val.parquet" --out "$wf/gen.parquet" --n 4 --in-process &&
  timeout "${WORKFLOW_S:-300}" "$python" -m megarl.cli evaluate configs/tiny_grpo.yaml --data "$wf/gen.parquet" \
    --k 1,4 --out "$out/workflow_eval.json"
  local code=$?
  cp "$wf/sft/metrics.jsonl" "$out/workflow_sft_metrics.jsonl" 2>/dev/null
  cp "$wf/rl/metrics.jsonl" "$out/workflow_rl_metrics.jsonl" 2>/dev/null
  rm -rf "$wf"
  return "$code"
}
workflow=0
if [[ $stages == *" workflow "* ]]; then
  run_workflow 2>&1 | tee "$out/workflow.log"
  workflow=${PIPESTATUS[0]}
fi
probe=0
if [[ $stages == *" probe "* ]]; then
  # Each section runs under its own limit inside; the probe's budget (280 s) is below PROBE_S.
  timeout "${PROBE_S:-300}" "$python" ci/gpu/probe_cluster_paths.py --out "$out" 2>&1 | tee "$out/probe.log"
  probe=${PIPESTATUS[0]}
fi
echo "ci/gpu: tests exit $tests, bench exit $bench, bf16 RL run exit $rl, workflow exit $workflow, probe exit $probe;" \
  "logs and results in $out" >&2
for code in "$tests" "$bench" "$rl" "$workflow" "$probe"; do
  [ "$code" -ne 0 ] && exit "$code"
done
exit 0
