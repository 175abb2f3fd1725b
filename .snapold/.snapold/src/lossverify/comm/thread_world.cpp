#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/strings.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <optional>
#include <mutex>
#include <thread>
#include <vector>

#include "lossverify/core/errors.hpp"

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;

// Thrown in ranks that are stopped because another rank failed; never the error that is reported.
class RankAborted : public std::runtime_error {
 public:
  RankAborted() : std::runtime_error("aborted because another rank failed") {}
};

struct WorldState {
  explicit WorldState(double timeout) : timeout_seconds(timeout) {}
  const double timeout_seconds;
  std::atomic<bool> aborted{false};
  std::mutex mutex;
  std::exception_ptr first_error;  // guarded by mutex
  std::atomic<std::int64_t> last_activity_ns{0};
  std::atomic<int> waiting{0};  // ranks inside a collective; their own deadline covers them

  void record(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex);
      if (!first_error) first_error = std::move(error);
    }
    aborted = true;
  }
  void touch() { last_activity_ns = Clock::now().time_since_epoch().count(); }
};

struct GroupState {
  GroupState(std::shared_ptr<WorldState> w, std::vector<int> members)
      : world(std::move(w)),
        world_ranks(std::move(members)),
        size(static_cast<int>(world_ranks.size())),
        present(world_ranks.size(), 0),
        slots(world_ranks.size(), nullptr),
        counts(world_ranks.size(), 0) {}

  std::shared_ptr<WorldState> world;
  std::vector<int> world_ranks;
  int size;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::vector<char> present;
  std::vector<const void*> slots;
  std::vector<std::size_t> counts;
  std::vector<unsigned char> scratch;
  std::map<int, std::shared_ptr<GroupState>> children;  // built by split
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<GroupState> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  int world_rank() const override { return group_->world_ranks[static_cast<std::size_t>(rank_)]; }
  bool aborted() const override { return group_->world->aborted; }

  void allreduce(void* data, std::size_t count, ElementType type, ReduceOp op) override {
    CollectiveTimer timer(collective_seconds_);
    GroupState& g = *group_;
    const std::size_t esize = element_size(type);
    g.slots[static_cast<std::size_t>(rank_)] = data;
    g.counts[static_cast<std::size_t>(rank_)] = count;
    wait_for_all("allreduce", [&g, esize, this] {
      for (int r = 0; r < g.size; ++r) {
        if (g.counts[static_cast<std::size_t>(r)] != g.counts[0]) {
          throw InternalError("allreduce: rank " + std::to_string(g.world_ranks[static_cast<std::size_t>(r)]) +
                              " passed " + std::to_string(g.counts[static_cast<std::size_t>(r)]) +
                              " elements, rank " + std::to_string(g.world_ranks[0]) + " passed " +
                              std::to_string(g.counts[0]));
        }
      }
      g.scratch.resize(g.counts[0] * esize);
      (void)this;
    });
    // Each rank reduces one slice of the buffer, always in rank order.
    const std::size_t begin = count * static_cast<std::size_t>(rank_) / static_cast<std::size_t>(g.size);
    const std::size_t end = count * static_cast<std::size_t>(rank_ + 1) / static_cast<std::size_t>(g.size);
    reduce_in_rank_order(g.slots.data(), g.size, g.scratch.data(), begin, end, type, op);
    wait_for_all("allreduce", nullptr);
    if (count > 0) std::memcpy(data, g.scratch.data(), count * esize);
    wait_for_all("allreduce", nullptr);
  }

  void all_gather(const void* mine, void* out, std::size_t bytes) override {
    CollectiveTimer timer(collective_seconds_);
    GroupState& g = *group_;
    g.slots[static_cast<std::size_t>(rank_)] = mine;
    g.counts[static_cast<std::size_t>(rank_)] = bytes;
    wait_for_all("all_gather", [&g] {
      for (int r = 0; r < g.size; ++r) {
        if (g.counts[static_cast<std::size_t>(r)] != g.counts[0]) {
          throw InternalError("all_gather: ranks passed different sizes");
        }
      }
    });
    auto* dst = static_cast<unsigned char*>(out);
    for (int r = 0; r < g.size && bytes > 0; ++r) {  // an empty vector's data() may be null
      std::memcpy(dst + static_cast<std::size_t>(r) * bytes, g.slots[static_cast<std::size_t>(r)], bytes);
    }
    wait_for_all("all_gather", nullptr);
  }

  void barrier() override {
    CollectiveTimer timer(collective_seconds_);
    wait_for_all("barrier", nullptr);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    GroupState& g = *group_;
    const int mine[3] = {color, key, rank_};
    std::vector<int> table(static_cast<std::size_t>(3 * g.size));
    all_gather(mine, table.data(), sizeof(mine));
    // Every rank sees the same table; the last to arrive builds all child groups.
    wait_for_all("split", [&g, &table] {
      std::map<int, std::vector<std::pair<std::pair<int, int>, int>>> by_color;
      for (int r = 0; r < g.size; ++r) {
        const auto i = static_cast<std::size_t>(3 * r);
        by_color[table[i]].push_back({{table[i + 1], table[i + 2]}, table[i + 2]});
      }
      g.children.clear();
      for (auto& [c, members] : by_color) {
        std::sort(members.begin(), members.end());
        std::vector<int> world_ranks;
        for (const auto& m : members) world_ranks.push_back(g.world_ranks[static_cast<std::size_t>(m.second)]);
        g.children[c] = std::make_shared<GroupState>(g.world, world_ranks);
      }
    });
    std::shared_ptr<GroupState> child = g.children.at(color);
    int child_rank = 0;
    for (int r = 0; r < child->size; ++r) {
      if (child->world_ranks[static_cast<std::size_t>(r)] == world_rank()) child_rank = r;
    }
    wait_for_all("split", nullptr);  // nobody clears children before all have read theirs
    return std::make_unique<ThreadCommunicator>(std::move(child), child_rank);
  }

  void abort(const std::string& reason) override {
    group_->world->record(std::make_exception_ptr(
        InternalError("rank " + std::to_string(world_rank()) + " aborted the run: " + reason)));
  }

 private:
  // The barrier under every collective. `completion` runs once, in the last rank to arrive, under the
  // group's lock, before anyone leaves (std::barrier's completion step, plus a deadline and an abort).
  template <class Completion>
  void wait_for_all(const char* what, Completion&& completion) {
    GroupState& g = *group_;
    WorldState& w = *g.world;
    std::unique_lock lock(g.mutex);
    if (w.aborted) throw RankAborted();
    w.touch();
    const std::uint64_t generation = g.generation;
    g.present[static_cast<std::size_t>(rank_)] = 1;
    if (++g.arrived == g.size) {
      if constexpr (!std::is_same_v<std::decay_t<Completion>, std::nullptr_t>) {
        try {
          completion();
        } catch (...) {
          w.record(std::current_exception());
          g.cv.notify_all();
          throw RankAborted();
        }
      }
      g.arrived = 0;
      std::fill(g.present.begin(), g.present.end(), 0);
      ++g.generation;
      g.cv.notify_all();
      return;
    }
    const auto deadline = Clock::now() + std::chrono::duration<double>(w.timeout_seconds);
    struct Waiting {
      std::atomic<int>& count;
      explicit Waiting(std::atomic<int>& c) : count(c) { ++count; }
      ~Waiting() { --count; }
    } waiting(w.waiting);
    while (g.generation == generation) {
      if (w.aborted) throw RankAborted();
      if (Clock::now() >= deadline) {
        std::string missing;
        for (int r = 0; r < g.size; ++r) {
          if (!g.present[static_cast<std::size_t>(r)]) {
            append_to_list(missing, std::to_string(g.world_ranks[static_cast<std::size_t>(r)]));
          }
        }
        char seconds[32];
        std::snprintf(seconds, sizeof(seconds), "%g", w.timeout_seconds);
        w.record(std::make_exception_ptr(TimeoutError(std::string("deadlock guard: ") + what + " waited " + seconds +
                                                      " s; rank(s) " + missing + " never arrived")));
        throw RankAborted();
      }
      g.cv.wait_for(lock, std::chrono::milliseconds(20));
    }
  }

  std::shared_ptr<GroupState> group_;
  int rank_;
};

}  // namespace

void run_thread_ranks(const ThreadWorldOptions& options, const std::function<void(Communicator&)>& rank_main) {
  if (options.ranks < 1) throw InternalError("thread backend needs at least one rank");
  auto world = std::make_shared<WorldState>(options.timeout_seconds);
  world->touch();
  std::vector<int> members(static_cast<std::size_t>(options.ranks));
  for (int r = 0; r < options.ranks; ++r) members[static_cast<std::size_t>(r)] = r;
  auto top = std::make_shared<GroupState>(world, members);

  struct Completion {
    std::mutex mutex;
    std::condition_variable cv;
    int finished = 0;
  };
  auto done = std::make_shared<Completion>();

  // Shared, not referenced: a hung rank that gets detached may outlive this call.
  auto main_function = std::make_shared<const std::function<void(Communicator&)>>(rank_main);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(options.ranks));
  for (int r = 0; r < options.ranks; ++r) {
    threads.emplace_back([world, top, done, r, main_function] {
      try {
        ThreadCommunicator comm(top, r);
        (*main_function)(comm);
      } catch (const RankAborted&) {
        // secondary: the error that stopped the world is already recorded
      } catch (const Error& e) {
        world->record(std::make_exception_ptr(Error(e.code(), "rank " + std::to_string(r) + ": " + e.what())));
      } catch (const std::exception& e) {
        world->record(std::make_exception_ptr(InternalError("rank " + std::to_string(r) + ": " + e.what())));
      } catch (...) {
        world->record(std::make_exception_ptr(InternalError("rank " + std::to_string(r) + ": unknown exception")));
      }
      std::lock_guard lock(done->mutex);
      ++done->finished;
      done->cv.notify_all();
    });
  }

  // Watchdog: when no rank is inside a collective and none has reached one for the timeout (every rank
  // stuck outside the collectives), the run times out too; ranks waiting in a collective have their own.
  // After an abort, ranks get a grace period to unwind; any still running are detached.
  const auto timeout = std::chrono::duration<double>(options.timeout_seconds);
  const auto grace = std::chrono::seconds(2);
  std::unique_lock lock(done->mutex);
  std::optional<Clock::time_point> aborted_at;
  while (done->finished < options.ranks) {
    done->cv.wait_for(lock, std::chrono::milliseconds(50));
    const auto now = Clock::now();
    if (!world->aborted && world->waiting == 0) {
      const auto idle = now.time_since_epoch() - Clock::duration(world->last_activity_ns.load());
      if (idle > timeout) {
        world->record(std::make_exception_ptr(
            TimeoutError("deadlock guard: no rank reached a collective for " +
                         std::to_string(static_cast<int>(options.timeout_seconds)) + " s")));
      }
    }
    if (world->aborted) {
      if (!aborted_at) aborted_at = now;
      if (now - *aborted_at > grace) break;
    }
  }
  const bool all_finished = done->finished == options.ranks;
  lock.unlock();
  if (all_finished) {
    for (auto& t : threads) t.join();
  } else {
    for (auto& t : threads) t.detach();  // hung ranks: the caller ends the process
  }
  if (world->first_error) std::rethrow_exception(world->first_error);
}

}  // namespace lossverify
