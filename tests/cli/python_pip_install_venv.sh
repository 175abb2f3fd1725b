#!/usr/bin/env bash
# CTests python_pip_install_prebuilt and python_pip_install_from_source: `pip install ./python` in a fresh venv puts the lossverify executable into
# the package, and the installed lossverify.torch uses it with no build tree, no LOSSVERIFY_BIN and no
# lossverify on PATH; `pip wheel` gives a platform wheel that carries it and installs elsewhere.
#   python_pip_install_venv.sh WORK PROJECT_ROOT PYTHON [PREBUILT]
# PYTHON: one that sees setuptools, wheel and torch. PREBUILT: an executable the build tree already has, which the
# package takes instead of compiling one (LOSSVERIFY_PIP_BINARY); without it the install compiles from source.
set -euo pipefail
work=$1 root=$2 python=$3 prebuilt=${4:-}
case_file=$root/cases/smoothing-pytorch.json  # cross-entropy, 512 x 1000: a second or two at tp 2
rm -rf "$work" && mkdir -p "$work/src"
# A copy of python/: setuptools writes build/ and *.egg-info beside setup.py, so they land here, not in the
# checkout. LOSSVERIFY_SOURCE_DIR names the project root the copy's build compiles.
cp -r "$root/python/pyproject.toml" "$root/python/setup.py" "$root/python/README.md" "$root/python/lossverify" \
  "$work/src/"
export LOSSVERIFY_SOURCE_DIR=$root
unset LOSSVERIFY_BIN LOSSVERIFY_PIP_BINARY PYTHONPATH
[ -z "$prebuilt" ] || export LOSSVERIFY_PIP_BINARY=$prebuilt

"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install --no-build-isolation --no-deps --no-index --quiet "$work/src"

# A PATH without any lossverify, from /, and a package outside any checkout: the packaged executable is the
# only one the harness can find, so the runs below that pass used it (find_binary says so too).
clean_path=""
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do [ -e "$d/lossverify" ] || clean_path=${clean_path:+$clean_path:}$d; done
cd /
run() { env -u LOSSVERIFY_BIN PATH="$clean_path" "$@"; }
package=$(run "$work/venv/bin/python" -c 'import os, lossverify; print(os.path.dirname(lossverify.__file__))')
case $package in "$work/venv/"*) ;; *) echo "lossverify imported from $package, not the venv"; exit 1 ;; esac
packaged=$package/_bin/lossverify
used=$(run "$work/venv/bin/python" -c 'import lossverify.tool; print(lossverify.tool.find_binary())')
[ "$used" = "$packaged" ] || { echo "the harness found $used, not the packaged $packaged"; exit 1; }
echo "packaged executable: $packaged"
ldd "$packaged" | sed 's/^/  /'
run "$work/venv/bin/python" -m lossverify.torch run --fn lossverify.torch.implementations:correct "$case_file" --tp 2
run "$work/venv/bin/lossverify-torch" run --fn lossverify.torch.implementations:correct "$case_file" --tp 2 -q
# The pytest plugin is registered through its pytest11 entry point.
pytest_help=$(run "$work/venv/bin/python" -m pytest --help)
grep -q -- "--lossverify-report" <<< "$pytest_help" ||
  { echo "pytest does not load lossverify.pytest_plugin from the install"; exit 1; }

# The wheel: platform-specific, carrying the executable with its execute bits; it installs without a build.
"$work/venv/bin/python" -m pip wheel --no-build-isolation --no-deps --no-index --quiet "$work/src" -w "$work/wheels"
wheel=$(ls "$work/wheels"/lossverify-*.whl)
echo "wheel: $(basename "$wheel")"
case $wheel in *-any.whl) echo "a pure wheel: the executable's platform is not in its tag"; exit 1 ;; esac
"$python" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
info = zipfile.ZipFile(sys.argv[1]).getinfo("lossverify/_bin/lossverify")
assert info.external_attr >> 16 & 0o111, "lossverify/_bin/lossverify is not executable in the wheel"
assert "lossverify/_cases/smoothing-pytorch.json" in names, "the shipped cases are missing from the wheel"
EOF
"$python" -m venv --system-site-packages "$work/wheel-venv"
"$work/wheel-venv/bin/python" -m pip install --no-deps --no-index --quiet "$wheel"
used=$(run "$work/wheel-venv/bin/python" -c 'import lossverify.tool; print(lossverify.tool.find_binary())')
case $used in "$work/wheel-venv/"*) ;; *) echo "the wheel's install found $used"; exit 1 ;; esac
"$used" --version
echo "python_pip_install_venv: pass"
