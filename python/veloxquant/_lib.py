"""ctypes bindings of the C ABI (include/veloxquant/veloxquant.h) and its errors."""
import ctypes
import ctypes.util
import os
import sys

# vq_status
OK, EINVAL, ENOMEM, EIO, EFORMAT, ESTATE, ECALLBACK, ENOROOM = range(8)
# vq_storage, vq_layout, vq_dtype
STORAGES = {"half": 0, "bfloat16": 1, "float": 2}
HEAD_MAJOR = 0
F16, BF16, F32, F64 = range(4)


class VeloxQuantError(Exception):
    """Base of the errors a vq_ call reports; `status` is its vq_status."""

    status = None


class InvalidArgumentError(VeloxQuantError, ValueError):
    """VQ_EINVAL: a bad argument, field, value or shape; nothing changed."""

    status = EINVAL


class OutOfMemoryError(VeloxQuantError, MemoryError):
    """VQ_ENOMEM: memory ran out; nothing changed."""

    status = ENOMEM


class CacheIOError(VeloxQuantError, OSError):
    """VQ_EIO: a file could not be opened, read, written or renamed."""

    status = EIO


class FormatError(VeloxQuantError, ValueError):
    """VQ_EFORMAT: a file that is empty, truncated, corrupt or not a prompt cache."""

    status = EFORMAT


class StateError(VeloxQuantError, RuntimeError):
    """VQ_ESTATE: the set's state refuses the call (a rollback without a checkpoint)."""

    status = ESTATE


class CallbackError(VeloxQuantError, RuntimeError):
    """VQ_ECALLBACK: the engine's parallel-for failed; the layer was reset."""

    status = ECALLBACK


class NoRoomError(VeloxQuantError, MemoryError):
    """VQ_ENOROOM: a memory pool's floors do not fit beside its sets'; nothing changed (queue
    the request)."""

    status = ENOROOM


_ERRORS = {c.status: c for c in (InvalidArgumentError, OutOfMemoryError, CacheIOError,
                                 FormatError, StateError, CallbackError, NoRoomError)}


class Tensor(ctypes.Structure):
    """struct vq_tensor."""

    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("batch", ctypes.c_int),
                ("heads", ctypes.c_int), ("seq", ctypes.c_int), ("dim", ctypes.c_int),
                ("layout", ctypes.c_int)]


_p, _i, _i64, _st = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int
_s, _T = ctypes.c_char_p, ctypes.POINTER(Tensor)
_PP, _SP = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_char_p)
_PROTOTYPES = {  # name: (restype, argtypes)
    "vq_abi_version": (_i, []),
    "vq_library_version": (_s, []),
    "vq_last_error": (_s, []),
    "vq_config_new": (_p, []),
    "vq_config_free": (None, [_p]),
    "vq_config_copy": (_p, [_p]),
    "vq_config_set": (_st, [_p, _s, _s]),
    "vq_config_get": (_st, [_p, _s, ctypes.c_char_p, ctypes.c_size_t,
                            ctypes.POINTER(ctypes.c_size_t)]),
    "vq_config_field_count": (_i, []),
    "vq_config_field_name": (_s, [_i]),
    "vq_config_validate": (_st, [_p]),
    "vq_caches_new": (_st, [_p, _i, _i, _PP]),
    "vq_caches_new_dims": (_st, [_p, ctypes.POINTER(ctypes.c_int), _i, _i, _PP]),
    "vq_caches_free": (None, [_p]),
    "vq_layers": (_i, [_p]),
    "vq_storage_of": (_st, [_p, ctypes.POINTER(ctypes.c_int)]),
    "vq_attend_ex": (_st, [_p, _i, _T, _T, _T, _p, _i]),
    "vq_update": (_st, [_p, _i, _T, _T, _T, ctypes.POINTER(_i64)]),
    "vq_fetch": (_st, [_p, _i, _p, _p, _i]),
    "vq_offset": (_i64, [_p, _i]),
    "vq_layer_budget": (_i, [_p, _i]),
    "vq_rows": (_i64, [_p, _i]),
    "vq_head_rows": (_i64, [_p, _i, _i, _i]),
    "vq_kept_bytes": (ctypes.c_size_t, [_p]),
    "vq_layer_kept_bytes": (ctypes.c_size_t, [_p, _i]),
    "vq_layer_full_seq_bytes": (ctypes.c_size_t, [_p, _i]),
    "vq_layer_compression_ratio": (ctypes.c_double, [_p, _i]),
    "vq_layer_tokens_seen": (_i64, [_p, _i]),
    "vq_layer_tokens_kept": (_i64, [_p, _i]),
    "vq_layer_is_trimmable": (_i, [_p, _i]),
    "vq_layer_concentration": (ctypes.c_double, [_p, _i]),
    "vq_reset": (None, [_p]),
    "vq_fork": (_st, [_p, _PP]),
    "vq_checkpoint": (_st, [_p]),
    "vq_rollback": (_st, [_p]),
    "vq_observe": (_st, [_p, _i, _T]),
    "vq_observe_keys": (_st, [_p, _i, _T, _T]),
    "vq_compress": (_st, [_p, ctypes.c_double]),
    "vq_metadata_set": (_st, [_p, _s, _s]),
    "vq_metadata_count": (_i, [_p]),
    "vq_metadata_at": (_st, [_p, _i, _SP, _SP]),
    "vq_save": (_st, [_p, _s]),
    "vq_load": (_st, [_s, _PP]),
    "vq_pool_new": (_st, [ctypes.c_size_t, _PP]),
    "vq_pool_free": (None, [_p]),
    "vq_pool_max_bytes": (ctypes.c_size_t, [_p]),
    "vq_pool_used_bytes": (ctypes.c_size_t, [_p]),
    "vq_pool_floor_bytes": (ctypes.c_size_t, [_p]),
    "vq_pool_sequences": (_i, [_p]),
    "vq_caches_new_pooled": (_st, [_p, _i, _i, _p, _PP]),
    "vq_fork_pooled": (_st, [_p, _p, _PP]),
    "vq_load_pooled": (_st, [_s, _p, _PP]),
    "vq_pool_release": (_st, [_p]),
}

# The ABI this module needs: major 1, minor 4 or later (the memory pool).
ABI_MAJOR, ABI_MINOR = 1, 4
# The library's file name where an installed package carries it beside this module (pip install
# of the repository: python/pip_backend/veloxquant_backend.py puts it there).
BUNDLED = {"darwin": "libveloxquant_c.dylib", "win32": "veloxquant_c.dll"}.get(
    sys.platform, "libveloxquant_c.so")

_lib = None


def library_path():
    """The library to load: $VELOXQUANT_C_LIBRARY (a full path) when set, else the one installed
    beside this module, else ctypes.util.find_library("veloxquant_c"); None if none is found."""
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), BUNDLED)
    return (os.environ.get("VELOXQUANT_C_LIBRARY")
            or (bundled if os.path.isfile(bundled) else None)
            or ctypes.util.find_library("veloxquant_c"))


def lib():
    """The loaded libveloxquant_c (library_path())."""
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    if not path:
        raise OSError("veloxquant: libveloxquant_c not found; install the package (pip install "
                      "<the repository>) or set VELOXQUANT_C_LIBRARY to the full path of "
                      "libveloxquant_c.so (CMake target veloxquant_c)")
    try:
        handle = ctypes.CDLL(path)
    except OSError as e:
        raise OSError(f"veloxquant: cannot load the C library '{path}': {e}") from e
    handle.vq_abi_version.restype, handle.vq_abi_version.argtypes = ctypes.c_int, []
    abi = handle.vq_abi_version()  # before the prototypes: an older library lacks some
    if abi // 1000 != ABI_MAJOR or abi % 1000 < ABI_MINOR:
        raise OSError(f"veloxquant: '{path}' has ABI {abi // 1000}.{abi % 1000}; this module "
                      f"needs {ABI_MAJOR}.{ABI_MINOR} or a later {ABI_MAJOR}.x")
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(handle, name)
        fn.restype, fn.argtypes = restype, argtypes
    _lib = handle
    return _lib


def last_error():
    """This thread's message for its last failing vq_ call."""
    return lib().vq_last_error().decode("utf-8", "replace")


def check(status):
    """Raises the exception of a status other than VQ_OK, carrying vq_last_error()."""
    if status != OK:
        raise _ERRORS.get(status, VeloxQuantError)(last_error())


def text(value, what):
    """value as the NUL-terminated UTF-8 bytes a const char* takes."""
    data = os.fsencode(value) if what == "path" else str(value).encode("utf-8")
    if b"\0" in data:
        raise InvalidArgumentError(f"{what} {value!r} contains a NUL character")
    return data
