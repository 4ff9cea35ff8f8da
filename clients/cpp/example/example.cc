// Maps a sealed memfd, stores block 0 and loads it back into block 3:
//   kv_example [host:port]   (default 127.0.0.1:50051)
#include <kvsvc/client.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <iostream>

int main(int argc, char** argv) {
  const std::string target = argc > 1 ? argv[1] : "127.0.0.1:50051";
  try {
    kvsvc::Client client(target);  // defaults: 5 s control calls, 30 s transfers
    constexpr size_t kBlock = 1024, kSize = 4 * kBlock;
    const int fd = kvsvc::make_sealed_memfd("kv-cache", kSize);
    auto* kv = static_cast<char*>(mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    const std::string token = client.RegisterMemfd(fd);
    close(fd);  // the server holds its own copy; kv keeps the memory

    kvsvc::v1::MapRequest req;
    req.set_namespace_("llama-3-8b/fp16");
    auto* rank = req.add_ranks();
    rank->mutable_context()->set_tp_size(1);
    rank->mutable_context()->set_pp_size(1);
    rank->mutable_context()->set_group_id("engine-0");
    auto* tensor = rank->add_tensors();
    tensor->set_name("layer.0");
    tensor->mutable_handle()->mutable_sealed_memfd()->set_token(token);
    tensor->mutable_handle()->mutable_sealed_memfd()->set_size_bytes(kSize);
    for (int64_t d : {int64_t{4}, int64_t{kBlock}}) tensor->add_shape(d);
    for (int64_t s : {int64_t{kBlock}, int64_t{1}}) tensor->add_strides(s);
    tensor->set_dtype(kvsvc::v1::DTYPE_UINT8);
    const auto mapping = client.Map(req);

    std::strcpy(kv, "block 0's KV bytes");
    kvsvc::CallOptions call;
    call.timeout = std::chrono::seconds(10);  // per-call override
    const auto stored = client.Store(mapping.mapping_id(), {{"prefix-hash-0", {0}}}, call);
    try {
      client.Retrieve(mapping.mapping_id(), {{"prefix-hash-0", {3}}});
    } catch (const kvsvc::TransferUnprovable& e) {
      // The copy may still be running: fence it before reusing block 3.
      client.Fence("", {e.request_id()});
      throw;
    }
    std::cout << "stored " << stored.stored_bytes() << " bytes; block 3 now holds: "
              << kv + 3 * kBlock << "\n";
    client.Unmap(mapping.mapping_id());
    munmap(kv, kSize);
  } catch (const kvsvc::ServiceUnavailable& e) {
    std::cerr << "no server at " << target << ": " << e.what() << "\n";
    return 2;
  } catch (const kvsvc::KVServiceError& e) {  // every other kvsvc error
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
