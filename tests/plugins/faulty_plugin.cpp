// A plugin that misbehaves on purpose, for the plugin backend's fault tests. Its parameter names the fault
// and the world rank that commits it: `fault=KIND@RANK` (RANK `all`: every rank). The other ranks take part in
// one TP all-reduce (so they are waiting for the faulty rank when it fails) and write zeros of the right sizes.
//   in run_rank: error, crash, abort, throw, hang, exit, _exit, quick_exit, stack-overflow, misuse (group 9),
//                fork-crash (a forked child holds the host's socket, then the crash), setsid-sleeper (starts
//                `setsid sleep 123.25`, then computes as the others), truncate-region (shrinks the shared
//                region through /proc/self/map_files, then computes),
//                element-mismatch (f64 where the others all-reduce f32), op-mismatch (max where they sum),
//                huge-count (2^40 elements)
//   outputs:     rows, losses, unlogged, overrun (8 bytes past the gradient), guard-value (the old guard byte
//                0xA5 past it), underrun (8 bytes before it), overrun-far (past the gradient's guard page);
//                of a policy case: values (one row too many), statistics (a count of 3), values-overrun (8
//                bytes past the per-row values), values-far (into the guard page after them); of a head case
//                (it declares LV_SUPPORTS_LM_HEAD and writes zeros as the head's outputs): head-count (one dh
//                element short), head-overrun (8 bytes past its dW)
//   after return, on a thread it started: thread-exit, thread-crash, late-allreduce
//   at load (no rank): params-exit, params-crash (check_params); and, from the environment variable
//   LOSSVERIFY_TEST_LOAD_FAULT, ctor-exit, ctor-crash (a static constructor), entry-exit, entry-crash
//   (lossverify_plugin()).
#include <fcntl.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "lossverify/plugin.h"

namespace {

struct Fault {
  std::string kind;
  int rank = -2;  // -1: every rank
};

Fault parse(const char* params) {
  const std::string text = params != nullptr ? params : "";
  Fault f;
  const auto at = text.find('@');
  if (text.rfind("fault=", 0) == 0 && at != std::string::npos) {
    f.kind = text.substr(6, at - 6);
    const std::string rank = text.substr(at + 1);
    f.rank = rank == "all" ? -1 : std::atoi(rank.c_str());
  } else if (text.rfind("fault=", 0) == 0) {
    f.kind = text.substr(6);
  }
  return f;
}

std::string load_fault() {
  const char* value = std::getenv("LOSSVERIFY_TEST_LOAD_FAULT");
  return value != nullptr ? value : "";
}

void crash_now() {
  volatile int* nowhere = nullptr;
  *nowhere = 1;
}

// A static constructor: runs when the library is loaded.
struct AtLoad {
  AtLoad() {
    if (load_fault() == "ctor-exit") std::exit(0);
    if (load_fault() == "ctor-crash") crash_now();
  }
} at_load;

std::size_t element_bytes(lv_dtype d) { return d == LV_DTYPE_F32 ? 4 : 2; }

int recurse(int depth) {
  volatile char frame[4096];
  frame[0] = static_cast<char>(depth);
  return recurse(depth + 1) + frame[0];
}

std::atomic<bool> returned{false};

// A thread that acts once run_rank has returned.
void after_return(const std::string& kind, const lv_collectives* c) {
  std::thread([kind, c] {
    while (!returned.load()) std::this_thread::yield();
    if (kind == "thread-exit") std::exit(0);
    if (kind == "thread-crash") crash_now();
    if (kind == "late-allreduce") {
      while (c->group_size(c->context, LV_GROUP_TP) != -1) std::this_thread::yield();  // the call is closed
      float x = 1.0f;
      c->allreduce(c->context, LV_GROUP_TP, &x, 1, LV_ELEMENT_F32, LV_REDUCE_SUM);
    }
  }).detach();
}

int commit(const std::string& kind, const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* c) {
  if (kind == "error") {
    std::snprintf(out->error, sizeof(out->error), "injected error in rank %d", in->world_rank);
    return 7;
  }
  if (kind == "crash") crash_now();
  if (kind == "abort") std::abort();
  if (kind == "throw") throw std::runtime_error("a C++ exception escaping the plugin");
  if (kind == "fork-crash") {  // a child that keeps the host's socket open (fork, no exec), then the crash
    if (::fork() == 0) {
      ::sleep(120);
      ::_exit(0);
    }
    crash_now();
  }
  if (kind == "setsid-sleeper") {  // a process in a session of its own holding the host's stdout; the run goes on
    if (std::system("setsid sleep 123.25 &") != 0) return 9;
    return -1;
  }
  if (kind == "truncate-region") {  // shrink the shared region lossverify reads back (through /proc: root)
    std::FILE* maps = std::fopen("/proc/self/maps", "r");
    char line[512];
    while (maps != nullptr && std::fgets(line, sizeof(line), maps) != nullptr) {
      if (std::strstr(line, "lossverify-plugin-region") == nullptr) continue;
      *std::strchr(line, ' ') = '\0';
      const int fd = ::open((std::string("/proc/self/map_files/") + line).c_str(), O_RDWR);
      if (fd >= 0) {
        if (::ftruncate(fd, 0) == 0) std::fprintf(stderr, "faulty plugin: the region was truncated\n");
        ::close(fd);
      }
    }
    if (maps != nullptr) std::fclose(maps);
    return -1;  // then compute as the others, into what is left
  }
  if (kind == "hang") {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (kind == "exit") std::exit(0);
  if (kind == "_exit") ::_exit(0);
  if (kind == "quick_exit") std::quick_exit(0);
  if (kind == "stack-overflow") return recurse(0);
  if (kind == "misuse") {
    float x = 0.0f;
    return c->allreduce(c->context, static_cast<lv_group>(9), &x, 1, LV_ELEMENT_F32, LV_REDUCE_SUM);
  }
  if (kind == "huge-count") {
    float x = 0.0f;
    return c->allreduce(c->context, LV_GROUP_TP, &x, int64_t{1} << 40, LV_ELEMENT_F32, LV_REDUCE_SUM);
  }
  return -1;  // not a fault that ends the call
}

int run_rank(const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* c) {
  returned.store(false);
  const Fault fault = parse(in->params);
  const bool mine = fault.rank == -1 || fault.rank == in->world_rank;
  if (mine) {
    const int status = commit(fault.kind, in, out, c);
    if (status >= 0) return status;
  }
  double probe64 = 1.0;
  float probe = 1.0f;
  const bool wide = mine && fault.kind == "element-mismatch";
  const lv_reduce_op op = mine && fault.kind == "op-mismatch" ? LV_REDUCE_MAX : LV_REDUCE_SUM;
  const int status = wide ? c->allreduce(c->context, LV_GROUP_TP, &probe64, 1, LV_ELEMENT_F64, op)
                          : c->allreduce(c->context, LV_GROUP_TP, &probe, 1, LV_ELEMENT_F32, op);
  if (status != 0) {
    std::snprintf(out->error, sizeof(out->error), "a collective failed");
    return 1;
  }
  const int64_t columns = in->vocab_end - in->vocab_begin;
  out->grad_rows = in->rows;
  out->grad_columns = columns;
  out->token_loss_count = in->rows;
  out->has_logged_loss = in->loss.reduction != LV_REDUCTION_NONE;
  if (mine && fault.kind == "rows") out->grad_rows = in->rows + 1;
  if (mine && fault.kind == "losses") out->token_loss_count = in->rows - 1;
  if (mine && fault.kind == "unlogged") out->has_logged_loss = 0;
  const std::size_t bytes = static_cast<std::size_t>(in->rows * columns) * element_bytes(in->dtype);
  char* grad = static_cast<char*>(out->grad);
  if (mine && fault.kind == "overrun") std::memset(grad + bytes, 0x11, 8);
  if (mine && fault.kind == "guard-value") std::memset(grad + bytes, 0xA5, 8);
  if (mine && fault.kind == "underrun") std::memset(grad - 8, 0x11, 8);
  if (mine && fault.kind == "overrun-far") {
    const long page = ::sysconf(_SC_PAGESIZE);
    std::memset(grad + bytes + page + 16, 0x11, 8);  // past the guard page after the gradient
  }
  if (in->loss.kind == LV_LOSS_POLICY) {  // zeros of the right sizes, unless the fault says otherwise
    out->token_value_rows = in->rows + (mine && fault.kind == "values" ? 1 : 0);
    out->token_value_columns = LV_POLICY_VALUES;
    out->logged_statistics_count = mine && fault.kind == "statistics" ? 3 : LV_POLICY_STATS;
    char* values = reinterpret_cast<char*>(out->token_values);
    const std::size_t value_bytes = static_cast<std::size_t>(in->rows) * LV_POLICY_VALUES * sizeof(float);
    if (mine && fault.kind == "values-overrun") std::memset(values + value_bytes, 0x11, 8);
    if (mine && fault.kind == "values-far") std::memset(values + value_bytes + ::sysconf(_SC_PAGESIZE) - 8, 0x11, 8);
  }
  if (in->head_hidden > 0) {  // zeros of the right sizes, unless the fault says otherwise
    out->head_dh_count = in->head_dh_rows * in->head_hidden - (mine && fault.kind == "head-count" ? 1 : 0);
    out->head_dw_count = columns * in->head_hidden;
    out->head_db_count = in->head_bias != 0 ? columns : 0;
    const std::size_t dw_bytes = static_cast<std::size_t>(out->head_dw_count) * element_bytes(in->dtype);
    if (mine && fault.kind == "head-overrun") std::memset(static_cast<char*>(out->head_dw) + dw_bytes, 0x11, 8);
  }
  if (mine && (fault.kind == "thread-exit" || fault.kind == "thread-crash" || fault.kind == "late-allreduce")) {
    after_return(fault.kind, c);
  }
  returned.store(true);
  return 0;
}

int check_params(const char* params, char* error, size_t error_size) {
  const Fault fault = parse(params);
  if (fault.kind == "params-exit") std::exit(0);
  if (fault.kind == "params-crash") crash_now();
  (void)error;
  (void)error_size;
  return 0;
}

const lv_plugin plugin = {LV_PLUGIN_ABI_VERSION,
                          "faulty",
                          "misbehaves on purpose (tests)",
                          LV_MEMORY_HOST,
                          LV_SUPPORTS_CROSS_ENTROPY | LV_SUPPORTS_KD | LV_SUPPORTS_POLICY | LV_SUPPORTS_LM_HEAD,
                          run_rank,
                          check_params};

}  // namespace

extern "C" const lv_plugin* lossverify_plugin(void) {
  if (load_fault() == "entry-exit") std::exit(0);
  if (load_fault() == "entry-crash") crash_now();
  return &plugin;
}
