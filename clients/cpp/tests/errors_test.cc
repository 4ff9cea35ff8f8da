// The error classes against kvsvc/errors/'s reason catalogue
// (proto/kvsvc/v1/reasons.json, made by scripts/gen_reasons.py), and the
// deadline rules; no server needed.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "kvsvc/client.h"

using nlohmann::json;

namespace {

const json& catalogue() {
  static const json cat = [] {
    std::ifstream in(KVSVC_REASONS_JSON);
    if (!in) throw std::runtime_error("cannot read " KVSVC_REASONS_JSON);
    return json::parse(in);
  }();
  return cat;
}

grpc::StatusCode code_by_name(const std::string& name) {
  kvsvc::v1::Code code;
  if (!kvsvc::v1::Code_Parse("CODE_" + name, &code)) throw std::runtime_error("no code " + name);
  return static_cast<grpc::StatusCode>(code);
}

const kvsvc::ErrorClass* our_class(const std::string& name) {
  for (const auto& c : kvsvc::error_classes()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

kvsvc::v1::RemoteError env(const std::string& type, const std::string& reason,
                           grpc::StatusCode code) {
  kvsvc::v1::RemoteError e;
  e.set_envelope_version(1);
  e.set_type(type);
  e.set_reason(reason);
  e.set_code(static_cast<kvsvc::v1::Code>(code));
  e.set_message("m");
  e.set_request_id("rid");
  e.set_transfer_state(kvsvc::v1::TRANSFER_STATE_NOT_STARTED);
  return e;
}

// The catalogue's ancestors of a class, itself included.
std::set<std::string> ancestors(const std::string& name) {
  std::set<std::string> out;
  for (std::string c = name; !c.empty();) {
    out.insert(c);
    std::string parent;
    for (const auto& k : catalogue()["classes"]) {
      if (k["name"] == c) parent = k["parent"];
    }
    c = parent;
  }
  return out;
}

}  // namespace

TEST(Catalogue, ClassesMatchTheCatalogue) {
  std::set<std::string> declared;
  for (const auto& c : catalogue()["classes"]) {
    const std::string name = c["name"];
    declared.insert(name);
    const kvsvc::ErrorClass* ours = our_class(name);
    if (ours == nullptr) {
      EXPECT_FALSE(c["everyClient"].get<bool>()) << name << " is missing: a server sends it";
      continue;
    }
    EXPECT_EQ(ours->parent, c["parent"].get<std::string>()) << name;
    EXPECT_EQ(kvsvc::code_name(ours->code), c["code"].get<std::string>()) << name;
    EXPECT_EQ(ours->reason, c["reason"].get<std::string>()) << name;
    EXPECT_EQ(ours->retryable, c["retryable"].get<bool>()) << name;
  }
  for (const auto& c : kvsvc::error_classes()) {
    EXPECT_TRUE(declared.count(c.name)) << c.name << " is not in the catalogue";
  }
}

TEST(Catalogue, CppInheritanceFollowsTheCatalogue) {
  // Each class thrown is caught as exactly its catalogue ancestors (dynamic_cast).
  for (const auto& c : kvsvc::error_classes()) {
    kvsvc::ErrorInfo info;
    info.class_name = c.name;
    try {
      kvsvc::throw_error(info);
    } catch (const kvsvc::KVServiceError& e) {
      EXPECT_EQ(e.class_name(), c.name);
      EXPECT_EQ(e.info().type, c.name);
      const auto up = ancestors(c.name);
      for (const auto& other : kvsvc::error_classes()) {
        EXPECT_EQ(kvsvc::is_instance(e, other.name), up.count(other.name) == 1)
            << c.name << " as " << other.name;
      }
    }
  }
}

TEST(Catalogue, EveryServerReasonComesBackAsItsDeclaredClass) {
  int n = 0;
  for (const auto& r : catalogue()["reasons"]) {
    const std::string name = r["name"], cls = r["class"], code = r["code"];
    // A bare KVServiceError is never raised by a server (it comes back by its code).
    if (r["by"] != "server" || cls == "KVServiceError") continue;
    ++n;
    auto e = env(cls, name, code_by_name(code));
    e.set_retryable(r["retryable"].get<bool>());
    try {
      kvsvc::throw_error(kvsvc::from_remote_error(e, "Lookup"));
    } catch (const kvsvc::KVServiceError& k) {
      EXPECT_EQ(k.class_name(), cls) << name;
      EXPECT_TRUE(kvsvc::is_instance(k, cls)) << name;
      EXPECT_EQ(kvsvc::code_name(k.code()), code) << name;
      EXPECT_EQ(k.reason(), name);
      EXPECT_EQ(k.retryable(), r["retryable"].get<bool>()) << name;
      EXPECT_TRUE(k.info().remote);
    }
    if (our_class(cls) != nullptr && our_class(cls)->reason == name) {
      // A class's own reason finds it even under a type this client does not know.
      auto by_reason = env("NotAClass", name, grpc::StatusCode::ABORTED);
      EXPECT_EQ(kvsvc::from_remote_error(by_reason, "Lookup").class_name, cls) << name;
    }
  }
  EXPECT_GT(n, 40);
}

TEST(Catalogue, UnknownReasonFallsBackToTheCatalogueDefault) {
  for (const auto& [code, cls] : catalogue()["defaultClassByCode"].items()) {
    auto e = env("NotAClass", "NOT_DECLARED", code_by_name(code));
    EXPECT_EQ(kvsvc::from_remote_error(e, "Lookup").class_name, cls.get<std::string>()) << code;
  }
}

TEST(Catalogue, EveryTransportReasonIsTheDeclaredOne) {
  int n = 0;
  for (const auto& r : catalogue()["reasons"]) {
    const std::string name = r["name"], code = r["code"];
    if (name != "TRANSPORT_" + code) continue;
    ++n;
    const grpc::Status st(static_cast<grpc::StatusCode>(r["codeNumber"].get<int>()), "d");
    try {
      kvsvc::throw_error(kvsvc::from_status(st, "r", "Lookup", false, false));
    } catch (const kvsvc::KVServiceError& k) {
      EXPECT_EQ(k.class_name(), r["class"].get<std::string>()) << name;
      EXPECT_EQ(kvsvc::code_name(k.code()), code) << name;
      EXPECT_EQ(k.reason(), name);
      EXPECT_EQ(k.retryable(), r["retryable"].get<bool>()) << name;
      EXPECT_FALSE(k.info().remote);
    }
  }
  EXPECT_EQ(n, 16);
}

TEST(Catalogue, TransferStateUnknownIsTransferUnprovable) {
  auto e = env("MappingLost", "MAPPING_NOT_FOUND", grpc::StatusCode::NOT_FOUND);
  e.set_transfer_state(kvsvc::v1::TRANSFER_STATE_UNKNOWN);
  try {
    kvsvc::throw_error(kvsvc::from_remote_error(e, "Store"));
    FAIL() << "no throw";
  } catch (const kvsvc::TransferUnprovable& k) {
    EXPECT_FALSE(k.buffers_reusable());
    EXPECT_EQ(k.reason(), "MAPPING_NOT_FOUND");
  }
  // A lost reply of a started block transfer is unprovable; of an unsent one, NOT_STARTED.
  const grpc::Status lost(grpc::StatusCode::UNAVAILABLE, "Socket closed");
  auto started = kvsvc::from_status(lost, "r", "Store", true, true);
  EXPECT_EQ(started.class_name, "TransferUnprovable");
  EXPECT_EQ(started.transfer_state, kvsvc::v1::TRANSFER_STATE_UNKNOWN);
  EXPECT_EQ(started.metadata.at("grpcCode"), "UNAVAILABLE");
  auto unsent = kvsvc::from_status(lost, "r", "Store", true, false);
  EXPECT_EQ(unsent.class_name, "ServiceUnavailable");
  EXPECT_EQ(unsent.transfer_state, kvsvc::v1::TRANSFER_STATE_NOT_STARTED);
}

TEST(Catalogue, EveryReasonTheClientMakesIsDeclared) {
  std::set<std::string> declared;
  for (const auto& r : catalogue()["reasons"]) declared.insert(r["name"].get<std::string>());
  for (const char* reason : {"INVALID_DEADLINE", "EMPTY_RESPONSE", "TRANSFER_UNPROVABLE",
                             "FD_PASSING_DISABLED", "FD_SOCKET_UNAVAILABLE", "FD_SOCKET_TIMEOUT"}) {
    EXPECT_TRUE(declared.count(reason)) << reason;
  }
}

TEST(Deadlines, DefaultsAreDocumentedAndTimeoutsValidated) {
  kvsvc::Client c("127.0.0.1:1");
  EXPECT_EQ(c.transfer_timeout(), std::chrono::seconds(30));
  EXPECT_EQ(c.control_timeout(), std::chrono::seconds(5));
  kvsvc::Options bad;
  bad.control_timeout = kvsvc::Millis(0);
  EXPECT_THROW(kvsvc::Client("127.0.0.1:1", bad), kvsvc::InvalidDeadline);
  bad = {};
  bad.transfer_timeout = kvsvc::Millis(-5);
  EXPECT_THROW(kvsvc::Client("127.0.0.1:1", bad), kvsvc::InvalidDeadline);
  kvsvc::CallOptions call;
  call.timeout = kvsvc::Millis(0);
  try {
    c.Put("ns", {{"k", "v"}}, call);
    FAIL() << "no throw";
  } catch (const kvsvc::InvalidRequest& e) {  // InvalidDeadline is an InvalidRequest
    EXPECT_EQ(e.class_name(), "InvalidDeadline");
    EXPECT_EQ(e.reason(), "INVALID_DEADLINE");
    EXPECT_EQ(e.metadata().at("setting"), "timeout");
  }
  EXPECT_THROW(c.RegisterMemfd(0, call), kvsvc::InvalidDeadline);
  EXPECT_THROW(c.HealthCheck("", call), kvsvc::InvalidDeadline);
}
