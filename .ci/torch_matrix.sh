#!/usr/bin/env bash
# The agent's tests on other torch releases, one after another:
#   .ci/torch_matrix.sh 2.4.1 2.9.1 2.15.0
# For each version: a fresh virtualenv, that torch from the package index, this checkout
# (editable), the agent's tests, the capability probe (benchmarks/capabilities.py, JSON under
# $TORCH_MATRIX_RESULTS), then the virtualenv is removed (each is 5-7 GB: PyPI's Linux torch
# wheels are CUDA builds and `import torch` needs their nvidia-* libraries, even on a machine
# without a GPU; measured with 2.4.1: libtorch_global_deps.so links libcudart.so.12, so a
# --no-deps install does not import). The next version installs while this one's tests run
# (the download, not the tests, was most of each version's time): two virtualenvs at most.
# A pip constraint that caps torch below a version asked for here (a machine's local copies)
# is lifted for these installs only: PIP_CONSTRAINT=/dev/null overrides pip's config.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/torch-matrix.XXXXXX")
results=${TORCH_MATRIX_RESULTS:-${TMPDIR:-/tmp}/torch-matrix-results}
mkdir -p "$results" "$work/tmp"
trap 'kill $(jobs -p) 2>/dev/null || true; wait || true; rm -rf "$work"' EXIT
# every test that imports torch or the agent (make test runs them all on the pinned torch)
tests=(tests/integration/test_agent_torch.py tests/integration/test_agent_process.py
       tests/integration/test_agent_fork.py tests/chaos/test_agent_faults.py
       tests/unit/test_timing.py tests/integration/test_inflight_fork.py
       tests/integration/test_hot_path_leaks.py
       tests/unit/test_hotpath_build.py tests/unit/test_emitter.py
       tests/integration/test_emitter_socket.py tests/unit/test_events.py
       tests/unit/test_identity.py tests/unit/test_config.py tests/unit/test_torch_layouts.py
       tests/unit/test_serve.py tests/integration/test_serve_agent.py)
prepare() {  # VERSION DIR: a virtualenv with that torch (in the background: the download)
  local version=$1 dir=$2 start=$SECONDS rc=0
  mkdir -p "$dir/tmp"
  {
    python3 -m venv "$dir/venv" &&
    # no wheel cache, pip's scratch inside $dir: three versions would leave 15-20 GB behind
    PIP_CONSTRAINT=/dev/null TMPDIR=$dir/tmp "$dir/venv/bin/pip" install -q --no-cache-dir \
      "torch==$version" numpy
  } >"$dir.log" 2>&1 || rc=$?
  echo "$((SECONDS - start))" >"$dir.seconds"
  return $rc
}

status=0
versions=("$@")
pids=()
prepare "${versions[0]}" "$work/v0" & pids[0]=$!
for i in "${!versions[@]}"; do
  version=${versions[$i]}
  dir=$work/v$i
  start=$SECONDS
  rc=0
  wait "${pids[$i]}" || rc=$?
  # this checkout, editable, in the foreground: its build writes the C extension into the
  # source tree, which another version's tests may have loaded. The agent extra accepts the
  # torch just installed: nothing is replaced
  if [ "$rc" -eq 0 ]; then
    PIP_CONSTRAINT=/dev/null TMPDIR=$dir/tmp "$dir/venv/bin/pip" install -q --no-cache-dir \
      -e ".[agent,test]" >>"$dir.log" 2>&1 &&
    "$dir/venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" \
      >>"$dir.log" 2>&1 || rc=$?
  fi
  next=$((i + 1))
  if [ "$next" -lt "${#versions[@]}" ]; then
    prepare "${versions[$next]}" "$work/v$next" & pids[$next]=$!
  fi
  if [ "$rc" -ne 0 ]; then
    echo "torch $version: install FAILED:"; tail -20 "$dir.log"
    status=1
    rm -rf "$dir"
    continue
  fi
  installed=$((SECONDS - start))
  if "$dir/venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"; then
    outcome=passed
  else
    outcome=FAILED
    status=1
  fi
  "$dir/venv/bin/python" benchmarks/capabilities.py --json "$results/caps-$version.json" \
    >/dev/null || status=1
  rm -rf "$dir"
  echo "torch $version: tests $outcome; its download $(cat "$dir.seconds")s, waited for" \
       "${installed}s; tests and probe $((SECONDS - start - installed))s;" \
       "probe in $results/caps-$version.json"
done
exit $status
