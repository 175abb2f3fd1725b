// The policy kind's catalogued bugs (docs/catalogue.md), from the post-training frameworks' record: the
// vocabulary-parallel log-prob and entropy backward, the temperature, the aggregation over micro-batches,
// DP and CP ranks, whitening, vocabulary padding and the KL's gradient. Each sets one bit of
// BugSwitches::kind_switches (policy_parts.hpp).
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kinds/policy/policy_parts.hpp"

namespace lossverify {

std::vector<Implementation> policy_catalogue() {
  const Applies mine = Applies::kind("policy");
  auto bit = [](std::uint64_t b) { return switches_with([b](BugSwitches& s) { s.kind_switches = b; }); };
  std::vector<Implementation> v;
  v.push_back(catalogued_bug(
      "rl-logprob-untracked-allreduce",
      "vocab-parallel log-prob: max, sum-exp and the gathered log-prob all-reduced in place outside autograd, "
      "the local max not detached",
      "the pattern of kd-untracked-allreduce (NVIDIA-NeMo/Automodel #1499) in a vocab-parallel log-prob kernel",
      "non-owner shards get 0 instead of -g p_v; the owner shard g (delta - p_v) plus g (P_r - 1) at its local "
      "argmax: grad fails at tp > 1, each shard's row sum stays 0, log-prob exact",
      {"grad"}, mine, bit(policy_bug::logprob_untracked_allreduce)));
  v.push_back(catalogued_bug(
      "rl-entropy-untracked-allreduce",
      "vocab-parallel entropy: the per-shard partials all-reduced outside autograd, each shard differentiating "
      "its own partial sum",
      "the kd-untracked-allreduce pattern in a vocab-parallel entropy kernel (docs/catalogue.md)",
      "dH/dx_v = -p_v (log p_v + H_r) - p_v (1 - P_r) instead of -p_v (log p_v + H): grad fails at tp > 1 with "
      "entropy_coef > 0; entropy exact",
      {"grad"}, mine, bit(policy_bug::entropy_untracked_allreduce)));
  v.push_back(catalogued_bug(
      "rl-logsoftmax-untracked-allreduce",
      "one vocab-parallel log-softmax, its local max not detached, under both the log-prob and the entropy: max, "
      "sum-exp, the gathered log-prob and the entropy's per-shard partials all-reduced in place outside autograd",
      "modelscope/ms-swift swift/megatron/trainers/vocab_parallel_utils.py compute_logps_and_entropy_from_logits, "
      "at 3602360a",
      "g_lambda [owner shard] (delta - D_v) + g_H (-(1 + log p_v) p_v + D_v (P_r - H_r)), D_v = p_v + "
      "[v = local argmax] (1 - P_r): grad fails at tp > 1, each shard's row sum stays 0, log-prob and entropy "
      "exact",
      {"grad"}, mine, bit(policy_bug::logsoftmax_untracked_allreduce)));
  v.push_back(catalogued_bug("rl-logprob-allgather-grad-sum",
                             "log-probs from a vocabulary all-gather to a replicated tensor, whose backward "
                             "all-reduces the replicated gradient",
                             "pytorch/torchtitan components/loss.py compute_logprobs (#3827)",
                             "the log-prob part of the gradient = TP x reference; loss exact", {"grad"}, mine,
                             bit(policy_bug::logprob_allgather_grad_sum)));
  v.push_back(catalogued_bug("rl-temperature-one-side",
                             "the trainer's log-probs at T = 1 against rollout log-probs at the sampling temperature",
                             "verl #3133, OpenRLHF #857, AReaL #581, ms-swift #8427, slime #557/#2085",
                             "loss, grad, log-prob, entropy and clip fraction wrong; passes at T = 1",
                             {"loss", "grad", "logprob", "entropy", "stats"}, mine,
                             bit(policy_bug::temperature_one_side)));
  v.push_back(catalogued_bug("rl-token-mean-sample-weighted",
                             "token-mean as each micro-batch's token mean weighted by its share of sequences, "
                             "then a DP mean, instead of sum l / N",
                             "verl legacy actor (#5625/#5877), SkyRL #1296, OpenRLHF df78645e",
                             "loss and grad wrong when micro-batches or ranks hold different token counts",
                             {"loss", "grad"}, mine, bit(policy_bug::token_mean_sample_weighted)));
  v.push_back(catalogued_bug("rl-microbatch-self-normalized",
                             "each micro-batch normalised by its own token count, the engine summing micro-batches",
                             "verl #7200 (#7225), #6957", "loss and grad about K x (K micro-batches per rank)",
                             {"loss", "grad"}, mine, bit(policy_bug::microbatch_self_normalized)));
  v.push_back(catalogued_bug(
      "rl-drgrpo-batch-sum", "seq-mean-token-sum-norm multiplied by the micro-batch's sequence count b",
      "verl #3741 (#5366/#5417)", "loss and grad x b", {"loss", "grad"}, mine, bit(policy_bug::drgrpo_batch_sum)));
  v.push_back(catalogued_bug(
      "rl-cp-extra-scale", "the KL and entropy terms scaled by CP, their statistics summed over CP copies",
      "NovaSky-AI/SkyRL #1420, #1751", "KL and entropy gradient x CP, their statistics x CP; passes at cp = 1",
      {"grad", "stats"}, mine, bit(policy_bug::cp_extra_scale)));
  v.push_back(catalogued_bug("rl-adv-whiten-dp-only", "advantage whitening statistics over DP only, not DP x CP",
                             "THUDM/slime #2235", "per-CP-rank loss and grad wrong at cp > 1 with whitening",
                             {"loss", "grad"}, mine, bit(policy_bug::adv_whiten_dp_only)));
  v.push_back(catalogued_bug("rl-fused-vocab-pad",
                             "a fused kernel's zero pad columns (each shard padded to a multiple of 1024) left in "
                             "the softmax",
                             "verl fused linear-CE kernel (#2656/#2899, #5349)",
                             "lse' = log(sum_v e^(x_v/T) + n_pad): log-prob, loss and grad wrong when V/TP mod 1024 "
                             "!= 0",
                             {"loss", "grad", "logprob", "entropy"}, mine, bit(policy_bug::fused_vocab_pad)));
  v.push_back(catalogued_bug("rl-kl-no-grad", "the KL penalty computed without gradient", "NovaSky-AI/SkyRL #1353",
                             "grad fails whenever kl_coef > 0; loss exact", {"grad"}, mine,
                             bit(policy_bug::kl_no_grad)));
  v.push_back(catalogued_bug(
      "rl-gspo-cp-local-ratio",
      "GSPO's sequence ratio and its gradient's sum taken over the CP rank's own chunks of each sequence",
      "predicted: the per-sequence reduction over CP that GSPO needs (radixark/miles #3188 reduces it; slime "
      "all-gathers the log-probs over CP for GSPO), left out",
      "each CP rank's rho_s = e^(mean over its own chunks), the gradient's sum Q_s over them too: loss and "
      "grad fail at cp > 1 with ratio sequence (the clip fraction only where a chunk's ratio crosses an edge); "
      "passes at cp = 1",
      {"loss", "grad"}, mine, bit(policy_bug::gspo_cp_local_ratio)));
  v.push_back(catalogued_bug(
      "rl-logprob-16bit",
      "the trainer's log-prob pass in the logits' 16-bit dtype: x / T rounded, log_softmax, logsumexp, softmax and "
      "sum p x each returning 16-bit values",
      "volcengine/verl b178a3cd verl/utils/torch_functional.py (logprobs_from_logits_v2's non-float32 branch, "
      "entropy_from_logits) from dp_actor.py; NovaSky-AI/SkyRL a9564572 utils/torch_utils.py:158-176 and "
      "workers/model_wrapper.py:334 (logits.div_(temperature)); huggingface/trl f2cd5771 trl/trainer/utils.py "
      "selective_log_softmax, entropy_from_logits (506-518)",
      "lambda = round16((x_y - M) - log S) of x = round16(z / T), H = round16(round16(lse) - round16(sum p x)); "
      "the gradient a 16-bit log_softmax's backward, round16(round16(g) (delta - e^(round16(log p)))), then "
      "div_(T)'s in the dtype: log-prob, entropy, loss and grad fail on bf16/fp16 logits; passes on fp32",
      {"entropy", "grad", "logprob", "loss", "stats"}, mine, bit(policy_bug::logprob_16bit)));
  v.push_back(catalogued_bug(
      "rl-stats-microbatch-mean",
      "the logged clip fraction, dual-clip fraction, KL and entropy each a token mean over one micro-batch of every "
      "rank, averaged over the micro-batches",
      "huggingface/trl GRPOTrainer._compute_loss at f2cd5771 (grpo_trainer.py:3229-3249, global_masked_mean: each "
      "micro-batch's sums and counts reduced over the processes; the Trainer's log averages the appended values)",
      "each token's statistic weighs 1/(GA N_k), N_k the valid tokens of micro-batch k over DP x CP, instead of "
      "1/N: stats fail when micro-batches hold unequal token counts; loss and grad exact",
      {"stats"}, mine, bit(policy_bug::stats_microbatch_mean)));
  v.push_back(catalogued_bug(
      "rl-drgrpo-rank-batch-sum",
      "seq-mean-token-sum-norm never divided by the sequence count: each micro-batch's sum_s S_s / H_max summed "
      "over the rank's micro-batches, then averaged over DP",
      "volcengine/verl b178a3cd verl/workers/utils/losses.py ppo_loss (global_batch_info passes no batch size "
      "to this mode) with verl/trainer/ppo/core_algos.py agg_loss (1072-1076: torch.sum(seq_losses) / "
      "loss_scale_factor), the new engine summing micro-batches",
      "each sequence weighs 1/(DP H_max) instead of 1/(B H_max): loss and grad x B/DP (= rl-drgrpo-batch-sum "
      "at GA = 1 with equal ranks)",
      {"loss", "grad"}, mine, bit(policy_bug::drgrpo_rank_batch_sum)));
  v.push_back(catalogued_bug(
      "rl-aux-token-mean",
      "the KL and entropy terms aggregated token-mean (1/N) while the policy term follows the case's sequence "
      "aggregation",
      "OpenRLHF/OpenRLHF 3c3be623 openrlhf/trainer/ray/ppo_actor.py:330 and :346 (aggregate_loss in its default "
      "token mode for the KL and the entropy; PolicyLoss forces per-sample for gspo)",
      "a token's KL and entropy weight 1/N instead of 1/(B n_s): their gradient x B n_s / N; passes under "
      "token-mean or without KL and entropy",
      {"loss", "grad"}, mine, bit(policy_bug::aux_token_mean)));
  v.push_back(catalogued_bug(
      "rl-aux-sample-weighted",
      "whatever the aggregation, the KL a mean over the micro-batch's sequences of each one's token mean and the "
      "entropy the micro-batch's token mean, each weighted by the micro-batch's share of the rank's sequences, "
      "then the DP mean",
      "NovaSky-AI/SkyRL a9564572 skyrl/backends/skyrl_train/workers/worker.py:1056-1089 (FSDP worker: "
      "masked_mean(kl, mask, dim=-1).mean() and masked_mean(entropy, mask), x len(microbatch) / len(data))",
      "KL weight 1/(DP B_r n_s), entropy weight b_k/(DP B_r N_k) (the rl-token-mean-sample-weighted pattern on "
      "the entropy): loss and grad fail with an entropy bonus on unequal micro-batches, or a KL under another "
      "aggregation than seq-mean-token-mean",
      {"loss", "grad"}, mine, bit(policy_bug::aux_sample_weighted)));
  v.push_back(catalogued_bug(
      "rl-aux-microbatch-mean",
      "whatever the aggregation, the KL a mean over the micro-batch's sequences of each one's token mean and the "
      "entropy the micro-batch's token mean, each micro-batch divided by K, then the DP mean",
      "NovaSky-AI/SkyRL a9564572 skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:851-941 "
      "(the Megatron loss_func's KL and entropy terms, Megatron's schedule dividing by K)",
      "KL weight 1/(DP K b_k n_s), entropy weight 1/(DP K N_k) (microbatch-local-mean on these terms): loss and "
      "grad fail with an entropy bonus on unequal micro-batches, or a KL under another aggregation than "
      "seq-mean-token-mean",
      {"loss", "grad"}, mine, bit(policy_bug::aux_microbatch_mean)));
  v.push_back(catalogued_bug(
      "rl-temperature-16bit", "the logits divided by T in place in their 16-bit dtype before a float32 log-prob pass",
      "NVIDIA-NeMo/RL 7ea279ab nemo_rl/models/automodel/train.py:193 and models/megatron/train.py:216 "
      "(logits.div_(temperature) before get_next_token_logprobs_from_logits casts to float32)",
      "x = round16(z / T): log-prob off by up to |z / T| 2^-8, softmax and gradient of x; loss, grad and "
      "log-prob (and the statistics through the ratio) fail on bf16/fp16 logits at T != 1; passes at T = 1 or on fp32",
      {"entropy", "grad", "logprob", "loss", "stats"}, mine, bit(policy_bug::temperature_16bit)));
  v.push_back(catalogued_bug(
      "rl-temperature-after-logprob",
      "the temperature applied to the log-probs after the log-softmax: lambda = log_softmax(z)_y / T, the pass at T = "
      "1",
      "NVIDIA-NeMo/RL 7ea279ab nemo_rl/models/megatron/train.py:336 (apply_temperature_scaling's div_(T) on the "
      "model's output, which under use_fused_linear_logprobs is the fused head's log-probs, "
      "distributed/model_utils.py:2331-2462)",
      "lambda_t off by log_softmax(z)_y / T - log_softmax(z / T)_y, its gradient (delta - softmax(z)) / T, the entropy "
      "that of softmax(z): log-prob, loss and grad fail at T != 1; passes at T = 1",
      {"entropy", "grad", "logprob", "loss", "stats"}, mine, bit(policy_bug::temperature_after_logprob)));
  v.push_back(catalogued_bug(
      "rl-kl-score-function",
      "the KL penalty weighted by e^(lambda - sg lambda) (value 1), which adds a score-function term to its "
      "gradient",
      "NVIDIA-NeMo/RL 7ea279ab nemo_rl/algorithms/loss/loss_functions.py:480-502 (calculate_kl with "
      "importance_sampling_weights; deliberate, after arXiv 2506.09477: a divergence from the objective's plain "
      "penalty, not a defect of NeMo-RL's own objective)",
      "d KL / d lambda = k'(lambda) + KL_t: grad fails whenever kl_coef > 0; loss and logged KL exact", {"grad"}, mine,
      bit(policy_bug::kl_score_function)));
  v.push_back(catalogued_bug(
      "rl-seq-mean-counts-empty",
      "the sequence aggregations' B counting every sequence of the step, those with no valid token included",
      "volcengine/verl verl/trainer/ppo/core_algos.py agg_loss before its seq_mask ('exclude fully masked "
      "sequences'): seq-mean-token-sum as torch.mean(seq_losses) over every row of the batch",
      "each sequence weighs 1/B_all instead of 1/B: loss and grad x B/B_all under seq-mean-token-sum, "
      "seq-mean-token-mean and seq-mean-token-sum-norm when a sequence is fully masked; passes under token-mean",
      {"loss", "grad"}, mine, bit(policy_bug::seq_mean_counts_empty)));
  return v;
}

}  // namespace lossverify
