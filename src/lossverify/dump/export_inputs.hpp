#pragma once
// `lossverify export-inputs`: every rank's exact inputs of a case at its layout, for code that runs outside
// lossverify (the Python harness, a user's own script). One folder holds `rank<R>.safetensors` per world rank
// R (logits shard, teacher shard for KD, labels, loss mask, tokens, token ids, sequences, positions, upstream
// weights: RankInputs; for a case with a stage, the stage's own inputs in place of the logits: an LM head's h, W and b,
// dump/stage_tensors.hpp) and `inputs.json` ("lossverify.inputs/1": the resolved case, the layout and per rank
// its coordinates, vocabulary columns, rows and micro-batches). The index is written last, so a folder with
// an index is complete. The values are bit-identical to what `run` feeds its own kernels.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"

namespace lossverify::dump {

inline constexpr const char* kInputsFormat = "lossverify.inputs/1";
inline constexpr const char* kInputsIndex = "inputs.json";

struct ExportOptions {
  std::string out_dir;                 // created when missing; must be empty when it exists
  std::string case_file;               // recorded in the index
  std::vector<std::string> overrides;  // the --set overrides applied, recorded in the index
  int threads = 1;
  // >= 0: write only this world rank's file (a process of a distributed launch regenerates its own inputs);
  // the index still describes every rank.
  int only_rank = -1;
};

// Throws CaseError (exit 2) when the folder is not usable (a file, or a folder that is not empty), before
// anything is written; InternalError (exit 3) when a file cannot be written. Returns the index.
nlohmann::json export_inputs(const Case& c, const ExportOptions& options);

}  // namespace lossverify::dump
