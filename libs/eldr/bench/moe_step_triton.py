"""The grouped-GEMM kernel of `eldr bench-moe-step` (Triton; imported only when used).

One launch multiplies the rows of every activated expert by that expert's weights:
program (m, n) takes block m of BLOCK_M (token, expert) slots, which all belong to one
expert (`block_expert[m]`, -1 past the last block: the program exits), and output columns
n * BLOCK_N onwards; it streams that expert's weight tiles [BLOCK_N, K] once per block,
however many of the block's rows are padding. This is the structure of the fused MoE
kernels serving engines run at decode. Weights are dequantised in the kernel:

- WEIGHT_FORMAT 0: weights in the activation dtype (BF16);
- 1: FP8 E4M3 bits (uint8) times a float32 scale per (expert, output channel);
- 2: MXFP4: uint8 bytes of two E2M1 codes along K (low nibble first) times an E8M0 scale
  (uint8 exponent, bias 127) per 32 values along K.

The kernel is our own, written for this benchmark; on the CPU it runs under Triton's
interpreter (TRITON_INTERPRET=1, set before this module is imported) in the tests.
Not type-checked by mypy (the comment below): the kernel's parameters and `tl.constexpr`
annotations are Triton's to read, and triton is not installed in .venv.
"""

# mypy: ignore-errors

import importlib
from typing import Any

triton: Any = importlib.import_module("triton")
tl: Any = importlib.import_module("triton.language")

FORMAT_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2}


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    scale_ptr,
    c_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    route_w_ptr,
    N,
    K,
    num_slots,
    rows_per_a,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_cm,
    WEIGHT_FORMAT: tl.constexpr,
    MUL_ROUTE_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = (slots // rows_per_a).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + rk[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        if WEIGHT_FORMAT == 2:
            rk2 = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                w_base + rn[:, None] * stride_wn + rk2[None, :] * stride_wk,
                mask=n_ok[:, None] & (rk2 < K // 2)[None, :],
                other=0,
            )
            code = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]
            exponent = ((code >> 1) & 3).to(tl.float32)
            mantissa = (code & 1).to(tl.float32)
            magnitude = tl.where(
                exponent == 0.0, 0.5 * mantissa, tl.exp2(exponent - 1.0) * (1.0 + 0.5 * mantissa)
            )
            value = tl.where((code & 8) != 0, -magnitude, magnitude)
            e8m0 = tl.load(
                scale_ptr
                + expert * stride_se
                + rn[:, None] * stride_sn
                + (rk // 32)[None, :] * stride_sk,
                mask=n_ok[:, None] & k_ok[None, :],
                other=127,
            )
            w = (value * tl.exp2(e8m0.to(tl.float32) - 127.0)).to(a.dtype)
            acc += tl.dot(a, tl.trans(w))
        else:
            w = tl.load(
                w_base + rn[None, :] * stride_wn + rk[:, None] * stride_wk,
                mask=k_ok[:, None] & n_ok[None, :],
                other=0,
            )  # [BLOCK_K, BLOCK_N]
            if WEIGHT_FORMAT == 1:
                w = w.to(tl.float8e4nv, bitcast=True).to(a.dtype)
            acc += tl.dot(a, w)
    if WEIGHT_FORMAT == 1:
        channel = tl.load(scale_ptr + expert * stride_se + rn * stride_sn, mask=n_ok, other=0.0)
        acc = acc * channel[None, :]
    if MUL_ROUTE_WEIGHT:
        route_w = tl.load(route_w_ptr + slots, mask=valid, other=0.0)
        acc = acc * route_w[:, None]
    tl.store(
        c_ptr + slots.to(tl.int64)[:, None] * stride_cm + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & n_ok[None, :],
    )


def grouped_gemm(
    a: Any,
    weights: Any,
    c: Any,
    sorted_ids: Any,
    block_expert: Any,
    route_w: Any,
    num_slots: int,
    *,
    rows_per_a: int,
    block: tuple[int, int, int],
    num_warps: int,
    num_stages: int,
    mul_route_weight: bool,
) -> None:
    """c[slot] = a[slot // rows_per_a] @ W[expert of slot].T (x router weight), per slot.

    a: [rows, K] activations; weights: an `ExpertMatrix` [E, N, K]; c: [num_slots, N];
    sorted_ids / block_expert: from `MoeLayer.align`; route_w: [num_slots] router weights.
    """
    block_m, block_n, block_k = block
    fmt = FORMAT_CODES[weights.fmt]
    if a.stride(1) != 1 or c.stride(1) != 1:
        raise ValueError("a and c need contiguous rows")
    if fmt == 2 and block_k % 32:
        raise ValueError("MXFP4 needs BLOCK_K divisible by 32")
    w, scale = weights.weight, weights.scale
    if fmt == 0:
        s_strides = (0, 0, 0)
    elif fmt == 1:
        s_strides = (scale.stride(0), scale.stride(1), 0)
    else:
        s_strides = (scale.stride(0), scale.stride(1), scale.stride(2))
    grid = (block_expert.shape[0], triton.cdiv(weights.n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        scale,
        c,
        sorted_ids,
        block_expert,
        route_w.reshape(-1),
        weights.n,
        weights.k,
        num_slots,
        rows_per_a,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        *s_strides,
        c.stride(0),
        WEIGHT_FORMAT=fmt,
        MUL_ROUTE_WEIGHT=mul_route_weight,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
