// The class table of kvsvc/errors/ and the two mappings into it.
#include "kvsvc/errors.h"

#include <functional>
#include <type_traits>
#include <utility>

namespace kvsvc {

KVServiceError::KVServiceError(ErrorInfo info)
    : std::runtime_error(info.class_name + ": " + info.message + " [" + info.reason +
                         (info.request_id.empty() ? "" : " request_id=" + info.request_id) + "]"),
      info_(std::move(info)) {}

namespace {
using SC = grpc::StatusCode;

struct Entry {
  ErrorClass cls;
  std::function<void(ErrorInfo)> raise;             // throws the class
  std::function<bool(const KVServiceError&)> test;  // dynamic_cast to the class
};

template <class T>
Entry entry(const char* name, const char* parent, SC code, const char* reason, bool retryable) {
  return Entry{ErrorClass{name, parent, code, reason, retryable},
               [](ErrorInfo info) { throw T(std::move(info)); },
               [](const KVServiceError& e) {
                 if constexpr (std::is_same_v<T, KVServiceError>) {
                   return true;
                 } else {
                   return dynamic_cast<const T*>(&e) != nullptr;
                 }
               }};
}

const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = {
      entry<KVServiceError>("KVServiceError", "", SC::UNKNOWN, "UNKNOWN", false),
      entry<InvalidRequest>("InvalidRequest", "KVServiceError", SC::INVALID_ARGUMENT,
                            "INVALID_ARGUMENT", false),
      entry<UnsupportedRequest>("UnsupportedRequest", "InvalidRequest", SC::INVALID_ARGUMENT,
                                "UNSUPPORTED_REQUEST", false),
      entry<MalformedRequest>("MalformedRequest", "InvalidRequest", SC::INVALID_ARGUMENT,
                              "MALFORMED_REQUEST", false),
      entry<InvalidDeadline>("InvalidDeadline", "InvalidRequest", SC::INVALID_ARGUMENT,
                             "INVALID_DEADLINE", false),
      entry<LayoutMismatch>("LayoutMismatch", "KVServiceError", SC::FAILED_PRECONDITION,
                            "LAYOUT_MISMATCH", false),
      entry<NotFound>("NotFound", "KVServiceError", SC::NOT_FOUND, "NOT_FOUND", false),
      entry<Miss>("Miss", "NotFound", SC::NOT_FOUND, "CHUNK_NOT_FOUND", false),
      entry<MappingLost>("MappingLost", "NotFound", SC::NOT_FOUND, "MAPPING_NOT_FOUND", false),
      entry<CudaUnavailable>("CudaUnavailable", "KVServiceError", SC::FAILED_PRECONDITION,
                             "CUDA_UNAVAILABLE", false),
      entry<CapacityExhausted>("CapacityExhausted", "KVServiceError", SC::RESOURCE_EXHAUSTED,
                               "CAPACITY_EXHAUSTED", false),
      entry<PermissionDenied>("PermissionDenied", "KVServiceError", SC::PERMISSION_DENIED,
                              "PERMISSION_DENIED", false),
      entry<Unauthenticated>("Unauthenticated", "KVServiceError", SC::UNAUTHENTICATED,
                             "UNAUTHENTICATED", false),
      entry<Unimplemented>("Unimplemented", "KVServiceError", SC::UNIMPLEMENTED, "UNIMPLEMENTED",
                           false),
      entry<DeadlineExceeded>("DeadlineExceeded", "KVServiceError", SC::DEADLINE_EXCEEDED,
                              "DEADLINE_EXCEEDED", false),
      entry<Cancelled>("Cancelled", "KVServiceError", SC::CANCELLED, "CANCELLED", false),
      entry<ServiceUnavailable>("ServiceUnavailable", "KVServiceError", SC::UNAVAILABLE,
                                "TRANSPORT_UNAVAILABLE", true),
      entry<ServiceNotServing>("ServiceNotServing", "KVServiceError", SC::UNAVAILABLE,
                               "SERVICE_NOT_SERVING", false),
      entry<TransferUnprovable>("TransferUnprovable", "KVServiceError", SC::UNKNOWN,
                                "TRANSFER_UNPROVABLE", false),
      entry<RegionUnavailable>("RegionUnavailable", "KVServiceError", SC::FAILED_PRECONDITION,
                               "REGION_UNAVAILABLE", false),
      entry<RemoteHandlerError>("RemoteHandlerError", "KVServiceError", SC::INTERNAL,
                                "HANDLER_FAILED", false),
      entry<DataLoss>("DataLoss", "RemoteHandlerError", SC::DATA_LOSS, "CHECKSUM_MISMATCH", false),
      entry<FatalServerError>("FatalServerError", "RemoteHandlerError", SC::INTERNAL,
                              "FATAL_SERVER_ERROR", false),
  };
  return table;
}

const Entry* find(const std::string& name) {
  for (const auto& e : entries()) {
    if (e.cls.name == name) return &e;
  }
  return nullptr;
}

// The class picked by a reason: the class whose own reason it is.
std::string by_reason(const std::string& reason) {
  for (const auto& e : entries()) {
    if (e.cls.name != "KVServiceError" && e.cls.reason == reason) return e.cls.name;
  }
  return "";
}

// The default class of a code: the first declared for it; UNAVAILABLE is a
// transport failure, UNKNOWN and INTERNAL a handler failure.
std::string by_code(SC code) {
  if (code == SC::UNAVAILABLE) return "ServiceUnavailable";
  if (code == SC::UNKNOWN || code == SC::INTERNAL) return "RemoteHandlerError";
  for (const auto& e : entries()) {
    if (e.cls.name != "KVServiceError" && e.cls.code == code) return e.cls.name;
  }
  return "";
}

// A code this client does not know picks a class as UNKNOWN, as in kvsvc.errors.
SC class_code(SC code) {
  return static_cast<int>(code) > static_cast<int>(SC::UNAUTHENTICATED) ? SC::UNKNOWN : code;
}
}  // namespace

const std::vector<ErrorClass>& error_classes() {
  static const std::vector<ErrorClass> classes = [] {
    std::vector<ErrorClass> out;
    for (const auto& e : entries()) out.push_back(e.cls);
    return out;
  }();
  return classes;
}

bool is_instance(const KVServiceError& e, const std::string& class_name) {
  const Entry* entry = find(class_name);
  return entry != nullptr && entry->test(e);
}

std::string code_name(SC code) {
  const int n = static_cast<int>(code);
  if (n == 0) return "OK";
  if (n > 0 && n <= 16) {
    std::string name = v1::Code_Name(static_cast<v1::Code>(n));
    return name.substr(5);  // "CODE_"
  }
  return "CODE_" + std::to_string(n);
}

ErrorInfo from_remote_error(const v1::RemoteError& env, const std::string& method) {
  ErrorInfo info;
  info.code = static_cast<SC>(env.code());
  if (env.transfer_state() == v1::TRANSFER_STATE_UNKNOWN) {
    info.class_name = "TransferUnprovable";
  } else if (!env.type().empty() && find(env.type()) != nullptr) {
    info.class_name = env.type();
  } else if (!by_reason(env.reason()).empty()) {
    info.class_name = by_reason(env.reason());
  } else if (env.code() != v1::CODE_UNSPECIFIED) {
    info.class_name = by_code(class_code(info.code));
  }
  info.message = env.message();
  info.reason = env.reason();
  info.metadata.insert(env.metadata().begin(), env.metadata().end());
  info.request_id = env.request_id();
  info.retryable = env.retryable();
  info.transfer_state = env.transfer_state();
  info.type = env.type();
  info.message_truncated = env.message_truncated();
  info.remote = true;
  info.method = method;
  info.envelope_version = env.envelope_version();
  return info;
}

ErrorInfo from_status(const grpc::Status& status, const std::string& request_id,
                      const std::string& method, bool transfer, bool transfer_started) {
  ErrorInfo info;
  info.code = status.error_code();
  const std::string details =
      status.error_message().empty() ? code_name(info.code) : status.error_message();
  info.metadata["grpcCode"] = code_name(info.code);
  info.request_id = request_id;
  info.method = method;
  if (transfer && transfer_started && info.code != SC::UNIMPLEMENTED) {
    info.class_name = "TransferUnprovable";
    info.message = "transfer outcome unknown after " + code_name(info.code) + ": " + details;
    info.reason = "TRANSFER_UNPROVABLE";
    info.transfer_state = v1::TRANSFER_STATE_UNKNOWN;
    return info;
  }
  info.class_name = by_code(class_code(info.code));
  if (info.class_name == "RemoteHandlerError") info.class_name = "";  // nothing ran remotely
  info.message = details;
  info.reason = "TRANSPORT_" + code_name(info.code);
  info.retryable = info.code == SC::UNAVAILABLE;
  if (transfer) info.transfer_state = v1::TRANSFER_STATE_NOT_STARTED;
  return info;
}

void throw_error(ErrorInfo info) {
  const Entry* entry = find(info.class_name);
  if (entry == nullptr) {
    info.class_name = "KVServiceError";
    entry = find(info.class_name);
  }
  if (info.type.empty()) info.type = info.class_name;
  entry->raise(std::move(info));
  throw KVServiceError(ErrorInfo{});  // unreachable: raise always throws
}

}  // namespace kvsvc
