// check-dump end to end in code: the built-in kernels' outputs, written as a dump the way a framework would
// write one, must give exactly the checks `run` gives (verdicts and margins) for the correct implementation
// and for catalogued bugs, at TP, CP (padding rows), DP, GA layouts, for cross-entropy and KD, every dtype.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "dump_writer.hpp"
#include "lossverify/dump/check_dump.hpp"
#include "lossverify/dump/stage_tensors.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/runner/run_case.hpp"
#include "test_support.hpp"

using namespace lossverify;
using namespace lossverify::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string safetensors_dtype(DType d) { return d == DType::bf16 ? "BF16" : d == DType::fp16 ? "F16" : "F32"; }

// Writes the outputs of a built-in run as a dump: one safetensors file per rank, one manifest.
// How a dump stores its losses: float32 as the kernels computed them, or rounded to bf16 the way
// torch.nn.functional.cross_entropy and Liger-Kernel return a bf16 loss (declared BF16, or the rounded values
// declared F32), optionally moved by a number of bf16 units. `softmax_logits`: the logits written as softmax
// probabilities, as code that overwrites its input in place leaves them.
struct LossStorage {
  bool bf16_values = false;
  bool declared_bf16 = false;
  int bf16_units_off = 0;
  bool softmax_logits = false;
};

RawTensor loss_tensor(std::vector<std::int64_t> shape, std::vector<float> values, const LossStorage& storage) {
  if (!storage.bf16_values) return raw_tensor("F32", std::move(shape), values);
  std::vector<std::uint16_t> bits;
  for (float& v : values) {
    std::uint16_t b = Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(v));
    if (v != 0.0f) b = static_cast<std::uint16_t>(b + storage.bf16_units_off);  // away from zero for v > 0
    bits.push_back(b);
    v = static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(b));
  }
  if (storage.declared_bf16) return raw_tensor("BF16", std::move(shape), bits);
  return raw_tensor("F32", std::move(shape), values);
}

// The kind's per-token inputs of rows [b, e) (as a framework holds them) and, with `outputs`, its per-token
// quantities as the rank computed them.
void write_kind_tensors(const Case& c, const InputSource& inputs, const RankOutput& out, std::int64_t b, std::int64_t e,
                        const std::string& p, std::map<std::string, RawTensor>& tensors, json& t, bool outputs) {
  const LossKind& kind = kind_of(c.loss);
  const std::vector<std::string> names = kind.token_inputs(c.loss);
  std::vector<std::vector<float>> columns(names.size());
  std::vector<float> values(names.size());
  for (std::int64_t i = b; i < e; ++i) {
    const std::int64_t token = out.assignment.rows[static_cast<std::size_t>(i)].token;
    std::fill(values.begin(), values.end(), 0.0f);
    if (token >= 0) kind.token_input_values(c, inputs, token, values);
    for (std::size_t k = 0; k < names.size(); ++k) columns[k].push_back(values[k]);
  }
  for (std::size_t k = 0; k < names.size(); ++k) {
    tensors[p + names[k]] = raw_tensor("F32", {e - b}, columns[k]);
    t[names[k]] = p + names[k];
  }
  const std::vector<std::string> quantities = kind.token_quantities();
  if (!outputs) return;
  for (std::size_t j = 0; j < quantities.size(); ++j) {
    std::vector<float> column;
    for (std::int64_t i = b; i < e; ++i) {
      column.push_back(out.token_values[static_cast<std::size_t>(i) * quantities.size() + j]);
    }
    const std::string key = "token_" + quantities[j];
    tensors[p + key] = raw_tensor("F32", {e - b}, column);
    t[key] = p + key;
  }
}

// A staged case's per-row tensors of rows [b, e): the stage's inputs (an LM head's h) as exported, its gradients (dh)
// as the rank computed them; no logits (the stage makes them) and no gradient of them (kept internal).
void write_stage_rows(const Case& c, const InputSource& inputs, const RankOutput& out, std::int64_t b, std::int64_t e,
                      const std::string& p, std::map<std::string, RawTensor>& tensors, json& t) {
  const std::string dtype = safetensors_dtype(c.inputs.dtype);
  RankAssignment rows = out.assignment;
  rows.rows.assign(out.assignment.rows.begin() + b, out.assignment.rows.begin() + e);
  for (const StageInput& input : c.loss.stage->inputs(c)) {
    if (input.rows != StageInput::Rows::token) continue;
    const std::vector<double> values = dump::stage_input_values(input, inputs, rows);
    tensors[p + input.name] =
        RawTensor{dtype, dump::stage_input_shape(input, rows), dump::to_dtype_bytes(values, c.inputs.dtype)};
    t[input.name] = p + input.name;
  }
  const std::size_t element = dtype_size(c.inputs.dtype);
  const std::vector<std::string> gradients = c.loss.stage->gradients();
  for (std::size_t w = 0; w < gradients.size(); ++w) {
    const std::int64_t cols = out.stage_columns[w];
    const auto from = out.stage_grads[w].begin() + b * cols * static_cast<std::int64_t>(element);
    const auto to = out.stage_grads[w].begin() + e * cols * static_cast<std::int64_t>(element);
    tensors[p + gradients[w]] = RawTensor{dtype, {e - b, cols}, std::vector<std::byte>(from, to)};
    t[gradients[w]] = p + gradients[w];
  }
}

// A staged case's tensors of the rank's vocabulary shard: the stage's inputs (W, b) as exported, its parameter
// gradients (dW, db) as the rank computed them. Returns the rank's "stage" object.
json write_stage_shard(const Case& c, const InputSource& inputs, const RankOutput& out,
                       std::map<std::string, RawTensor>& tensors) {
  const std::string dtype = safetensors_dtype(c.inputs.dtype);
  json shard = json::object();
  for (const StageInput& input : c.loss.stage->inputs(c)) {
    if (input.rows == StageInput::Rows::token) continue;
    const std::vector<double> values = dump::stage_input_values(input, inputs, out.assignment);
    tensors[input.name] =
        RawTensor{dtype, dump::stage_input_shape(input, out.assignment), dump::to_dtype_bytes(values, c.inputs.dtype)};
    shard[input.name] = input.name;
  }
  const std::vector<std::string> parameters = c.loss.stage->parameters();
  for (std::size_t q = 0; q < parameters.size(); ++q) {
    const ParameterShape shape = c.loss.stage->parameter_shape(q, c, out.assignment);
    if (shape.rows * shape.columns == 0) continue;
    std::vector<std::int64_t> dims = {shape.rows, shape.columns};
    if (shape.columns == 1) dims = {shape.rows};
    tensors[parameters[q]] = RawTensor{dtype, dims, out.stage_params[q]};
    shard[parameters[q]] = parameters[q];
  }
  return shard;
}

// `edit`, where given, changes each rank's tensors before they are written (a dump with one thing wrong).
using TensorEdit = std::function<void(std::map<std::string, RawTensor>&)>;

fs::path write_dump(const Case& c, const InputSource& inputs, const std::vector<RankOutput>& outputs,
                    const std::string& name, bool token_loss = true, bool stats = true, LossStorage storage = {},
                    bool kind_outputs = true, const TensorEdit& edit = {}) {
  const fs::path dir = temp_folder("dump-" + name);
  const json resolved = c.resolved();
  json loss = resolved["loss"];
  loss.erase("upstream_weights");  // dumped as grad_output tensors instead
  const LossKind& kind = kind_of(c.loss);
  const bool kd = kind.inputs().teacher_logits;
  const bool labelled = kind.inputs().labels;
  const bool none = c.loss.reduction == Reduction::none;
  std::vector<std::int64_t> cu = {0};
  for (auto l : c.batch.sequence_lengths) cu.push_back(cu.back() + l);
  json manifest = {
      {"format", "lossverify.dump/1"},
      {"name", name},
      {"shape",
       {{"tokens", c.shape.tokens}, {std::string(kind.column_axis()), c.shape.vocab / kind.row_blocks(c.loss)}}},
      {"dtype", std::string(to_string(c.inputs.dtype))},
      {"cu_seqlens", cu},
      {"loss", loss},
      {"layout", resolved["layout"]},
      {"framework", resolved["framework"]},
      {"tolerances", resolved["tolerances"]},
      {"ranks", json::array()}};
  if (resolved.contains("stage")) manifest["stage"] = resolved["stage"];
  const std::size_t element = dtype_size(c.inputs.dtype);
  for (const RankOutput& out : outputs) {
    const auto& a = out.assignment;
    const std::int64_t cols = a.vocab.size();
    std::map<std::string, RawTensor> tensors;
    json mbs = json::array();
    for (std::size_t k = 0; k + 1 < a.micro_batch_begin.size(); ++k) {
      const std::int64_t b = a.micro_batch_begin[k];
      const std::int64_t e = a.micro_batch_begin[k + 1];
      const std::int64_t rows = e - b;
      const std::string p = "mb" + std::to_string(k) + ".";
      RawTensor logits{safetensors_dtype(c.inputs.dtype),
                       {rows, cols},
                       std::vector<std::byte>(static_cast<std::size_t>(rows * cols) * element)};
      RawTensor teacher = logits;
      std::vector<std::int64_t> labels, row_tokens;
      std::vector<float> mask, losses;
      std::vector<double> upstream;
      for (std::int64_t i = b; i < e; ++i) {
        const std::int64_t t = a.rows[static_cast<std::size_t>(i)].token;
        row_tokens.push_back(t);
        dispatch_dtype(c.inputs.dtype, [&](auto type) {
          using S = typename decltype(type)::type;
          S* row = reinterpret_cast<S*>(logits.data.data()) + (i - b) * cols;
          S* trow = reinterpret_cast<S*>(teacher.data.data()) + (i - b) * cols;
          if (t >= 0 && storage.softmax_logits) {
            std::vector<double> whole(static_cast<std::size_t>(c.shape.vocab));
            inputs.logits(t, 0, c.shape.vocab, whole.data());
            const double top = *std::max_element(whole.begin(), whole.end());
            double sum = 0.0;
            for (double x : whole) sum += std::exp(x - top);
            for (std::int64_t j = 0; j < cols; ++j) {
              row[j] = S(static_cast<float>(std::exp(whole[static_cast<std::size_t>(a.vocab.begin + j)] - top) / sum));
            }
          } else if (t >= 0) {
            inputs.logits(t, a.vocab.begin, a.vocab.end, row);
            if (kd) inputs.teacher_logits(t, a.vocab.begin, a.vocab.end, trow);
          }
        });
        labels.push_back(t >= 0 ? inputs.label(t) : c.loss.ignore_index);
        mask.push_back(t >= 0 && inputs.is_valid(t) ? 1.0f : 0.0f);
        losses.push_back(out.token_loss[static_cast<std::size_t>(i)]);
        upstream.push_back(t >= 0 ? inputs.upstream_weight(t) : 1.0);
      }
      RawTensor grad{logits.dtype,
                     {rows, cols},
                     std::vector<std::byte>(out.grad.begin() + b * cols * static_cast<std::int64_t>(element),
                                            out.grad.begin() + e * cols * static_cast<std::int64_t>(element))};
      json t = json::object();
      if (c.loss.stage == nullptr) {
        t = {{"logits", p + "logits"}, {"grad_logits", p + "grad"}};
        tensors[p + "logits"] = logits;
        tensors[p + "grad"] = grad;
      } else {
        write_stage_rows(c, inputs, out, b, e, p, tensors, t);
      }
      if (kd) {
        tensors[p + "teacher"] = teacher;
        t["teacher_logits"] = p + "teacher";
      }
      if (labelled) {
        tensors[p + "labels"] = raw_tensor("I64", {rows}, labels);
        t["labels"] = p + "labels";
      } else {
        tensors[p + "mask"] = raw_tensor("F32", {rows}, mask);
        t["loss_mask"] = p + "mask";
      }
      if (token_loss) {
        tensors[p + "token_loss"] = loss_tensor({rows}, losses, storage);
        t["token_loss"] = p + "token_loss";
      }
      write_kind_tensors(c, inputs, out, b, e, p, tensors, t, kind_outputs);
      if (const std::string scope(kind.scope_values_name()); !scope.empty() && kind_outputs) {
        const auto width = static_cast<std::ptrdiff_t>(c.shape.vocab);
        const auto at = out.scope_values.begin() + static_cast<std::ptrdiff_t>(k) * width;
        tensors[p + scope] = raw_tensor("F64", {c.shape.vocab}, std::vector<double>(at, at + width));
        t[scope] = p + scope;
      }
      if (none) {
        tensors[p + "grad_output"] = raw_tensor("F64", {rows}, upstream);
        t["grad_output"] = p + "grad_output";
      }
      json rows_json = json::array();
      for (auto token : row_tokens) rows_json.push_back(token);
      mbs.push_back({{"rows", rows_json}, {"tensors", t}});
    }
    json rank = {{"tp", a.coordinates.tp},
                 {"cp", a.coordinates.cp},
                 {"dp", a.coordinates.dp},
                 {"vocab", {a.vocab.begin, a.vocab.end}},
                 {"file", "rank" + std::to_string(a.world_rank) + ".safetensors"},
                 {"micro_batches", mbs}};
    if (c.loss.stage != nullptr) rank["stage"] = write_stage_shard(c, inputs, out, tensors);
    if (stats) {
      rank["stats"] = {{"num_tokens", "num_tokens"}};
      tensors["num_tokens"] = raw_tensor("I64", {}, std::vector<std::int64_t>{out.logged_valid_tokens});
      if (out.has_reduced_loss) {
        tensors["loss"] = loss_tensor({}, std::vector<float>{out.reduced_loss}, storage);
        rank["stats"]["loss"] = "loss";
      }
      const std::vector<std::string> statistics = kind_of(c.loss).logged_statistics(c.loss);
      for (std::size_t k = 0; k < statistics.size() && kind_outputs; ++k) {
        rank["stats"][statistics[k]] = out.logged_stats[k];
      }
    }
    if (edit) edit(tensors);
    write_bytes(dir / ("rank" + std::to_string(a.world_rank) + ".safetensors"), safetensors_bytes(tensors));
    manifest["ranks"].push_back(rank);
  }
  write_bytes(dir / "manifest.json", manifest.dump(1));
  return dir;
}

struct Outcome {
  RunResult run;
  RunResult dumped;
};

Outcome run_both(const Case& c, const std::string& impl, bool token_loss = true, bool stats = true,
                 bool kind_outputs = true) {
  RunOptions options;
  options.implementation = impl;
  options.threads = 2;
  const InputSource inputs(c);
  const RankRun ranks = execute_ranks(c, inputs, *find_implementation(impl), options);
  const fs::path dir = write_dump(c, inputs, ranks.outputs, c.name + "-" + impl, token_loss, stats, {}, kind_outputs);
  const auto problem = dump::load_dump((dir / "manifest.json").string());
  Outcome o{run_case(c, options), dump::check_dump(*problem, {2})};
  // The report of a dump validates as JSON and locates the worst elements in the dump.
  const json j = dump::dump_run_to_json(*problem, o.dumped);
  CHECK(j["dump"]["ranks"].size() == static_cast<std::size_t>(c.layout.world_size()));
  fs::remove_all(dir);
  return o;
}

// check-dump reproduces run: the same verdict and margin for every check.
void expect_same(const Case& c, const std::string& impl) {
  CAPTURE(c.name);
  CAPTURE(impl);
  const Outcome o = run_both(c, impl);
  REQUIRE(o.run.checks.size() == o.dumped.checks.size());
  for (std::size_t i = 0; i < o.run.checks.size(); ++i) {
    const CheckResult& a = o.run.checks[i];
    const CheckResult& b = o.dumped.checks[i];
    CAPTURE(a.name);
    CHECK(a.name == b.name);
    CHECK(a.verdict == b.verdict);
    if (b.metrics.is_object() && b.metrics.value("dumped", true) == false) {
      CHECK(a.verdict == Verdict::not_applicable);  // the logits' gradient a fused head keeps: in no dump
      continue;
    }
    if (std::isfinite(a.margin)) {
      CHECK(b.margin == doctest::Approx(a.margin).epsilon(1e-12));
    } else {
      CHECK(a.margin == b.margin);
    }
  }
  CHECK(o.run.verdict == o.dumped.verdict);
}

Case layout_case(const json& extra) {
  json j = case_json(41, 203, 2, "fp32");
  j.merge_patch(extra);
  return make_case(j);
}

}  // namespace

TEST_CASE("check-dump of the built-in kernels' dump reproduces run: TP, smoothing, bf16") {
  const Case c = layout_case({{"name", "tp4-bf16"},
                              {"inputs", {{"dtype", "bf16"}, {"ignore_fraction", 0.2}}},
                              {"loss", {{"label_smoothing", 0.1}, {"smoothing_convention", "megatron"}}},
                              {"layout", {{"tp", 4}}}});
  for (const char* impl : {"correct", "smoothing-partition-vocab", "no-max-shift"}) expect_same(c, impl);
  CHECK(run_both(c, "correct").dumped.verdict == Verdict::pass);
  CHECK(run_both(c, "smoothing-partition-vocab").dumped.verdict == Verdict::fail);
}

TEST_CASE("check-dump reproduces run: CP zigzag with padding rows, packed sequences, fp16") {
  const Case c = layout_case({{"name", "cp2"},
                              {"shape", {{"tokens", nullptr}}},
                              {"inputs", {{"dtype", "fp16"}}},
                              {"batch", {{"sequence_lengths", {13, 7, 22, 5}}}},
                              {"layout", {{"tp", 2}, {"cp", 2}}}});
  for (const char* impl : {"correct", "cp-roll-after-split", "cp-duplicated-loss"}) expect_same(c, impl);
}

TEST_CASE("check-dump reproduces run: DP x GA micro-batches, both framework models") {
  const Case c = layout_case({{"name", "dp2-ga2"},
                              {"shape", {{"tokens", nullptr}}},
                              {"batch", {{"sequence_lengths", {8, 4, 2, 1, 6, 3, 9, 5}}}},
                              {"layout", {{"tp", 2}, {"cp", 2}, {"dp", 2}, {"ga", 2}}},
                              {"framework", {{"grad_reduce", "sum"}, {"ga_reduce", "mean"}}}});
  for (const char* impl : {"correct", "dp-local-mean", "ga-microbatch-mean", "cp-stats-dp-only"}) expect_same(c, impl);
}

TEST_CASE("check-dump reproduces run: KD and reduction none with upstream weights") {
  const Case kd = layout_case({{"name", "kd"},
                               {"loss", {{"kind", "kd"}, {"temperature", 2.0}}},
                               {"inputs", {{"ignore_fraction", 0.1}, {"teacher", {{"scale", 3.0}}}}},
                               {"layout", {{"tp", 3}}}});
  for (const char* impl : {"correct", "kd-no-t2", "kd-local-softmax"}) expect_same(kd, impl);
  const Case none = layout_case(
      {{"name", "none"},
       {"loss",
        {{"reduction", "none"}, {"upstream_weights", {{"distribution", "uniform"}, {"low", 0.25}, {"high", 4.0}}}}},
       {"layout", {{"tp", 3}}}});
  for (const char* impl : {"correct", "grad-output-first", "none-divides-grad"}) expect_same(none, impl);
}

TEST_CASE("check-dump: what the dump lacks is reported as not dumped, and the rest is still checked") {
  const Case c = layout_case({{"name", "partial"},
                              {"shape", {{"tokens", nullptr}}},
                              {"batch", {{"sequence_lengths", {17, 9, 11, 4}}}},
                              {"layout", {{"tp", 2}, {"dp", 2}}},
                              {"inputs", {{"ignore_fraction", 0.2}}}});
  auto find = [](const RunResult& r, const std::string& name) -> const CheckResult& {
    for (const auto& check : r.checks) {
      if (check.name == name) return check;
    }
    FAIL("no check " << name);
    return r.checks.front();
  };
  {
    const Outcome o = run_both(c, "correct", /*token_loss=*/false, /*stats=*/true);
    CHECK(find(o.dumped, "rank_agreement").verdict == Verdict::not_applicable);
    CHECK(find(o.dumped, "rank_agreement").metrics["dumped"] == false);
    CHECK(find(o.dumped, "loss").metrics["per_token"]["dumped"] == false);
    CHECK(find(o.dumped, "loss").verdict == Verdict::pass);  // the logged loss is compared
    CHECK(find(o.dumped, "loss").metrics["reduced"]["compared"] == 4);
  }
  {
    const Outcome o = run_both(c, "correct", /*token_loss=*/true, /*stats=*/false);
    CHECK(find(o.dumped, "stats").verdict == Verdict::not_applicable);
    CHECK(find(o.dumped, "loss").metrics["reduced"]["dumped"] == false);
    CHECK(find(o.dumped, "loss").verdict == Verdict::pass);
    CHECK(find(o.dumped, "loss").margin ==
          doctest::Approx(find(o.run, "loss").metrics["per_token"]["margin"].get<double>()));
  }
  {  // a wrong logged loss with no per-token losses still fails
    const Outcome o = run_both(c, "dp-local-mean", /*token_loss=*/false, /*stats=*/true);
    CHECK(find(o.dumped, "loss").verdict == Verdict::fail);
    REQUIRE(find(o.dumped, "loss").worst);
    CHECK(find(o.dumped, "loss").worst->token == -1);
    CHECK(find(o.dumped, "grad").verdict == Verdict::fail);
  }
}

TEST_CASE("manifest: rows, ranks, coordinates and sequences") {
  const json base = {{"format", "lossverify.dump/1"},
                     {"shape", {{"tokens", 6}, {"vocab", 4}}},
                     {"dtype", "bf16"},
                     {"layout", {{"tp", 2}, {"cp", 1}, {"dp", 1}}},
                     {"cu_seqlens", {0, 2, 2, 6}},
                     {"ranks",
                      {{{"tp", 1},
                        {"vocab", {2, 4}},
                        {"rows", {json::array({0, 3}), {{"padding", 2}}, 3, json::array({4, 6})}},
                        {"tensors",
                         {{"logits", {{"file", "r1.safetensors"}, {"name", "x"}}},
                          {"grad_logits", {{"file", "g.npy"}}},
                          {"labels", {{"file", "r1.safetensors"}, {"name", "y"}}},
                          {"token_loss", {{"file", "r1.safetensors"}, {"name", "l"}}}}}},
                       {{"rank", 0},
                        {"vocab", {0, 2}},
                        {"file", "r0.safetensors"},
                        {"rows", {json::array({0, 3}), {{"padding", 2}}, 3, json::array({4, 6})}},
                        {"tensors", {{"logits", "x"}, {"grad_logits", "g"}, {"labels", "y"}, {"token_loss", "l"}}}}}}};
  const dump::Manifest m = dump::parse_manifest(base, "some/dir/manifest.json");
  REQUIRE(m.ranks.size() == 2);
  CHECK(m.ranks[0].world_rank == 0);  // sorted by world rank
  CHECK(m.ranks[1].coordinates.tp == 1);
  CHECK(m.ranks[1].micro_batches[0].rows == std::vector<std::int64_t>{0, 1, 2, -1, -1, 3, 4, 5});
  CHECK(m.ranks[0].micro_batches[0].tensors.at("logits").file == "some/dir/r0.safetensors");
  CHECK(m.ranks[1].micro_batches[0].tensors.at("grad_logits").file == "some/dir/g.npy");
  CHECK(m.ranks[1].micro_batches[0].tensors.at("grad_logits").name.empty());
  CHECK(m.the_case.batch.sequence_lengths == std::vector<std::int64_t>{2, 4});  // the empty sequence is dropped
  CHECK(m.the_case.inputs.dtype == DType::bf16);
  CHECK(m.the_case.name == "dir");
  CHECK(m.dumped.token_loss);
  CHECK(!m.dumped.loss);
  CHECK(m.token_row[3] == 5);
  auto error = [&](const std::function<void(json&)>& edit) {
    json j = base;
    edit(j);
    try {
      dump::parse_manifest(j, "m.json");
    } catch (const Error& e) {
      CHECK(e.code() == ExitCode::usage_error);
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error([](json&) {}).empty());
  CHECK(error([](json& j) { j["ranks"][1]["file"] = "r0.npy"; }).find("default file must be a .safetensors file") !=
        std::string::npos);
  CHECK(error([](json& j) { j["ranks"][0]["tensors"]["logits"] = "x"; }).find("needs the rank's \"file\"") !=
        std::string::npos);
  CHECK(error([](json& j) {
          j["ranks"][1]["rows"] = json::array({json::array({0, 8})});
        }).find("$.ranks[1].rows[0]: range [0, 8) outside [0, 6)") != std::string::npos);
  CHECK(error([](json& j) { j["ranks"][1]["rows"][2] = -2; }).find("token -2 outside") != std::string::npos);
  CHECK(error([](json& j) { j["ranks"][1]["rows"][1]["padding"] = 1ll << 40; }).find("too many rows") !=
        std::string::npos);
  CHECK(error([](json& j) { j["ranks"][1]["tp"] = 2; }).find("tp = 2 outside [0, 2)") != std::string::npos);
  CHECK(error([](json& j) { j["layout"]["ga"] = 2; }).find("give the rank's \"micro_batches\"") != std::string::npos);
  CHECK(error([](json& j) { j["cu_seqlens"] = {0, 2, 5}; }).find("must end at shape.tokens = 6") != std::string::npos);
  CHECK(error([](json& j) { j["ranks"][0].erase("vocab"); }).find("$.ranks[0].vocab: required key is missing") !=
        std::string::npos);
  CHECK(error([](json& j) { j["dtype"] = "fp64"; }).find("$.dtype: expected one of fp32|bf16|fp16") !=
        std::string::npos);
  CHECK(error([](json& j) {
          j["ranks"][0]["stats"] = {{"num_tokens", 2.5}};
        }).find("expected integer") != std::string::npos);
  CHECK(error([](json& j) {
          j["ranks"][0]["stats"] = {{"num_tokens", "NaN"}};
        }).find("a count must be a non-negative integer") != std::string::npos);
  CHECK(
      error([](json& j) {
        j["ranks"][0]["stats"] = {{"loss", 1.0}};
      }).find("has stats.loss, but $.ranks[1].stats lacks it: every rank and micro-batch must dump the same things") !=
      std::string::npos);
  CHECK(error([](json& j) { j["ranks"].push_back(j["ranks"][0]); }).find("3 ranks, but the layout tp*cp*dp = 2") !=
        std::string::npos);
  // Logged losses may be non-finite; strict JSON spells them as strings (what lossverify.dump writes).
  for (const char* spelled : {"NaN", "Infinity", "-Infinity"}) {
    json j = base;
    for (json& r : j["ranks"]) r["stats"] = {{"loss", spelled}};
    const dump::Manifest nonfinite = dump::parse_manifest(j, "m.json");
    CHECK(!std::isfinite(nonfinite.ranks[0].loss.value));
    CHECK(std::isnan(nonfinite.ranks[0].loss.value) == (std::string(spelled) == "NaN"));
  }
  CHECK(error([](json& j) {
          j["loss"] = {{"label_smoothing", 0.1}};
        }).find("$.loss.smoothing_convention: label_smoothing > 0 needs an explicit convention") != std::string::npos);
  CHECK(error([](json& j) { j["loss"] = {{"label_smoothing", 0.1}, {"smoothing_convention", "pytorch"}}; }).empty());
}

// Tensor files must lie in the manifest's folder, symlinks resolved, unless allowed: absolute paths, ../ and
// symlinks out of the folder are errors naming the JSON path that names the file; inside, anything goes.
TEST_CASE("manifest: tensor files are confined to the manifest's folder") {
  const fs::path dir = temp_folder("confined");
  fs::create_directories(dir / "dump" / "sub");
  fs::create_directories(dir / "elsewhere");
  write_bytes(dir / "elsewhere" / "x.safetensors", "");
  write_bytes(dir / "dump" / "sub" / "x.safetensors", "");
  fs::create_symlink(dir / "elsewhere" / "x.safetensors", dir / "dump" / "out.safetensors");
  fs::create_symlink("sub/x.safetensors", dir / "dump" / "in.safetensors");
  fs::create_symlink(dir / "elsewhere" / "missing.safetensors", dir / "dump" / "dangling.safetensors");
  const json base = {
      {"format", "lossverify.dump/1"},
      {"shape", {{"tokens", 2}, {"vocab", 4}}},
      {"dtype", "fp32"},
      {"layout", {{"tp", 2}}},
      {"ranks",
       {{{"rank", 0},
         {"vocab", {0, 2}},
         {"file", "r0.safetensors"},
         {"rows", {json::array({0, 2})}},
         {"tensors", {{"logits", "x"}, {"grad_logits", "g"}, {"labels", "y"}, {"token_loss", "l"}}}},
        {{"rank", 1},
         {"vocab", {2, 4}},
         {"file", "r1.safetensors"},
         {"rows", {json::array({0, 2})}},
         {"tensors",
          {{"logits", "x"}, {"grad_logits", {{"file", "g1.npy"}}}, {"labels", "y"}, {"token_loss", "l"}}}}}}};
  const std::string manifest = (dir / "dump" / "manifest.json").string();
  auto error = [&](const std::function<void(json&)>& edit, bool allow = false) {
    json j = base;
    edit(j);
    dump::ManifestLimits limits;
    limits.allow_outside_folder = allow;
    try {
      dump::parse_manifest(j, manifest, limits);
    } catch (const Error& e) {
      CHECK(e.code() == ExitCode::usage_error);
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string outside =
      "outside the dump's folder " + fs::canonical(dir / "dump").string() + " (symlinks resolved)";
  CHECK(error([](json&) {}).empty());
  // inside: a subfolder, a symlink to a file in it, an absolute path into the folder, a ../ that comes back
  CHECK(error([](json& j) { j["ranks"][1]["file"] = "sub/r1.safetensors"; }).empty());
  CHECK(error([](json& j) { j["ranks"][1]["file"] = "in.safetensors"; }).empty());
  CHECK(error([&](json& j) { j["ranks"][1]["file"] = (dir / "dump" / "r1.safetensors").string(); }).empty());
  CHECK(error([](json& j) { j["ranks"][1]["file"] = "../dump/r1.safetensors"; }).empty());
  // outside: ../, an absolute path, a symlink out, a sibling folder whose name starts with the folder's
  const std::string dotdot = error([](json& j) { j["ranks"][1]["file"] = "../elsewhere/r1.safetensors"; });
  CHECK(dotdot.find(manifest + ": $.ranks[1].file: the tensor file ") == 0);
  CHECK(dotdot.find("resolves to " + fs::canonical(dir).string() + "/elsewhere/r1.safetensors, " + outside) !=
        std::string::npos);
  CHECK(dotdot.find("--allow-outside-dump") != std::string::npos);
  CHECK(
      error([](json& j) {
        j["ranks"][1]["tensors"]["grad_logits"]["file"] = "/etc/g1.npy";
      }).find("$.ranks[1].tensors.grad_logits.file: the tensor file /etc/g1.npy resolves to /etc/g1.npy, " + outside) !=
      std::string::npos);
  CHECK(error([](json& j) { j["ranks"][0]["file"] = "out.safetensors"; }).find("$.ranks[0].file: ") !=
        std::string::npos);
  CHECK(error([](json& j) { j["ranks"][0]["file"] = "../dump-other/r0.safetensors"; }).find(outside) !=
        std::string::npos);
  CHECK(error([](json& j) {
          j["cu_seqlens"] = {{"file", "/tmp/cu.npy"}};
        }).find("$.cu_seqlens.file: ") != std::string::npos);
  CHECK(error([](json& j) {
          j["ranks"][0]["stats"] = {{"loss", {{"file", "../l.npy"}}}};
          j["ranks"][1]["stats"] = {{"loss", "l"}};
        }).find("$.ranks[0].stats.loss.file: ") != std::string::npos);
  // a symlink to nowhere (it could lead anywhere once its target appears)
  CHECK(error([](json& j) { j["ranks"][0]["file"] = "dangling.safetensors"; })
            .find("$.ranks[0].file: the tensor file " + (dir / "dump" / "dangling.safetensors").string() +
                  " is a symlink to " + (dir / "elsewhere" / "missing.safetensors").string() +
                  ", which does not exist") != std::string::npos);
  // allowed: the same manifests parse
  CHECK(error([](json& j) { j["ranks"][1]["file"] = "../elsewhere/r1.safetensors"; }, true).empty());
  CHECK(error([](json& j) { j["ranks"][0]["file"] = "out.safetensors"; }, true).empty());
  // a NUL would cut the name short where the system opens it
  CHECK(error([](json& j) {
          j["ranks"][0]["file"] = std::string("r0.safetensors\0.npy", 19);
        }).find("$.ranks[0].file: a file name must not hold a NUL character") != std::string::npos);
  fs::remove_all(dir);
}

// Names with control characters or invalid UTF-8 (a folder's name) are stored and printed escaped.
TEST_CASE("manifest: names are printable") {
  const json base = {{"format", "lossverify.dump/1"},
                     {"shape", {{"tokens", 2}, {"vocab", 2}}},
                     {"dtype", "fp32"},
                     {"implementation", "mine\x1b[2J"},
                     {"ranks",
                      {{{"rank", 0},
                        {"vocab", {0, 2}},
                        {"file", "r\x01.safetensors"},
                        {"rows", {json::array({0, 2})}},
                        {"tensors", {{"logits", "x"}, {"grad_logits", "g"}, {"labels", "y"}, {"token_loss", "l"}}}}}}};
  const dump::Manifest m = dump::parse_manifest(base, "odd\xff\x07/manifest.json");
  CHECK(m.path == "odd\\xFF\\x07/manifest.json");
  CHECK(m.the_case.name == "odd\\xFF\\x07");
  CHECK(m.implementation == "mine\\x1B[2J");
  CHECK(m.ranks[0].micro_batches[0].tensors.at("logits").file == "odd\xff\x07/r\x01.safetensors");  // to open
  json bad = base;
  bad["ranks"][0]["tensors"]["logits"] = {{"file", "x\x1b.bin"}};
  CHECK_THROWS_WITH_AS(
      dump::parse_manifest(bad, "odd\xff/manifest.json"),
      "odd\\xFF/manifest.json: $.ranks[0].tensors.logits.file: expected a .safetensors or .npy file, got "
      "\"x\\x1B.bin\"",
      Error);
}

// A loss stored in bf16 (what torch and Liger-Kernel return for bf16 logits) is judged in bf16 units at the
// exact value: correctly rounded losses pass (within half a unit); the same values declared float32 fail, and
// values two units away fail.
TEST_CASE("check_dump_judges_bf16_losses_in_bf16_units") {
  const Case c = layout_case({{"name", "bf16-loss"}, {"inputs", {{"dtype", "bf16"}, {"scale", 3.0}}}});
  RunOptions options;
  options.threads = 2;
  const InputSource inputs(c);
  const RankRun ranks = execute_ranks(c, inputs, *find_implementation("correct"), options);
  auto loss_check = [&](const LossStorage& storage, const std::string& name) {
    const fs::path dir = write_dump(c, inputs, ranks.outputs, name, true, true, storage);
    const auto problem = dump::load_dump((dir / "manifest.json").string());
    const RunResult r = dump::check_dump(*problem, {2});
    fs::remove_all(dir);
    for (const CheckResult& check : r.checks) {
      if (check.name == "loss") return check;
    }
    FAIL("no loss check");
    return CheckResult{};
  };
  const CheckResult rounded = loss_check({true, true, 0}, "bf16-loss-rounded");
  CHECK(rounded.verdict == Verdict::pass);
  CHECK(rounded.margin > 0.01);  // the rounding is visible in the margin
  CHECK(rounded.margin < 0.6);   // half a unit, plus the kernel's float32 error
  const CheckResult as_float = loss_check({true, false, 0}, "bf16-loss-as-f32");
  CHECK(as_float.verdict == Verdict::fail);
  CHECK(as_float.margin > 10.0);
  const CheckResult two_units = loss_check({true, true, 2}, "bf16-loss-two-units");
  CHECK(two_units.verdict == Verdict::fail);
  CHECK(two_units.margin > 1.4);
}

// Logits that are softmax probabilities (overwritten in place, dumped after the call) fail, and the failure
// says why; real logits that fail carry no such hint.
TEST_CASE("check_dump_hints_at_logits_overwritten_by_softmax") {
  const Case c = layout_case(
      {{"name", "softmax-logits"}, {"loss", {{"label_smoothing", 0.1}, {"smoothing_convention", "megatron"}}}});
  RunOptions options;
  options.threads = 2;
  const InputSource inputs(c);
  auto checked = [&](const std::string& impl, bool softmax, const std::string& name) {
    const RankRun ranks = execute_ranks(c, inputs, *find_implementation(impl), options);
    LossStorage storage;
    storage.softmax_logits = softmax;
    const fs::path dir = write_dump(c, inputs, ranks.outputs, name, true, true, storage);
    const auto problem = dump::load_dump((dir / "manifest.json").string());
    RunResult r = dump::check_dump(*problem, {2});
    fs::remove_all(dir);
    return r;
  };
  const RunResult overwritten = checked("correct", true, "softmax-logits");
  CHECK(overwritten.verdict == Verdict::fail);
  REQUIRE(overwritten.hints.size() == 1);
  CHECK(overwritten.hints[0].find("look like softmax probabilities") != std::string::npos);
  const RunResult buggy = checked("smoothing-partition-vocab", false, "real-logits-bug");
  CHECK(buggy.verdict == Verdict::fail);
  CHECK(buggy.hints.empty());
  CHECK(checked("correct", false, "real-logits").hints.empty());
}

// Dumps of one problem at several layouts: the invariance check compares their global answers, and a dump
// of another problem is refused before it is compared.
TEST_CASE("check_dump_sweep_compares_layouts_of_one_problem") {
  const Case base =
      layout_case({{"name", "sweep"}, {"loss", {{"label_smoothing", 0.1}, {"smoothing_convention", "pytorch"}}}});
  RunOptions options;
  options.threads = 2;
  auto dumped = [&](int tp, const std::string& impl, double scale) {
    Case c = base;
    c.layout.tp = tp;
    c.inputs.scale = scale;
    const InputSource inputs(c);
    const RankRun ranks = execute_ranks(c, inputs, *find_implementation(impl), options);
    const fs::path dir = write_dump(c, inputs, ranks.outputs, "sweep-tp" + std::to_string(tp) + "-" + impl);
    return dump::load_dump((dir / "manifest.json").string(), /*fingerprint_inputs=*/true);
  };
  dump::DumpCheckOptions keep;
  keep.threads = 2;
  keep.keep_snapshot = true;
  auto invariance = [&](const dump::DumpProblem& a, const dump::DumpProblem& b) {
    dump::require_same_problem(a, b);
    std::vector<LayoutSnapshot> snapshots;
    for (const dump::DumpProblem* p : {&a, &b}) snapshots.push_back(*dump::check_dump(*p, keep).snapshot);
    return invariance_check(base, snapshots, {"tp1", "tp3"});
  };
  const auto tp1 = dumped(1, "correct", 2.0);
  const auto tp3 = dumped(3, "correct", 2.0);
  CHECK(invariance(*tp1, *tp3).verdict == Verdict::pass);
  // A bug whose answers depend on the layout breaks invariance.
  const auto tp3_bug = dumped(3, "smoothing-partition-vocab", 2.0);
  const CheckResult broken = invariance(*tp1, *tp3_bug);
  CHECK(broken.verdict == Verdict::fail);
  CHECK(broken.margin > 10.0);
  // Other inputs: not a sweep of one problem.
  const auto other_inputs = dumped(3, "correct", 2.5);
  try {
    dump::require_same_problem(*tp1, *other_inputs);
    FAIL("a dump of other inputs was accepted");
  } catch (const dump::DumpError& e) {
    CHECK(std::string(e.what()).find("its logits differ from the first dump's") != std::string::npos);
  }
}

// Small policy cases with the shapes of the shipped ones: TP x DP x GA with the clip, dual clip, k3 and
// temperature; CP x DP with Dr. GRPO's aggregation and whitening; a TP log-prob and entropy pass; GSPO's
// sequence ratio over TP x CP.
Case policy_case(const std::string& name, const json& loss, const json& layout) {
  json j = {{"name", name},
            {"shape", {{"vocab", 301}}},
            {"batch", {{"sequence_lengths", {21, 9, 30, 12, 17, 5, 14, 8}}}},
            {"loss", {{"kind", "policy"}}},
            {"inputs", {{"seed", 23}, {"scale", 2.0}, {"ignore_fraction", 0.2}}},
            {"layout", layout},
            {"timeout_seconds", 60.0}};
  j["loss"].merge_patch(loss);
  return make_case(j);
}

TEST_CASE("check-dump reproduces run for the policy kind: its inputs, per-token log-probs, entropies, statistics") {
  const Case grpo = policy_case("grpo",
                                {{"temperature", 0.7},
                                 {"clip_low", 0.2},
                                 {"clip_high", 0.28},
                                 {"dual_clip", 3.0},
                                 {"kl_penalty", "k3"},
                                 {"kl_coef", 0.05},
                                 {"entropy_coef", 0.01}},
                                {{"tp", 2}, {"dp", 2}, {"ga", 2}});
  const Case drgrpo = policy_case("drgrpo",
                                  {{"aggregation", "seq-mean-token-sum-norm"},
                                   {"norm_constant", 64.0},
                                   {"kl_penalty", "k1"},
                                   {"kl_coef", 0.1},
                                   {"whiten_advantages", true}},
                                  {{"cp", 2}, {"dp", 2}});
  const Case logprob =
      policy_case("logprob", {{"objective", "logprob"}, {"entropy_coef", 0.02}, {"temperature", 1.3}}, {{"tp", 4}});
  const Case gspo = policy_case("gspo",
                                {{"ratio", "sequence"},
                                 {"aggregation", "seq-mean-token-mean"},
                                 {"kl_penalty", "k2"},
                                 {"kl_coef", 0.05},
                                 {"entropy_coef", 0.01}},
                                {{"tp", 2}, {"cp", 2}});
  const std::pair<const Case*, std::vector<const char*>> runs[] = {
      {&gspo, {"correct", "rl-kl-no-grad", "rl-gspo-cp-local-ratio"}},
      {&grpo,
       {"correct", "rl-temperature-one-side", "rl-token-mean-sample-weighted", "rl-fused-vocab-pad", "rl-kl-no-grad"}},
      {&drgrpo, {"correct", "rl-adv-whiten-dp-only", "rl-cp-extra-scale", "rl-drgrpo-batch-sum"}},
      {&logprob, {"correct", "rl-entropy-untracked-allreduce", "rl-logprob-allgather-grad-sum"}}};
  for (const auto& [c, impls] : runs) {
    for (const char* impl : impls) expect_same(*c, impl);
    CHECK(run_both(*c, "correct").dumped.verdict == Verdict::pass);
    CHECK(run_both(*c, impls.back()).dumped.verdict == Verdict::fail);
  }
}

TEST_CASE("a policy dump without per-token log-probs or statistics reports them as not dumped, never as passing") {
  const Case c = policy_case("grpo-bare", {{"kl_penalty", "k2"}, {"kl_coef", 0.05}}, {{"tp", 2}});
  const Outcome o = run_both(c, "correct", /*token_loss=*/true, /*stats=*/true, /*kind_outputs=*/false);
  int not_dumped = 0;
  for (const CheckResult& r : o.dumped.checks) {
    CAPTURE(r.name);
    if (r.name == "logprob" || r.name == "entropy") {
      CHECK(r.verdict == Verdict::not_applicable);
      CHECK(r.metrics.value("dumped", true) == false);
      ++not_dumped;
    }
    if (r.name == "stats") {  // the token count was dumped and is judged; the statistics are marked
      CHECK(r.verdict == Verdict::pass);
      for (const char* name : {"clip_fraction", "dual_clip_fraction", "kl", "entropy"}) {
        CHECK(r.metrics[name].value("dumped", true) == false);
      }
    }
  }
  CHECK(not_dumped == 2);
}

TEST_CASE("two policy dumps that differ in one per-token input name it, not the logits") {
  const Case c = policy_case("grpo-inputs", {{"kl_penalty", "k1"}, {"kl_coef", 0.1}}, {{"tp", 2}});
  Case other = c;
  other.inputs.overrides.push_back(RowOverride{});
  other.inputs.overrides.back().token = 3;
  other.inputs.overrides.back().token_inputs = {{"advantages", 0.75}};
  RunOptions options;
  options.threads = 2;
  auto dumped = [&](const Case& inputs_of, const std::string& name) {
    const InputSource inputs(inputs_of);
    const RankRun ranks = execute_ranks(c, InputSource(c), *find_implementation("correct"), options);
    const fs::path dir = write_dump(c, inputs, ranks.outputs, name);
    return dump::load_dump((dir / "manifest.json").string(), /*fingerprint_inputs=*/true);
  };
  const auto a = dumped(c, "policy-a");
  const auto b = dumped(other, "policy-b");
  try {
    dump::require_same_problem(*a, *b);
    FAIL("dumps of other advantages were accepted as one problem");
  } catch (const dump::DumpError& e) {
    CHECK(std::string(e.what()).find("its advantages differ from the first dump's") != std::string::npos);
  }
}

TEST_CASE("a policy dump's advantages must be floating point and its log-probabilities <= 0") {
  const Case c = policy_case("grpo-types", {{"kl_penalty", "k1"}, {"kl_coef", 0.1}}, {{"tp", 2}});
  RunOptions options;
  options.threads = 2;
  const InputSource inputs(c);
  const RankRun ranks = execute_ranks(c, inputs, *find_implementation("correct"), options);
  auto refused = [&](const std::string& name, const TensorEdit& edit, const std::string& message) {
    CAPTURE(name);
    const fs::path dir = write_dump(c, inputs, ranks.outputs, name, true, true, {}, true, edit);
    try {
      (void)dump::load_dump((dir / "manifest.json").string());
      FAIL("accepted");
    } catch (const dump::DumpError& e) {
      CHECK(std::string(e.what()).find(message) != std::string::npos);
    }
    fs::remove_all(dir);
  };
  // The advantages as a tensor of ones of another dtype.
  const auto advantages_as = [](const char* dtype, auto one) -> TensorEdit {
    return [dtype, one](std::map<std::string, RawTensor>& tensors) {
      RawTensor& t = tensors.at("mb0.advantages");
      t = raw_tensor(dtype, t.shape, std::vector<decltype(one)>(t.data.size() / sizeof(float), one));
    };
  };
  refused("int-advantages", advantages_as("I64", std::int64_t{1}), "advantages must be a floating-point tensor");
  refused("bool-advantages", advantages_as("BOOL", std::uint8_t{1}), "advantages must be a floating-point tensor");
  refused(
      "positive-logprob",
      [](std::map<std::string, RawTensor>& tensors) {
        RawTensor& t = tensors.at("mb0.old_logprob");
        std::vector<float> values(t.data.size() / sizeof(float));
        std::memcpy(values.data(), t.data.data(), t.data.size());
        values[0] = 0.5f;
        t = raw_tensor("F32", t.shape, values);
      },
      "old_logprob 0.5 at row 0");
}

namespace {

void expect_contains(const std::string& text, const std::string& part) {
  CAPTURE(text);
  CAPTURE(part);
  CHECK(text.find(part) != std::string::npos);
}

Case router_dump_case(const std::string& name, const json& loss, const json& layout) {
  json j = {{"name", name},
            {"shape", {{"experts", 8}}},
            {"batch", {{"sequence_lengths", {19, 7, 26, 11, 15, 4, 13, 9}}}},
            {"loss", {{"kind", "router"}, {"top_k", 2}}},
            {"inputs", {{"seed", 29}, {"scale", 1.5}, {"ignore_fraction", 0.15}}},
            {"layout", layout},
            {"timeout_seconds", 60.0}};
  if (loss.is_object()) j["loss"].merge_patch(loss);
  return make_case(j);
}

// The correct router's dump of `c`, its manifest read back as JSON for a test to change.
struct RouterDump {
  fs::path dir;
  json manifest;
  std::string reload(const std::function<void(json&)>& change) const {
    json m = manifest;
    change(m);
    write_bytes(dir / "manifest.json", m.dump(1));
    try {
      dump::load_dump((dir / "manifest.json").string());
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
};
RouterDump router_dump(const Case& c, const TensorEdit& edit = {}) {
  RunOptions options;
  options.implementation = "correct";
  options.threads = 2;
  const InputSource inputs(c);
  const RankRun ranks = execute_ranks(c, inputs, *find_implementation("correct"), options);
  RouterDump d{write_dump(c, inputs, ranks.outputs, c.name, true, true, {}, true, edit), {}};
  std::ifstream in(d.dir / "manifest.json");
  d.manifest = json::parse(in);
  return d;
}

}  // namespace

TEST_CASE("check-dump reproduces run for the router kind: SP and replicated TP, CP, per-token, global aux, layers") {
  const Case sp =
      router_dump_case("sp", {{"layers", 2}, {"z_loss_coef", 0.001}}, {{"tp", 2}, {"cp", 2}, {"ga", 2}, {"sp", true}});
  const Case replicated = router_dump_case("replicated", {{"score", "sigmoid"}}, {{"tp", 2}, {"dp", 2}});
  const Case per_token = router_dump_case("per-token", {{"scaling", "per_token"}, {"seq_aux_coef", 0.001}},
                                          {{"tp", 2}, {"cp", 2}, {"dp", 2}, {"sp", true}});
  const Case global = router_dump_case(
      "global", {{"layers", 3}, {"global_aux_coef", 0.01}, {"global_counts", "running"}, {"aux_coef", 0.001}},
      {{"tp", 2}, {"dp", 2}, {"ga", 2}, {"sp", true}});
  const std::pair<const Case*, std::vector<const char*>> runs[] = {
      {&sp, {"correct", "moe-aux-local-counts", "moe-aux-log-doubled", "moe-aux-tp-sum"}},
      {&replicated, {"correct", "moe-aux-padding-counted", "moe-aux-topk-squared"}},
      {&per_token, {"correct", "moe-aux-per-token-rank-count", "moe-seq-aux-mbs", "moe-aux-count-not-returned"}},
      {&global, {"correct", "moe-aux-ga-overweight", "moe-aux-local-counts"}}};
  for (const auto& [c, impls] : runs) {
    for (const char* impl : impls) expect_same(*c, impl);
    CHECK(run_both(*c, "correct").dumped.verdict == Verdict::pass);
    CHECK(run_both(*c, impls.back()).dumped.verdict == Verdict::fail);
  }
}

TEST_CASE("a router dump's geometry: whole rows, SP's token split, the case's micro-batches, finite logits") {
  const Case sp = router_dump_case("geometry-sp", {}, {{"tp", 2}, {"cp", 2}, {"ga", 2}, {"sp", true}});
  const RouterDump d = router_dump(sp);
  CHECK(d.reload([](json&) {}).empty());
  expect_contains(d.reload([](json& m) {
    m["ranks"][1]["vocab"] = {0, 4};
  }),
                  "a router row is whole on every rank: give [0, 8)");
  // Rank 1 (tp 1 under SP) claims a token rank 0 holds: held twice, named with both ranks.
  expect_contains(d.reload([](json& m) {
    m["ranks"][1]["micro_batches"][0]["rows"][0] = m["ranks"][0]["micro_batches"][0]["rows"][0];
  }),
                  "under layout.sp each token belongs to exactly one rank, once");
  // Every rank's micro-batches swapped: the tokens are held once, but in the other micro-batch's scope.
  expect_contains(d.reload([](json& m) {
    for (json& r : m["ranks"]) std::swap(r["micro_batches"][0], r["micro_batches"][1]);
  }),
                  "router losses are over micro-batches and the case's batch puts sequence");
  expect_contains(d.reload([](json& m) {
    m["cu_seqlens"] = {{"file", "cu.npy"}};
  }),
                  "a router dump gives cu_seqlens inline");
  fs::remove_all(d.dir);

  // Without SP the TP ranks hold the same tokens: their rows must agree, in order and bit for bit.
  const Case replicated = router_dump_case("geometry-replicated", {}, {{"tp", 2}, {"cp", 2}});
  const RouterDump r = router_dump(replicated);
  CHECK(r.reload([](json&) {}).empty());
  expect_contains(r.reload([](json& m) {
    json& rows = m["ranks"][1]["micro_batches"][0]["rows"];
    std::swap(rows[0], rows[1]);
  }),
                  "without layout.sp, TP replicates the tokens of a kind whose rows are whole");
  fs::remove_all(r.dir);
  int rank_file = 0;
  const RouterDump moved = router_dump(replicated, [&](std::map<std::string, RawTensor>& tensors) {
    if (rank_file++ == 1) reinterpret_cast<float*>(tensors["mb0.logits"].data.data())[3] += 0.5f;
  });
  expect_contains(moved.reload([](json&) {}), "logits of token");
  expect_contains(moved.reload([](json&) {}), "disagree between ranks 0 and 1 of one TP group");
  fs::remove_all(moved.dir);
  const RouterDump nan = router_dump(replicated, [](std::map<std::string, RawTensor>& tensors) {
    reinterpret_cast<float*>(tensors["mb0.logits"].data.data())[5] = std::nanf("");
  });
  expect_contains(nan.reload([](json&) {}), "non-finite value NaN at row 0, column 5");
  fs::remove_all(nan.dir);
}

namespace {

// A case with an LM head in front of its kind (kinds/lm_head/), small enough for a unit test.
Case head_dump_case(const json& extra) {
  json j = {{"name", "head"},
            {"shape", {{"vocab", 96}}},
            {"batch", {{"sequence_lengths", {9, 5, 11, 7}}}},
            {"stage", {{"kind", "lm_head"}, {"hidden", 16}, {"chunks", 3}}},
            {"inputs", {{"seed", 5}, {"dtype", "fp32"}, {"scale", 2.0}, {"ignore_fraction", 0.1}}},
            {"timeout_seconds", 60.0}};
  j.merge_patch(extra);
  return make_case(j);
}

}  // namespace

TEST_CASE("check-dump of an LM head: h, W, b read as inputs, dh, dW, db judged as run judges them") {
  // The head's contract at TP, DP x GA, bf16, smoothing: dh whole on every rank, dW per rank over its micro-batches.
  const Case smoothing = head_dump_case({{"name", "head-tp2-dp2-ga2"},
                                         {"loss", {{"label_smoothing", 0.1}}},
                                         {"stage", {{"chunks", 4}}},
                                         {"inputs", {{"dtype", "bf16"}}},
                                         {"layout", {{"tp", 2}, {"dp", 2}, {"ga", 2}}}});
  for (const char* impl : {"correct", "head-dh-shard-partial", "head-dw-16bit-accumulate", "head-smoothing-dropped"}) {
    expect_same(smoothing, impl);
  }
  CHECK(run_both(smoothing, "correct").dumped.verdict == Verdict::pass);
  const RunResult partial = run_both(smoothing, "head-dh-shard-partial").dumped;
  CHECK(partial.verdict == Verdict::fail);
  CHECK(check_named(partial, "dh").verdict == Verdict::fail);
  CHECK(check_named(partial, "dW").verdict == Verdict::pass);
  // A bias, reduction none with upstream weights, the framework's dh contract, CP with padding rows, a softcap.
  const Case bias =
      head_dump_case({{"name", "head-bias-cp2"},
                      {"loss",
                       {{"reduction", "none"},
                        {"softcap", 30.0},
                        {"upstream_weights", {{"distribution", "uniform"}, {"low", 0.25}, {"high", 2.0}}}}},
                      {"stage", {{"bias", true}, {"dh_reduce", "framework"}}},
                      {"layout", {{"tp", 2}, {"cp", 2}}}});
  for (const char* impl : {"correct", "head-grad-output-first", "head-bias-repeated", "head-softcap-dropped"}) {
    expect_same(bias, impl);
  }
  const RunResult first = run_both(bias, "head-grad-output-first").dumped;
  CHECK(check_named(first, "db").verdict == Verdict::fail);
  CHECK(check_named(first, "dh").verdict == Verdict::pass);
  // KD: the student's logits out of the head, the teacher's dumped as they are.
  const Case kd = head_dump_case({{"name", "head-kd"},
                                  {"loss", {{"kind", "kd"}, {"temperature", 2.0}}},
                                  {"inputs", {{"teacher", {{"scale", 3.0}}}}},
                                  {"layout", {{"tp", 3}}}});
  for (const char* impl : {"correct", "kd-no-t2", "head-dh-double-reduce"}) expect_same(kd, impl);
  // The policy kind: a dump's old log-probabilities are its own, and the head's logit error still bounds the loss,
  // log-probs, entropies and statistics (once left out of a dump's bounds, so the correct head failed them).
  const Case policy =
      load_case_file(std::string(LOSSVERIFY_SOURCE_DIR) + "/cases/head-policy-bf16-tp2-cp2-ga2.json", {});
  for (const char* impl : {"correct", "head-dw-16bit-accumulate"}) expect_same(policy, impl);
  CHECK(run_both(policy, "correct").dumped.verdict == Verdict::pass);
}

TEST_CASE("check-dump of an LM head: the dumped h, W and b are the reference's inputs, not the case's streams") {
  // W of one column moved by one unit of its last place on every rank holding it: the head's correct outputs on the
  // case's own inputs no longer match the reference computed from the dump's W.
  const Case c = head_dump_case({{"name", "head-moved-w"}, {"layout", {{"tp", 2}}}});
  RunOptions options;
  options.threads = 2;
  const InputSource inputs(c);
  const RankRun ranks = execute_ranks(c, inputs, *find_implementation("correct"), options);
  const fs::path same = write_dump(c, inputs, ranks.outputs, "head-same");
  CHECK(dump::check_dump(*dump::load_dump((same / "manifest.json").string()), {2}).verdict == Verdict::pass);
  const fs::path moved = write_dump(c, inputs, ranks.outputs, "head-moved", true, true, {}, true,
                                    [](std::map<std::string, RawTensor>& tensors) {
                                      float* w = reinterpret_cast<float*>(tensors.at("W").data.data());
                                      for (int k = 0; k < 16; ++k) w[k] *= 1.5f;
                                    });
  const RunResult run = dump::check_dump(*dump::load_dump((moved / "manifest.json").string()), {2});
  CHECK(run.verdict == Verdict::fail);
  CHECK(check_named(run, "dh").verdict == Verdict::fail);
  fs::remove_all(same);
  fs::remove_all(moved);
}
