#include "lossverify/comm/thread_world.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"

namespace lossverify {

namespace {

using Clock = std::chrono::steady_clock;

// Thrown in ranks that are stopped because another rank failed; never the error that is reported.
class RankAborted : public std::runtime_error {
 public:
  RankAborted() : std::runtime_error("aborted because another rank failed") {}
};

struct GroupState;

// Where a rank waits: the collective it entered and has not left, its group, and since when.
struct Wait {
  const GroupState* group = nullptr;  // null: the rank is not waiting in a collective
  const char* what = "";
  Clock::time_point since;
};

struct WorldState {
  WorldState(int ranks, double timeout)
      : timeout_seconds(timeout),
        beacons(static_cast<std::size_t>(ranks)),
        waits(static_cast<std::size_t>(ranks)),
        finished(static_cast<std::size_t>(ranks), 0) {}
  const double timeout_seconds;
  std::atomic<bool> aborted{false};
  std::mutex error_mutex;
  std::exception_ptr first_error;       // guarded by error_mutex
  std::vector<ProgressBeacon> beacons;  // by world rank
  // One lock for every group's barrier state and for `waits`, so that the watchdog sees who waits for
  // whom consistently.
  std::mutex sync;
  std::vector<Wait> waits;     // by world rank; guarded by sync
  std::vector<char> finished;  // by world rank: its function returned or threw; guarded by sync

  void record(std::exception_ptr error) {
    {
      std::lock_guard lock(error_mutex);
      if (!first_error) first_error = std::move(error);
    }
    aborted = true;
  }
};

// A group's barrier state, guarded by its world's `sync` (each rank fills its own slot and count before
// it arrives).
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
                              " passed " + std::to_string(g.counts[static_cast<std::size_t>(r)]) + " elements, rank " +
                              std::to_string(g.world_ranks[0]) + " passed " + std::to_string(g.counts[0]));
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

  void gather_to_root(const void* mine, void* out, std::size_t bytes) override {
    CollectiveTimer timer(collective_seconds_);
    GroupState& g = *group_;
    g.slots[static_cast<std::size_t>(rank_)] = mine;
    g.counts[static_cast<std::size_t>(rank_)] = bytes;
    wait_for_all("gather", [&g] {
      for (int r = 0; r < g.size; ++r) {
        if (g.counts[static_cast<std::size_t>(r)] != g.counts[0])
          throw InternalError("gather: ranks passed different sizes");
      }
    });
    auto* dst = static_cast<unsigned char*>(out);
    for (int r = 0; rank_ == 0 && r < g.size && bytes > 0; ++r) {
      std::memcpy(dst + static_cast<std::size_t>(r) * bytes, g.slots[static_cast<std::size_t>(r)], bytes);
    }
    wait_for_all("gather", nullptr);
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
    group_->world->record(
        std::make_exception_ptr(InternalError("rank " + std::to_string(world_rank()) + " aborted the run: " + reason)));
  }

 private:
  // The barrier under every collective. `completion` runs once, in the last rank to arrive, under the
  // world's lock, before anyone leaves (std::barrier's completion step, plus an abort). Entering and
  // leaving are progress; in between, the rank is recorded as waiting, which the watchdog judges.
  template <class Completion>
  void wait_for_all(const char* what, Completion&& completion) {
    GroupState& g = *group_;
    WorldState& w = *g.world;
    ProgressBeacon& beacon = w.beacons[static_cast<std::size_t>(world_rank())];
    beacon.beat();
    std::unique_lock lock(w.sync);
    if (w.aborted) throw RankAborted();
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
      for (const int r : g.world_ranks) {  // released: progress, before they wake to beat themselves
        w.waits[static_cast<std::size_t>(r)] = Wait{};
        w.beacons[static_cast<std::size_t>(r)].beat();
      }
      ++g.generation;
      g.cv.notify_all();
    } else {
      // Cleared by the rank that completes the group, or here on an abort: a record never outlives the
      // wait, so the group it points to is alive while the watchdog can read it.
      Wait& mine = w.waits[static_cast<std::size_t>(world_rank())];
      mine = Wait{&g, what, Clock::now()};
      while (g.generation == generation) {
        if (w.aborted) {
          mine = Wait{};
          throw RankAborted();
        }
        g.cv.wait_for(lock, std::chrono::milliseconds(20));
      }
    }
    lock.unlock();
    beacon.beat();
  }

  std::shared_ptr<GroupState> group_;
  int rank_;
};

// The deadlock guard. Time counts only while a rank waits inside a collective: the guard fires when a
// rank has waited longer than the timeout and every rank it waits for, directly or through ranks that
// wait in turn, has made no progress (its beacon has not moved) for longer than the timeout too. It
// names the ranks at the ends of those chains, the ones that are not waiting; when every rank reached
// waits (a cycle: ranks calling collectives in different orders), it names them and their collectives.
// When no rank waits at all, it fires once no running rank has made progress for the timeout.
class Watchdog {
 public:
  explicit Watchdog(WorldState& world)
      : world_(world),
        timeout_(std::chrono::duration<double>(world.timeout_seconds)),
        seen_(world.beacons.size(), 0),
        progressed_(world.beacons.size(), Clock::now()) {}

  // Samples the beacons; returns the error message when the guard fires. Called every few tens of ms.
  std::optional<std::string> check(Clock::time_point now) {
    // Sampled under the lock that releases waits, which beats the released ranks: a rank seen neither
    // waiting nor beating has really been silent.
    std::lock_guard lock(world_.sync);
    for (std::size_t r = 0; r < seen_.size(); ++r) {
      const std::uint64_t beats = world_.beacons[r].beats();
      if (beats != seen_[r]) {
        seen_[r] = beats;
        progressed_[r] = now;
      }
    }
    for (std::size_t r = 0; r < seen_.size(); ++r) {
      const Wait& wait = world_.waits[r];
      if (wait.group == nullptr || now - wait.since <= timeout_) continue;
      const Blame blame = blame_for(*wait.group);
      if (std::all_of(blame.chain.begin(), blame.chain.end(), [&](int k) { return stalled(k, now); })) {
        return message(wait.what, blame);
      }
    }
    return silent_world(now);
  }

 private:
  bool stalled(int rank, Clock::time_point now) const {
    return now - progressed_[static_cast<std::size_t>(rank)] > timeout_;
  }

  // No rank waits in a collective and none of the running ones has made progress for the timeout: a rank
  // hung outside every collective that no wait will reveal (a world of one rank). Under world_.sync.
  std::optional<std::string> silent_world(Clock::time_point now) const {
    std::vector<int> running;
    for (std::size_t r = 0; r < seen_.size(); ++r) {
      if (world_.finished[r]) continue;
      if (world_.waits[r].group != nullptr || !stalled(static_cast<int>(r), now)) return std::nullopt;
      running.push_back(static_cast<int>(r));
    }
    if (running.empty()) return std::nullopt;
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", world_.timeout_seconds);
    return std::string("deadlock guard: no rank made progress for ") + seconds + " s; rank(s) " + join(running) +
           " never reached a collective";
  }

  // The ranks a wait in `group` waits for, followed through those that wait in turn (`chain`), and
  // those of them that are not waiting in a collective (`roots`). Under world_.sync.
  struct Blame {
    std::vector<int> chain, roots;
  };
  Blame blame_for(const GroupState& group) const {
    Blame blame;
    std::vector<char> reached(seen_.size(), 0);
    std::vector<const GroupState*> pending = {&group};
    while (!pending.empty()) {
      const GroupState& g = *pending.back();
      pending.pop_back();
      for (int m = 0; m < g.size; ++m) {
        const int r = g.world_ranks[static_cast<std::size_t>(m)];
        if (g.present[static_cast<std::size_t>(m)] || reached[static_cast<std::size_t>(r)]) continue;
        reached[static_cast<std::size_t>(r)] = 1;
        blame.chain.push_back(r);
        const GroupState* next = world_.waits[static_cast<std::size_t>(r)].group;
        if (next != nullptr) {
          pending.push_back(next);
        } else {
          blame.roots.push_back(r);
        }
      }
    }
    std::sort(blame.chain.begin(), blame.chain.end());
    std::sort(blame.roots.begin(), blame.roots.end());
    return blame;
  }

  std::string message(const char* what, const Blame& blame) const {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", world_.timeout_seconds);
    std::string text = std::string("deadlock guard: ") + what + " waited " + seconds + " s; rank(s) ";
    if (!blame.roots.empty()) return text + join(blame.roots) + " never arrived";
    std::string cycle;
    for (const int r : blame.chain) {
      const char* where = world_.waits[static_cast<std::size_t>(r)].what;
      append_to_list(cycle, "rank " + std::to_string(r) + ": " + where);
    }
    return text + join(blame.chain) + " never arrived, each waiting in a different collective (" + cycle +
           "): a deadlock cycle";
  }

  static std::string join(const std::vector<int>& ranks) {
    std::string list;
    for (const int r : ranks) append_to_list(list, std::to_string(r));
    return list;
  }

  WorldState& world_;
  const std::chrono::duration<double> timeout_;
  std::vector<std::uint64_t> seen_;            // each rank's beats at the last sample
  std::vector<Clock::time_point> progressed_;  // when they last moved
};

}  // namespace

void run_thread_ranks(const ThreadWorldOptions& options, const std::function<void(Communicator&)>& rank_main) {
  if (options.ranks < 1) throw InternalError("thread backend needs at least one rank");
  auto world = std::make_shared<WorldState>(options.ranks, options.timeout_seconds);
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
      ProgressBeacon::set_current(&world->beacons[static_cast<std::size_t>(r)]);
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
      {
        std::lock_guard sync(world->sync);
        world->finished[static_cast<std::size_t>(r)] = 1;
      }
      std::lock_guard lock(done->mutex);
      ++done->finished;
      done->cv.notify_all();
    });
  }

  // This thread is the watchdog. After an abort, ranks get a grace period to unwind; any still running
  // are detached.
  Watchdog watchdog(*world);
  const auto grace = std::chrono::seconds(2);
  std::unique_lock lock(done->mutex);
  std::optional<Clock::time_point> aborted_at;
  while (done->finished < options.ranks) {
    done->cv.wait_for(lock, std::chrono::milliseconds(50));
    const auto now = Clock::now();
    if (!world->aborted) {
      if (auto message = watchdog.check(now)) world->record(std::make_exception_ptr(TimeoutError(*message)));
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
