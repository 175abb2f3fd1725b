#include "lossverify/dump/check_dump.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <map>
#include <ostream>
#include <sstream>
#include <thread>

#include "lossverify/checks/checks.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/kind_api/stage.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/oracle/host_oracle.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/loss_reference.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/runner/control_band.hpp"
#include "lossverify/runner/launcher.hpp"

namespace lossverify::dump {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Whether every global row lies in [0, 1] and sums to 1: softmax output where logits were expected (code that
// overwrites its input in place, dumped after the call).
bool rows_look_like_probabilities(const std::vector<std::byte>& rows, std::int64_t n, std::int64_t v, DType dtype) {
  const double slack = dtype == DType::fp32 ? 1e-3 : 1e-2;  // V roundings of the stored values
  return dispatch_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    const T* x = reinterpret_cast<const T*>(rows.data());
    for (std::int64_t t = 0; t < n; ++t) {
      double sum = 0.0;
      for (std::int64_t j = 0; j < v; ++j) {
        const auto value = static_cast<double>(static_cast<float>(x[t * v + j]));
        if (!(value >= 0.0 && value <= 1.0)) return false;
        sum += value;
      }
      if (std::fabs(sum - 1.0) > slack) return false;
    }
    return n > 0;
  });
}

// FNV-1a over each global input: two dumps of one problem at different layouts must hold the same ones.
std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const ExplicitInputs& data,
                                                               const std::vector<std::string>& token_input_names) {
  auto hash = [](const void* bytes, std::size_t size) {
    std::uint64_t h = 14695981039346656037ull;
    const auto* p = static_cast<const unsigned char*>(bytes);
    for (std::size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  };
  std::vector<std::pair<std::string, std::uint64_t>> out = {
      {"logits", hash(data.student.data(), data.student.size())},
      {"teacher logits", hash(data.teacher.data(), data.teacher.size())},
      {"labels", hash(data.labels.data(), data.labels.size() * sizeof(std::int64_t))},
      {"loss mask", hash(data.loss_mask.data(), data.loss_mask.size())}};
  for (std::size_t k = 0; k < data.token_inputs.size(); ++k) {
    const std::string name = k < token_input_names.size() ? token_input_names[k] : "token input " + std::to_string(k);
    out.emplace_back(name, hash(data.token_inputs[k].data(), data.token_inputs[k].size() * sizeof(float)));
  }
  for (std::size_t k = 0; k < data.stage.size(); ++k) {
    const std::size_t at = data.token_inputs.size() + k;
    const std::string name = at < token_input_names.size() ? token_input_names[at] : "stage input " + std::to_string(k);
    out.emplace_back(name, hash(data.stage[k].values.data(), data.stage[k].values.size() * sizeof(double)));
  }
  return out;
}

// One tensor of the dump, opened and located.
struct Located {
  const TensorFile* file = nullptr;
  const TensorInfo* info = nullptr;
  std::string label;  // file: tensor "name" ($.path)
  [[noreturn]] void fail(const std::string& message) const { throw DumpError(label + ": " + message); }
};

class Loader {
 public:
  Loader(DumpProblem& p, bool fingerprint_inputs)
      : p_(p), m_(p.manifest), c_(p.manifest.the_case), fingerprint_inputs_(fingerprint_inputs) {}

  void run() {
    const auto start = Clock::now();
    const std::int64_t n = c_.shape.tokens;
    const std::int64_t v = c_.shape.vocab;
    teacher_ = kind_of(c_.loss).inputs().teacher_logits;
    labelled_ = kind_of(c_.loss).inputs().labels;
    start_stage();
    if (m_.cu_seqlens) {
      const Located t = locate(*m_.cu_seqlens);
      if (t.info->shape.size() != 1) t.fail("cu_seqlens must be one-dimensional, got shape " + t.info->shape_string());
      const std::vector<std::int64_t> offsets = integers(t);
      c_.batch.sequence_lengths = sequence_lengths_from_cu_seqlens(offsets, n, t.label);
    }
    // Every header and shape first: the global arrays below are then no larger than the files' data.
    for (const RankSpec& rank : m_.ranks) validate_shapes(rank);
    const std::size_t element = dtype_size(c_.inputs.dtype);
    const std::size_t row_bytes = static_cast<std::size_t>(v) * element;
    data_.student.assign(static_cast<std::size_t>(n) * row_bytes, std::byte{0});
    if (teacher_) data_.teacher.assign(data_.student.size(), std::byte{0});
    if (labelled_) data_.labels.assign(static_cast<std::size_t>(n), c_.loss.ignore_index);
    data_.loss_mask.assign(static_cast<std::size_t>(n), 1);
    label_owner_.assign(static_cast<std::size_t>(n), Owner{});
    mask_owner_.assign(static_cast<std::size_t>(n), Owner{});
    upstream_owner_.assign(static_cast<std::size_t>(n), Owner{});
    row_owner_.assign(tp_splits_columns(c_) ? 0 : static_cast<std::size_t>(n), Owner{});
    teacher_row_owner_.assign(tp_splits_columns(c_) || !teacher_ ? 0 : static_cast<std::size_t>(n), Owner{});
    if (m_.dumped.grad_output) upstream_.assign(static_cast<std::size_t>(n), 1.0);
    token_input_names_ = kind_of(c_.loss).token_inputs(c_.loss);
    data_.token_inputs.assign(token_input_names_.size(), std::vector<float>(static_cast<std::size_t>(n), 0.0f));
    token_input_owner_.assign(token_input_names_.size(), std::vector<Owner>(static_cast<std::size_t>(n)));

    p_.outputs.resize(m_.ranks.size());
    for (const RankSpec& rank : m_.ranks) load_rank(rank, p_.outputs[static_cast<std::size_t>(rank.world_rank)]);

    if (m_.dumped.grad_output) {
      c_.loss.upstream_weights.kind = UpstreamWeights::Kind::explicit_list;
      c_.loss.upstream_weights.values = upstream_;
    }
    require_finite_token_inputs();
    p_.logits_look_like_probabilities =
        stage_inputs_.empty() && rows_look_like_probabilities(data_.student, n, v, c_.inputs.dtype);
    if (fingerprint_inputs_) {
      std::vector<std::string> names = kind_of(c_.loss).token_inputs(c_.loss);
      for (const StageInput& input : stage_inputs_) names.push_back(input.name);
      p_.inputs_fingerprint = fingerprint(data_, names);
    }
    p_.inputs = std::make_unique<InputSource>(c_, std::move(data_));
    fill_not_dumped();
    p_.load_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }

 private:
  struct Owner {
    int rank = -1;
    std::int64_t row = -1;
    std::size_t label = 0;  // index into labels_
  };

  Located locate(const TensorRef& ref) {
    auto it = files_.find(ref.file);
    if (it == files_.end()) {
      try {
        it = files_.emplace(ref.file, std::make_unique<TensorFile>(TensorFile::open(ref.file))).first;
      } catch (const DumpError& e) {
        throw DumpError(std::string(e.what()) + " (named by " + m_.path + " at " + ref.json_path + ")");
      }
      p_.files.push_back(printable(ref.file));
    }
    Located l;
    l.file = it->second.get();
    l.label = tensor_label(ref.file, ref.name) + " (" + ref.json_path + ")";
    try {
      l.info = &l.file->tensor(ref.name);
    } catch (const DumpError& e) {
      throw DumpError(std::string(e.what()) + " (named by " + m_.path + " at " + ref.json_path + ")");
    }
    return l;
  }

  std::vector<std::byte> bytes(const Located& t) {
    p_.bytes_read += t.info->bytes;
    return t.file->read(*t.info);
  }
  std::vector<double> doubles(const Located& t) { return to_doubles(*t.info, bytes(t), t.label); }
  std::vector<std::int64_t> integers(const Located& t) { return to_integers(*t.info, bytes(t), t.label); }

  // [.., cols] with the leading dimensions flattening to `rows`, in the dump's dtype.
  void expect_matrix(const Located& t, std::int64_t rows, std::int64_t cols) {
    const TensorDType want = tensor_dtype_of(c_.inputs.dtype);
    if (t.info->dtype != want) {
      t.fail("dtype " + std::string(to_string(t.info->dtype)) + ", but the manifest's dtype is " +
             std::string(to_string(c_.inputs.dtype)) + " (" + std::string(to_string(want)) +
             "): logits, teacher logits and their gradients must all be in it");
    }
    const auto& s = t.info->shape;
    std::int64_t leading = 1;
    bool overflow = false;
    for (std::size_t i = 0; i + 1 < s.size(); ++i)
      overflow = overflow || __builtin_mul_overflow(leading, s[i], &leading);
    if (s.size() < 2 || s.back() != cols || overflow || leading != rows) {
      t.fail("shape " + t.info->shape_string() + ", but the rank holds " + std::to_string(rows) + " rows x " +
             std::to_string(cols) + " vocabulary columns (expected [" + std::to_string(rows) + ", " +
             std::to_string(cols) + "], or leading dimensions that flatten to " + std::to_string(rows) + ")");
    }
  }
  void expect_rows(const Located& t, std::int64_t rows) {
    if (t.info->numel() != rows) {
      t.fail("shape " + t.info->shape_string() + " holds " + std::to_string(t.info->numel()) +
             " elements, but the rank holds " + std::to_string(rows) + " rows (one element per row)");
    }
  }

  // Per-token values held by several TP ranks must agree.
  template <class T>
  void agree(std::vector<Owner>& owners, std::vector<T>& values, std::int64_t token, T value, const RankSpec& rank,
             std::int64_t row, const std::string& label, const char* what) {
    Owner& o = owners[static_cast<std::size_t>(token)];
    const auto t = static_cast<std::size_t>(token);
    if (o.rank < 0) {
      if (labels_.empty() || labels_.back() != label) labels_.push_back(label);
      o = Owner{rank.world_rank, row, labels_.size() - 1};
      values[t] = value;
      return;
    }
    if (values[t] == value || (values[t] != values[t] && value != value)) return;  // NaN agrees with NaN
    std::ostringstream a, b;
    a << static_cast<double>(values[t]);
    b << static_cast<double>(value);
    throw DumpError(std::string(what) + " of token " + std::to_string(token) + " disagree between ranks " +
                    std::to_string(o.rank) + " and " + std::to_string(rank.world_rank) +
                    " of one TP group: " + a.str() + " at row " + std::to_string(o.row) + " of " + labels_[o.label] +
                    ", " + b.str() + " at row " + std::to_string(row) + " of " + label);
  }

  // Whole rows replicated over TP (a router's without SP): every rank holding a token holds the same row, bit for
  // bit; a rank judged against another's inputs would be judged wrongly.
  void require_same_row(const std::string& key, std::int64_t token, const RankSpec& rank, std::int64_t row,
                        const Located& t, const std::byte* held, const std::byte* here, std::size_t size) {
    std::vector<Owner>& owners = key == "logits" ? row_owner_ : teacher_row_owner_;
    Owner& o = owners[static_cast<std::size_t>(token)];
    if (o.rank < 0) {
      if (labels_.empty() || labels_.back() != t.label) labels_.push_back(t.label);
      o = Owner{rank.world_rank, row, labels_.size() - 1};
      return;
    }
    if (std::memcmp(held, here, size) == 0) return;
    throw DumpError(key + " of token " + std::to_string(token) + " disagree between ranks " + std::to_string(o.rank) +
                    " and " + std::to_string(rank.world_rank) + " of one TP group: row " + std::to_string(o.row) +
                    " of " + labels_[o.label] + " and row " + std::to_string(row) + " of " + t.label +
                    " (TP replicates the tokens here: every rank must hold the same inputs)");
  }

  void validate_shapes(const RankSpec& rank) {
    for (const auto& [key, ref] : rank.stage) {
      expect_stage_shape(locate(ref), stage_shape(key, rank, 0), stage_rows_text(key, rank, 0));
    }
    for (const MicroBatchSpec& mb : rank.micro_batches) {
      const auto rows = static_cast<std::int64_t>(mb.rows.size());
      for (const auto& [key, ref] : mb.tensors) {
        const Located t = locate(ref);
        if (key == "logits" || key == "grad_logits" || key == "teacher_logits") {
          expect_matrix(t, rows, rank.vocab.size());
        } else if (is_stage_key(key)) {
          expect_stage_shape(t, stage_shape(key, rank, rows), stage_rows_text(key, rank, rows));
        } else if (key == kind_of(c_.loss).scope_values_name()) {
          continue;  // one value per column of a row, whatever the rows (load_scope_values)
        } else {
          expect_rows(t, rows);
        }
      }
    }
  }

  void load_rank(const RankSpec& rank, RankOutput& out) {
    const std::int64_t v = c_.shape.vocab;
    const std::int64_t cols = rank.vocab.size();
    const std::size_t element = dtype_size(c_.inputs.dtype);
    out.assignment.world_rank = rank.world_rank;
    out.assignment.coordinates = rank.coordinates;
    out.assignment.vocab = rank.vocab;
    out.dtype = c_.inputs.dtype;
    const std::int64_t total_rows = rank.row_count();
    out.grad.reserve(static_cast<std::size_t>(total_rows * cols) * element);
    out.token_loss.reserve(static_cast<std::size_t>(total_rows));
    const GlobalBatch batch(c_.batch);
    for (std::size_t k = 0; k < rank.micro_batches.size(); ++k) {
      const MicroBatchSpec& mb = rank.micro_batches[k];
      const auto rows = static_cast<std::int64_t>(mb.rows.size());
      out.assignment.micro_batch_begin.push_back(static_cast<std::int64_t>(out.assignment.rows.size()));
      for (std::size_t i = 0; i < mb.rows.size(); ++i) {
        const std::int64_t t = mb.rows[i];
        LocalRow row;
        row.token = t;
        if (t >= 0) {
          row.sequence = batch.sequence_of(t);
          row.position = t - batch.sequences()[static_cast<std::size_t>(row.sequence)].begin;
        } else {
          // A padding row: located by its rank-local row in the report (see dump_run_to_json).
          row.sequence = 0;
          row.position = static_cast<std::int64_t>(out.assignment.rows.size());
        }
        out.assignment.rows.push_back(row);
      }
      // logits and teacher logits -> the global rows
      for (const char* key : {"logits", "teacher_logits"}) {
        if (!mb.tensors.count(key)) continue;
        const Located t = locate(mb.tensors.at(key));
        expect_matrix(t, rows, cols);
        const std::vector<std::byte> data = bytes(t);
        std::vector<std::byte>& global = std::string(key) == "logits" ? data_.student : data_.teacher;
        dispatch_dtype(c_.inputs.dtype, [&](auto type) {
          using S = typename decltype(type)::type;
          const S* values = reinterpret_cast<const S*>(data.data());
          for (std::int64_t i = 0; i < rows; ++i) {
            for (std::int64_t j = 0; j < cols; ++j) {
              const float x = static_cast<float>(values[i * cols + j]);
              if (!std::isfinite(x)) {
                t.fail("non-finite value " + std::string(std::isnan(x) ? "NaN" : "Inf") + " at row " +
                       std::to_string(i) + ", column " + std::to_string(rank.vocab.begin + j) +
                       ": the reference needs finite inputs (a NaN in the forward input is not the loss's fault)");
              }
            }
          }
        });
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t token = mb.rows[static_cast<std::size_t>(i)];
          if (token < 0) continue;
          std::byte* to = global.data() + static_cast<std::size_t>(token * v + rank.vocab.begin) * element;
          const std::byte* from = data.data() + static_cast<std::size_t>(i * cols) * element;
          const auto size = static_cast<std::size_t>(cols) * element;
          if (!tp_splits_columns(c_)) require_same_row(key, token, rank, i, t, to, from, size);
          std::memcpy(to, from, size);
        }
      }
      // gradient: the rank's own, as dumped (zeros where a stage keeps it internal: no check reads it then)
      if (!mb.tensors.count("grad_logits")) {
        out.grad.insert(out.grad.end(), static_cast<std::size_t>(rows * cols) * element, std::byte{0});
      } else {
        const Located t = locate(mb.tensors.at("grad_logits"));
        expect_matrix(t, rows, cols);
        const std::vector<std::byte> data = bytes(t);
        out.grad.insert(out.grad.end(), data.begin(), data.end());
      }
      if (mb.tensors.count("labels")) {
        const Located t = locate(mb.tensors.at("labels"));
        expect_rows(t, rows);
        const std::vector<std::int64_t> labels = integers(t);
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t token = mb.rows[static_cast<std::size_t>(i)];
          if (token < 0) continue;
          const std::int64_t l = labels[static_cast<std::size_t>(i)];
          if (l != c_.loss.ignore_index && (l < 0 || l >= v)) {
            t.fail("label " + std::to_string(l) + " at row " + std::to_string(i) + " (token " + std::to_string(token) +
                   ") is outside [0, " + std::to_string(v) + ") and not the ignore_index " +
                   std::to_string(c_.loss.ignore_index));
          }
          agree(label_owner_, data_.labels, token, l, rank, i, t.label, "labels");
        }
      }
      if (mb.tensors.count("loss_mask")) {
        const Located t = locate(mb.tensors.at("loss_mask"));
        expect_rows(t, rows);
        const std::vector<double> mask = doubles(t);
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t token = mb.rows[static_cast<std::size_t>(i)];
          if (token < 0) continue;
          const double value = mask[static_cast<std::size_t>(i)];
          if (value != 0.0 && value != 1.0) {
            std::ostringstream s;
            s << value;
            t.fail("loss mask value " + s.str() + " at row " + std::to_string(i) + " is not 0 or 1");
          }
          agree(mask_owner_, data_.loss_mask, token, static_cast<char>(value), rank, i, t.label, "loss masks");
        }
      }
      if (mb.tensors.count("grad_output")) {
        const Located t = locate(mb.tensors.at("grad_output"));
        expect_rows(t, rows);
        const std::vector<double> g = doubles(t);
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t token = mb.rows[static_cast<std::size_t>(i)];
          if (token < 0) continue;
          const double value = g[static_cast<std::size_t>(i)];
          if (!std::isfinite(value)) t.fail("non-finite upstream gradient at row " + std::to_string(i));
          agree(upstream_owner_, upstream_, token, value, rank, i, t.label, "upstream gradients");
        }
      }
      for (std::size_t input = 0; input < token_input_names_.size(); ++input) load_token_input(rank, mb, input);
      load_stage_rows(rank, mb, out);
      load_scope_values(mb, k, out);
      load_token_quantities(mb, out);
      if (mb.tensors.count("token_loss")) {
        const Located t = locate(mb.tensors.at("token_loss"));
        expect_rows(t, rows);
        out.token_loss_dtype = stored_dtype(t);
        for (double x : doubles(t)) out.token_loss.push_back(static_cast<float>(x));
      } else {
        out.token_loss.insert(out.token_loss.end(), static_cast<std::size_t>(rows), 0.0f);  // filled below
      }
    }
    out.assignment.micro_batch_begin.push_back(static_cast<std::int64_t>(out.assignment.rows.size()));
    // The rows whose stage gradients the rank's dump holds: every row it holds (a dump's dh is per row).
    if (c_.loss.stage != nullptr) {
      out.stage_rows.resize(out.assignment.rows.size());
      for (std::size_t i = 0; i < out.stage_rows.size(); ++i) out.stage_rows[i] = static_cast<std::int64_t>(i);
    }
    load_stage_shard(rank, out);
    if (rank.loss.kind != ScalarSpec::Kind::absent) {
      out.has_reduced_loss = true;
      out.reduced_loss = static_cast<float>(scalar(rank.loss, false));
      if (rank.loss.kind == ScalarSpec::Kind::tensor) out.reduced_loss_dtype = stored_dtype(locate(rank.loss.ref));
      out.reduced_loss_precision = m_.logged_loss_precision;
    }
    if (rank.num_tokens.kind != ScalarSpec::Kind::absent) {
      out.logged_valid_tokens = static_cast<std::int64_t>(scalar(rank.num_tokens, true));
    }
    out.logged_stats.assign(rank.statistics.size(), 0.0);  // filled below where not dumped
    for (std::size_t q = 0; q < rank.statistics.size(); ++q) {
      if (rank.statistics[q].kind != ScalarSpec::Kind::absent) out.logged_stats[q] = scalar(rank.statistics[q], false);
    }
  }

  // The kind's values of micro-batch k's scope (a router's counts per expert), one per column of a row; zeros for a
  // micro-batch without rows that leaves them out (its scope holds no token).
  void load_scope_values(const MicroBatchSpec& mb, std::size_t k, RankOutput& out) {
    const std::string name(kind_of(c_.loss).scope_values_name());
    if (name.empty() || !m_.dumped.scope_values) return;
    const auto width = static_cast<std::size_t>(c_.shape.vocab);
    out.scope_values.resize(static_cast<std::size_t>(c_.layout.ga) * width, 0.0);
    if (!mb.tensors.count(name)) return;
    const Located t = locate(mb.tensors.at(name));
    if (t.info->numel() != static_cast<std::int64_t>(width)) {
      t.fail("shape " + t.info->shape_string() + " holds " + std::to_string(t.info->numel()) + " values, but a " +
             name + " tensor holds one per column of a row (" + std::to_string(width) + ")");
    }
    const std::vector<double> values = doubles(t);
    std::copy(values.begin(), values.end(), out.scope_values.begin() + static_cast<std::ptrdiff_t>(k * width));
  }

  // One of the kind's per-token inputs (a policy loss's old log-probabilities...): every TP rank holding a
  // token must give it the same value (bit for bit; NaN as NaN).
  void load_token_input(const RankSpec& rank, const MicroBatchSpec& mb, std::size_t k) {
    const Located t = locate(mb.tensors.at(token_input_names_[k]));
    const auto rows = static_cast<std::int64_t>(mb.rows.size());
    expect_rows(t, rows);
    // Log-probabilities and advantages are real numbers: an integer or boolean tensor is a dump of something else.
    if (!is_floating(t.info->dtype)) {
      t.fail("dtype " + std::string(to_string(t.info->dtype)) + ": " + token_input_names_[k] +
             " must be a floating-point tensor (F16, BF16, F32 or F64)");
    }
    const bool log_probability = token_input_names_[k].find("logprob") != std::string::npos;
    const std::vector<double> values = doubles(t);
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t token = mb.rows[static_cast<std::size_t>(i)];
      if (token < 0) continue;
      const double value = values[static_cast<std::size_t>(i)];
      if (log_probability && value > 0.0) {
        std::ostringstream text;
        text << value;
        t.fail(token_input_names_[k] + " " + text.str() + " at row " + std::to_string(i) + " (token " +
               std::to_string(token) + ") is not a log-probability (> 0)");
      }
      agree(token_input_owner_[k], data_.token_inputs[k], token,
            static_cast<float>(values[static_cast<std::size_t>(i)]), rank, i, t.label, token_input_names_[k].c_str());
    }
  }

  // ---- A stage's tensors (an LM head's h, W, b and dh, dW, db: manifest.hpp, stage_row_tensors/stage_rank_tensors)

  void start_stage() {
    if (c_.loss.stage == nullptr) return;
    stage_inputs_ = c_.loss.stage->inputs(c_);
    const std::int64_t n = c_.shape.tokens, v = c_.shape.vocab;
    for (const StageInput& input : stage_inputs_) {
      ExplicitInputs::StageTensor t;
      t.stream = input.stream;
      t.rows = input.rows == StageInput::Rows::token ? n : input.rows == StageInput::Rows::column ? v : 1;
      t.width = input.rows == StageInput::Rows::vocabulary ? v : input.width;
      t.values.assign(static_cast<std::size_t>(t.rows * t.width), 0.0);
      data_.stage.push_back(std::move(t));
      stage_owner_.emplace_back(static_cast<std::size_t>(input.rows == StageInput::Rows::token ? n : v));
    }
  }

  bool is_stage_key(const std::string& key) const {
    if (c_.loss.stage == nullptr) return false;
    const std::vector<std::string> rows = stage_row_tensors(c_), shard = stage_rank_tensors(c_);
    return std::find(rows.begin(), rows.end(), key) != rows.end() ||
           std::find(shard.begin(), shard.end(), key) != shard.end();
  }
  const StageInput* stage_input(const std::string& key) const {
    for (const StageInput& input : stage_inputs_) {
      if (input.name == key) return &input;
    }
    return nullptr;
  }
  static RankAssignment shard_of(const RankSpec& rank) {
    RankAssignment a;
    a.world_rank = rank.world_rank;
    a.coordinates = rank.coordinates;
    a.vocab = rank.vocab;
    return a;
  }

  // The shape a stage tensor of `rank` must have (`rows`: the micro-batch's, for a per-row tensor). A parameter
  // gradient of one column (db) is a vector.
  std::vector<std::int64_t> stage_shape(const std::string& key, const RankSpec& rank, std::int64_t rows) const {
    const Stage& stage = *c_.loss.stage;
    const RankAssignment shard = shard_of(rank);
    if (const StageInput* input = stage_input(key)) {
      if (input->rows == StageInput::Rows::token) return {rows, input->width};
      if (input->rows == StageInput::Rows::column) return {rank.vocab.size(), input->width};
      return {rank.vocab.size()};
    }
    const std::vector<std::string> gradients = stage.gradients(), parameters = stage.parameters();
    for (std::size_t w = 0; w < gradients.size(); ++w) {
      if (gradients[w] == key) return {rows, stage.gradient_columns(w, c_, shard)};
    }
    for (std::size_t p = 0; p < parameters.size(); ++p) {
      if (parameters[p] != key) continue;
      const ParameterShape shape = stage.parameter_shape(p, c_, shard);
      if (shape.columns == 1) return {shape.rows};
      return {shape.rows, shape.columns};
    }
    throw InternalError("check-dump: " + key + " is no tensor of the stage");
  }

  // What the expected shape holds, for messages.
  std::string stage_rows_text(const std::string& key, const RankSpec& rank, std::int64_t rows) const {
    const std::string columns = "vocabulary columns [" + std::to_string(rank.vocab.begin) + ", " +
                                std::to_string(rank.vocab.end) + ") of V = " + std::to_string(c_.shape.vocab);
    const std::string settings = "the case's stage settings";
    if (const StageInput* input = stage_input(key)) {
      if (input->rows == StageInput::Rows::token) {
        return "a row of " + std::to_string(input->width) + " values (" + settings + ") per row of the micro-batch (" +
               std::to_string(rows) + " rows)";
      }
      if (input->rows == StageInput::Rows::column) {
        return "a row of " + std::to_string(input->width) + " values (" + settings + ") per vocabulary column of " +
               rank.describe() + ", which holds " + columns;
      }
      return "a value per vocabulary column of " + rank.describe() + ", which holds " + columns;
    }
    const std::vector<std::string> gradients = c_.loss.stage->gradients();
    if (std::find(gradients.begin(), gradients.end(), key) != gradients.end()) {
      return "the stage's gradient " + key + " of each row of the micro-batch (" + std::to_string(rows) + " rows)";
    }
    return "the stage's parameter gradient " + key + " of the shard of " + rank.describe() + ", which holds " + columns;
  }

  void expect_stage_shape(const Located& t, const std::vector<std::int64_t>& shape, const std::string& what) {
    const TensorDType want = tensor_dtype_of(c_.inputs.dtype);
    if (t.info->dtype != want) {
      t.fail("dtype " + std::string(to_string(t.info->dtype)) + ", but the manifest's dtype is " +
             std::string(to_string(c_.inputs.dtype)) + " (" + std::string(to_string(want)) +
             "): a stage's inputs and gradients are in it");
    }
    if (t.info->shape == shape) return;
    std::string expected;
    for (const std::int64_t d : shape) append_to_list(expected, std::to_string(d));
    t.fail("shape " + t.info->shape_string() + ", but it holds " + what + ": expected [" + expected + "]");
  }

  // A stage input's values, each finite (the reference computes the logits from them).
  std::vector<double> finite_stage_values(const Located& t, std::int64_t width) {
    std::vector<double> values = doubles(t);
    for (std::size_t k = 0; k < values.size(); ++k) {
      if (std::isfinite(values[k])) continue;
      t.fail("non-finite value " +
             std::string(std::isnan(values[k]) ? "NaN"
                         : values[k] > 0       ? "Inf"
                                               : "-Inf") +
             " at row " + std::to_string(static_cast<std::int64_t>(k) / width) + ", column " +
             std::to_string(static_cast<std::int64_t>(k) % width) +
             ": the reference needs finite inputs (a NaN in the forward input is not the loss's fault)");
    }
    return values;
  }

  // Row `unit` (a token, or a vocabulary column) of stage input `k` from `rank`'s row `row`: the first holder sets it,
  // every later one (another TP rank of the token, another DP or CP replica of the shard) must agree bit for bit.
  void place_stage_row(std::size_t k, std::int64_t unit, std::span<const double> values, const RankSpec& rank,
                       std::int64_t row, const Located& t) {
    ExplicitInputs::StageTensor& global = data_.stage[k];
    const bool vector = stage_inputs_[k].rows == StageInput::Rows::vocabulary;
    double* to = vector ? &global.values[static_cast<std::size_t>(unit)]
                        : &global.values[static_cast<std::size_t>(unit * global.width)];
    Owner& o = stage_owner_[k][static_cast<std::size_t>(unit)];
    if (o.rank < 0) {
      if (labels_.empty() || labels_.back() != t.label) labels_.push_back(t.label);
      o = Owner{rank.world_rank, row, labels_.size() - 1};
      std::copy(values.begin(), values.end(), to);
      return;
    }
    if (std::equal(values.begin(), values.end(), to)) return;
    const bool token = stage_inputs_[k].rows == StageInput::Rows::token;
    throw DumpError(stage_inputs_[k].name + " of " + (token ? "token " : "vocabulary column ") + std::to_string(unit) +
                    " disagrees between ranks " + std::to_string(o.rank) + " and " + std::to_string(rank.world_rank) +
                    ": row " + std::to_string(o.row) + " of " + labels_[o.label] + " and row " + std::to_string(row) +
                    " of " + t.label +
                    (token ? " (the TP ranks of a token must hold the same input)"
                           : " (the DP and CP replicas of a vocabulary shard must hold the same input)"));
  }

  // A micro-batch's per-row stage tensors: its inputs (h) into the global ones, its gradients (dh) into the rank's.
  void load_stage_rows(const RankSpec& rank, const MicroBatchSpec& mb, RankOutput& out) {
    const Stage* stage = c_.loss.stage;
    if (stage == nullptr) return;
    const auto rows = static_cast<std::int64_t>(mb.rows.size());
    for (std::size_t k = 0; k < stage_inputs_.size(); ++k) {
      if (stage_inputs_[k].rows != StageInput::Rows::token || !mb.tensors.count(stage_inputs_[k].name)) continue;
      const Located t = locate(mb.tensors.at(stage_inputs_[k].name));
      const std::int64_t width = stage_inputs_[k].width;
      const std::vector<double> values = finite_stage_values(t, width);
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::int64_t token = mb.rows[static_cast<std::size_t>(i)];
        if (token < 0) continue;
        place_stage_row(k, token, std::span<const double>(&values[static_cast<std::size_t>(i * width)], width), rank, i,
                        t);
      }
    }
    const std::vector<std::string> gradients = stage->gradients();
    out.stage_grads.resize(gradients.size());
    out.stage_columns.resize(gradients.size());
    for (std::size_t w = 0; w < gradients.size(); ++w) {
      out.stage_columns[w] = stage->gradient_columns(w, c_, shard_of(rank));
      const std::vector<std::byte> data = bytes(locate(mb.tensors.at(gradients[w])));
      out.stage_grads[w].insert(out.stage_grads[w].end(), data.begin(), data.end());
    }
  }

  // The rank's shard tensors: its inputs (W, b) into the global ones, its parameter gradients (dW, db) as they are.
  void load_stage_shard(const RankSpec& rank, RankOutput& out) {
    const Stage* stage = c_.loss.stage;
    if (stage == nullptr) return;
    for (std::size_t k = 0; k < stage_inputs_.size(); ++k) {
      const StageInput& input = stage_inputs_[k];
      if (input.rows == StageInput::Rows::token) continue;
      const Located t = locate(rank.stage.at(input.name));
      const bool vector = input.rows == StageInput::Rows::vocabulary;
      const std::int64_t width = vector ? 1 : input.width;
      const std::vector<double> values = finite_stage_values(t, width);
      for (std::int64_t j = 0; j < rank.vocab.size(); ++j) {
        place_stage_row(k, rank.vocab.begin + j,
                        std::span<const double>(&values[static_cast<std::size_t>(j * width)], width), rank, j, t);
      }
    }
    const std::vector<std::string> parameters = stage->parameters();
    out.stage_params.assign(parameters.size(), {});
    for (std::size_t p = 0; p < parameters.size(); ++p) {
      if (rank.stage.count(parameters[p])) out.stage_params[p] = bytes(locate(rank.stage.at(parameters[p])));
    }
  }

  // The reference reads the kind's per-token inputs of every token that counts: each must be finite.
  void require_finite_token_inputs() const {
    const LossSpec& loss = c_.loss;
    for (std::size_t k = 0; k < token_input_names_.size(); ++k) {
      for (std::size_t t = 0; t < data_.token_inputs[k].size(); ++t) {
        const float value = data_.token_inputs[k][t];
        const bool counts = data_.loss_mask[t] != 0 && (data_.labels.empty() || data_.labels[t] != loss.ignore_index);
        if (!counts || std::isfinite(value)) continue;
        const Owner& o = token_input_owner_[k][t];
        throw DumpError(labels_[o.label] + ": non-finite " + token_input_names_[k] + " " +
                        (std::isnan(value) ? "NaN"
                         : value > 0       ? "Inf"
                                           : "-Inf") +
                        " at row " + std::to_string(o.row) + " (token " + std::to_string(t) +
                        ", which counts in the loss): the reference needs finite inputs");
      }
    }
  }

  // The kind's per-token quantities ("token_" tensors) into the rank's token values, row major; zeros where
  // not dumped (filled in by fill_not_dumped).
  void load_token_quantities(const MicroBatchSpec& mb, RankOutput& out) {
    const std::vector<std::string> quantities = kind_of(c_.loss).token_quantities();
    const std::size_t q = quantities.size();
    if (q == 0) return;
    const std::size_t rows = mb.rows.size();
    const std::size_t first = out.token_values.size();
    out.token_values.resize(first + rows * q, 0.0f);
    for (std::size_t j = 0; j < q; ++j) {
      const auto it = mb.tensors.find(token_quantity_tensor(quantities[j]));
      if (it == mb.tensors.end()) continue;
      const Located t = locate(it->second);
      expect_rows(t, static_cast<std::int64_t>(rows));
      const std::vector<double> values = doubles(t);
      for (std::size_t i = 0; i < rows; ++i) out.token_values[first + i * q + j] = static_cast<float>(values[i]);
    }
  }

  // A loss stored in 16 bits is judged in that dtype's units (verify_rank); anything wider as float32.
  static DType stored_dtype(const Located& t) {
    if (t.info->dtype == TensorDType::bf16) return DType::bf16;
    if (t.info->dtype == TensorDType::f16) return DType::fp16;
    return DType::fp32;
  }

  double scalar(const ScalarSpec& s, bool count) {
    if (s.kind == ScalarSpec::Kind::inline_value) return s.value;
    const Located t = locate(s.ref);
    if (t.info->numel() != 1) t.fail("a logged scalar must hold one element, got shape " + t.info->shape_string());
    const double value = doubles(t).front();
    if (count) {
      if (std::isnan(value)) t.fail("NaN in a count: the logged token count must be a non-negative integer");
      if (!std::isfinite(value) || value < 0.0 || value != std::floor(value) || value > 9.0e15) {
        std::ostringstream text;
        text << value;
        t.fail("the logged token count " + text.str() + " is not a non-negative integer");
      }
    }
    return value;
  }

  // Quantities the dump lacks get the reference's values, so that verify_rank compares nothing through
  // them; check_dump then reports them as not dumped (never as a passing comparison).
  void fill_not_dumped() {
    const Dumped& d = m_.dumped;
    const bool need_reduced = !d.loss && c_.loss.reduction != Reduction::none;
    const auto missing = [](const std::vector<char>& dumped) {
      return std::find(dumped.begin(), dumped.end(), 0) != dumped.end();
    };
    const bool need_values = missing(d.token_quantities);
    const bool need_statistics = missing(d.statistics);
    if (d.token_loss && !need_reduced && d.num_tokens && !need_values && !need_statistics) return;
    const InputSource& inputs = *p_.inputs;
    const LossReference reference(c_, inputs);
    const std::int64_t n = c_.shape.tokens;
    const std::int64_t v = c_.shape.vocab;
    const std::size_t q = d.token_quantities.size();
    const std::size_t s = d.statistics.size();
    std::vector<double> losses(static_cast<std::size_t>(n), 0.0);
    std::vector<double> values(static_cast<std::size_t>(n) * q, 0.0);
    std::vector<double> statistics(static_cast<std::size_t>(n) * s, 0.0);
    if (!d.token_loss || need_reduced || need_values || need_statistics) {
#pragma omp parallel
      {
        std::vector<double> student(static_cast<std::size_t>(v));
        std::vector<double> teacher(teacher_ ? static_cast<std::size_t>(v) : 0);
        std::vector<double> grad(static_cast<std::size_t>(v));
#pragma omp for schedule(dynamic, 8)
        for (std::int64_t t = 0; t < n; ++t) {
          const StageReference* stage = reference.stage();
          if (stage != nullptr && stage->makes_logits()) {
            stage->logits(t, 0, v, student.data());  // the stage's float64 logits from its dumped inputs
          } else {
            inputs.logits(t, 0, v, student.data());
          }
          if (teacher_) inputs.teacher_logits(t, 0, v, teacher.data());
          const ReferenceToken r = reference.evaluate(t, student, teacher, grad);
          const auto k = static_cast<std::size_t>(t);
          losses[k] = r.loss;
          if (!r.valid) continue;
          reference.row().token_values(t, r.stats, std::span<double>(values).subspan(k * q, q));
          reference.row().token_statistics(t, r.stats, std::span<double>(statistics).subspan(k * s, s));
        }
      }
    }
    const float reduced =
        c_.loss.reduction == Reduction::none ? 0.0f : static_cast<float>(reference.reduced_loss(losses));
    std::vector<double> means(s, 0.0);
    for (std::size_t j = 0; j < s; ++j) {
      CompensatedSum total;
      for (std::int64_t t = 0; t < n; ++t) total.add(statistics[static_cast<std::size_t>(t) * s + j]);
      means[j] = total.value() / static_cast<double>(std::max<std::int64_t>(reference.valid_tokens(), 1));
    }
    for (RankOutput& out : p_.outputs) {
      for (std::int64_t i = 0; i < out.rows(); ++i) {
        const std::int64_t t = out.token_of(i);
        const auto row = static_cast<std::size_t>(i);
        if (!d.token_loss)
          out.token_loss[row] = t >= 0 ? static_cast<float>(losses[static_cast<std::size_t>(t)]) : 0.0f;
        for (std::size_t j = 0; j < q; ++j) {
          if (d.token_quantities[j]) continue;
          out.token_values[row * q + j] =
              t >= 0 ? static_cast<float>(values[static_cast<std::size_t>(t) * q + j]) : 0.0f;
        }
      }
      for (std::size_t j = 0; j < s; ++j) {
        if (!d.statistics[j]) out.logged_stats[j] = means[j];
      }
      if (!d.loss) out.reduced_loss = reduced;
      if (!d.num_tokens) out.logged_valid_tokens = reference.valid_tokens();
    }
  }

  DumpProblem& p_;
  Manifest& m_;
  Case& c_;
  bool fingerprint_inputs_ = false;
  bool teacher_ = false;
  bool labelled_ = true;
  ExplicitInputs data_;
  std::vector<double> upstream_;
  std::vector<Owner> label_owner_, mask_owner_, upstream_owner_, row_owner_, teacher_row_owner_;
  std::vector<std::string> token_input_names_;
  std::vector<std::vector<Owner>> token_input_owner_;
  std::vector<StageInput> stage_inputs_;         // the case's stage's own inputs (none without a stage)
  std::vector<std::vector<Owner>> stage_owner_;  // per stage input: who gave each token's or column's row
  std::vector<std::string> labels_;
  std::map<std::string, std::unique_ptr<TensorFile>> files_;
};

// The reduced-loss record of the loss check (token, column and padding all absent).
bool is_reduced_record(const ElementRecord& r) { return r.token < 0 && r.column < 0 && r.padding_sequence < 0; }

// A check of one of the kind's per-token quantities that the dump lacks: not applicable.
void mark_quantity_not_dumped(CheckResult& r) {
  r.verdict = Verdict::not_applicable;
  r.margin = 0.0;
  r.worst.reset();
  r.metrics = {{"dumped", false}};
  r.summary = "no per-token " + r.name + " in the dump (tensors." + token_quantity_tensor(r.name) + ")";
}

// The kind's logged statistics that the dump lacks are marked so in the stats check's metrics; with neither
// them nor the token count dumped, the check is not applicable.
void mark_statistics_not_dumped(CheckResult& r, const Dumped& d, const std::vector<std::string>& names) {
  bool any = d.num_tokens;
  for (std::size_t j = 0; j < names.size(); ++j) {
    if (d.statistics[j]) {
      any = true;
    } else {
      r.metrics[names[j]] = {{"dumped", false}};
    }
  }
  if (!d.num_tokens) r.metrics["num_tokens"] = {{"dumped", false}};
  if (any) return;
  r.verdict = Verdict::not_applicable;
  r.margin = 0.0;
  r.worst.reset();
  const json expected = r.metrics.value("expected_valid_tokens", json());
  r.metrics = {{"dumped", false}};
  if (!expected.is_null()) r.metrics["expected_valid_tokens"] = expected;
  r.summary = "no logged token count or statistics in the dump";
}

// Replaces the comparisons made through filled-in values by "not dumped".
void mark_not_dumped(std::vector<CheckResult>& checks, const Dumped& d, const LossSpec& loss) {
  const Reduction reduction = loss.reduction;
  const bool logged_loss_missing = !d.loss && reduction != Reduction::none;  // "none" logs no reduced loss
  const LossKind& kind = kind_of(loss);
  const std::vector<std::string> quantities = kind.token_quantities();
  const bool internal_gradient = loss.stage != nullptr && loss.stage->logit_gradient_internal();
  for (CheckResult& r : checks) {
    if (internal_gradient && (r.name == "grad" || r.name == "row_sum")) {  // a fused head's dump holds no gradient
      r.verdict = Verdict::not_applicable;
      r.margin = 0.0;
      r.worst.reset();
      r.metrics = {{"dumped", false}};
      r.summary = "the stage " + std::string(loss.stage->name()) +
                  " keeps the logits' gradient internal: a dump holds none, its gradients judge it";
      continue;
    }
    const auto quantity = std::find(quantities.begin(), quantities.end(), r.name);
    if (quantity != quantities.end()) {
      if (!d.token_quantities[static_cast<std::size_t>(quantity - quantities.begin())]) mark_quantity_not_dumped(r);
      continue;
    }
    if (r.name == "stats") {
      mark_statistics_not_dumped(r, d, kind.logged_statistics(loss));
      continue;
    }
    if (r.name == kind.scope_values_name() && !d.scope_values) {
      mark_quantity_not_dumped(r);
      r.summary = "no " + r.name + " in the dump (tensors." + r.name + ")";
      continue;
    }
    if (r.name == "loss" && (!d.token_loss || logged_loss_missing)) {
      const bool keep_tokens = d.token_loss;
      const json kept = keep_tokens ? r.metrics["per_token"] : r.metrics.value("reduced", json::object());
      r.metrics[keep_tokens ? "reduced" : "per_token"] = {{"dumped", false}};
      r.margin = kept.value("margin", 0.0);
      r.metrics["margin"] = r.margin;
      const std::int64_t compared = kept.value("compared", std::int64_t{0});
      const std::int64_t mismatches = kept.value("mismatches", std::int64_t{0});
      r.verdict = compared == 0 ? Verdict::not_applicable : mismatches > 0 ? Verdict::fail : Verdict::pass;
      if (r.worst && is_reduced_record(*r.worst) == keep_tokens) r.worst.reset();  // a filled-in element
      r.summary = keep_tokens ? "per-token losses vs the float64 reference (no logged loss in the dump)"
                              : "logged loss vs the float64 reference (no per-token losses in the dump)";
    } else if (r.name == "rank_agreement" && !d.token_loss) {
      r.verdict = Verdict::not_applicable;
      r.margin = 0.0;
      r.worst.reset();
      r.metrics = {{"dumped", false}};
      r.summary = "no per-token losses in the dump";
    }
  }
}

std::string check_tensor_key(const LossSpec& loss, const std::string& check, const ElementRecord& w) {
  if (loss.stage != nullptr) {  // a stage's gradient is dumped under its check's name ("dh")
    const std::vector<std::string> gradients = loss.stage->gradients();
    if (std::find(gradients.begin(), gradients.end(), check) != gradients.end()) return check;
  }
  if (check == "grad" || check == "row_sum" || (check == "finite" && w.column >= 0)) return "grad_logits";
  if (check == "loss" || check == "rank_agreement" || check == "finite") return "token_loss";
  const std::vector<std::string> quantities = kind_of(loss).token_quantities();
  if (std::find(quantities.begin(), quantities.end(), check) != quantities.end()) return token_quantity_tensor(check);
  return "";
}

// Where the dump holds the element of a worst record: rank, micro-batch, row (of that micro-batch's
// tensors) and the tensor itself.
struct DumpPlace {
  int rank = -1;
  int micro_batch = -1;
  std::int64_t row = -1;
  const RankSpec* spec = nullptr;
};

DumpPlace place_of(const DumpProblem& p, const ElementRecord& w) {
  DumpPlace place;
  if (w.rank < 0 || w.rank >= static_cast<int>(p.outputs.size())) return place;
  const RankOutput& out = p.outputs[static_cast<std::size_t>(w.rank)];
  std::int64_t local = -1;
  if (w.token >= 0) {
    for (std::int64_t i = 0; i < out.rows(); ++i) {
      if (out.token_of(i) == w.token) {
        local = i;
        break;
      }
    }
  } else if (w.padding_sequence >= 0) {
    local = w.padding_position;  // padding rows carry their rank-local row here
  }
  if (local < 0 || local >= out.rows()) return place;
  const auto& begin = out.assignment.micro_batch_begin;
  int k = 0;
  while (k + 1 < static_cast<int>(begin.size()) - 1 && begin[static_cast<std::size_t>(k + 1)] <= local) ++k;
  place.rank = w.rank;
  place.micro_batch = k;
  place.row = local - begin[static_cast<std::size_t>(k)];
  place.spec = &p.manifest.ranks[static_cast<std::size_t>(w.rank)];
  return place;
}

std::string ref_text(const TensorRef& ref) {
  return ref.name.empty() ? printable(ref.file) : printable(ref.file) + ":" + printable(ref.name);
}

}  // namespace

std::unique_ptr<DumpProblem> load_dump(Manifest manifest, bool fingerprint_inputs) {
  auto problem = std::make_unique<DumpProblem>();
  problem->manifest = std::move(manifest);
  problem->implementation.name = problem->manifest.implementation;
  problem->implementation.summary = "the implementation that wrote the dump";
  problem->implementation.source = problem->manifest.path;
  problem->implementation.signal = "";
  Loader(*problem, fingerprint_inputs).run();
  return problem;
}

std::unique_ptr<DumpProblem> load_dump(const std::string& manifest_path, bool fingerprint_inputs) {
  return load_dump(load_manifest(manifest_path), fingerprint_inputs);
}

void require_same_manifest_problem(const Manifest& first, const Manifest& other) {
  const Case& a = first.the_case;
  const Case& b = other.the_case;
  const std::string where = other.path + ": not the problem of " + first.path + ": ";
  auto section = [](const Case& c, const char* key) { return c.resolved().value(key, json()); };
  for (const char* key : {"shape", "loss", "stage", "framework"}) {
    if (section(a, key) != section(b, key)) {
      throw DumpError(where + "its " + key + " differs (" + section(b, key).dump() + " against " +
                      section(a, key).dump() + "); a sweep compares one problem at several layouts");
    }
  }
  if (a.inputs.dtype != b.inputs.dtype) throw DumpError(where + "its dtype differs");
  if (a.batch.sequence_lengths != b.batch.sequence_lengths)
    throw DumpError(where + "its sequences (cu_seqlens) differ");
}

void require_same_problem(const DumpProblem& first, const DumpProblem& other) {
  require_same_manifest_problem(first.manifest, other.manifest);
  const std::string where = other.manifest.path + ": not the problem of " + first.manifest.path + ": ";
  if (!first.inputs_fingerprint || !other.inputs_fingerprint) {
    throw InternalError("require_same_problem: load the dumps with fingerprint_inputs");
  }
  std::string differing;
  for (std::size_t k = 0; k < first.inputs_fingerprint->size() && k < other.inputs_fingerprint->size(); ++k) {
    if ((*first.inputs_fingerprint)[k] != (*other.inputs_fingerprint)[k]) {
      differing += (differing.empty() ? "" : ", ") + (*first.inputs_fingerprint)[k].first;
    }
  }
  if (!differing.empty() || first.inputs_fingerprint->size() != other.inputs_fingerprint->size()) {
    throw DumpError(where + "its " + (differing.empty() ? std::string("inputs") : differing) +
                    " differ from the first dump's");
  }
}

RunResult check_dump(const DumpProblem& p, const DumpCheckOptions& options) {
  const auto start = Clock::now();
  const Case& c = p.manifest.the_case;
  const int world_size = c.layout.world_size();
  const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = std::max(1, (options.threads > 0 ? options.threads : hardware) / world_size);
  std::vector<CheckResult> checks;
  ErrorMap error_map;
  double verify_seconds = 0.0;
  LayoutSnapshot snapshot;
  if (options.keep_snapshot)
    snapshot = LayoutSnapshot::sized_for(c.shape.tokens, c.shape.vocab,
                                         c.loss.stage == nullptr || !c.loss.stage->logit_gradient_internal());
  ThreadWorldOptions world_options;
  world_options.ranks = world_size;
  world_options.timeout_seconds = c.timeout_seconds;
  run_thread_ranks(world_options, [&](Communicator& world) {
    const auto rank_start = Clock::now();
    const int rank = world.rank();
    OwnedRankGroups owned = make_rank_groups(world, c);  // those of run_case
    RankGroups groups = owned.view();
    ErrorMap map;
    const RankOutput& out = p.outputs[static_cast<std::size_t>(rank)];
    HostOracle oracle(c, *p.inputs, out, grad_judgement(c, p.inputs->valid_tokens(), out.dtype), threads);
    std::vector<CheckResult> results =
        verify_rank(c, out, oracle, groups, world, options.keep_snapshot ? &snapshot : nullptr, &map);
    double seconds[1] = {std::chrono::duration<double>(Clock::now() - rank_start).count()};
    world.allreduce_max(std::span<double>(seconds, 1));
    if (rank == 0) {
      checks = std::move(results);
      error_map = std::move(map);
      verify_seconds = seconds[0];
    }
  });
  mark_not_dumped(checks, p.manifest.dumped, c.loss);
  RunResult result;
  result.the_case = c;
  result.implementation = &p.implementation;
  result.ranks = world_size;
  result.checks = std::move(checks);
  result.error_map = std::move(error_map);
  result.verdict = Verdict::pass;
  for (const CheckResult& check : result.checks) {
    if (check.verdict == Verdict::fail) result.verdict = Verdict::fail;
  }
  if (result.verdict == Verdict::fail && p.logits_look_like_probabilities) {
    result.hints.push_back(
        "every row of the dumped logits lies in [0, 1] and sums to 1: they look like softmax probabilities, not "
        "logits. The implementation probably overwrote its input in place (Megatron-LM's fp32 "
        "vocab_parallel_cross_entropy does) and the logits were dumped after the call: dump a copy taken before it");
  }
  if (options.keep_snapshot) result.snapshot = std::move(snapshot);
  result.timings.generate_max = p.load_seconds;
  result.timings.reference_and_checks = verify_seconds;
  result.timings.ranks_wall = verify_seconds;
  result.timings.total = p.load_seconds + std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

std::vector<ControlRun> dump_controls(const DumpProblem& p, const DumpCheckOptions& options) {
  RunOptions control;
  control.threads = options.threads;
  control.shared_inputs = p.inputs.get();
  RunResult dumped;  // the dump is never lossverify's own run: every control runs
  return run_controls(p.manifest.the_case, control, *thread_launcher(), dumped);
}

json dump_run_to_json(const DumpProblem& p, const RunResult& run) {
  json j = run_to_json(run);
  const Manifest& m = p.manifest;
  for (std::size_t i = 0; i < run.checks.size() && i < j["checks"].size(); ++i) {
    const CheckResult& check = run.checks[i];
    json& worst = j["checks"][i]["worst"];
    if (!check.worst || worst.is_null()) continue;
    const ElementRecord& w = *check.worst;
    if (w.token < 0 && w.rank >= 0 && w.rank < static_cast<int>(m.ranks.size())) {
      const auto& shard = m.ranks[static_cast<std::size_t>(w.rank)].stage;  // a stage's parameter gradient (dW)
      if (shard.count(check.name)) worst["tensor"] = ref_text(shard.at(check.name));
    }
    const DumpPlace place = place_of(p, *check.worst);
    // The layout model's placement (dp, micro-batch, CP rank, chunk) does not apply to a dump: the dump's own.
    for (const char* key : {"dp_rank", "micro_batch", "cp_rank", "chunk"}) worst.erase(key);
    if (place.spec == nullptr) continue;
    worst["dp_rank"] = place.spec->coordinates.dp;
    worst["cp_rank"] = place.spec->coordinates.cp;
    worst["micro_batch"] = place.micro_batch;
    worst["row"] = place.row;
    if (check.worst->token < 0) {
      worst["sequence"] = nullptr;
      worst["position"] = nullptr;
    }
    const std::string key = check_tensor_key(m.the_case.loss, check.name, *check.worst);
    const auto& tensors = place.spec->micro_batches[static_cast<std::size_t>(place.micro_batch)].tensors;
    if (!key.empty() && tensors.count(key)) worst["tensor"] = ref_text(tensors.at(key));
  }
  json ranks = json::array();
  for (const RankSpec& r : m.ranks) {
    ranks.push_back({{"rank", r.world_rank},
                     {"tp", r.coordinates.tp},
                     {"cp", r.coordinates.cp},
                     {"dp", r.coordinates.dp},
                     {"vocab", {r.vocab.begin, r.vocab.end}},
                     {"rows", r.row_count()}});
  }
  j["dump"] = {{"format", kManifestFormat},
               {"manifest", m.path},
               {"files", p.files},
               {"bytes_read", p.bytes_read},
               {"load_seconds", p.load_seconds},
               {"dumped",
                {{"token_loss", m.dumped.token_loss},
                 {"loss", m.dumped.loss},
                 {"num_tokens", m.dumped.num_tokens},
                 {"loss_mask", m.dumped.loss_mask},
                 {"grad_output", m.dumped.grad_output}}},
               {"ranks", ranks}};
  const LossKind& kind = kind_of(m.the_case.loss);
  const std::vector<std::string> quantities = kind.token_quantities();
  for (std::size_t q = 0; q < quantities.size(); ++q) {
    j["dump"]["dumped"][token_quantity_tensor(quantities[q])] = m.dumped.token_quantities[q] != 0;
  }
  const std::vector<std::string> statistics = kind.logged_statistics(m.the_case.loss);
  for (std::size_t k = 0; k < statistics.size(); ++k) {
    j["dump"]["dumped"]["stats." + statistics[k]] = m.dumped.statistics[k] != 0;
  }
  if (const std::string name(kind.scope_values_name()); !name.empty()) {
    j["dump"]["dumped"][name] = m.dumped.scope_values;
  }
  j["case"]["description"] =
      "inputs from the dump " + m.path + (m.the_case.description.empty() ? "" : ": " + m.the_case.description);
  return j;
}

void print_dump_summary(std::ostream& out, const DumpProblem& p, const RunResult& run) {
  const Case& c = run.the_case;
  out << "dump " << c.name << "  [" << to_string(c.loss.kind) << ", N=" << c.shape.tokens << " V=" << c.shape.vocab
      << ", " << to_string(c.inputs.dtype) << ", tp=" << c.layout.tp << " cp=" << c.layout.cp << " dp=" << c.layout.dp
      << " ga=" << c.layout.ga << "]  impl " << run.implementation->name << "\n";
  const std::string control_header = control_column_header(run);
  const int control_width = static_cast<int>(control_column_width(run));
  out << "  " << std::left << std::setw(16) << "check" << std::setw(16) << "verdict" << std::setw(11) << "margin";
  if (!control_header.empty()) out << std::setw(control_width) << control_header;
  out << "worst (token, column, rank: expected -> got) where in the dump\n";
  for (const CheckResult& check : run.checks) {
    std::string worst = "-";
    if (check.worst && check.margin > 0.0) {
      const ElementRecord& w = *check.worst;
      std::ostringstream s;
      s << std::setprecision(6) << "(" << (w.token >= 0 ? std::to_string(w.token) : "-") << ", "
        << (w.column >= 0 ? std::to_string(w.column) : "-") << ", " << w.rank << ": " << w.expected << " -> " << w.got
        << ")";
      const DumpPlace place = place_of(p, w);
      if (place.spec != nullptr) {
        s << " mb " << place.micro_batch << " row " << place.row;
        const std::string key = check_tensor_key(c.loss, check.name, w);
        const auto& tensors = place.spec->micro_batches[static_cast<std::size_t>(place.micro_batch)].tensors;
        if (!key.empty() && tensors.count(key)) s << " of " << ref_text(tensors.at(key));
        if (w.token < 0) s << " (padding row)";
      }
      worst = s.str();
    }
    std::ostringstream margin;
    margin << std::setprecision(3) << check.margin;
    const std::string verdict = check.verdict == Verdict::fail ? "FAIL" : std::string(to_string(check.verdict));
    const bool not_dumped = check.metrics.is_object() && check.metrics.value("dumped", true) == false;
    out << "  " << std::left << std::setw(16) << check.name << std::setw(16) << verdict << std::setw(11)
        << margin.str();
    if (!control_header.empty()) out << std::setw(control_width) << (not_dumped ? "-" : control_cell(run, check));
    out << (not_dumped ? "not in the dump" : worst) << "\n";
  }
  for (const std::string& note : band_notes(run)) out << "  note: " << note << "\n";
  for (const std::string& hint : run.hints) out << "  hint: " << hint << "\n";
  out << "  verdict: " << (run.verdict == Verdict::fail ? "FAIL" : "pass") << "   (" << std::fixed
      << std::setprecision(2) << run.timings.total << " s, " << p.files.size() << " files, " << p.bytes_read
      << " bytes)\n"
      << std::defaultfloat;
}

}  // namespace lossverify::dump
