/* A plugin built before the policy loss: compiled against tests/plugins/v1/lossverify/plugin.h, a frozen copy of
 * include/lossverify/plugin.h as it was then (ABI version 1, the shorter lv_rank_inputs and lv_rank_outputs).
 * lossverify grew those structures at their ends within version 1, so this plugin must still load, run and pass
 * cross-entropy exactly as before, and a policy case must be refused naming it (it never sets the policy bit).
 * Vocabulary-parallel cross-entropy with label smoothing in both conventions and every reduction, float32
 * logits in host memory, in float64 over all the rank's rows at once (one max and one sum all-reduce over TP). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "lossverify/plugin.h"

static int fail(lv_rank_outputs* out, const char* what) {
  snprintf(out->error, sizeof out->error, "%s", what);
  return 1;
}

static int row_counts(const lv_rank_inputs* in, int64_t i) {
  return in->loss_mask[i] != 0 && in->labels[i] != in->loss.ignore_index;
}

static int run(const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* c, double* maxima, double* sums) {
  const int64_t rows = in->rows, width = in->vocab_end - in->vocab_begin;
  const float* x = (const float*)in->logits;
  float* grad = (float*)out->grad;
  const double vocab = (double)in->vocab_size, alpha = in->loss.label_smoothing;
  const int megatron = in->loss.smoothing_convention == LV_SMOOTHING_MEGATRON;
  const double q_on = megatron ? 1.0 - alpha : 1.0 - alpha + alpha / vocab;
  const double q_off = megatron ? alpha / (vocab - 1.0) : alpha / vocab;
  double factor = 1.0, logged = 0.0;
  int64_t valid = 0, i, v;
  if (in->framework.grad_reduce_avg) factor /= (double)in->dp_size * in->cp_size;
  if (in->framework.ga_reduce_mean) factor /= in->ga;
  for (i = 0; i < rows; ++i) valid += row_counts(in, i);
  if (c->allreduce(c->context, LV_GROUP_DP_CP, &valid, 1, LV_ELEMENT_I64, LV_REDUCE_SUM) != 0)
    return fail(out, "all-reduce failed");
  for (i = 0; i < rows; ++i) {
    maxima[i] = -INFINITY;
    for (v = 0; row_counts(in, i) && v < width; ++v) maxima[i] = fmax(maxima[i], x[i * width + v]);
  }
  if (c->allreduce(c->context, LV_GROUP_TP, maxima, rows, LV_ELEMENT_F64, LV_REDUCE_MAX) != 0)
    return fail(out, "all-reduce failed");
  for (i = 0; i < rows; ++i) { /* [S | sum (x - M) | x_label - M] */
    const int64_t target = in->labels[i] - in->vocab_begin;
    sums[i] = sums[rows + i] = sums[2 * rows + i] = 0.0;
    if (!row_counts(in, i)) continue;
    for (v = 0; v < width; ++v) {
      sums[i] += exp(x[i * width + v] - maxima[i]);
      sums[rows + i] += x[i * width + v] - maxima[i];
    }
    if (target >= 0 && target < width) sums[2 * rows + i] = x[i * width + target] - maxima[i];
  }
  if (c->allreduce(c->context, LV_GROUP_TP, sums, 3 * rows, LV_ELEMENT_F64, LV_REDUCE_SUM) != 0)
    return fail(out, "all-reduce failed");
  for (i = 0; i < rows; ++i) {
    const int64_t target = in->labels[i] - in->vocab_begin;
    const double log_sum = log(sums[i]);
    double weight = 1.0, loss;
    if (!row_counts(in, i)) continue;
    loss = log_sum - (q_off * sums[rows + i] + (q_on - q_off) * sums[2 * rows + i]);
    if (in->loss.reduction == LV_REDUCTION_MEAN) weight = 1.0 / (double)valid;
    if (in->loss.reduction == LV_REDUCTION_NONE) weight = in->upstream_weights[i];
    out->token_loss[i] = (float)loss;
    logged += weight * loss;
    for (v = 0; v < width; ++v) {
      const double p = exp(x[i * width + v] - maxima[i] - log_sum);
      grad[i * width + v] = (float)(weight / factor * (p - (v == target ? q_on : q_off)));
    }
  }
  if (c->allreduce(c->context, LV_GROUP_DP_CP, &logged, 1, LV_ELEMENT_F64, LV_REDUCE_SUM) != 0)
    return fail(out, "all-reduce failed");
  out->grad_rows = rows;
  out->grad_columns = width;
  out->token_loss_count = rows;
  out->has_logged_loss = in->loss.reduction != LV_REDUCTION_NONE;
  out->logged_loss = logged;
  out->logged_num_tokens = valid;
  return 0;
}

static int run_rank(const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* c) {
  double *maxima, *sums;
  int status;
  if (in->struct_size < sizeof(lv_rank_inputs) || out->struct_size < sizeof(lv_rank_outputs))
    return fail(out, "lossverify passed smaller structures than version 1's");
  if (in->loss.kind != LV_LOSS_CROSS_ENTROPY || in->dtype != LV_DTYPE_F32 || in->memory != LV_MEMORY_HOST ||
      in->loss.z_loss_weight != 0.0 || in->loss.softcap > 0.0)
    return fail(out, "this test plugin computes plain cross-entropy on float32 host logits only");
  maxima = malloc((size_t)(in->rows + 1) * sizeof(double));
  sums = malloc((size_t)(3 * in->rows + 1) * sizeof(double));
  status = maxima != NULL && sums != NULL ? run(in, out, c, maxima, sums) : fail(out, "out of memory");
  free(maxima);
  free(sums);
  return status;
}

static const lv_plugin plugin = {LV_PLUGIN_ABI_VERSION,
                                 "v1-cross-entropy",
                                 "test plugin built against ABI version 1 before the policy loss",
                                 LV_MEMORY_HOST,
                                 LV_SUPPORTS_CROSS_ENTROPY,
                                 run_rank,
                                 NULL};

const lv_plugin* lossverify_plugin(void) { return &plugin; }
