#include "lossverify/dump/export_inputs.hpp"
#include "lossverify/kind_api/loss_kind.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "lossverify/core/atomic_file.hpp"
#include "lossverify/core/build_info.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/output_path.hpp"
#include "lossverify/dump/safetensors_writer.hpp"
#include "lossverify/dump/stage_tensors.hpp"
#include "lossverify/impl/rank_inputs.hpp"
#include "lossverify/runner/memory_estimate.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify::dump {

namespace {

namespace fs = std::filesystem;

std::string rank_file_name(int rank) { return "rank" + std::to_string(rank) + ".safetensors"; }

// Ranks of a kind that reads teacher logits (KD) carry the teacher's shard too (even a rank with no rows: the reader
// needs every tensor).
bool has_teacher(const Case& c) { return kind_of(c.loss).inputs().teacher_logits; }

// A stage's own inputs (an LM head's h, W, b) are the inputs of a staged case: the stage makes the logits from them,
// so the generated logits are none of its inputs and are not written.
std::vector<StageInput> stage_inputs(const Case& c) {
  return c.loss.stage != nullptr ? c.loss.stage->inputs(c) : std::vector<StageInput>{};
}
bool writes_logits(const Case& c) { return stage_inputs(c).empty(); }

// The rank's stage inputs in the dtype, one byte buffer each (kept alive while the tensors are written).
std::vector<std::vector<std::byte>> stage_bytes(const Case& c, const InputSource& inputs,
                                                const RankAssignment& assignment) {
  std::vector<std::vector<std::byte>> out;
  for (const StageInput& input : stage_inputs(c)) {
    out.push_back(to_dtype_bytes(stage_input_values(input, inputs, assignment), c.inputs.dtype));
  }
  return out;
}

std::vector<TensorToWrite> rank_tensors(const Case& c, const RankInputs& in,
                                        const std::vector<std::vector<std::byte>>& stage) {
  const std::vector<std::int64_t> shard_shape = {in.rows(), in.columns()};
  const std::vector<std::int64_t> rows_shape = {in.rows()};
  std::vector<TensorToWrite> tensors;
  if (writes_logits(c)) {
    tensors.push_back({"logits", tensor_dtype_of(in.dtype), shard_shape, std::span<const std::byte>(in.logits)});
  }
  const std::vector<StageInput> inputs = stage_inputs(c);
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    tensors.push_back({inputs[k].name, tensor_dtype_of(in.dtype), stage_input_shape(inputs[k], in.assignment),
                       std::span<const std::byte>(stage[k])});
  }
  std::vector<TensorToWrite> rows = {
      tensor_to_write("labels", TensorDType::i64, rows_shape, in.labels),
      tensor_to_write("loss_mask", TensorDType::boolean, rows_shape, in.loss_mask),
      tensor_to_write("tokens", TensorDType::i64, rows_shape, in.tokens),
      tensor_to_write("token_ids", TensorDType::i64, rows_shape, in.token_ids),
      tensor_to_write("sequences", TensorDType::i64, rows_shape, in.sequences),
      tensor_to_write("positions", TensorDType::i64, rows_shape, in.positions),
      tensor_to_write("upstream_weights", TensorDType::f64, rows_shape, in.upstream_weights)};
  tensors.insert(tensors.end(), rows.begin(), rows.end());
  if (has_teacher(c)) {
    tensors.push_back(
        {"teacher_logits", tensor_dtype_of(in.dtype), shard_shape, std::span<const std::byte>(in.teacher_logits)});
  }
  const std::vector<std::string> names = kind_of(c.loss).token_inputs(c.loss);
  for (std::size_t k = 0; k < names.size(); ++k) {
    tensors.push_back(tensor_to_write(names[k], TensorDType::f32, rows_shape, in.token_inputs[k]));
  }
  return tensors;
}

// Writes one rank's tensors.
void write_rank(const Case& c, const InputSource& inputs, RankAssignment assignment, const std::string& dir,
                int threads) {
  const int rank = assignment.world_rank;
  const std::vector<std::vector<std::byte>> stage = stage_bytes(c, inputs, assignment);
  const RankInputs in = make_rank_inputs(c, inputs, std::move(assignment), threads);
  write_safetensors((fs::path(dir) / rank_file_name(rank)).string(), rank_tensors(c, in, stage),
                    {{"format", kInputsFormat}, {"rank", std::to_string(rank)}});
}

// A rank's entry of the index, from its assignment alone (whether or not its file is written here).
nlohmann::json rank_entry(const Case& c, const RankAssignment& assignment) {
  const int rank = assignment.world_rank;
  nlohmann::json micro_batches = nlohmann::json::array();
  const auto& offsets = assignment.micro_batch_begin;
  for (std::size_t k = 0; k + 1 < offsets.size(); ++k) micro_batches.push_back({offsets[k], offsets[k + 1]});
  nlohmann::json names = nlohmann::json::array();
  if (writes_logits(c)) names.push_back("logits");
  for (const StageInput& input : stage_inputs(c)) names.push_back(input.name);
  for (const char* name :
       {"labels", "loss_mask", "tokens", "token_ids", "sequences", "positions", "upstream_weights"}) {
    names.push_back(name);
  }
  if (has_teacher(c)) names.push_back("teacher_logits");
  for (const std::string& name : kind_of(c.loss).token_inputs(c.loss)) names.push_back(name);
  const RankCoordinates& at = assignment.coordinates;
  return {{"rank", rank},
          {"tp", at.tp},
          {"cp", at.cp},
          {"dp", at.dp},
          {"vocab", {assignment.vocab.begin, assignment.vocab.end}},
          {"file", rank_file_name(rank)},
          {"rows", static_cast<std::int64_t>(assignment.rows.size())},
          {"micro_batches", micro_batches},
          {"tensors", names}};
}

// One rank's tensors are held at a time, and written out: about twice its logit shards (and teacher shards).
void require_export_memory(const Case& c, const InputSource& inputs, int only_rank) {
  std::int64_t widest = 0;
  for (int rank = 0; rank < c.layout.world_size(); ++rank) {
    if (only_rank >= 0 && rank != only_rank) continue;
    const RankAssignment a = assign_rank(c, inputs.batch(), rank);
    widest = std::max(widest, static_cast<std::int64_t>(a.rows.size()) * a.vocab.size());
  }
  const std::int64_t copies = has_teacher(c) ? 4 : 2;
  const std::int64_t needed = widest * static_cast<std::int64_t>(dtype_size(c.inputs.dtype)) * copies;
  const std::int64_t available = available_memory();
  if (available >= 0 && needed > available) {
    throw CaseError(c.source + ": exporting N=" + std::to_string(c.shape.tokens) +
                    " V=" + std::to_string(c.shape.vocab) + " needs about " + std::to_string(needed >> 20) +
                    " MiB for the largest rank's shard, but this machine has " + std::to_string(available >> 20) +
                    " MiB available (nothing was written)");
  }
}

}  // namespace

// Before the inputs are even set up (their per-token arrays alone take seconds for a huge N): the widest rank holds
// at least the average share of rows, N / (CP DP), of V / TP columns; a case whose average share cannot fit is
// refused at once.
void require_export_memory_bound(const Case& c) {
  const double rows = static_cast<double>(c.shape.tokens) / static_cast<double>(c.layout.cp * c.layout.dp);
  const double cols = std::ceil(static_cast<double>(c.shape.vocab) / static_cast<double>(c.layout.tp));
  const double needed = rows * cols * static_cast<double>(dtype_size(c.inputs.dtype)) * (has_teacher(c) ? 4.0 : 2.0);
  const std::int64_t available = available_memory();
  if (available >= 0 && needed > static_cast<double>(available)) {
    throw CaseError(c.source + ": exporting N=" + std::to_string(c.shape.tokens) +
                    " V=" + std::to_string(c.shape.vocab) + " needs at least " +
                    std::to_string(static_cast<std::int64_t>(needed / 1048576.0)) +
                    " MiB for a rank's shard, but this machine has " + std::to_string(available >> 20) +
                    " MiB available (nothing was written)");
  }
}

nlohmann::json export_inputs(const Case& c, const ExportOptions& options) {
  check_case(c);
  if (options.only_rank >= c.layout.world_size()) {
    throw CaseError("--rank " + std::to_string(options.only_rank) + ": outside the layout's " +
                    std::to_string(c.layout.world_size()) + " ranks (tp * cp * dp)");
  }
  require_export_memory_bound(c);
  const InputSource inputs(c);
  require_export_memory(c, inputs, options.only_rank);
  prepare_new_folder("--out", options.out_dir);
  nlohmann::json ranks = nlohmann::json::array();
  for (int rank = 0; rank < c.layout.world_size(); ++rank) {
    RankAssignment assignment = assign_rank(c, inputs.batch(), rank);
    ranks.push_back(rank_entry(c, assignment));
    if (options.only_rank < 0 || options.only_rank == rank) {
      write_rank(c, inputs, std::move(assignment), options.out_dir, options.threads);
    }
  }
  std::int64_t valid_tokens = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) valid_tokens += inputs.is_valid(t);
  nlohmann::json cu_seqlens = nlohmann::json::array({0});
  for (const Sequence& s : inputs.batch().sequences()) cu_seqlens.push_back(s.begin + s.length);
  const nlohmann::json index = {
      {"format", kInputsFormat},
      {"tool", {{"version", build_info::version}, {"git_revision", build_info::git_revision}}},
      {"case_file", options.case_file},
      {"overrides", options.overrides},
      {"case", c.resolved()},
      {"shape", {{"tokens", c.shape.tokens}, {"vocab", c.shape.vocab}}},
      {"dtype", to_string(c.inputs.dtype)},
      {"layout",
       {{"tp", c.layout.tp}, {"cp", c.layout.cp}, {"dp", c.layout.dp}, {"ga", c.layout.ga}, {"sp", c.layout.sp}}},
      {"valid_tokens", valid_tokens},
      {"cu_seqlens", cu_seqlens},
      {"ranks", ranks}};
  AtomicFile file((fs::path(options.out_dir) / kInputsIndex).string(), "inputs index");
  file.write(index.dump(1) + "\n");
  file.commit();
  return index;
}

}  // namespace lossverify::dump
