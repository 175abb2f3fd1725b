#pragma once
// What lossverify and its plugin host (`lossverify-plugin-host`, a child process that loads the plugin and runs
// one rank's call) say to each other over a socket pair, and the layout of the memory they share.
//
// A plugin's code runs only in the host: lossverify never loads it. The host loads the library (static
// constructors, lossverify_plugin(), check_params), then serves one rank's run_rank: its inputs and outputs
// live in a shared region that lossverify created, its all-reduces travel to lossverify as messages (the data
// in the region's staging area) and are carried out over the rank's real groups, and it reports the call's
// end with a message that carries the run's token. lossverify accepts the outputs only with that message; a
// host that ends in any other way (exit(0), _exit, a signal, a hang) fails the run naming the plugin, the
// rank and the phase. Messages are fixed-size structs over SOCK_SEQPACKET (one send, one message).
#include <cstddef>
#include <cstdint>

#include "lossverify/plugin.h"

namespace lossverify::plugin_host {

inline constexpr int kSocketFd = 3;  // the host's end of the socket pair
inline constexpr int kAliveFd = 4;   // read end of a pipe whose write end only lossverify holds: EOF = it is gone
inline constexpr std::size_t kCanaryBytes = 64;

enum class Message : std::uint32_t {
  hello = 1,           // host -> lossverify: the plugin loaded (its declaration), or why not
  run = 2,             // lossverify -> host: one rank's call (with the region's file descriptor)
  allreduce = 3,       // host -> lossverify: one chunk of an all-reduce, its data in the staging area
  allreduce_done = 4,  // lossverify -> host: the chunk's result is in the staging area (status 0), or failing
  done = 5,            // host -> lossverify: run_rank returned (the run's token, status and scalar outputs)
  misuse = 6,          // host -> lossverify: the plugin called a collective with impossible arguments
  quit = 7,            // lossverify -> host: the outputs are taken; say how many calls came too late, and end
  bye = 8,             // host -> lossverify: the answer to quit
};

struct Header {
  Message type;
  std::uint32_t reserved = 0;
  std::uint64_t token = 0;  // the run's (0 before a run)
};

struct Hello {
  Header header{Message::hello};
  std::int32_t ok = 0;  // 1: loaded and valid; 0: refused (message)
  std::uint32_t abi_version = 0;
  std::int32_t memory = 0;
  std::uint32_t losses = 0;
  char name[256] = {};
  char description[1024] = {};
  char message[2048] = {};
  char names[4096] = {};  // lossverify_plugin_names(), one per line (plugin.h: LV_PLUGIN_NAMES_ENTRY_POINT)
};

// Byte offsets into the shared region; every array is 64-byte aligned. The three outputs end exactly at a page
// end with a page the host makes inaccessible after each, and a page before each; the bytes between that
// page and the output's first byte hold the canary, as do the canary arrays of the region's header.
inline constexpr int kOutputs = 7;      // grad, token_loss, token_values, scope_values, head_dh, head_dw, head_db
inline constexpr int kTokenInputs = 3;  // old_logprob, ref_logprob, advantages (lv_rank_inputs, in that order)

struct RegionLayout {
  std::uint64_t bytes = 0;
  std::uint64_t params = 0, params_bytes = 0;      // NUL-terminated
  std::uint64_t settings = 0, settings_bytes = 0;  // the kind's settings block (settings_block.hpp), NUL-terminated
  std::uint64_t micro_batch_begin = 0;             // ga + 1 int64
  std::uint64_t logits = 0, logits_bytes = 0;
  std::uint64_t teacher = 0, teacher_bytes = 0;  // KD only (the student's logits_bytes, also under a head)
  std::uint64_t labels = 0, loss_mask = 0, upstream = 0, tokens = 0, sequences = 0;
  std::uint64_t token_inputs = 0;  // kTokenInputs columns of rows float32, one after the other
  // The LM head stage's inputs (lv_rank_inputs.head_*; empty without a head), in dtype: h (rows x H), W_r, b_r, and
  // the rows whose dh the rank returns (int64)
  std::uint64_t hidden = 0, hidden_bytes = 0, head_weight = 0, head_weight_bytes = 0;
  std::uint64_t head_bias = 0, head_bias_bytes = 0, head_dh_row_index = 0;
  std::uint64_t grad = 0, grad_bytes = 0;  // ends at a page end
  std::uint64_t token_loss = 0, token_loss_bytes = 0;
  std::uint64_t token_values = 0, token_values_bytes = 0;  // rows x the kind's per-row values, float32
  std::uint64_t scope_values = 0, scope_values_bytes = 0;  // ga x the kind's scope values, float64
  std::uint64_t head_dh = 0, head_dh_bytes = 0;            // the head's outputs, in dtype (empty without a head)
  std::uint64_t head_dw = 0, head_dw_bytes = 0;
  std::uint64_t head_db = 0, head_db_bytes = 0;
  std::uint64_t guard_pages[2 * kOutputs] = {};  // before and after each output, in the order above
  std::uint64_t staging = 0, staging_bytes = 0;
  std::uint64_t crash = 0;  // a CrashRecord the host's signal handler fills
  std::uint64_t page_bytes = 0;
};

struct CrashRecord {
  std::int32_t signal = 0;
  std::uint32_t reserved = 0;
  std::uint64_t offset = 0;  // the faulting address as an offset into the region (or ~0: outside it)
};

struct Run {
  Header header{Message::run};
  RegionLayout layout;
  std::uint8_t canary[kCanaryBytes] = {};  // the pattern lossverify wrote before and after each output
  // The rank's description (lv_rank_inputs without its pointers).
  std::int32_t world_rank = 0, world_size = 0, tp = 0, cp = 0, dp = 0, tp_size = 0, cp_size = 0, dp_size = 0, ga = 0;
  std::int64_t vocab_size = 0, vocab_begin = 0, vocab_end = 0, rows = 0, global_valid_tokens = 0;
  std::int64_t num_sequences = 0;
  std::int32_t dtype = 0, device = -1, has_teacher = 0;
  // The v1 structures, whole (frozen: a setting added later travels in the region's settings block only).
  lv_loss_config loss{};
  lv_policy_config policy{};
  std::int32_t policy_ratio = LV_POLICY_RATIO_TOKEN;
  std::int32_t sequence_parallel = 0;
  std::int64_t head_hidden = 0, head_dh_rows = 0;  // the LM head (0: none)
  std::int32_t head_bias = 0, head_dh_reduce = LV_HEAD_DH_HEAD;
  lv_framework framework{};
  std::int32_t group_size[4] = {}, group_rank[4] = {};
  std::uint64_t max_allreduce_bytes = 0;  // a call past this is refused as misuse
};

struct Allreduce {
  Header header{Message::allreduce};
  std::int32_t group = 0, element = 0, op = 0;
  std::int64_t count = 0;        // of the whole call
  std::int64_t chunk_begin = 0;  // this chunk: elements [chunk_begin, chunk_begin + chunk_count)
  std::int64_t chunk_count = 0;
  std::int64_t call = 0;  // the call's number within the run
};

struct AllreduceDone {
  Header header{Message::allreduce_done};
  std::int32_t status = 0;
};

struct Done {
  Header header{Message::done};
  std::int32_t status = 0;  // run_rank's return value
  std::int32_t has_logged_loss = 0;
  std::int64_t grad_rows = 0, grad_columns = 0, token_loss_count = 0;
  double logged_loss = 0.0;
  std::int64_t logged_num_tokens = 0;
  std::int64_t token_value_rows = 0, token_value_columns = 0;
  std::int64_t scope_value_count = 0;
  std::int64_t head_dh_count = 0, head_dw_count = 0, head_db_count = 0;
  double logged_statistics[LV_MAX_LOGGED_STATISTICS] = {};
  std::int32_t logged_statistics_count = 0;
  std::int32_t device_guards_intact = 1;  // CUDA outputs: the host checked their canaries on the device
  char error[1024] = {};
};

struct Misuse {
  Header header{Message::misuse};
  char message[1024] = {};
};

struct Quit {
  Header header{Message::quit};
};

struct Bye {
  Header header{Message::bye};
  std::int64_t late_calls = 0;  // collectives called after run_rank returned
};

}  // namespace lossverify::plugin_host
