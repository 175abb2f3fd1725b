#!/usr/bin/env bash
# Installs the Debian packages lossverify needs, if any is missing (root or sudo).
# The CUDA toolkit is not a Debian package here: it is used when present (/usr/local/cuda), never required.
#   install-deps.sh          everything the tests need
#   install-deps.sh --gate   what building the tool and running the gate need (no doctest, MPFR, Python or clang-format)
set -euo pipefail
packages=(
  cmake ninja-build g++ git
  libeigen3-dev libcli11-dev nlohmann-json3-dev librandom123-dev
  mpich libmpich-dev
)
case "${1:-}" in
  --gate) ;;
  "") packages+=(doctest-dev clang-format libmpfr-dev python3 python3-jsonschema python3-torch python3-pip python3-setuptools
             python3-venv python3-wheel python3-pytest) ;;
  *) echo "install-deps: unknown option $1 (expected --gate or nothing)" >&2; exit 2 ;;
esac
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update
$sudo apt-get install -y --no-install-recommends "${missing[@]}"
