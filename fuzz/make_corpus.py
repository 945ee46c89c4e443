#!/usr/bin/env python3
"""Writes the hand-designed seed corpus of the veloxquant fuzzer into fuzz/corpus/.

Each seed spells out, byte by byte, what the ops target reads (fuzz_ops.hpp says what the bytes
choose; ops_config.hpp, ops_oracle.hpp, ops_harness.hpp and ops_calls.hpp read them): storage
type, policy, configuration, sequence dims and query mode, then operations. The seeds cover every
policy, every entry point, queries, resets, trims, coordinator reports, save and reload, fork,
checkpoint and rollback, and every kind of bad input, so the fuzzer starts from deep states instead
of from empty calls.

Run from anywhere: python3 fuzz/make_corpus.py   (rewrites fuzz/corpus/seed-*.bin)

The corpus also holds found-*.bin: inputs found by search or by the fuzzer that reach states the
hand seeds do not (e.g. an exact score tie at the first eviction after a deferred re-budget); this
script leaves them alone.
"""
import os
import struct

STORAGE = {"float": 0, "half": 1, "bf16": 2}
POLICY = {"standard": 0, "squeeze": 1, "squeeze_builder": 2, "h2o": 3, "pyramid": 4,
          "pyramid_builder": 5, "tova": 6, "streaming": 7, "snapkv": 8}
RATIO = [0.5, 0.0, 0.25, 0.75, 1.0, 0.3]
DECAY = [0.98, 1.0, 0.9, 0.5, 0.25]
STRENGTH = [1.0, 0.0, 0.5, 0.25]
BETA = [2.0, 1.0, 1.5, 3.0]
BAD = ["none", "nan-key", "inf-key", "overflow-key", "values-B", "values-H", "values-S", "zero-B",
       "zero-H", "zero-Dk", "zero-Dv", "change-B", "change-H", "change-Dk", "change-Dv", "query-Hq",
       "query-B", "query-S", "query-D", "query-nan", "query-inf", "query-overflow"]
API = {"fetch": 0, "view": 1, "into": 2}
MODE = {"uniform": 0, "ternary": 1, "sparse": 2, "palette": 3, "constant": 4}


def rng(lo, hi, v):
    """The byte that Bytes::range(lo, hi) reads as v."""
    assert lo <= v <= hi, (lo, v, hi)
    return v - lo


FLOOR = [0.2, 0.25, 0.5, 0.75, 1.0, 0.1, 0.34, 0.05]  # head_budget_floor, adaptive byte bits 0-2
CORE = ("squeeze", "squeeze_builder", "h2o", "pyramid", "pyramid_builder")


class Seed:
    def __init__(self, storage, policy, budget=8, n_sink=2, ratio=0.5, decay=0.98, direct=False,
                 defer=False, resolved=None, strength=1.0, layers=1, layer=0, grace=4, beta=2.0,
                 window=6, obs=4, invalid=None, proxy="key_as_query", value_power=None,
                 adaptive=None):
        """adaptive: the head_budget_floor of adaptive head budgets (SPEC 14; flag bits 2-3 = 2,
        then for an H2O-core policy one byte: the floor, and with `resolved` its resolved budget);
        value_power: value_norm_power (flag bit 7: 2.0, or 0.5 with bit 4)."""
        b = [STORAGE[storage], POLICY[policy], rng(1, 24, budget),
             rng(0, min(budget - 1, 5), n_sink), RATIO.index(ratio), DECAY.index(decay)]
        flags = (1 if direct else 0) | (2 if defer else 0)
        if adaptive is not None:
            flags |= 8
        elif resolved is not None:
            flags |= 4
        if value_power is not None:
            flags |= 128 | (16 if value_power == 0.5 else 0)
        if policy == "snapkv" and obs > 8:
            flags |= 16
        flags |= {"key_as_query": 0, "keydiff": 32, "knorm": 64}[proxy]  # bits 5-6
        b.append(flags)
        if policy in ("squeeze", "squeeze_builder"):
            b.append(STRENGTH.index(strength))
            if resolved is not None and adaptive is None:
                b.append(rng(n_sink + 1, 24, resolved))
            if policy == "squeeze_builder":
                b += [rng(1, 3, layers), rng(0, layers - 1, layer)]
        elif policy == "h2o":
            b.append(rng(0, 10, grace))
        elif policy in ("pyramid", "pyramid_builder"):
            b.append(BETA.index(beta))
            if policy == "pyramid" and resolved is not None and adaptive is None:
                b.append(rng(n_sink + 1, 24, resolved))
            if policy == "pyramid_builder":
                b += [rng(1, 4, layers), rng(0, layers - 1, layer)]
        elif policy == "streaming":
            b += [rng(0, 5, n_sink), rng(1, 16, window)]
        elif policy == "snapkv":
            b.append(rng(1, 40, obs) if obs > 8 else rng(1, 8, obs))
        if adaptive is not None and policy in CORE:
            b.append(FLOOR.index(adaptive) | (8 if resolved is not None else 0))
            if resolved is not None:
                b.append(rng(n_sink + 1, 24, resolved))
        if invalid is None:
            b.append(1)  # pick(12) != 0: a valid config
        else:
            b += [0] + list(invalid)  # pick(12) == 0, then break_config's bytes
        self.b = b

    def sequence(self, B=1, H=2, Dk=4, Dv=None, queries="none", palette_seed=7, one_hot=False):
        self.b += [rng(1, 2, B), rng(1, 3, H), rng(1, 8, Dk)]
        if Dv is None or Dv == Dk:
            self.b.append(0)
        else:
            self.b += [1, rng(1, 8, Dv)]
        self.b.append({"none": 0, "always": 2, "mixed": 3}[queries] | (0x30 if one_hot else 0))
        self.b += list(struct.pack(">I", palette_seed))
        return self

    def _call_bytes(self, api, as_double, qtype, G, with_q, kmode, qmode, seed):
        f = API[api] | (4 if as_double else 0) | (qtype << 3) | ((G - 1) << 5) | (128 if with_q else 0)
        return [f, MODE[kmode] | (MODE[qmode] << 3)] + list(struct.pack(">I", seed))

    def next_seed(self):
        self.seed_counter = getattr(self, "seed_counter", 0) + 1
        return 1000 + 7919 * self.seed_counter + self.b[1] * 104729

    def call(self, S, api="fetch", as_double=False, qtype=0, G=1, with_q=True, kmode="uniform",
             qmode="uniform", seed=None):
        """A valid call of S tokens (with_q only matters in mixed query mode)."""
        if S == 1:
            self.b.append(0)
        elif S == 0:
            self.b.append(5)
        else:
            self.b += [4, rng(0, 40, S)]
        if seed is None:
            seed = self.next_seed()
        self.b += self._call_bytes(api, as_double, qtype, G, with_q, kmode, qmode, seed)
        return self

    def bad(self, what, S=3, api="fetch", as_double=False, qtype=0, G=1, seed=None):
        self.b += [6, BAD.index(what) - 1, rng(0, 6, S)]
        if seed is None:
            seed = self.next_seed()
        self.b += self._call_bytes(api, as_double, qtype, G, True, "uniform", "uniform", seed)
        return self

    def reset(self, whole=False, **seq):
        self.b.append(7)
        if self.b[1] == POLICY["squeeze_builder"]:
            self.b.append(1 if whole else 0)
        return self.sequence(**seq)

    def trim(self, k):
        self.b += [8, rng(-2, 60, k)]
        return self

    def report(self, layer, c_index):
        self.b += [9, layer + 1, c_index]
        return self

    def parallel(self, on):
        self.b += [10, 1 if on else 0]
        return self

    def reload(self):
        """save_prompt_cache + load_prompt_cache of every cache of the run (op 15, choice 0)."""
        self.b += [15, 0]
        return self

    def fork(self, go_on_with_copy=True):
        """KVCacheBuilder::fork of the run's set, going on with the copy or the source (op 15,
        choice 1)."""
        self.b += [15, 1, 1 if go_on_with_copy else 0]
        return self

    def speculate(self, *drafts, G=1, with_q=True):
        """KVCacheBuilder::checkpoint, draft calls of the sizes given (1 to 3), rollback (op 15,
        choice 2)."""
        assert 1 <= len(drafts) <= 3
        self.b += [15, 2, len(drafts) - 1]
        for i, S in enumerate(drafts):
            api = ["fetch", "view", "into"][i % 3]
            self.b += self._call_bytes(api, False, 0, G, with_q, "uniform", "uniform",
                                       self.next_seed())
            self.b.append(rng(0, 12, S))
        return self

    def scramble_out(self):
        self.b += [11, 3, 1, 2, 5, 0, 1, 3]
        return self

    def bytes(self):
        return bytes(self.b)


def seeds():
    s = {}
    s["standard-trim"] = (Seed("float", "standard").sequence(B=2, H=2, Dk=3, Dv=5)
                          .call(7).call(1, api="view").trim(3).call(2, api="into").trim(-1)
                          .trim(50).call(4).bad("change-Dv").call(1, api="view"))
    s["squeeze-prefill-decode"] = (Seed("half", "squeeze", budget=10, n_sink=2).sequence(H=2, Dk=8)
                                   .call(30).call(1).call(1, api="view").call(1, api="into")
                                   .call(12, api="view").call(1))
    s["squeeze-ties"] = (Seed("float", "squeeze", budget=6, n_sink=1, ratio=0.0, decay=1.0)
                         .sequence(H=3, Dk=2).call(20, kmode="palette").call(1, kmode="constant")
                         .call(1, kmode="palette").call(9, kmode="ternary"))
    s["squeeze-queries"] = (Seed("bf16", "squeeze", budget=9, n_sink=3, resolved=7)
                            .sequence(B=2, H=1, Dk=5, queries="always")
                            .call(25, G=2).call(1, G=3, qtype=1).call(1, api="view", G=1, qtype=2)
                            .call(6, api="into", as_double=True, G=2))
    s["squeeze-builder-defer"] = (Seed("float", "squeeze_builder", budget=8, n_sink=1, defer=True,
                                       layers=3, layer=1, strength=1.0)
                                  .sequence(H=2, Dk=4).call(14).report(0, 3).call(1)
                                  .report(2, 2).call(1).call(3, api="view")
                                  .reset(whole=True).call(12).report(0, 1).report(2, 4).call(2))
    s["squeeze-builder-reports"] = (Seed("half", "squeeze_builder", budget=12, n_sink=2,
                                         resolved=5, layers=2, layer=0, strength=0.5)
                                    .sequence(B=2, H=1, Dk=3, queries="mixed").report(-1, 0)
                                    .report(1, 8).call(16, with_q=False).report(1, 5).call(1)
                                    .call(1, with_q=False).reset(whole=False).call(9).report(3, 2))
    s["squeeze-builder-one-layer"] = (Seed("bf16", "squeeze_builder", budget=5, n_sink=0,
                                           defer=True, layers=1, layer=0)
                                      .sequence(H=3, Dk=1).call(11).call(1).call(1))
    s["h2o-decode"] = (Seed("float", "h2o", budget=12, n_sink=2, grace=3, decay=0.9)
                       .sequence(B=2, H=2, Dk=6, Dv=2).call(5).call(1).call(1).call(1).call(1)
                       .call(1).call(1).call(1).call(1).call(1).call(1, api="view").call(1))
    s["h2o-queries-g3"] = (Seed("half", "h2o", budget=7, n_sink=1, grace=10, decay=1.0)
                           .sequence(H=3, Dk=7, queries="always").call(18, G=3)
                           .call(1, G=3, api="view").call(3, G=2, api="into", qtype=2))
    s["pyramid-single"] = (Seed("float", "pyramid", budget=16, n_sink=4, resolved=6, ratio=0.75,
                                decay=0.5).sequence(H=1, Dk=8).call(40, kmode="sparse")
                           .call(1, api="view").call(1))
    s["pyramid-builder"] = (Seed("bf16", "pyramid_builder", budget=10, n_sink=2, beta=3.0,
                                 layers=4, layer=3).sequence(B=2, H=2, Dk=2)
                            .call(20).call(1).call(1, api="into"))
    s["tova-proxy"] = (Seed("float", "tova", budget=5, n_sink=1).sequence(H=2, Dk=3)
                       .call(12, kmode="palette").call(1).call(1, api="view").call(4, api="into"))
    s["tova-queries"] = (Seed("half", "tova", budget=9, n_sink=0)
                         .sequence(B=2, H=2, Dk=4, queries="always").call(15, G=2)
                         .call(1, G=2).call(1, G=1, api="view"))
    s["streaming"] = (Seed("bf16", "streaming", n_sink=3, window=4).sequence(H=3, Dk=5, Dv=1)
                      .call(9).call(1).call(1, api="view").call(0).call(6, api="into").trim(4)
                      .call(2))
    s["snapkv-proxy"] = (Seed("float", "snapkv", budget=6, n_sink=2, obs=3)
                         .sequence(B=2, H=1, Dk=4).call(3).call(14, kmode="palette").call(1)
                         .call(9, api="view"))
    s["snapkv-queries"] = (Seed("half", "snapkv", budget=10, n_sink=1, obs=20)
                           .sequence(H=2, Dk=6, queries="always").call(33, G=2).call(1, G=2)
                           .call(1, G=1, api="into"))
    s["snapkv-mixed"] = (Seed("float", "snapkv", budget=4, n_sink=0, obs=2)
                         .sequence(H=1, Dk=2, queries="mixed").call(2, with_q=False)
                         .call(8, with_q=True, G=3).call(5, with_q=False))
    s["bad-keys"] = (Seed("half", "h2o", budget=6, n_sink=1, grace=2).sequence(B=2, H=2, Dk=3, Dv=4)
                     .bad("nan-key").bad("inf-key", api="view").bad("overflow-key", as_double=True)
                     .bad("values-B").bad("values-H").bad("values-S").bad("zero-B").bad("zero-H")
                     .bad("zero-Dk").bad("zero-Dv").call(8).bad("change-B").bad("change-H")
                     .bad("change-Dk").bad("change-Dv", S=0).bad("nan-key", api="into")
                     .call(1))
    s["bad-queries"] = (Seed("float", "squeeze", budget=5, n_sink=1).sequence(B=1, H=2, Dk=4)
                        .call(6).bad("query-Hq", G=2).bad("query-B").bad("query-S", S=0)
                        .bad("query-D", api="view").bad("query-nan", api="into")
                        .bad("query-inf", G=3).bad("query-overflow", qtype=1).call(1))
    s["bad-queries-tova"] = (Seed("bf16", "tova", budget=4, n_sink=1).sequence(H=3, Dk=2)
                             .bad("query-Hq").call(5).bad("query-nan", qtype=2).call(1))
    s["reset-redims"] = (Seed("float", "snapkv", budget=3, n_sink=1, obs=2).sequence(H=1, Dk=2)
                         .call(0).call(5).reset(B=2, H=3, Dk=7, Dv=1).call(4).call(1)
                         .parallel(False).call(2).parallel(True).scramble_out()
                         .call(1, api="into"))
    s["standard-queries"] = (Seed("half", "standard", direct=True)
                             .sequence(B=2, H=3, Dk=2, queries="always")
                             .call(3, G=2).call(0, G=3).call(1, api="view", G=1, qtype=1)
                             .scramble_out().call(2, api="into", G=2).trim(1))
    # One-hot sequences (keys/queries in {-64, 0, 64}): exact ties on every scored path.
    s["onehot-h2o"] = (Seed("float", "h2o", budget=6, n_sink=1, grace=1, decay=1.0)
                       .sequence(H=2, Dk=1, one_hot=True).call(9, kmode="ternary").call(1).call(1)
                       .call(1, api="view").call(1).call(5).call(1).call(1))
    s["onehot-squeeze-defer-trim"] = (Seed("half", "squeeze_builder", budget=5, n_sink=1,
                                           defer=True, layers=2, layer=0, ratio=0.25)
                                      .sequence(B=2, H=1, Dk=2, one_hot=True).call(12).call(1)
                                      .call(1).report(1, 2).call(1).call(1).call(3))
    s["onehot-queries"] = (Seed("bf16", "pyramid", budget=7, n_sink=2, ratio=0.0, decay=0.5)
                           .sequence(H=1, Dk=3, queries="always", one_hot=True).call(14, G=2)
                           .call(1, G=3).call(1, G=1).call(4, G=2, api="into"))
    s["onehot-tova-snapkv"] = (Seed("float", "snapkv", budget=5, n_sink=1, obs=3)
                               .sequence(H=3, Dk=2, one_hot=True).call(11).call(1)
                               .reset(H=2, Dk=1, one_hot=True).call(7).call(1))
    # Saved and loaded mid-run (prompt caches on disk): every policy, calibration in flight, a
    # deferring builder model, quantities the oracles then keep checking.
    s["reload-squeeze-builder-defer"] = (Seed("float", "squeeze_builder", budget=8, n_sink=1,
                                              defer=True, layers=3, layer=1)
                                         .sequence(H=2, Dk=4).reload().call(14).reload()
                                         .report(0, 3).call(1).reload().report(2, 2).call(1)
                                         .reload().call(3, api="view").reset(whole=True).reload()
                                         .call(12).report(0, 1).report(2, 4).reload().call(2))
    s["reload-squeeze-queries"] = (Seed("half", "squeeze", budget=9, n_sink=3, resolved=7)
                                   .sequence(B=2, H=1, Dk=5, queries="always").call(25, G=2)
                                   .reload().call(1, G=3, qtype=1).reload()
                                   .call(1, api="view", G=1, qtype=2).reload())
    s["reload-h2o-decode"] = (Seed("bf16", "h2o", budget=6, n_sink=2, grace=2, decay=0.9)
                              .sequence(B=2, H=2, Dk=6, Dv=2).call(9).call(1).reload().call(1)
                              .call(1, api="view").reload().call(1).reload().call(2))
    s["reload-pyramid-builder"] = (Seed("half", "pyramid_builder", budget=10, n_sink=2, beta=3.0,
                                        layers=3, layer=2).sequence(B=1, H=2, Dk=3)
                                   .call(20).reload().call(1).reload().call(1, api="into"))
    s["reload-tova-snapkv"] = (Seed("float", "tova", budget=5, n_sink=1).sequence(H=2, Dk=3)
                               .call(12, kmode="palette").reload().call(1).reload()
                               .call(4, api="into").reload())
    s["reload-snapkv"] = (Seed("bf16", "snapkv", budget=6, n_sink=2, obs=3)
                          .sequence(B=2, H=1, Dk=4).call(3).reload().call(14).reload().call(1))
    s["reload-streaming-standard"] = (Seed("half", "streaming", n_sink=3, window=4)
                                      .sequence(H=3, Dk=5, Dv=1).call(9).reload().call(1)
                                      .reload().call(0).call(6, api="into"))
    s["reload-standard-trim"] = (Seed("float", "standard").sequence(B=2, H=2, Dk=3, Dv=5)
                                 .call(7).trim(3).reload().call(2, api="into").trim(50)
                                 .reload().call(4))
    s["reload-onehot-squeeze"] = (Seed("half", "squeeze_builder", budget=5, n_sink=1, defer=True,
                                       layers=2, layer=0, ratio=0.25)
                                  .sequence(B=2, H=1, Dk=2, one_hot=True).call(12).reload()
                                  .call(1).reload().report(1, 2).call(1).reload().call(3))
    # The query-free scorers (docs/design.md 4.7): KeyDiff through a deferred re-budget of a
    # builder model and with queries, K-norm on H2O and PyramidKV.
    s["keydiff-squeeze-builder-defer"] = (Seed("float", "squeeze_builder", budget=6, n_sink=1,
                                               defer=True, layers=2, layer=0, proxy="keydiff")
                                          .sequence(H=2, Dk=4).call(14).report(1, 3).call(1)
                                          .reload().call(1).call(5).call(1))
    s["keydiff-h2o-queries"] = (Seed("half", "h2o", budget=7, n_sink=1, grace=2, proxy="keydiff")
                                .sequence(B=2, H=1, Dk=6, queries="always").call(12, G=2)
                                .call(1, G=2).reload().call(3, G=1))
    s["knorm-h2o"] = (Seed("bf16", "h2o", budget=6, n_sink=2, grace=1, proxy="knorm")
                      .sequence(B=1, H=2, Dk=5).call(10).call(1).reload().call(1).call(4))
    s["knorm-pyramid-builder"] = (Seed("float", "pyramid_builder", budget=8, n_sink=1, layers=2,
                                       layer=1, proxy="knorm")
                                  .sequence(H=2, Dk=3).call(16).call(1).call(1))
    # Serving (docs/design.md 10): forks going on with either side, speculative drafts rolled
    # back, mid-calibration in a deferring builder model, with queries, and SnapKV chunks.
    s["fork-squeeze-builder-defer"] = (Seed("float", "squeeze_builder", budget=8, n_sink=1,
                                            defer=True, layers=3, layer=1)
                                       .sequence(H=2, Dk=4).fork().call(14).fork(False)
                                       .report(0, 3).call(1).fork().report(2, 2).call(1)
                                       .speculate(3, 1).call(3, api="view").speculate(1, 1, 2)
                                       .call(1))
    s["speculate-h2o-queries"] = (Seed("half", "h2o", budget=7, n_sink=1, grace=2)
                                  .sequence(B=2, H=1, Dk=6, queries="always").speculate(4)
                                  .call(12, G=2).speculate(3, 1, G=2).call(1, G=2)
                                  .speculate(2, G=2).fork(False).call(3, G=1))
    s["speculate-snapkv-chunks"] = (Seed("bf16", "snapkv", budget=6, n_sink=2, obs=3)
                                    .sequence(B=2, H=1, Dk=4).call(3).speculate(5).call(4)
                                    .call(1).call(1).speculate(2, 2).call(2).fork().call(5))
    s["speculate-standard-trim"] = (Seed("float", "standard").sequence(B=2, H=2, Dk=3, Dv=5)
                                    .call(7).speculate(2, 1).trim(3).fork().call(2, api="into")
                                    .speculate(1))
    # Adaptive head budgets (SPEC 14): heads that turn ragged, fetches refused on them (S > 0 and
    # empty), pooled evictions against the harness's pool oracle (ops_oracle.hpp pool_evict) with
    # and without queries, value-weighted, KeyDiff and K-norm ranks, a pooled re-budget at the start
    # of a call (a deferring builder layer adopting its coordinator's budget), one-hot ties across
    # heads, save / fork / rollback of ragged heads, floor 1, a policy that ignores the mode, and
    # invalid fields.
    s["adaptive-h2o-decode"] = (Seed("float", "h2o", budget=6, n_sink=1, grace=1, adaptive=0.25)
                                .sequence(B=2, H=3, Dk=4, Dv=3).call(12).call(1, api="view")
                                .call(1).call(1, api="into").call(1, api="view").call(0)
                                .call(0, api="into").call(5, api="view").call(1).reload()
                                .call(1, api="view").fork().call(2).speculate(1, 3)
                                .call(1, api="view"))
    s["adaptive-squeeze-queries-vnorm"] = (Seed("half", "squeeze", budget=8, n_sink=2,
                                                adaptive=0.75, value_power=2.0)
                                           .sequence(B=1, H=3, Dk=6, queries="always")
                                           .call(20, G=2).call(1, G=2, api="view")
                                           .call(1, G=1, api="view", qtype=1)
                                           .call(3, G=3, api="view").call(1, G=2)
                                           .call(1, G=2, api="into").call(6, G=2, api="view"))
    s["adaptive-squeeze-builder-defer-keydiff"] = (Seed("float", "squeeze_builder", budget=6,
                                                        n_sink=1, defer=True, layers=2, layer=0,
                                                        proxy="keydiff", adaptive=0.2)
                                                   .sequence(B=2, H=2, Dk=4).call(14, api="view")
                                                   .report(1, 3).call(1, api="view").call(1)
                                                   .call(5, api="view").reload()
                                                   .call(1, api="view").call(1, api="view"))
    s["adaptive-pyramid-onehot"] = (Seed("bf16", "pyramid", budget=9, n_sink=1, resolved=5,
                                         ratio=0.25, decay=1.0, adaptive=0.5)
                                    .sequence(H=3, Dk=2, one_hot=True).call(10, api="view")
                                    .call(1, api="view").call(1, api="view").call(4, api="view")
                                    .call(1).call(1, api="view"))
    s["adaptive-knorm-pyramid-builder-mixed"] = (Seed("float", "pyramid_builder", budget=8,
                                                      n_sink=1, layers=2, layer=1, proxy="knorm",
                                                      adaptive=0.34)
                                                 .sequence(B=2, H=2, Dk=3, queries="mixed")
                                                 .call(12, with_q=False, api="view")
                                                 .call(1, with_q=True, api="view")
                                                 .call(1, with_q=False).call(3, api="view"))
    s["adaptive-h2o-queries-speculate"] = (Seed("half", "h2o", budget=7, n_sink=1, grace=2,
                                                adaptive=0.1)
                                           .sequence(B=2, H=2, Dk=5, queries="always")
                                           .call(11, G=3).speculate(2, 1, G=3)
                                           .call(1, G=3, api="view").fork(False)
                                           .call(2, G=1, api="view")
                                           .reset(B=1, H=3, Dk=2, queries="always")
                                           .call(9, G=2, api="view").call(1, G=2))
    s["adaptive-floor-one"] = (Seed("float", "squeeze", budget=5, n_sink=1, adaptive=1.0)
                               .sequence(B=1, H=2, Dk=3, queries="always").call(9, G=2)
                               .call(1, G=2).call(1, G=2, api="into"))
    s["adaptive-ignored-snapkv"] = (Seed("float", "snapkv", budget=5, n_sink=1, obs=3,
                                         adaptive=0.25)
                                    .sequence(H=2, Dk=3).call(9).call(1).call(4, api="view"))
    s["adaptive-invalid-floor"] = Seed("half", "h2o", adaptive=0.25, invalid=[0, 1, 3])  # NaN
    s["adaptive-invalid-head-budgets"] = Seed("float", "squeeze", adaptive=0.5,
                                              invalid=[0, 0, 1])  # "Adaptive"
    s["invalid-config-field"] = Seed("float", "h2o", invalid=[8, 1])         # h2o_grace < 0
    s["invalid-config-sink"] = Seed("half", "snapkv", budget=3, n_sink=2, invalid=[23, 1])
    s["invalid-config-method"] = Seed("float", "tova", invalid=[24, 0])      # factory, "SQUEEZE"
    s["invalid-config-beta"] = Seed("bf16", "pyramid_builder", layers=2, layer=1,
                                    invalid=[12, 1])                          # pyramid_beta NaN
    return s


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.startswith("seed-"):
            os.remove(os.path.join(out, name))
    total = 0
    for name, seed in seeds().items():
        data = seed.bytes()
        total += len(data)
        with open(os.path.join(out, "seed-" + name + ".bin"), "wb") as f:
            f.write(data)
    print("wrote", len(seeds()), "seeds,", total, "bytes, into", out)


if __name__ == "__main__":
    main()
