# The hostile-input suite, part 1: output files, case files and options, sweeps, value ranges, names that are
# not text, and the rough edges of the command line. Each test is one function of hostile.sh.
set(HOSTILE ${CMAKE_CURRENT_SOURCE_DIR}/cli/hostile.sh)
set(hostile_tests
  report_dev_null report_dev_full report_fifo report_symlink report_folder report_is_input report_long_name
  outputs_checked_first
  case_number_overflow case_duplicate_key case_sequence_overflow case_not_regular
  sweep_rank_overflow sweep_checked_first sweep_cap sweep_progress sweep_case_after_layouts sweep_alone sweep_memory
  threads_bound timeout_values bench_shape memory_estimate value_ranges
  utf8_case_path control_characters
  kd_bug_on_cross_entropy seam_refusals unknown_command list_losses policy_export_inputs help_exit_codes gate_outside_root launcher_without_mpiexec)
if(LOSSVERIFY_HAVE_MPI)
  list(APPEND hostile_tests launcher_threads_under_mpiexec mpi_fault_values utf8_case_path_mpi)
endif()
foreach(name ${hostile_tests})
  add_test(NAME hostile_${name}
    COMMAND bash ${HOSTILE} ${name} ${LV} ${CASES} ${OUT}/hostile ${MPIEXEC_EXECUTABLE})
endforeach()
set_tests_properties(hostile_sweep_memory hostile_value_ranges PROPERTIES PROCESSORS 2)
