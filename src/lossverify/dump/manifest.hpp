#pragma once
// The dump manifest ("lossverify.dump/1"): what a training step's dump holds and where. It gives the loss
// configuration (the case file's own `loss`, `framework` and `tolerances` sections, parsed by the same
// code so the semantics are identical to `run`), the global shape and dtype, the layout, and per rank its
// coordinates, vocabulary columns, the global token positions of its rows (micro-batch by micro-batch) and
// the files and tensor names of what it dumped. Parsing is strict and opens no file: unknown keys,
// impossible layouts, missing or duplicated ranks, overlapping vocabulary shards, tokens held twice or never
// and tensor files outside the manifest's folder are errors naming the manifest and the JSON path (exit
// code 2). The last is the one check that looks at the file system (it resolves symlinks).
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/layout/vocab_range.hpp"

namespace lossverify::dump {

inline constexpr const char* kManifestFormat = "lossverify.dump/1";

// A tensor in a file: safetensors key, or the whole .npy file (empty name).
struct TensorRef {
  std::string file;            // resolved against the manifest's folder: the path to open, printable() to show
  std::string name;            // safetensors key; empty for .npy
  std::string json_path;       // where the manifest names it, for messages
  std::string file_json_path;  // where it names the file: json_path + ".file", or the rank's "$.ranks[i].file"
};

// A logged scalar: given inline in the manifest or as a one-element tensor.
struct ScalarSpec {
  enum class Kind { absent, inline_value, tensor } kind = Kind::absent;
  double value = 0.0;
  TensorRef ref;
  std::string json_path;
};

// The per-row tensors of one micro-batch (keys of a "tensors" object); a kind adds its per-token inputs
// (the kind's token_inputs()), "token_" + each of its per-token quantities (the kind's token_quantities()) and its
// scope values (scope_values_name(): a router's "counts", one value per column of a row).
inline constexpr const char* kRowTensors[] = {"logits",     "grad_logits",    "labels",     "loss_mask",
                                              "token_loss", "teacher_logits", "grad_output"};
inline std::string token_quantity_tensor(const std::string& quantity) { return "token_" + quantity; }

// A case with a stage in front of its kind (an LM head): its own inputs (Stage::inputs) and gradients go in the dump
// under their names: those with a row per token ("h") and the stage's gradients of them ("dh") beside the micro-batch's
// tensors, those of the rank's vocabulary shard ("W", "b") and its parameter gradients ("dW", "db") in the rank's
// "stage" object. A stage that makes the logits from its inputs takes no "logits", one that keeps the logits' gradient
// internal no "grad_logits".
std::vector<std::string> stage_row_tensors(const Case& c);
std::vector<std::string> stage_rank_tensors(const Case& c);

struct MicroBatchSpec {
  std::vector<std::int64_t> rows;  // global token per local row; -1 for a padding row
  std::map<std::string, TensorRef> tensors;
  std::string json_path;
};

struct RankSpec {
  int manifest_index = 0;  // position in $.ranks
  int world_rank = 0;      // (dp * CP + cp) * TP + tp
  RankCoordinates coordinates;
  VocabRange vocab;
  std::vector<MicroBatchSpec> micro_batches;  // GA of them
  ScalarSpec loss;                            // the logged (reduced) loss
  ScalarSpec num_tokens;                      // the logged valid-token count
  std::vector<ScalarSpec> statistics;         // the kind's logged statistics (the kind's logged_statistics())
  std::map<std::string, TensorRef> stage;     // the stage's tensors of the rank's shard (stage_rank_tensors)
  std::string json_path;
  std::int64_t row_count() const;
  std::string describe() const;  // "rank 3 (tp=1 cp=0 dp=1, $.ranks[3])"
};

// Which optional quantities the dump holds (all ranks alike).
struct Dumped {
  bool token_loss = false;
  bool loss = false;
  bool num_tokens = false;
  bool loss_mask = false;
  bool grad_output = false;
  std::vector<char> token_quantities;  // per the kind's token_quantities(): its "token_" tensor
  std::vector<char> statistics;        // per the kind's logged_statistics(): its value in "stats"
  bool scope_values = false;           // the kind's scope values (a router's "counts") per micro-batch
};

struct Manifest {
  std::string path;       // the manifest file, printable: for messages and reports
  std::string directory;  // relative tensor paths resolve here (as given: a path to open)
  std::string implementation = "dump";
  Case the_case;                        // loss, shape, dtype, layout, framework, tolerances; batch from cu_seqlens
  std::optional<TensorRef> cu_seqlens;  // a tensor to read; inline cu_seqlens are already in the case
  std::vector<RankSpec> ranks;          // in world-rank order
  // The precision the logged loss carries, as the dump declares it ("logged_loss_precision"): a bf16 loss
  // logged with .float() or .item() is stored wider than it was computed.
  std::optional<DType> logged_loss_precision;
  Dumped dumped;
  // Per global token: the world rank of the first TP rank of the group holding it, its micro-batch and
  // its row inside that micro-batch's tensors.
  std::vector<std::int32_t> token_rank;
  std::vector<std::int32_t> token_micro_batch;
  std::vector<std::int64_t> token_row;
};

struct ManifestLimits {
  std::int64_t max_rows = std::int64_t{1} << 26;  // rows of all ranks together, padding included
  // Tensor files may lie outside the manifest's folder (check-dump --allow-outside-dump). Otherwise every
  // tensor file the manifest names, symlinks resolved, must lie inside the folder, symlinks resolved too.
  bool allow_outside_folder = false;
};

// Parse and validate a manifest document. `path` names it in messages and fixes the folder that relative
// tensor paths resolve against (and that tensor files must lie in, unless limits allow otherwise).
Manifest parse_manifest(const nlohmann::json& document, const std::string& path, const ManifestLimits& limits = {});
// Reads the file (strict JSON) and parses it.
Manifest load_manifest(const std::string& path, const ManifestLimits& limits = {});
// Sequence lengths from cu_seqlens offsets 0 = c_0 <= ... <= c_k = n (empty sequences dropped); DumpError
// prefixed with `where` otherwise.
std::vector<std::int64_t> sequence_lengths_from_cu_seqlens(const std::vector<std::int64_t>& offsets, std::int64_t n,
                                                           const std::string& where);
// Strict JSON text of a manifest: duplicate keys rejected too.
nlohmann::json parse_manifest_text(const std::string& text, const std::string& path);

}  // namespace lossverify::dump
