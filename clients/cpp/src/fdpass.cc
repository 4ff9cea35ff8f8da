// Passing a sealed memfd to the server's fd socket: the client side of
// kvsvc/fdpass.py. Connect a SOCK_SEQPACKET socket to
// GetServerInfoResult.fd_socket (or Options::fd_socket), send kLeaseMagic with
// exactly one fd in SCM_RIGHTS, and read one reply: 0x00 then the token, or
// 0x01 then a serialized RemoteError. The connection stays open for the next
// passes: it is the lease that keeps the server's mappings of those memfds
// alive, and its end (this client destroyed, or the process dead) releases them.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <system_error>
#include <vector>

#include "kvsvc/client.h"

namespace kvsvc {
namespace {
constexpr char kLeaseMagic[] = "kvsvc-fd/L";  // fdpass.LEASE_MAGIC
constexpr const char* kMethod = "RegisterMemfd";

[[noreturn]] void fd_socket_unavailable(const std::string& path, const std::string& message) {
  ErrorInfo info;
  info.class_name = "ServiceUnavailable";
  info.code = grpc::StatusCode::UNAVAILABLE;
  info.reason = "FD_SOCKET_UNAVAILABLE";
  info.message = message;
  info.metadata = {{"path", path}};
  info.retryable = true;
  info.method = kMethod;
  throw_error(std::move(info));
}

[[noreturn]] void fd_socket_timeout(const std::string& path) {
  ErrorInfo info;
  info.class_name = "DeadlineExceeded";
  info.code = grpc::StatusCode::DEADLINE_EXCEEDED;
  info.reason = "FD_SOCKET_TIMEOUT";
  info.message = "the fd socket " + path + " did not answer before the deadline";
  info.metadata = {{"path", path}};
  info.method = kMethod;
  throw_error(std::move(info));
}

// A failed connect, send or recv: the deadline's, else the socket's.
[[noreturn]] void fd_socket_error(const std::string& path, int err) {
  if (err == EAGAIN || err == EWOULDBLOCK || err == ETIMEDOUT || err == EINPROGRESS) {
    fd_socket_timeout(path);
  }
  fd_socket_unavailable(path, "cannot pass an fd through " + path + ": " + std::strerror(err));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// Sets the socket's send and receive timeouts to what is left until deadline.
void bound(int sock, const std::string& path, std::chrono::system_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(
      deadline - std::chrono::system_clock::now());
  if (left.count() <= 0) fd_socket_timeout(path);
  timeval tv{static_cast<time_t>(left.count() / 1000000),
             static_cast<suseconds_t>(left.count() % 1000000)};
  if (::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0 ||
      ::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0) {
    fd_socket_error(path, errno);
  }
}

// A connected SOCK_SEQPACKET socket to the fd socket at path.
int connect_fd_socket(const std::string& path, std::chrono::system_clock::time_point deadline) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    fd_socket_unavailable(path, "the fd socket path " + path + " is too long");
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  Fd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) fd_socket_error(path, errno);
  bound(sock.get(), path, deadline);
  int rc;
  do {
    rc = ::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) fd_socket_error(path, errno);
  return sock.release();
}

// One pass on the connected sock: kLeaseMagic with fd; the token or a throw.
std::string exchange(int sock, const std::string& path, int fd,
                     std::chrono::system_clock::time_point deadline) {
  iovec iov{const_cast<char*>(kLeaseMagic), sizeof kLeaseMagic - 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  ssize_t n;
  do {
    bound(sock, path, deadline);
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) fd_socket_error(path, errno);

  std::string reply(1 << 16, '\0');
  do {
    bound(sock, path, deadline);
    n = ::recv(sock, reply.data(), reply.size(), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) fd_socket_error(path, errno);
  reply.resize(static_cast<size_t>(n));
  if (reply.size() > 1 && reply[0] == '\0') return reply.substr(1);
  if (!reply.empty() && reply[0] == '\1') {
    v1::RemoteError env;
    if (!env.ParseFromString(reply.substr(1))) {
      fd_socket_unavailable(path, "the fd socket " + path + " answered an unreadable error");
    }
    throw_error(from_remote_error(env, kMethod));
  }
  fd_socket_unavailable(path, "the fd socket " + path + " closed without an answer");
}
}  // namespace

// The lease connection: opened on the first pass, closed with the client.
// Connections whose exchange failed midway are kept (their passes stay leased)
// but not reused: a late reply there could be taken for the next pass's.
struct Client::FdLease {
  std::mutex mu;
  std::string path;
  int sock = -1;
  std::vector<int> retired;
  ~FdLease() {
    if (sock >= 0) ::close(sock);
    for (int fd : retired) ::close(fd);
  }
};

std::string Client::RegisterMemfd(int fd, const CallOptions& call) {
  Millis timeout = control_timeout_;
  if (call.timeout) {
    validate_timeout(*call.timeout, "timeout");
    timeout = *call.timeout;
  }
  const auto deadline = std::chrono::system_clock::now() + timeout;
  std::string path = fd_socket_;
  if (path.empty()) {
    CallOptions info_call;
    info_call.timeout = timeout;
    info_call.cancel = call.cancel;  // the fd exchange after it is bounded by the deadline only
    const v1::GetServerInfoResult info = GetServerInfo(info_call);
    if (info.fd_socket().empty()) {
      ErrorInfo e;
      e.class_name = "Unimplemented";
      e.code = grpc::StatusCode::UNIMPLEMENTED;
      e.reason = "FD_PASSING_DISABLED";
      e.message =
          "the server has no fd socket (--fd-socket off, or it could not make one: see its "
          "log), so it takes no memfds; map a file under its shm dir instead";
      e.method = kMethod;
      throw_error(std::move(e));
    }
    path = info.fd_socket();
  }
  auto lease = std::atomic_load(&fd_lease_);
  if (!lease) {
    auto made = std::make_shared<FdLease>();
    std::shared_ptr<FdLease> none;
    std::atomic_compare_exchange_strong(&fd_lease_, &none, made);
    lease = std::atomic_load(&fd_lease_);
  }
  std::lock_guard<std::mutex> lock(lease->mu);
  if (lease->sock >= 0 && lease->path != path) {  // the server moved: a new lease there
    lease->retired.push_back(lease->sock);
    lease->sock = -1;
  }
  if (lease->sock < 0) {
    lease->sock = connect_fd_socket(path, deadline);
    lease->path = path;
  }
  try {
    return exchange(lease->sock, path, fd, deadline);
  } catch (const KVServiceError& e) {
    const std::string& r = e.reason();
    if (r == "FD_SOCKET_TIMEOUT" || r == "FD_SOCKET_UNAVAILABLE" || r == "FD_SOCKET_BUSY") {
      lease->retired.push_back(lease->sock);  // the next pass opens a new connection
      lease->sock = -1;
    }
    throw;
  }
}

int make_sealed_memfd(const std::string& name, uint64_t size) {
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "memfd_create");
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::system_error(err, std::generic_category(), "sealing a memfd");
  }
  return fd;
}

}  // namespace kvsvc
