#!/usr/bin/env bash
# `make fresh-check`: what a new user's machine does, from nothing. A clean clone of this checkout's HEAD (commits only:
# uncommitted changes are not in it) under a new directory, an empty HOME (so every cache is empty: uv's and pip's,
# the client venvs in ~/.cache/tito, verifiers' harness environments, vLLM's compile cache), then each make target
# given (default: seed-run) from there, each timed. What the machine image holds stays: its Pythons (PYENV_ROOT), pip's
# system configuration, Debian's packages, and ../shared beside the clone (linked).
#
#   bash scripts/fresh_check.sh [TARGET ...]          # e.g. seed-run test
#   FRESH_DIR=/tmp/x FRESH_KEEP=1 bash scripts/fresh_check.sh seed-run
set -euo pipefail
src=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(seed-run)
dir=${FRESH_DIR:-$(mktemp -d /tmp/tito-fresh.XXXXXX)}
mkdir -p "$dir/home"
[[ -e $dir/shared ]] || ln -s "$(cd "$src/.." && pwd)/shared" "$dir/shared"
git clone -q "$src" "$dir/tito"
echo "fresh-check: $(git -C "$dir/tito" log -1 --format='%h %s' | cut -c1-100)"
echo "fresh-check: clone $dir/tito, HOME=$dir/home (empty), targets: ${targets[*]}"
export PYENV_ROOT=${PYENV_ROOT:-$HOME/.pyenv}
export HOME=$dir/home
unset XDG_CACHE_HOME XDG_STATE_HOME UV_CACHE_DIR PIP_CACHE_DIR VLLM_CACHE_ROOT TORCHINDUCTOR_CACHE_DIR \
  TITO_TRAINERS_VENV TITO_AREAL_VENV TITO_PRIME_RL_VENV VIRTUAL_ENV
# torch.compile's cache defaults to /tmp/torchinductor_$USER, outside HOME: a fresh one here too.
export TORCHINDUCTOR_CACHE_DIR=$dir/home/.cache/torchinductor
summary=()
rc=0
for t in "${targets[@]}"; do
  start=$(date +%s)
  if make -C "$dir/tito" "$t" OUT="$dir/out-$t" 2>&1 | tee "$dir/$t.log"; then status=ok; else status="failed"; rc=1; fi
  summary+=("$t: $status in $(( $(date +%s) - start )) s (log: $dir/$t.log)")
done
echo "---- fresh-check ($(date -u +%F' '%H:%M) UTC) ----"
printf '%s\n' "${summary[@]}"
echo "disk: HOME $(du -sh "$dir/home" | cut -f1), checkout $(du -sh "$dir/tito" | cut -f1)"
if [[ -z ${FRESH_KEEP:-} ]]; then rm -rf "$dir/home" "$dir/tito"; echo "removed the clone and HOME (FRESH_KEEP=1 keeps them)"; fi
exit $rc
