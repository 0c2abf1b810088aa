#!/usr/bin/env bash
# The prepared GPU check: on one CUDA GPU, in under 8 minutes, the GPU-marked tests, the online
# update against one CPU core, and the hot-update, rollout and update-loop benchmarks on a 0.5B
# model, written to one JSON (runs/gpu-check.json: device, driver, versions, each stage's
# outcome and key figures); the tenant demo (`hotloop demo-tenants`, 300 s of training at
# most) comes last, and gets its own run when the budget is spent before it.
#
#   make EXTRA=gpu install && scripts/gpu-check.sh            # from a checkout on the GPU host
#   scripts/gpu-check.sh --model /path/to/Qwen2.5-0.5B-Instruct   # no network on the host
#   scripts/gpu-check.sh --stages model,tenants --budget-s 600 --out runs/gpu-tenants.json
#   scripts/gpu-check.sh --dry-run                            # the plumbing, tiny, on a CPU
#
# The default model, Qwen/Qwen2.5-0.5B-Instruct, comes from the Hugging Face hub: the host
# needs network for it (or a local directory via --model). A failing stage is recorded and
# the check goes on; --budget-s bounds the whole run (default 480). Exit 0: every stage ok.
# Options: python -m benchmarks.gpu_check --help. Put its figures into docs/results.md with
# the date and the device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${HOTLOOP_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m benchmarks.gpu_check "$@"
