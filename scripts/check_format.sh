#!/usr/bin/env bash
# Checks the C/C++/CUDA sources against the repository's .clang-format.
#
# usage: scripts/check_format.sh [--fix] [--diff] [FILE...]
#   (no option)  list the files that clang-format would change; exit 1 when any, 0 when none
#   --fix        reformat those files in place (clang-format -i); exit 0
#   --diff       with the check, also print what clang-format would change (unified diff)
#   FILE...      check (or fix) these files instead of the repository's own
# The repository's files: the tracked ones and the untracked ones git does not ignore (git ls-files),
# named *.cpp *.hpp *.cu *.cuh *.h *.c *.cc *.cxx *.hh, minus third-party/vendored/generated folders.
# Exit 2: clang-format missing or unusable, .clang-format missing, bad usage.
# CLANG_FORMAT=/path/to/clang-format picks the binary (default: clang-format, else clang-format-14).
# The style was tuned with clang-format 14; other major versions may format some lines differently.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STYLE_FILE="$ROOT/.clang-format"
# Never checked: vendored or generated code (none is tracked today; build/ and out/ are git-ignored).
EXCLUDE_REGEX='(^|/)(third_party|thirdparty|3rdparty|vendor|vendored|external|_deps|generated)/'
EXTENSIONS=('*.cpp' '*.hpp' '*.cu' '*.cuh' '*.h' '*.c' '*.cc' '*.cxx' '*.hh')

die() {
  echo "check_format: $*" >&2
  exit 2
}
files_text() { if (($1 == 1)); then echo "1 file"; else echo "$1 files"; fi; }

fix=0
show_diff=0
files=()
while (($#)); do
  case "$1" in
    --fix) fix=1 ;;
    --diff) show_diff=1 ;;
    -h | --help)
      sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
      exit 0
      ;;
    --) shift; files+=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) files+=("$1") ;;
  esac
  shift
done

# --- the binary -------------------------------------------------------------------------------------------
if [[ -n "${CLANG_FORMAT:-}" ]]; then
  command -v "$CLANG_FORMAT" > /dev/null 2>&1 || die "CLANG_FORMAT=$CLANG_FORMAT: no such program"
  CF="$CLANG_FORMAT"
elif command -v clang-format > /dev/null 2>&1; then
  CF=clang-format
elif command -v clang-format-14 > /dev/null 2>&1; then
  CF=clang-format-14
else
  die "clang-format is not installed (Debian/Ubuntu: apt-get install clang-format; or set CLANG_FORMAT=/path/to/clang-format)"
fi
version_text="$("$CF" --version 2>/dev/null)" || die "$CF --version failed: is it clang-format?"
major="$(sed -n 's/.*clang-format version \([0-9][0-9]*\)\..*/\1/p' <<< "$version_text" | head -n1)"
[[ -n "$major" ]] || die "cannot read the version of $CF: $version_text"
# --style=file:PATH (the same style for files anywhere, e.g. a copy in /tmp) needs clang-format >= 14.
((major >= 14)) || die "$CF is clang-format $major; version 14 or newer is needed (set CLANG_FORMAT=...)"
((major == 14)) || echo "check_format: note: $CF is clang-format $major; .clang-format was tuned with 14" >&2
[[ -f "$STYLE_FILE" ]] || die "$STYLE_FILE is missing"
STYLE=(--style="file:$STYLE_FILE")

# --- the files --------------------------------------------------------------------------------------------
if ((${#files[@]} == 0)); then
  git -C "$ROOT" rev-parse --is-inside-work-tree > /dev/null 2>&1 || die "$ROOT is not a git checkout; name the files to check"
  listed="$(git -C "$ROOT" ls-files --cached --others --exclude-standard -- "${EXTENSIONS[@]}" | sort -u)" ||
    die "git ls-files failed"
  while IFS= read -r f; do
    [[ -n "$f" ]] || continue
    [[ "$f" =~ $EXCLUDE_REGEX ]] && continue
    [[ -f "$ROOT/$f" ]] || continue  # tracked but deleted (or moved) in the work tree
    files+=("$f")
  done <<< "$listed"
  cd "$ROOT" || die "cannot cd to $ROOT"
  fix_hint="scripts/check_format.sh --fix"
else
  for f in "${files[@]}"; do [[ -f "$f" ]] || die "$f: no such file"; done
  fix_hint="scripts/check_format.sh --fix$(printf ' %q' "${files[@]}")"
fi
((${#files[@]})) || { echo "check_format: no C/C++ files to check"; exit 0; }

# --- check ------------------------------------------------------------------------------------------------
differ=()
for f in "${files[@]}"; do
  if err="$("$CF" "${STYLE[@]}" --dry-run --Werror "$f" 2>&1 > /dev/null)"; then
    continue
  fi
  # --Werror turns each formatting difference into a -Wclang-format-violations error; anything else is a failure
  # to run (unreadable file, invalid .clang-format, ...).
  grep -q 'clang-format-violations' <<< "$err" || die "$CF failed on $f: $err"
  differ+=("$f")
done

if ((${#differ[@]} == 0)); then
  echo "check_format: $(files_text ${#files[@]}) formatted as .clang-format says"
  exit 0
fi

if ((fix)); then
  "$CF" "${STYLE[@]}" -i "${differ[@]}" || die "$CF -i failed"
  printf '  %s\n' "${differ[@]}"
  echo "check_format: reformatted ${#differ[@]} of $(files_text ${#files[@]})"
  exit 0
fi

echo "check_format: ${#differ[@]} of $(files_text ${#files[@]}) not formatted as .clang-format says:"
for f in "${differ[@]}"; do
  echo "  $f"
  if ((show_diff)); then
    "$CF" "${STYLE[@]}" "$f" | diff -u --label "$f" --label "$f (clang-format)" "$f" - | sed 's/^/    /'
  fi
done
echo "run: $fix_hint"
exit 1
