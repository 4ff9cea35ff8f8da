#include "kvsvc/client.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <system_error>
#include <utility>

namespace kvsvc {
namespace {
// The server's limit too (kvsvc/config.py).
constexpr int kMaxMessageBytes = 256 << 20;

ErrorInfo client_error(const char* class_name, grpc::StatusCode code, std::string reason,
                       std::string message, const std::string& method) {
  ErrorInfo info;
  info.class_name = class_name;
  info.code = code;
  info.reason = std::move(reason);
  info.message = std::move(message);
  info.method = method;
  return info;
}
}  // namespace

void validate_timeout(Millis timeout, const std::string& setting) {
  if (timeout.count() <= 0) {
    ErrorInfo info = client_error("InvalidDeadline", grpc::StatusCode::INVALID_ARGUMENT,
                                  "INVALID_DEADLINE",
                                  setting + " must be > 0 ms, got " +
                                      std::to_string(timeout.count()) + " ms",
                                  "");
    info.metadata = {{"setting", setting}, {"timeoutMs", std::to_string(timeout.count())}};
    throw_error(std::move(info));
  }
}

std::string new_request_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* hex = "0123456789abcdef";
  std::string id(32, '0');
  uint64_t bits = 0;
  for (size_t i = 0; i < id.size(); ++i) {
    if (i % 16 == 0) bits = rng();
    id[i] = hex[bits & 0xf];
    bits >>= 4;
  }
  return id;
}

void CancelToken::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  for (auto* ctx : running_) ctx->TryCancel();
}

bool CancelToken::cancelled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_;
}

struct Client::Plan {
  std::string method;
  bool transfer;
  std::chrono::system_clock::time_point deadline;
  std::string request_id;
  std::shared_ptr<CancelToken> cancel;
};

template <class Rpc>
grpc::Status Client::run(const Plan& plan, Rpc rpc) {
  grpc::ClientContext ctx;
  ctx.set_deadline(plan.deadline);
  CancelToken* token = plan.cancel.get();
  if (token != nullptr) {
    std::lock_guard<std::mutex> lock(token->mu_);
    if (token->cancelled_) {
      ErrorInfo info = client_error("Cancelled", grpc::StatusCode::CANCELLED, "CANCELLED",
                                    plan.method + " was cancelled before it was sent",
                                    plan.method);
      info.request_id = plan.request_id;
      if (plan.transfer) info.transfer_state = v1::TRANSFER_STATE_NOT_STARTED;
      throw_error(std::move(info));
    }
    token->running_.push_back(&ctx);
  }
  grpc::Status status = rpc(&ctx);
  if (token != nullptr) {
    std::lock_guard<std::mutex> lock(token->mu_);
    auto& r = token->running_;
    r.erase(std::remove(r.begin(), r.end(), &ctx), r.end());
  }
  return status;
}

Client::Client(const std::string& target, Options options)
    : fd_socket_(options.fd_socket),
      transfer_timeout_(options.transfer_timeout),
      control_timeout_(options.control_timeout) {
  validate_timeout(transfer_timeout_, "transfer_timeout");
  validate_timeout(control_timeout_, "control_timeout");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);  // what the server permits
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  auto creds = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  channel_ = grpc::CreateCustomChannel(target, creds, args);
  kv_ = v1::KVCacheService::NewStub(channel_);
  health_ = grpc::health::v1::Health::NewStub(channel_);
}

Client::Plan Client::prepare(const char* method, bool long_call, bool transfer,
                             v1::RequestHeader* header, const CallOptions& call) const {
  Millis timeout = long_call ? transfer_timeout_ : control_timeout_;
  if (call.timeout) {
    validate_timeout(*call.timeout, "timeout");
    timeout = *call.timeout;
  }
  Plan plan{method, transfer, std::chrono::system_clock::now() + timeout, call.request_id,
            call.cancel};
  if (header != nullptr) {
    if (header->envelope_version() == 0) header->set_envelope_version(kEnvelopeVersion);
    if (!call.request_id.empty()) header->set_request_id(call.request_id);
    if (header->request_id().empty()) header->set_request_id(new_request_id());
    plan.request_id = header->request_id();
  }
  return plan;
}

template <class Resp, class Rpc>
auto Client::unary(const Plan& plan, Rpc rpc)
    -> std::decay_t<decltype(std::declval<Resp>().result())> {
  Resp resp;
  const grpc::Status status = run(plan, [&](grpc::ClientContext* ctx) { return rpc(ctx, &resp); });
  if (!status.ok()) {
    // UNAVAILABLE before a connection existed: the request never left (calls.py's _never_sent).
    std::string details = status.error_message();
    for (auto& ch : details) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    const bool never_sent = status.error_code() == grpc::StatusCode::UNAVAILABLE &&
                            details.find("failed to connect") != std::string::npos;
    throw_error(from_status(status, plan.request_id, plan.method, plan.transfer, !never_sent));
  }
  if (resp.has_error()) throw_error(from_remote_error(resp.error(), plan.method));
  if (!resp.has_result()) {
    ErrorInfo info = client_error("KVServiceError", grpc::StatusCode::UNKNOWN, "EMPTY_RESPONSE",
                                  plan.method +
                                      " response carries neither result nor error (newer server?)",
                                  plan.method);
    info.request_id = plan.request_id;
    if (plan.transfer) info.transfer_state = v1::TRANSFER_STATE_UNKNOWN;
    throw_error(std::move(info));
  }
  return resp.result();
}

v1::MapResult Client::Map(v1::MapRequest request, const CallOptions& call) {
  const Plan plan = prepare("Map", false, false, request.mutable_header(), call);
  return unary<v1::MapResponse>(plan, [&](grpc::ClientContext* c, v1::MapResponse* r) {
    return kv_->Map(c, request, r);
  });
}

v1::UnmapResult Client::Unmap(const std::string& mapping_id, const CallOptions& call) {
  v1::UnmapRequest request;
  request.set_mapping_id(mapping_id);
  const Plan plan = prepare("Unmap", true, false, request.mutable_header(), call);
  return unary<v1::UnmapResponse>(plan, [&](grpc::ClientContext* c, v1::UnmapResponse* r) {
    return kv_->Unmap(c, request, r);
  });
}

namespace {
void fill_blocks(v1::BlockChunks* out, const std::string& mapping_id,
                 const std::vector<BlockChunk>& chunks) {
  out->set_mapping_id(mapping_id);
  for (const auto& chunk : chunks) {
    auto* c = out->add_chunks();
    c->set_key(chunk.key);
    c->mutable_block_ids()->Add(chunk.block_ids.begin(), chunk.block_ids.end());
  }
}
}  // namespace

v1::StoreResult Client::Store(v1::StoreRequest request, const CallOptions& call) {
  const Plan plan = prepare("Store", true, request.has_blocks(), request.mutable_header(), call);
  return unary<v1::StoreResponse>(plan, [&](grpc::ClientContext* c, v1::StoreResponse* r) {
    return kv_->Store(c, request, r);
  });
}

v1::RetrieveResult Client::Retrieve(v1::RetrieveRequest request, const CallOptions& call) {
  const Plan plan =
      prepare("Retrieve", true, request.has_blocks(), request.mutable_header(), call);
  return unary<v1::RetrieveResponse>(plan, [&](grpc::ClientContext* c, v1::RetrieveResponse* r) {
    return kv_->Retrieve(c, request, r);
  });
}

v1::LookupResult Client::Lookup(v1::LookupRequest request, const CallOptions& call) {
  const Plan plan = prepare("Lookup", false, false, request.mutable_header(), call);
  return unary<v1::LookupResponse>(plan, [&](grpc::ClientContext* c, v1::LookupResponse* r) {
    return kv_->Lookup(c, request, r);
  });
}

v1::StoreResult Client::Store(const std::string& mapping_id,
                              const std::vector<BlockChunk>& chunks, const CallOptions& call) {
  v1::StoreRequest request;
  fill_blocks(request.mutable_blocks(), mapping_id, chunks);
  return Store(std::move(request), call);
}

v1::RetrieveResult Client::Retrieve(const std::string& mapping_id,
                                    const std::vector<BlockChunk>& chunks,
                                    const CallOptions& call) {
  v1::RetrieveRequest request;
  fill_blocks(request.mutable_blocks(), mapping_id, chunks);
  return Retrieve(std::move(request), call);
}

v1::StoreResult Client::Put(const std::string& ns, const std::vector<Chunk>& chunks,
                            const CallOptions& call) {
  v1::StoreRequest request;
  auto* inline_chunks = request.mutable_inline_();
  inline_chunks->set_namespace_(ns);
  for (const auto& chunk : chunks) {
    auto* c = inline_chunks->add_chunks();
    c->set_key(chunk.key);
    c->set_data(chunk.data);
  }
  return Store(std::move(request), call);
}

v1::RetrieveResult Client::Get(const std::string& ns, const std::vector<std::string>& keys,
                               const CallOptions& call) {
  v1::RetrieveRequest request;
  auto* inline_keys = request.mutable_inline_();
  inline_keys->set_namespace_(ns);
  for (const auto& key : keys) inline_keys->add_keys(key);
  return Retrieve(std::move(request), call);
}

std::string Client::GetOne(const std::string& ns, const std::string& key,
                           const CallOptions& call) {
  const v1::RetrieveResult r = Get(ns, {key}, call);
  if (r.chunks_size() == 0) {
    static const char* hex = "0123456789abcdef";
    std::string key_hex;
    for (unsigned char ch : key) {
      key_hex += hex[ch >> 4];
      key_hex += hex[ch & 0xf];
    }
    ErrorInfo info = client_error("Miss", grpc::StatusCode::NOT_FOUND, "CHUNK_NOT_FOUND",
                                  "chunk " + key_hex.substr(0, 32) +
                                      " is not stored in namespace '" + ns + "'",
                                  "Retrieve");
    info.metadata = {{"key", key_hex}, {"namespace", ns}};
    info.request_id = r.transfer_id();
    throw_error(std::move(info));
  }
  return r.chunks(0).data();
}

v1::LookupResult Client::Lookup(const std::string& ns, const std::vector<std::string>& keys,
                                const CallOptions& call) {
  v1::LookupRequest request;
  request.set_namespace_(ns);
  for (const auto& key : keys) request.add_keys(key);
  return Lookup(std::move(request), call);
}

v1::LookupResult Client::LookupMapping(const std::string& mapping_id,
                                       const std::vector<std::string>& keys,
                                       const CallOptions& call) {
  v1::LookupRequest request;
  request.set_mapping_id(mapping_id);
  for (const auto& key : keys) request.add_keys(key);
  return Lookup(std::move(request), call);
}

v1::FenceResult Client::Fence(const std::string& mapping_id,
                              const std::vector<std::string>& transfer_ids,
                              const CallOptions& call) {
  v1::FenceRequest request;
  request.set_mapping_id(mapping_id);
  for (const auto& id : transfer_ids) request.add_transfer_ids(id);
  const Plan plan = prepare("Fence", true, false, request.mutable_header(), call);
  return unary<v1::FenceResponse>(plan, [&](grpc::ClientContext* c, v1::FenceResponse* r) {
    return kv_->Fence(c, request, r);
  });
}

v1::GetServerInfoResult Client::GetServerInfo(const CallOptions& call) {
  v1::GetServerInfoRequest request;
  const Plan plan = prepare("GetServerInfo", false, false, request.mutable_header(), call);
  return unary<v1::GetServerInfoResponse>(
      plan, [&](grpc::ClientContext* c, v1::GetServerInfoResponse* r) {
        return kv_->GetServerInfo(c, request, r);
      });
}

ServingStatus Client::HealthCheck(const std::string& service, const CallOptions& call) {
  const Plan plan = prepare("Health.Check", false, false, nullptr, call);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = run(
      plan, [&](grpc::ClientContext* ctx) { return health_->Check(ctx, request, &response); });
  if (!status.ok()) throw_error(from_status(status, "", plan.method, false, false));
  return response.status();
}

}  // namespace kvsvc
