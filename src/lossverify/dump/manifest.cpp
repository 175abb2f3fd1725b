#include "lossverify/dump/manifest.hpp"
#include "lossverify/kind_api/loss_kind.hpp"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <set>

#include "lossverify/case/json_reader.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/dump/tensor_file.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify::dump {

using detail::fail_at;
using detail::ObjectReader;
using nlohmann::json;
namespace fs = std::filesystem;

std::int64_t RankSpec::row_count() const {
  std::int64_t n = 0;
  for (const auto& mb : micro_batches) n += static_cast<std::int64_t>(mb.rows.size());
  return n;
}

std::string RankSpec::describe() const {
  return "rank " + std::to_string(world_rank) + " (tp=" + std::to_string(coordinates.tp) +
         " cp=" + std::to_string(coordinates.cp) + " dp=" + std::to_string(coordinates.dp) + ", " + json_path + ")";
}

std::vector<std::string> stage_row_tensors(const Case& c) {
  std::vector<std::string> names;
  if (c.loss.stage == nullptr) return names;
  for (const StageInput& input : c.loss.stage->inputs(c)) {
    if (input.rows == StageInput::Rows::token) names.push_back(input.name);
  }
  for (const std::string& gradient : c.loss.stage->gradients()) names.push_back(gradient);
  return names;
}

std::vector<std::string> stage_rank_tensors(const Case& c) {
  std::vector<std::string> names;
  if (c.loss.stage == nullptr) return names;
  for (const StageInput& input : c.loss.stage->inputs(c)) {
    if (input.rows != StageInput::Rows::token) names.push_back(input.name);
  }
  for (const std::string& parameter : c.loss.stage->parameters()) names.push_back(parameter);
  return names;
}

namespace {

std::string index_path(const std::string& path, std::size_t i) { return path + "[" + std::to_string(i) + "]"; }

std::string resolve(const std::string& directory, const std::string& file) {
  const fs::path p(file);
  if (p.is_absolute() || directory.empty()) return file;
  return (fs::path(directory) / p).lexically_normal().string();
}

// Whether `target` is `folder` or lies below it, both without symlinks or dot components (compared part by
// part: /dump-other is not inside /dump).
bool lies_inside(const fs::path& target, const fs::path& folder) {
  auto t = target.begin();
  for (const fs::path& part : folder) {
    if (part.empty()) continue;  // a trailing separator
    if (t == target.end() || *t != part) return false;
    ++t;
  }
  return true;
}

class Parser {
 public:
  Parser(const std::string& path, const ManifestLimits& limits) : limits_(limits) {
    m_.path = printable(path);
    m_.directory = fs::path(path).parent_path().string();
  }

  Manifest run(const json& doc) {
    ObjectReader root(doc, "$", m_.path);
    const std::string format = root.string("format");
    if (format != kManifestFormat) {
      root.fail("format",
                "unsupported format \"" + printable(format) + "\" (this version reads " + kManifestFormat + ")");
    }
    build_case(root);
    m_.implementation = printable(root.string("implementation", "dump"));
    if (m_.implementation.empty()) root.fail("implementation", "must not be empty");
    parse_cu_seqlens(root);
    parse_ranks(root);
    if (root.has("logged_loss_precision")) {
      const std::string precision = root.string("logged_loss_precision");
      const auto dtype = parse_dtype(precision);
      if (!dtype) {
        root.fail("logged_loss_precision", "expected one of fp32|bf16|fp16, got \"" + printable(precision) + "\"");
      }
      m_.logged_loss_precision = *dtype;
    }
    root.reject_unknown_keys();
    validate_layout();
    validate_tensors();
    if (!limits_.allow_outside_folder) confine_to_folder();
    return std::move(m_);
  }

 private:
  const std::string& src() const { return m_.path; }

  // The case file's sections, parsed by the case parser: identical semantics and messages. The paths of
  // loss, shape, layout, framework and tolerances are the same in the manifest as in a case file.
  void build_case(ObjectReader& root) {
    json c = json::object();
    c["name"] = printable(root.string("name", fs::path(m_.directory).filename().string()));
    if (c["name"].get<std::string>().empty()) c["name"] = "dump";
    c["description"] = printable(root.string("description", ""));
    const std::string dtype = root.string("dtype");
    if (!parse_dtype(dtype)) root.fail("dtype", "expected one of fp32|bf16|fp16, got \"" + printable(dtype) + "\"");
    c["inputs"] = {{"dtype", dtype}};
    for (const char* key : {"shape", "loss", "stage", "layout", "framework", "tolerances"}) {
      if (root.has(key)) {
        c[key] = root.raw(key);
      } else if (std::string(key) == "shape") {
        root.raw(key);  // required: fails naming the key
      } else {
        root.allow(key);
      }
    }
    c["timeout_seconds"] = root.number("timeout_seconds", 120.0);
    batch_from_cu_seqlens(root, c);
    m_.the_case = parse_case(c, m_.path);
    bound_tolerances(root);
    const LossKind& kind = kind_of(m_.the_case.loss);
    if (const std::string gap = kind.dump_gap(); !gap.empty()) {
      root.fail("case", "loss kind " + std::string(kind.name()) + " cannot be checked from a dump: " + gap);
    }
    kind.require_explicit(m_.the_case.loss, c.contains("loss") ? c["loss"] : json(), src());
    const std::int64_t n = m_.the_case.shape.tokens;
    if (n > limits_.max_rows) root.fail("shape", "tokens = " + std::to_string(n) + " is more than this reader takes");
  }

  // A kind whose losses are over micro-batches (a router's) is validated against the batch (its micro-batches must
  // hold sequences) as the case is parsed: its cu_seqlens must be inline, and give the case its batch.
  void batch_from_cu_seqlens(ObjectReader& root, json& c) {
    if (!c.contains("loss") || !c["loss"].is_object() || !c["loss"].contains("kind")) return;
    const LossKind* kind = find_loss_kind(c["loss"]["kind"].is_string() ? c["loss"]["kind"].get<std::string>() : "");
    if (kind == nullptr || !kind->scopes_are_micro_batches() || !root.has("cu_seqlens")) return;
    const json& v = root.raw("cu_seqlens");
    if (!v.is_array()) {
      root.fail("cu_seqlens", "a " + std::string(kind->name()) +
                                  " dump gives cu_seqlens inline: its losses are over micro-batches, whose sequences "
                                  "are checked before any tensor is read");
    }
    if (!c.contains("shape") || !c["shape"].is_object() || !c["shape"].contains("tokens")) return;
    const std::int64_t n = detail::as_integer(c["shape"]["tokens"], "$.shape.tokens", src());
    std::vector<std::int64_t> offsets;
    for (std::size_t i = 0; i < v.size(); ++i) {
      offsets.push_back(detail::as_integer(v[i], index_path(root.path_of("cu_seqlens"), i), src()));
    }
    c["batch"] = {{"sequence_lengths", sequence_lengths(offsets, n, src() + ": " + root.path_of("cu_seqlens"))},
                  {"labels", "independent"}};
  }

  // A dump judges the code that wrote it, so its own tolerances are bounded: wider than these judges nothing (a
  // manifest that says rtol 1e300 would pass itself).
  void bound_tolerances(ObjectReader& root) const {
    for (const auto& [quantity, t] : m_.the_case.tolerance_overrides) {
      const auto wide = [&](const char* field, double value, double bound) {
        if (!(value <= bound)) {
          root.fail("tolerances", quantity + "." + field + " = " + std::to_string(value) + " is wider than " +
                                      std::to_string(bound) +
                                      ", the most a dump may set (a tolerance that wide "
                                      "judges nothing)");
        }
      };
      wide("rtol", t.rtol, 1.0);
      wide("atol", t.atol, 1.0);
      wide("max_ulp", static_cast<double>(t.max_ulp), 1024.0);
    }
  }

  void parse_cu_seqlens(ObjectReader& root) {
    if (!root.has("cu_seqlens")) {
      root.allow("cu_seqlens");
      return;
    }
    const json& v = root.raw("cu_seqlens");
    const std::string path = root.path_of("cu_seqlens");
    if (v.is_array()) {
      std::vector<std::int64_t> offsets;
      for (std::size_t i = 0; i < v.size(); ++i)
        offsets.push_back(detail::as_integer(v[i], index_path(path, i), src()));
      set_sequences(offsets, path);
    } else {
      m_.cu_seqlens = tensor_ref(v, path, TensorRef{});
    }
  }

 public:
  // cu_seqlens: 0 = c_0 <= c_1 <= ... <= c_k = N; empty sequences are dropped.
  static std::vector<std::int64_t> sequence_lengths(const std::vector<std::int64_t>& offsets, std::int64_t n,
                                                    const std::string& where) {
    if (offsets.size() < 2) throw DumpError(where + ": cu_seqlens needs at least two offsets [0, ..., N]");
    if (offsets.front() != 0)
      throw DumpError(where + ": cu_seqlens must start at 0, got " + std::to_string(offsets.front()));
    if (offsets.back() != n) {
      throw DumpError(where + ": cu_seqlens must end at shape.tokens = " + std::to_string(n) + ", got " +
                      std::to_string(offsets.back()));
    }
    std::vector<std::int64_t> lengths;
    for (std::size_t i = 1; i < offsets.size(); ++i) {
      if (offsets[i] < offsets[i - 1]) {
        throw DumpError(where + ": cu_seqlens decreases at index " + std::to_string(i) + " (" +
                        std::to_string(offsets[i - 1]) + " -> " + std::to_string(offsets[i]) + ")");
      }
      if (offsets[i] > offsets[i - 1]) lengths.push_back(offsets[i] - offsets[i - 1]);
    }
    return lengths;
  }

 private:
  void set_sequences(const std::vector<std::int64_t>& offsets, const std::string& path) {
    m_.the_case.batch.sequence_lengths = sequence_lengths(offsets, m_.the_case.shape.tokens, src() + ": " + path);
  }

  // The file name at r's "file": not empty, and none that the system would cut short at a NUL character.
  static std::string file_name(ObjectReader& r) {
    std::string file = r.string("file");
    if (file.empty()) r.fail("file", "must not be empty");
    if (file.find('\0') != std::string::npos) r.fail("file", "a file name must not hold a NUL character");
    return file;
  }

  // {"file": ..., "name": ...} or a bare name in the rank's default file (no file: none given).
  TensorRef tensor_ref(const json& v, const std::string& path, const TensorRef& default_file) {
    TensorRef ref;
    ref.json_path = path;
    if (v.is_string()) {
      if (default_file.file.empty()) {
        fail_at(src(), path, "a bare tensor name needs the rank's \"file\"; or give {\"file\": ..., \"name\": ...}");
      }
      ref.file = default_file.file;
      ref.file_json_path = default_file.file_json_path;
      ref.name = v.get<std::string>();
      if (ref.name.empty()) fail_at(src(), path, "tensor name must not be empty");
      if (ref.file.size() >= 4 && ref.file.ends_with(".npy")) {
        fail_at(src(), path, "an .npy file holds one unnamed tensor: give {\"file\": \"....npy\"}");
      }
      return ref;
    }
    ObjectReader r(v, path, src());
    const std::string file = file_name(r);
    ref.file = resolve(m_.directory, file);
    ref.file_json_path = r.path_of("file");
    ref.name = r.string("name", "");
    const bool npy = file.ends_with(".npy");
    if (!npy && !file.ends_with(".safetensors")) {
      r.fail("file", "expected a .safetensors or .npy file, got \"" + printable(file) + "\"");
    }
    if (npy && !ref.name.empty()) r.fail("name", "an .npy file holds one unnamed tensor: give no name");
    if (!npy && ref.name.empty()) r.fail("name", "a safetensors file needs the tensor's name");
    r.reject_unknown_keys();
    return ref;
  }

  ScalarSpec scalar(ObjectReader& r, const std::string& key, const TensorRef& default_file, bool integer) {
    ScalarSpec s;
    s.json_path = r.path_of(key);
    if (!r.has(key)) {
      r.allow(key);
      return s;
    }
    const json& v = r.raw(key);
    if (v.is_number()) {
      s.kind = ScalarSpec::Kind::inline_value;
      if (integer) {
        const std::int64_t count = detail::as_integer(v, s.json_path, src());
        if (count < 0) fail_at(src(), s.json_path, "a count must be >= 0, got " + std::to_string(count));
        s.value = static_cast<double>(count);
      } else {
        s.value = v.get<double>();
      }
    } else if (v.is_string() && !integer && (v == "NaN" || v == "Infinity" || v == "-Infinity")) {
      // A logged loss may be non-finite (the finite and loss checks then fail); strict JSON cannot spell it.
      s.kind = ScalarSpec::Kind::inline_value;
      s.value = v == "NaN"        ? std::numeric_limits<double>::quiet_NaN()
                : v == "Infinity" ? std::numeric_limits<double>::infinity()
                                  : -std::numeric_limits<double>::infinity();
    } else if (v.is_string() && integer && (v == "NaN" || v == "Infinity" || v == "-Infinity")) {
      fail_at(src(), s.json_path, "a count must be a non-negative integer, got " + v.dump());
    } else {
      s.kind = ScalarSpec::Kind::tensor;
      s.ref = tensor_ref(v, s.json_path, default_file);
    }
    return s;
  }

  std::vector<std::int64_t> parse_rows(const json& v, const std::string& path) {
    if (!v.is_array()) fail_at(src(), path, "expected an array of tokens, [begin, end) ranges and {\"padding\": k}");
    std::vector<std::int64_t> rows;
    const std::int64_t n = m_.the_case.shape.tokens;
    auto reserve = [&](std::int64_t more, const std::string& where) {
      if (more < 0 || total_rows_ + more > limits_.max_rows) {
        fail_at(src(), where, "too many rows (more than " + std::to_string(limits_.max_rows) + " in the whole dump)");
      }
      total_rows_ += more;
    };
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::string item_path = index_path(path, i);
      const json& item = v[i];
      if (item.is_array()) {
        if (item.size() != 2) fail_at(src(), item_path, "a range is [begin, end)");
        const std::int64_t b = detail::as_integer(item[0], index_path(item_path, 0), src());
        const std::int64_t e = detail::as_integer(item[1], index_path(item_path, 1), src());
        if (b < 0 || e < b || e > n) {
          fail_at(src(), item_path,
                  "range [" + std::to_string(b) + ", " + std::to_string(e) + ") outside [0, " + std::to_string(n) +
                      ") or reversed");
        }
        reserve(e - b, item_path);
        for (std::int64_t t = b; t < e; ++t) rows.push_back(t);
      } else if (item.is_object()) {
        ObjectReader p(item, item_path, src());
        const std::int64_t k = p.integer("padding");
        if (k < 0) p.fail("padding", "must be >= 0");
        p.reject_unknown_keys();
        reserve(k, item_path);
        rows.insert(rows.end(), static_cast<std::size_t>(k), -1);
      } else {
        const std::int64_t t = detail::as_integer(item, item_path, src());
        if (t < -1 || t >= n) {
          fail_at(src(), item_path,
                  "token " + std::to_string(t) + " outside [0, " + std::to_string(n) + ") (-1 marks a padding row)");
        }
        reserve(1, item_path);
        rows.push_back(t);
      }
    }
    return rows;
  }

  MicroBatchSpec parse_micro_batch(ObjectReader& r, const TensorRef& default_file) {
    MicroBatchSpec mb;
    mb.json_path = r.path();
    mb.rows = parse_rows(r.raw("rows"), r.path_of("rows"));
    ObjectReader t = r.object("tensors");
    std::vector<std::string> keys(std::begin(kRowTensors), std::end(kRowTensors));
    const LossKind& kind = kind_of(m_.the_case.loss);
    for (const std::string& key : kind.token_inputs(m_.the_case.loss)) keys.push_back(key);
    for (const std::string& quantity : kind.token_quantities()) keys.push_back(token_quantity_tensor(quantity));
    if (!kind.scope_values_name().empty()) keys.emplace_back(kind.scope_values_name());
    for (const std::string& key : stage_row_tensors(m_.the_case)) keys.push_back(key);
    for (const std::string& key : keys) {
      if (t.has(key)) {
        mb.tensors[key] = tensor_ref(t.raw(key), t.path_of(key), default_file);
      } else {
        t.allow(key);
      }
    }
    t.reject_unknown_keys();
    return mb;
  }

  // The rank's "stage" object: the stage's tensors of its vocabulary shard (W, b, dW, db of an LM head).
  void parse_rank_stage(ObjectReader& r, RankSpec& rank, const TensorRef& default_file) {
    const std::vector<std::string> keys = stage_rank_tensors(m_.the_case);
    if (!r.has("stage")) {
      r.allow("stage");
      return;
    }
    if (keys.empty()) {
      r.fail("stage", m_.the_case.loss.stage == nullptr ? "the case has no stage (give the manifest's \"stage\")"
                                                        : "the stage has no tensors of a rank's shard");
    }
    ObjectReader s = r.object("stage");
    for (const std::string& key : keys) {
      if (s.has(key)) {
        rank.stage[key] = tensor_ref(s.raw(key), s.path_of(key), default_file);
      } else {
        s.allow(key);
      }
    }
    s.reject_unknown_keys();
  }

  void parse_ranks(ObjectReader& root) {
    const json& list = root.raw("ranks");
    const std::string path = root.path_of("ranks");
    if (!list.is_array() || list.empty()) fail_at(src(), path, "expected a non-empty array of ranks");
    const LayoutSpec& layout = m_.the_case.layout;
    const int world = layout.world_size();
    if (static_cast<std::int64_t>(list.size()) > world) {
      fail_at(src(), path, std::to_string(list.size()) + " ranks, but the layout tp*cp*dp = " + std::to_string(world));
    }
    std::vector<int> seen(static_cast<std::size_t>(world), -1);
    std::vector<RankSpec> ranks;
    for (std::size_t i = 0; i < list.size(); ++i) {
      ObjectReader r(list[i], index_path(path, i), src());
      RankSpec rank;
      rank.manifest_index = static_cast<int>(i);
      rank.json_path = r.path();
      const bool has_rank = r.has("rank");
      const bool has_coordinates = r.has("tp") || r.has("cp") || r.has("dp");
      if (!has_rank && !has_coordinates)
        r.fail_here("give the rank's \"rank\" (world rank) or its tp, cp, dp coordinates");
      auto coordinate = [&](const char* key, int size) {
        const std::int64_t v = r.integer(key, 0);
        if (v < 0 || v >= size) {
          r.fail(key, std::string(key) + " = " + std::to_string(v) + " outside [0, " + std::to_string(size) + ")");
        }
        return static_cast<int>(v);
      };
      if (has_coordinates) {
        rank.coordinates = {coordinate("tp", layout.tp), coordinate("cp", layout.cp), coordinate("dp", layout.dp)};
        rank.world_rank = world_rank_of(rank.coordinates, layout);
      }
      if (has_rank) {
        const std::int64_t w = r.integer("rank");
        if (w < 0 || w >= world)
          r.fail("rank", "rank " + std::to_string(w) + " outside [0, " + std::to_string(world) + ")");
        if (has_coordinates && w != rank.world_rank) {
          r.fail("rank", "rank " + std::to_string(w) + " disagrees with tp=" + std::to_string(rank.coordinates.tp) +
                             " cp=" + std::to_string(rank.coordinates.cp) +
                             " dp=" + std::to_string(rank.coordinates.dp) +
                             ", which is world rank (dp*CP + cp)*TP + tp = " + std::to_string(rank.world_rank) +
                             " (give the coordinates alone when your ranks are numbered otherwise)");
        }
        if (!has_coordinates) {
          rank.world_rank = static_cast<int>(w);
          rank.coordinates = coordinates_of(rank.world_rank, layout);
        }
      } else {
        r.allow("rank");
      }
      int& slot = seen[static_cast<std::size_t>(rank.world_rank)];
      if (slot >= 0) {
        r.fail_here("duplicates " + index_path(path, static_cast<std::size_t>(slot)) + ": both are world rank " +
                    std::to_string(rank.world_rank) + " (tp=" + std::to_string(rank.coordinates.tp) +
                    " cp=" + std::to_string(rank.coordinates.cp) + " dp=" + std::to_string(rank.coordinates.dp) + ")");
      }
      slot = static_cast<int>(i);
      // vocabulary columns
      const json& vocab = r.raw("vocab");
      if (!vocab.is_array() || vocab.size() != 2) r.fail("vocab", "expected [begin, end) columns of the vocabulary");
      rank.vocab.begin = detail::as_integer(vocab[0], r.path_of("vocab") + "[0]", src());
      rank.vocab.end = detail::as_integer(vocab[1], r.path_of("vocab") + "[1]", src());
      if (rank.vocab.begin < 0 || rank.vocab.end <= rank.vocab.begin || rank.vocab.end > m_.the_case.shape.vocab) {
        r.fail("vocab", "columns [" + std::to_string(rank.vocab.begin) + ", " + std::to_string(rank.vocab.end) +
                            ") must be a non-empty range inside [0, " + std::to_string(m_.the_case.shape.vocab) + ")");
      }
      TensorRef default_file;
      if (r.has("file")) {
        default_file.file = resolve(m_.directory, file_name(r));
        default_file.file_json_path = r.path_of("file");
        if (!default_file.file.ends_with(".safetensors")) {
          r.fail("file", "a rank's default file must be a .safetensors file");
        }
      } else {
        r.allow("file");
      }
      const bool flat = r.has("rows") || r.has("tensors");
      if (flat && r.has("micro_batches")) {
        r.fail("micro_batches", "give either rows + tensors (one micro-batch) or micro_batches, not both");
      }
      if (r.has("micro_batches")) {
        const json& mbs = r.raw("micro_batches");
        const std::string mbs_path = r.path_of("micro_batches");
        if (!mbs.is_array()) fail_at(src(), mbs_path, "expected an array of {rows, tensors}");
        if (static_cast<std::int64_t>(mbs.size()) != layout.ga) {
          fail_at(src(), mbs_path,
                  std::to_string(mbs.size()) + " micro-batches, but layout.ga = " + std::to_string(layout.ga));
        }
        for (std::size_t k = 0; k < mbs.size(); ++k) {
          ObjectReader mr(mbs[k], index_path(mbs_path, k), src());
          rank.micro_batches.push_back(parse_micro_batch(mr, default_file));
          mr.reject_unknown_keys();
        }
      } else {
        r.allow("micro_batches");
        if (layout.ga != 1) {
          r.fail_here("layout.ga = " + std::to_string(layout.ga) +
                      ": give the rank's \"micro_batches\", one per micro-batch");
        }
        rank.micro_batches.push_back(parse_micro_batch(r, default_file));
      }
      if (r.has("stats")) {
        ObjectReader s = r.object("stats");
        rank.loss = scalar(s, "loss", default_file, false);
        rank.num_tokens = scalar(s, "num_tokens", default_file, true);
        for (const std::string& name : kind_of(m_.the_case.loss).logged_statistics(m_.the_case.loss)) {
          rank.statistics.push_back(scalar(s, name, default_file, false));
        }
        s.reject_unknown_keys();
      } else {
        r.allow("stats");
        rank.statistics.resize(kind_of(m_.the_case.loss).logged_statistics(m_.the_case.loss).size());
      }
      parse_rank_stage(r, rank, default_file);
      r.reject_unknown_keys();
      ranks.push_back(std::move(rank));
    }
    // Every rank of the layout must be there.
    std::string missing;
    int missing_count = 0;
    for (int w = 0; w < world; ++w) {
      if (seen[static_cast<std::size_t>(w)] >= 0) continue;
      if (++missing_count <= 8) {
        const RankCoordinates c = coordinates_of(w, layout);
        append_to_list(missing, std::to_string(w) + " (tp=" + std::to_string(c.tp) + " cp=" + std::to_string(c.cp) +
                                    " dp=" + std::to_string(c.dp) + ")");
      }
    }
    if (missing_count > 0) {
      fail_at(src(), path,
              "missing rank(s) " + missing + (missing_count > 8 ? ", ..." : "") +
                  ": the layout tp*cp*dp = " + std::to_string(world) + " needs every rank's dump");
    }
    std::sort(ranks.begin(), ranks.end(),
              [](const RankSpec& a, const RankSpec& b) { return a.world_rank < b.world_rank; });
    m_.ranks = std::move(ranks);
  }

  // Every token lies in exactly one TP group (once), the TP ranks of a group hold the same rows and tile the
  // vocabulary; or, for a kind whose rows are whole on every rank (a router's experts), each rank holds whole rows
  // and the TP ranks of a group hold the same rows (no SP) or split the group's tokens among them (layout.sp).
  void validate_layout() {
    const LayoutSpec& layout = m_.the_case.layout;
    const std::int64_t n = m_.the_case.shape.tokens;
    const bool columns_split = tp_splits_columns(m_.the_case);
    const bool tokens_split = !columns_split && layout.sp;
    // Tokens of the TP groups: rows of every group's first rank (every rank's under SP).
    std::int64_t group_rows = 0;
    for (const RankSpec& r : m_.ranks) {
      if (tokens_split || r.coordinates.tp == 0) group_rows += r.row_count();
    }
    if (group_rows < n) {
      fail_at(src(), "$.ranks",
              "the TP groups hold " + std::to_string(group_rows) + " rows in all, fewer than the " + std::to_string(n) +
                  " tokens of shape.tokens: some tokens are held by no rank");
    }
    m_.token_rank.assign(static_cast<std::size_t>(n), -1);
    m_.token_micro_batch.assign(static_cast<std::size_t>(n), -1);
    m_.token_row.assign(static_cast<std::size_t>(n), -1);
    for (int cp = 0; cp < layout.cp; ++cp) {
      for (int dp = 0; dp < layout.dp; ++dp) {
        if (columns_split) {
          require_same_rows(cp, dp);
          require_tiled_vocabulary(cp, dp);
        } else {
          require_whole_rows(cp, dp);
          if (!tokens_split) require_same_rows(cp, dp);
        }
        for (int tp = 0; tp < (tokens_split ? layout.tp : 1); ++tp) {
          record_tokens(m_.ranks[static_cast<std::size_t>(world_rank_of({tp, cp, dp}, layout))]);
        }
      }
    }
    for (std::int64_t t = 0; t < n; ++t) {
      if (m_.token_rank[static_cast<std::size_t>(t)] < 0) {
        fail_at(src(), "$.ranks",
                "token " + std::to_string(t) + " is held by no rank (every token in [0, " + std::to_string(n) +
                    ") must be in some rank's rows)");
      }
    }
    if (kind_of(m_.the_case.loss).scopes_are_micro_batches()) require_case_micro_batches();
  }

  const RankSpec& rank_at(int tp, int cp, int dp) const {
    return m_.ranks[static_cast<std::size_t>(world_rank_of({tp, cp, dp}, m_.the_case.layout))];
  }

  // The TP ranks of the group (cp, dp) hold the same rows in the same order.
  void require_same_rows(int cp, int dp) const {
    const RankSpec& first = rank_at(0, cp, dp);
    for (int tp = 1; tp < m_.the_case.layout.tp; ++tp) {
      const RankSpec& r = rank_at(tp, cp, dp);
      for (std::size_t k = 0; k < r.micro_batches.size(); ++k) {
        const auto& a = first.micro_batches[k].rows;
        const auto& b = r.micro_batches[k].rows;
        if (a == b) continue;
        std::size_t i = 0;
        while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
        const std::string detail =
            i < a.size() && i < b.size()
                ? "row " + std::to_string(i) + " is token " + std::to_string(a[i]) + " there and " +
                      std::to_string(b[i]) + " here"
                : std::to_string(a.size()) + " rows there, " + std::to_string(b.size()) + " here";
        const std::string why = tp_splits_columns(m_.the_case)
                                    ? ""
                                    : " (without layout.sp, TP replicates the tokens of a kind whose rows are whole)";
        fail_at(src(), r.micro_batches[k].json_path + ".rows",
                "the TP ranks of a group must hold the same rows in the same order" + why + ", but " + r.describe() +
                    " differs from " + first.describe() + ": " + detail);
      }
    }
  }

  // The TP ranks of the group (cp, dp) tile the vocabulary: no overlap, no gap.
  void require_tiled_vocabulary(int cp, int dp) const {
    const LayoutSpec& layout = m_.the_case.layout;
    const RankSpec& first = rank_at(0, cp, dp);
    std::vector<std::pair<std::int64_t, std::int64_t>> columns;
    for (int tp = 0; tp < layout.tp; ++tp)
      columns.push_back({rank_at(tp, cp, dp).vocab.begin, rank_at(tp, cp, dp).vocab.end});
    std::sort(columns.begin(), columns.end());
    std::int64_t next = 0;
    for (const auto& [b, e] : columns) {
      if (b != next) {
        std::string shards;
        for (int tp = 0; tp < layout.tp; ++tp) {
          const RankSpec& r = rank_at(tp, cp, dp);
          append_to_list(shards, "rank " + std::to_string(r.world_rank) + " [" + std::to_string(r.vocab.begin) + ", " +
                                     std::to_string(r.vocab.end) + ")");
        }
        fail_at(src(), first.json_path + ".vocab",
                std::string(b < next ? "vocabulary shards overlap" : "vocabulary shards leave a gap") + " at column " +
                    std::to_string(std::min(b, next)) + " in the TP group cp=" + std::to_string(cp) +
                    " dp=" + std::to_string(dp) + ": " + shards);
      }
      next = e;
    }
    if (next != m_.the_case.shape.vocab) {
      fail_at(src(), first.json_path + ".vocab",
              "the TP group cp=" + std::to_string(cp) + " dp=" + std::to_string(dp) + " covers columns [0, " +
                  std::to_string(next) + ") of the vocabulary of " + std::to_string(m_.the_case.shape.vocab));
    }
  }

  // Every rank of the group (cp, dp) holds whole rows: columns [0, V).
  void require_whole_rows(int cp, int dp) const {
    const LossKind& kind = kind_of(m_.the_case.loss);
    for (int tp = 0; tp < m_.the_case.layout.tp; ++tp) {
      const RankSpec& r = rank_at(tp, cp, dp);
      if (r.vocab.begin != 0 || r.vocab.end != m_.the_case.shape.vocab) {
        fail_at(src(), r.json_path + ".vocab",
                "columns [" + std::to_string(r.vocab.begin) + ", " + std::to_string(r.vocab.end) + "), but a " +
                    std::string(kind.name()) + " row is whole on every rank: give [0, " +
                    std::to_string(m_.the_case.shape.vocab) + ") (" + std::string(kind.column_axis()) +
                    " are not split by TP)");
      }
    }
  }

  // The rank's tokens, each held once in all (by this rank or another rank holding other tokens).
  void record_tokens(const RankSpec& holder) {
    for (std::size_t k = 0; k < holder.micro_batches.size(); ++k) {
      const auto& rows = holder.micro_batches[k].rows;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const std::int64_t t = rows[i];
        if (t < 0) continue;
        const auto ti = static_cast<std::size_t>(t);
        if (m_.token_rank[ti] >= 0) {
          const RankSpec& other = m_.ranks[static_cast<std::size_t>(m_.token_rank[ti])];
          const std::string unit = tp_splits_columns(m_.the_case) || !m_.the_case.layout.sp
                                       ? "each token belongs to exactly one TP group, once"
                                       : "under layout.sp each token belongs to exactly one rank, once";
          fail_at(src(), holder.micro_batches[k].json_path + ".rows",
                  "token " + std::to_string(t) + " is held twice: by " + holder.describe() + " (micro-batch " +
                      std::to_string(k) + ", row " + std::to_string(i) + ") and by " + other.describe() +
                      " (micro-batch " + std::to_string(m_.token_micro_batch[ti]) + ", row " +
                      std::to_string(m_.token_row[ti]) + "); " + unit);
        }
        m_.token_rank[ti] = holder.world_rank;
        m_.token_micro_batch[ti] = static_cast<std::int32_t>(k);
        m_.token_row[ti] = static_cast<std::int64_t>(i);
      }
    }
  }

  // A kind whose losses are over micro-batches (a router's scopes) is judged on the case's batching: every sequence
  // in the DP rank and micro-batch where the case's batch puts it (docs/spec.md section 5).
  void require_case_micro_batches() const {
    const Case& c = m_.the_case;
    const GlobalBatch batch(c.batch);
    std::vector<std::pair<int, int>> slot_of(batch.sequences().size(), {-1, -1});
    for (int dp = 0; dp < c.layout.dp; ++dp) {
      for (int k = 0; k < c.layout.ga; ++k) {
        for (const std::int64_t q : sequences_of_slot(batch, c.batch, c.layout, dp, k)) {
          slot_of[static_cast<std::size_t>(q)] = {dp, k};
        }
      }
    }
    for (std::int64_t t = 0; t < c.shape.tokens; ++t) {
      const auto ti = static_cast<std::size_t>(t);
      const RankSpec& holder = m_.ranks[static_cast<std::size_t>(m_.token_rank[ti])];
      const std::int64_t q = batch.sequence_of(t);
      const auto [dp, k] = slot_of[static_cast<std::size_t>(q)];
      if (holder.coordinates.dp == dp && m_.token_micro_batch[ti] == k) continue;
      fail_at(src(), holder.micro_batches[static_cast<std::size_t>(m_.token_micro_batch[ti])].json_path + ".rows",
              "token " + std::to_string(t) + " (sequence " + std::to_string(q) + ") is in " + holder.describe() +
                  "'s micro-batch " + std::to_string(m_.token_micro_batch[ti]) + ", but " +
                  std::string(kind_of(c.loss).name()) + " losses are over micro-batches and the case's batch puts " +
                  "sequence " + std::to_string(q) + " in DP rank " + std::to_string(dp) + "'s micro-batch " +
                  std::to_string(k) + " (lossverify export-inputs gives each rank its rows)");
    }
  }

  // Which tensors every micro-batch needs, and which optional ones the dump has (all ranks alike).
  void validate_tensors() {
    const LossKind& kind = kind_of(m_.the_case.loss);
    const std::string kind_name(kind.name());
    const bool teacher = kind.inputs().teacher_logits;
    const bool labelled = kind.inputs().labels;
    const bool none = m_.the_case.loss.reduction == Reduction::none;
    const std::vector<std::string> quantities = kind.token_quantities();
    const std::vector<std::string> statistics = kind.logged_statistics(m_.the_case.loss);
    m_.dumped.token_quantities.assign(quantities.size(), 0);
    m_.dumped.statistics.assign(statistics.size(), 0);
    const Stage* stage = m_.the_case.loss.stage;
    const std::string stage_name = stage != nullptr ? std::string(stage->name()) : "";
    const bool takes_logits = stage == nullptr || stage->inputs(m_.the_case).empty();
    const bool takes_logit_gradient = stage == nullptr || !stage->logit_gradient_internal();
    std::string stage_inputs, stage_gradients;
    if (stage != nullptr) {
      for (const StageInput& input : stage->inputs(m_.the_case)) append_to_list(stage_inputs, input.name);
      for (const std::string& name : stage->gradients()) append_to_list(stage_gradients, name);
      for (const std::string& name : stage->parameters()) append_to_list(stage_gradients, name);
    }
    require_rank_stage_tensors();
    bool first = true;
    std::string first_path;
    auto all_or_none = [&](bool& flag, bool here, const std::string& what, const std::string& path) {
      if (first) {
        flag = here;
      } else if (flag != here) {
        fail_at(src(), path,
                std::string(here ? "has" : "lacks") + " " + what + ", but " + first_path +
                    (here ? " lacks it" : " has it") + ": every rank and micro-batch must dump the same things");
      }
    };
    for (const RankSpec& r : m_.ranks) {
      for (const MicroBatchSpec& mb : r.micro_batches) {
        const std::string tp = mb.json_path + ".tensors";
        auto has = [&](const char* key) { return mb.tensors.count(key) > 0; };
        for (const char* key : {"logits", "grad_logits"}) {
          const bool taken = std::string(key) == "logits" ? takes_logits : takes_logit_gradient;
          if (taken && !has(key)) fail_at(src(), tp, std::string("\"") + key + "\" is required");
          if (!taken && has(key)) {
            fail_at(src(), tp + "." + key,
                    std::string(key == std::string("logits")
                                    ? "the stage " + stage_name + " makes the logits from its own inputs (" +
                                          stage_inputs + "): dump those"
                                    : "the stage " + stage_name +
                                          " keeps the logits' gradient internal: dump its "
                                          "gradients (" +
                                          stage_gradients + ")"));
          }
        }
        for (const std::string& key : stage_row_tensors(m_.the_case)) {
          if (!has(key.c_str())) fail_at(src(), tp, "\"" + key + "\" is required by the stage " + stage_name);
        }
        if (teacher && !has("teacher_logits")) fail_at(src(), tp, "\"teacher_logits\" is required for " + kind_name);
        if (!teacher && has("teacher_logits")) {
          fail_at(src(), tp + ".teacher_logits", "teacher logits do not apply to " + kind_name);
        }
        if (labelled && !has("labels")) fail_at(src(), tp, "\"labels\" is required for " + kind_name);
        if (!labelled && has("labels")) {
          fail_at(src(), tp + ".labels", kind_name + " takes no labels (mask tokens with loss_mask)");
        }
        for (const std::string& key : kind.token_inputs(m_.the_case.loss)) {
          if (!has(key.c_str())) fail_at(src(), tp, "\"" + key + "\" is required for " + kind_name);
        }
        if (!none && has("grad_output")) {
          fail_at(src(), tp + ".grad_output",
                  "the upstream gradient of per-token losses applies to reduction \"none\" only");
        }
        if (mb.rows.empty()) continue;  // a micro-batch with no rows may leave the optional tensors out
        all_or_none(m_.dumped.token_loss, has("token_loss"), "token_loss", tp);
        all_or_none(m_.dumped.loss_mask, has("loss_mask"), "loss_mask", tp);
        all_or_none(m_.dumped.grad_output, has("grad_output"), "grad_output", tp);
        for (std::size_t q = 0; q < quantities.size(); ++q) {
          const std::string key = token_quantity_tensor(quantities[q]);
          bool flag = m_.dumped.token_quantities[q] != 0;
          all_or_none(flag, has(key.c_str()), key, tp);
          m_.dumped.token_quantities[q] = flag;
        }
        if (const std::string key(kind.scope_values_name()); !key.empty()) {
          all_or_none(m_.dumped.scope_values, has(key.c_str()), key, tp);
        }
        if (first) first_path = tp;
        first = false;
      }
    }
    first = true;
    for (const RankSpec& r : m_.ranks) {
      const std::string sp = r.json_path + ".stats";
      all_or_none(m_.dumped.loss, r.loss.kind != ScalarSpec::Kind::absent, "stats.loss", sp);
      all_or_none(m_.dumped.num_tokens, r.num_tokens.kind != ScalarSpec::Kind::absent, "stats.num_tokens", sp);
      for (std::size_t q = 0; q < statistics.size(); ++q) {
        bool flag = m_.dumped.statistics[q] != 0;
        all_or_none(flag, r.statistics[q].kind != ScalarSpec::Kind::absent, "stats." + statistics[q], sp);
        m_.dumped.statistics[q] = flag;
      }
      if (first) first_path = sp;
      first = false;
    }
    if (none && m_.dumped.loss)
      fail_at(src(), m_.ranks.front().loss.json_path, "reduction \"none\" logs no reduced loss");
    if (none && !m_.dumped.token_loss) {
      fail_at(src(), "$.ranks",
              "reduction \"none\": every micro-batch must dump \"token_loss\" (the per-token losses)");
    }
    if (!m_.dumped.token_loss && !m_.dumped.loss) {
      fail_at(src(), "$.ranks",
              "the dump holds no loss: give per-token losses (tensors.token_loss) and/or the logged "
              "loss (stats.loss) of every rank");
    }
    if (m_.dumped.grad_output && m_.the_case.loss.upstream_weights.kind != UpstreamWeights::Kind::ones) {
      fail_at(src(), "$.loss.upstream_weights",
              "give the upstream weights either here or as grad_output tensors, not both");
    }
  }

  // Each rank's stage object holds the stage's tensors of its shard: each one the shard has (a parameter of no
  // elements, db without a bias, is none), and no other.
  void require_rank_stage_tensors() const {
    const Stage* stage = m_.the_case.loss.stage;
    if (stage == nullptr) return;
    const std::vector<std::string> parameters = stage->parameters();
    for (const RankSpec& r : m_.ranks) {
      RankAssignment shard;
      shard.vocab = r.vocab;
      for (const std::string& key : stage_rank_tensors(m_.the_case)) {
        const auto p = std::find(parameters.begin(), parameters.end(), key);
        bool needed = true;
        if (p != parameters.end()) {
          const ParameterShape shape =
              stage->parameter_shape(static_cast<std::size_t>(p - parameters.begin()), m_.the_case, shard);
          needed = shape.rows * shape.columns > 0;
        }
        if (needed && !r.stage.count(key)) {
          fail_at(src(), r.json_path + ".stage",
                  "\"" + key + "\" is required by the stage " + std::string(stage->name()) +
                      " (the rank's shard of it: docs/dumps.md)");
        }
        if (!needed && r.stage.count(key)) {
          fail_at(src(), r.stage.at(key).json_path,
                  "the case's stage has no " + key + " (its stage section gives it none: no bias)");
        }
      }
    }
  }

  // Every tensor file, symlinks resolved, must lie inside the manifest's folder, symlinks resolved: a
  // manifest must not make lossverify read /etc/passwd (by an absolute path, ../ or a symlink in the dump).
  // Checked before any tensor file is opened; a file that does not exist resolves as far as its folders do.
  void confine_to_folder() const {
    auto resolved = [&](const std::string& path, const std::string& where) {
      std::error_code error;
      fs::path p = fs::absolute(path.empty() ? "." : path, error);
      if (!error) p = fs::weakly_canonical(p, error);
      if (error) throw DumpError(where + ": cannot resolve " + printable(path) + ": " + error.message());
      return p;
    };
    const fs::path folder = resolved(m_.directory, src() + ": the manifest's folder");
    std::set<std::string> checked;
    auto check = [&](const TensorRef& ref) {
      if (!checked.insert(ref.file).second) return;
      const fs::path target = resolved(ref.file, src() + ": " + ref.file_json_path);
      std::error_code error;
      if (fs::is_symlink(target, error)) {  // left unresolved: it leads nowhere (yet)
        fail_at(src(), ref.file_json_path,
                "the tensor file " + printable(ref.file) + " is a symlink to " +
                    printable(fs::read_symlink(target, error).string()) + ", which does not exist");
      }
      if (lies_inside(target, folder)) return;
      fail_at(src(), ref.file_json_path,
              "the tensor file " + printable(ref.file) + " resolves to " + printable(target.string()) +
                  ", outside the dump's folder " + printable(folder.string()) +
                  " (symlinks resolved): move it into that folder, or pass --allow-outside-dump to check-dump to "
                  "read tensor files wherever paths and symlinks lead");
    };
    if (m_.cu_seqlens) check(*m_.cu_seqlens);
    for (const RankSpec& rank : m_.ranks) {
      for (const MicroBatchSpec& mb : rank.micro_batches) {
        for (const auto& [key, ref] : mb.tensors) check(ref);
      }
      for (const ScalarSpec* s : {&rank.loss, &rank.num_tokens}) {
        if (s->kind == ScalarSpec::Kind::tensor) check(s->ref);
      }
      for (const ScalarSpec& s : rank.statistics) {
        if (s.kind == ScalarSpec::Kind::tensor) check(s.ref);
      }
      for (const auto& [key, ref] : rank.stage) check(ref);
    }
  }

  Manifest m_;
  ManifestLimits limits_;
  std::int64_t total_rows_ = 0;
};

}  // namespace

Manifest parse_manifest(const json& document, const std::string& path, const ManifestLimits& limits) {
  return Parser(path, limits).run(document);
}

json parse_manifest_text(const std::string& text, const std::string& path) {
  return parse_json_without_duplicates(text, printable(path), "manifest", true);
}

Manifest load_manifest(const std::string& path, const ManifestLimits& limits) {
  return parse_manifest(parse_manifest_text(read_regular_file(path, "manifest"), path), path, limits);
}

std::vector<std::int64_t> sequence_lengths_from_cu_seqlens(const std::vector<std::int64_t>& offsets, std::int64_t n,
                                                           const std::string& where) {
  return Parser::sequence_lengths(offsets, n, where);
}

}  // namespace lossverify::dump
