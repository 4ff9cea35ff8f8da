# Sourced by the check scripts: the one way they install what they need from
# Debian's packages, only the ones missing (CI machines start without them).
# Usage: apt_install_missing LOG_DIR PACKAGE...
apt_install_missing() {
  local logs=$1 p
  shift
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    echo "apt packages: all present"
    return 0
  fi
  echo "apt packages to install: ${missing[*]}"
  local sudo=()
  [[ $(id -u) == 0 ]] || sudo=(sudo)
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -q >"$logs/apt-update.log" 2>&1 \
    || { cat "$logs/apt-update.log"; return 1; }
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >"$logs/apt.log" 2>&1 || { cat "$logs/apt.log"; return 1; }
}
