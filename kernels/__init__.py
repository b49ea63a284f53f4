"""Attention over paged KV, imported as `chatstore.kernels` (never as a top-level `kernels`).

- `paged_attention.paged_attention_reference`: the clear torch reference (CPU and CUDA), per
  sequence: gather its blocks, then scaled-dot-product attention with a causal offset mask.
- `paged_decode.paged_decode`: the fast decode path (one query token per sequence) that reads each
  sequence's blocks once, without a padded copy of every sequence's whole KV.
- `paged_prefill.paged_prefill`: any batch of new tokens over the pool, in place.
- `fused_ops`: the element-wise parts of a layer.

What runs where (`native.py`): the C kernels are built for the CPU they run on; with AVX512-BF16,
bf16 attention and the norm's sum of squares use bf16 dot products with fp32 accumulation, and
without it the same sources compile to the fp32 path (`native.fallback_library()` is that build
on any CPU; `CHATSTORE_BF16_DOT=0` serves it).
"""
