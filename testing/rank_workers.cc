#include "testing/rank_workers.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "topology/launcher.h"

namespace trident {
namespace testing {
namespace {

constexpr char kWorkerFlag[] = "--trident_rank_worker";

std::string ResultPath(const std::string& prefix, int rank) { return absl::StrCat(prefix, ".rank", rank); }

}  // namespace

absl::StatusOr<std::vector<std::string>> RunRankWorkers(int ranks, const std::vector<std::string>& args) {
  static int run = 0;
  const std::string prefix = absl::StrCat("/tmp/trident_rank_worker_", getpid(), "_", run++);
  LaunchOptions launch;
  launch.nproc_per_node = ranks;
  launch.command = {"/proc/self/exe", kWorkerFlag, prefix};
  launch.command.insert(launch.command.end(), args.begin(), args.end());
  launch.env["OMP_NUM_THREADS"] = "1";
  launch.env["OPENBLAS_NUM_THREADS"] = "1";
  launch.on_output = [](int, bool, absl::string_view) {};
  LaunchResult launched = RunLocalGroup(launch);
  std::vector<std::string> results;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(ResultPath(prefix, r));
    std::stringstream text;
    text << in.rdbuf();
    results.push_back(text.str());
    std::remove(ResultPath(prefix, r).c_str());
  }
  TRIDENT_RETURN_IF_ERROR(launched.status);
  return results;
}

std::optional<int> RunIfRankWorker(int argc, char** argv, const RankWorker& worker) {
  if (argc < 3 || std::string(argv[1]) != kWorkerFlag) return std::nullopt;
  const char* rank = std::getenv("RANK");
  const std::string path = ResultPath(argv[2], rank != nullptr ? std::atoi(rank) : 0);
  std::string result;
  absl::Status status = worker(std::vector<std::string>(argv + 3, argv + argc), &result);
  std::ofstream(path) << result;
  return ExitCodeFor("rank worker", status);
}

}  // namespace testing
}  // namespace trident
