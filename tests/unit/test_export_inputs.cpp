// export-inputs: every rank's file holds exactly the values the built-in kernels read (the same InputSource
// calls, bit for bit), the index describes the layout, and a folder that is in use is refused untouched.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "dump_writer.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/dump/export_inputs.hpp"
#include "lossverify/dump/tensor_file.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "test_support.hpp"

using namespace lossverify;
using namespace lossverify::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::vector<std::int64_t> read_integers(const dump::TensorFile& file, const std::string& name) {
  const dump::TensorInfo& info = file.tensor(name);
  return dump::to_integers(info, file.read(info), name);
}

// Compares every exported tensor of every rank with the InputSource, row by row.
void check_export_matches_inputs(const Case& c, const fs::path& dir) {
  const json index = json::parse(std::ifstream(dir / dump::kInputsIndex));
  CHECK(index["format"] == dump::kInputsFormat);
  CHECK(index["layout"]["tp"] == c.layout.tp);
  REQUIRE(index["ranks"].size() == static_cast<std::size_t>(c.layout.world_size()));
  const InputSource inputs(c);
  std::int64_t valid = 0;
  for (std::int64_t t = 0; t < c.shape.tokens; ++t) valid += inputs.is_valid(t);
  CHECK(index["valid_tokens"] == valid);
  const bool kd = kind_of(c.loss).inputs().teacher_logits;
  std::multiset<std::int64_t> tokens_of_tp0;
  for (const json& r : index["ranks"]) {
    const int rank = r["rank"];
    const RankAssignment a = assign_rank(c, inputs.batch(), rank);
    CHECK(r["tp"] == a.coordinates.tp);
    CHECK(r["vocab"][0] == a.vocab.begin);
    CHECK(r["vocab"][1] == a.vocab.end);
    REQUIRE(r["micro_batches"].size() == static_cast<std::size_t>(c.layout.ga));
    for (int k = 0; k < c.layout.ga; ++k) {
      CHECK(r["micro_batches"][k][0] == a.micro_batch_begin[static_cast<std::size_t>(k)]);
      CHECK(r["micro_batches"][k][1] == a.micro_batch_begin[static_cast<std::size_t>(k + 1)]);
    }
    const auto file = dump::TensorFile::open((dir / r["file"].get<std::string>()).string());
    const auto rows = static_cast<std::int64_t>(a.rows.size());
    const std::int64_t cols = a.vocab.size();
    const std::vector<std::int64_t> labels = read_integers(file, "labels");
    const std::vector<std::int64_t> mask = read_integers(file, "loss_mask");
    const std::vector<std::int64_t> tokens = read_integers(file, "tokens");
    REQUIRE(static_cast<std::int64_t>(tokens.size()) == rows);
    std::vector<std::byte> expected(static_cast<std::size_t>(rows * cols) * dtype_size(c.inputs.dtype));
    std::vector<std::byte> expected_teacher = expected;
    for (std::int64_t i = 0; i < rows; ++i) {
      const LocalRow& row = a.rows[static_cast<std::size_t>(i)];
      const auto k = static_cast<std::size_t>(i);
      CHECK(tokens[k] == row.token);
      if (row.token >= 0 && a.coordinates.tp == 0) tokens_of_tp0.insert(row.token);
      const bool row_valid = row.token >= 0 && inputs.is_valid(row.token);
      CHECK(mask[k] == (row_valid ? 1 : 0));
      CHECK(labels[k] == (row_valid ? inputs.label(row.token) : c.loss.ignore_index));
      dispatch_dtype(c.inputs.dtype, [&](auto type) {
        using T = typename decltype(type)::type;
        T* out = reinterpret_cast<T*>(expected.data()) + i * cols;
        T* teacher = reinterpret_cast<T*>(expected_teacher.data()) + i * cols;
        if (row.token < 0) {
          inputs.padding_logits(row.sequence, row.position, a.vocab.begin, a.vocab.end, out);
          inputs.padding_logits(row.sequence, row.position, a.vocab.begin, a.vocab.end, teacher);
        } else {
          inputs.logits(row.token, a.vocab.begin, a.vocab.end, out);
          inputs.teacher_logits(row.token, a.vocab.begin, a.vocab.end, teacher);
        }
      });
    }
    const std::vector<std::byte> logits = file.read(file.tensor("logits"));
    CHECK(file.tensor("logits").shape == std::vector<std::int64_t>{rows, cols});
    CHECK(std::memcmp(logits.data(), expected.data(), expected.size()) == 0);
    if (kd) {
      const std::vector<std::byte> teacher = file.read(file.tensor("teacher_logits"));
      CHECK(std::memcmp(teacher.data(), expected_teacher.data(), expected_teacher.size()) == 0);
    }
  }
  // The TP-rank-0 ranks hold every global token exactly once.
  CHECK(static_cast<std::int64_t>(tokens_of_tp0.size()) == c.shape.tokens);
  CHECK(static_cast<std::int64_t>(std::set<std::int64_t>(tokens_of_tp0.begin(), tokens_of_tp0.end()).size()) ==
        c.shape.tokens);
}

}  // namespace

TEST_CASE("export_inputs_cp_zigzag_rows_match_the_kernels_inputs") {
  json j = case_json(0, 37, 2, "bf16");
  j["shape"].erase("tokens");
  j["batch"] = {{"sequence_lengths", {13, 7, 22, 5}}, {"labels", "next_token"}};
  j["layout"] = {{"tp", 2}, {"cp", 2}};
  j["inputs"]["ignore_fraction"] = 0.2;
  const Case c = make_case(j);
  const fs::path dir = temp_folder("export-cp") / "out";
  dump::ExportOptions options;
  options.out_dir = dir.string();
  dump::export_inputs(c, options);
  check_export_matches_inputs(c, dir);
}

TEST_CASE("export_inputs_kd_dp_ga_fp16_match_the_kernels_inputs") {
  json j = case_json(0, 50, 3, "fp16");
  j["shape"].erase("tokens");
  j["loss"] = {{"kind", "kd"}, {"temperature", 2.0}};
  j["batch"] = {{"sequence_lengths", {9, 4, 6, 3, 8}}};
  j["layout"] = {{"tp", 3}, {"dp", 2}, {"ga", 2}};
  const Case c = make_case(j);
  const fs::path dir = temp_folder("export-kd");
  dump::ExportOptions options;
  options.out_dir = dir.string();
  dump::export_inputs(c, options);
  check_export_matches_inputs(c, dir);
}

TEST_CASE("export_inputs_refuses_a_folder_in_use_and_writes_nothing") {
  const Case c = make_case(case_json(8, 16, 2));
  const fs::path dir = temp_folder("export-busy");
  write_bytes(dir / "notes.txt", "mine");
  dump::ExportOptions options;
  options.out_dir = dir.string();
  CHECK_THROWS_AS(dump::export_inputs(c, options), CaseError);
  CHECK(fs::exists(dir / "notes.txt"));
  CHECK(!fs::exists(dir / dump::kInputsIndex));
  CHECK(!fs::exists(dir / "rank0.safetensors"));
  options.out_dir = (dir / "notes.txt").string();
  CHECK_THROWS_AS(dump::export_inputs(c, options), CaseError);
}

TEST_CASE("export_inputs_of_an_lm_head_writes_h_w_b_of_the_head_streams_and_no_logits") {
  // bf16, a bias, tp = 2 (V = 45: shards of 23 and 22), cp = 2 with padding rows; each rank's h, W and b compared with
  // the head's Philox streams (InputSource::stage_values) bit for bit.
  json j = case_json(0, 45, 2, "bf16");
  j["shape"].erase("tokens");
  j["batch"] = {{"sequence_lengths", {11, 6, 9}}};
  j["stage"] = {{"kind", "lm_head"}, {"hidden", 6}, {"bias", true}, {"hidden_scale", 0.5}};
  j["layout"] = {{"tp", 2}, {"cp", 2}};
  const Case c = make_case(j);
  const fs::path dir = temp_folder("export-head");
  dump::ExportOptions options;
  options.out_dir = dir.string();
  const json index = dump::export_inputs(c, options);
  const InputSource inputs(c);
  const int hidden = 6;
  const double w_scale = 2.0 / (std::sqrt(6.0) * 0.5);  // the case's logit scale over sqrt(H) hidden_scale
  for (const json& r : index["ranks"]) {
    const std::vector<std::string> names = r["tensors"];
    CHECK(std::find(names.begin(), names.end(), "logits") == names.end());
    CHECK(std::find(names.begin(), names.end(), "h") != names.end());
    const RankAssignment a = assign_rank(c, inputs.batch(), r["rank"].get<int>());
    const auto file = dump::TensorFile::open((dir / r["file"].get<std::string>()).string());
    CHECK_THROWS_AS(file.tensor("logits"), dump::DumpError);
    auto values = [&](const char* name) {
      const dump::TensorInfo& info = file.tensor(name);
      CHECK(info.dtype == dump::TensorDType::bf16);
      return dump::to_doubles(info, file.read(info), name);
    };
    const std::vector<double> h = values("h"), w = values("W"), b = values("b");
    REQUIRE(h.size() == a.rows.size() * hidden);
    REQUIRE(w.size() == static_cast<std::size_t>(a.vocab.size() * hidden));
    REQUIRE(b.size() == static_cast<std::size_t>(a.vocab.size()));
    std::vector<double> want(static_cast<std::size_t>(hidden));
    for (std::size_t i = 0; i < a.rows.size(); ++i) {
      if (a.rows[i].token < 0) continue;
      inputs.stage_values(InputStream::head_hidden, static_cast<std::uint64_t>(a.rows[i].token), 0, hidden, 0.5,
                          want.data());
      for (int k = 0; k < hidden; ++k) CHECK(h[i * hidden + static_cast<std::size_t>(k)] == want[k]);
    }
    for (std::int64_t v = a.vocab.begin; v < a.vocab.end; ++v) {
      inputs.stage_values(InputStream::head_weight, static_cast<std::uint64_t>(v), 0, hidden, w_scale, want.data());
      for (int k = 0; k < hidden; ++k) {
        CHECK(w[static_cast<std::size_t>((v - a.vocab.begin) * hidden + k)] == want[static_cast<std::size_t>(k)]);
      }
    }
    std::vector<double> bias(static_cast<std::size_t>(a.vocab.size()));
    inputs.stage_values(InputStream::head_bias, 0, a.vocab.begin, a.vocab.end, 1.0, bias.data());  // 0.5 x scale 2
    CHECK(b == bias);
  }
}
