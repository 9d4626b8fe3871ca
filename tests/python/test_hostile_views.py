"""Inputs a hostile-input sweep of the Python API found crashing the process (SIGSEGV, SIGFPE, heap
corruption) or answering from memory outside the arrays, on the CPU backend. Each must now be refused
with a sparsepage.Error that names the problem, before anything is read or written."""

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import gates_off


def test_selection_mask_offsets_past_the_positions_are_refused():
    mask = np.zeros((1, 8), np.float32)
    for last in (2, 1000, 2**31 - 1):  # 2^31 - 1 read past the array and crashed
        with pytest.raises(sp.Error, match=rf"offsets ends at {last} but positions holds 1 entries"):
            sp.build_selection_mask(np.zeros(1, np.int32), np.array([0, last], np.int32), 8, mask)
    sp.build_selection_mask(np.array([3], np.int32), np.array([0, 1], np.int32), 8, mask)
    assert mask[0, 3] == 0 and np.isneginf(np.delete(mask[0], 3)).all()


def test_fp8_index_pool_of_one_block_must_be_packed():
    base = np.zeros((1, 32, 132), np.uint8)
    for view in (base[:, 28::-4, :],  # reversed token order: wrote 528 bytes past the array
                 np.zeros((1, 132, 8), np.uint8).transpose(0, 2, 1)):  # written in the wrong layout
        with pytest.raises(sp.Error, match="index_cache must be packed"):
            sp.write_index_keys(view, np.ones((8, 128), np.float16), np.arange(8, dtype=np.int64))
    assert not base.any(), "a refused write changed the pool"


def test_native_index_pool_whose_blocks_alias_is_refused():
    one = np.zeros((16, 16), np.float16)  # block stride 0 (an expanded view): read as "packed", wrote past it
    expanded = np.lib.stride_tricks.as_strided(one, (100000, 16, 16), (0, 32, 2), writeable=True)
    with pytest.raises(sp.Error, match=r"index_cache has strides \(0, 16\) that make its rows or blocks overlap"):
        sp.write_index_keys(expanded, np.ones((1, 16), np.float16), np.array([99999 * 16], np.int64))
    rows_alias = np.lib.stride_tricks.as_strided(np.zeros(64, np.float16), (2, 4, 16), (64, 0, 2), writeable=True)
    with pytest.raises(sp.Error, match="overlap"):
        sp.write_index_keys(rows_alias, np.ones((1, 16), np.float16), np.array([1], np.int64))


@pytest.mark.parametrize("strides", ["numpy", "zero"])
@pytest.mark.parametrize("model", ["block_sparse", "dsa"])
def test_engine_pool_with_blocks_of_no_rows_is_refused(model, strides):
    f = lambda *s: np.zeros(s, np.float16)  # noqa: E731
    empty = f
    if strides == "zero":  # an empty tensor's strides are the producer's choice (numpy 2.5 exports 0): not judged
        torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
        empty = lambda *s: torch.empty_strided(s, (0,) * len(s), dtype=torch.float16)  # noqa: E731
    table = np.zeros((2, 4), np.int32)
    if model == "block_sparse":  # block_size 0 divided the pool's rows by zero (SIGFPE)
        cfg = sp.BlockSparseConfig(num_qo_heads=8, num_kv_heads=2, head_dim=16, block_size=8, topk_blocks=3,
                                   local_blocks=1, capacity_step=32, kv_storage=sp.KVStorage.ENGINE_PAGED)
        layer = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, cfg, 2, gates_off())
        pool = empty(8, 0, 2, 16)
        call = lambda: layer.decode_paged(f(2, 8, 16), f(2, 2, 16), f(2, 1, 1, 16), f(2, 8, 16), pool, pool, table)  # noqa: E731
    else:
        cfg = sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=2, index_head_dim=8, index_topk=12,
                           capacity_step=32, kv_storage=sp.KVStorage.ENGINE_PAGED)
        layer = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, cfg, 2, gates_off())
        call = lambda: layer.decode_paged(f(2, 4, 32), f(2, 4, 8), f(2, 2, 8), np.ones((2, 2), np.float32),  # noqa: E731
                                          f(2, 1, 1, 8), f(2, 4, 32), empty(8, 0, 40), table)
    with pytest.raises(sp.Error, match="has blocks of 0 rows; a block holds at least one"):
        call()
    assert layer.kv_lens == [0, 0], "a refused step appended"


def test_window_mode_stays_inside_each_requests_rows():
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
    from sparsepage import torch_ops as ops

    big = torch.randn(1000, 8)
    k = big[:4]  # the pool is rows 0..3 of a longer buffer
    plan = ops.DecodePlan([1], group_size=1, head_dim_qk=8, head_dim_v=8)
    for window, index in ((1000, 900), (2**31, 2**31 - 2)):  # read row 900 of the buffer; or crashed
        with pytest.raises(sp.Error, match=rf"k: {window} rows per head exceed k.capacity = 1"):
            ops.paged_decode(plan, torch.randn(1, 1, 8), k, k, torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([index], dtype=torch.int32), None, page_size=1, scale=1.0,
                             workspace=plan.new_workspace(), request_row_stride=1, window_len=window)
    pool, q = torch.randn(12, 8), torch.randn(3, 2, 8)
    plan = ops.DecodePlan([3] * 3, group_size=2, head_dim_qk=8, head_dim_v=8)
    idx = torch.tensor([[0, 3, 1], [2, 2, 0], [3, 1, 0]], dtype=torch.int32)
    for stride in (2**62, 2**62 + 2**40):  # wrapped to a stride of 0 (every request read rows 0..3), or crashed
        with pytest.raises(sp.Error, match=rf"window mode needs num_requests \* request_row_stride = 3 \* {stride}"):
            ops.paged_decode(plan, q, pool, pool, None, idx, None, page_size=1, scale=0.3,
                             workspace=plan.new_workspace(), request_row_stride=stride, window_len=4)
    o, _ = ops.paged_decode(plan, q, pool, pool, None, idx, None, page_size=1, scale=0.3,
                            workspace=plan.new_workspace(), request_row_stride=4, window_len=4)
    assert torch.isfinite(o).all()


def test_decoders_refuse_sizes_of_zero_by_name():
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
    from sparsepage import engine
    from sparsepage import torch_ops as ops

    with pytest.raises(sp.Error, match="num_kv_heads = 0, .* must be at least 1"):  # was ZeroDivisionError
        ops.PagedKVDecoder(1, 8, 0, 16, max_blocks=4, block_size=16, device="cpu")
    with pytest.raises(sp.Error, match="block_size = 0 must be at least 1"):  # was accepted
        ops.PagedKVDecoder(1, 8, 2, 16, max_blocks=4, block_size=0, device="cpu")
    with pytest.raises(sp.Error, match="rope_dim = -64 must be at least 1"):  # was accepted
        ops.MlaSparseDecoder(4, 8, 16, device="cpu", rope_dim=-64)
    q = torch.zeros(1, 8, 16, dtype=torch.float16)
    cache = torch.zeros(4, 16, 0, 16, dtype=torch.float16)
    with pytest.raises(sp.Error, match="at least one KV head"):  # was ZeroDivisionError
        engine.paged_kv_decode(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), scale=0.25)
