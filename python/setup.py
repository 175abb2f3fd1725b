"""The build step that puts the lossverify executable inside the Python package.

`pip install ./python` and `pip wheel ./python` (setuptools, from pyproject.toml) run CMake on the project
root as `scripts/build.sh --gate` does: the release preset, tests off, the `lossverify` target only, the CUDA
backend only where a GPU is present or LOSSVERIFY_CUDA=ON asks for it (OFF leaves it out). The CMake build
folder is setuptools' build_temp, never the project's build/. Two choices differ from the gate's build, both
for a binary that travels in a wheel: no MPI backend (the Python harness never uses it; the wheel then needs
no MPICH) and LOSSVERIFY_PORTABLE (the compiler's default instruction set, not this machine's). Warnings
are not errors here: a newer compiler's new warning must not fail a user's install.

The package gets lossverify/_bin/lossverify and the plugin host it starts (lossverify-plugin-host, beside
it), and lossverify/_cases/ with the shipped cases. The project root is python/.. (LOSSVERIFY_SOURCE_DIR
overrides it, for a copy of python/ elsewhere). Developer option: LOSSVERIFY_PIP_BINARY=PATH copies an
already-built executable instead of building one (docs/development.md).
"""

import glob
import os
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution
from setuptools.errors import ExecError

try:  # setuptools >= 70.1 has its own; before that it is the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
EXECUTABLES = ("lossverify", "lossverify-plugin-host")
MINIMUM_CMAKE = (3, 25)  # CMakePresets.json version 6
# What a failed configure names -> the Debian package that provides it.
HEADER_PACKAGES = {"Eigen3": "libeigen3-dev", "nlohmann_json": "nlohmann-json3-dev", "CLI11": "libcli11-dev",
                   "RANDOM123": "librandom123-dev", "OpenMP": "g++ (libgomp)"}


class BuildError(ExecError):
    """A build failure with a message for the person installing (setuptools prints it as `error: ...`)."""


def install_hint(root):
    return (f"install the build dependencies with `bash {os.path.join(root, 'scripts', 'install-deps.sh')} --gate` "
            "(Debian packages cmake, ninja-build, g++, libeigen3-dev, libcli11-dev, nlohmann-json3-dev, "
            "librandom123-dev)")


def project_root():
    root = os.path.abspath(os.environ.get("LOSSVERIFY_SOURCE_DIR") or os.path.join(HERE, ".."))
    if not os.path.isfile(os.path.join(root, "CMakePresets.json")) or not os.path.isdir(os.path.join(root, "cases")):
        raise BuildError(f"{root} is not the lossverify project root (no CMakePresets.json and cases/ there): "
                         "install from a checkout's python/ folder, or set LOSSVERIFY_SOURCE_DIR to the checkout")
    return root


def check_tools(root):
    """cmake (3.25 or newer), ninja and a C++ compiler, before CMake is asked anything."""
    compiler = (os.environ.get("CXX") or "g++").split()[0]
    tools = {"cmake": "cmake", "ninja": "ninja", compiler: f"the C++ compiler {compiler}"}
    missing = [what for tool, what in tools.items() if not shutil.which(tool)]
    if missing:
        raise BuildError(f"building the lossverify executable needs {', '.join(missing)}, not found on PATH: "
                         + install_hint(root))
    version = subprocess.run(["cmake", "--version"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"(\d+)\.(\d+)", version)
    if not found or (int(found[1]), int(found[2])) < MINIMUM_CMAKE:
        raise BuildError(f"building the lossverify executable needs CMake >= 3.25, found {version.strip()!r}: "
                         + install_hint(root))


def gpu_present():
    if os.path.exists("/dev/nvidia0"):
        return True
    return bool(shutil.which("nvidia-smi")) and subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                                               check=False).returncode == 0


def cmake_options():
    cuda = os.environ.get("LOSSVERIFY_CUDA") or ("ON" if gpu_present() else "OFF")
    options = ["-DLOSSVERIFY_BUILD_TESTS=OFF", f"-DLOSSVERIFY_WITH_CUDA={cuda}", "-DLOSSVERIFY_WITH_MPI=OFF",
               "-DLOSSVERIFY_PORTABLE=ON", "-DLOSSVERIFY_WARNINGS_AS_ERRORS=OFF"]
    if shutil.which("ccache"):
        options += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
    if os.environ.get("LOSSVERIFY_DEPS_INCLUDE_DIR"):
        options.append(f"-DLOSSVERIFY_DEPS_INCLUDE_DIR={os.environ['LOSSVERIFY_DEPS_INCLUDE_DIR']}")
    return options


def configure_failure(output, root):
    """The CMake error blocks of a failed configure (else its last lines), what they name, and how to get it."""
    lines, keep = [], False
    for line in output.splitlines():
        if line.startswith("CMake Error"):
            keep = True
        elif line and not line.startswith(" "):
            keep = False
        if keep:
            lines.append(line)
    errors = "\n".join(lines[:40] or output.splitlines()[-30:]).rstrip()
    named = [f"{name} ({package})" for name, package in HEADER_PACKAGES.items() if name in errors]
    missing = f"missing: {', '.join(named)}; " if named else ""
    return f"CMake could not configure the lossverify executable:\n{errors}\n{missing}{install_hint(root)}"


def configured_source(build_dir):
    """The source folder a CMake build folder was configured for; None when it was not."""
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt"), encoding="utf-8") as f:
            found = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", f.read(), re.MULTILINE)
    except OSError:
        return None
    return found[1] if found else None


def build_executables(build_temp, root):
    """Configure and build the `lossverify` target in build_temp/cmake; returns its folder of executables."""
    check_tools(root)
    build_dir = os.path.join(os.path.abspath(build_temp), "cmake")
    if configured_source(build_dir) not in (None, root):
        shutil.rmtree(build_dir)  # configured for another checkout: CMake refuses to reuse it
    env = dict(os.environ)
    if not shutil.which("nvcc") and os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        env["PATH"] = "/usr/local/cuda/bin" + os.pathsep + env.get("PATH", "")
    print(f"lossverify: building the executable in {build_dir}", flush=True)
    configure = subprocess.run(["cmake", "--preset", "release", "-B", build_dir, *cmake_options()], cwd=root, env=env,
                               capture_output=True, text=True, check=False)
    if configure.returncode != 0:
        raise BuildError(configure_failure(configure.stdout + configure.stderr, root))
    print(configure.stdout + configure.stderr, flush=True)
    built = subprocess.run(["cmake", "--build", build_dir, "--parallel", str(os.cpu_count() or 1), "--target",
                            "lossverify"], cwd=root, env=env, check=False)
    if built.returncode != 0:
        raise BuildError("building the lossverify executable failed (the compiler's output is above): "
                         + install_hint(root))
    return os.path.join(build_dir, "cli")


class BuildWithExecutable(build_py):
    """build_py, then the executables into lossverify/_bin/ and the shipped cases into lossverify/_cases/."""

    def run(self):
        super().run()
        root = project_root()
        prebuilt = os.environ.get("LOSSVERIFY_PIP_BINARY")
        if prebuilt:
            if not (os.path.isfile(prebuilt) and os.access(prebuilt, os.X_OK)):
                raise BuildError(f"LOSSVERIFY_PIP_BINARY={prebuilt}: not an executable file")
            source = os.path.dirname(os.path.abspath(prebuilt))
            names = {"lossverify": os.path.basename(prebuilt), "lossverify-plugin-host": "lossverify-plugin-host"}
        else:
            source = build_executables(self.get_finalized_command("build").build_temp, root)
            names = {name: name for name in EXECUTABLES}
        bin_dir = os.path.join(self.build_lib, "lossverify", "_bin")
        shutil.rmtree(bin_dir, ignore_errors=True)  # an earlier build's
        os.makedirs(bin_dir)
        for name, built in names.items():
            path = os.path.join(source, built)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(bin_dir, name))
                os.chmod(os.path.join(bin_dir, name), 0o755)
        cases_dir = os.path.join(self.build_lib, "lossverify", "_cases")
        shutil.rmtree(cases_dir, ignore_errors=True)
        os.makedirs(cases_dir)
        for case in glob.glob(os.path.join(root, "cases", "*.json")):
            shutil.copyfile(case, os.path.join(cases_dir, os.path.basename(case)))


class BinaryDistribution(Distribution):
    """The package carries an executable: a platform wheel, installed into platlib."""

    def has_ext_modules(self):
        return True


commands = {"build_py": BuildWithExecutable}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """py3-none-<platform>: the executable does not depend on the Python version, only on the platform."""

        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    commands["bdist_wheel"] = PlatformWheel

setup(distclass=BinaryDistribution, cmdclass=commands)
