#!/usr/bin/env bash
# anyrec's one-stop script: sets up what is missing, then trains or tests.
#   scripts/dev.sh train [hydra overrides...]   2-rank default job under torchrun
#   scripts/dev.sh test  [pytest args...]       the whole test suite
#   scripts/dev.sh setup                        only the environment
# Environment: ANYREC_VENV (default .venv), ANYREC_ACCEL=cpu|cuda|rocm (default: detected),
# ANYREC_NPROC (ranks for `train`, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ANYREC_VENV:-.venv}
PY=${PYTHON:-python3}

detect_accel() {
  if [ -n "${ANYREC_ACCEL:-}" ]; then echo "$ANYREC_ACCEL"
  elif [ -e /dev/kfd ]; then echo rocm
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda
  else echo cpu; fi
}

setup_env() {
  local accel; accel=$(detect_accel)
  case "$accel" in cpu|cuda|rocm) ;; *) echo "dev.sh: error: ANYREC_ACCEL must be cpu, cuda or rocm, got '$accel'" >&2; exit 2;; esac
  local stamp; stamp="$VENV/.anyrec-$accel-$(cat requirements/*.txt setup.py | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  echo "dev.sh: setting up $VENV for $accel" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  case "$accel" in
    cpu)  "${pip[@]}" -r requirements/cpu.txt ;;
    cuda) "${pip[@]}" torch==2.13.0 fbgemm-gpu==1.8.0 --index-url "${ANYREC_TORCH_INDEX:-https://download.pytorch.org/whl/cu130}" ;;
    rocm) "${pip[@]}" torch==2.13.0 fbgemm-gpu==1.8.0 --index-url "${ANYREC_TORCH_INDEX:-https://download.pytorch.org/whl/rocm7.0}" ;;
  esac
  # torch stays at the version just installed: its FBGEMM pair depends on it.
  local pin; pin=$(mktemp); "$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > "$pin"
  "${pip[@]}" -c "$pin" -r requirements/common.txt -r requirements/dev.txt
  rm -f "$pin"
  # torchrec declares the CUDA fbgemm-gpu: install it alone, its real dependencies come from common.txt.
  "${pip[@]}" --no-deps torchrec==1.9.2
  "${pip[@]}" --no-deps -e .
  rm -f "$VENV"/.anyrec-*
  touch "$stamp"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup_env ;;
  train) setup_env; exec "$VENV/bin/torchrun" --standalone --nproc_per_node="${ANYREC_NPROC:-2}" -m anyrec.train "$@" ;;
  test)  setup_env; export PATH="$PWD/$VENV/bin:$PATH"; exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests "$@" ;;
  *) echo "usage: scripts/dev.sh setup|train [overrides...]|test [pytest args...]" >&2; exit 2 ;;
esac
