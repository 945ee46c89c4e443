"""KVCacheConfig, KVCacheBuilder, the model's CacheSet and its per-layer KVCache objects."""
import ctypes
import functools
import numbers

import numpy as np

from . import _lib
from ._lib import check, lib

_INT_MAX = 2**31 - 1


@functools.lru_cache(maxsize=None)
def _types():
    """{field: type} of every KVCacheConfig field, probed from the values vq_config_set takes."""
    c = _new(lib().vq_config_new())
    try:
        types = {}
        for i in range(lib().vq_config_field_count()):
            name = lib().vq_config_field_name(i)
            for probe, kind in ((b"x", str), (b"0.5", float), (b"true", bool), (b"none", None)):
                if lib().vq_config_set(c, name, probe) == _lib.OK:
                    break
            else:
                kind = int
            types[name.decode()] = kind
        return types
    finally:
        lib().vq_config_free(c)


def _new(handle):
    """handle, unless a constructor returned NULL (out of memory)."""
    if not handle:
        raise _lib.OutOfMemoryError("veloxquant: out of memory")
    return handle


def _format(value):
    if value is None:
        return "none"
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, str):
        return value
    raise TypeError(f"a config value must be str, int, float, bool or None, not {type(value)}")


class KVCacheConfig:
    """Every knob of every policy (C++ KVCacheConfig), read and set as attributes.

    KVCacheConfig(method="h2o", h2o_budget=64) sets fields through vq_config_set; a value may be
    a str (passed as is), int, float, bool or None (an unset optional budget). Unknown fields
    and unparsable values raise ValueError; the values' meaning is checked by validate() and
    when caches are built.
    """

    def __init__(self, **fields):
        object.__setattr__(self, "_handle", None)
        object.__setattr__(self, "_handle", _new(lib().vq_config_new()))
        for name, value in fields.items():
            setattr(self, name, value)

    def __del__(self):
        if getattr(self, "_handle", None) and _lib._lib is not None:
            _lib._lib.vq_config_free(self._handle)
            object.__setattr__(self, "_handle", None)

    @staticmethod
    def fields():
        """The field names (those readable as attributes; "budget" is only set)."""
        return [f for f in _types() if f != "budget"]

    def __setattr__(self, name, value):
        if name.startswith("_"):
            return object.__setattr__(self, name, value)
        check(lib().vq_config_set(self._handle, _lib.text(name, "field"),
                                  _lib.text(_format(value), "value")))

    def __getattr__(self, name):  # only for names that are not ordinary attributes
        if name.startswith("_") or name not in _types() or name == "budget":
            raise AttributeError(f"KVCacheConfig has no field {name!r}")
        buf, needed = ctypes.create_string_buffer(64), ctypes.c_size_t(0)
        if lib().vq_config_get(self._handle, name.encode(), buf, 64, ctypes.byref(needed)) != 0:
            buf = ctypes.create_string_buffer(needed.value)
            check(lib().vq_config_get(self._handle, name.encode(), buf, needed.value, None))
        value, kind = buf.value.decode("utf-8"), _types()[name]
        if kind is None:
            return None if value == "none" else int(value)
        return (value == "true") if kind is bool else kind(value)

    def set_budget(self, rows):
        """Sets every method's budget (squeeze_budget, h2o_budget, ...; stream_window_size)."""
        self.budget = rows

    def validate(self):
        """Raises ValueError naming the first bad field of the configured method."""
        check(lib().vq_config_validate(self._handle))

    def to_dict(self):
        """{field: value} of every field."""
        return {f: getattr(self, f) for f in self.fields()}

    def copy(self):
        """An independent copy (vq_config_copy)."""
        out = KVCacheConfig()
        lib().vq_config_free(out._handle)
        object.__setattr__(out, "_handle", None)
        object.__setattr__(out, "_handle", _new(lib().vq_config_copy(self._handle)))
        return out

    __copy__ = copy

    def __deepcopy__(self, memo):
        return self.copy()

    def __reduce__(self):
        return (_config_from_dict, (self.to_dict(),))

    def __eq__(self, other):
        return isinstance(other, KVCacheConfig) and self.to_dict() == other.to_dict()

    __hash__ = None

    def __repr__(self):
        return f"KVCacheConfig(method={self.method!r})"


def _config_from_dict(fields):
    return KVCacheConfig(**fields)


def _tensor(name, x, kv_dtype=None):
    """(array, vq_tensor) for a [B, H, S, D] input: float16/32/64 as is, uint16 (or an
    ml_dtypes bfloat16) as bfloat16 bits, anything else converted to float32."""
    a = np.asarray(x)
    if kv_dtype is not None and a.dtype != kv_dtype:
        a = a.astype(kv_dtype)
    codes = {"float16": _lib.F16, "float32": _lib.F32, "float64": _lib.F64,
             "uint16": _lib.BF16, "bfloat16": _lib.BF16}
    if a.dtype.name not in codes:
        a = a.astype(np.float32)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if a.ndim != 4:
        raise _lib.InvalidArgumentError(f"{name} must be 4-D [B, H, S, D]; its shape is {a.shape}")
    if max(a.shape) > _INT_MAX:
        raise _lib.InvalidArgumentError(f"{name}: a dimension of {a.shape} exceeds INT_MAX")
    a = np.ascontiguousarray(a)
    return a, _lib.Tensor(a.ctypes.data, codes[a.dtype.name], *a.shape, _lib.HEAD_MAJOR)


def _kv_dtype(keys, values):
    """The one dtype keys and values are passed in (the C ABI takes one for both)."""
    k, v = np.asarray(keys).dtype, np.asarray(values).dtype
    if k == v:
        return None
    if k.kind == "f" and v.kind == "f":
        return np.promote_types(k, v)
    raise _lib.InvalidArgumentError(f"keys ({k}) and values ({v}) must have the same dtype")


class KVCache:
    """Layer `layer` of a CacheSet: the calls of one attention layer."""

    def __init__(self, caches, layer):
        self._set, self.layer = caches, layer

    def update_and_fetch(self, keys, values, queries=None):
        """Absorbs keys/values [B, H, S, D] (queries [B, G*H, S, D] optional: real-query
        scoring) and returns (K, V), float32 [B, H, n, D]: the rows kept before the call and the
        call's S rows, in ascending position (the call's last). Attention over them needs only the
        causal mask on the last S."""
        kd = _kv_dtype(keys, values)
        k, kt = _tensor("keys", keys, kd)
        v, vt = _tensor("values", values, kd)
        q, qt = _tensor("queries", queries) if queries is not None else (None, None)
        rows, h = ctypes.c_int64(0), self._set._handle
        if self._ragged(k.shape[0], k.shape[1]):  # refused before the call, as in C++
            raise _lib.InvalidArgumentError(
                "update_and_fetch: the heads hold different numbers of rows (adaptive head "
                "budgets or a compress), which one dense array cannot return; use attend")
        check(lib().vq_update(h, self.layer, kt, vt, qt, ctypes.byref(rows)))
        B, H, _, Dk = k.shape
        K = np.empty((B, H, rows.value, Dk), np.float32)
        V = np.empty((B, H, rows.value, v.shape[3]), np.float32)
        check(lib().vq_fetch(h, self.layer, K.ctypes.data, V.ctypes.data, _lib.HEAD_MAJOR))
        return K, V

    def attend(self, queries, keys, values):
        """Absorbs keys/values [B, H, S, D] and returns softmax(q K^T / sqrt(D)) V over the kept
        rows and the call's own (causal), float32 [B, Hq, S, Dv]; queries [B, Hq = G*H, S, D]."""
        kd = _kv_dtype(keys, values)
        k, kt = _tensor("keys", keys, kd)
        v, vt = _tensor("values", values, kd)
        q, qt = _tensor("queries", queries)
        out = np.empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), np.float32)
        check(lib().vq_attend_ex(self._set._handle, self.layer, qt, kt, vt, out.ctypes.data,
                                 _lib.HEAD_MAJOR))
        return out

    def observe(self, queries, keys=None):
        """KVzip (method "kvzip"): scores every kept row by the attention queries [B, G*H, S, D]
        (RoPE applied; a re-read of the prompt) give it, the most any query and query head of its
        group gives it. With keys [B, H, S, D] (the re-read's own), each query's softmax also runs
        over them up to its token, KVzip's own normalisation. Changes no row; CacheSet.compress
        then keeps the best-observed rows."""
        q, qt = _tensor("queries", queries)
        if keys is None:
            check(lib().vq_observe(self._set._handle, self.layer, qt))
            return
        k, kt = _tensor("keys", keys)
        check(lib().vq_observe_keys(self._set._handle, self.layer, qt, kt))

    @property
    def offset(self):
        """The true position of the layer's next token (its RoPE position)."""
        return self._value(lib().vq_offset, -1)

    @property
    def layer_budget(self):
        """This layer's resolved (or fallback) per-layer budget: rows per KV head kept after a
        call; None without one (a standard cache)."""
        b = lib().vq_layer_budget(self._set._handle, self.layer)  # -1: no budget
        return None if b < 0 else b

    @property
    def tokens_kept(self):
        """Tokens currently in the (B=0, H=0) head's cache (the reference's diagnostic; heads
        differ only with adaptive head budgets: max_head_rows())."""
        return self._value(lib().vq_layer_tokens_kept, -1)

    @property
    def tokens_seen(self):
        """Total token positions ever passed to the layer, all heads summed: B * H * S over its
        calls since the set was built or reset."""
        return self._value(lib().vq_layer_tokens_seen, -1)

    def max_head_rows(self):
        """The most rows any KV head of the layer holds now (tokens_kept unless adaptive head
        budgets made the heads differ)."""
        return self._value(lib().vq_rows, -1)

    def head_rows(self, b, h):
        """Rows head (b, h) holds now (adaptive head budgets: heads differ)."""
        n = lib().vq_head_rows(self._set._handle, self.layer, b, h)
        if n < 0:
            raise _lib.InvalidArgumentError(_lib.last_error())
        return n

    def _ragged(self, batch, heads):
        """Whether the layer's heads hold different numbers of rows (batch x heads: the call's;
        a layer of other dims refuses the call itself)."""
        h, layer = self._set._handle, self.layer
        rows = {lib().vq_head_rows(h, layer, b, hh) for b in range(batch) for hh in range(heads)}
        rows.discard(-1)
        return len(rows) > 1

    @property
    def kept_bytes(self):
        """Bytes of the K and V rows this layer holds, as stored (C++ KVCache::kept_bytes)."""
        return self._value(lib().vq_layer_kept_bytes)

    @property
    def squeeze_kept_bytes(self):
        """Bytes currently stored across all heads (K + V, kept tokens only): kept_bytes, under
        the reference's name."""
        return self.kept_bytes

    @property
    def full_seq_bytes(self):
        """Hypothetical K + V cost if all tokens were kept, in the storage type:
        B * H * offset * (Dk + Dv) * its size."""
        return self._value(lib().vq_layer_full_seq_bytes)

    @property
    def compression_ratio(self):
        """full_seq_bytes / kept_bytes; > 1 means memory savings (1.0 while nothing is kept)."""
        return self._value(lib().vq_layer_compression_ratio, -1.0)

    @property
    def concentration(self):
        """This layer's measured concentration score (SqueezeAttention: the mean over heads of
        the keys' mean pairwise cosine similarity, frozen once calibrated; 0.0 before prefill).
        0.0 for a layer of another method, which measures none."""
        return self._value(lib().vq_layer_concentration, "nan")

    def is_trimmable(self):
        """False for every eviction policy: trim() could not roll back their per-token state
        (only the standard cache, method "standard" or a layer without attention, is)."""
        return self._value(lib().vq_layer_is_trimmable, -1) == 1

    def _value(self, fn, error=None):
        """fn(set, layer), a vq_ function that returns a value; raises the library's message when
        it returned its error value (`error`: -1, -1.0 or "nan"; None for the byte counts, whose
        error value 0 is also a count: a KVCache's layer and set are always valid)."""
        value = fn(self._set._handle, self.layer)
        if error is not None and (value != value if error == "nan" else value == error):
            raise _lib.InvalidArgumentError(_lib.last_error())
        return value

    def __repr__(self):
        return f"<veloxquant.KVCache layer {self.layer} offset {self.offset}>"


class CacheSet:
    """One model's caches (a sequence of KVCache, one per layer), from KVCacheBuilder.for_model or
    CacheSet.load. One thread at a time per set."""

    def __init__(self, handle):
        self._handle = handle
        self._n_layers = lib().vq_layers(handle)
        # Layer objects are made on demand: a list of them, each referring back to the set, would
        # be a cycle that keeps the C set alive until the garbage collector runs.

    def __del__(self):
        if getattr(self, "_handle", None) and _lib._lib is not None:
            _lib._lib.vq_caches_free(self._handle)
            self._handle = None

    def __len__(self):
        return self._n_layers

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n_layers))]
        if not isinstance(i, numbers.Integral):
            raise TypeError(f"layer index must be an int, not {type(i).__name__}")
        j = int(i) + self._n_layers if i < 0 else int(i)
        if not 0 <= j < self._n_layers:
            raise IndexError(f"layer {i} out of range (the set has {self._n_layers} layers)")
        return KVCache(self, j)

    def __iter__(self):
        return (KVCache(self, j) for j in range(self._n_layers))

    @property
    def storage(self):
        """How rows are stored: "half", "bfloat16" or "float"."""
        s = ctypes.c_int(0)
        check(lib().vq_storage_of(self._handle, ctypes.byref(s)))
        return {v: k for k, v in _lib.STORAGES.items()}[s.value]

    @property
    def kept_bytes(self):
        """Bytes of rows the whole set holds (the layers' kept_bytes summed)."""
        return lib().vq_kept_bytes(self._handle)

    @property
    def metadata(self):
        """The set's string metadata (saved with it, read back by load), as a new dict."""
        out = {}
        for i in range(lib().vq_metadata_count(self._handle)):
            k, v = ctypes.c_char_p(), ctypes.c_char_p()
            check(lib().vq_metadata_at(self._handle, i, ctypes.byref(k), ctypes.byref(v)))
            out[k.value.decode("utf-8")] = v.value.decode("utf-8")
        return out

    def reset(self):
        """Every layer back to empty, before an unrelated sequence."""
        lib().vq_reset(self._handle)

    def fork(self, pool=None):
        """An independent copy that continues bit-identically (metadata copied). A copy of a set
        in a MemoryPool joins that pool; given `pool`, the copy joins it (NoRoomError when its
        floors do not fit)."""
        out = ctypes.c_void_p()
        if pool is None:
            check(lib().vq_fork(self._handle, ctypes.byref(out)))
        else:
            check(lib().vq_fork_pooled(self._handle, _pool_handle(pool), ctypes.byref(out)))
        return CacheSet(out.value)

    __copy__ = fork

    def __deepcopy__(self, memo):
        return self.fork()

    def __reduce__(self):
        raise TypeError("a CacheSet is not picklable; use save() and CacheSet.load()")

    def checkpoint(self):
        """Marks the set's state; a later checkpoint replaces it."""
        check(lib().vq_checkpoint(self._handle))

    def rollback(self):
        """Returns to the checkpoint and consumes it; StateError without one."""
        check(lib().vq_rollback(self._handle))

    def compress(self, keep):
        """KVzip: keeps ceil(keep x the rows held) rows of the set's kvzip layers, the
        best-observed over all their heads (one threshold, a floor per head); keep in (0, 1].
        Every kvzip layer must have been observed since its reset."""
        check(lib().vq_compress(self._handle, float(keep)))

    def save(self, path, metadata=None):
        """Writes the set to path (replaced atomically). metadata (a dict of str), when given,
        replaces the set's metadata, if the save succeeds (on any error it is left as it was)."""
        if metadata is None:
            check(lib().vq_save(self._handle, _lib.text(path, "path")))
            return
        new = {_lib.text(k, "key"): _lib.text(v, "value") for k, v in metadata.items()}
        old = self.metadata
        try:
            self._replace_metadata({k.encode("utf-8"): v.encode("utf-8") for k, v in old.items()},
                                   new)
            check(lib().vq_save(self._handle, _lib.text(path, "path")))
        except BaseException:
            self._replace_metadata(new, {k.encode("utf-8"): v.encode("utf-8")
                                         for k, v in old.items()})
            raise

    def _replace_metadata(self, current, wanted):
        """Metadata from `current` to `wanted` (dicts of bytes)."""
        for key in current:
            if key not in wanted:
                check(lib().vq_metadata_set(self._handle, key, None))
        for key, value in wanted.items():
            check(lib().vq_metadata_set(self._handle, key, value))

    @classmethod
    def load(cls, path, pool=None):
        """A new set from a file save() wrote, continuing exactly where the saved one stood;
        given `pool` (a MemoryPool), attached to it (NoRoomError when its floors do not fit)."""
        out = ctypes.c_void_p()
        if pool is None:
            check(lib().vq_load(_lib.text(path, "path"), ctypes.byref(out)))
        else:
            check(lib().vq_load_pooled(_lib.text(path, "path"), _pool_handle(pool),
                                       ctypes.byref(out)))
        return cls(out.value)

    def __repr__(self):
        return f"<veloxquant.CacheSet {len(self)} layers, {self.storage}>"


class MemoryPool:
    """One byte cap over many sequences' sets (C++ MemoryPool, docs/design.md 10.5): sets attach
    at creation (KVCacheBuilder.for_model(..., pool=), CacheSet.fork(pool=), CacheSet.load(...,
    pool=)) and leave when freed or by release(). After every call on an attached set the pool
    holds at most max_bytes, taking rows from its sets (fair shares), never below a head's floor
    (the config's pool_floor_rows plus its sinks)."""

    def __init__(self, max_bytes):
        if not isinstance(max_bytes, numbers.Integral) or max_bytes < 0:
            raise _lib.InvalidArgumentError(f"max_bytes ({max_bytes!r}) must be an int >= 0")
        out = ctypes.c_void_p()
        check(lib().vq_pool_new(int(max_bytes), ctypes.byref(out)))
        self._handle = out.value

    def __del__(self):
        if getattr(self, "_handle", None) and _lib._lib is not None:
            _lib._lib.vq_pool_free(self._handle)
            self._handle = None

    @property
    def max_bytes(self):
        return lib().vq_pool_max_bytes(self._handle)

    @property
    def used_bytes(self):
        """The attached sets' kept bytes (as counted at the end of each layer's last call)."""
        return lib().vq_pool_used_bytes(self._handle)

    @property
    def floor_bytes(self):
        """What the attached sets' floors claim."""
        return lib().vq_pool_floor_bytes(self._handle)

    @property
    def sequences(self):
        """Attached sets."""
        return lib().vq_pool_sequences(self._handle)

    def release(self, caches):
        """Detaches `caches` (a CacheSet): its bytes and floors return to the pool; it works on,
        limited by its policy alone."""
        check(lib().vq_pool_release(caches._handle))

    def __repr__(self):
        return (f"<veloxquant.MemoryPool {self.used_bytes}/{self.max_bytes} bytes, "
                f"{self.sequences} sequences>")


def _pool_handle(pool):
    if not isinstance(pool, MemoryPool):
        raise _lib.InvalidArgumentError(f"pool must be a MemoryPool, not {type(pool).__name__}")
    return pool._handle


class KVCacheBuilder:
    """Builds a model's caches (C++ KVCacheBuilder) and runs the set-wide operations."""

    @staticmethod
    def for_model(n_layers, config, storage="half", pool=None):
        """A CacheSet from config (validated), rows stored as storage ("half", "bfloat16" or
        "float"): n_layers caches, or, given a list of head dims, one cache per entry (None or 0:
        a layer without attention, which gets a standard cache), as C++ for_model does. Given
        `pool` (a MemoryPool; n_layers only), the set is attached to it: each layer's first call
        claims its heads' floors (NoRoomError, nothing changed, when they do not fit)."""
        if storage not in _lib.STORAGES:
            raise _lib.InvalidArgumentError(f"storage {storage!r} is not one of "
                                            f"{', '.join(_lib.STORAGES)}")
        out = ctypes.c_void_p()
        if pool is not None:
            if not isinstance(n_layers, numbers.Integral) or not 0 < n_layers <= _INT_MAX:
                raise _lib.InvalidArgumentError(
                    f"n_layers ({n_layers!r}) must be an int >= 1 with a pool")
            check(lib().vq_caches_new_pooled(config._handle, int(n_layers),
                                             _lib.STORAGES[storage], _pool_handle(pool),
                                             ctypes.byref(out)))
            return CacheSet(out.value)
        if not isinstance(n_layers, numbers.Integral):
            dims = [0 if d is None else d for d in n_layers]
            if not dims or not all(isinstance(d, numbers.Integral) and 0 <= d <= _INT_MAX
                                   for d in dims):
                raise _lib.InvalidArgumentError(
                    f"layer head dims ({n_layers!r}) must be a non-empty list of ints >= 0 or None")
            array = (ctypes.c_int * len(dims))(*dims)
            check(lib().vq_caches_new_dims(config._handle, array, len(dims),
                                           _lib.STORAGES[storage], ctypes.byref(out)))
            return CacheSet(out.value)
        if not 0 < n_layers <= _INT_MAX:
            raise _lib.InvalidArgumentError(f"n_layers ({n_layers!r}) must be an int >= 1")
        check(lib().vq_caches_new(config._handle, int(n_layers), _lib.STORAGES[storage],
                                  ctypes.byref(out)))
        return CacheSet(out.value)

    @staticmethod
    def reset(caches):
        caches.reset()

    @staticmethod
    def fork(caches, pool=None):
        return caches.fork(pool)

    @staticmethod
    def compress(caches, keep):
        caches.compress(keep)

    @staticmethod
    def checkpoint(caches):
        caches.checkpoint()

    @staticmethod
    def rollback(caches):
        caches.rollback()


def save_prompt_cache(path, caches, metadata=None):
    """caches.save(path, metadata)."""
    caches.save(path, metadata)


def load_prompt_cache(path, pool=None):
    """CacheSet.load(path, pool)."""
    return CacheSet.load(path, pool)
