"""Quantize float weights into GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K).

The ``gguf`` package dequantizes K-quants but does not quantize them; tests and
benchmarks write Q4_K_M / Q5_K_M / Q6_K files of the default model with this
quantizer and check it block by block against ``gguf.quants.dequantize``.

It is the plain min/max fit, vectorized in numpy, not llama.cpp's iterative
search (``make_qkx2_quants``, which tries several scales per sub-block and
keeps the one with the least weighted error): slightly larger error per
weight, the same bytes and layout.

* Q4_K / Q5_K: 8 sub-blocks of 32 weights, each ``w = (d * sc) * q - (dmin * m)``
  with 6-bit ``sc``, ``m`` under float16 super-scales ``d``, ``dmin``; q has 4
  (5) bits.
* Q6_K: 16 sub-blocks of 16 weights, ``w = (d * sc) * (q - 32)``, int8 ``sc``
  under a float16 ``d``, 6-bit q.

Everything else (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) is the ``gguf`` package's own
quantizer, which matches llama.cpp's reference.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

Q = GGMLQuantizationType
QK_K = 256


def quantize(weight: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """``weight`` [rows, cols] float32 as uint8 blocks [rows, row bytes]."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    rows, cols = weight.shape
    if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K) and cols % QK_K:
        raise ValueError(f"{kind.name} needs rows of whole {QK_K}-weight super-blocks, not {cols}")
    if kind in (Q.Q4_K, Q.Q5_K):
        blocks = _quantize_q45k(weight.reshape(-1, QK_K), 5 if kind == Q.Q5_K else 4)
    elif kind == Q.Q6_K:
        blocks = _quantize_q6k(weight.reshape(-1, QK_K))
    else:
        return gguf_quantize(weight, kind)
    return blocks.reshape(rows, -1)


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _quantize_q45k(x: np.ndarray, bits: int) -> np.ndarray:
    n = x.shape[0]
    levels = (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)  # the offset is subtracted: min <= 0
    high = sub.max(axis=-1)
    scale = (high - low) / levels
    d = _half(scale.max(axis=-1) / 63)
    dmin = _half((-low).max(axis=-1) / 63)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d32[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-low, dmin32[:, None])), 0, 63).astype(np.uint8)
    # The values dequantization rebuilds, each a float32 product (gguf's order).
    ds = d32[:, None] * sc.astype(np.float32)
    dm = dmin32[:, None] * m.astype(np.float32)
    q = np.rint(_safe_div(sub + dm[..., None], ds[..., None]))
    q = np.clip(q, 0, levels).astype(np.uint8)  # [n, 8, 32]

    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    # 64-weight chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high.
    nib = q & 0xF
    qs = (nib[:, 0::2, :] | (nib[:, 1::2, :] << 4)).reshape(n, 128)
    parts = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales]
    if bits == 5:
        high_bits = (q >> 4) & 1  # [n, 8, 32]: bit s of qh[l]
        qh = np.zeros((n, 32), dtype=np.uint8)
        for s in range(8):
            qh |= high_bits[:, s, :] << s
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=-1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31  # q - 32 in -32..31: 31 keeps both ends
    d = _half(scale.max(axis=-1) / 127)
    d32 = d.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d32[:, None])), -128, 127).astype(np.int8)
    ds = d32[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(_safe_div(sub, ds[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 2, 128)  # two halves of 128 weights
    # Weight r of a half: low nibble in ql[r % 64] (>> 4 for r >= 64), two high
    # bits in qh[r % 32] at bit 2 (r // 32).
    low, high = q & 0xF, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for t in range(4):
        qh |= high[:, :, 32 * t : 32 * (t + 1)] << (2 * t)
    return np.concatenate(
        [ql, qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=-1
    )


def reference_dequantize(weight: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """What ``quantize(weight, kind)`` stands for, computed from the quantizer's
    own fields (not by unpacking bytes): the check of the packing in tests."""
    x = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, QK_K)
    n = x.shape[0]
    if kind in (Q.Q4_K, Q.Q5_K):
        levels = 31 if kind == Q.Q5_K else 15
        sub = x.reshape(n, 8, 32)
        low = np.minimum(sub.min(axis=-1), 0)
        scale = (sub.max(axis=-1) - low) / levels
        d32 = _half(scale.max(axis=-1) / 63).astype(np.float32)
        dmin32 = _half((-low).max(axis=-1) / 63).astype(np.float32)
        sc = np.clip(np.rint(_safe_div(scale, d32[:, None])), 0, 63).astype(np.float32)
        m = np.clip(np.rint(_safe_div(-low, dmin32[:, None])), 0, 63).astype(np.float32)
        ds, dm = d32[:, None] * sc, dmin32[:, None] * m
        q = np.clip(np.rint(_safe_div(sub + dm[..., None], ds[..., None])), 0, levels)
        out = ds[..., None] * q.astype(np.float32) - dm[..., None]
    else:
        sub = x.reshape(n, 16, 16)
        scale = np.abs(sub).max(axis=-1) / 31
        d32 = _half(scale.max(axis=-1) / 127).astype(np.float32)
        sc = np.clip(np.rint(_safe_div(scale, d32[:, None])), -128, 127).astype(np.float32)
        ds = d32[:, None] * sc
        q = np.clip(np.rint(_safe_div(sub, ds[..., None])), -32, 31)
        out = ds[..., None] * q.astype(np.float32)
    return out.astype(np.float32).reshape(weight.shape)
