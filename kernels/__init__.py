"""Attention over paged KV, imported as `chatstore.kernels` (never as a top-level `kernels`).

- `paged_attention.paged_attention_reference`: the clear torch reference (CPU and CUDA), per
  sequence: gather its blocks, then scaled-dot-product attention with a causal offset mask.
- `paged_decode.paged_decode`: the fast decode path (one query token per sequence) that reads each
  sequence's blocks once, without a padded copy of every sequence's whole KV.
"""
