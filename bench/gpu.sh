#!/usr/bin/env bash
# The accelerator tests (pytest -m accelerator), then one prepared GPU benchmark (under 8 minutes on one
# H100/H200-class chip):
# base and big train steps in float32 and bfloat16 as a fraction of the bf16 matmul peak measured in the
# same run, beside the capacity plan's prediction for the same step (python -m flax_transformer plan,
# compiled on the CPU), and beam-4 decoding on newstest-like lengths. Tables go to stdout; the last line is JSON.
#   bash bench/gpu.sh            (on the GPU machine, from the repository root)
#   bash bench/gpu.sh --smoke    (tiny sizes: checks the script on a CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--smoke" ]]; then
  platform=$(python -c 'import jax; print(jax.devices()[0].platform)')
  if [[ "$platform" != "gpu" ]]; then
    echo "bench/gpu.sh: JAX sees no GPU (platform: $platform); install a CUDA jaxlib or run with --smoke" >&2
    exit 1
  fi
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
if [[ "${1:-}" != "--smoke" ]]; then  # the tests that need an accelerator (skipped in the CPU suite), and two benchmarks' smoke runs
  TEST_ON_ACCELERATOR=1 timeout 300 python -m pytest -q -p no:cacheprovider -m accelerator tests
fi
timeout 470 python bench/accelerator.py "$@"
