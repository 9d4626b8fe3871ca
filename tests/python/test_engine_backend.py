"""Runs the engine backend sketch of docs/ENGINES.md (python/examples/engine_backend.py) on
the CPU and checks both backends' outputs against the fp64 reference."""

import importlib.util
import os
import sys

import numpy as np

from reference import attend

SKETCH = os.path.join(os.path.dirname(__file__), "..", "..", "python", "examples", "engine_backend.py")


def load_sketch():
    spec = importlib.util.spec_from_file_location("engine_backend", SKETCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_backend"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_engine_backend_sketch_runs_and_is_right():
    d = load_sketch().demo()
    rows = d["kv_cache"].reshape(-1, 576)
    for t in range(d["slot_ids"].shape[0]):
        s = d["slot_ids"][t][d["slot_ids"][t] >= 0]
        ref, _ = attend(d["q_latent"][t], rows[s, :512], rows[s, :512], 576 ** -0.5, d["q_pe"][t], rows[s, 512:])
        np.testing.assert_allclose(d["mla_out"][t], ref, rtol=3e-5, atol=3e-5)
    G = 4
    for b in range(2):
        tok = np.arange(d["seq_lens"][b])
        blocks, slots = d["block_tables"][b, tok // 16], tok % 16
        for h in range(2):
            ref, _ = attend(d["q"][b, h * G:(h + 1) * G], d["k_cache"][blocks, slots, h], d["v_cache"][blocks, slots, h],
                            64 ** -0.5)
            np.testing.assert_allclose(d["gqa_out"][b, h * G:(h + 1) * G].astype(np.float64), ref, atol=4e-3, rtol=4e-3)
