// Starts real `kvsvc serve` processes on 127.0.0.1 for the tests and stops them.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvsvc_test {

class TestServer {
 public:
  // $KVSVC_BIN (else the CMake-configured path) serve on 127.0.0.1:0 with
  // KVSVC_FAILPOINTS=failpoints; throws std::runtime_error with its log if it
  // does not serve within 60 s.
  static std::unique_ptr<TestServer> start(const std::string& failpoints = "",
                                           const std::vector<std::string>& args = {});
  ~TestServer();
  const std::string& addr() const { return addr_; }
  const std::string& shm_dir() const { return shm_dir_; }
  std::string log();
  // SIGKILL to the whole process group, at once.
  void kill_now();
  // SIGTERM, then SIGKILL after 5 s; idempotent.
  void stop();

 private:
  TestServer() = default;
  void read_log(int fd);
  std::string addr_;
  std::string shm_dir_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string log_;
  bool eof_ = false;
};

// A 127.0.0.1 address on which nothing listens.
std::string refused_address();

}  // namespace kvsvc_test
