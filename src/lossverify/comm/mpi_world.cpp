#include "lossverify/comm/mpi_world.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"

namespace lossverify::mpi {

namespace {

using Clock = std::chrono::steady_clock;

int g_world_rank = -1;
bool g_finished = false;
char g_signal_message[128];

void check(int code, const char* what) {
  if (code != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(code, text, &length);
    throw InternalError(std::string("MPI ") + what + " failed: " + std::string(text, static_cast<std::size_t>(length)));
  }
}

// A fatal signal names the rank before the process dies (mpiexec itself reports only the PID).
extern "C" void on_fatal_signal(int signal_number) {
  const ssize_t written = ::write(STDERR_FILENO, g_signal_message, std::strlen(g_signal_message));
  (void)written;
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

// A rank that exits before the run finished says so.
// mpiexec forwards each rank's output through its proxy; an abort right after writing can lose it.
void let_output_drain() {
  std::fflush(stdout);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
}

void on_exit() {
  if (!g_finished && g_world_rank >= 0) {
    std::fprintf(stderr, "lossverify: rank %d exited before the run finished\n", g_world_rank);
  }
}

// The deadlock guard's protocol across processes: a rank whose wait times out tells every other rank,
// listens for the others' reports for a grace period, and the lowest rank that is alive names the
// ranks that never reported (they never reached a collective) before ending the job with exit code 4.
class Watch {
 public:
  explicit Watch(double timeout) : timeout_seconds(timeout) {
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "Comm_dup");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  double timeout_seconds;

  [[noreturn]] void timed_out(const std::string& what) {
    constexpr int kTag = 4004;
    int message = rank_;
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      sends.emplace_back();
      MPI_Isend(&message, 1, MPI_INT, r, kTag, comm_, &sends.back());
    }
    std::vector<char> alive(static_cast<std::size_t>(size_), 0);
    alive[static_cast<std::size_t>(rank_)] = 1;
    const auto grace_end = Clock::now() + std::chrono::seconds(2);
    while (Clock::now() < grace_end) {
      int flag = 0;
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, kTag, comm_, &flag, &status);
      if (flag) {
        int from = 0;
        MPI_Recv(&from, 1, MPI_INT, status.MPI_SOURCE, kTag, comm_, MPI_STATUS_IGNORE);
        alive[static_cast<std::size_t>(from)] = 1;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    std::string missing;
    std::string waiting;
    int lowest_alive = size_;
    for (int r = 0; r < size_; ++r) {
      if (alive[static_cast<std::size_t>(r)]) {
        lowest_alive = std::min(lowest_alive, r);
        append_to_list(waiting, std::to_string(r));
      } else {
        append_to_list(missing, std::to_string(r));
      }
    }
    if (rank_ == lowest_alive) {
      std::fprintf(stderr,
                   "lossverify: timeout: deadlock guard: %s waited %g s; rank(s) %s never arrived (rank(s) %s were "
                   "waiting)\n",
                   what.c_str(), timeout_seconds, missing.empty() ? "none" : missing.c_str(), waiting.c_str());
      let_output_drain();
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(1));  // let the lowest rank speak first
    }
    g_finished = true;
    MPI_Abort(MPI_COMM_WORLD, static_cast<int>(ExitCode::timeout));
    std::_Exit(static_cast<int>(ExitCode::timeout));
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::shared_ptr<Watch> watch, bool owned)
      : comm_(comm), watch_(std::move(watch)), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    if (owned_) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank() const override { return g_world_rank; }

  void all_gather(const void* mine, void* out, std::size_t bytes) override {
    CollectiveTimer timer(collective_seconds_);
    gather(mine, out, bytes, "all_gather");
  }

  void allreduce(void* data, std::size_t count, ElementType type, ReduceOp op) override {
    CollectiveTimer timer(collective_seconds_);
    // Gather every rank's buffer and reduce in rank order: the thread backend's arithmetic, bit for bit.
    const std::size_t bytes = count * element_size(type);
    std::vector<unsigned char> all(bytes * static_cast<std::size_t>(size_));
    gather(data, all.data(), bytes, "allreduce");
    std::vector<const void*> inputs(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      inputs[static_cast<std::size_t>(r)] = all.data() + bytes * static_cast<std::size_t>(r);
    reduce_in_rank_order(inputs.data(), size_, data, 0, count, type, op);
  }

  void barrier() override {
    CollectiveTimer timer(collective_seconds_);
    MPI_Request request;
    check(MPI_Ibarrier(comm_, &request), "Ibarrier");
    wait(request, "barrier");
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    // Agree on the split with a deadline first, so that a rank that never arrives cannot hang
    // MPI_Comm_split itself.
    barrier();
    MPI_Comm child = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &child), "Comm_split");
    return std::make_unique<MpiCommunicator>(child, watch_, true);
  }

  void abort(const std::string& reason) override {
    std::fprintf(stderr, "lossverify: rank %d aborted the run: %s\n", g_world_rank, printable_message(reason).c_str());
    let_output_drain();
    g_finished = true;
    MPI_Abort(MPI_COMM_WORLD, static_cast<int>(ExitCode::internal_error));
    std::_Exit(static_cast<int>(ExitCode::internal_error));
  }

 private:
  void gather(const void* mine, void* out, std::size_t bytes, const char* what) {
    if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
      throw InternalError(std::string(what) + ": message of " + std::to_string(bytes) + " bytes is too large for MPI");
    }
    MPI_Request request;
    check(MPI_Iallgather(mine, static_cast<int>(bytes), MPI_BYTE, out, static_cast<int>(bytes), MPI_BYTE, comm_,
                         &request),
          "Iallgather");
    wait(request, what);
  }

  // Polls with back-off until the request completes or the deadline passes.
  void wait(MPI_Request& request, const char* what) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(watch_->timeout_seconds);
    int spins = 0;
    for (;;) {
      int done = 0;
      check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "Test");
      if (done) return;
      if (Clock::now() > deadline) watch_->timed_out(what);
      if (++spins < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spins < 2000 ? 50 : 500));
      }
    }
  }

  MPI_Comm comm_;
  std::shared_ptr<Watch> watch_;
  bool owned_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

bool launched_by_mpiexec() {
  for (const char* name : {"PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

struct Session::State {
  std::shared_ptr<Watch> watch;
  std::unique_ptr<MpiCommunicator> world;
};

Session::Session(int* argc, char*** argv, double timeout_seconds) : state_(std::make_unique<State>()) {
  int provided = 0;
  check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "Init_thread");
  MPI_Comm_rank(MPI_COMM_WORLD, &g_world_rank);
  std::snprintf(g_signal_message, sizeof(g_signal_message), "lossverify: rank %d died on a fatal signal\n",
                g_world_rank);
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(s, on_fatal_signal);
  std::atexit(on_exit);
  state_->watch = std::make_shared<Watch>(timeout_seconds);
  state_->world = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, state_->watch, false);
}

Session::~Session() {
  g_finished = true;
  state_->world.reset();
  MPI_Finalize();
}

int Session::rank() const { return g_world_rank; }
int Session::size() const { return state_->world->size(); }
Communicator& Session::world() { return *state_->world; }
void Session::set_timeout(double seconds) { state_->watch->timeout_seconds = seconds; }

void Session::abort(int exit_code, const std::string& message) {
  std::fprintf(stderr, "lossverify: rank %d: %s\n", g_world_rank, printable_message(message).c_str());
  let_output_drain();
  g_finished = true;
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

}  // namespace lossverify::mpi
