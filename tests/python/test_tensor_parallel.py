"""Tensor parallel over two GPUs (python/examples/tensor_parallel.py under torchrun, NCCL with
NVLink multicast off): both layers with their query heads sharded must reproduce the per-shard
single-GPU run bit for bit and the all-heads single-GPU run within bf16 rounding. Skips, saying
so, without two GPUs and torch (it runs on the two-H200 machine)."""

import os
import subprocess
import sys

import pytest

import sparsepage as sp

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "python", "examples", "tensor_parallel.py")


@pytest.mark.skipif(not (sp.cuda_available() and torch.cuda.device_count() >= 2),
                    reason="needs two GPUs and sparsepage built with CUDA")
def test_two_gpu_tensor_parallel_equals_one_gpu():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          EXAMPLE], env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stderr[-4000:]
    assert "block-sparse layer: 2 GPUs == per-shard run on one GPU bit for bit: True" in run.stdout
    assert "DSA layer: 2 GPUs == per-shard run on one GPU bit for bit: True" in run.stdout
    assert "tensor parallel: PASS" in run.stdout
