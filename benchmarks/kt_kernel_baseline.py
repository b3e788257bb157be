"""Optional baseline for ``benchmarks/cpu_moe.py``: KTransformers' CPU MoE kernel.

Wraps the BF16 MoE backend of the ``kt-kernel`` pip package (import name
``kt_kernel``; it picks a CPU build such as avx2 / avx512 / amx at import time)
so it can be run on exactly the same weights and routing as our own kernel.
Only the public pybind API (``kt_kernel_ext.CPUInfer``, ``WorkerPoolConfig``,
``moe.MOEConfig`` and ``moe.AMXBF16_MOE`` / ``moe.AVX2BF16_MOE``) is used.

If ``kt_kernel`` is not installed, or its build for this CPU has no BF16 MoE
backend, :func:`available` returns False and the benchmark should skip it.

Caveats:
* kt-kernel starts its own worker pool (``threads`` threads, one NUMA subpool
  on node 0) and pins those threads; the pool lives as long as the KTMoE object.
* ``max_tokens`` sizes kt-kernel's internal buffers; calls with more tokens
  are rejected here.
* Weights are repacked into kt-kernel's own buffers at construction, so it
  holds a second copy of all expert weights (~1.1 GB for one DeepSeek-V2-Lite layer).
* The output is BF16 (kt-kernel writes BF16); warm up before timing.
* kt-kernel prints pool/layer set-up lines on stdout when a KTMoE is built.
"""

from __future__ import annotations

import torch


def _moe_cls() -> type | None:
    from kt_kernel import kt_kernel_ext

    moe = kt_kernel_ext.moe
    return getattr(moe, "AMXBF16_MOE", None) or getattr(moe, "AVX2BF16_MOE", None)


def available() -> bool:
    """True if kt_kernel imports and has a BF16 MoE backend for this CPU."""
    try:
        return _moe_cls() is not None
    except Exception:
        return False


class KTMoE:
    """kt-kernel BF16 MoE over all ``E`` experts held on the CPU.

    ``gate_up``: [E, 2I, H] bf16 (rows :I gate, I: up); ``down``: [E, H, I] bf16.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, max_tokens: int, threads: int) -> None:
        from kt_kernel import kt_kernel_ext

        cls = _moe_cls()
        if cls is None:
            raise RuntimeError("kt_kernel has no BF16 MoE backend on this CPU")
        E, two_i, H = gate_up.shape
        I = two_i // 2
        assert down.shape == (E, H, I), (down.shape, (E, H, I))
        self.top_k, self.max_tokens, self.hidden = top_k, max_tokens, H

        # kt-kernel takes one row-major [I, H] / [I, H] / [H, I] pointer per expert;
        # for contiguous inputs these are views (no copy). load_weights repacks them.
        gu = gate_up.detach().to("cpu", torch.bfloat16).contiguous()
        dn = down.detach().to("cpu", torch.bfloat16).contiguous()
        self._gate = [gu[e, :I].contiguous() for e in range(E)]
        self._up = [gu[e, I:].contiguous() for e in range(E)]
        self._down = [dn[e].contiguous() for e in range(E)]
        self._gpu_mask = torch.zeros(E, dtype=torch.bool)  # no expert is on a GPU
        self._p2l = torch.arange(E, dtype=torch.int64)  # identity expert map

        pool_cfg = kt_kernel_ext.WorkerPoolConfig()
        pool_cfg.subpool_count = 1
        pool_cfg.subpool_numa_map = [0]
        pool_cfg.subpool_thread_count = [threads]
        self._cpu_infer = kt_kernel_ext.CPUInfer(pool_cfg)

        cfg = kt_kernel_ext.moe.MOEConfig(E, top_k, H, I, self._gpu_mask.data_ptr())
        cfg.layer_idx = 0
        cfg.pool = self._cpu_infer.backend_
        cfg.max_len = max_tokens
        cfg.gate_projs = [[t.data_ptr() for t in self._gate]]
        cfg.up_projs = [[t.data_ptr() for t in self._up]]
        cfg.down_projs = [[t.data_ptr() for t in self._down]]
        zeros = [[0] * E]
        cfg.gate_scales, cfg.up_scales, cfg.down_scales = zeros, zeros, zeros
        self._cfg = cfg
        self._moe = cls(cfg)
        self._cpu_infer.submit(self._moe.load_weights_task(self._p2l.data_ptr()))
        self._cpu_infer.sync()

        # Persistent I/O buffers the kernel reads from / writes to.
        self._bsz = torch.zeros(1, dtype=torch.int32)
        self._x = torch.zeros(max_tokens, H, dtype=torch.bfloat16)
        self._ids = torch.zeros(max_tokens, top_k, dtype=torch.int64)
        self._w = torch.zeros(max_tokens, top_k, dtype=torch.float32)
        self._out = torch.zeros(max_tokens, H, dtype=torch.bfloat16)

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] bf16, ids [T, top_k] int, weights [T, top_k] -> [T, H] bf16."""
        T = hidden.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"T={T} exceeds max_tokens={self.max_tokens}")
        assert ids.shape == weights.shape == (T, self.top_k) and hidden.shape[1] == self.hidden
        self._bsz[0] = T
        self._x[:T].copy_(hidden)
        self._ids[:T].copy_(ids)
        self._w[:T].copy_(weights)
        self._cpu_infer.submit(
            self._moe.forward_task(
                self._bsz.data_ptr(),
                self.top_k,
                self._ids.data_ptr(),
                self._w.data_ptr(),
                self._x.data_ptr(),
                self._out.data_ptr(),
                False,
            )
        )
        self._cpu_infer.sync()
        return self._out[:T].clone()
