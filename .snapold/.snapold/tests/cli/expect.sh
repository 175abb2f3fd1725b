#!/usr/bin/env bash
# Runs a command and checks its exit code and output.
# usage: expect.sh CODE REGEX [--absent FILE] [--present FILE] [--within SECONDS] -- command [args...]
#   CODE     the exit code the command must return
#   REGEX    an extended regex that must match somewhere in stdout+stderr ("" matches anything)
#   --absent FILE   FILE must not exist afterwards (no partial report); removed before the run
#   --present FILE  FILE must exist afterwards
#   --within S      the command must finish within S seconds (a guard against hangs)
set -u
expected_code=$1
pattern=$2
shift 2
absent=() present=() within=600
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --absent) absent+=("$2"); shift 2 ;;
    --present) present+=("$2"); shift 2 ;;
    --within) within=$2; shift 2 ;;
    *) echo "expect.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
shift  # --
for f in "${absent[@]+"${absent[@]}"}" "${present[@]+"${present[@]}"}"; do rm -f "$f"; done
output=$(timeout --kill-after=5 "$within" "$@" 2>&1)
code=$?
status=0
if [ "$code" -ne "$expected_code" ]; then
  echo "FAIL: exit code $code, expected $expected_code"
  status=1
fi
if [ -n "$pattern" ] && ! grep -Eq -- "$pattern" <<<"$output"; then
  echo "FAIL: output does not match: $pattern"
  status=1
fi
for f in "${absent[@]+"${absent[@]}"}"; do
  if [ -e "$f" ] || compgen -G "$f.tmp.*" >/dev/null; then echo "FAIL: $f exists"; status=1; fi
done
for f in "${present[@]+"${present[@]}"}"; do
  if [ ! -s "$f" ]; then echo "FAIL: $f was not written"; status=1; fi
done
if [ $status -ne 0 ]; then
  echo "--- command: $*"
  echo "--- output:"
  echo "$output"
fi
exit $status
