// Benchmarks of multi-rank jobs: the benchmark binary runs itself again as
// every rank of a local job (one intra-op and one BLAS thread each, output
// silenced), and each rank reports its figures back as text.
//
//   absl::Status Worker(const std::vector<std::string>& args, std::string* result) {...}
//   void BM_Step(benchmark::State& state) {
//     auto results = testing::RunRankWorkers(2, {"1f1b"});  // each rank's *result, by rank
//   }
//   int main(int argc, char** argv) {
//     if (auto code = testing::RunIfRankWorker(argc, argv, Worker)) return *code;
//     benchmark::Initialize(&argc, argv);
//     benchmark::RunSpecifiedBenchmarks();
//   }
#ifndef TRIDENT_TESTING_RANK_WORKERS_H_
#define TRIDENT_TESTING_RANK_WORKERS_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace trident {
namespace testing {

// One rank's work: `args` as given to RunRankWorkers; what it leaves in
// `result` goes back to the caller.
using RankWorker = std::function<absl::Status(const std::vector<std::string>& args, std::string* result)>;

// Runs this binary as `ranks` local ranks, each running the worker on `args`;
// returns every rank's result, by rank, or the first failure.
absl::StatusOr<std::vector<std::string>> RunRankWorkers(int ranks, const std::vector<std::string>& args);

// In main: when this process is a rank started by RunRankWorkers, runs
// `worker` and returns the exit code; nullopt otherwise.
std::optional<int> RunIfRankWorker(int argc, char** argv, const RankWorker& worker);

}  // namespace testing
}  // namespace trident

#endif  // TRIDENT_TESTING_RANK_WORKERS_H_
