"""pip install of the repository, as a Python user does it: a virtual environment, `pip install
<repository>` (the in-tree backend builds libveloxquant_c with CMake and puts it in the package;
nothing is downloaded), then `import veloxquant` and real calls with no library path set.

Environment: VELOXQUANT_SOURCE_DIR (the repository; default: two levels up), and optionally
VELOXQUANT_PIP_BUILD_DIR, an already configured build tree of that repository for the backend
to reuse (pip's --config-settings build-dir=...: it runs `cmake --build` for veloxquant_c there,
so an up-to-date tree compiles nothing); without it the backend builds the library from scratch
(Release: about a minute on 2 cores). tests/python/CMakeLists.txt registers this as
python.pip_install with the suite's own build tree. Skipped, saying why, when the interpreter
cannot make a virtual environment with pip (Debian: python3-venv) or has no numpy (the module's
one dependency, taken from the system's site-packages: pip cannot download it offline).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

SOURCE = os.environ.get("VELOXQUANT_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_DIR = os.environ.get("VELOXQUANT_PIP_BUILD_DIR")

# Run by the installed module, outside the source tree: it must load the library it carries.
CHECK = r"""
import os, sys
import numpy as np
import veloxquant as vq
from veloxquant import _lib
here = os.path.dirname(vq.__file__)
assert here.startswith(sys.prefix), (here, sys.prefix)
assert _lib.library_path() == os.path.join(here, _lib.BUNDLED), _lib.library_path()
config = vq.KVCacheConfig(method="h2o", h2o_n_sink=1)
config.set_budget(6)
caches = vq.KVCacheBuilder.for_model(2, config, storage="float")
rng = np.random.default_rng(3)
out = caches[0].attend(rng.standard_normal((1, 4, 10, 8)), rng.standard_normal((1, 2, 10, 8)),
                       rng.standard_normal((1, 2, 10, 8)))
assert out.shape == (1, 4, 10, 8) and np.isfinite(out).all()
layer = caches[0]
assert (layer.offset, layer.tokens_kept, layer.tokens_seen) == (10, 6, 20)
assert layer.compression_ratio == 10 / 6 and not layer.is_trimmable()
print("veloxquant", vq.library_version(), "from", _lib.library_path())
"""


def clean_env(**extra):
    """The environment without the suite's library path or module path: the installed package
    must find its own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VELOXQUANT_C_LIBRARY", "PYTHONPATH", "PYTHONHOME", "PIP_CONFIG_FILE")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


class PipInstallTest(unittest.TestCase):
    def skip(self, reason):
        print("SKIP: " + reason, flush=True)  # ctest's SKIP_REGULAR_EXPRESSION
        self.skipTest(reason)

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="vq_pip_")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def run_step(self, what, command, **kwargs):
        start = time.monotonic()
        r = subprocess.run(command, capture_output=True, text=True, **kwargs)
        print(f"  {what}: {time.monotonic() - start:.1f} s", flush=True)
        if r.returncode != 0:
            self.fail(f"{what} failed ({r.returncode}): {' '.join(command)}\n"
                      f"--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}")
        return r

    def make_venv(self):
        """A virtual environment with pip that sees the system's numpy; skips if there is none."""
        try:
            import numpy  # noqa: F401
        except ImportError:
            self.skip("numpy is not importable (the module's dependency)")
        venv = os.path.join(self.tmp, "venv")
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv],
                           capture_output=True, text=True, env=clean_env())
        print(f"  python -m venv: {time.monotonic() - start:.1f} s", flush=True)
        if r.returncode != 0:
            if "ensurepip" in r.stdout + r.stderr or "No module named venv" in r.stderr:
                self.skip("python3 -m venv cannot make an environment with pip (Debian: "
                              "apt-get install python3-venv): " + (r.stdout + r.stderr).strip())
            self.fail(f"python -m venv failed: {r.stdout}{r.stderr}")
        bindir = "Scripts" if os.name == "nt" else "bin"
        return os.path.join(venv, bindir, "python")

    def test_pip_install_then_import(self):
        python = self.make_venv()
        install = [python, "-m", "pip", "install", "--no-index", "--no-cache-dir", SOURCE]
        if BUILD_DIR:
            install[4:4] = ["--config-settings", f"build-dir={BUILD_DIR}"]
        r = self.run_step("pip install", install, cwd=self.tmp, env=clean_env())
        self.assertIn("Successfully installed veloxquant", r.stdout)
        work = os.path.join(self.tmp, "elsewhere")  # not the source tree: no python/ to import
        os.mkdir(work)
        r = self.run_step("import and calls", [python, "-c", CHECK], cwd=work, env=clean_env())
        self.assertIn("veloxquant 0.1.0 from", r.stdout)
        self.assertIn(os.path.join(self.tmp, "venv"), r.stdout)
        print("  " + r.stdout.strip())


if __name__ == "__main__":
    unittest.main()
