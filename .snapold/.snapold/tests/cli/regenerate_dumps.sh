#!/usr/bin/env bash
# Regenerates the check-dump fixtures with real PyTorch (scripts/make_dump_fixtures.py: torch.distributed,
# gloo, 2-4 processes) into a fresh folder and checks every one against its expected outcome.
# usage: regenerate_dumps.sh PYTHON LOSSVERIFY SOURCE_DIR OUT_DIR
# Exits 77 (CTest: skipped) when PyTorch cannot be imported.
set -u
python=$1 lossverify=$2 source=$3 out=$4
if ! "$python" -c "import torch, numpy" 2>/dev/null; then
  echo "skipped: PyTorch is not installed for $python (Debian: apt-get install python3-torch); the committed fixtures are checked by the dump_fixture_* tests"
  exit 77
fi
rm -rf "$out"
mkdir -p "$out"
"$python" "$source/scripts/make_dump_fixtures.py" "$out/dumps" || { echo "FAIL: make_dump_fixtures.py failed"; exit 1; }
committed=$(cd "$source/tests/data/dumps" && ls -d */ | sort | tr -d /)
regenerated=$(cd "$out/dumps" && ls -d */ | sort | tr -d /)
if [ "$committed" != "$regenerated" ]; then
  echo "FAIL: the script makes other fixtures than are committed:"
  diff <(echo "$committed") <(echo "$regenerated")
  exit 1
fi
exec "$python" "$source/tests/cli/check_dumps.py" "$lossverify" "$out/reports" "$out/dumps"
