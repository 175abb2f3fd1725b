/* lossverify plugin ABI: a shared library that computes one rank's sharded loss, judged by lossverify.
 *
 *   lossverify run CASE.json --impl plugin:./libmy_loss.so[?PARAMS]
 *
 * lossverify loads the library, calls lossverify_plugin() once, and for every rank of the case's layout
 * calls run_rank() with the rank's own copy of its inputs (the float64 reference never reads memory a plugin
 * could write) and a table of collectives over the rank's TP, CP, DP and DP x CP groups (threads, MPI
 * processes or NCCL underneath). The plugin returns the rank's per-row losses, its logged loss and token
 * count, and the gradient of its logits shard; lossverify compares every element with the float64 reference
 * exactly as it compares its own kernels (docs/spec.md: the layouts, the framework model, the checks).
 *
 * What a rank computes (the same contract as lossverify's built-in kernels and a dump's tensors):
 *   - token_loss[i]: the loss of local row i as it enters the reduction, unweighted (0 on rows whose
 *     loss_mask is 0, CP padding included);
 *   - grad: d(local objective)/d(logits) of the rank's shard, as autograd would give it, where the local
 *     objective is what the rank back-propagates. The effective gradient, grad x framework factor
 *     (grad_reduce avg: 1/(DP*CP); ga_reduce mean: 1/GA), must equal dL/dx of the global objective L
 *     (mean: sum over valid tokens / N_v; sum; none: sum of upstream_weights[t] * loss[t]);
 *   - logged_loss: L as the rank would log it (every rank the same global value; none: not logged);
 *   - logged_num_tokens: N_v, the global count of rows whose loss_mask is 1.
 * Rows of micro-batch k are [micro_batch_begin[k], micro_batch_begin[k+1]); each micro-batch is one
 * forward/backward of the rank, and its gradient rows are the rank's gradient for those rows.
 *
 * Parameters: PARAMS, the text after '?', is the plugin's own (the examples take '&'-separated key=value
 * items, e.g. "bug=smoothing-partition-vocab"). check_params, when set, vets it once at load time, so a bad
 * parameter is a usage error (exit code 2) before any rank runs.
 *
 * CUDA plugins: link the shared CUDA runtime (nvcc -cudart shared), as lossverify does: one runtime in the
 * process. Inputs are in device memory when run_rank is called, and an all-reduce's result is in device
 * memory when allreduce returns (lossverify synchronizes its copies). Before calling allreduce, and before
 * returning from run_rank, finish the work that produces the data (lossverify copies on the legacy default
 * stream, which does not wait for non-blocking streams).
 *
 * The policy loss (LV_LOSS_POLICY, docs/spec.md §3.3): the same per-row loss, gradient, logged loss and count
 * under the aggregation of inputs->policy (token_loss[i] = l_t, the objective's gradient with each token's
 * aggregation weight), plus each row's log-probability and entropy (outputs->token_values) and the logged
 * statistics (outputs->logged_statistics). Its settings and per-row inputs come at the end of lv_rank_inputs.
 *
 * Versioning: abi_version must equal LV_PLUGIN_ABI_VERSION of the lossverify that loads the plugin, or the
 * load fails (exit code 2) naming both versions. Structures only grow at the end within one version: the
 * policy loss's fields were appended to lv_rank_inputs and lv_rank_outputs within version 1 (they are not in
 * lv_loss_config, which sits in the middle of lv_rank_inputs: growing it would move the fields after it), so
 * a plugin built before them loads and runs as it did, reading and writing only the prefix it knows.
 * lossverify runs a loss kind only on a plugin whose `losses` has its bit: a plugin built before the policy
 * loss cannot have set LV_SUPPORTS_POLICY, so it is never handed a policy case (run: exit code 2 naming it;
 * gate: not run), and lossverify reads the policy outputs only of a plugin that declares it. Likewise a setting
 * added later (policy_ratio, appended after the policy fields) reaches only a plugin that sets its capability
 * bit (LV_SUPPORTS_POLICY_SEQUENCE_RATIO): one built before it is never handed ratio sequence. Then the kind's name
 * and all its settings as one self-describing block (loss_kind, settings), appended within v1 with the optional
 * lossverify_plugin_names() symbol: every later setting travels there only (lv_find_setting). struct_size is
 * the size lossverify passes; a plugin that needs appended fields checks it (examples/plugins does). The LM head
 * stage's inputs and outputs were appended the same way, behind LV_SUPPORTS_LM_HEAD: a plugin built before them is
 * never handed a case with a stage (run: exit 2 naming it; gate: not run).
 * Where it runs: in a plugin host, a child process of lossverify (lossverify-plugin-host) that loads the library
 * and serves the rank's calls; inputs and outputs are in memory shared with lossverify. lossverify takes a rank's
 * outputs only when run_rank has returned: an exit(), _exit(), quick_exit() or a crash anywhere in the plugin
 * (static constructors, lossverify_plugin, check_params, run_rank, a thread it started) ends the host, and the
 * run fails with exit code 3 naming the plugin, the rank and when (docs/plugins.md, "Faults").
 * Errors: return nonzero from run_rank with a message in outputs->error (exit code 3, naming the plugin and
 * the rank). Sizes written must match: grad_rows x grad_columns and token_loss_count are checked, and a write
 * before or past an output buffer is detected. After run_rank returns, the collectives table refuses every
 * call (group_size and group_rank return -1, allreduce nonzero), and a late all-reduce fails the run.
 */
#ifndef LOSSVERIFY_PLUGIN_H
#define LOSSVERIFY_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LV_PLUGIN_ABI_VERSION 1u

/* Element types of logits and gradients (the case's input dtype; gradients are written in it too). */
/* clang-format off: the field comments are aligned by hand */
typedef enum lv_dtype { LV_DTYPE_F32 = 0, LV_DTYPE_BF16 = 1, LV_DTYPE_F16 = 2 } lv_dtype;

/* Where a plugin wants its inputs and outputs. LV_MEMORY_CUDA: device memory of the GPU `device`
 * (cudaSetDevice has been called on the calling thread). */
typedef enum lv_memory { LV_MEMORY_HOST = 0, LV_MEMORY_CUDA = 1 } lv_memory;

/* LV_LOSS_BY_NAME: a kind with no code of its own here; lv_rank_inputs.loss_kind names it. */
typedef enum lv_loss_kind {
  LV_LOSS_CROSS_ENTROPY = 0,
  LV_LOSS_KD = 1,
  LV_LOSS_POLICY = 2,
  LV_LOSS_BY_NAME = 15
} lv_loss_kind;
/* Bits of lv_plugin.losses. */
#define LV_SUPPORTS_CROSS_ENTROPY (1u << LV_LOSS_CROSS_ENTROPY)
#define LV_SUPPORTS_KD (1u << LV_LOSS_KD)
#define LV_SUPPORTS_POLICY (1u << LV_LOSS_POLICY) /* reads lv_rank_inputs.policy, writes token values, statistics */
/* Capabilities beyond a loss kind (bits from 16 up; the kinds' bits, 1 << lv_loss_kind, stay below): a case whose
 * settings need one is given only to a plugin that sets it (run: exit 2 naming the setting; gate: not run). */
#define LV_SUPPORTS_POLICY_SEQUENCE_RATIO (1u << 16) /* the policy loss's lv_rank_inputs.policy_ratio sequence */
#define LV_SUPPORTS_LM_HEAD (1u << 17) /* an LM head in front of cross-entropy or KD: lv_rank_inputs.head_* (host) */

/* Who sums a vocab-parallel head's dh over TP (the case's stage.dh_reduce). */
typedef enum lv_head_dh_reduce { LV_HEAD_DH_HEAD = 0, LV_HEAD_DH_FRAMEWORK = 1 } lv_head_dh_reduce;

typedef enum lv_reduction { LV_REDUCTION_MEAN = 0, LV_REDUCTION_SUM = 1, LV_REDUCTION_NONE = 2 } lv_reduction;

/* Label smoothing with alpha: pytorch q = (1-a)[v=l] + a/V; megatron q = (1-a)[v=l] + a/(V-1)[v!=l]. */
typedef enum lv_smoothing_convention { LV_SMOOTHING_PYTORCH = 0, LV_SMOOTHING_MEGATRON = 1 } lv_smoothing_convention;

typedef struct lv_loss_config {
  lv_loss_kind kind;
  lv_reduction reduction;
  /* cross-entropy */
  double label_smoothing;
  lv_smoothing_convention smoothing_convention;
  double z_loss_weight; /* loss += w_z lse^2 */
  double softcap;       /* > 0: logits become c tanh(x / c) */
  int64_t ignore_index; /* labels of rows that do not count */
  /* KD: k = T^s KL(softmax(teacher / T) || softmax(student / T)), s = 2 when t2_scaling */
  double temperature;
  int32_t t2_scaling;
} lv_loss_config;

/* The policy loss (RL post-training; docs/spec.md §3.3), per token t with log-probability lambda = log
 * softmax(x / T)_y, entropy H of softmax(x / T), ratio rho = exp(lambda - old_logprob) and advantage A (whitened
 * when whiten_advantages):
 *   l_t = max(-rho A, -clip(rho, 1 - clip_low, 1 + clip_high) A), capped at -dual_clip A where A < 0 (dual_clip
 *         > 0), + kl_coef KL_t - entropy_coef H_t, KL_t with d = lambda - ref_logprob: k1 d, k2 d^2 / 2,
 *         k3 e^-d + d - 1;
 *   objective logprob (a trainer's log-prob pass): l_t = -lambda - entropy_coef H_t.
 * L = sum_t w_t m_t l_t over the step (DP x CP x GA), with N = sum m_t, B the sequences with n_s > 0 and n_s a
 * sequence's valid tokens (all its CP chunks): token-mean w = 1/N, token-sum 1, seq-mean-token-sum 1/B,
 * seq-mean-token-mean 1/(B n_s), seq-mean-token-sum-norm 1/(B norm_constant). Whitening: A' = (A - mu) /
 * (sigma + whiten_epsilon), mu and the unbiased sigma over the step's valid tokens (DP x CP). */
typedef enum lv_policy_objective { LV_POLICY_OBJECTIVE_LOSS = 0, LV_POLICY_OBJECTIVE_LOGPROB = 1 } lv_policy_objective;
typedef enum lv_kl_penalty { LV_KL_NONE = 0, LV_KL_K1 = 1, LV_KL_K2 = 2, LV_KL_K3 = 3 } lv_kl_penalty;
typedef enum lv_aggregation {
  LV_AGGREGATION_TOKEN_MEAN = 0,
  LV_AGGREGATION_TOKEN_SUM = 1,
  LV_AGGREGATION_SEQ_MEAN_TOKEN_SUM = 2,
  LV_AGGREGATION_SEQ_MEAN_TOKEN_MEAN = 3,
  LV_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM = 4 /* Dr. GRPO */
} lv_aggregation;

/* The importance ratio of the clipped surrogate: each token's own, rho_t = exp(lambda_t - old_t), or GSPO's per
 * sequence, rho_s = exp((1/n_s) sum over the sequence's valid tokens t, all its CP chunks, of (lambda_t - old_t)),
 * which every valid token of s uses in place of its own (in the surrogate and the clip statistics). The gradient is
 * L's true derivative: the surrogate's part of dL/dlambda_u is (rho_s / n_s) Q_s, Q_s = sum over the valid t of s
 * (all its CP chunks) of w_t (-A_t) [t's unclipped term is the one taken]; the KL and entropy terms stay per token. */
typedef enum lv_policy_ratio { LV_POLICY_RATIO_TOKEN = 0, LV_POLICY_RATIO_SEQUENCE = 1 } lv_policy_ratio;

typedef struct lv_policy_config {
  lv_policy_objective objective;
  double temperature; /* T > 0 (lv_loss_config.temperature carries the same value) */
  double clip_low;    /* epsilon_low in (0, 1) */
  double clip_high;   /* epsilon_high > 0 */
  double dual_clip;   /* c > 1; 0: off */
  lv_kl_penalty kl_penalty;
  double kl_coef;      /* beta */
  double entropy_coef; /* c_H */
  lv_aggregation aggregation;
  double norm_constant;      /* H_max of seq-mean-token-sum-norm; 0 otherwise */
  int32_t whiten_advantages; /* 1: whiten over the step's valid tokens (DP x CP) */
  double whiten_epsilon;     /* delta */
} lv_policy_config;

/* The policy loss's per-row values (lv_rank_outputs.token_values, its columns) and logged statistics
 * (lv_rank_outputs.logged_statistics), each statistic the global token-mean over the step's valid tokens,
 * sum_t m_t s_t / N, the same on every rank. [clipped] is 1 where the clipped term is strictly the larger,
 * [dual_clipped] where the dual clip caps it; under objective logprob both are 0, as is KL without a penalty. */
enum { LV_POLICY_VALUE_LOGPROB = 0, LV_POLICY_VALUE_ENTROPY = 1, LV_POLICY_VALUES = 2 };
enum {
  LV_POLICY_STAT_CLIP_FRACTION = 0,
  LV_POLICY_STAT_DUAL_CLIP_FRACTION = 1,
  LV_POLICY_STAT_KL = 2,
  LV_POLICY_STAT_ENTROPY = 3,
  LV_POLICY_STATS = 4
};
#define LV_MAX_LOGGED_STATISTICS 8

/* One setting of the case's kind (lv_rank_inputs.settings): its key in the case's "loss" section and its value
 * as the case resolves it (a setting that does not apply to the case holds its fallback). */
typedef enum lv_setting_type {
  LV_SETTING_NUMBER = 0,  /* number */
  LV_SETTING_INTEGER = 1, /* integer (number holds it too) */
  LV_SETTING_BOOLEAN = 2, /* integer 0 or 1 (number too) */
  LV_SETTING_CHOICE = 3   /* choice: the value's name, e.g. "megatron" */
} lv_setting_type;
typedef struct lv_setting {
  const char* name;
  lv_setting_type type;
  double number;
  int64_t integer;
  const char* choice; /* "" unless LV_SETTING_CHOICE */
} lv_setting;

/* How the framework combines rank gradients (the effective gradient is grad x this model's factor). */
typedef struct lv_framework {
  int32_t grad_reduce_avg; /* 1: averaged over DP x CP (DDP/FSDP); 0: summed */
  int32_t ga_reduce_mean;  /* 1: micro-batch gradients averaged; 0: summed */
} lv_framework;

/* The groups a rank communicates in. TP: same tokens, other vocabulary columns (a kind with whole rows: the same tokens
 * replicated, or under sequence parallelism the other parts of them). CP: same DP rank, other sequence chunks. DP: same
 * TP and CP coordinates. DP_CP: every rank holding other tokens (same TP rank; every rank under sequence
 * parallelism). */
typedef enum lv_group { LV_GROUP_TP = 0, LV_GROUP_CP = 1, LV_GROUP_DP = 2, LV_GROUP_DP_CP = 3 } lv_group;
typedef enum lv_element { LV_ELEMENT_F32 = 0, LV_ELEMENT_F64 = 1, LV_ELEMENT_I64 = 2 } lv_element;
typedef enum lv_reduce_op { LV_REDUCE_SUM = 0, LV_REDUCE_MAX = 1 } lv_reduce_op;

typedef struct lv_collectives {
  void* context; /* pass back unchanged */
  /* In-place all-reduce of `count` elements at `data`, which lives in the plugin's declared memory. Every
   * rank of the group must call it with the same count, element and op. Results are reduced in rank order,
   * so they are the same on every rank and from run to run. Device memory is copied through the host with
   * synchronous copies on the legacy default stream: finish the work that produces `data` first.
   * Returns 0; nonzero when the run is failing (another rank failed, the deadlock guard fired): the plugin
   * should then return nonzero from run_rank at once. */
  int (*allreduce)(void* context, lv_group group, void* data, int64_t count, lv_element element, lv_reduce_op op);
  int (*group_size)(void* context, lv_group group);
  int (*group_rank)(void* context, lv_group group);
} lv_collectives;

typedef struct lv_rank_inputs {
  size_t struct_size; /* sizeof(lv_rank_inputs) of the lossverify that calls */
  /* coordinates */
  int32_t world_rank, world_size;
  int32_t tp, cp, dp;                /* this rank's coordinates */
  int32_t tp_size, cp_size, dp_size; /* the layout */
  int32_t ga;                        /* micro-batches */
  /* the shard */
  int64_t vocab_size;               /* V, the global vocabulary */
  int64_t vocab_begin, vocab_end;   /* this rank's columns [begin, end) */
  int64_t rows;                     /* local rows of all micro-batches, CP padding included */
  const int64_t* micro_batch_begin; /* ga + 1 offsets into the rows; host memory */
  int64_t global_valid_tokens;      /* N_v, as a framework's loader counts it before the step */
  lv_dtype dtype;
  lv_memory memory; /* where the arrays below live (the plugin's declared memory) */
  int32_t device;   /* CUDA device ordinal when memory is LV_MEMORY_CUDA, else -1 */
  /* Arrays are never NULL for the losses they belong to (a rank with no rows gets valid empty arrays). The
   * plugin may scribble on them: they are its own copies, and the reference never reads them. */
  const void* logits;             /* rows x (vocab_end - vocab_begin), row major, in dtype */
  const void* teacher_logits;     /* KD: as logits; NULL for cross-entropy */
  const int64_t* labels;          /* rows: the global label, or ignore_index (ignored, masked, padding) */
  const uint8_t* loss_mask;       /* rows: 1 when the row counts in the loss */
  const double* upstream_weights; /* rows: g_t of reduction none, 1 otherwise, 0 on padding rows */
  const int64_t* tokens;          /* rows: the global token, -1 on CP padding rows */
  lv_loss_config loss;
  lv_framework framework;
  const char* params; /* the text after '?' in --impl plugin:PATH?PARAMS; "" when none */
  /* ---- Appended for the policy loss (within version 1: struct_size covers them; a plugin built before them
   * never reads them). Set for every loss; the arrays live in the plugin's declared memory. */
  int64_t num_sequences;    /* sequences in the global step */
  const int64_t* sequences; /* rows: the row's sequence in the step, [0, num_sequences) (CP padding too) */
  lv_policy_config policy;  /* LV_LOSS_POLICY: the settings; zero for other losses */
  /* Per row, float32, as export-inputs writes them: 0 on CP padding rows, and all 0 under objective logprob or
   * for other losses. A masked row keeps only its sequence's advantage. */
  const float* old_logprob; /* the rollout policy's log-probability of the row's label */
  const float* ref_logprob; /* the reference policy's, for the KL penalty */
  const float* advantages;  /* the row's (sequence's) advantage BEFORE whitening */
  /* ---- Appended for the policy loss's ratio (within version 1; lv_policy_config cannot grow in place). A plugin
   * is given LV_POLICY_RATIO_SEQUENCE only when it sets LV_SUPPORTS_POLICY_SEQUENCE_RATIO. */
  int32_t policy_ratio; /* lv_policy_ratio; LV_POLICY_RATIO_TOKEN for every other loss and objective */
  /* ---- Appended for kinds named by string and settings carried whole (within version 1). Set for every loss;
   * host memory, read-only, valid during run_rank. Every setting of the kind is here, those of the structures above
   * too; a setting added to a kind later reaches plugins only here (lv_find_setting), and at a value other than its
   * fallback only a plugin that names it (LV_PLUGIN_NAMES_ENTRY_POINT). */
  const char* loss_kind;      /* loss.kind: "cross_entropy", "kd", "policy" or a kind without an lv_loss_kind */
  const lv_setting* settings; /* the kind's settings in the order of its table (docs/cases.md) */
  int64_t settings_count;
  /* ---- Appended for kinds whose rows are whole on every rank (within version 1; a router's). vocab_begin is then 0
   * and vocab_end vocab_size on every rank, and TP either replicates the tokens (0) or, under layout.sp (1), splits
   * each CP rank's tokens: the TP group then holds the other parts of this rank's micro-batches, and DP_CP is every
   * rank of the world (every rank holds other tokens). */
  int32_t sequence_parallel;
  /* ---- Appended for the LM head stage (within version 1; docs/plugins.md, "The LM head"). A case with "stage":
   * {"kind": "lm_head"} reaches only a plugin that sets LV_SUPPORTS_LM_HEAD; for every other case head_hidden is 0
   * and the arrays are NULL. Under a head, `logits` is NULL: the plugin makes the kind's logits itself, u = h W_r^T
   * (+ b_r) over the rank's columns, runs the kind on u exactly as on logits, and from the kind's gradient g of u
   * (never judged: it stays inside a fused head; `grad` may hold it) returns dh = g W_r, its dW_r = sum_t g_t^T h_t
   * and db_r = sum_t g_t over its rows of all micro-batches, in the head's outputs of lv_rank_outputs. In the declared
   * memory (as logits), in dtype, read-only; head_dh_row_index is host memory. */
  int64_t head_hidden;          /* H; 0: no head */
  int32_t head_bias;            /* 1: the head adds b */
  int32_t head_dh_reduce;       /* lv_head_dh_reduce: the head sums dh over TP, or each rank returns its partial */
  const void* hidden_states;    /* rows x H: h of every local row (0 on CP padding), under sequence parallelism as
                                   all-gathered over TP */
  const void* head_weight;      /* (vocab_end - vocab_begin) x H: W's rows of the rank's columns */
  const void* head_bias_values; /* vocab_end - vocab_begin: b's (zeros without a bias) */
  /* The local rows whose dh the rank returns, in order: every row, or under sequence parallelism with
   * LV_HEAD_DH_HEAD the rank's token shard of each micro-batch (the reduce-scatter's part: sum dh over TP, keep
   * these rows). */
  int64_t head_dh_rows;
  const int64_t* head_dh_row_index;
} lv_rank_inputs;

typedef struct lv_rank_outputs {
  size_t struct_size; /* sizeof(lv_rank_outputs) of the lossverify that calls */
  /* Both zero-filled. Rows whose loss_mask is 0 must end exactly zero (leave them or write zeros). */
  void* grad;        /* rows x columns in dtype, in the declared memory */
  float* token_loss; /* rows float32 values, in the declared memory */
  /* Set by the plugin: */
  int64_t grad_rows, grad_columns; /* what it wrote: must be rows and vocab_end - vocab_begin */
  int64_t token_loss_count;        /* must be rows */
  int32_t has_logged_loss;         /* 0 for reduction none */
  double logged_loss;
  int64_t logged_num_tokens;
  char error[1024]; /* a message when run_rank returns nonzero (NUL-terminated) */
  /* ---- Appended for the policy loss (within version 1). lossverify reads them only for a loss whose kind has
   * per-row values or statistics (the policy loss), which only a plugin declaring LV_SUPPORTS_POLICY is given. */
  float* token_values; /* rows x LV_POLICY_VALUES float32, row major, zero-filled, in the declared memory: each
                          row's log-probability and entropy at T (0 where loss_mask is 0); empty otherwise */
  int64_t token_value_rows, token_value_columns;      /* set by the plugin: rows and LV_POLICY_VALUES */
  double logged_statistics[LV_MAX_LOGGED_STATISTICS]; /* [LV_POLICY_STAT_*], as the rank logs them */
  int32_t logged_statistics_count;                    /* set by the plugin: LV_POLICY_STATS */
  /* ---- Appended for the router (within version 1). A kind that judges values per micro-batch scope (a router's
   * counts per expert of each layer, as the rank holds them after their all-reduce) gets ga x (vocab_end -
   * vocab_begin) zero-filled doubles here, in the declared memory, micro-batch after micro-batch (NULL and 0 for
   * other kinds); the plugin sets scope_value_count to what it wrote, or leaves 0 (the check is then not
   * applicable). */
  double* scope_values;
  int64_t scope_value_count;
  /* ---- Appended for the LM head stage (within version 1; NULL and unread without a head). Zero-filled, in dtype,
   * in the declared memory; the plugin sets each count to the elements it wrote (checked). */
  void* head_dh; /* head_dh_rows x head_hidden, row i the dh of local row head_dh_row_index[i] */
  void* head_dw; /* (vocab_end - vocab_begin) x head_hidden: the rank's dW_r */
  void* head_db; /* vocab_end - vocab_begin: the rank's db_r (NULL without a bias) */
  int64_t head_dh_count, head_dw_count, head_db_count;
} lv_rank_outputs;

typedef struct lv_plugin {
  uint32_t abi_version;    /* LV_PLUGIN_ABI_VERSION */
  const char* name;        /* short name for reports */
  const char* description; /* one line: what it implements */
  lv_memory memory;        /* where run_rank wants its inputs and outputs */
  uint32_t losses;         /* LV_SUPPORTS_* bits; other losses are refused (run: exit 2; gate: not run) */
  /* Called once per rank, concurrently from several threads (thread ranks) or once per process (MPI).
   * Returns 0 on success. */
  int (*run_rank)(const lv_rank_inputs* inputs, lv_rank_outputs* outputs, const lv_collectives* collectives);
  /* Optional (NULL: any PARAMS is accepted): returns 0 when PARAMS is one the plugin understands, else
   * nonzero with a message in error (error_size bytes, NUL-terminated). */
  int (*check_params)(const char* params, char* error, size_t error_size);
} lv_plugin;

/* The symbol lossverify looks up. The returned object must live as long as the library is loaded. */
#define LV_PLUGIN_ENTRY_POINT "lossverify_plugin"
typedef const lv_plugin* (*lv_plugin_entry)(void);

/* Optional, beside lossverify_plugin: what the plugin computes beyond the bits of lv_plugin.losses, as a
 * NULL-terminated array of names (living as long as the library): a kind by its name ("log_partition"), or a setting
 * as "kind.key" ("policy.ratio"). A kind is handed to a plugin that sets its bit or names it; a setting that is not
 * in the v1 structures reaches a plugin at a value other than its fallback only when the plugin names it (or sets
 * the setting's capability bit), else run refuses the case (exit 2, naming the setting) and the gate skips it. */
#define LV_PLUGIN_NAMES_ENTRY_POINT "lossverify_plugin_names"
typedef const char* const* (*lv_plugin_names_entry)(void);

/* The setting named `name` of the rank's kind, or NULL (a lossverify older than the settings block, or no such
 * setting). */
static inline const lv_setting* lv_find_setting(const lv_rank_inputs* inputs, const char* name) {
  const size_t end = offsetof(lv_rank_inputs, settings_count) + sizeof(inputs->settings_count);
  int64_t i;
  if (inputs->struct_size < end || inputs->settings == NULL) return NULL;
  for (i = 0; i < inputs->settings_count; ++i) {
    const char* a = inputs->settings[i].name;
    const char* b = name;
    while (*a != '\0' && *a == *b) ++a, ++b;
    if (*a == *b) return &inputs->settings[i];
  }
  return NULL;
}

/* The router's expert bias b_le for a case's router.expert_bias beta (docs/spec.md, the routed map): a fixed sequence
 * in [-beta, beta], fl32(beta (2 frac(j phi) - 1)) with j = layer E + expert + 1 and phi = (sqrt 5 - 1) / 2, in
 * float64 as lossverify computes it. */
static inline float lv_router_expert_bias(double beta, int64_t layer, int64_t expert, int64_t experts) {
  const double u = (double)(layer * experts + expert + 1) * 0.6180339887498949;
  return (float)(beta * (2.0 * (u - (double)(int64_t)u) - 1.0));
}
/* clang-format on */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LOSSVERIFY_PLUGIN_H */
