"""The torch ops' two eager launch paths agree bit for bit: tensors described through DLPack's C
exchange table (torch >= 2.11 publishes it on torch.Tensor) and DLPack capsules. The exchange
path is the one taken whenever torch publishes the table, and it refuses a mix of tensor types
by name. Runs where torch is installed (the GPU machine); CUDA cases skip without a GPU."""

import pytest

import sparsepage as sp

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
ops = pytest.importorskip("sparsepage.torch_ops")

has_gpu = torch.cuda.is_available() and sp.cuda_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not has_gpu, reason="needs a GPU"))]


def test_the_exchange_path_is_taken_exactly_when_torch_publishes_the_table():
    assert ops._exchange == hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    assert ops._decode is (sp._core._paged_decode_exchange if ops._exchange else ops._capsule_decode)


@pytest.mark.parametrize("device", DEVICES)
def test_exchange_and_capsule_paths_agree(device, monkeypatch):
    if not ops._exchange:
        pytest.skip("this torch publishes no DLPack exchange table; only the capsule path exists")
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pool = torch.randn(512, 8, 128, generator=gen).to(dtype).to(device)  # [blocks, 8 rows, 128]
    table = torch.randperm(512, generator=gen)[:24].to(torch.int32).reshape(2, 12).to(device)
    qkv = torch.randn(2, 3, 16, 128, generator=gen).to(dtype).to(device)
    q = qkv[:, 0]  # a strided slice of a packed tensor
    lens = torch.tensor([90, 37], dtype=torch.int32, device=device)
    decoder = ops.PagedKVDecoder(2, 16, 1, 128, max_blocks=12, block_size=8, device=device)
    outs, capsule_calls = [], []

    def capsule(*args):  # the capsule path, counted so the test knows it ran
        capsule_calls.append(1)
        ops._capsule_decode(*args)

    for exchange in (True, False):
        monkeypatch.setattr(ops, "_decode", sp._core._paged_decode_exchange if exchange else capsule)
        o = torch.full((2, 16, 128), float("nan"), dtype=dtype, device=device)
        lse = torch.full((2, 16), float("nan"), dtype=torch.float32, device=device)
        decoder(q, pool.unsqueeze(2), pool.unsqueeze(2), table, lens, scale=0.09, o=o, lse=lse)
        if device == "cuda":
            torch.cuda.synchronize()
        outs.append((o, lse))
    assert capsule_calls == [1]
    assert not outs[0][0].isnan().any() and not outs[0][1].isnan().any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_the_exchange_entry_refuses_another_tensor_type():
    if not ops._exchange:
        pytest.skip("this torch publishes no DLPack exchange table")
    import numpy as np

    plan = ops.DecodePlan([4], group_size=2, head_dim_qk=8, head_dim_v=8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(sp.Error, match=r"^paged_decode: k is not a tensor of q's type"):
        sp._core._paged_decode_exchange(plan.plan, q, np.zeros((16, 8), np.float32), q, q, None,
                                  torch.zeros(4, dtype=torch.int32), None, 1, 1.0, None, None, None, None, None, -1, 0, 0,
                                  1, False, None, None, 0)
