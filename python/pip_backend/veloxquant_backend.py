"""The PEP 517 build backend of `pip install <this repository>` (pyproject.toml), standard library
only, so that pip's isolated build environment needs nothing from an index (requires = []).

build_wheel configures the repository with CMake, builds the target veloxquant_c (the shared C
library of include/veloxquant/veloxquant.h) and writes a wheel of python/veloxquant with the
library beside its modules, where the module's loader looks first after $VELOXQUANT_C_LIBRARY.
The library's path is CMake's own answer (its file API's codemodel), not a guess.

Config settings (pip install -C key=value ...):
  build-type=<type>  CMAKE_BUILD_TYPE of the build (default Release)
  cmake-args=<args>  more arguments for CMake's configure step (split like a shell's words)
  build-dir=<dir>    an already configured build tree of this repository to reuse: the backend
                     runs `cmake --build <dir> --target veloxquant_c` there (nothing is compiled
                     that is up to date) and packs the library it reports. Its configuration
                     (build type, flags) is the tree's own; build-type and cmake-args do not
                     apply. The first time, the backend asks CMake's file API where the library
                     is, which re-runs the tree's configure step once (its cache unchanged).
Without build-dir the build happens in a temporary directory, removed afterwards.
"""
import base64
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "veloxquant"
CLIENT = "client-veloxquant-pip"  # this backend's file API query
SUMMARY = ("KV-cache eviction (SqueezeAttention, H2O, PyramidKV, TOVA, StreamingLLM, SnapKV) "
           "over the C ABI of libveloxquant_c")
# The name the module's loader (python/veloxquant/_lib.py, BUNDLED) looks for beside itself.
LIBRARY = {"darwin": "libveloxquant_c.dylib", "win32": "veloxquant_c.dll"}.get(
    sys.platform, "libveloxquant_c.so")
# What an sdist carries: what the C library's build and the package need.
SDIST_ENTRIES = ["CMakeLists.txt", "LICENSE", "README.md", "pyproject.toml", "cmake", "include",
                 "src", "python"]


def _log(message):
    print(f"veloxquant build: {message}", file=sys.stderr, flush=True)


def _version():
    """The project's version, from project(veloxquant VERSION x.y.z) in CMakeLists.txt."""
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(\s*veloxquant\s+VERSION\s+([0-9.]+)", f.read())
    if not match:
        raise RuntimeError("veloxquant build: no project(veloxquant VERSION ...) in CMakeLists.txt")
    return match.group(1)


def _tag():
    """The wheel's tag: any Python 3, no ABI of Python's (ctypes), this platform."""
    platform = re.sub(r"[^A-Za-z0-9_]", "_", sysconfig.get_platform())
    return f"py3-none-{platform}"


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {_version()}\nSummary: {SUMMARY}\n"
            "License: MIT\nRequires-Python: >=3.8\nRequires-Dist: numpy\n")


def _dist_info_files():
    """{file name in the .dist-info: bytes}."""
    wheel = (f"Wheel-Version: 1.0\nGenerator: {NAME} pip_backend\nRoot-Is-Purelib: false\n"
             f"Tag: {_tag()}\n")
    files = {"METADATA": _metadata().encode(), "WHEEL": wheel.encode()}
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        files["LICENSE"] = f.read()
    return files


def _setting(config_settings, key):
    value = (config_settings or {}).get(key)
    if isinstance(value, list):  # given more than once: the last one
        value = value[-1] if value else None
    return value


def _run(command, **kwargs):
    _log(" ".join(shlex.quote(c) for c in command))
    subprocess.run(command, check=True, stdout=sys.stderr, **kwargs)


# ---- CMake -------------------------------------------------------------------------------------

def _query(build_dir):
    """Asks CMake's file API for the codemodel of build_dir (answered at its next configure)."""
    query = os.path.join(build_dir, ".cmake", "api", "v1", "query", CLIENT)
    os.makedirs(query, exist_ok=True)
    open(os.path.join(query, "codemodel-v2"), "a").close()


def _codemodel(build_dir):
    """The codemodel CMake wrote for this backend's query, or None if it has not answered."""
    reply = os.path.join(build_dir, ".cmake", "api", "v1", "reply")
    indexes = sorted(f for f in os.listdir(reply) if f.startswith("index-")) \
        if os.path.isdir(reply) else []
    if not indexes:
        return None
    with open(os.path.join(reply, indexes[-1]), encoding="utf-8") as f:
        answer = json.load(f).get("reply", {}).get(CLIENT, {}).get("codemodel-v2", {})
    if "jsonFile" not in answer:
        return None
    with open(os.path.join(reply, answer["jsonFile"]), encoding="utf-8") as f:
        return reply, json.load(f)


def _library_file(build_dir, build_type):
    """The path of target veloxquant_c's shared library, as the file API reports it."""
    found = _codemodel(build_dir)
    if found is None:
        raise RuntimeError(f"veloxquant build: CMake's file API did not answer in {build_dir}")
    reply, model = found
    configs = model["configurations"]
    config = next((c for c in configs if c["name"] == build_type), configs[0])
    target = next((t for t in config["targets"] if t["name"] == "veloxquant_c"), None)
    if target is None:
        raise RuntimeError(f"veloxquant build: {build_dir} has no target veloxquant_c "
                           "(configured with VELOXQUANT_BUILD_COMPILED=OFF?)")
    with open(os.path.join(reply, target["jsonFile"]), encoding="utf-8") as f:
        artifacts = [a["path"] for a in json.load(f).get("artifacts", [])]
    for path in artifacts:
        if re.search(r"\.(so(\.[0-9]+)*|dylib|dll)$", path):
            path = path if os.path.isabs(path) else os.path.join(model["paths"]["build"], path)
            return os.path.realpath(path)
    raise RuntimeError(f"veloxquant build: no shared library among {artifacts}")


def _cache_value(build_dir, name):
    with open(os.path.join(build_dir, "CMakeCache.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    return None


def _build_library(config_settings, scratch):
    """Builds veloxquant_c; returns the path of the shared library."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("veloxquant build: CMake (3.20 or later) is needed to build the C "
                           "library; Debian: apt-get install cmake")
    jobs = ["-j", str(os.cpu_count() or 1)]
    reuse = _setting(config_settings, "build-dir")
    if reuse:
        build_dir = os.path.abspath(reuse)
        if not os.path.isfile(os.path.join(build_dir, "CMakeCache.txt")):
            raise RuntimeError(f"veloxquant build: build-dir {build_dir} is not a configured "
                               "CMake build tree")
        home = _cache_value(build_dir, "CMAKE_HOME_DIRECTORY")
        if home is None or os.path.realpath(home) != os.path.realpath(ROOT):
            raise RuntimeError(f"veloxquant build: build-dir {build_dir} was configured from "
                               f"{home}, not from {ROOT}")
        build_type = _cache_value(build_dir, "CMAKE_BUILD_TYPE") or ""
        _query(build_dir)
        if _codemodel(build_dir) is None:  # its configure step answers the query
            _run([cmake, build_dir])
    else:
        build_dir = os.path.join(scratch, "build")
        build_type = _setting(config_settings, "build-type") or "Release"
        _query(build_dir)
        _run([cmake, "-S", ROOT, "-B", build_dir, f"-DCMAKE_BUILD_TYPE={build_type}",
              "-DVELOXQUANT_BUILD_COMPILED=ON", "-DVELOXQUANT_BUILD_TESTS=OFF",
              "-DVELOXQUANT_BUILD_EXAMPLES=OFF", "-DVELOXQUANT_BUILD_BENCHMARKS=OFF",
              "-DVELOXQUANT_INSTALL=OFF", "-DVELOXQUANT_WERROR=OFF"]
             + shlex.split(_setting(config_settings, "cmake-args") or ""))
    command = [cmake, "--build", build_dir, "--target", "veloxquant_c"] + jobs
    if build_type:
        command += ["--config", build_type]
    _run(command)
    return _library_file(build_dir, build_type)


# ---- PEP 517 hooks -----------------------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    dist_info = f"{NAME}-{_version()}.dist-info"
    os.makedirs(os.path.join(metadata_directory, dist_info), exist_ok=True)
    for name, data in _dist_info_files().items():
        with open(os.path.join(metadata_directory, dist_info, name), "wb") as f:
            f.write(data)
    return dist_info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = _version()
    dist_info = f"{NAME}-{version}.dist-info"
    wheel_name = f"{NAME}-{version}-{_tag()}.whl"
    files = []  # (path in the wheel, bytes)
    package = os.path.join(ROOT, "python", NAME)
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                files.append((f"{NAME}/{name}", f.read()))
    with tempfile.TemporaryDirectory(prefix="veloxquant-build-") as scratch:
        library = _build_library(config_settings, scratch)
        _log(f"packing {library} as {NAME}/{LIBRARY}")
        with open(library, "rb") as f:
            files.append((f"{NAME}/{LIBRARY}", f.read()))
    files += [(f"{dist_info}/{name}", data) for name, data in _dist_info_files().items()]
    record = io.StringIO()
    for path, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{path},sha256={digest},{len(data)}\n")
    record.write(f"{dist_info}/RECORD,,\n")
    os.makedirs(wheel_directory, exist_ok=True)
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel_name), "w",
                         zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files:
            info = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if path.endswith(LIBRARY) else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
        wheel.writestr(zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)),
                       record.getvalue())
    return wheel_name


def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{_version()}"
    name = f"{base}.tar.gz"

    def keep(info):
        parts = info.name.split("/")
        return None if "__pycache__" in parts or info.name.endswith(".pyc") else info

    os.makedirs(sdist_directory, exist_ok=True)
    path = os.path.join(sdist_directory, name)
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for entry in SDIST_ENTRIES:
            tar.add(os.path.join(ROOT, entry), arcname=f"{base}/{entry}", filter=keep)
        pkg_info = _metadata().encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return name
