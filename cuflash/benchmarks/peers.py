"""The systems a speed benchmark sets side by side: cuflash's algorithms and the peers found here.

Every system takes cuflash's (batch, seqlen, nheads, headdim) self-attention
problem and offers two things:

* ``compute(q, k, v, dout, causal)``: output and gradients for NumPy inputs,
  used once per (dtype, head dim, causal) to check the system against the
  float64 reference before any of its timings is believed;
* ``prepare(workload)``: inputs on the GPU and one zero-argument call per
  direction it supports (forward, backward, forward+backward), plus the timer
  of those calls (timing.py: busy-start CUDA events on the stream the system
  launches on, or back-to-back wall-clock for JAX).

Peers are optional: a system whose framework is missing reports why through
``unavailable()`` and is left out; none is a dependency of cuflash.

* ``cupy-standard``: attention as a CuPy user writes it: ``cupy.matmul``
  (cuBLAS) for Q K^T, a float32 softmax, ``cupy.matmul`` for P V, and the
  backward by hand from the saved P. Materializes the (seqlen x seqlen) scores,
  so large problems run out of memory (reported as skipped).
* ``jax-xla`` / ``jax-cudnn``: ``jax.nn.dot_product_attention`` with
  ``implementation="xla"`` / ``"cudnn"``, jitted. JAX offers no backward
  without its forward, so these time forward and forward+backward.
* ``torch-flash`` / ``torch-cudnn``: PyTorch's
  ``scaled_dot_product_attention`` restricted to its FlashAttention-2 or
  cuDNN backend, on contiguous (batch, heads, seqlen, dim) tensors, its
  users' layout.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import timing
from .timing import Timer, cupy_or_refuse
from .workloads import DIRECTIONS, FLEX_VARIANTS, Workload, flex_mods

# JAX grabs 75% of GPU memory at start-up unless told otherwise, which would starve the other systems.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@dataclass
class Prepared:
    """A system ready to be timed on one workload."""

    calls: dict[str, Callable[[], object]]
    timer: Timer


class System:
    key: str = ""
    label: str = ""
    is_cuflash: bool = False
    directions: tuple[str, ...] = DIRECTIONS
    # The flex variants (workloads.FLEX_VARIANTS) the system runs: only cuflash's fa2 takes score_mod / mask_mod.
    flex_variants: tuple[str, ...] = ()
    # The sequence length of the correctness check (speed.check_against_reference): odd, so ragged tiles are judged,
    # where the system takes one.
    check_seqlen: int = 257

    def unavailable(self) -> str | None:
        """Why this system cannot run in this environment, or None."""
        raise NotImplementedError

    def compute(self, q, k, v, dout, causal: bool):
        """(out, (dq, dk, dv)) as NumPy arrays for NumPy inputs."""
        raise NotImplementedError

    def prepare(self, workload: Workload, seed: int = 0) -> Prepared:
        raise NotImplementedError

    def release(self) -> None:
        """Return cached device memory so the next system starts from the same free memory."""

    def variant(self, workload: Workload, direction: str) -> str:
        """Which of the system's own kernels time ``direction`` of ``workload`` (cuflash: the plans' variants), or
        "" where the system does not say."""
        return ""

    def __repr__(self) -> str:
        return f"<system {self.key}>"


@functools.lru_cache(maxsize=1)  # every system of a sweep point takes the same inputs: draw them once
def _host_inputs(workload: Workload, seed: int):
    from cuflash.testing import numpy_dtype

    rng = np.random.default_rng(seed)
    dtype = numpy_dtype(workload.dtype)
    return tuple(rng.standard_normal(workload.shape, dtype=np.float32).astype(dtype) for _ in range(4))


def _free_cupy_pools() -> None:
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # no CuPy: nothing cached
        pass


class Cuflash(System):
    is_cuflash = True

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self.key = f"cuflash-{algorithm}"
        self.label = f"cuflash {algorithm}"
        self.flex_variants = FLEX_VARIANTS if algorithm == "fa2" else ()

    def unavailable(self) -> str | None:
        try:
            cupy_or_refuse()
        except Exception as err:
            return str(err)
        return None

    def variant(self, workload, direction, target=None) -> str:
        """The catalog variant the plans pick on ``target`` (default: device 0's, as cuflash's calls get it) for
        each direction the timed call runs, "+"-joined for forward+backward: "hopper" (wgmma) or "tensor-core"
        (mma.sync) on sm_90, so a figure names the kernels behind it (flex workloads: their flex problem's plans, the
        Hopper forward and backward on sm_90)."""
        from cuflash.kernels import plans
        from cuflash.kernels.program import Problem
        from cuflash.mask import Mask

        if target is None:
            from cuflash._placement import _cupy_backend

            target = _cupy_backend(0).target
        flex = workload.flex is not None  # the mods carry the mask
        problem = Problem(workload.dtype, workload.batch, workload.seqlen, workload.seqlen, workload.nheads,
                          workload.nheads, workload.headdim, mask=Mask.causal(workload.causal and not flex), flex=flex)
        names = [plans.variant_for(self.algorithm, problem, target, d).name for d in direction.split("+")]
        return "+".join(names)

    def compute(self, q, k, v, dout, causal, flex: str | None = None):
        import cuflash

        cupy = cupy_or_refuse()
        gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
        if flex is not None:
            mods = _flex_options(flex, q.shape[1], q.shape[2])
            out, lse = cuflash.flex_attention(gq, gk, gv, return_lse=True, **mods)
            grads = cuflash.flex_attention_backward(gdout, gq, gk, gv, out, lse, **mods)
        else:
            out, lse = cuflash.attention(gq, gk, gv, causal=causal, algorithm=self.algorithm, return_lse=True)
            grads = cuflash.attention_backward(gdout, gq, gk, gv, out, lse, causal=causal, algorithm=self.algorithm)
        return cupy.asnumpy(out), tuple(cupy.asnumpy(g) for g in grads)

    def prepare(self, workload, seed=0):
        import cuflash

        cupy = cupy_or_refuse()
        q, k, v, dout = (cupy.asarray(x) for x in _host_inputs(workload, seed))
        if workload.flex is not None:
            return self._prepare_flex(workload, q, k, v, dout)
        causal, algorithm = workload.causal, self.algorithm
        out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)

        def forward_backward():
            o, l = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
            return cuflash.attention_backward(dout, q, k, v, o, l, causal=causal, algorithm=algorithm)

        calls = {
            "forward": lambda: cuflash.attention(q, k, v, causal=causal, algorithm=algorithm),
            "backward": lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm),
            "forward+backward": forward_backward,
        }
        return Prepared(calls, timing.cupy_timer())

    @staticmethod
    def _prepare_flex(workload, q, k, v, dout) -> Prepared:
        """cuflash.flex_attention with the variant's mods (a mask_mod through a block mask built once here, as a
        training step reuses one); the traced mods and compiled kernels are cached after the first call."""
        import cuflash

        mods = _flex_options(workload.flex, workload.seqlen, workload.nheads)
        out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)

        def forward_backward():
            o, l = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
            return cuflash.flex_attention_backward(dout, q, k, v, o, l, **mods)

        calls = {
            "forward": lambda: cuflash.flex_attention(q, k, v, **mods),
            "backward": lambda: cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods),
            "forward+backward": forward_backward,
        }
        return Prepared(calls, timing.cupy_timer())

    def release(self):
        _free_cupy_pools()


def _flex_options(variant: str, seqlen: int, nheads: int) -> dict:
    """flex_attention's keyword arguments for a variant: its score_mod, and its mask_mod as a block mask."""
    from cuflash.flex import create_block_mask

    mods = flex_mods(variant, seqlen, nheads)
    mask_mod = mods.pop("mask_mod", None)
    if mask_mod is not None:
        mods["block_mask"] = create_block_mask(mask_mod, None, None, seqlen, seqlen)
    return mods


class CupyStandard(System):
    key = "cupy-standard"
    label = "CuPy standard (cuBLAS)"

    def unavailable(self):
        try:
            cupy_or_refuse()
        except Exception as err:
            return str(err)
        return None

    @staticmethod
    def _functions(cupy, causal: bool):
        """Forward and hand-written backward in (batch, heads, seqlen, headdim), as a CuPy user writes them."""

        def forward(q, k, v):
            scale = 1.0 / math.sqrt(q.shape[-1])
            s = cupy.matmul(q, k.swapaxes(-1, -2)).astype(cupy.float32) * scale
            if causal:
                sq, sk = s.shape[-2:]
                visible = cupy.tri(sq, sk, k=sk - sq, dtype=bool)
                s = cupy.where(visible, s, -cupy.inf)
            row_max = s.max(axis=-1, keepdims=True)
            row_max = cupy.where(cupy.isfinite(row_max), row_max, 0)
            p = cupy.exp(s - row_max)
            total = p.sum(axis=-1, keepdims=True)
            p /= cupy.where(total > 0, total, 1)
            out = cupy.matmul(p.astype(q.dtype), v)
            return out, p

        def backward(dout, q, k, v, out, p):
            scale = 1.0 / math.sqrt(q.shape[-1])
            dv = cupy.matmul(p.astype(q.dtype).swapaxes(-1, -2), dout)
            dp = cupy.matmul(dout, v.swapaxes(-1, -2)).astype(cupy.float32)
            delta = (dout.astype(cupy.float32) * out.astype(cupy.float32)).sum(axis=-1, keepdims=True)
            ds = (p * (dp - delta) * scale).astype(q.dtype)
            dq = cupy.matmul(ds, k)
            dk = cupy.matmul(ds.swapaxes(-1, -2), q)
            return dq, dk, dv

        return forward, backward

    def compute(self, q, k, v, dout, causal):
        cupy = cupy_or_refuse()
        forward, backward = self._functions(cupy, causal)
        gq, gk, gv, gdout = (cupy.asarray(x).swapaxes(1, 2) for x in (q, k, v, dout))
        out, p = forward(gq, gk, gv)
        grads = backward(gdout, gq, gk, gv, out, p)
        back = lambda x: cupy.asnumpy(x.swapaxes(1, 2))  # noqa: E731
        return back(out), tuple(back(g) for g in grads)

    def prepare(self, workload, seed=0):
        cupy = cupy_or_refuse()
        forward, backward = self._functions(cupy, workload.causal)
        # The user's own layout: contiguous (batch, heads, seqlen, dim).
        q, k, v, dout = (cupy.ascontiguousarray(cupy.asarray(x).swapaxes(1, 2)) for x in _host_inputs(workload, seed))
        out, p = forward(q, k, v)

        def forward_backward():
            o, pp = forward(q, k, v)
            return backward(dout, q, k, v, o, pp)

        calls = {
            "forward": lambda: forward(q, k, v),
            "backward": lambda: backward(dout, q, k, v, out, p),
            "forward+backward": forward_backward,
        }
        return Prepared(calls, timing.cupy_timer())

    def release(self):
        _free_cupy_pools()


class JaxDotProductAttention(System):
    directions = ("forward", "forward+backward")

    def __init__(self, implementation: str):
        self.implementation = implementation
        self.key = f"jax-{implementation}"
        self.label = f"JAX {implementation}"
        if implementation == "cudnn":
            # JAX 0.11.2's cuDNN path refused 257 ("NotImplementedError: Unsupported sequence length Q 257, KV 257",
            # an H200, 2026-11-26): its check takes a length it runs, as the sweep's do.
            self.check_seqlen = 256

    def unavailable(self):
        try:
            import jax

            if not jax.devices("gpu"):
                return "JAX sees no GPU"
        except Exception as err:  # JAX missing, or a CPU-only build
            return f"JAX with CUDA is not available ({type(err).__name__}: {err})"
        return None

    def _functions(self, causal: bool):
        import jax

        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=self.implementation)

        def forward_backward(q, k, v, dout):
            out, pullback = jax.vjp(attend, q, k, v)
            return out, pullback(dout)

        return jax.jit(attend), jax.jit(forward_backward)

    def _device_inputs(self, arrays):
        import jax

        device = jax.devices("gpu")[0]
        return tuple(jax.device_put(x, device) for x in arrays)

    def compute(self, q, k, v, dout, causal):
        _, forward_backward = self._functions(causal)
        out, grads = forward_backward(*self._device_inputs((q, k, v, dout)))
        return np.asarray(out), tuple(np.asarray(g) for g in grads)

    def prepare(self, workload, seed=0):
        import jax

        forward, forward_backward = self._functions(workload.causal)
        q, k, v, dout = self._device_inputs(_host_inputs(workload, seed))
        calls = {
            # Dispatch only: JAX runs on its own streams, and its timer waits for the results (timing.py).
            "forward": lambda: forward(q, k, v),
            "forward+backward": lambda: forward_backward(q, k, v, dout),
        }
        return Prepared(calls, timing.jax_timer(jax.devices("gpu")[0]))

    def release(self):
        import jax

        jax.clear_caches()


class TorchSdpa(System):
    def __init__(self, backend: str):
        self.backend = backend
        self.key = f"torch-{backend}"
        self.label = f"PyTorch SDPA {backend}"

    def unavailable(self):
        try:
            import torch

            if not torch.cuda.is_available():
                return "PyTorch sees no CUDA device"
        except Exception as err:
            return f"PyTorch is not available ({type(err).__name__}: {err})"
        return None

    def _sdpa(self, causal: bool, enable_gqa: bool = False):
        """(attend, gradients) restricted to the backend; ``enable_gqa`` (PyTorch >= 2.5) for k and v with fewer
        heads than q (splitkv.py's decode shapes), asked only then so older PyTorch runs the rest."""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[self.backend]
        gqa = {"enable_gqa": True} if enable_gqa else {}

        def attend(q, k, v):
            # PyTorch's own layout, (batch, heads, seqlen, dim), contiguous: what its users pass.
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

        def gradients(out, q, k, v, dout):
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        return attend, gradients

    @staticmethod
    def _tensors(arrays):
        """(batch, seqlen, heads, dim) NumPy arrays -> contiguous (batch, heads, seqlen, dim) CUDA leaf tensors."""
        import torch

        from cuflash.testing import numpy_dtype

        bf16 = numpy_dtype("bfloat16")
        tensors = []
        for x in arrays:
            if x.dtype == bf16:  # torch cannot read ml_dtypes' bfloat16: go through float32
                t = torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
            else:
                t = torch.from_numpy(np.ascontiguousarray(x)).to("cuda")
            tensors.append(t.transpose(1, 2).contiguous().requires_grad_(True))
        return tensors

    @staticmethod
    def _numpy(t, dtype):
        """A (batch, heads, seqlen, dim) tensor back in cuflash's layout and dtype."""
        return t.detach().transpose(1, 2).float().cpu().numpy().astype(dtype)

    def compute(self, q, k, v, dout, causal):
        attend, gradients = self._sdpa(causal)
        tq, tk, tv, tdout = self._tensors((q, k, v, dout))
        out = attend(tq, tk, tv)
        grads = gradients(out, tq, tk, tv, tdout)
        return self._numpy(out, q.dtype), tuple(self._numpy(g, q.dtype) for g in grads)

    def prepare(self, workload, seed=0):
        attend, gradients = self._sdpa(workload.causal)
        q, k, v, dout = self._tensors(_host_inputs(workload, seed))
        out = attend(q, k, v)
        calls = {
            "forward": lambda: attend(q, k, v),
            "backward": lambda: gradients(out, q, k, v, dout),
            "forward+backward": lambda: gradients(attend(q, k, v), q, k, v, dout),
        }
        return Prepared(calls, timing.torch_timer())

    def release(self):
        import torch

        torch.cuda.empty_cache()


def all_systems() -> list[System]:
    """Every system cuflash knows, cuflash's algorithms first (in the catalog's order), then the peers."""
    from cuflash.kernels.catalog import algorithms

    return [*(Cuflash(a) for a in algorithms()), CupyStandard(), JaxDotProductAttention("xla"),
            JaxDotProductAttention("cudnn"), TorchSdpa("flash"), TorchSdpa("cudnn")]


def system_keys() -> list[str]:
    return [s.key for s in all_systems()]


def select(keys: list[str] | None) -> list[System]:
    """The systems named by ``keys`` (all when None); unknown keys raise ValueError listing the known ones."""
    systems = all_systems()
    if keys is None:
        return systems
    known = {s.key: s for s in systems}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {list(known)}")
    return [known[k] for k in keys]
