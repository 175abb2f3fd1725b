#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "lossverify/comm/progress_beacon.hpp"
#include "lossverify/comm/thread_world.hpp"
#include "lossverify/core/errors.hpp"

using namespace lossverify;

TEST_CASE("allreduce_sums_and_maxes_in_rank_order_identically_every_run") {
  std::vector<std::vector<float>> results(5);
  for (int repeat = 0; repeat < 3; ++repeat) {
    run_thread_ranks({5, 10.0}, [&](Communicator& comm) {
      std::vector<float> v = {0.1f * static_cast<float>(comm.rank() + 1), 1e8f, -static_cast<float>(comm.rank())};
      comm.allreduce_sum(v);
      std::vector<double> m = {static_cast<double>(comm.rank()), -static_cast<double>(comm.rank())};
      comm.allreduce_max(m);
      CHECK(m[0] == 4.0);
      CHECK(m[1] == 0.0);
      if (repeat == 0) {
        results[static_cast<std::size_t>(comm.rank())] = v;
      } else {
        CHECK(results[static_cast<std::size_t>(comm.rank())] == v);
      }
    });
  }
  const float expected = (((0.1f + 0.2f) + 0.3f) + 0.4f) + 0.5f;  // rank order
  CHECK(results[0][0] == expected);
  CHECK(results[0][2] == -10.0f);
  for (const auto& r : results) CHECK(r == results[0]);
}

TEST_CASE("split_forms_groups_by_color_ordered_by_key") {
  run_thread_ranks({6, 10.0}, [&](Communicator& comm) {
    auto group = comm.split(comm.rank() % 2, -comm.rank());  // reverse order inside each group
    CHECK(group->size() == 3);
    CHECK(group->rank() == 2 - comm.rank() / 2);
    std::int64_t v[1] = {comm.rank()};
    group->allreduce_sum(std::span<std::int64_t>(v, 1));
    CHECK(v[0] == (comm.rank() % 2 == 0 ? 0 + 2 + 4 : 1 + 3 + 5));
    std::vector<int> gathered(3);
    const int mine = comm.rank();
    group->all_gather(&mine, gathered.data(), sizeof(int));
    CHECK(gathered[0] > gathered[2]);
  });
}

TEST_CASE("a_rank_that_throws_stops_every_rank_with_an_error_naming_it_without_waiting_for_the_timeout") {
  const auto start = std::chrono::steady_clock::now();
  try {
    run_thread_ranks({4, 60.0}, [](Communicator& comm) {
      if (comm.rank() == 2) throw std::runtime_error("kernel exploded");
      std::vector<float> v(16, 1.0f);
      comm.allreduce_sum(v);
    });
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.code() == ExitCode::internal_error);
    CHECK(std::string(e.what()).find("rank 2: kernel exploded") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("a_rank_that_never_arrives_trips_the_deadlock_guard_which_names_it") {
  static std::atomic<bool> release{false};  // static: the detached rank may read it late
  try {
    run_thread_ranks({3, 0.5}, [](Communicator& comm) {
      if (comm.rank() == 1) {
        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return;
      }
      comm.barrier();
    });
    FAIL("expected a timeout");
  } catch (const TimeoutError& e) {
    CHECK(std::string(e.what()).find("rank(s) 1 never arrived") != std::string::npos);
  }
  release = true;  // let the detached rank finish
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

namespace {

using Clock = std::chrono::steady_clock;

// Computes for `seconds`, beating this rank's beacon from a worker thread, as an OpenMP loop does: the
// pointer is captured on the rank thread, where current() is the rank's.
void compute_with_beats(double seconds) {
  ProgressBeacon* const beacon = ProgressBeacon::current();
  REQUIRE(beacon != nullptr);
  std::thread worker([beacon, seconds] {
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    while (Clock::now() < end) {
      beat(beacon);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  worker.join();
}

std::string timeout_message(const std::function<void(Communicator&)>& rank_main, int ranks, double timeout) {
  try {
    run_thread_ranks({ranks, timeout}, rank_main);
  } catch (const TimeoutError& e) {
    return e.what();
  }
  return "no timeout";
}

}  // namespace

TEST_CASE("a_rank_that_computes_past_the_timeout_is_not_accused_while_it_beats") {
  // The others wait in the barrier four times the timeout; the guard times waits, not compute.
  run_thread_ranks({3, 0.3}, [](Communicator& comm) {
    if (comm.rank() == 1) compute_with_beats(1.2);
    comm.barrier();
  });
}

TEST_CASE("a_rank_that_stops_beating_is_accused_once_the_timeout_has_passed_since_its_last_beat") {
  static std::atomic<bool> release{false};  // static: the detached rank may read it late
  static std::atomic<double> stopped_after{0.0};
  const auto start = Clock::now();
  const std::string message = timeout_message(
      [start](Communicator& comm) {
        if (comm.rank() == 1) {
          compute_with_beats(0.8);
          while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // hung: no beats
          return;
        }
        try {
          comm.barrier();
        } catch (...) {  // the guard stopped the world
          if (comm.rank() == 0) stopped_after = std::chrono::duration<double>(Clock::now() - start).count();
          throw;
        }
      },
      3, 0.3);
  release = true;
  CHECK(message == "deadlock guard: barrier waited 0.3 s; rank(s) 1 never arrived");
  CHECK(stopped_after > 1.1);  // its last beat at 0.8 s, plus the timeout
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

TEST_CASE("the_deadlock_guard_names_the_root_rank_not_the_ranks_stuck_behind_it") {
  // Pairs {0, 2}, {1, 3} and {0, 1}, {2, 3}. Rank 1 hangs; rank 3 waits for it, rank 2 for rank 3 and
  // rank 0 for rank 2, in that order of arrival, so rank 0 has waited longest.
  static std::atomic<bool> release{false};
  const std::string message = timeout_message(
      [](Communicator& comm) {
        auto columns = comm.split(comm.rank() % 2, comm.rank());
        auto rows = comm.split(comm.rank() / 2, comm.rank());
        switch (comm.rank()) {
          case 0:
            columns->barrier();
            break;
          case 1:
            while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
            return;
          case 2:
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            rows->barrier();
            break;
          case 3:
            std::this_thread::sleep_for(std::chrono::milliseconds(400));
            columns->barrier();
            break;
        }
      },
      4, 0.5);
  release = true;
  CHECK(message == "deadlock guard: barrier waited 0.5 s; rank(s) 1 never arrived");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

TEST_CASE("a_deadlock_cycle_names_every_rank_in_it_and_the_collective_each_waits_in") {
  const std::string message = timeout_message(
      [](Communicator& comm) {
        auto pair = comm.split(0, comm.rank());  // the same ranks as the world, another group
        if (comm.rank() == 0) {
          comm.barrier();
        } else {
          // Later, so that rank 0 has waited longest and its collective leads the message.
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          std::vector<int> all(2);
          const int mine = comm.rank();
          pair->all_gather(&mine, all.data(), sizeof(int));
        }
      },
      2, 0.3);
  CHECK(message ==
        "deadlock guard: barrier waited 0.3 s; rank(s) 0, 1 never arrived, each waiting in a different "
        "collective (rank 0: barrier, rank 1: all_gather): a deadlock cycle");
}

TEST_CASE("mismatched_allreduce_sizes_are_an_error_not_memory_corruption") {
  CHECK_THROWS_AS(run_thread_ranks({2, 10.0},
                                   [](Communicator& comm) {
                                     std::vector<float> v(static_cast<std::size_t>(4 + comm.rank()), 1.0f);
                                     comm.allreduce_sum(v);
                                   }),
                  InternalError);
}
