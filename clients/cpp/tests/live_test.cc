// Against real `kvsvc serve` processes: round trips (inline and through a
// sealed memfd mapping), health, deadlines, and every error class the server
// can be made to raise, each from a real path.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <regex>
#include <thread>

#include <grpcpp/generic/generic_stub.h>

#include "kvsvc/client.h"
#include "server.h"

using kvsvc_test::TestServer;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;
namespace v1 = kvsvc::v1;

namespace {

TestServer& shared_server() {
  static std::unique_ptr<TestServer> server = TestServer::start();
  return *server;
}

std::string rand_bytes(size_t n) {
  static std::mt19937_64 rng{std::random_device{}()};
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::string uniq(const std::string& prefix) { return prefix + "-" + kvsvc::new_request_id(); }

bool is_rid(const std::string& s) { return std::regex_match(s, std::regex("[0-9a-f]{32}")); }

kvsvc::CallOptions with_timeout(milliseconds t, const std::string& rid = "") {
  kvsvc::CallOptions c;
  c.timeout = t;
  c.request_id = rid;
  return c;
}

// One rank, one uint8 tensor of 4 blocks of block_bytes over handle.
v1::MapRequest map_request(const std::string& ns, const v1::MemoryHandle& handle,
                           int64_t block_bytes) {
  v1::MapRequest req;
  req.set_namespace_(ns);
  auto* rank = req.add_ranks();
  rank->mutable_context()->set_tp_size(1);
  rank->mutable_context()->set_pp_size(1);
  rank->mutable_context()->set_group_id("g");
  auto* t = rank->add_tensors();
  t->set_name("layer.0");
  *t->mutable_handle() = handle;
  t->add_shape(4);
  t->add_shape(block_bytes);
  t->add_strides(block_bytes);
  t->add_strides(1);
  t->set_dtype(v1::DTYPE_UINT8);
  return req;
}

v1::MemoryHandle shm_handle(const std::string& name, uint64_t size) {
  v1::MemoryHandle h;
  h.mutable_shared_memory()->set_name(name);
  h.mutable_shared_memory()->set_size_bytes(size);
  return h;
}

void write_file(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

// Runs f, which must throw E; returns the error's fields.
template <class E, class F>
kvsvc::ErrorInfo expect_error(F&& f, const std::string& what) {
  try {
    f();
  } catch (const E& e) {
    return e.info();
  } catch (const kvsvc::KVServiceError& e) {
    ADD_FAILURE() << what << ": got " << e.what();
    return e.info();
  }
  ADD_FAILURE() << what << ": no error";
  return {};
}

class Timer {
 public:
  double seconds() const {
    return std::chrono::duration<double>(Clock::now() - t0_).count();
  }

 private:
  Clock::time_point t0_ = Clock::now();
};

}  // namespace

TEST(Live, InlineRoundTripIsBitExact) {
  kvsvc::Client c(shared_server().addr());
  const std::string ns = uniq("rt");
  std::vector<kvsvc::Chunk> chunks = {{rand_bytes(16), rand_bytes(1000)},
                                      {rand_bytes(16), std::string(2, '\0') + rand_bytes(5000)},
                                      {rand_bytes(16), rand_bytes(9000)}};
  std::vector<std::string> keys;
  uint64_t total = 0;
  for (const auto& ch : chunks) {
    keys.push_back(ch.key);
    total += ch.data.size();
  }
  const auto st = c.Put(ns, chunks);
  EXPECT_EQ(st.stored_chunks(), 3u);
  EXPECT_EQ(st.stored_bytes(), total);
  EXPECT_TRUE(is_rid(st.transfer_id()));
  EXPECT_EQ(c.Lookup(ns, keys).hit_chunks(), 3u);
  const std::string missing = rand_bytes(16);
  EXPECT_EQ(c.Lookup(ns, {keys[0], missing, keys[1]}).hit_chunks(), 1u);
  EXPECT_EQ(c.Lookup(ns + "-other", keys).hit_chunks(), 0u);
  const auto got = c.Get(ns, {keys[0], keys[1], keys[2], missing, keys[0]});
  ASSERT_EQ(got.chunks_size(), 3);
  EXPECT_EQ(got.loaded_bytes(), total);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got.chunks(i).key(), keys[i]);
    EXPECT_TRUE(got.chunks(i).data() == chunks[i].data) << "chunk " << i << " differs";
  }
  const auto again = c.Put(ns, chunks, with_timeout(seconds(10)));
  EXPECT_EQ(again.stored_chunks(), 0u);
  EXPECT_EQ(again.present_chunks(), 3u);
}

TEST(Live, MemfdMappingRoundTripIsBitExact) {
  kvsvc::Client c(shared_server().addr());
  constexpr size_t kBlock = 1024, kSize = 4 * kBlock;
  const int fd = kvsvc::make_sealed_memfd("kv-cache", kSize);
  void* p = ::mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  char* kv = static_cast<char*>(p);
  const std::string content = rand_bytes(kSize);
  std::memcpy(kv, content.data(), kSize);
  const std::string token = c.RegisterMemfd(fd);
  ::close(fd);  // the server holds its own copy
  ASSERT_FALSE(token.empty());

  v1::MemoryHandle h;
  h.mutable_sealed_memfd()->set_token(token);
  h.mutable_sealed_memfd()->set_size_bytes(kSize);
  const auto m = c.Map(map_request(uniq("ns-memfd"), h, kBlock));
  EXPECT_EQ(m.num_blocks(), 4u);
  EXPECT_EQ(m.block_bytes(), kBlock);
  const auto st = c.Store(m.mapping_id(), {{"blk", {0, 1}}});
  EXPECT_EQ(st.stored_bytes(), 2 * kBlock);
  EXPECT_EQ(c.LookupMapping(m.mapping_id(), {"blk"}).hit_chunks(), 1u);
  const auto rt = c.Retrieve(m.mapping_id(), {{"blk", {2, 3}}});
  EXPECT_EQ(rt.loaded_chunks(), 1u);
  EXPECT_TRUE(std::memcmp(kv + 2 * kBlock, content.data(), 2 * kBlock) == 0)
      << "blocks 0..1 did not come back bit-exact into blocks 2..3";
  EXPECT_TRUE(std::memcmp(kv, content.data(), 2 * kBlock) == 0) << "the source changed";

  // LayoutMismatch: a 2-block chunk does not load into 1 block.
  auto e = expect_error<kvsvc::LayoutMismatch>(
      [&] { c.Retrieve(m.mapping_id(), {{"blk", {3}}}); }, "1 block for 2");
  EXPECT_EQ(e.reason, "BLOCK_COUNT_MISMATCH");
  EXPECT_EQ(e.code, grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(e.remote);

  c.Unmap(m.mapping_id());
  e = expect_error<kvsvc::MappingLost>([&] { c.LookupMapping(m.mapping_id(), {"blk"}); },
                                       "after Unmap");
  ::munmap(p, kSize);
}

// The memfd goes over the client's lease connection: destroying the client (an
// engine that exits) makes the server release the mapping by itself, no Unmap.
TEST(Live, DestroyedClientsMemfdMappingIsReleased) {
  constexpr size_t kBlock = 1024, kSize = 4 * kBlock;
  const int fd = kvsvc::make_sealed_memfd("leased", kSize);
  std::string mapping;
  {
    kvsvc::Client engine(shared_server().addr());
    v1::MemoryHandle h;
    h.mutable_sealed_memfd()->set_token(engine.RegisterMemfd(fd));
    h.mutable_sealed_memfd()->set_size_bytes(kSize);
    mapping = engine.Map(map_request(uniq("ns-lease"), h, kBlock)).mapping_id();
    EXPECT_FALSE(engine.RegisterMemfd(fd).empty());  // a second pass, same lease
    engine.Store(mapping, {{"leased", {0}}});
  }
  ::close(fd);
  kvsvc::Client other(shared_server().addr());
  const auto until = Clock::now() + seconds(10);  // released at once; a loaded CI host
  bool lost = false;
  while (!lost && Clock::now() < until) {
    try {
      other.LookupMapping(mapping, {"leased"});
      std::this_thread::sleep_for(milliseconds(20));
    } catch (const kvsvc::MappingLost&) {
      lost = true;
    }
  }
  EXPECT_TRUE(lost) << "mapping " << mapping << " outlived its client by 10 s";
}

TEST(Live, ErrorsFromRealPaths) {
  TestServer& s = shared_server();
  kvsvc::Client c(s.addr());

  // InvalidRequest
  auto e = expect_error<kvsvc::InvalidRequest>([&] { c.Put("", {{"k", "v"}}); }, "empty ns");
  EXPECT_EQ(e.class_name, "InvalidRequest");
  EXPECT_EQ(e.reason, "INVALID_ARGUMENT");
  EXPECT_EQ(e.metadata["field"], "namespace");
  EXPECT_TRUE(e.remote);
  EXPECT_TRUE(is_rid(e.request_id));
  EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_NOT_STARTED);
  e = expect_error<kvsvc::InvalidRequest>(
      [&] { c.Map(map_request("ns-oob", shm_handle("oob", 100), 64)); }, "tensor out of bounds");
  EXPECT_EQ(e.reason, "TENSOR_OUT_OF_BOUNDS");
  EXPECT_EQ(e.metadata["endBytes"], "256");

  // InvalidRequest through the fd socket: a memfd whose size is not sealed.
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 4096), 0);
  e = expect_error<kvsvc::InvalidRequest>([&] { c.RegisterMemfd(unsealed); }, "unsealed");
  EXPECT_EQ(e.reason, "FD_NOT_SEALED");
  ::close(unsealed);

  // UnsupportedRequest
  e = expect_error<kvsvc::UnsupportedRequest>([&] { c.Store(v1::StoreRequest{}); }, "no source");
  EXPECT_EQ(e.reason, "UNSUPPORTED_REQUEST");
  EXPECT_EQ(e.metadata["field"], "source");
  v1::LookupRequest future;
  future.mutable_header()->set_envelope_version(99);
  future.set_namespace_("ns");
  future.add_keys("k");
  e = expect_error<kvsvc::InvalidRequest>([&] { c.Lookup(future); }, "envelope 99");
  EXPECT_EQ(e.class_name, "UnsupportedRequest");
  EXPECT_EQ(e.reason, "UNSUPPORTED_ENVELOPE_VERSION");
  EXPECT_EQ(e.metadata["envelopeVersion"], "99");

  // MappingLost (a NotFound)
  for (int i = 0; i < 3; ++i) {
    e = expect_error<kvsvc::NotFound>(
        [&] {
          if (i == 0) c.LookupMapping("nope", {"k"});
          if (i == 1) c.Unmap("nope");
          if (i == 2) c.Fence("nope", {});
        },
        "unknown mapping");
    EXPECT_EQ(e.class_name, "MappingLost");
    EXPECT_EQ(e.reason, "MAPPING_NOT_FOUND");
    EXPECT_EQ(e.metadata["mappingId"], "nope");
  }

  // NotFound from the health service (a transport status, not an envelope)
  e = expect_error<kvsvc::NotFound>([&] { c.HealthCheck("no.such.Service"); }, "health");
  EXPECT_EQ(e.class_name, "NotFound");
  EXPECT_EQ(e.reason, "TRANSPORT_NOT_FOUND");
  EXPECT_FALSE(e.remote);

  // CudaUnavailable: a CUDA IPC handle sent to a CPU server.
  v1::MemoryHandle cuda;
  cuda.mutable_cuda_ipc()->set_device_uuid("GPU-0");
  cuda.mutable_cuda_ipc()->set_ipc_handle(std::string(64, 'x'));
  cuda.mutable_cuda_ipc()->set_storage_size_bytes(256);
  e = expect_error<kvsvc::CudaUnavailable>(
      [&] { c.Map(map_request(uniq("ns-cuda"), cuda, 64)); }, "cuda on cpu");
  EXPECT_EQ(e.reason, "CUDA_UNAVAILABLE");

  // RegionUnavailable: a region truncated after Map; the copy is FINISHED.
  const std::string file = s.shm_dir() + "/shrinks";
  write_file(file, rand_bytes(256));
  const auto m = c.Map(map_request(uniq("ns-trunc"), shm_handle("shrinks", 256), 64));
  std::filesystem::resize_file(file, 0);
  e = expect_error<kvsvc::RegionUnavailable>([&] { c.Store(m.mapping_id(), {{"t", {3}}}); },
                                             "truncated");
  EXPECT_EQ(e.reason, "REGION_TRUNCATED");
  EXPECT_EQ(e.metadata["name"], "shrinks");
  EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_FINISHED);
  c.Unmap(m.mapping_id());
  EXPECT_EQ(c.HealthCheck(), grpc::health::v1::HealthCheckResponse::SERVING);

  // Miss: one chunk asked for by GetOne that is not stored (a NotFound).
  const std::string ns_one = uniq("ns-one");
  c.Put(ns_one, {{"here", "bytes"}});
  EXPECT_EQ(c.GetOne(ns_one, "here"), "bytes");
  e = expect_error<kvsvc::NotFound>([&] { c.GetOne(ns_one, "absent"); }, "miss");
  EXPECT_EQ(e.class_name, "Miss");
  EXPECT_EQ(e.reason, "CHUNK_NOT_FOUND");
  EXPECT_EQ(e.metadata["namespace"], ns_one);

  // MalformedRequest: bytes that do not parse as a LookupRequest, answered in
  // the method's own response envelope.
  {
    grpc::GenericStub stub(grpc::CreateChannel(s.addr(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
    const std::string garbage = "\xff\xff\xff\xff";
    grpc::Slice slice(garbage);
    grpc::ByteBuffer request(&slice, 1), response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, "/kvsvc.v1.KVCacheService/Lookup", grpc::StubOptions(), &request,
                   &response, [&](grpc::Status st) { done.set_value(st); });
    ASSERT_TRUE(done.get_future().get().ok());
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(response.Dump(&slices).ok());
    std::string bytes;
    for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    v1::LookupResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    ASSERT_TRUE(parsed.has_error());
    e = expect_error<kvsvc::InvalidRequest>(
        [&] { kvsvc::throw_error(kvsvc::from_remote_error(parsed.error(), "Lookup")); },
        "malformed");
    EXPECT_EQ(e.class_name, "MalformedRequest");
    EXPECT_EQ(e.reason, "MALFORMED_REQUEST");
  }

  // Request ids: a duplicate transfer id, and a transfer barred by a Fence.
  const std::string rid = uniq("rid");
  EXPECT_EQ(c.Put("ns-rid", {{"k", "v"}}, with_timeout(seconds(10), rid)).transfer_id(), rid);
  e = expect_error<kvsvc::InvalidRequest>(
      [&] { c.Put("ns-rid", {{"k2", "v"}}, with_timeout(seconds(10), rid)); }, "duplicate");
  EXPECT_EQ(e.reason, "DUPLICATE_TRANSFER_ID");
  EXPECT_EQ(e.request_id, rid);
  const std::string late = uniq("late");
  EXPECT_EQ(c.Fence("", {late}).barred_transfers(), 1u);
  e = expect_error<kvsvc::InvalidRequest>(
      [&] { c.Put("ns-fence", {{"k", "v"}}, with_timeout(seconds(10), late)); }, "barred");
  EXPECT_EQ(e.reason, "TRANSFER_BARRED");
  EXPECT_EQ(c.Lookup("ns-fence", {"k"}).hit_chunks(), 0u);
}

TEST(Live, ConnectionRefusedIsServiceUnavailable) {
  kvsvc::Client c(kvsvc_test::refused_address());
  Timer t;
  for (int i = 0; i < 4; ++i) {
    auto e = expect_error<kvsvc::ServiceUnavailable>(
        [&] {
          if (i == 0) c.Lookup("ns", {"k"});
          if (i == 1) c.GetServerInfo();
          if (i == 2) c.Put("ns", {{"k", "v"}});
          if (i == 3) c.HealthCheck();
        },
        "refused");
    EXPECT_EQ(e.reason, "TRANSPORT_UNAVAILABLE");
    EXPECT_TRUE(e.retryable);
    EXPECT_FALSE(e.remote);
  }
  // A block transfer that could not be sent provably did not start.
  auto e = expect_error<kvsvc::ServiceUnavailable>([&] { c.Store("m", {{"k", {0}}}); }, "block");
  EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_NOT_STARTED);
  EXPECT_TRUE(is_rid(e.request_id));
  EXPECT_LT(t.seconds(), 20.0) << "not failing fast";
}

TEST(Live, SlowServerDeadlines) {
  // Each sleep outlasts the deadline it races by seconds (a loaded CI host).
  auto s = TestServer::start("handler.enter=Lookup@sleep(4000);transfer.before_copy=sleep(5000)",
                             {"--store-bytes", "64K", "--fd-socket", "off"});
  kvsvc::Client c(s->addr());

  {  // a per-call timeout bounds the call
    Timer t;
    auto e = expect_error<kvsvc::DeadlineExceeded>(
        [&] { c.Lookup("ns", {"k"}, with_timeout(milliseconds(300))); }, "300 ms lookup");
    EXPECT_EQ(e.reason, "TRANSPORT_DEADLINE_EXCEEDED");
    EXPECT_EQ(e.code, grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_FALSE(e.remote);
    EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_UNSPECIFIED);
    EXPECT_TRUE(is_rid(e.request_id));
    EXPECT_GT(t.seconds(), 0.25);
    EXPECT_LT(t.seconds(), 3.5);
  }
  {  // Cancelled: a CancelToken from another thread ends a running call
    auto token = std::make_shared<kvsvc::CancelToken>();
    kvsvc::CallOptions call;
    call.timeout = seconds(20);
    call.cancel = token;
    Timer t;
    std::thread canceller([&] {
      std::this_thread::sleep_for(milliseconds(300));
      token->cancel();
    });
    auto e = expect_error<kvsvc::Cancelled>([&] { c.Lookup("ns", {"k"}, call); }, "cancelled");
    canceller.join();
    EXPECT_EQ(e.code, grpc::StatusCode::CANCELLED);
    EXPECT_EQ(e.reason, "TRANSPORT_CANCELLED");
    EXPECT_LT(t.seconds(), 10.0);
    // A cancelled token refuses the next call before sending it.
    e = expect_error<kvsvc::Cancelled>([&] { c.Store("m", {{"k", {0}}}, call); }, "again");
    EXPECT_EQ(e.reason, "CANCELLED");
    EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_NOT_STARTED);
  }
  {  // the control timeout default bounds a call without one
    kvsvc::Options o;
    o.control_timeout = milliseconds(1000);
    kvsvc::Client short_c(s->addr(), o);
    Timer t;
    expect_error<kvsvc::DeadlineExceeded>([&] { short_c.Lookup("ns", {"k"}); }, "default");
    EXPECT_GT(t.seconds(), 0.9);
    EXPECT_LT(t.seconds(), 3.9);
  }
  {  // CapacityExhausted
    auto e = expect_error<kvsvc::CapacityExhausted>(
        [&] { c.Put("ns", {{"big", std::string(100 << 10, 'x')}}); }, "too big");
    EXPECT_EQ(e.reason, "REQUEST_EXCEEDS_CAPACITY");
    EXPECT_FALSE(e.retryable);
    EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_NOT_STARTED);
  }
  {  // Unimplemented: the server takes no memfds
    const int fd = kvsvc::make_sealed_memfd("x", 4096);
    auto e = expect_error<kvsvc::Unimplemented>([&] { c.RegisterMemfd(fd); }, "fd socket off");
    EXPECT_EQ(e.reason, "FD_PASSING_DISABLED");
    ::close(fd);
  }
  {  // TransferUnprovable: a block Store whose reply is lost, until a Fence
    write_file(s->shm_dir() + "/r", rand_bytes(256));
    const auto m = c.Map(map_request(uniq("ns-unprovable"), shm_handle("r", 256), 64));
    const std::string rid = uniq("blk");
    Timer t;
    try {
      c.Store(m.mapping_id(), {{"b", {0, 1}}}, with_timeout(milliseconds(1500), rid));
      FAIL() << "no error";
    } catch (const kvsvc::TransferUnprovable& e) {
      EXPECT_EQ(e.reason(), "TRANSFER_UNPROVABLE");
      EXPECT_EQ(e.code(), grpc::StatusCode::DEADLINE_EXCEEDED);
      EXPECT_FALSE(e.buffers_reusable());
      EXPECT_EQ(e.request_id(), rid);
      EXPECT_EQ(e.metadata().at("grpcCode"), "DEADLINE_EXCEEDED");
    }
    EXPECT_LT(t.seconds(), 8.0);
    const auto f = c.Fence("", {rid}, with_timeout(seconds(20)));
    EXPECT_EQ(f.barred_transfers(), 0u);
    EXPECT_EQ(c.LookupMapping(m.mapping_id(), {"b"}, with_timeout(seconds(10))).hit_chunks(), 1u);
    c.Unmap(m.mapping_id(), with_timeout(seconds(20)));
  }
}

TEST(Live, ServerKilledMidCall) {
  auto s = TestServer::start("handler.enter=Fence@raise;transfer.before_copy=sleep(20000)");
  kvsvc::Client c(s->addr());
  // RemoteHandlerError: a handler that fails unexpectedly (not fatal).
  auto eh = expect_error<kvsvc::RemoteHandlerError>([&] { c.Fence("", {"x"}); }, "handler");
  EXPECT_EQ(eh.class_name, "RemoteHandlerError");
  EXPECT_EQ(eh.reason, "HANDLER_FAILED");
  EXPECT_EQ(eh.code, grpc::StatusCode::INTERNAL);
  EXPECT_EQ(eh.message.find("Traceback"), std::string::npos);
  write_file(s->shm_dir() + "/r", rand_bytes(256));
  const auto m = c.Map(map_request(uniq("ns-kill"), shm_handle("r", 256), 64));
  Timer t;
  // An inline Put moves no mapped blocks: its lost reply is a plain ServiceUnavailable.
  auto put = std::async(std::launch::async, [&] {
    return expect_error<kvsvc::ServiceUnavailable>(
        [&] { c.Put("ns", {{"k", "v"}}, with_timeout(seconds(30))); }, "put mid-kill");
  });
  auto store = std::async(std::launch::async, [&] {
    return expect_error<kvsvc::TransferUnprovable>(
        [&] { c.Store(m.mapping_id(), {{"b", {0}}}, with_timeout(seconds(30))); },
        "store mid-kill");
  });
  std::this_thread::sleep_for(milliseconds(1500));  // both calls are in the server
  s->kill_now();
  const auto el = put.get();
  const auto es = store.get();
  EXPECT_LT(t.seconds(), 15.0) << "a killed server must end the calls, not their deadline";
  EXPECT_EQ(el.code, grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(el.reason, "TRANSPORT_UNAVAILABLE");
  EXPECT_TRUE(el.retryable);
  EXPECT_EQ(es.transfer_state, v1::TRANSFER_STATE_UNKNOWN);
  EXPECT_EQ(es.metadata.at("grpcCode"), "UNAVAILABLE");
  s->stop();
  // Afterwards nothing listens: a block Store provably never started.
  auto e = expect_error<kvsvc::ServiceUnavailable>(
      [&] { c.Store(m.mapping_id(), {{"b", {0}}}, with_timeout(seconds(10))); }, "after");
  EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_NOT_STARTED);
}

TEST(Live, FatalFailureFlipsHealth) {
  auto s = TestServer::start("transfer.before_copy=raise");
  kvsvc::Client c(s->addr());
  using HS = grpc::health::v1::HealthCheckResponse;
  EXPECT_EQ(c.HealthCheck(), HS::SERVING);
  EXPECT_EQ(c.HealthCheck(kvsvc::kHealthServiceName), HS::SERVING);
  auto e = expect_error<kvsvc::RemoteHandlerError>([&] { c.Put("ns", {{"k", "v"}}); }, "fatal");
  EXPECT_EQ(e.class_name, "FatalServerError");
  EXPECT_EQ(e.code, grpc::StatusCode::INTERNAL);
  EXPECT_EQ(e.reason, "TRANSFER_WORKER_FAILED");
  EXPECT_EQ(e.metadata["error"], "FailpointError");
  EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_FINISHED);
  EXPECT_EQ(e.message.find("Traceback"), std::string::npos);
  const auto until = Clock::now() + seconds(10);
  auto h = c.HealthCheck();
  while (h != HS::NOT_SERVING && Clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(50));
    h = c.HealthCheck();
  }
  EXPECT_EQ(h, HS::NOT_SERVING);
  EXPECT_EQ(c.HealthCheck(kvsvc::kHealthServiceName), HS::NOT_SERVING);
  const auto info = c.GetServerInfo();
  EXPECT_FALSE(info.serving());
  EXPECT_EQ(info.failure_reason(), "TRANSFER_WORKER_FAILED");
  EXPECT_TRUE(info.has_failure_time());
  for (int i = 0; i < 2; ++i) {
    e = expect_error<kvsvc::ServiceNotServing>(
        [&] {
          if (i == 0) c.Put("ns", {{"k2", "v"}});
          if (i == 1) c.Get("ns", {"k"});
        },
        "not serving");
    EXPECT_EQ(e.reason, "SERVICE_NOT_SERVING");
    EXPECT_EQ(e.code, grpc::StatusCode::UNAVAILABLE);
    EXPECT_FALSE(e.retryable);
    EXPECT_EQ(e.metadata["failureReason"], "TRANSFER_WORKER_FAILED");
    EXPECT_EQ(e.transfer_state, v1::TRANSFER_STATE_NOT_STARTED);
  }
  EXPECT_EQ(c.Lookup("ns", {"k"}).hit_chunks(), 0u) << "control calls still answer";
}

TEST(Live, ServerInfo) {
  kvsvc::Client c(shared_server().addr());
  const auto info = c.GetServerInfo();
  EXPECT_EQ(info.envelope_version(), 1u);
  EXPECT_TRUE(info.serving());
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.device(), "cpu");
  EXPECT_FALSE(info.fd_socket().empty());
  EXPECT_GT(info.capacity_bytes(), 0u);
}
