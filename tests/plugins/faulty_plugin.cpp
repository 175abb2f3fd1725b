// A plugin that misbehaves on purpose, for the plugin backend's fault tests. Its parameter names the fault
// and the world rank that commits it: `fault=KIND@RANK` with KIND one of error, crash, abort, throw, hang,
// rows, losses, overrun, unlogged, misuse. The other ranks take part in one TP all-reduce (so they are
// waiting for the faulty rank when it fails) and write zeros of the right sizes.
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
  int rank = -1;
};

Fault parse(const char* params) {
  const std::string text = params != nullptr ? params : "";
  Fault f;
  const auto at = text.find('@');
  if (text.rfind("fault=", 0) == 0 && at != std::string::npos) {
    f.kind = text.substr(6, at - 6);
    f.rank = std::atoi(text.c_str() + at + 1);
  }
  return f;
}

std::size_t element_bytes(lv_dtype d) { return d == LV_DTYPE_F32 ? 4 : 2; }

int commit(const std::string& kind, const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* c) {
  if (kind == "error") {
    std::snprintf(out->error, sizeof(out->error), "injected error in rank %d", in->world_rank);
    return 7;
  }
  if (kind == "crash") {
    volatile int* nowhere = nullptr;
    *nowhere = 1;
  }
  if (kind == "abort") std::abort();
  if (kind == "throw") throw std::runtime_error("a C++ exception escaping the plugin");
  if (kind == "hang") {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (kind == "misuse") {
    float x = 0.0f;
    return c->allreduce(c->context, static_cast<lv_group>(9), &x, 1, LV_ELEMENT_F32, LV_REDUCE_SUM);
  }
  return -1;  // not a fault that ends the call
}

int run_rank(const lv_rank_inputs* in, lv_rank_outputs* out, const lv_collectives* c) {
  const Fault fault = parse(in->params);
  const bool mine = fault.rank == in->world_rank;
  if (mine) {
    const int status = commit(fault.kind, in, out, c);
    if (status >= 0) return status;
  }
  float probe = 1.0f;
  if (c->allreduce(c->context, LV_GROUP_TP, &probe, 1, LV_ELEMENT_F32, LV_REDUCE_SUM) != 0) {
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
  if (mine && fault.kind == "overrun") {
    const std::size_t bytes = static_cast<std::size_t>(in->rows * columns) * element_bytes(in->dtype);
    std::memset(static_cast<char*>(out->grad) + bytes, 0x11, 8);
  }
  return 0;
}

const lv_plugin plugin = {LV_PLUGIN_ABI_VERSION,
                          "faulty",
                          "misbehaves on purpose (tests)",
                          LV_MEMORY_HOST,
                          LV_SUPPORTS_CROSS_ENTROPY | LV_SUPPORTS_KD,
                          run_rank,
                          nullptr};

}  // namespace

extern "C" const lv_plugin* lossverify_plugin(void) { return &plugin; }
