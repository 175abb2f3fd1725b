#!/usr/bin/env bash
# A process a plugin starts in a session of its own (setsid) ends with the command: a caller that reads lossverify's
# output through a pipe is not held until that process exits, and none is left behind.
set -u
lv=$1 plugin=$2 case_file=$3
pattern='^sleep 123[.]25$'
pkill -f "$pattern"
start=$(date +%s)
timeout 60 bash -c "\"$lv\" run \"$case_file\" --impl \"plugin:$plugin?fault=setsid-sleeper@0\" --no-control | cat > /dev/null"
took=$(( $(date +%s) - start ))
left=$(pgrep -f "$pattern" | wc -l)
echo "the command and its reader took $took s; $left sleeper(s) left"
pkill -f "$pattern"
[ "$took" -lt 30 ] && [ "$left" -eq 0 ]
