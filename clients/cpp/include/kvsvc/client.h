// A small C++17 client for kvsvc.v1.KVCacheService: Map (files under the
// server's --shm-dir or sealed memfds passed over its fd socket), Unmap, block
// and inline Store/Retrieve, Lookup, Fence, GetServerInfo and the
// grpc.health.v1 check, with a deadline on every call and a typed exception
// (kvsvc/errors.h) for every RemoteError and transport failure.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "kvsvc/errors.h"
#include "kvsvc/v1/kv_cache_service.grpc.pb.h"

namespace kvsvc {

using Millis = std::chrono::milliseconds;
using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

// Bounds Store, Retrieve, Put, Get, Unmap and Fence without a per-call timeout.
inline constexpr Millis kDefaultTransferTimeout{30000};
// Bounds every other call without a per-call timeout.
inline constexpr Millis kDefaultControlTimeout{5000};
// The grpc.health.v1 name of the service ("" is the whole server).
inline constexpr const char* kHealthServiceName = "kvsvc.v1.KVCacheService";

// Throws InvalidDeadline (INVALID_DEADLINE) unless timeout > 0; names the setting.
void validate_timeout(Millis timeout, const std::string& setting);

struct Options {
  Millis transfer_timeout = kDefaultTransferTimeout;
  Millis control_timeout = kDefaultControlTimeout;
  // Insecure when null; pass grpc::SslCredentials(...) for TLS.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // The server's fd socket as this process sees it, when not where the server
  // says (another container mounts the socket directory elsewhere).
  std::string fd_socket;
};

// Cancels the calls it is passed to (CallOptions::cancel), from any thread: a
// running call ends with Cancelled (TRANSPORT_CANCELLED), or TransferUnprovable
// for a block transfer that may have reached the server; a later call with a
// cancelled token throws Cancelled without sending anything.
class CancelToken {
 public:
  void cancel();
  bool cancelled() const;

 private:
  friend class Client;
  mutable std::mutex mu_;
  bool cancelled_ = false;
  std::vector<grpc::ClientContext*> running_;
};

// Adjusts one call.
struct CallOptions {
  // Bounds this call instead of the default; must be > 0.
  std::optional<Millis> timeout;
  // For a transfer, the transfer id that Fence takes; random (32 hex) if empty.
  std::string request_id;
  // Lets another thread cancel this call.
  std::shared_ptr<CancelToken> cancel;
};

// One inline chunk: a key and its bytes.
struct Chunk {
  std::string key;
  std::string data;
};

// One block chunk: a key and the mapped blocks that hold it.
struct BlockChunk {
  std::string key;
  std::vector<uint32_t> block_ids;
};

// Thread-safe; connects lazily, so an unreachable server shows up as
// ServiceUnavailable on the first call.
class Client {
 public:
  explicit Client(const std::string& target, Options options = {});

  Millis transfer_timeout() const { return transfer_timeout_; }
  Millis control_timeout() const { return control_timeout_; }

  // Maps the KV tensors of one engine's ranks (all or none).
  v1::MapResult Map(v1::MapRequest request, const CallOptions& call = {});
  // Fences a mapping's copies and releases it.
  v1::UnmapResult Unmap(const std::string& mapping_id, const CallOptions& call = {});

  // Copies mapped blocks into the store. A Store whose reply is lost after it
  // may have reached the server throws TransferUnprovable: Fence its request
  // id before reusing the blocks.
  v1::StoreResult Store(const std::string& mapping_id, const std::vector<BlockChunk>& chunks,
                        const CallOptions& call = {});
  // Copies stored chunks into mapped blocks; loading stops at the first miss.
  v1::RetrieveResult Retrieve(const std::string& mapping_id,
                              const std::vector<BlockChunk>& chunks,
                              const CallOptions& call = {});
  // Inline put: chunks sent in the request; keys already present are skipped.
  v1::StoreResult Put(const std::string& ns, const std::vector<Chunk>& chunks,
                      const CallOptions& call = {});
  // Inline get: the leading present chunks of keys, in the response.
  v1::RetrieveResult Get(const std::string& ns, const std::vector<std::string>& keys,
                         const CallOptions& call = {});
  // One chunk, inline; a miss throws Miss (CHUNK_NOT_FOUND) here.
  std::string GetOne(const std::string& ns, const std::string& key, const CallOptions& call = {});
  // The number of leading keys present in a namespace (any layout).
  v1::LookupResult Lookup(const std::string& ns, const std::vector<std::string>& keys,
                          const CallOptions& call = {});
  // The number of leading keys present in a mapping's layout.
  v1::LookupResult LookupMapping(const std::string& mapping_id,
                                 const std::vector<std::string>& keys,
                                 const CallOptions& call = {});
  // Returns once no copy of the mapping (if not "") or of the listed transfers
  // runs; ids the server never saw are barred from ever starting.
  v1::FenceResult Fence(const std::string& mapping_id,
                        const std::vector<std::string>& transfer_ids,
                        const CallOptions& call = {});
  v1::GetServerInfoResult GetServerInfo(const CallOptions& call = {});
  // grpc.health.v1 Check of service ("" or kHealthServiceName).
  ServingStatus HealthCheck(const std::string& service = "", const CallOptions& call = {});

  // Passes fd, a sealed memfd (make_sealed_memfd), to the server's fd socket
  // and returns the token a SealedMemfdHandle names in a Map. fd stays the
  // caller's. It goes over this client's lease connection, kept open until the
  // client is destroyed: the server keeps mappings of the memfd while it is
  // open and releases them when it closes (the client is destroyed, or this
  // process dies, in any container). One deadline (the control timeout by
  // default) covers asking GetServerInfo for the socket (skipped when
  // Options::fd_socket is set) and the exchange. Throws Unimplemented
  // (FD_PASSING_DISABLED) when the server has no fd socket,
  // ServiceUnavailable (FD_SOCKET_UNAVAILABLE), DeadlineExceeded
  // (FD_SOCKET_TIMEOUT), or what the server refuses the fd with (e.g.
  // InvalidRequest FD_NOT_SEALED).
  std::string RegisterMemfd(int fd, const CallOptions& call = {});

  // The raw requests, sent as given (the header is filled in).
  v1::StoreResult Store(v1::StoreRequest request, const CallOptions& call = {});
  v1::RetrieveResult Retrieve(v1::RetrieveRequest request, const CallOptions& call = {});
  v1::LookupResult Lookup(v1::LookupRequest request, const CallOptions& call = {});

 private:
  struct Plan;
  // Runs rpc on a context with plan's deadline, registered with plan's cancel token.
  template <class Rpc>
  grpc::Status run(const Plan& plan, Rpc rpc);
  Plan prepare(const char* method, bool long_call, bool transfer, v1::RequestHeader* header,
               const CallOptions& call) const;
  template <class Resp, class Rpc>
  auto unary(const Plan& plan, Rpc rpc) -> std::decay_t<decltype(std::declval<Resp>().result())>;

  struct FdLease;  // fdpass.cc: the lease connection, made on first use
  std::shared_ptr<FdLease> fd_lease_;
  std::string fd_socket_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KVCacheService::Stub> kv_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  Millis transfer_timeout_;
  Millis control_timeout_;
};

// A memfd of size bytes with F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL, close-on-exec:
// what the server requires. mmap it MAP_SHARED and close it when done.
// Throws std::system_error.
int make_sealed_memfd(const std::string& name, uint64_t size);

// A 32-hex-digit random id.
std::string new_request_id();

}  // namespace kvsvc
