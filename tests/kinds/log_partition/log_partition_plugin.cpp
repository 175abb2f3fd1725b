// The log-partition kind as a native plugin (include/lossverify/plugin.h): it has no lv_loss_kind code, so the plugin
// names the kind (lossverify_plugin_names) and its setting "sharpness", which it reads from lv_rank_inputs.settings.
// Host memory, float32 logits; TP all-reduces of each row's maximum and sum, the logged loss over DP x CP.
// LOG_PARTITION_PLUGIN_KIND_ONLY builds it as a plugin from before the setting: it names the kind alone.
#include <lossverify/plugin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

int fail(lv_rank_outputs* out, const char* message) {
  std::snprintf(out->error, sizeof out->error, "%s", message);
  return 1;
}

int run_rank(const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* comm) {
  if (in->dtype != LV_DTYPE_F32) return fail(out, "this test plugin reads float32 logits only");
  if (in->struct_size < offsetof(lv_rank_inputs, settings_count) + sizeof in->settings_count ||
      std::strcmp(in->loss_kind, "log_partition") != 0) {
    return fail(out, "not a log_partition case");
  }
  const lv_setting* sharpness = lv_find_setting(in, "sharpness");
  const float beta = sharpness != nullptr ? static_cast<float>(sharpness->number) : 1.0f;
  const int64_t rows = in->rows, cols = in->vocab_end - in->vocab_begin;
  const auto* x = static_cast<const float*>(in->logits);
  auto* g = static_cast<float*>(out->grad);
  std::vector<float> max(rows, -INFINITY), sum(rows, 0.0f);
  for (int64_t i = 0; i < rows; ++i) {
    if (in->loss_mask[i] == 0) continue;
    for (int64_t v = 0; v < cols; ++v) max[i] = std::max(max[i], beta * x[i * cols + v]);
  }
  if (comm->allreduce(comm->context, LV_GROUP_TP, max.data(), rows, LV_ELEMENT_F32, LV_REDUCE_MAX) != 0) return 1;
  for (int64_t i = 0; i < rows; ++i) {
    if (in->loss_mask[i] == 0) continue;
    for (int64_t v = 0; v < cols; ++v) sum[i] += std::exp(beta * x[i * cols + v] - max[i]);
  }
  if (comm->allreduce(comm->context, LV_GROUP_TP, sum.data(), rows, LV_ELEMENT_F32, LV_REDUCE_SUM) != 0) return 1;
  // The rank back-propagates each row's weight in L divided by the framework's factor (plugin.h).
  double factor = 1.0;
  if (in->framework.grad_reduce_avg != 0) factor /= static_cast<double>(in->dp_size) * in->cp_size;
  if (in->framework.ga_reduce_mean != 0) factor /= in->ga;
  double logged = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    if (in->loss_mask[i] == 0) continue;
    const float log_sum = std::log(sum[i]);
    const float loss = (max[i] + log_sum) / beta;
    out->token_loss[i] = loss;
    double weight = 1.0;
    if (in->loss.reduction == LV_REDUCTION_MEAN) weight = 1.0 / static_cast<double>(in->global_valid_tokens);
    if (in->loss.reduction == LV_REDUCTION_NONE) weight = in->upstream_weights[i];
    logged += weight * loss;
    const auto backward = static_cast<float>(weight / factor);
    for (int64_t v = 0; v < cols; ++v)
      g[i * cols + v] = backward * std::exp((beta * x[i * cols + v] - max[i]) - log_sum);
  }
  if (in->tp != 0) logged = 0.0;  // every TP rank holds the same rows: count them once
  double total[1] = {logged};
  if (comm->allreduce(comm->context, LV_GROUP_DP_CP, total, 1, LV_ELEMENT_F64, LV_REDUCE_SUM) != 0) return 1;
  if (comm->allreduce(comm->context, LV_GROUP_TP, total, 1, LV_ELEMENT_F64, LV_REDUCE_SUM) != 0) return 1;
  out->grad_rows = rows;
  out->grad_columns = cols;
  out->token_loss_count = rows;
  out->has_logged_loss = in->loss.reduction == LV_REDUCTION_NONE ? 0 : 1;
  out->logged_loss = total[0];
  out->logged_num_tokens = in->global_valid_tokens;
  return 0;
}

#ifdef LOG_PARTITION_PLUGIN_KIND_ONLY
const char* const kNames[] = {"log_partition", nullptr};
#else
const char* const kNames[] = {"log_partition", "log_partition.sharpness", nullptr};
#endif

const lv_plugin kPlugin = {LV_PLUGIN_ABI_VERSION,
                           "log-partition",
                           "the test kind log_partition, named by string",
                           LV_MEMORY_HOST,
                           0u,
                           run_rank,
                           nullptr};

}  // namespace

extern "C" const lv_plugin* lossverify_plugin(void) { return &kPlugin; }
extern "C" const char* const* lossverify_plugin_names(void) { return kNames; }
