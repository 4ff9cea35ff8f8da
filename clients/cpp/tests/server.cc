#include "server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <stdexcept>

namespace kvsvc_test {
namespace {
constexpr auto kStartupTimeout = std::chrono::seconds(60);
}

std::unique_ptr<TestServer> TestServer::start(const std::string& failpoints,
                                              const std::vector<std::string>& args) {
  const char* env_bin = std::getenv("KVSVC_BIN");
  const std::string bin = env_bin != nullptr && *env_bin ? env_bin : KVSVC_DEFAULT_BIN;
  std::string tmpl = (std::filesystem::temp_directory_path() / "kvsvc-cpp-shm-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  std::unique_ptr<TestServer> s(new TestServer());
  s->shm_dir_ = tmpl;
  std::vector<std::string> argv_s = {bin,          "serve",      "--listen", "127.0.0.1:0",
                                     "--shm-dir",  tmpl,         "--shutdown-grace", "1",
                                     "--device",   "cpu"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string fp_env = "KVSVC_FAILPOINTS=" + failpoints;

  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    // Its own process group (stop kills all of it), killed by the kernel if
    // the test process dies first.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(pipefd[1], 1);
    ::dup2(pipefd[1], 2);
    ::putenv(const_cast<char*>(fp_env.c_str()));
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(pipefd[1]);
  s->pid_ = pid;
  s->reader_ = std::thread([srv = s.get(), fd = pipefd[0]] { srv->read_log(fd); });
  std::unique_lock<std::mutex> lock(s->mu_);
  const bool up = s->cv_.wait_for(lock, kStartupTimeout, [&] { return !s->addr_.empty() || s->eof_; });
  if (!up || s->addr_.empty()) {
    const std::string log = s->log_;
    lock.unlock();
    s->stop();
    throw std::runtime_error(bin + " exited or did not serve within 60 s:\n" + log);
  }
  return s;
}

void TestServer::read_log(int fd) {
  static const std::regex serving(R"(serving on (127\.0\.0\.1:\d+))");
  std::string pending;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    std::lock_guard<std::mutex> lock(mu_);
    if (log_.size() < (1 << 20)) log_.append(buf, static_cast<size_t>(n));
    if (addr_.empty()) {
      std::smatch m;
      if (std::regex_search(log_, m, serving)) {
        addr_ = m[1];
        cv_.notify_all();
      }
    }
  }
  ::close(fd);
  std::lock_guard<std::mutex> lock(mu_);
  eof_ = true;
  cv_.notify_all();
}

std::string TestServer::log() {
  std::lock_guard<std::mutex> lock(mu_);
  return log_;
}

void TestServer::kill_now() {
  if (pid_ > 0) ::kill(-pid_, SIGKILL);
}

void TestServer::stop() {
  if (pid_ > 0 && !reaped_) {
    ::kill(-pid_, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (::waitpid(pid_, nullptr, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(-pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::kill(-pid_, SIGKILL);  // whatever the server left behind
    reaped_ = true;
  }
  if (reader_.joinable()) reader_.join();
  if (!shm_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(shm_dir_, ec);
    shm_dir_.clear();
  }
}

TestServer::~TestServer() { stop(); }

std::string refused_address() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(s);
  return "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
}

}  // namespace kvsvc_test
