// The error contract of kvsvc, mirrored from kvsvc/errors/: one exception
// class per way a caller reacts. Every failed call throws one of the classes
// below, and the C++ inheritance follows the Python hierarchy: a
// kvsvc::UnsupportedRequest is also a kvsvc::InvalidRequest, a MappingLost a
// NotFound, and every class a kvsvc::KVServiceError. tests/errors_test.cc
// checks this table against the reason catalogue (proto/kvsvc/v1/reasons.json).
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvsvc/v1/error.pb.h"

namespace kvsvc {

// The RemoteError envelope version this client reads and sends.
inline constexpr uint32_t kEnvelopeVersion = 1;

// Every field of an error, whatever the server sent.
struct ErrorInfo {
  std::string class_name;  // the class thrown, e.g. "MappingLost"
  std::string message;     // at most 4096 bytes from a server
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;  // as received
  std::string reason;  // stable UPPER_SNAKE id, e.g. "MAPPING_NOT_FOUND"
  std::map<std::string, std::string> metadata;  // every dynamic value of the message
  std::string request_id;  // for a transfer: the transfer id that Fence takes
  bool retryable = false;  // repeating the same request here may succeed
  // What a failed transfer did to the caller's buffers; UNKNOWN: fence first.
  v1::TransferState transfer_state = v1::TRANSFER_STATE_UNSPECIFIED;
  std::string type;  // the server's exception class, or class_name for client errors
  bool message_truncated = false;
  bool remote = false;  // an in-band RemoteError (false: transport or client)
  std::string method;   // the RPC that failed, e.g. "Store" or "Health.Check"
  uint32_t envelope_version = 0;
};

// The base of every kvsvc error.
class KVServiceError : public std::runtime_error {
 public:
  explicit KVServiceError(ErrorInfo info);
  const ErrorInfo& info() const noexcept { return info_; }
  const std::string& class_name() const noexcept { return info_.class_name; }
  const std::string& reason() const noexcept { return info_.reason; }
  grpc::StatusCode code() const noexcept { return info_.code; }
  const std::string& request_id() const noexcept { return info_.request_id; }
  const std::map<std::string, std::string>& metadata() const noexcept { return info_.metadata; }
  bool retryable() const noexcept { return info_.retryable; }
  v1::TransferState transfer_state() const noexcept { return info_.transfer_state; }
  // False when a copy of the failed call may still be running: Fence first.
  bool buffers_reusable() const noexcept {
    return info_.transfer_state != v1::TRANSFER_STATE_UNKNOWN;
  }

 private:
  ErrorInfo info_;
};

#define KVSVC_ERROR_CLASS(Name, Parent)  \
  class Name : public Parent {           \
   public:                               \
    using Parent::Parent;                \
  };
// The caller fixes its input or falls back (recompute).
KVSVC_ERROR_CLASS(InvalidRequest, KVServiceError)
// A request this server does not understand (unset oneof, newer envelope).
KVSVC_ERROR_CLASS(UnsupportedRequest, InvalidRequest)
// Request bytes the server could not parse as the method's message.
KVSVC_ERROR_CLASS(MalformedRequest, InvalidRequest)
// A timeout that is not > 0, refused by this client before sending.
KVSVC_ERROR_CLASS(InvalidDeadline, InvalidRequest)
// Chunks only load into the layout they were stored with.
KVSVC_ERROR_CLASS(LayoutMismatch, KVServiceError)
// Something named by the request does not exist.
KVSVC_ERROR_CLASS(NotFound, KVServiceError)
// A chunk the caller required is not in the store.
KVSVC_ERROR_CLASS(Miss, NotFound)
// The mapping is unknown (server restarted or unmapped): map again.
KVSVC_ERROR_CLASS(MappingLost, NotFound)
// A CUDA IPC handle reached a server without CUDA; no retry can help.
KVSVC_ERROR_CLASS(CudaUnavailable, KVServiceError)
// The chunk store cannot hold the data.
KVSVC_ERROR_CLASS(CapacityExhausted, KVServiceError)
// The caller's tenant may not do this; nothing is said about what exists.
KVSVC_ERROR_CLASS(PermissionDenied, KVServiceError)
// No valid credentials (a missing, unknown or expired token).
KVSVC_ERROR_CLASS(Unauthenticated, KVServiceError)
// The server does not implement the call.
KVSVC_ERROR_CLASS(Unimplemented, KVServiceError)
// The call's deadline passed.
KVSVC_ERROR_CLASS(DeadlineExceeded, KVServiceError)
// The call was cancelled.
KVSVC_ERROR_CLASS(Cancelled, KVServiceError)
// The transport failed (connection refused or lost); a retry may succeed.
KVSVC_ERROR_CLASS(ServiceUnavailable, KVServiceError)
// The instance had a fatal failure or is shutting down: go elsewhere.
KVSVC_ERROR_CLASS(ServiceNotServing, KVServiceError)
// A copy may still be writing the caller's blocks: Fence its request id first.
KVSVC_ERROR_CLASS(TransferUnprovable, KVServiceError)
// A mapped region cannot be used (missing, too small, truncated).
KVSVC_ERROR_CLASS(RegionUnavailable, KVServiceError)
// A server handler failed unexpectedly; see the server log.
KVSVC_ERROR_CLASS(RemoteHandlerError, KVServiceError)
// A stored chunk failed its checksum on the server.
KVSVC_ERROR_CLASS(DataLoss, RemoteHandlerError)
// Device error or dead transfer worker: the instance stops serving.
KVSVC_ERROR_CLASS(FatalServerError, RemoteHandlerError)
#undef KVSVC_ERROR_CLASS

// One class of the table: kvsvc.errors' declaration.
struct ErrorClass {
  std::string name;
  std::string parent;  // "" for KVServiceError itself
  grpc::StatusCode code;
  std::string reason;
  bool retryable;
};

// Every class, KVServiceError first, in kvsvc.errors' declaration order.
const std::vector<ErrorClass>& error_classes();

// Whether e is (a subclass of) the named class, by C++ type (dynamic_cast).
bool is_instance(const KVServiceError& e, const std::string& class_name);

// The canonical UPPER_SNAKE name of a gRPC code ("DEADLINE_EXCEEDED").
std::string code_name(grpc::StatusCode code);

// kvsvc.errors' from_remote_error: transfer state UNKNOWN gives
// TransferUnprovable, else the class named by the envelope's type, else by
// its reason, else the default class of its code.
ErrorInfo from_remote_error(const v1::RemoteError& env, const std::string& method);

// kvsvc.errors' from_grpc_error: with transfer_started, a block transfer whose
// reply was lost after it may have reached the server is TransferUnprovable.
ErrorInfo from_status(const grpc::Status& status, const std::string& request_id,
                      const std::string& method, bool transfer, bool transfer_started);

// Fills the class defaults (type) and throws info as its class.
[[noreturn]] void throw_error(ErrorInfo info);

}  // namespace kvsvc
