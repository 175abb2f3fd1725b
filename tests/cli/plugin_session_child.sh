#!/usr/bin/env bash
# A process a plugin starts in a session of its own (setsid) ends with the command: a caller that reads lossverify's
# output through a pipe is not held until that process exits, and none is left behind. (Processes are found through
# /proc, which needs no package.)
set -u
lv=$1 plugin=$2 case_file=$3
sleepers() {  # pids whose command line is exactly `sleep 123.25`
  local p
  for p in /proc/[0-9]*; do
    [[ "$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)" == "sleep 123.25 " ]] && echo "${p#/proc/}"
  done
}
end_sleepers() { local p; for p in $(sleepers); do kill -9 "$p" 2>/dev/null; done; }
end_sleepers
start=$(date +%s)
timeout 60 bash -c "\"$lv\" run \"$case_file\" --impl \"plugin:$plugin?fault=setsid-sleeper@0\" --no-control | cat > /dev/null"
took=$(( $(date +%s) - start ))
left=$(sleepers | wc -l)
echo "the command and its reader took $took s; $left sleeper(s) left"
end_sleepers
[ "$took" -lt 30 ] && [ "$left" -eq 0 ]
