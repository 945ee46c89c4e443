"""The Python module (python/veloxquant) against the C++ library.

ReferenceTest replays, through the module, the calls veloxquant_py_reference (reference.cpp) made
through the C++ API ($VELOXQUANT_PY_REFERENCE), on the inputs it wrote, and requires its outputs
and states bit for bit. The other tests check the module's own behaviour: configs, the set's
operations, input types and errors. Run: python3 -m unittest discover -s tests/python, with
VELOXQUANT_C_LIBRARY and PYTHONPATH=python set (tests/python/CMakeLists.txt does).
"""
import copy
import gc
import os
import pickle
import subprocess
import sys
import tempfile
import unittest
import weakref

try:
    import numpy as np
except ImportError:
    print("SKIP: numpy is not importable")
    raise unittest.SkipTest("numpy is not importable")

import veloxquant as vq

REFERENCE = os.environ.get("VELOXQUANT_PY_REFERENCE")
INPUT_DTYPES = {"float16": np.float16, "bfloat16": np.uint16,  # bfloat16 bits
                "float32": np.float32, "float64": np.float64}


def assert_same_bits(test, got, want, what):
    """got and want: the same shape and dtype and the same bits (stricter than np.array_equal:
    -0.0 is not 0.0)."""
    test.assertEqual(got.shape, want.shape, what)
    test.assertEqual(got.dtype, want.dtype, what)
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        at = np.unravel_index(np.nanargmax(diff), got.shape)
        test.fail(f"{what}: {np.count_nonzero(got != want)} of {got.size} elements differ, the "
                  f"largest by {np.nanmax(diff)} at {at}")


def assert_same_window(test, got, want, what):
    """got and want, (keys, values) [B, H, n, D] windows, hold the same rows bit for bit in the
    same order: ascending position, as C++ update_and_fetch returns them and vq_fetch copies."""
    for g, w in zip(got, want):
        test.assertEqual((g.shape, g.dtype), (w.shape, w.dtype), what)
        assert_same_bits(test, g, w, what)


def read_trace(directory):
    """{scenario: {storage, dtype, n_layers, config: [(field, text)], records: [[token]]}}."""
    scenarios, current = {}, None
    with open(os.path.join(directory, "trace.txt"), encoding="utf-8") as f:
        for line in f:
            tokens = line.split()
            if tokens[0] == "scenario":
                current = {"storage": tokens[2], "dtype": tokens[3], "n_layers": int(tokens[4]),
                           "config": [], "records": []}
                scenarios[tokens[1]] = current
            elif tokens[0] == "config":
                current["config"].append((tokens[1], tokens[2] if len(tokens) > 2 else ""))
            elif tokens[0] != "end":
                current["records"].append(tokens)
    with open(os.path.join(directory, "data.bin"), "rb") as f:
        return scenarios, f.read()


@unittest.skipUnless(REFERENCE, "VELOXQUANT_PY_REFERENCE (the reference program) is not set")
class ReferenceTest(unittest.TestCase):
    """The same calls through the C++ API and through the module give the same bits."""

    SCENARIOS = ["squeeze_half", "squeeze_float_f64", "squeeze_keydiff_defer", "h2o_half_f16",
                 "snapkv_float", "standard_half", "tova_bf16", "pyramidkv_float",
                 "streaming_half_f64"]

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        subprocess.run([REFERENCE, cls.tmp.name], check=True)
        cls.scenarios, cls.data = read_trace(cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def array(self, offset, shape, dtype):
        count = int(np.prod(shape))
        return np.frombuffer(self.data, dtype, count, offset).reshape(shape)

    def replay(self, name):
        sc = self.scenarios[name]
        inputs = INPUT_DTYPES[sc["dtype"]]
        config = vq.KVCacheConfig(**dict(sc["config"]))
        for field, value in sc["config"]:  # every value reads back as the C++ one
            got = getattr(config, field)
            want = {"true": True, "false": False, "none": None}.get(value, value)
            if isinstance(got, (int, float)) and not isinstance(got, bool):
                want = type(got)(value)
            self.assertEqual(got, want, field)
        sets = {}
        for i, rec in enumerate(sc["records"]):
            op, args = rec[0], [int(a) if a.lstrip("-").isdigit() else a for a in rec[1:]]
            where = f"{name}, record {i}: {' '.join(rec)}"
            if op == "build":
                sets[args[0]] = vq.KVCacheBuilder.for_model(sc["n_layers"], config, sc["storage"])
            elif op == "attend":
                s, layer, B, H, Hq, S, Dk, Dv, q, k, v, out = args
                got = sets[s][layer].attend(self.array(q, (B, Hq, S, Dk), inputs),
                                            self.array(k, (B, H, S, Dk), inputs),
                                            self.array(v, (B, H, S, Dv), inputs))
                assert_same_bits(self, got, self.array(out, (B, Hq, S, Dv), np.float32), where)
            elif op == "update":
                s, layer, B, H, Hq, S, Dk, Dv, k, v, q, n, K, V = args
                queries = None if q < 0 else self.array(q, (B, Hq, S, Dk), inputs)
                got_k, got_v = sets[s][layer].update_and_fetch(
                    self.array(k, (B, H, S, Dk), inputs), self.array(v, (B, H, S, Dv), inputs),
                    queries)
                want = (self.array(K, (B, H, n, Dk), np.float32),
                        self.array(V, (B, H, n, Dv), np.float32))
                assert_same_window(self, (got_k, got_v), want, where)
            elif op == "fork":
                sets[args[1]] = sets[args[0]].fork()
            elif op == "checkpoint":
                sets[args[0]].checkpoint()
            elif op == "rollback":
                sets[args[0]].rollback()
            elif op == "reset":
                sets[args[0]].reset()
            elif op == "saveload":
                s, file = args
                mine = os.path.join(self.tmp.name, "module-" + file)
                sets[s].save(mine, metadata={"scenario": name})
                with open(mine, "rb") as a, open(os.path.join(self.tmp.name, file), "rb") as b:
                    self.assertEqual(a.read(), b.read(), where + ": the files differ")
                sets[s] = vq.CacheSet.load(mine)
                self.assertEqual(sets[s].metadata, {"scenario": name}, where)
                self.assertEqual(sets[s].storage, sc["storage"], where)
            elif op == "state":
                s, layer, offset, budget, rows, kept = args[:6]
                seen, layer_kept, full, ratio, concentration, trimmable = args[6:]
                c = sets[s][layer]
                self.assertEqual((c.offset, c.layer_budget, c.tokens_kept, sets[s].kept_bytes),
                                 (offset, None if budget < 0 else budget, rows, kept), where)
                # The reference's diagnostics, the doubles to the bit (%.17g reads back exactly).
                self.assertEqual((c.tokens_seen, c.kept_bytes, c.squeeze_kept_bytes,
                                  c.full_seq_bytes, c.compression_ratio, c.concentration,
                                  c.is_trimmable()),
                                 (seen, layer_kept, layer_kept, full, float(ratio),
                                  float(concentration), trimmable == 1), where)
            else:
                self.fail(f"{where}: unknown record")

    def test_every_scenario_is_replayed(self):
        self.assertEqual(sorted(self.scenarios), sorted(self.SCENARIOS))

    def test_squeeze_half(self):
        self.replay("squeeze_half")

    def test_squeeze_float_f64(self):
        self.replay("squeeze_float_f64")

    def test_squeeze_keydiff_defer(self):
        self.replay("squeeze_keydiff_defer")

    def test_h2o_half_f16(self):
        self.replay("h2o_half_f16")

    def test_snapkv_float(self):
        self.replay("snapkv_float")

    def test_standard_half(self):
        self.replay("standard_half")

    def test_tova_bf16(self):
        self.replay("tova_bf16")

    def test_pyramidkv_float(self):
        self.replay("pyramidkv_float")

    def test_streaming_half_f64(self):
        self.replay("streaming_half_f64")


def squeeze_set(n_layers=2, budget=8, storage="half"):
    config = vq.KVCacheConfig(squeeze_n_sink=1, squeeze_calibration_tokens=8)
    config.set_budget(budget)
    return vq.KVCacheBuilder.for_model(n_layers, config, storage=storage)


def step(caches, rng, seq, B=1, H=2, G=2, D=8):
    """One model call on every layer: even layers attend, odd ones update_and_fetch with
    queries. Returns the outputs."""
    outs = []
    for layer, cache in enumerate(caches):
        q, k, v = (rng.standard_normal(s).astype(np.float32)
                   for s in ((B, H * G, seq, D), (B, H, seq, D), (B, H, seq, D)))
        outs.extend([cache.attend(q, k, v)] if layer % 2 == 0 else cache.update_and_fetch(k, v, q))
    return outs


class ConfigTest(unittest.TestCase):
    def test_defaults(self):
        c = vq.KVCacheConfig()
        self.assertEqual(c.method, "squeeze")
        self.assertEqual(c.squeeze_budget, 512)
        self.assertIsNone(c.squeeze_resolved_budget)
        self.assertIs(c.squeeze_defer, False)
        self.assertIsInstance(c.squeeze_strength, float)
        self.assertEqual(c.squeeze_decay, 0.98)

    def test_keywords_and_attributes(self):
        c = vq.KVCacheConfig(method="h2o", h2o_budget=64, h2o_decay=0.9, squeeze_defer=True,
                             squeeze_resolved_budget=100, value_norm_power="1.5")
        self.assertEqual((c.method, c.h2o_budget, c.h2o_decay), ("h2o", 64, 0.9))
        self.assertEqual((c.squeeze_defer, c.squeeze_resolved_budget), (True, 100))
        self.assertEqual(c.value_norm_power, 1.5)
        c.squeeze_resolved_budget = None
        c.h2o_budget = np.int64(32)
        self.assertEqual((c.squeeze_resolved_budget, c.h2o_budget), (None, 32))

    def test_set_budget(self):
        c = vq.KVCacheConfig(stream_n_sink=3)
        c.set_budget(100)
        for f in ("squeeze_budget", "h2o_budget", "pyramid_budget", "tova_budget", "snap_budget"):
            self.assertEqual(getattr(c, f), 100, f)
        self.assertEqual(c.stream_window_size, 97)

    def test_fields_copy_pickle(self):
        c = vq.KVCacheConfig(method="tova", tova_budget=33)
        self.assertIn("method", vq.KVCacheConfig.fields())
        self.assertNotIn("budget", vq.KVCacheConfig.fields())
        self.assertEqual(set(c.to_dict()), set(vq.KVCacheConfig.fields()))
        for other in (c.copy(), copy.copy(c), copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
            self.assertEqual(other, c)
            other.tova_budget = 7
            self.assertEqual(c.tova_budget, 33)

    def test_bad_field(self):
        with self.assertRaises(ValueError) as e:
            vq.KVCacheConfig(no_such_field=1)
        self.assertIn("no_such_field", str(e.exception))
        self.assertIsInstance(e.exception, vq.InvalidArgumentError)
        c = vq.KVCacheConfig()
        with self.assertRaisesRegex(ValueError, "squeeze_bugdet"):
            c.squeeze_bugdet = 8
        self.assertFalse(hasattr(c, "squeeze_bugdet"))

    def test_bad_value(self):
        c = vq.KVCacheConfig()
        for field, value in (("squeeze_budget", "many"), ("squeeze_budget", 1.5),
                             ("squeeze_defer", "maybe"), ("squeeze_decay", "0,5")):
            with self.assertRaisesRegex(ValueError, field):
                setattr(c, field, value)
        self.assertEqual(c.squeeze_budget, 512)  # a failed set changes nothing

    def test_validate(self):
        c = vq.KVCacheConfig(squeeze_n_sink=600)
        with self.assertRaisesRegex(ValueError, "squeeze_n_sink"):
            c.validate()
        with self.assertRaisesRegex(ValueError, "squeeze_n_sink"):
            vq.KVCacheBuilder.for_model(2, c)
        vq.KVCacheConfig(method="streaming_llm").validate()


class CacheSetTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def test_prefill_then_decode(self):
        caches = squeeze_set(n_layers=3)
        self.assertEqual((len(caches), caches.storage), (3, "half"))
        self.assertEqual([c.layer for c in caches], [0, 1, 2])
        self.assertEqual(caches[-1].layer, 2)
        rng = np.random.default_rng(1)
        offset = 0
        for seq in [12] + [1] * 10:
            before = [c.tokens_kept for c in caches]
            outs = step(caches, rng, seq)
            self.assertEqual(outs[0].shape, (1, 4, seq, 8))
            self.assertEqual(outs[1].shape, (1, 2, before[1] + seq, 8))
            self.assertEqual(outs[1].dtype, np.float32)
            offset += seq
            for c in caches:
                self.assertEqual(c.offset, offset)
                self.assertLessEqual(c.tokens_kept, c.layer_budget)
        self.assertGreater(caches.kept_bytes, 0)
        self.assertEqual(sum(c.layer_budget for c in caches), 3 * 8)

    def test_returned_rows(self):
        caches = vq.KVCacheBuilder.for_model(1, vq.KVCacheConfig(method="standard"), "float")
        self.assertIsNone(caches[0].layer_budget)
        rng = np.random.default_rng(2)
        k1, v1 = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 6))
        k2, v2 = rng.standard_normal((2, 3, 2, 4)), rng.standard_normal((2, 3, 2, 6))
        caches[0].update_and_fetch(k1, v1)
        K, V = caches[0].update_and_fetch(k2, v2)
        np.testing.assert_array_equal(K, np.concatenate([k1, k2], 2).astype(np.float32))
        np.testing.assert_array_equal(V, np.concatenate([v1, v2], 2).astype(np.float32))
        caches.reset()
        self.assertEqual((caches[0].offset, caches[0].tokens_kept, caches.kept_bytes), (0, 0, 0))
        half = vq.KVCacheBuilder.for_model(1, vq.KVCacheConfig(method="standard"))
        K, _ = half[0].update_and_fetch(k1, v1)
        np.testing.assert_array_equal(K, k1.astype(np.float16).astype(np.float32))

    def test_input_dtypes(self):
        """The same values as float16, float32, float64 and bfloat16 bits give the same bits."""
        rng = np.random.default_rng(3)
        # values exact in float16 and bfloat16: multiples of 1/8 in [-2, 2]
        q, k, v = (np.round(rng.uniform(-2, 2, s) * 8) / 8 for s in
                   ((1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)))
        results = []
        for storage in ("half", "bfloat16", "float"):
            for dtype in (np.float16, np.float32, np.float64, "bf16"):
                cast = ((lambda a: (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
                        if dtype == "bf16" else (lambda a: a.astype(dtype)))
                caches = squeeze_set(storage=storage)
                out = caches[0].attend(cast(q), cast(k), cast(v))
                K, V = caches[1].update_and_fetch(cast(k), cast(v), cast(q))
                results.append((storage, dtype, out, K, V))
        for storage, dtype, out, K, V in results:
            first = next(r for r in results if r[0] == storage)
            for a, b in zip((out, K, V), first[2:]):
                assert_same_bits(self, a, b, f"{storage} from {dtype}")

    def test_save_load_continues(self):
        for storage in ("half", "float"):
            caches = squeeze_set(storage=storage)
            rng = np.random.default_rng(4)
            for seq in (6, 1, 1):
                step(caches, rng, seq)
            path = os.path.join(self.tmp.name, f"{storage}.vqkv")
            caches.save(path, metadata={"prompt": "Once upon a time", "n": "3"})
            loaded = vq.CacheSet.load(path)
            self.assertEqual(loaded.metadata, {"prompt": "Once upon a time", "n": "3"})
            self.assertEqual((loaded.storage, len(loaded)), (storage, 2))
            self.assertEqual([c.offset for c in loaded], [c.offset for c in caches])
            self.assertEqual(loaded.kept_bytes, caches.kept_bytes)
            for seq in (1, 1, 2, 1, 1, 1):  # past the coordinator's decision
                a = step(caches, np.random.default_rng(seq), seq)
                b = step(loaded, np.random.default_rng(seq), seq)
                for x, y in zip(a, b):
                    assert_same_bits(self, x, y, f"{storage}: loaded vs saved")
            self.assertEqual([c.layer_budget for c in loaded], [c.layer_budget for c in caches])
            vq.save_prompt_cache(path, loaded)  # the module-level names; metadata kept
            self.assertEqual(vq.load_prompt_cache(path).metadata["n"], "3")

    def test_fork(self):
        caches = squeeze_set()
        step(caches, np.random.default_rng(5), 7)
        fork = vq.KVCacheBuilder.fork(caches)
        for seq in (1, 1, 1):
            a = step(caches, np.random.default_rng(seq), seq)
            b = step(fork, np.random.default_rng(seq), seq)
            for x, y in zip(a, b):
                assert_same_bits(self, x, y, "fork vs source")
        step(fork, np.random.default_rng(9), 4)
        self.assertEqual((caches[0].offset, fork[0].offset), (10, 14))
        self.assertEqual(copy.deepcopy(fork)[1].offset, 14)

    def test_kvzip_observe_and_compress(self):
        """KVzip (SPEC 18): observe scores a layer's rows, compress keeps a share of the set's
        rows over every head, the heads then ragged; compress before observe refuses."""
        config = vq.KVCacheConfig(method="kvzip", kvzip_n_sink=1)
        caches = vq.KVCacheBuilder.for_model(2, config, "float")
        rng = np.random.default_rng(12)
        q, k, v = (rng.standard_normal(s).astype(np.float32)
                   for s in ((1, 4, 40, 8), (1, 2, 40, 8), (1, 2, 40, 8)))
        for cache in caches:
            cache.attend(q, k, v)
        caches[0].observe(rng.standard_normal((1, 4, 10, 8)))
        with self.assertRaisesRegex(vq.InvalidArgumentError, "cache 1 has not been observed"):
            caches.compress(0.25)
        with self.assertRaisesRegex(vq.InvalidArgumentError, "must be in"):
            caches.compress(1.5)
        caches[1].observe(rng.standard_normal((1, 4, 10, 8)), rng.standard_normal((1, 2, 10, 8)))
        before = caches.kept_bytes
        vq.KVCacheBuilder.compress(caches, 0.25)
        rows = sum(c.head_rows(0, h) for c in caches for h in range(2))
        self.assertEqual(rows, 40)  # ceil(0.25 x 160)
        self.assertEqual(caches.kept_bytes * 160, before * 40)
        with self.assertRaisesRegex(vq.InvalidArgumentError, "different numbers of rows"):
            caches[0].update_and_fetch(k[:, :, :1], v[:, :, :1])
        out = caches[0].attend(q[:, :, :1], k[:, :, :1], v[:, :, :1])
        self.assertEqual(out.shape, (1, 4, 1, 8))

    def test_layer_head_dims(self):
        """for_model with a list of head dims: None is a layer without attention (standard)."""
        config = vq.KVCacheConfig(method="h2o")
        config.set_budget(8)
        caches = vq.KVCacheBuilder.for_model([8, None, 8], config, "float")
        self.assertEqual([c.layer_budget for c in caches], [8, None, 8])
        rng = np.random.default_rng(11)
        q, k, v = (rng.standard_normal(s).astype(np.float32)
                   for s in ((1, 4, 20, 8), (1, 2, 20, 8), (1, 2, 20, 8)))
        for cache in caches:
            cache.attend(q, k, v)
        self.assertEqual([c.tokens_kept for c in caches], [8, 20, 8])
        self.assertEqual([c.kept_bytes for c in caches], [2 * 8 * 16 * 4, 2 * 20 * 16 * 4,
                                                          2 * 8 * 16 * 4])
        self.assertEqual(sum(c.kept_bytes for c in caches), caches.kept_bytes)
        with self.assertRaises(ValueError):  # a call whose dim is not the first call's
            caches[0].attend(*(np.zeros((1, h, 1, 16), np.float32) for h in (4, 2, 2)))
        with self.assertRaises(ValueError):
            vq.KVCacheBuilder.for_model([8, -1], config)

    def test_a_set_is_freed_when_dropped(self):
        """No reference cycle keeps a set (and its C memory) alive until the collector runs."""
        gc.disable()
        self.addCleanup(gc.enable)
        caches = squeeze_set()
        step(caches, np.random.default_rng(3), 5)
        fork = caches.fork()
        layers = list(fork)
        alive = weakref.ref(fork)
        del fork
        self.assertIsNotNone(alive())  # its layer objects still hold it
        del layers
        self.assertIsNone(alive())

    def test_checkpoint_rollback(self):
        caches = squeeze_set()
        step(caches, np.random.default_rng(6), 6)
        caches.checkpoint()
        kept = caches.kept_bytes
        first = [step(caches, np.random.default_rng(10 + i), 1) for i in range(4)]
        self.assertEqual(caches[0].offset, 10)
        vq.KVCacheBuilder.rollback(caches)
        self.assertEqual((caches[0].offset, caches[1].offset, caches.kept_bytes), (6, 6, kept))
        again = [step(caches, np.random.default_rng(10 + i), 1) for i in range(4)]
        for a, b in zip(first, again):
            for x, y in zip(a, b):
                assert_same_bits(self, x, y, "after the rollback")
        with self.assertRaises(vq.StateError):  # the rollback consumed the checkpoint
            caches.rollback()


class AdaptiveHeadsTest(unittest.TestCase):
    def test_ragged_heads(self):
        """Adaptive head budgets (docs/design.md 4.9): the heads share 4 x 8 rows and come to
        hold different numbers; attend serves them, update_and_fetch refuses before the call
        (nothing changes) and head_rows says what each holds."""
        config = vq.KVCacheConfig(method="h2o", h2o_n_sink=1, h2o_grace=1,
                                  head_budgets="adaptive", head_budget_floor=0.25)
        config.set_budget(8)
        caches = vq.KVCacheBuilder.for_model(1, config, storage="float")
        twin = caches.fork()
        rng = np.random.default_rng(5)
        layer = caches[0]
        counts = set()
        for seq in [12] + [1] * 16:
            q, k, v = (rng.standard_normal(s).astype(np.float32)
                       for s in ((1, 8, seq, 8), (1, 4, seq, 8), (1, 4, seq, 8)))
            np.testing.assert_array_equal(layer.attend(q, k, v), twin[0].attend(q, k, v))
            rows = [layer.head_rows(0, h) for h in range(4)]
            self.assertEqual(sum(rows), 4 * 8)
            self.assertGreaterEqual(min(rows), 2)
            # tokens_kept is head (0, 0)'s, as the reference counts it.
            self.assertEqual((layer.tokens_kept, layer.max_head_rows()), (rows[0], max(rows)))
            counts.add(len(set(rows)))
        self.assertGreater(max(counts), 1)  # the heads did come to differ
        self.assertGreater(len(set(layer.head_rows(0, h) for h in range(4))), 1)
        k = rng.standard_normal((1, 4, 1, 8))
        before = (layer.offset, [layer.head_rows(0, h) for h in range(4)], caches.kept_bytes)
        with self.assertRaisesRegex(vq.InvalidArgumentError, "different numbers of rows"):
            layer.update_and_fetch(k, k)
        self.assertEqual(before,
                         (layer.offset, [layer.head_rows(0, h) for h in range(4)],
                          caches.kept_bytes))
        with self.assertRaises(vq.InvalidArgumentError):
            layer.head_rows(0, 4)
        with self.assertRaises(vq.InvalidArgumentError):
            vq.KVCacheConfig(head_budgets="per_head").validate()
        with self.assertRaises(vq.InvalidArgumentError):
            vq.KVCacheConfig(head_budget_floor=0.0).validate()


class ChannelAxisTest(unittest.TestCase):
    def test_channel_rows(self):
        """Keys and values quantized along channels (docs/design.md 7.5) through the C ABI's
        fields by name: a pending block of 16 rows at T, sealed blocks at 4 bits with one table
        each; the rows read back near the inputs, exactly while pending; a bad axis is named."""
        config = vq.KVCacheConfig(method="standard", key_bits=4, value_bits=4,
                                  key_axis="channel", value_axis="channel", quant_block=16)
        self.assertEqual((config.key_axis, config.quant_block), ("channel", 16))
        caches = vq.KVCacheBuilder.for_model(1, config, storage="float")
        rng = np.random.default_rng(9)
        k = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
        got_k, _ = caches[0].update_and_fetch(k, k)
        np.testing.assert_array_equal(got_k[:, :, 32:], k[:, :, 32:])  # the pending block
        self.assertLess(np.abs(got_k[:, :, :32] - k[:, :, :32]).max(), 0.5)
        self.assertFalse(np.array_equal(got_k[:, :, :32], k[:, :, :32]))
        # Two tensors x 2 heads: 40 rows of 4 bytes of codes, 2 tables of 8 x 4 bytes, 16 rows
        # of 8 floats pending.
        self.assertEqual(caches.kept_bytes, 2 * 2 * (40 * 4 + 2 * 32 + 16 * 32))
        with self.assertRaisesRegex(vq.InvalidArgumentError, "key_axis"):
            vq.KVCacheConfig(key_axis="channels").validate()


def grid(rng, shape):
    """float32 multiples of 1/64 in [-1, 1]: exact in half, bfloat16 and float."""
    return (rng.integers(-64, 65, size=shape) / 64.0).astype(np.float32)


def concentration_of(keys):
    """The concentration of keys [B, H, S, D] computed here in double: per head the mean pairwise
    cosine similarity of its rows (i != j), then the mean over the heads."""
    k = np.asarray(keys, np.float64)
    scores = []
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            u = k[b, h] / np.linalg.norm(k[b, h], axis=1, keepdims=True)
            g, n = u @ u.T, u.shape[0]
            scores.append((g.sum() - np.trace(g)) / (n * (n - 1)))
    return float(np.mean(scores))


class DiagnosticsTest(unittest.TestCase):
    """The reference's per-layer diagnostics, under its names and of its kinds (properties, and
    the method is_trimmable()), with their values (ReferenceTest also requires them to be the C++
    library's, bit for bit, after every call of its scenarios)."""

    PROPERTIES = ("layer_budget", "concentration", "squeeze_kept_bytes", "full_seq_bytes",
                  "compression_ratio", "tokens_seen", "tokens_kept")

    def test_kinds(self):
        for name in self.PROPERTIES:
            self.assertIsInstance(getattr(vq.KVCache, name), property, name)
        self.assertTrue(callable(vq.KVCache.is_trimmable))
        self.assertNotIsInstance(vq.KVCache.__dict__["is_trimmable"], property)
        layer = squeeze_set()[0]
        for name in self.PROPERTIES:
            self.assertIsInstance(getattr(layer, name), (int, float), name)
        self.assertIs(layer.is_trimmable(), False)

    def test_squeeze_values(self):
        """Two sequences, 2 KV heads, keys of 8 and values of 4 elements, rows in half."""
        config = vq.KVCacheConfig(squeeze_n_sink=1, squeeze_calibration_tokens=4)
        config.set_budget(8)
        caches = vq.KVCacheBuilder.for_model(2, config, storage="half")
        layer = caches[0]
        self.assertEqual((layer.tokens_seen, layer.tokens_kept, layer.full_seq_bytes,
                          layer.squeeze_kept_bytes, layer.compression_ratio, layer.concentration,
                          layer.layer_budget), (0, 0, 0, 0, 1.0, 0.0, 8))  # 0.0 before prefill
        rng = np.random.default_rng(11)
        B, H, D, Dv = 2, 2, 8, 4
        k = grid(rng, (B, H, 20, D))
        layer.attend(grid(rng, (B, 2 * H, 20, D)), k, grid(rng, (B, H, 20, Dv)))
        # B x H x S seen; the fallback budget kept (the coordinator waits for layer 1).
        self.assertEqual((layer.tokens_seen, layer.tokens_kept), (B * H * 20, 8))
        self.assertEqual(layer.full_seq_bytes, B * H * 20 * (D + Dv) * 2)
        self.assertEqual(layer.squeeze_kept_bytes, B * H * 8 * (D + Dv) * 2)
        self.assertEqual(layer.squeeze_kept_bytes, layer.kept_bytes)
        self.assertEqual(layer.compression_ratio, 2.5)
        want = concentration_of(k)
        self.assertNotEqual(want, 0.0)
        self.assertLessEqual(abs(layer.concentration - want), 1e-9)
        self.assertEqual(caches[1].concentration, 0.0)
        frozen = layer.concentration
        for i in range(3):  # decode: seen grows, the concentration stays (calibrated)
            layer.attend(grid(rng, (B, 2 * H, 1, D)), grid(rng, (B, H, 1, D)),
                         grid(rng, (B, H, 1, Dv)))
            self.assertEqual(layer.tokens_seen, B * H * (21 + i))
            self.assertEqual(layer.concentration, frozen)
            self.assertEqual(layer.compression_ratio,
                             layer.full_seq_bytes / layer.squeeze_kept_bytes)
        self.assertEqual(layer.compression_ratio, 23 / 8)
        # Layer 1's prompt: its own concentration, and the coordinator's budgets (total 2 x 8).
        k1 = grid(rng, (B, H, 12, D))
        caches[1].update_and_fetch(k1, grid(rng, (B, H, 12, Dv)))
        self.assertLessEqual(abs(caches[1].concentration - concentration_of(k1)), 1e-9)
        self.assertEqual(caches[0].layer_budget + caches[1].layer_budget, 16)
        self.assertEqual([c.is_trimmable() for c in caches], [False, False])
        copy = caches.fork()
        self.assertEqual([(c.tokens_seen, c.concentration, c.compression_ratio) for c in copy],
                         [(c.tokens_seen, c.concentration, c.compression_ratio) for c in caches])
        caches.reset()
        self.assertEqual((layer.tokens_seen, layer.tokens_kept, layer.full_seq_bytes,
                          layer.compression_ratio, layer.concentration), (0, 0, 0, 1.0, 0.0))
        self.assertEqual(copy[0].tokens_seen, B * H * 23)

    def test_other_methods(self):
        rng = np.random.default_rng(12)
        h2o = vq.KVCacheBuilder.for_model(1, vq.KVCacheConfig(method="h2o", h2o_budget=6),
                                          storage="float")
        standard = vq.KVCacheBuilder.for_model(1, vq.KVCacheConfig(method="standard"))
        for caches in (h2o, standard):
            for seq in (9, 1, 1):
                caches[0].update_and_fetch(grid(rng, (1, 2, seq, 8)), grid(rng, (1, 2, seq, 8)))
        a, b = h2o[0], standard[0]
        self.assertEqual((a.tokens_seen, a.tokens_kept, a.concentration, a.is_trimmable()),
                         (2 * 11, 6, 0.0, False))  # H2O measures no concentration
        self.assertEqual(a.compression_ratio, 11 / 6)
        self.assertEqual(a.full_seq_bytes, 2 * 11 * 16 * 4)
        self.assertEqual((b.tokens_seen, b.tokens_kept, b.compression_ratio, b.is_trimmable(),
                          b.layer_budget), (2 * 11, 11, 1.0, True, None))
        # A layer without attention is a standard cache too.
        dims = vq.KVCacheBuilder.for_model([8, None], vq.KVCacheConfig(method="pyramidkv"))
        self.assertEqual([c.is_trimmable() for c in dims], [False, True])


class MemoryPoolTest(unittest.TestCase):
    """One byte cap over many sets (SPEC 19): attached at creation, by a fork and by a load; the
    cap after every call; NoRoomError for floors that do not fit; release."""

    def test_pool(self):
        row = 2 * 8 * 2  # 2 KV heads of dim 8, half
        floor = 2 * 2 * 20 * row  # 2 layers, (16 + 4 sinks) rows a head
        pool = vq.MemoryPool(2 * floor + floor // 2)
        config = vq.KVCacheConfig(method="h2o")
        config.set_budget(64)
        a = vq.KVCacheBuilder.for_model(2, config, pool=pool)
        b = vq.KVCacheBuilder.for_model(2, config, pool=pool)
        rng = np.random.default_rng(3)
        for i in range(20):
            step(a, rng, 40 if i == 0 else 1)
            self.assertLessEqual(pool.used_bytes, pool.max_bytes)
            step(b, rng, 40 if i == 0 else 1)
            self.assertLessEqual(pool.used_bytes, pool.max_bytes)
        self.assertEqual(pool.sequences, 2)
        self.assertEqual(pool.used_bytes, a.kept_bytes + b.kept_bytes)
        self.assertEqual(pool.floor_bytes, 2 * floor)
        with self.assertRaises(vq.NoRoomError):
            a.fork()  # joins a's pool, where a third floor does not fit
        self.assertTrue(issubclass(vq.NoRoomError, MemoryError))
        with self.assertRaisesRegex(ValueError, "standard"):
            vq.KVCacheBuilder.for_model(2, vq.KVCacheConfig(method="standard"), pool=pool)
        pool.release(b)
        self.assertEqual(pool.sequences, 1)
        self.assertEqual(pool.used_bytes, a.kept_bytes)
        c = a.fork(pool)
        self.assertEqual(pool.sequences, 2)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "a.vqkv")
            a.save(path)
            del c
            gc.collect()
            loaded = vq.CacheSet.load(path, pool=pool)
            self.assertEqual(pool.sequences, 2)
            step(loaded, rng, 1)
            self.assertLessEqual(pool.used_bytes, pool.max_bytes)


class ErrorTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def test_hierarchy(self):
        for cls, base in ((vq.InvalidArgumentError, ValueError), (vq.FormatError, ValueError),
                          (vq.OutOfMemoryError, MemoryError), (vq.CacheIOError, OSError),
                          (vq.StateError, RuntimeError), (vq.CallbackError, RuntimeError),
                          (vq.NoRoomError, MemoryError)):
            self.assertTrue(issubclass(cls, base) and issubclass(cls, vq.VeloxQuantError), cls)

    def test_wrong_shape(self):
        caches = squeeze_set()
        step(caches, np.random.default_rng(7), 3)
        k, q = np.zeros((1, 2, 2, 8), np.float32), np.zeros((1, 4, 2, 8), np.float32)
        with self.assertRaisesRegex(ValueError, "4-D"):
            caches[1].update_and_fetch(k[0], k[0])
        with self.assertRaisesRegex(ValueError, "vq_update"):  # values of another length
            caches[1].update_and_fetch(k, np.zeros((1, 2, 3, 8), np.float32))
        with self.assertRaisesRegex(ValueError, "vq_attend_ex"):  # 3 query heads for 2 KV heads
            caches[0].attend(q[:, :3], k, k)
        with self.assertRaisesRegex(ValueError, "vq_update"):  # another head dim than before
            caches[1].update_and_fetch(np.zeros((1, 2, 2, 4), np.float32), k)
        with self.assertRaises(ValueError):  # not finite
            caches[0].attend(q, np.full_like(k, np.nan), k)
        with self.assertRaises(ValueError):
            caches[1].update_and_fetch(k, k.astype(np.int32).astype(np.uint8))
        self.assertEqual([c.offset for c in caches], [3, 3])  # the failed calls changed nothing
        step(caches, np.random.default_rng(8), 2)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "storage"):
            vq.KVCacheBuilder.for_model(2, vq.KVCacheConfig(), storage="fp8")
        with self.assertRaisesRegex(ValueError, "n_layers"):
            vq.KVCacheBuilder.for_model(0, vq.KVCacheConfig())
        with self.assertRaises(ValueError):
            squeeze_set().save(os.path.join(self.tmp.name, "a\0b"))

    def test_rollback_without_checkpoint(self):
        with self.assertRaisesRegex(vq.StateError, "checkpoint"):
            squeeze_set().rollback()

    def test_missing_file(self):
        path = os.path.join(self.tmp.name, "missing.vqkv")
        with self.assertRaises(OSError) as e:
            vq.CacheSet.load(path)
        self.assertIsInstance(e.exception, vq.CacheIOError)
        self.assertIn("missing.vqkv", str(e.exception))
        with self.assertRaises(OSError):
            squeeze_set().save(os.path.join(self.tmp.name, "no", "such", "dir.vqkv"))

    def test_failed_save_keeps_metadata(self):
        caches = squeeze_set()
        caches.save(os.path.join(self.tmp.name, "a.vqkv"), {"a": "1"})
        with self.assertRaises(OSError):
            caches.save(os.path.join(self.tmp.name, "no", "dir.vqkv"), {"b": "2"})
        with self.assertRaises(ValueError):
            caches.save(os.path.join(self.tmp.name, "b.vqkv"), {"b": "2", "c": "x\0y"})
        self.assertEqual(caches.metadata, {"a": "1"})

    def test_corrupt_file(self):
        caches = squeeze_set()
        step(caches, np.random.default_rng(9), 5)
        path = os.path.join(self.tmp.name, "good.vqkv")
        caches.save(path)
        with open(path, "rb") as f:
            good = f.read()
        flipped = bytearray(good)
        flipped[len(good) // 2] ^= 0x10
        for what, data in (("empty", b""), ("truncated", good[: len(good) // 2]),
                           ("flipped", bytes(flipped)), ("foreign", b"not a prompt cache\n" * 9),
                           ("trailing", good + b"\0")):
            bad = os.path.join(self.tmp.name, what + ".vqkv")
            with open(bad, "wb") as f:
                f.write(data)
            with self.assertRaises(vq.FormatError, msg=what) as e:
                vq.CacheSet.load(bad)
            self.assertIsInstance(e.exception, ValueError)
            self.assertIn(what + ".vqkv", str(e.exception), what)

    def test_library_not_found(self):
        env = dict(os.environ, VELOXQUANT_C_LIBRARY=os.path.join(self.tmp.name, "libnone.so"))
        r = subprocess.run([sys.executable, "-c", "import veloxquant; veloxquant.KVCacheConfig()"],
                           env=env, capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("libnone.so", r.stderr)
        self.assertIn("cannot load the C library", r.stderr)


if __name__ == "__main__":
    unittest.main()
