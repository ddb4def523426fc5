"""The routed experts' kernels: how a device moves dispatched rows and multiplies them by its
experts' SwiGLU weights. A token dispatcher (engines/torch/dispatch.py, parallel/dispatch.py)
decides which row goes where; one of these kernel sets does the moving and the matmuls.

CastKernels holds the block's expert weights already cast to the compute dtype (gate|up
concatenated, from engines/torch/forward.block_weights or the optimizer's working copies) and runs
grouped GEMMs and Triton kernels as options.torch_kernels chooses, row maps with gather backwards
(engines/torch/rows.py); its methods (sorted_experts, unsort, fill, read, padded, gate_up, down)
are what a dispatcher calls.

Shape legend: T tokens, K top-k, A assignments (T*K), E experts, C rows per expert buffer,
R buffer rows (E*C), L expert width, F expert hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.options import TorchKernels
from engines.torch.kernels import gather, grouped_dw, swiglu, swiglu_gemm
from engines.torch.kernels.gather import Combine
from engines.torch.rows import Dispatch, Permute, RowGather


def kernels_here(k: TorchKernels) -> TorchKernels:
    """The kernel choices as they can run here: every Triton choice falls back to its compiled
    form where Triton is not installed."""
    return k.without_triton() if gather.triton is None else k


def _fused(x: torch.Tensor, cdt: torch.dtype, o: TorchKernels) -> bool:
    """Whether the experts run through engines/torch/kernels/swiglu_gemm.py (o.experts)."""
    return (o.experts in ("fused", "fused-gather") and cdt == torch.bfloat16
            and o.grouped_mm_weights == "nmajor" and swiglu_gemm.kernels_usable(x))


def grouped_swiglu(x_AL, counts_E, w_gu, w_down, cdt: torch.dtype, o: TorchKernels) -> torch.Tensor:
    """SwiGLU over rows sorted by expert (counts_E rows each), in cdt; w_gu [E, L, 2F] is gate|up."""
    Fh = w_down.shape[1]
    if x_AL.is_cuda and hasattr(torch, "_grouped_mm") and cdt == torch.bfloat16:
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        if _fused(x_AL, cdt, o) and o.experts == "fused":
            return swiglu_gemm.fused_experts(x_AL, w_gu, w_down, offs_E)
        wd = w_down
        if o.grouped_mm_weights == "kmajor":
            w_gu, wd = (w.transpose(-2, -1).contiguous().transpose(-2, -1) for w in (w_gu, wd))
        # gate and up as one [E, L, 2F] matmul: wider tiles, one dx GEMM in the backward
        kernel = o.grouped_dw == "triton"
        gu_A2F = grouped_dw.grouped_mm(x_AL, w_gu, offs_E, kernel)
        h_AF = swiglu.swiglu(gu_A2F, o.swiglu == "triton")
        return grouped_dw.grouped_mm(h_AF, wd, offs_E, kernel)
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):  # CPU (or no grouped kernel): a host loop
        x = x_AL[start : start + n]
        gu = x @ w_gu[e]
        outs.append((F.silu(gu[:, :Fh]) * gu[:, Fh:]) @ w_down[e])
        start += n
    return torch.cat(outs, 0)


def swiglu_padded(experts, buf_eRL: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """SwiGLU of the pooled-wave transports' fixed [e, R, L] receive buffers (engines/torch/parallel/
    dispatch.py) from the Experts module's fp32 weights: gate|up as one batched matmul on a GPU,
    apart on the CPU."""
    if buf_eRL.is_cuda:  # gate and up as one [e, L, 2F] batched matmul
        Fh = experts.w_gate.shape[-1]
        gu_eR2F = torch.bmm(buf_eRL, torch.cat([experts.w_gate, experts.w_up], -1).to(cdt))
        h_eRF = F.silu(gu_eR2F[..., :Fh]) * gu_eR2F[..., Fh:]
    else:
        h_eRF = F.silu(torch.bmm(buf_eRL, experts.w_gate.to(cdt))) * torch.bmm(buf_eRL, experts.w_up.to(cdt))
    return torch.bmm(h_eRF, experts.w_down.to(cdt))


class CastKernels:
    """The experts' kernels: w holds the block's expert weights in cdt ("moe.experts.gate_up"
    [E, L, 2F] and "moe.experts.w_down" [E, F, L]: engines/torch/forward.block_weights or working
    copies)."""

    def __init__(self, experts, w: dict, cdt: torch.dtype, o: TorchKernels):
        self.experts, self.w, self.cdt, self.o = experts, w, cdt, o

    def sorted_experts(self, x_TL, order_A, inv_A, K: int, counts_E) -> torch.Tensor:
        w_gu, w_down, cdt, o = self.w["moe.experts.gate_up"], self.w["moe.experts.w_down"], self.cdt, self.o
        if o.experts == "fused-gather" and _fused(x_TL, cdt, o):
            offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
            return swiglu_gemm.fused_dispatch_experts(x_TL.to(cdt), order_A // K, inv_A, K, w_gu, w_down, offs_E)
        x_AL = Dispatch.apply(x_TL.to(cdt), order_A // K, inv_A, K, o.gather == "triton")
        return grouped_swiglu(x_AL, counts_E, w_gu, w_down, cdt, o)

    def unsort(self, y_sorted_AL, order_A, inv_A, gate_TK) -> torch.Tensor:
        """y_TKL; with o.gather "triton", y_TL: the outputs already summed with their gates (by the
        kernels on a GPU with Triton, by their torch forms elsewhere)."""
        T, K = gate_TK.shape
        if self.o.gather == "triton":
            return Combine.apply(y_sorted_AL, gate_TK, inv_A, order_A, True, self.o.combine_grad == "triton")
        return Permute.apply(y_sorted_AL, inv_A, order_A).view(T, K, -1)

    def fill(self, x_TL, fill_R, slot_A, K: int) -> torch.Tensor:
        T = x_TL.shape[0]
        src_R = torch.where(fill_R < T * K, fill_R // K, T)  # T: the zero row
        # a dropped assignment (slot_A = R) or an unfilled row reads a zero row: gather backwards
        return Dispatch.apply(x_TL.to(self.cdt), src_R, slot_A, K, self.o.gather == "triton", True)

    def read(self, out_RL, slot_A, fill_R) -> torch.Tensor:
        return RowGather.apply(out_RL, slot_A, fill_R)

    def padded(self, x_ECL) -> torch.Tensor:
        Fh = self.w["moe.experts.w_down"].shape[1]
        gu_EC2F = torch.bmm(x_ECL, self.w["moe.experts.gate_up"])  # gate and up as one batched matmul
        h_ECF = F.silu(gu_EC2F[..., :Fh]) * gu_EC2F[..., Fh:]
        return torch.bmm(h_ECF, self.w["moe.experts.w_down"])

    def gate_up(self) -> torch.Tensor:
        return self.w["moe.experts.gate_up"]

    def down(self) -> torch.Tensor:
        return self.w["moe.experts.w_down"]
