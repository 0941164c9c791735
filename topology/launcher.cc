#include "topology/launcher.h"

#include <cstdlib>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "topology/distributed_env.h"

extern char** environ;

namespace trident {
namespace {

int signal_pipe_write = -1;  // set while RunLocalGroup runs

void ForwardSignal(int signo) {
  const unsigned char byte = static_cast<unsigned char>(signo);
  if (signal_pipe_write >= 0) (void)!write(signal_pipe_write, &byte, 1);
}

// Installs SIGINT/SIGTERM handlers that write to a pipe; restores the old ones on destruction.
class SignalCatcher {
 public:
  SignalCatcher() {
    if (pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) fds_[0] = fds_[1] = -1;
    signal_pipe_write = fds_[1];
    struct sigaction action = {};
    action.sa_handler = ForwardSignal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalCatcher() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    signal_pipe_write = -1;
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  int read_fd() const { return fds_[0]; }
  // The signal received since the last call, or 0.
  int Take() {
    unsigned char byte = 0;
    int signo = 0;
    while (fds_[0] >= 0 && read(fds_[0], &byte, 1) == 1) signo = byte;
    return signo;
  }

 private:
  int fds_[2];
  struct sigaction old_int_;
  struct sigaction old_term_;
};

// One output stream of one rank, split into lines.
struct Stream {
  int fd = -1;
  int rank = 0;
  bool is_stderr = false;
  std::string partial;
};

struct Child {
  pid_t pid = -1;
  bool running = false;
  RankExit exit;
};

std::string DescribeExit(const RankExit& e) {
  if (e.signal != 0) {
    return absl::StrCat("rank ", e.rank, " was killed by signal ", e.signal, " (", strsignal(e.signal), ")");
  }
  return absl::StrCat("rank ", e.rank, " exited with code ", e.exit_code);
}

void DefaultOutput(int rank, bool is_stderr, absl::string_view line) {
  const bool redraw = !line.empty() && line.back() == '\r';
  std::string text = absl::StrCat("[rank ", rank, "] ", line, redraw ? "" : "\n");
  FILE* out = is_stderr ? stderr : stdout;
  fwrite(text.data(), 1, text.size(), out);
  fflush(out);
}

absl::Status Validate(const LaunchOptions& o) {
  if (o.nproc_per_node < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--nproc_per_node=", o.nproc_per_node, " must be at least 1"));
  }
  if (o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node_rank=", o.node_rank, " must be in [0, --nnodes=", o.nnodes, ")"));
  }
  if (o.command.empty()) {
    return absl::InvalidArgumentError("no program to launch; pass it after '--'");
  }
  if (o.master_port == 0 && o.nnodes > 1) {
    return absl::InvalidArgumentError(
        "--master_port is required with --nnodes > 1 so that all nodes meet at the same port");
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--master_port=", o.master_port, " is not a TCP port"));
  }
  return absl::OkStatus();
}

// The environment of local rank `local_rank`: this process's, with the job layout on top.
std::vector<std::string> RankEnvironment(const LaunchOptions& o, int local_rank, int port, int restart) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  // Each rank gets an equal share of the CPUs the launcher may use (its
  // affinity and cgroup quota) for OpenMP and for OpenBLAS's own thread pool
  // (which reads its variable once, at load time).
  const std::string share = absl::StrCat(std::max(1, UsableCpus() / o.nproc_per_node));
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) {
    if (vars.count(name) == 0) vars[name] = share;
  }
  for (const auto& [key, value] : o.env) vars[key] = value;
  vars["RANK"] = absl::StrCat(o.node_rank * o.nproc_per_node + local_rank);
  vars["WORLD_SIZE"] = absl::StrCat(o.nnodes * o.nproc_per_node);
  vars["LOCAL_RANK"] = absl::StrCat(local_rank);
  vars["LOCAL_WORLD_SIZE"] = absl::StrCat(o.nproc_per_node);
  vars["GROUP_RANK"] = absl::StrCat(o.node_rank);
  vars["MASTER_ADDR"] = o.master_addr;
  vars["MASTER_PORT"] = absl::StrCat(port);
  vars["TRIDENT_RESTART_COUNT"] = absl::StrCat(restart);
  std::vector<std::string> result;
  for (const auto& [key, value] : vars) result.push_back(absl::StrCat(key, "=", value));
  return result;
}

class Attempt {
 public:
  Attempt(const LaunchOptions& options, SignalCatcher& signals, int restart)
      : o_(options), signals_(signals), restart_(restart) {}

  // Runs one attempt. Sets `interrupted` when a signal stopped it.
  absl::Status Run(std::vector<RankExit>* exits, bool* interrupted) {
    const int port = o_.master_port != 0 ? o_.master_port : PickFreePort();
    for (int local = 0; local < o_.nproc_per_node; ++local) {
      absl::Status started = Start(local, port);
      if (!started.ok()) {
        StopAll(SIGKILL);
        Reap(/*block=*/true);
        return started;
      }
    }
    const absl::Time deadline = absl::Now() + o_.timeout;
    absl::Time first_failure = absl::InfiniteFuture();
    absl::Time terminated_at = absl::InfiniteFuture();
    std::string stop_reason;
    int received_signal = 0;
    while (AnyRunning() || AnyStreamOpen()) {
      Pump(absl::Milliseconds(100));
      Reap(/*block=*/false);
      if (int signo = signals_.Take(); signo != 0 && received_signal == 0) {
        received_signal = signo;
        stop_reason = absl::StrCat("interrupted by signal ", signo, " (", strsignal(signo), ")");
        StopAll(signo);
        terminated_at = absl::Now();
      }
      const absl::Time now = absl::Now();
      if (first_failure == absl::InfiniteFuture() && FirstFailure() != nullptr) first_failure = now;
      if (terminated_at == absl::InfiniteFuture() && AnyRunning()) {
        if (now > deadline) {
          stop_reason = absl::StrCat("timed out after ", absl::FormatDuration(o_.timeout));
        }
        if (now > deadline || now > first_failure + o_.failure_grace) {
          StopAll(SIGTERM);
          terminated_at = now;
        }
      }
      if (AnyRunning() && now > terminated_at + (received_signal != 0 ? o_.signal_grace : o_.kill_grace)) {
        StopAll(SIGKILL);
      }
      if (!AnyRunning() && AnyStreamOpen() && now > LastExit() + absl::Seconds(1)) {
        CloseStreams();  // a grandchild still holds the pipe; stop reading it
      }
    }
    exits->clear();
    for (const Child& child : children_) exits->push_back(child.exit);
    *interrupted = received_signal != 0;
    std::vector<int> stopped;
    for (const Child& child : children_) {
      if (child.exit.stopped_by_launcher) stopped.push_back(child.exit.rank);
    }
    std::string stopped_text = stopped.empty() ? "" : absl::StrCat("; stopped rank(s) ", absl::StrJoin(stopped, ", "));
    if (const RankExit* failure = FirstFailure()) {
      return absl::AbortedError(absl::StrCat(DescribeExit(*failure), stopped_text));
    }
    const bool all_exited_cleanly =
        std::all_of(children_.begin(), children_.end(), [](const Child& c) { return c.exit.exit_code == 0; });
    if (received_signal != 0 && all_exited_cleanly) return absl::OkStatus();  // the ranks ended on their own terms
    if (!stop_reason.empty()) {
      return received_signal != 0 ? absl::CancelledError(stop_reason + stopped_text)
                                  : absl::DeadlineExceededError(stop_reason + stopped_text);
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Start(int local_rank, int port) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
    }
    std::vector<std::string> env = RankEnvironment(o_, local_rank, port, restart_);
    std::vector<char*> envp, argv;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> command = o_.command;
    for (std::string& a : command) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      execvpe(argv[0], argv.data(), envp.data());
      const std::string message = absl::StrCat("cannot execute ", argv[0], ": ", strerror(errno), "\n");
      (void)!write(STDERR_FILENO, message.data(), message.size());
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    Child child;
    child.pid = pid;
    child.running = true;
    child.exit.rank = o_.node_rank * o_.nproc_per_node + local_rank;
    children_.push_back(child);
    streams_.push_back({out[0], child.exit.rank, false, ""});
    streams_.push_back({err[0], child.exit.rank, true, ""});
    return absl::OkStatus();
  }

  void Emit(int rank, bool is_stderr, absl::string_view line) {
    if (o_.on_output) {
      o_.on_output(rank, is_stderr, line);
    } else {
      DefaultOutput(rank, is_stderr, line);
    }
  }

  // Reads whatever output is ready (waiting up to `wait`) and emits complete lines.
  void Pump(absl::Duration wait) {
    std::vector<pollfd> fds;
    std::vector<Stream*> owners;
    for (Stream& s : streams_) {
      if (s.fd >= 0) {
        fds.push_back({s.fd, POLLIN, 0});
        owners.push_back(&s);
      }
    }
    fds.push_back({signals_.read_fd(), POLLIN, 0});
    if (poll(fds.data(), fds.size(), static_cast<int>(absl::ToInt64Milliseconds(wait))) <= 0) {
      return;
    }
    char buffer[65536];
    for (size_t i = 0; i < owners.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Stream& s = *owners[i];
      ssize_t n = read(s.fd, buffer, sizeof(buffer));
      if (n > 0) {
        s.partial.append(buffer, n);
        // A line ends at '\n', or at '\r' (kept, so progress bars redraw in place).
        size_t start = 0, end;
        while ((end = s.partial.find_first_of("\n\r", start)) != std::string::npos) {
          const size_t length = end - start + (s.partial[end] == '\r' ? 1 : 0);
          Emit(s.rank, s.is_stderr, absl::string_view(s.partial).substr(start, length));
          start = end + 1;
        }
        s.partial.erase(0, start);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        Close(s);
      }
    }
  }

  void Close(Stream& s) {
    if (!s.partial.empty()) Emit(s.rank, s.is_stderr, s.partial);
    s.partial.clear();
    close(s.fd);
    s.fd = -1;
  }

  void CloseStreams() {
    for (Stream& s : streams_) {
      if (s.fd >= 0) Close(s);
    }
  }

  void Reap(bool block) {
    for (Child& child : children_) {
      if (!child.running) continue;
      int status = 0;
      pid_t done = waitpid(child.pid, &status, block ? 0 : WNOHANG);
      if (done != child.pid) continue;
      child.running = false;
      last_exit_ = absl::Now();
      if (WIFEXITED(status)) {
        child.exit.exit_code = WEXITSTATUS(status);
      } else if (WIFSIGNALED(status)) {
        child.exit.signal = WTERMSIG(status);
      }
      // Kill whatever the rank left behind in its process group.
      kill(-child.pid, SIGKILL);
      if (child.exit.exit_code != 0 && !child.exit.stopped_by_launcher) {
        failure_order_.push_back(&child - children_.data());
      }
    }
  }

  void StopAll(int signo) {
    for (Child& child : children_) {
      if (!child.running) continue;
      child.exit.stopped_by_launcher = true;
      kill(-child.pid, signo);
    }
  }

  const RankExit* FirstFailure() const {
    return failure_order_.empty() ? nullptr : &children_[failure_order_.front()].exit;
  }
  bool AnyRunning() const {
    return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; });
  }
  bool AnyStreamOpen() const {
    return std::any_of(streams_.begin(), streams_.end(), [](const Stream& s) { return s.fd >= 0; });
  }
  absl::Time LastExit() const { return last_exit_; }

  const LaunchOptions& o_;
  SignalCatcher& signals_;
  const int restart_;
  std::vector<Child> children_;
  std::vector<Stream> streams_;
  std::vector<size_t> failure_order_;
  absl::Time last_exit_ = absl::InfinitePast();
};

}  // namespace

int PickFreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 29500;
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  int port = 29500;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

int RestartCount() {
  const char* count = std::getenv("TRIDENT_RESTART_COUNT");
  return count != nullptr ? std::atoi(count) : 0;
}

std::optional<absl::Status> RunAsLocalJobUnlessLaunched(int nproc, int argc, char** argv, LaunchOptions options) {
  if (HasDistributedEnv()) return std::nullopt;
  options.nproc_per_node = nproc;
  options.command = {"/proc/self/exe"};
  for (int i = 1; i < argc; ++i) options.command.push_back(argv[i]);
  return RunLocalGroup(options).status;
}

LaunchResult RunLocalGroup(const LaunchOptions& options) {
  LaunchResult result;
  result.status = Validate(options);
  if (!result.status.ok()) return result;
  SignalCatcher signals;
  for (int attempt = 0;; ++attempt) {
    bool interrupted = false;
    Attempt run(options, signals, attempt);
    result.status = run.Run(&result.exits, &interrupted);
    result.restarts = attempt;
    if (result.status.ok() || interrupted || attempt >= options.max_restarts) break;
    const std::string note =
        absl::StrCat("launcher: ", result.status.message(), "; restarting the local group (restart ", attempt + 1,
                     " of ", options.max_restarts, ")\n");
    fwrite(note.data(), 1, note.size(), stderr);
  }
  if (!result.status.ok() && result.restarts > 0) {
    result.status = absl::Status(result.status.code(),
                                 absl::StrCat(result.status.message(), " (after ", result.restarts, " restart(s))"));
  }
  return result;
}

}  // namespace trident
