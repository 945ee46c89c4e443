"""veloxquant: KV-cache eviction (SqueezeAttention, H2O, PyramidKV, TOVA, StreamingLLM, SnapKV)
over the C ABI of libveloxquant_c, with ctypes and numpy, under the names of veloxquant_mlx.

    import veloxquant as vq
    cfg = vq.KVCacheConfig(method="squeeze")
    cfg.set_budget(256)
    caches = vq.KVCacheBuilder.for_model(n_layers, cfg, storage="half")
    K, V = caches[layer].update_and_fetch(k, v, q)   # numpy [B, H, S, D] in, float32 out
    out = caches[layer].attend(q, k, v)              # or the fused attention: [B, Hq, S, Dv]
    caches[layer].compression_ratio                  # the reference's diagnostics: tokens_seen,
                                                     # tokens_kept, full_seq_bytes, concentration,
                                                     # squeeze_kept_bytes, is_trimmable(), ...

The library is $VELOXQUANT_C_LIBRARY (a full path), else the one pip installed beside this module
(pip install <the repository>: docs/c_abi.md), else ctypes.util.find_library("veloxquant_c").
A failing call raises a VeloxQuantError carrying vq_last_error(): InvalidArgumentError
(a ValueError), OutOfMemoryError (MemoryError), CacheIOError (OSError), FormatError (ValueError),
StateError or CallbackError (RuntimeError).
"""
from ._lib import (CacheIOError, CallbackError, FormatError, InvalidArgumentError,
                   NoRoomError, OutOfMemoryError, StateError, VeloxQuantError)
from .cache import (CacheSet, KVCache, KVCacheBuilder, KVCacheConfig, MemoryPool,
                    load_prompt_cache, save_prompt_cache)

__all__ = ["KVCacheConfig", "KVCacheBuilder", "CacheSet", "KVCache", "save_prompt_cache",
           "load_prompt_cache", "library_version", "VeloxQuantError", "InvalidArgumentError",
           "OutOfMemoryError", "CacheIOError", "FormatError", "StateError", "CallbackError",
           "MemoryPool", "NoRoomError"]


def library_version():
    """The C++ library's version ("0.1.0")."""
    from ._lib import lib
    return lib().vq_library_version().decode()
