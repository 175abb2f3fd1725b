// lossverify-plugin-host PATH PARAMS probe|serve: the process a native plugin's code runs in (host_protocol.hpp).
//   probe: load the library, validate it, say hello (the declaration or why not) and end;
//   serve: the same, then run one rank's call after another, each on the region lossverify sends with it, until
//          lossverify closes its end (a host is kept for the next run of the same plugin).
// Started by lossverify with its end of a socket pair as file descriptor 3 and the read end of its alive pipe as
// descriptor 4; it ends with lossverify.
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "lossverify/impl/plugin/host_protocol.hpp"
#include "lossverify/impl/plugin/plugin_memory.hpp"
#include "lossverify/impl/plugin/settings_block.hpp"
#include "lossverify/plugin.h"

namespace {

using namespace lossverify::plugin_host;
namespace memory = lossverify::plugin_memory;

// ---- messages --------------------------------------------------------------------------------------------

template <class T>
void send_message(const T& message) {
  for (;;) {
    const ssize_t sent = ::send(kSocketFd, &message, sizeof(T), MSG_NOSIGNAL);
    if (sent == static_cast<ssize_t>(sizeof(T))) return;
    if (sent < 0 && errno == EINTR) continue;
    ::_exit(70);  // lossverify has gone: nothing to report to
  }
}

// A message of type T (and the descriptor that came with it, if `fd`); ends the process when lossverify has
// gone or sends something else.
template <class T>
T receive(int* fd = nullptr) {
  T message{};
  char control[CMSG_SPACE(sizeof(int))] = {};
  iovec part{&message, sizeof(T)};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  header.msg_control = control;
  header.msg_controllen = sizeof(control);
  ssize_t got = -1;
  do {
    got = ::recvmsg(kSocketFd, &header, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got == 0) ::_exit(0);  // lossverify closed its end: no more runs
  if (got != static_cast<ssize_t>(sizeof(T)) || message.header.type != T{}.header.type) ::_exit(71);
  if (fd != nullptr) {
    *fd = -1;
    for (cmsghdr* c = CMSG_FIRSTHDR(&header); c != nullptr; c = CMSG_NXTHDR(&header, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(fd, CMSG_DATA(c), sizeof(int));
    }
  }
  return message;
}

template <std::size_t N>
void copy_text(char (&to)[N], const std::string& from) {
  std::snprintf(to, N, "%s", from.c_str());
}

// ---- crashes ---------------------------------------------------------------------------------------------

// Where a fatal signal hit, for lossverify's message: a guard page of the region means a write outside an
// output. The handler runs on its own stack (a stack overflow is a SIGSEGV too), records, and lets the
// default action end the process, so that lossverify sees the signal.
std::byte* g_region = nullptr;
std::size_t g_region_bytes = 0;
CrashRecord* g_crash = nullptr;

void on_fatal_signal(int sig, siginfo_t* info, void*) {
  if (g_crash != nullptr) {
    const auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
    const auto base = reinterpret_cast<std::uintptr_t>(g_region);
    g_crash->signal = sig;
    g_crash->offset = address >= base && address < base + g_region_bytes ? address - base : ~std::uint64_t{0};
  }
  // SA_RESETHAND restored the default action: a fault re-faults on return, an abort carries on.
}

void install_crash_handlers() {
  static std::vector<char> stack(std::max<std::size_t>(SIGSTKSZ, 64 * 1024));
  stack_t alternate{};
  alternate.ss_sp = stack.data();
  alternate.ss_size = stack.size();
  ::sigaltstack(&alternate, nullptr);
  for (const int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) {
    struct sigaction action {};
    action.sa_sigaction = on_fatal_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
    sigemptyset(&action.sa_mask);
    ::sigaction(sig, &action, nullptr);
  }
}

// ---- loading ---------------------------------------------------------------------------------------------

struct Loaded {
  const lv_plugin* plugin = nullptr;
  Hello hello;
};

// The optional list of kinds and settings the plugin names (plugin.h, LV_PLUGIN_NAMES_ENTRY_POINT), one per line.
bool read_names(void* handle, Hello& hello) {
  void* symbol = ::dlsym(handle, LV_PLUGIN_NAMES_ENTRY_POINT);
  if (symbol == nullptr) return true;
  const char* const* names = reinterpret_cast<lv_plugin_names_entry>(symbol)();
  std::string joined;
  for (std::size_t i = 0; names != nullptr && names[i] != nullptr; ++i) {
    const std::string name = names[i];
    if (name.empty() || name.find_first_of("\n\t") != std::string::npos) {
      copy_text(hello.message, std::string(LV_PLUGIN_NAMES_ENTRY_POINT) + "() entry " + std::to_string(i) +
                                   " is empty or holds a tab or newline");
      return false;
    }
    joined += name + "\n";
  }
  if (joined.size() >= sizeof(hello.names)) {
    copy_text(hello.message, std::string(LV_PLUGIN_NAMES_ENTRY_POINT) + "() names more than " +
                                 std::to_string(sizeof(hello.names) - 1) + " bytes");
    return false;
  }
  copy_text(hello.names, joined);
  return true;
}

Loaded load(const char* path, const char* params) {
  Loaded loaded;
  Hello& hello = loaded.hello;
  void* handle = ::dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    copy_text(hello.message, std::string("cannot load the library: ") + ::dlerror());
    return loaded;
  }
  ::dlerror();
  void* symbol = ::dlsym(handle, LV_PLUGIN_ENTRY_POINT);
  if (symbol == nullptr) {
    copy_text(hello.message, std::string("the library has no entry point ") + LV_PLUGIN_ENTRY_POINT +
                                 " (see include/lossverify/plugin.h; was it declared extern \"C\"?)");
    return loaded;
  }
  const lv_plugin* p = reinterpret_cast<lv_plugin_entry>(symbol)();
  if (p == nullptr) {
    copy_text(hello.message, std::string(LV_PLUGIN_ENTRY_POINT) + "() returned NULL");
    return loaded;
  }
  hello.abi_version = p->abi_version;
  if (p->abi_version != LV_PLUGIN_ABI_VERSION) {
    copy_text(hello.message, "plugin ABI version " + std::to_string(p->abi_version) +
                                 ", but this lossverify implements version " + std::to_string(LV_PLUGIN_ABI_VERSION) +
                                 " (rebuild the plugin against this include/lossverify/plugin.h)");
    return loaded;
  }
  if (p->run_rank == nullptr) {
    copy_text(hello.message, "the plugin's run_rank is NULL");
    return loaded;
  }
  if (p->memory != LV_MEMORY_HOST && p->memory != LV_MEMORY_CUDA) {
    copy_text(hello.message,
              "the plugin declares memory " + std::to_string(static_cast<int>(p->memory)) + " (host 0 or CUDA 1)");
    return loaded;
  }
  if (!read_names(handle, hello)) return loaded;
  if ((p->losses & (LV_SUPPORTS_CROSS_ENTROPY | LV_SUPPORTS_KD | LV_SUPPORTS_POLICY)) == 0 && hello.names[0] == '\0') {
    copy_text(hello.message,
              "the plugin supports no loss (set LV_SUPPORTS_CROSS_ENTROPY, LV_SUPPORTS_KD and/or LV_SUPPORTS_POLICY in "
              "losses, or name a kind in " LV_PLUGIN_NAMES_ENTRY_POINT "())");
    return loaded;
  }
  if (p->check_params != nullptr) {
    char error[1024] = {};
    if (p->check_params(params, error, sizeof(error)) != 0) {
      error[sizeof(error) - 1] = '\0';
      copy_text(hello.message, std::string("the plugin refuses its parameters \"") + params + "\"" +
                                   (error[0] != '\0' ? ": " + std::string(error) : ""));
      return loaded;
    }
  }
  hello.ok = 1;
  hello.memory = static_cast<std::int32_t>(p->memory);
  hello.losses = p->losses;
  copy_text(hello.name, p->name != nullptr ? p->name : "");
  copy_text(hello.description, p->description != nullptr ? p->description : "");
  loaded.plugin = p;
  return loaded;
}

// ---- collectives -----------------------------------------------------------------------------------------

// One run's collectives table and what it needs. Never freed: a thread the plugin started may hold the table
// after the call, and must find it refusing (the run's region is gone by then: `open` guards every use).
struct Call {
  std::uint64_t token = 0;
  Run run;
  lv_collectives table{};
  std::byte* staging = nullptr;
  std::size_t staging_bytes = 0;
  lv_memory memory = LV_MEMORY_HOST;
  std::mutex mutex;  // one collective at a time, whichever thread of the plugin calls
  std::atomic<bool> open{true};
  std::atomic<std::int64_t> late{0};
  bool failing = false;
  std::int64_t calls = 0;
};

std::size_t element_bytes(lv_element e) { return e == LV_ELEMENT_F32 ? 4 : 8; }

int refuse(Call& call, const std::string& why) {
  Misuse m;
  m.header.token = call.token;
  copy_text(m.message, why);
  send_message(m);
  call.failing = true;
  return 1;
}

int host_allreduce(void* context, lv_group group, void* data, int64_t count, lv_element element, lv_reduce_op op) {
  Call& call = *static_cast<Call*>(context);
  if (!call.open.load()) {
    ++call.late;
    return 1;
  }
  const std::lock_guard lock(call.mutex);
  if (call.failing) return 1;
  const std::string what = "allreduce called with group " + std::to_string(static_cast<int>(group)) + ", count " +
                           std::to_string(count) + ", element " + std::to_string(static_cast<int>(element)) + ", op " +
                           std::to_string(static_cast<int>(op));
  if (group < LV_GROUP_TP || group > LV_GROUP_DP_CP || element < LV_ELEMENT_F32 || element > LV_ELEMENT_I64 ||
      (op != LV_REDUCE_SUM && op != LV_REDUCE_MAX) || count < 0 || (data == nullptr && count > 0)) {
    return refuse(call, what);
  }
  const std::size_t size = element_bytes(element);
  if (static_cast<std::uint64_t>(count) > call.run.max_allreduce_bytes / size) {
    return refuse(call, what + ": " + std::to_string(count) + " elements is more than a loss all-reduces (at most " +
                            std::to_string(call.run.max_allreduce_bytes / size) + " here)");
  }
  const std::int64_t chunk = static_cast<std::int64_t>(call.staging_bytes / size);
  const std::int64_t index = call.calls++;
  auto* bytes = static_cast<std::byte*>(data);
  std::int64_t begin = 0;
  do {
    const std::int64_t n = std::min(chunk, count - begin);
    memory::to_host(call.memory, bytes + begin * static_cast<std::int64_t>(size), call.staging,
                    static_cast<std::size_t>(n) * size);
    Allreduce a;
    a.header.token = call.token;
    a.group = group;
    a.element = element;
    a.op = op;
    a.count = count;
    a.chunk_begin = begin;
    a.chunk_count = n;
    a.call = index;
    send_message(a);
    const AllreduceDone reply = receive<AllreduceDone>();
    if (reply.status != 0) {
      call.failing = true;
      return 1;
    }
    memory::from_host(call.memory, call.staging, bytes + begin * static_cast<std::int64_t>(size),
                      static_cast<std::size_t>(n) * size);
    begin += n;
  } while (begin < count);
  return 0;
}

// After run_rank has returned the table answers nothing: -1 here, and a refused all-reduce.
int host_group_size(void* context, lv_group group) {
  const Call& call = *static_cast<const Call*>(context);
  if (!call.open.load()) return -1;
  return group >= LV_GROUP_TP && group <= LV_GROUP_DP_CP ? call.run.group_size[group] : -1;
}

int host_group_rank(void* context, lv_group group) {
  const Call& call = *static_cast<const Call*>(context);
  if (!call.open.load()) return -1;
  return group >= LV_GROUP_TP && group <= LV_GROUP_DP_CP ? call.run.group_rank[group] : -1;
}

// ---- one rank's call -------------------------------------------------------------------------------------

// The rank's arrays where the plugin wants them: the region itself (host memory), or device copies of it.
struct Arrays {
  const void* logits = nullptr;
  const void* teacher = nullptr;
  const void* labels = nullptr;
  const void* loss_mask = nullptr;
  const void* upstream = nullptr;
  const void* tokens = nullptr;
  const void* sequences = nullptr;
  const void* token_inputs[kTokenInputs] = {};
  const void* hidden = nullptr;  // the LM head's inputs
  const void* head_weight = nullptr;
  const void* head_bias = nullptr;
  void* grad = nullptr;
  void* token_loss = nullptr;
  void* token_values = nullptr;
  void* scope_values = nullptr;
  void* head_dh = nullptr;  // the LM head's outputs
  void* head_dw = nullptr;
  void* head_db = nullptr;
  std::vector<std::unique_ptr<memory::Buffer>> device;  // CUDA: inputs, then the kOutputs outputs
};

Arrays place_arrays(const Run& r, std::byte* region, lv_memory where) {
  const RegionLayout& l = r.layout;
  Arrays a;
  const auto rows = static_cast<std::size_t>(r.rows);
  if (where == LV_MEMORY_HOST) {
    a.logits = region + l.logits;
    a.teacher = r.has_teacher ? region + l.teacher : nullptr;
    a.labels = region + l.labels;
    a.loss_mask = region + l.loss_mask;
    a.upstream = region + l.upstream;
    a.tokens = region + l.tokens;
    a.sequences = region + l.sequences;
    for (int k = 0; k < kTokenInputs; ++k)
      a.token_inputs[k] = region + l.token_inputs + static_cast<std::size_t>(k) * rows * 4;
    a.hidden = region + l.hidden;
    a.head_weight = region + l.head_weight;
    a.head_bias = region + l.head_bias;
    a.grad = region + l.grad;
    a.token_loss = region + l.token_loss;
    a.token_values = region + l.token_values;
    a.scope_values = region + l.scope_values;
    a.head_dh = region + l.head_dh;
    a.head_dw = region + l.head_dw;
    a.head_db = region + l.head_db;
    return a;
  }
  memory::select_device(where, r.device);
  const auto copy = [&](std::uint64_t offset, std::size_t bytes) {
    a.device.push_back(std::make_unique<memory::Buffer>(where, bytes, r.canary, kCanaryBytes));
    a.device.back()->upload(region + offset);
    return a.device.back()->data();
  };
  a.logits = copy(l.logits, l.logits_bytes);
  a.teacher = r.has_teacher ? copy(l.teacher, l.teacher_bytes) : nullptr;
  a.labels = copy(l.labels, rows * 8);
  a.loss_mask = copy(l.loss_mask, rows);
  a.upstream = copy(l.upstream, rows * 8);
  a.tokens = copy(l.tokens, rows * 8);
  a.sequences = copy(l.sequences, rows * 8);
  for (int k = 0; k < kTokenInputs; ++k) {
    a.token_inputs[k] = copy(l.token_inputs + static_cast<std::size_t>(k) * rows * 4, rows * 4);
  }
  a.hidden = copy(l.hidden, l.hidden_bytes);
  a.head_weight = copy(l.head_weight, l.head_weight_bytes);
  a.head_bias = copy(l.head_bias, l.head_bias_bytes);
  const auto output = [&](std::uint64_t bytes) {
    a.device.push_back(std::make_unique<memory::Buffer>(where, bytes, r.canary, kCanaryBytes));
    return a.device.back()->data();
  };
  a.grad = output(l.grad_bytes);
  a.token_loss = output(l.token_loss_bytes);
  a.token_values = output(l.token_values_bytes);
  a.scope_values = output(l.scope_values_bytes);
  a.head_dh = output(l.head_dh_bytes);
  a.head_dw = output(l.head_dw_bytes);
  a.head_db = output(l.head_db_bytes);
  return a;
}

lv_rank_inputs describe(const Run& r, std::byte* region, const Arrays& a, lv_memory where,
                        const SettingsBlock& settings) {
  lv_rank_inputs in{};
  in.struct_size = sizeof(lv_rank_inputs);
  in.world_rank = r.world_rank;
  in.world_size = r.world_size;
  in.tp = r.tp;
  in.cp = r.cp;
  in.dp = r.dp;
  in.tp_size = r.tp_size;
  in.cp_size = r.cp_size;
  in.dp_size = r.dp_size;
  in.ga = r.ga;
  in.vocab_size = r.vocab_size;
  in.vocab_begin = r.vocab_begin;
  in.vocab_end = r.vocab_end;
  in.rows = r.rows;
  in.micro_batch_begin = reinterpret_cast<const int64_t*>(region + r.layout.micro_batch_begin);
  in.global_valid_tokens = r.global_valid_tokens;
  in.dtype = static_cast<lv_dtype>(r.dtype);
  in.memory = where;
  in.device = where == LV_MEMORY_CUDA ? r.device : -1;
  in.logits = a.logits;
  in.teacher_logits = a.teacher;
  in.labels = static_cast<const int64_t*>(a.labels);
  in.loss_mask = static_cast<const uint8_t*>(a.loss_mask);
  in.upstream_weights = static_cast<const double*>(a.upstream);
  in.tokens = static_cast<const int64_t*>(a.tokens);
  in.loss = r.loss;
  in.framework = r.framework;
  in.params = reinterpret_cast<const char*>(region + r.layout.params);
  in.num_sequences = r.num_sequences;
  in.sequences = static_cast<const int64_t*>(a.sequences);
  in.policy = r.policy;
  in.old_logprob = static_cast<const float*>(a.token_inputs[0]);
  in.ref_logprob = static_cast<const float*>(a.token_inputs[1]);
  in.advantages = static_cast<const float*>(a.token_inputs[2]);
  in.policy_ratio = r.policy_ratio;
  in.loss_kind = settings.kind();
  in.settings = settings.data();
  in.settings_count = settings.size();
  in.sequence_parallel = r.sequence_parallel;
  if (r.head_hidden > 0) {
    in.head_hidden = r.head_hidden;
    in.head_bias = r.head_bias;
    in.head_dh_reduce = r.head_dh_reduce;
    in.logits = nullptr;  // the plugin's head makes them
    in.hidden_states = a.hidden;
    in.head_weight = a.head_weight;
    in.head_bias_values = a.head_bias;
    in.head_dh_rows = r.head_dh_rows;
    in.head_dh_row_index = reinterpret_cast<const int64_t*>(region + r.layout.head_dh_row_index);
  }
  return in;
}

void unmap_region(std::byte* region, const RegionLayout& layout) {
  g_crash = nullptr;
  g_region = nullptr;
  g_region_bytes = 0;
  ::munmap(region, layout.bytes);
}

std::byte* map_region(int fd, const RegionLayout& layout) {
  void* p = ::mmap(nullptr, layout.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) ::_exit(72);
  auto* region = static_cast<std::byte*>(p);
  for (const std::uint64_t page : layout.guard_pages) ::mprotect(region + page, layout.page_bytes, PROT_NONE);
  g_region = region;
  g_region_bytes = layout.bytes;
  g_crash = reinterpret_cast<CrashRecord*>(region + layout.crash);
  return region;
}

// One rank's call on the region that comes with the run message.
void serve_one(const lv_plugin& plugin) {
  int fd = -1;
  const Run run = receive<Run>(&fd);
  if (fd < 0) ::_exit(73);
  std::byte* region = map_region(fd, run.layout);
  const lv_memory where = plugin.memory;
  Done done;
  done.header.token = run.header.token;
  Call& call = *new Call();
  call.token = run.header.token;
  call.run = run;
  call.table = lv_collectives{&call, host_allreduce, host_group_size, host_group_rank};
  call.staging = region + run.layout.staging;
  call.staging_bytes = run.layout.staging_bytes;
  call.memory = where;
  try {
    Arrays arrays = place_arrays(run, region, where);
    const auto* block = reinterpret_cast<const char*>(region + run.layout.settings);
    const SettingsBlock settings(std::string_view(block, strnlen(block, run.layout.settings_bytes)));
    if (!settings.ok()) throw std::runtime_error("the settings block in the shared region is ill-formed");
    const lv_rank_inputs in = describe(run, region, arrays, where, settings);
    lv_rank_outputs out{};
    out.struct_size = sizeof(lv_rank_outputs);
    out.grad = arrays.grad;
    out.token_loss = static_cast<float*>(arrays.token_loss);
    out.token_values = static_cast<float*>(arrays.token_values);
    out.scope_values = run.layout.scope_values_bytes > 0 ? static_cast<double*>(arrays.scope_values) : nullptr;
    if (run.head_hidden > 0) {
      out.head_dh = arrays.head_dh;
      out.head_dw = arrays.head_dw;
      out.head_db = run.head_bias != 0 ? arrays.head_db : nullptr;
    }
    try {
      done.status = plugin.run_rank(&in, &out, &call.table);
      out.error[sizeof(out.error) - 1] = '\0';
      copy_text(done.error, out.error);
    } catch (const std::exception& e) {
      done.status = -1;
      copy_text(done.error, std::string("run_rank threw a C++ exception through the C ABI: ") + e.what());
    } catch (...) {
      done.status = -1;
      copy_text(done.error, "run_rank threw through the C ABI");
    }
    {
      const std::lock_guard lock(call.mutex);  // a call still in flight on another thread ends first
      call.open.store(false);
    }
    done.grad_rows = out.grad_rows;
    done.grad_columns = out.grad_columns;
    done.token_loss_count = out.token_loss_count;
    done.has_logged_loss = out.has_logged_loss;
    done.logged_loss = out.logged_loss;
    done.logged_num_tokens = out.logged_num_tokens;
    done.token_value_rows = out.token_value_rows;
    done.token_value_columns = out.token_value_columns;
    std::copy(std::begin(out.logged_statistics), std::end(out.logged_statistics), done.logged_statistics);
    done.logged_statistics_count = out.logged_statistics_count;
    done.scope_value_count = out.scope_value_count;
    done.head_dh_count = out.head_dh_count;
    done.head_dw_count = out.head_dw_count;
    done.head_db_count = out.head_db_count;
    if (where == LV_MEMORY_CUDA) {
      memory::wait_for_device(where);  // work the plugin left queued on its own streams
      const std::size_t outputs = arrays.device.size() - kOutputs;
      for (std::size_t k = outputs; k < arrays.device.size(); ++k) {
        if (!arrays.device[k]->guards_intact()) done.device_guards_intact = 0;
      }
      arrays.device[outputs]->download(region + run.layout.grad);
      arrays.device[outputs + 1]->download(region + run.layout.token_loss);
      arrays.device[outputs + 2]->download(region + run.layout.token_values);
      arrays.device[outputs + 3]->download(region + run.layout.scope_values);
      arrays.device[outputs + 4]->download(region + run.layout.head_dh);
      arrays.device[outputs + 5]->download(region + run.layout.head_dw);
      arrays.device[outputs + 6]->download(region + run.layout.head_db);
    }
  } catch (const std::exception& e) {  // the host's own CUDA copies failed
    call.open.store(false);
    done.status = -2;
    copy_text(done.error, e.what());
  }
  send_message(done);
  const Quit quit = receive<Quit>();
  (void)quit;
  Bye bye;
  bye.header.token = run.header.token;
  bye.late_calls = call.late.load();
  send_message(bye);
  unmap_region(region, run.layout);
}

}  // namespace

// Never outlive lossverify: its end of the alive pipe closes when its process ends, however it ends (a kept
// host outlives the thread that started it, so the parent-death signal, which follows threads, cannot serve).
void watch_parent() {
  std::thread([] {
    char byte = 0;
    for (;;) {
      const ssize_t got = ::read(kAliveFd, &byte, 1);
      if (got == 0 || (got < 0 && errno != EINTR)) ::_exit(0);
    }
  }).detach();
}

int main(int argc, char** argv) {
  if (argc != 4 || ::getppid() == 1) {
    std::fprintf(stderr, "lossverify-plugin-host: started by lossverify only (PATH PARAMS probe|serve)\n");
    return 64;
  }
  // A program the plugin runs (system(), posix_spawn) must not inherit the socket: lossverify would not see its
  // EOF when this host ends. (A forked child still holds it; lossverify also watches this process itself.)
  ::fcntl(kSocketFd, F_SETFD, FD_CLOEXEC);
  watch_parent();
  install_crash_handlers();
  const bool serving = std::strcmp(argv[3], "serve") == 0;
  Loaded loaded = load(argv[1], argv[2]);
  send_message(loaded.hello);
  if (!serving || loaded.plugin == nullptr) {
    std::fflush(nullptr);
    ::_exit(0);
  }
  for (;;) serve_one(*loaded.plugin);  // one run after another, until lossverify closes its end
}
