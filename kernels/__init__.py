"""Attention over paged KV, imported as `chatstore.kernels` (never as a top-level `kernels`).

- `paged_attention.paged_attention_reference`: the clear torch reference (CPU and CUDA), per
  sequence: gather its blocks, then scaled-dot-product attention with a causal offset mask.
- `paged_decode.paged_decode`: the fast decode path (one query token per sequence) that reads each
  sequence's blocks once, without a padded copy of every sequence's whole KV.
- `paged_prefill.paged_prefill`: any batch of new tokens over the pool, in place.
- `fused_ops`: the element-wise parts of a layer.

What runs where (`native.py`): the C kernels are built once per instruction set (avx512_bf16,
avx512, avx2, generic) and the best variant the CPU reports serves, chosen at run time; with
AVX512-BF16, bf16 attention and the norm's sum of squares use bf16 dot products with fp32
accumulation, and every other variant computes the fp32 path (`native.fallback_library()` is the
best of those on this CPU; `CHATSTORE_BF16_DOT=0` serves it, `CHATSTORE_KERNEL_ISA` pins one).
"""
