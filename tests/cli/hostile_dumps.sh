#!/usr/bin/env bash
# Hostile dumps for check-dump (tests/cli/hostile_dump_tests.cmake), made at test time from the valid dump of
# make_bad_dumps.py. Each case is one folder OUT/<case>/ with a manifest.json; a tensor file outside the dump
# lies in OUT/outside/.
#   usage: hostile_dumps.sh make PYTHON MAKE_BAD_DUMPS_PY OUT
#          hostile_dumps.sh no-leak TEXT_FILE -- command [args...]
#   make      writes the cases: absolute_path, dotdot_path, symlink_out (rank 1's file outside the dump, named
#             by an absolute path, by ../, or reached through a symlink), fifo (rank 1's file is a FIFO),
#             fifo_manifest (the manifest is one),
#             no_leak (rank 1's file is a symlink to a text file in the dump), no_leak_outside (to one
#             outside), and a dump in a folder whose name holds invalid UTF-8 and control characters, with
#             a tensor file whose name holds control characters (utf8_name.txt says where it is).
#   no-leak   runs the command: it must exit 2 saying the file is not a safetensors file, and print neither
#             TEXT_FILE's first 8 bytes read as a little-endian integer nor any other run of 10 or more digits.
set -euo pipefail

make_cases() {
  local python=$1 make_bad_dumps=$2 out=$3
  rm -rf "$out"
  mkdir -p "$out/outside"
  "$python" "$make_bad_dumps" /dev/null "$out/made" >/dev/null
  local valid=$out/made/valid
  cp "$valid/rank1.safetensors" "$out/outside/rank1.safetensors"
  printf 'root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n' >"$out/outside/passwd"

  # rank 1's file named by the absolute path of a file outside the dump, and by ../
  local absolute=$out/outside/rank1.safetensors
  case_with_rank1_file absolute_path "$absolute"
  case_with_rank1_file dotdot_path "../outside/rank1.safetensors"
  # rank 1's file a symlink out of the dump
  copy_case symlink_out
  ln -sf "$absolute" "$out/symlink_out/rank1.safetensors"
  # a FIFO where rank 1's file should be: opening it for reading would wait for a writer forever
  copy_case fifo
  rm "$out/fifo/rank1.safetensors"
  mkfifo "$out/fifo/rank1.safetensors"
  mkdir -p "$out/fifo_manifest"
  mkfifo "$out/fifo_manifest/manifest.json"
  # a symlink to a text file, inside the dump and outside it: its bytes must not reach the message
  copy_case no_leak
  cp "$out/outside/passwd" "$out/no_leak/notes.txt"
  ln -sf notes.txt "$out/no_leak/rank1.safetensors"
  copy_case no_leak_outside
  ln -sf "$out/outside/passwd" "$out/no_leak_outside/rank1.safetensors"
  # invalid UTF-8 and control characters in the folder's name, control characters in a tensor file's name
  local odd_dir=$out/$'utf8-\xff\xfe-\x01\x1b[31m-name'
  mkdir -p "$odd_dir"
  cp "$valid"/*.safetensors "$odd_dir/"
  mv "$odd_dir/rank1.safetensors" "$odd_dir/"$'rank\x01one\x1b[0m.safetensors'
  sed 's|"file": "rank1.safetensors"|"file": "rank\\u0001one\\u001b[0m.safetensors"|' "$valid/manifest.json" \
    >"$odd_dir/manifest.json"
  grep -q 'rank\\u0001one' "$odd_dir/manifest.json"
  printf '%s' "$odd_dir" >"$out/utf8_name.txt"
  # the same with the tensor file gone: the error names it, escaped
  local odd_missing=$out/$'utf8-missing-\xff\x07'
  mkdir -p "$odd_missing"
  cp "$odd_dir/manifest.json" "$valid/rank0.safetensors" "$odd_missing/"
  printf '%s' "$odd_missing" >"$out/utf8_missing.txt"
}

# OUT/<name>/: the valid dump.
copy_case() {
  mkdir -p "$out/$1"
  cp "$out/made/valid"/* "$out/$1/"
}

# OUT/<name>/: the valid dump with rank 1's default file named FILE in its manifest.
case_with_rank1_file() {
  local name=$1 file=$2
  copy_case "$name"
  rm "$out/$name/rank1.safetensors"
  sed "s|\"file\": \"rank1.safetensors\"|\"file\": \"$file\"|" "$out/made/valid/manifest.json" >"$out/$name/manifest.json"
  grep -qF "\"file\": \"$file\"" "$out/$name/manifest.json"
}

no_leak() {
  local text_file=$1
  shift 2  # TEXT_FILE --
  local leaked code=0 output
  leaked=$(od -An -t u8 -N 8 "$text_file" | tr -d ' ')  # the first 8 bytes as safetensors reads them (LE host)
  output=$(timeout 60 "$@" 2>&1) || code=$?
  local status=0
  [ "$code" -eq 2 ] || { echo "FAIL: exit code $code, expected 2"; status=1; }
  grep -Eq "not a safetensors file" <<<"$output" || { echo "FAIL: no 'not a safetensors file'"; status=1; }
  if grep -qF "$leaked" <<<"$output"; then echo "FAIL: the output holds $leaked, the file's first 8 bytes"; status=1; fi
  if grep -Eq "[0-9]{10}" <<<"$output"; then echo "FAIL: the output holds a run of 10 or more digits"; status=1; fi
  if [ $status -ne 0 ]; then
    echo "--- command: $*"
    echo "--- output:"
    echo "$output"
  fi
  return $status
}

mode=$1
shift
case $mode in
  make)
    out=$3
    make_cases "$@"
    echo "hostile_dumps.sh: cases in $out"
    ;;
  no-leak) no_leak "$@" ;;
  *) echo "hostile_dumps.sh: unknown mode $mode" >&2; exit 2 ;;
esac
