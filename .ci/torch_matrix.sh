#!/usr/bin/env bash
# The agent's tests on other torch releases, one at a time:
#   .ci/torch_matrix.sh 2.4.1 2.9.1
# For each version: a fresh virtualenv, that torch from the package index, this checkout
# (editable), the agent's tests, the capability probe (benchmarks/capabilities.py, JSON under
# $TORCH_MATRIX_RESULTS), then the virtualenv is removed before the next one (each is 5-7 GB:
# PyPI's Linux torch wheels are CUDA builds and `import torch` needs their nvidia-* libraries,
# even on a machine without a GPU; measured with 2.4.1: libtorch_global_deps.so links
# libcudart.so.12, so a --no-deps install does not import).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/torch-matrix.XXXXXX")
results=${TORCH_MATRIX_RESULTS:-${TMPDIR:-/tmp}/torch-matrix-results}
mkdir -p "$results" "$work/tmp"
trap 'rm -rf "$work"' EXIT
# every test that imports torch or the agent (make test runs them all on the pinned torch)
tests=(tests/integration/test_agent_torch.py tests/integration/test_agent_process.py
       tests/integration/test_agent_fork.py tests/chaos/test_agent_faults.py
       tests/unit/test_timing.py tests/unit/test_hotpath_build.py tests/unit/test_emitter.py tests/unit/test_events.py
       tests/unit/test_identity.py tests/unit/test_config.py tests/unit/test_torch_layouts.py
       tests/unit/test_serve.py tests/integration/test_serve_agent.py)
status=0
for version in "$@"; do
  start=$SECONDS
  venv=$work/venv
  rm -rf "$venv"
  python3 -m venv "$venv"
  # no wheel cache, pip's scratch inside $work: three versions would leave 15-20 GB behind
  TMPDIR=$work/tmp "$venv/bin/pip" install -q --no-cache-dir "torch==$version" numpy
  # the agent extra accepts the torch just installed: nothing is replaced
  TMPDIR=$work/tmp "$venv/bin/pip" install -q --no-cache-dir -e ".[agent,test]"
  installed=$((SECONDS - start))
  if "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"; then
    outcome=passed
  else
    outcome=FAILED
    status=1
  fi
  "$venv/bin/python" benchmarks/capabilities.py --json "$results/caps-$version.json" \
    >/dev/null || status=1
  rm -rf "$venv" "$work/tmp"/*
  echo "torch $version: tests $outcome; install ${installed}s, total $((SECONDS - start))s;" \
       "probe in $results/caps-$version.json"
done
exit $status
