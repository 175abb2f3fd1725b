#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

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

TEST_CASE("mismatched_allreduce_sizes_are_an_error_not_memory_corruption") {
  CHECK_THROWS_AS(run_thread_ranks({2, 10.0},
                                   [](Communicator& comm) {
                                     std::vector<float> v(static_cast<std::size_t>(4 + comm.rank()), 1.0f);
                                     comm.allreduce_sum(v);
                                   }),
                  InternalError);
}
