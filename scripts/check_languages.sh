#!/usr/bin/env bash
# Checks that proto/ serves every language protoc has built in, on a fresh
# Debian 12 machine:
#   1. installs what it needs from Debian (only what is missing);
#   2. runs Debian's protoc for cpp, java, kotlin, csharp, python (with .pyi),
#      ruby, php and objc, and the gRPC plugins Debian ships (C++, Java,
#      Python, Ruby, PHP), into a temp dir: any output on stderr (protoc's
#      warnings, e.g. a Java outer class named like a type) fails the check;
#   3. compiles the generated C++ (protobuf + grpc++) to objects and the
#      generated Java (protobuf-java + grpc-java), warnings as errors.
# Kotlin, C#, Ruby, PHP and Objective-C are generated only: Debian has no
# runtime libraries for them to compile against.
# Env: CHECK_LANGUAGES_SKIP_INSTALL=1 to skip step 1.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/apt.sh
start=$SECONDS

WORK=$(mktemp -d "${TMPDIR:-/tmp}/check_languages.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n== check_languages: %s\n' "$*"; }

# --- 1. install -------------------------------------------------------------
# Guava, javax.annotation (geronimo) and error-prone annotations are what the
# grpc-java stubs and guava's classes reference at compile time.
APT_PACKAGES=(
  protobuf-compiler libprotobuf-dev protobuf-compiler-grpc libgrpc++-dev g++ pkgconf
  libprotobuf-java libgrpc-java protobuf-compiler-grpc-java-plugin
  libguava-java libgeronimo-annotation-1.3-spec-java liberror-prone-java
)
if [[ "${CHECK_LANGUAGES_SKIP_INSTALL:-}" != 1 ]]; then
  step "install"
  command -v javac >/dev/null || APT_PACKAGES+=(default-jdk-headless)
  apt_install_missing "$WORK" "${APT_PACKAGES[@]}"
fi
protoc --version

# --- 2. generate ------------------------------------------------------------
step "generate"
mapfile -t protos < <(find proto/kvsvc -name '*.proto' | LC_ALL=C sort)
includes=(-Iproto -I/usr/include) # /usr/include: google/protobuf/*.proto
gen="$WORK/gen"
warnings=0
# run NAME ARGS...: one protoc run; whatever it writes to stderr is a warning.
run() {
  local name=$1
  shift
  local err="$WORK/$name.stderr" dir="$gen/${name%%-*}" before
  before=$(find "$dir" -type f | wc -l)
  if ! protoc "${includes[@]}" "$@" "${protos[@]}" 2>"$err"; then
    cat "$err" >&2
    echo "check_languages: protoc failed for $name" >&2
    exit 1
  fi
  if [[ -s "$err" ]]; then
    echo "check_languages: $name: protoc warned:" >&2
    cat "$err" >&2
    warnings=$((warnings + $(wc -l <"$err")))
  fi
  printf '%-12s %3d files\n' "$name" $(($(find "$dir" -type f | wc -l) - before))
}
languages=(cpp java kotlin csharp python ruby php objc)
for lang in "${languages[@]}"; do
  mkdir -p "$gen/$lang"
  extra=()
  [[ $lang == python ]] && extra=(--pyi_out="$gen/$lang")
  run "$lang" --"${lang}_out=$gen/$lang" "${extra[@]}"
done
plugins=(cpp:grpc_cpp_plugin java:grpc_java_plugin python:grpc_python_plugin
  ruby:grpc_ruby_plugin php:grpc_php_plugin)
for entry in "${plugins[@]}"; do
  lang=${entry%%:*}
  run "$lang-grpc" --plugin="protoc-gen-grpc=$(command -v "${entry#*:}")" --grpc_out="$gen/$lang"
done

# --- 3. compile -------------------------------------------------------------
step "compile C++ (g++ -std=c++17 -Wall -Wextra -Werror, protobuf + grpc++)"
mkdir -p "$WORK/obj"
read -ra cflags <<<"$(pkg-config --cflags protobuf grpc++)"
export WORK gen
find "$gen/cpp" -name '*.cc' -print0 | LC_ALL=C sort -z \
  | xargs -0 -P "$(nproc)" -I{} sh -c \
    'f=$1; shift; g++ -std=c++17 -Wall -Wextra -Werror -c -I"$gen/cpp" "$@" "$f" -o "$WORK/obj/$(basename "$f" .cc).o"' \
    sh {} "${cflags[@]}" || { echo "check_languages: the generated C++ does not compile" >&2; exit 1; }
n_obj=$(find "$WORK/obj" -name '*.o' | wc -l)
echo "$n_obj objects"

step "compile Java (javac -Xlint:all -Werror, protobuf-java + grpc-java)"
jars=(protobuf grpc-api grpc-stub grpc-protobuf grpc-protobuf-lite guava
  geronimo-annotation-1.3-spec error_prone_annotations)
cp=$(printf '/usr/share/java/%s.jar:' "${jars[@]}")
mkdir -p "$WORK/classes"
find "$gen/java" -name '*.java' >"$WORK/java-sources"
javac -encoding UTF-8 -Xlint:all -Werror -d "$WORK/classes" -cp "${cp%:}" "@$WORK/java-sources" \
  || { echo "check_languages: the generated Java does not compile" >&2; exit 1; }
n_class=$(find "$WORK/classes" -name '*.class' | wc -l)
echo "$n_class classes"

echo
echo "languages: ${#languages[@]} generated (+ ${#plugins[@]} gRPC plugins), $warnings warnings;" \
  "C++ ($n_obj objects) and Java ($n_class classes) compiled in $((SECONDS - start))s"
((warnings == 0)) || exit 1
