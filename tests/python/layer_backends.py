"""What the layer tests share: the dispatch gates opened, and the places a test can hold its step
tensors (numpy or torch CPU tensors on the CPU backend in f16, torch CUDA tensors in bf16) behind
one interface, so one test body runs on any of them."""

import numpy as np

import sparsepage as sp


def gates_off(enabled=True):
    """The dispatch config with every size and sparsity gate at zero (the kill switch: enabled=False)."""
    c = sp.DispatchConfig.defaults()
    c.enabled = enabled
    c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0
    return c


def quarter_grid(rng, *shape, dtype=np.float32):
    """Multiples of 1/4 in [-1, 1]: f16, bf16 and e4m3 at a power-of-two scale hold them, and f16 their
    products, exactly, so every form and backend scores alike (indexer ties break the same way)."""
    return (rng.integers(-4, 5, size=shape) / 4).astype(dtype)


class NumpyF16:
    """numpy arrays on the CPU backend: f16 holds the tests' quarter-grid values exactly."""
    device, dtype = sp.Device.cpu, sp.DType.f16

    def half(self, a):
        return np.ascontiguousarray(a, np.float16)

    def f32(self, a):
        return np.ascontiguousarray(a, np.float32)

    def raw(self, a):  # int32 tables and lengths, uint8 FP8 blocks
        return np.ascontiguousarray(a)

    def nan_out(self, shape):
        return np.full(shape, np.nan, np.float16)

    def get(self, a):
        return np.array(a, np.float32)  # a copy: the output buffer may be reused

    def stream(self):
        return None


class TorchF16:
    """torch CPU tensors in f16 on the CPU backend (the bindings take them through DLPack): NumpyF16's
    values and dtypes as torch tensors, copies of the test's arrays as TorchBf16's are."""
    device, dtype = sp.Device.cpu, sp.DType.f16

    def __init__(self, torch):
        self.torch = torch

    def half(self, a):
        return self.torch.from_numpy(np.array(a, np.float16))

    def f32(self, a):
        return self.torch.from_numpy(np.array(a, np.float32))

    def raw(self, a):
        return self.torch.from_numpy(np.array(a))

    def nan_out(self, shape):
        return self.torch.full(shape, float("nan"), dtype=self.torch.float16)

    def get(self, a):
        return a.float().numpy().copy()

    def stream(self):
        return None


class TorchBf16:
    """torch CUDA tensors in bf16 (the DSA layer's fused MLA prefill reads bf16 on the GPU)."""
    device, dtype = sp.Device.cuda, sp.DType.bf16

    def __init__(self, torch):
        self.torch = torch

    def half(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(self.torch.bfloat16).cuda()

    def f32(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a, np.float32)).cuda()

    def raw(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def nan_out(self, shape):
        return self.torch.full(shape, float("nan"), dtype=self.torch.bfloat16, device="cuda")

    def get(self, a):
        self.torch.cuda.synchronize()
        return a.float().cpu().numpy()

    def stream(self):
        return self.torch.cuda.current_stream().cuda_stream
