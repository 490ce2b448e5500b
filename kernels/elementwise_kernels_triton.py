"""Triton programs for the decoder's small per-token ops (host wrappers:
kernels/elementwise_triton.py). Each replaces several torch launches with one and rounds
exactly where the torch reference (kernels/elementwise_ref.py) rounds to the model dtype."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps,
                    BLOCK: tl.constexpr):
    """Grid (rows,): out = w * (x * rsqrt(mean(x^2) + eps)).to(dtype), stats in float32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    h = (x * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
    """Grid (rows, I blocks): out = silu(gate).to(dtype) * up with x = [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_head_in_place(base, pos, cos_ptr, sin_ptr, stride_c, HALF: tl.constexpr,
                          BLOCK: tl.constexpr):
    """One head at `base`: x * cos + rotate_half(x) * sin, neox style, each product
    rounded to the head's dtype as torch does, written back in place; returns the two
    rotated halves."""
    dt = base.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    c1 = tl.load(cos_ptr + pos * stride_c + offs, mask=mask).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_c + HALF + offs, mask=mask).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_c + offs, mask=mask).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_c + HALF + offs, mask=mask).to(dt).to(tl.float32)
    x1 = tl.load(base + offs, mask=mask).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask).to(tl.float32)
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    o1 = o1.to(dt)
    o2 = o2.to(dt)
    tl.store(base + offs, o1, mask=mask)
    tl.store(base + HALF + offs, o2, mask=mask)
    return o1, o2


@triton.jit
def rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, H, stride_qt, stride_qh,
                  stride_kt, stride_kh, stride_c, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (tokens, H + KVH): rotate one head of q (h < H) or k in place, neox style:
    out = x * cos + rotate_half(x) * sin, each product rounded to the dtype, as torch."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < H:
        base = q_ptr + t * stride_qt + h * stride_qh
    else:
        base = k_ptr + t * stride_kt + (h - H) * stride_kh
    _rotate_head_in_place(base, tl.load(pos_ptr + t), cos_ptr, sin_ptr, stride_c, HALF, BLOCK)


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, N, stride_x, stride_r, stride_o, eps,
                        BLOCK: tl.constexpr):
    """Grid (rows,): res = (x + res).to(dtype) in place, out = rms_norm(res), one pass:
    the residual add of a decoder layer fused into the following RMSNorm."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = res_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(dt)
    tl.store(res_ptr + row * stride_r + offs, s, mask=mask)
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, 0) / N
    h = (sf * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
                           kc_ptr, vc_ptr, H, stride_qt, stride_qh, stride_kt, stride_kh,
                           stride_vt, stride_vh, stride_c,
                           stride_kb, stride_ko, stride_kch, stride_vb, stride_vo, stride_vch,
                           KV_BLOCK: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (tokens, H + KVH): rotate one head of q (h < H) or k in place, as
    rotary_kernel; a k head is then written, with its v head, to the token's paged KV
    cache slot (slot < 0: no write). Rotary and the KV store of a layer in one launch."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < H:
        base = q_ptr + t * stride_qt + h * stride_qh
    else:
        base = k_ptr + t * stride_kt + (h - H) * stride_kh
    o1, o2 = _rotate_head_in_place(base, tl.load(pos_ptr + t), cos_ptr, sin_ptr, stride_c,
                                   HALF, BLOCK)
    if h >= H:
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            kvh = h - H
            blk = slot // KV_BLOCK
            off = slot % KV_BLOCK
            kc = kc_ptr + blk * stride_kb + off * stride_ko + kvh * stride_kch
            tl.store(kc + offs, o1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kc + HALF + offs, o2.to(kc_ptr.dtype.element_ty), mask=mask)
            vb = v_ptr + t * stride_vt + kvh * stride_vh
            vc = vc_ptr + blk * stride_vb + off * stride_vo + kvh * stride_vch
            tl.store(vc + offs, tl.load(vb + offs, mask=mask).to(vc_ptr.dtype.element_ty),
                     mask=mask)
            tl.store(vc + HALF + offs,
                     tl.load(vb + HALF + offs, mask=mask).to(vc_ptr.dtype.element_ty),
                     mask=mask)
