"""Generated kvsvc.v1 protobuf messages and gRPC stubs (see scripts/gen_proto.sh)."""
