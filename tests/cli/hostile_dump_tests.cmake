# Hostile-input suite: see tests/CMakeLists.txt.
# Hostile dumps (check-dump): tensor paths out of the dump folder, a FIFO, a symlink to a text file, odd bytes in
# names, a positional manifest. The cases are made at test time by hostile_dumps.sh from the valid dump of
# make_bad_dumps.py.
set(HOSTILE_DUMPS ${OUT}/hostile_dumps)
set(HOSTILE_SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/cli/hostile_dumps.sh)
add_test(NAME dump_hostile_make
  COMMAND bash ${HOSTILE_SCRIPT} make ${LOSSVERIFY_SYSTEM_PYTHON}
          ${CMAKE_CURRENT_SOURCE_DIR}/data/bad_dumps/make_bad_dumps.py ${HOSTILE_DUMPS})
set_tests_properties(dump_hostile_make PROPERTIES FIXTURES_SETUP lossverify_hostile_dumps)
function(lossverify_hostile_dump_test name code regex)
  add_test(NAME hostile_dump_${name} COMMAND bash ${EXPECT} ${code} ${regex} ${ARGN})
  set_tests_properties(hostile_dump_${name} PROPERTIES FIXTURES_REQUIRED lossverify_hostile_dumps)
endfunction()

# Tensor files must lie in the manifest's folder, symlinks resolved: the message names the manifest, the JSON
# path, where the file resolves to and the option that allows it; nothing is read and no report is written.
set(OUTSIDE_MESSAGE "manifest.json: \\$\\.ranks.1.\\.file: the tensor file .* resolves to .*/outside/rank1.safetensors, outside the dump's folder .*--allow-outside-dump")
lossverify_hostile_dump_test(absolute_path 2 "absolute_path/${OUTSIDE_MESSAGE}" --absent ${HOSTILE_DUMPS}/absolute.json
  -- ${LV} check-dump --manifest ${HOSTILE_DUMPS}/absolute_path/manifest.json --report ${HOSTILE_DUMPS}/absolute.json)
lossverify_hostile_dump_test(dotdot_path 2 "dotdot_path/${OUTSIDE_MESSAGE}"
  -- ${LV} check-dump --manifest ${HOSTILE_DUMPS}/dotdot_path/manifest.json)
lossverify_hostile_dump_test(symlink_out 2 "symlink_out/${OUTSIDE_MESSAGE}"
  -- ${LV} check-dump --manifest ${HOSTILE_DUMPS}/symlink_out/manifest.json)
# --allow-outside-dump: the same dumps are read and pass.
lossverify_hostile_dump_test(allow_outside 0 "invariance over 3 dumps: pass"
  -- ${LV} check-dump --allow-outside-dump --manifest ${HOSTILE_DUMPS}/absolute_path/manifest.json
     --manifest ${HOSTILE_DUMPS}/dotdot_path/manifest.json --manifest ${HOSTILE_DUMPS}/symlink_out/manifest.json)

# A FIFO named *.safetensors: refused at once (opening it for reading would wait for a writer forever).
lossverify_hostile_dump_test(fifo 2 "fifo/rank1.safetensors: is a FIFO, not a regular file" --within 10
  -- ${LV} check-dump --manifest ${HOSTILE_DUMPS}/fifo/manifest.json)
lossverify_hostile_dump_test(fifo_manifest 2 "fifo_manifest/manifest.json: is a FIFO, not a regular file" --within 10
  -- ${LV} check-dump --manifest ${HOSTILE_DUMPS}/fifo_manifest/manifest.json)

# A symlink to a text file: "not a safetensors file", and none of its bytes printed as a number.
add_test(NAME hostile_dump_no_leak
  COMMAND bash ${HOSTILE_SCRIPT} no-leak ${HOSTILE_DUMPS}/outside/passwd
          -- ${LV} check-dump --manifest ${HOSTILE_DUMPS}/no_leak/manifest.json)
add_test(NAME hostile_dump_no_leak_outside
  COMMAND bash ${HOSTILE_SCRIPT} no-leak ${HOSTILE_DUMPS}/outside/passwd
          -- ${LV} check-dump --allow-outside-dump --manifest ${HOSTILE_DUMPS}/no_leak_outside/manifest.json)
set_tests_properties(hostile_dump_no_leak hostile_dump_no_leak_outside PROPERTIES
  FIXTURES_REQUIRED lossverify_hostile_dumps)

# Invalid UTF-8 and control characters in the dump folder's name and a tensor file's name: the dump is checked
# (a report is written) and names are printed escaped; a missing file of such a name is exit 2, escaped too.
lossverify_hostile_dump_test(utf8_name 0 "dump utf8-\\\\xFF\\\\xFE-\\\\x01\\\\x1B.31m-name "
  --present ${HOSTILE_DUMPS}/utf8.json
  -- bash -c "d=$(cat ${HOSTILE_DUMPS}/utf8_name.txt) && exec ${LV} check-dump --manifest \"$d/manifest.json\" --report ${HOSTILE_DUMPS}/utf8.json")
lossverify_hostile_dump_test(utf8_name_missing_file 2
  "utf8-missing-\\\\xFF\\\\x07/rank\\\\x01one\\\\x1B.0m.safetensors: cannot open: No such file"
  -- bash -c "d=$(cat ${HOSTILE_DUMPS}/utf8_missing.txt) && exec ${LV} check-dump --manifest \"$d/manifest.json\"")

# The manifest as a positional argument, alone and with --manifest (a sweep of the two).
set(VALID_MANIFEST ${HOSTILE_DUMPS}/made/valid/manifest.json)
lossverify_hostile_dump_test(positional 0 "verdict: pass" -- ${LV} check-dump ${VALID_MANIFEST})
lossverify_hostile_dump_test(positional_and_option 0 "invariance over 2 dumps: pass"
  -- ${LV} check-dump ${VALID_MANIFEST} --manifest ${VALID_MANIFEST})
