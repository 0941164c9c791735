// A rank program for launcher_test, driven by its arguments:
//   print                 print the launch environment and exit 0
//   fail RANK CODE        rank RANK exits with CODE after 0.2 s, the others sleep 60 s
//   fail_first_attempt    rank 1 exits 5 on the first attempt; every rank succeeds on a restart
//   sleep                 sleep 60 s
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

int EnvInt(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? -1 : std::atoi(value);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int rank = EnvInt("RANK");
  if (mode == "print") {
    std::printf("rank=%d world=%d local=%d local_world=%d addr=%s port=%d restart=%d\n", rank, EnvInt("WORLD_SIZE"),
                EnvInt("LOCAL_RANK"), EnvInt("LOCAL_WORLD_SIZE"), std::getenv("MASTER_ADDR"), EnvInt("MASTER_PORT"),
                EnvInt("TRIDENT_RESTART_COUNT"));
    std::fprintf(stderr, "stderr line of rank %d\n", rank);
    std::printf("no newline at the end");
    return 0;
  }
  if (mode == "fail" && argc == 4) {
    if (rank == std::atoi(argv[2])) {
      usleep(200 * 1000);
      return std::atoi(argv[3]);
    }
    sleep(60);
    return 0;
  }
  if (mode == "fail_first_attempt") {
    if (EnvInt("TRIDENT_RESTART_COUNT") == 0 && rank == 1) return 5;
    std::printf("attempt %d ok\n", EnvInt("TRIDENT_RESTART_COUNT"));
    return 0;
  }
  if (mode == "sleep") {
    sleep(60);
    return 0;
  }
  std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  return 2;
}
