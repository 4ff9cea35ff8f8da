#!/usr/bin/env bash
# Regenerates every client's generated code from proto/: the one way it is made.
#
#   Go:      clients/go/gen/kvsvc/v1/*.pb.go, by Debian's protoc with protoc-gen-go
#            and protoc-gen-go-grpc (packages protobuf-compiler, protoc-gen-go,
#            protoc-gen-go-grpc, libprotobuf-dev for google/protobuf/*.proto).
#   Node.js: nothing to generate: @grpc/proto-loader loads proto/ at run time.
#   Python:  scripts/gen_proto.sh (kvsvc/v1).
#
# Usage: scripts/gen_clients.sh [ROOT]
#   ROOT stands for the repository root in the output paths (default: the
#   repository itself); scripts/check_clients.sh passes a temp dir to compare.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${1:-.}"

for tool in protoc protoc-gen-go protoc-gen-go-grpc; do
  command -v "$tool" >/dev/null || {
    echo "gen_clients: $tool not found (run scripts/check_clients.sh, or apt-get install" \
      "protobuf-compiler protoc-gen-go protoc-gen-go-grpc libprotobuf-dev)" >&2
    exit 1
  }
done

# --- Go ---
module=$(awk '$1 == "module" { print $2; exit }' clients/go/go.mod)
gopkg="$module/gen/kvsvc/v1;kvsvcv1"
out="$ROOT/clients/go/gen"
mkdir -p "$out"
rm -rf "$out/kvsvc"
mapfile -t protos < <(cd proto && find kvsvc -name '*.proto' | LC_ALL=C sort)
mopts=()
for p in "${protos[@]}"; do
  mopts+=("--go_opt=M$p=$gopkg" "--go-grpc_opt=M$p=$gopkg")
done
includes=(-Iproto)
# Well-known types (google/protobuf/timestamp.proto) from libprotobuf-dev.
[[ -f /usr/include/google/protobuf/timestamp.proto ]] && includes+=(-I/usr/include)
protoc "${includes[@]}" \
  --go_out="$out" --go_opt=paths=source_relative \
  --go-grpc_out="$out" --go-grpc_opt=paths=source_relative \
  "${mopts[@]}" "${protos[@]}"
echo "gen_clients: Go code for ${#protos[@]} proto files in $out/kvsvc"
