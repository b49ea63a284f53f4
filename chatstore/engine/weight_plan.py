"""Which weights each projection computes with: `weights = auto | bf16 | fp32 | int8 | int4`.

    format   what the runner builds                                    from
    dense    linear.Linear in the compute dtype (prepacked where faster) the HF weights
    int8     Int8Linear, per-output-channel W8A16                        the HF weights (a
                                                                         GGUF's Q8_0 as it is)
    int4     Int4Linear, group 32 W4A16                                  the GGUF's blocks where
                                                                         it has them, else HF's
    gguf     the GGUF's own quantized tensors as int4 (Q4_0/Q4_1/Q4_K; Q8_0 exactly on two int4
             halves, `gguf_repack`), every other tensor dense: the model as published

`auto` is `gguf` on a CPU when the model came from a GGUF file (the embedded default does) and
the compute dtype is left to `dtype = auto`; anything else serves dense weights, so an explicit
`dtype` (the tests' servers run `CHATSTORE_DTYPE=float32`) or a model handed in already loaded
keeps today's exact 16/32-bit path. `bf16` / `fp32` are dense weights in that dtype (the compute
dtype follows them under `dtype = auto`). Embeddings stay a dense table (a step gathers T rows
of it, ~1 KB a token), except where `gguf` weights are expanded: there the rows are read from the
file's own quantized table (`embedding_rows`), and no 16-bit table is held.

Token counts at which a 16-bit GEMM beats the quantized kernels compute on a 16-bit weight: the
quantized one expanded just in time (`prefill_weights = expand`: `DENSE_FROM`; `DENSE_FROM_NATIVE`
for the native int4 kernel, where expanding wins from 8 tokens; `DENSE_FROM_INT8` where int8 dot
products serve, from 12: bench/prefill_weights.py's crossover on the 1B shape, docs/models.md) or a
resident copy (`copy`: `DENSE_FROM_COPY`, the table below); `auto` copies while they take at most
PREFILL_COPY_BUDGET (docs/models.md has the measurement). Measured with
`bench/quant_shapes.py` on the AVX512-BF16 EPYC (bf16 activations, 2 threads, a layer's
projection over 30 distinct weights so they stream from DRAM as in a step; ms per call, the
fastest pass), 2026-11-25 at a quiet moment (load ~1.5 on the 2 cores; two earlier runs under
load 5-9 showed the same crossovers with stalls in single cells):

    shape        T    16-bit     int8 int4-g32 int4-g64 Q8_0 2x4
    qkv          1     0.082    0.022    0.022    0.021        -
    qkv          8     0.053    0.079    0.059    0.058        -
    qkv         32     0.116    0.290    0.216    0.212        -
    qkv       2000     5.211   14.756   13.138   12.929        -
    o_proj       1     0.045    0.015    0.016    0.015        -
    o_proj       8     0.038    0.044    0.038    0.037        -
    o_proj      32     0.078    0.153    0.133    0.130        -
    o_proj    2000     3.083    8.783    7.923    7.793        -
    gate_up      1     0.229    0.133    0.058    0.055        -
    gate_up      8     0.179    0.360    0.182    0.177        -
    gate_up     32     0.347    0.942    0.689    0.672        -
    gate_up   2000    16.448   48.753   42.241   41.473        -
    down         1     0.106    0.052    0.033    0.032        -
    down         8     0.088    0.142    0.092    0.090        -
    down        32     0.188    0.416    0.347    0.338        -
    down      2000     8.117   22.418   20.937   20.705        -
    lm_head      1     3.316    1.856    0.770    0.728    1.680
    lm_head      8     2.583    5.709    2.740    2.690    5.714
    lm_head     32     5.580   23.038   10.917   10.705   22.384

What it chose, per shape:
- qkv, o_proj, gate_up, down: the quantized weight below 16 tokens, the 16-bit copy from 16 on
  (expanding the weight costs ~0.1-0.4 ms a projection here, so it takes over from 24 tokens:
  measured on whole forwards at DENSE_FROM).
  At 1 token (decode at batch 1) int4 is 2.8-4x faster: the step reads a quarter of the bytes.
  At 8 they tie (within 11% either way). From 32 tokens on (1.7-2x), and at a 2,000-token
  prefill by 2.5-2.6x, oneDNN's blocked 16-bit GEMM wins: torch's int4/int8 kernels are
  compute-bound once the weight is amortised over many tokens. So prefill stays 16-bit.
- int4 group 32 over 64: within 5% everywhere; 32 is GGUF's block, so one layout serves both.
- int8 (W8A16): as fast as int4 at 1 token on the small layers, 1.5-2.3x slower on gate_up and
  the head and from 8 tokens on; it reads twice int4's bytes, so it is offered (`weights =
  int8`) but never chosen by auto. On the embedded model (bench/quant_accuracy.py) it costs
  +0.88% perplexity against bf16, where the GGUF's own int4 codes cost nothing (-0.001%):
  per-channel int8 re-quantizes Q4_1's per-32 grid. A GGUF's Q8_0 tensors (the head) stay as
  they are under int8 too.
- lm_head (49152 x 576, tied to the embeddings, Q8_0 in the embedded GGUF): it sees one row per
  sequence, never a prompt. At 1 row the GGUF's Q8_0 on two int4 halves (exact) runs 1.68 ms
  against 3.32 for the 16-bit GEMV (int8 1.86; a lossy int4 re-quantization would run 0.77, not
  taken: the head keeps the GGUF's 8 bits); at 8 rows the 16-bit GEMM wins 2.2x. So the
  quantized head serves single-row steps only (DENSE_FROM 2).

On a CPU without AVX512 torch runs its AVX2 kernels; forcing them here (ATEN_CPU_CAPABILITY=avx2,
the 16-bit side still bf16 oneDNN) int4 stays 2.1-2.6x faster at 1 token, loses 1.4-1.7x at 8
(so 16 is late there: 4 would fit), and the Q8_0 head is 1.1x slower than the 16-bit GEMV at 1
row. Not tuned per CPU: on such a CPU `dtype = auto` computes in fp32, whose dense weights read
twice the bytes, which moves every crossover toward the quantized side.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable

import torch

from chatstore.config import WEIGHTS_CHOICES
from chatstore.engine.linear import Linear, packing_available
from chatstore.engine.quant_linear import (
    NEVER,
    Int4Linear,
    Int8Linear,
    PackedRows,
    int4_kernel,
    int4_supported,
    kernels_available,
)
from chatstore.kernels.int4_matmul import Int4Packed
from chatstore.kernels.int4_vnni import int8_prefill_available
from chatstore.kernels.weight_dequant import DequantScratch, dequant_available
from chatstore.model.gguf_weights import GGUFWeights
from chatstore.model.loader import LoadedModel
from chatstore.model.quant_weights import (
    Int4Weight,
    PackedInt4Weight,
    QuantWeight,
    cat_int4_rows,
    quantize_int4,
    quantize_int8,
)
from chatstore.model.spec import ModelSpec

log = logging.getLogger(__name__)

WEIGHT_FORMATS = WEIGHTS_CHOICES
INT4_GROUP = 32  # GGUF's block: a repacked and a quantized weight share one layout
# First token count each projection computes on its weight expanded to 16 bits (lm_head: on the
# tied embeddings), per int4 kernel. torch's: a whole forward of T tokens on the Xeon (AVX512-
# BF16 + AMX, bf16, 2 threads; the fastest of 2), int4 kernel vs expanded, in seconds:
#   1B-shape Q4_0   T 16: 0.31 vs 0.45   24: 0.44 vs 0.41   31: 0.62 vs 0.45
#   8B-shape Q4_0   T  8: 1.14 vs 3.57   16: 2.28 vs 3.46   31: 3.90 vs 2.82
#   embedded 135M   T 16: 0.035 vs 0.027 24: 0.045 vs 0.034 (expanding wins from below 16)
# The int4 kernel's cost grows with T, expanding's is nearly flat (the dequant): 24 serves all
# three (the first turn's ~30-token prompt of an 8B: 2.8 s instead of 3.9).
DENSE_FROM = {"qkv": 24, "o_proj": 24, "gate_up": 24, "down": 24, "lm_head": 2}
DENSE_FROM_NATIVE = {"qkv": 8, "o_proj": 8, "gate_up": 8, "down": 8, "lm_head": 2}
DENSE_FROM_INT8 = {"qkv": 12, "o_proj": 12, "gate_up": 12, "down": 12, "lm_head": 2}
# 16-bit copies for the short-prefill counts, as before expanding: at 16 tokens on
DENSE_FROM_COPY = {"qkv": 16, "o_proj": 16, "gate_up": 16, "down": 16, "lm_head": 2}
PREFILL_COPY_BUDGET = 1 << 30  # prefill_weights = auto keeps copies up to this many bytes

Projection = Linear | Int8Linear | Int4Linear
# (role, layer or None for lm_head, weight [N, K] in the compute dtype, bias) -> projection
ProjectionFactory = Callable[[str, "int | None", torch.Tensor, "torch.Tensor | None"], Projection]


def resolve_format(
    weights: str, dtype_setting: str, device: str, from_gguf: bool, model_given: bool
) -> str:
    """dense | int8 | int4 | gguf for a `weights` setting (see the module doc for `auto`)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {list(WEIGHT_FORMATS)}, got {weights!r}")
    cpu = device == "cpu"
    if weights in ("int8", "int4") and not cpu:
        raise ValueError(f"weights = {weights} runs on CPU only (torch's CPU kernels)")
    if weights == "auto":
        shipped = cpu and from_gguf and dtype_setting == "auto" and not model_given
        return "gguf" if shipped else "dense"
    return weights if weights in ("int8", "int4") else "dense"


def plan_projections(
    weights: str,
    dtype_setting: str,
    model: LoadedModel,
    attention: str,
    device: str,
    model_given: bool,
    prefill_weights: str = "auto",
) -> Projections | None:
    """The runner's projection builder for these settings; None for dense weights (the
    runner's default). `dtype_setting` is `dtype` as configured ("auto" or a name);
    `prefill_weights` the `prefill_weights` setting (`prefill_mode`)."""
    fmt = resolve_format(weights, dtype_setting, device, model.gguf is not None, model_given)
    if fmt == "gguf" and weights == "auto" and not kernels_available():
        log.warning(
            "weights = auto: this torch (%s) lacks the int4/int8 CPU kernels "
            "(_weight_int4pack_mm_for_cpu, _weight_int8pack_mm): serving dense weights",
            torch.__version__,
        )
        return None
    if fmt == "dense":
        return None
    gguf = GGUFWeights(model.gguf, model.spec) if model.gguf else None
    pack = attention == "auto" and packing_available(torch.device(device), model.dtype)
    prefill = prefill_mode(prefill_weights, model.spec, model.dtype)
    return Projections(
        fmt, model.dtype, pack, gguf, tied_head=model.spec.tie_word_embeddings, prefill=prefill
    )


def prefill_copy_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """What 16-bit (compute dtype) copies of every layer's projections take."""
    h, d = spec.hidden_size, spec.head_dim
    per_layer = (2 * spec.num_heads + 2 * spec.num_kv_heads) * d * h  # q, k, v, o
    per_layer += 3 * spec.intermediate_size * h  # gate, up, down
    return spec.num_layers * per_layer * dtype.itemsize


def prefill_mode(setting: str, spec: ModelSpec, dtype: torch.dtype) -> str:
    """expand | copy for `prefill_weights`: auto copies while the copies fit PREFILL_COPY_BUDGET
    (the embedded model's take 212 MB in bf16; a 1B model's 2.3 GB, an 8B's 13 GB)."""
    if setting not in ("auto", "expand", "copy"):
        raise ValueError(f"prefill_weights must be auto, expand or copy, got {setting!r}")
    if setting != "auto":
        return setting
    return "copy" if prefill_copy_bytes(spec, dtype) <= PREFILL_COPY_BUDGET else "expand"


def weights_fingerprint(model_fingerprint: str, fmt: str, prefill: str = "") -> str:
    """The store's model fingerprint for KV computed with `fmt` weights: KV of quantized
    weights differs from dense KV, so the two never share stored chunks; nor does a prompt's KV
    computed on the expanded quantized weight (`prefill` "expanded", or "int8" on int8 dot
    products) share with one computed on 16-bit copies of the file's floats, or each other."""
    if fmt == "dense":
        return model_fingerprint
    tag = f"{model_fingerprint}:{fmt}" + (f":{prefill}" if prefill else "")
    return hashlib.sha256(tag.encode()).hexdigest()[:16]


class Projections:
    """Builds the runner's projections in one format and counts what it built."""

    def __init__(
        self,
        fmt: str,
        dtype: torch.dtype,
        pack: bool,
        gguf: GGUFWeights | None = None,
        dense_from: dict[str, int] | None = None,
        int4: str | None = None,
        tied_head: bool = False,
        prefill: str = "expand",
    ) -> None:
        """`dense_from` overrides DENSE_FROM (per role; tests use it to run the quantized
        kernels at every token count); `int4` the int4 kernel (quant_linear.int4_kernel);
        `tied_head`: the lm_head's weight is the embedding table, which the runner holds in
        16 bits anyway, so the head's multi-row calls run on it at no cost in memory;
        `prefill`: expand (the weight expanded just in time for a call of many tokens) or copy
        (a 16-bit copy kept beside each quantized weight for such calls)."""
        self.fmt, self.dtype, self.pack, self.gguf = fmt, dtype, pack, gguf
        self.int4_kernel = int4_kernel(int4)
        self.int4_kernels: Counter[str] = Counter()  # what the int4 projections run on
        self.tied_head = tied_head
        # every quantized projection's prefill weight lands here (None: keep 16-bit copies)
        expand = prefill == "expand" and fmt != "dense"
        self.scratch = None
        if expand and dequant_available():
            # int4 prefill on integer dot products where the CPU has VNNI (int4_vnni.py)
            self.scratch = DequantScratch(dtype, int8_prefill_available())
        if expand and self.scratch is None:
            log.warning(
                "weights = %s: cannot expand weights here (no native kernels): "
                "quantized projections keep a 16-bit copy for prefill",
                fmt,
            )
        native, int8 = self.int4_kernel == "native", self.scratch is not None and self.scratch.int8
        table = DENSE_FROM_NATIVE if native else (DENSE_FROM_INT8 if int8 else DENSE_FROM)
        self.dense_from = dense_from or (table if self.scratch is not None else DENSE_FROM_COPY)
        self.built: Counter[str] = Counter()

    def __call__(
        self, role: str, layer: int | None, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Projection:
        quant = None if self.fmt == "dense" else self._quantized(role, layer, weight)
        if quant is None:
            self.built[f"{role}: {str(self.dtype).removeprefix('torch.')}"] += 1
            return Linear(weight, bias, self.pack)
        weight_q, label = quant
        self.built[f"{role}: {label}"] += 1
        dense_from = self.dense_from[role]
        dense = self._dense_side(role, weight, bias, dense_from)
        scratch = None if role == "lm_head" else self.scratch
        if isinstance(weight_q, Int4Weight | PackedInt4Weight | Int4Packed):
            built = Int4Linear(weight_q, bias, dense, dense_from, self.int4_kernel, scratch)
            self.int4_kernels[built.kernel] += 1
            return built
        return Int8Linear(weight_q, bias, dense, dense_from, scratch)

    def _dense_side(
        self, role: str, weight: torch.Tensor, bias: torch.Tensor | None, dense_from: int
    ) -> Linear | None:
        """The 16-bit weight kept for the counts from `dense_from` on, where one is: with
        copies (prefill = copy, or no expanding here) a prepacked copy, as before expanding;
        else only the tied head's, the embeddings themselves (a view). An untied head is
        never expanded (the whole vocabulary every step): it stays quantized at every count."""
        if dense_from >= NEVER:
            return None
        if self.scratch is None:  # only calls of dense_from (>= 2) rows reach it
            return Linear(weight, bias, self.pack, single_rows=False)
        if role == "lm_head" and self.tied_head and not self._rows_from_file:
            return Linear(weight, bias, pack=False)
        return None

    def takes_float(self, role: str, layer: int | None) -> bool:
        """Whether building `role` reads its float weight: not where the GGUF's blocks are
        taken as they are and nothing 16-bit is kept (expanding), so a load skips
        dequantising them (issue 35: the load's largest cost after the repack)."""
        if role == "embeddings":
            return not self._table_from_file()
        if self.scratch is None or self.fmt != "gguf" or self.gguf is None:
            return True
        if role == "lm_head" and self.tied_head:  # the table: read as `embeddings` says
            return True
        return not self.gguf.fuses(role, layer)  # else _from_gguf takes the blocks alone

    @property
    def _rows_from_file(self) -> bool:
        """Whether the embeddings are read from the GGUF's quantized table (`embedding_rows`):
        expanding the model as published (`gguf`), on either int4 kernel."""
        return self.scratch is not None and self.fmt == "gguf"

    def _table_from_file(self) -> bool:
        """Whether `embedding_rows` reads the table from the file: expanding the model as
        published, and the table (the tied head's tensor, or token_embd) repacks to int4."""
        if not self._rows_from_file or self.gguf is None:
            return False
        return self.gguf.fuses("lm_head" if self.tied_head else "embeddings", None)

    def embedding_rows(self, head: Projection) -> PackedRows | None:
        """The embedding lookup from the file's quantized table instead of a 16-bit one, where
        the weights are expanded (the tied head's pack; an untied model's token_embd repacked),
        or None: the runner keeps its 16-bit table (and must have read it: `takes_float`).
        The file holds the embeddings quantized, so reading them so is the model as published."""
        if not self._table_from_file():
            return None
        assert self.gguf is not None
        table = head
        if not self.tied_head:
            packed = self.gguf.kernel_pack(self.int4_kernel, "embeddings", None)
            if packed is None:
                (part,) = self.gguf.parts("embeddings", None)
                assert part.weight is not None
                table = Int4Linear(part.weight, None, kernel=self.int4_kernel)
            else:
                table = Int4Linear(packed, None)
        if not isinstance(table, Int4Linear):
            raise RuntimeError(f"the embedding table cannot be read by rows from {table!r}")
        self.built["embeddings: rows of the GGUF's quantized table"] += 1
        return PackedRows(table, self.dtype)

    def describe(self) -> str:
        """One line for the log: what each projection computes with."""
        parts = [f"{label} x{count}" for label, count in sorted(self.built.items())]
        kernels = [f"{kernel} x{count}" for kernel, count in sorted(self.int4_kernels.items())]
        tail = f"; int4 kernel: {', '.join(kernels)}" if kernels else ""
        prefill = "expanded just in time" if self.scratch is not None else "16-bit copies"
        if self.scratch is not None and self.scratch.int8:
            prefill = "int4 tiles on int8 dot products (VNNI), other weights " + prefill
        return f"weights = {self.fmt}: " + ", ".join(parts) + tail + f"; prefill on {prefill}"

    def _quantized(
        self, role: str, layer: int | None, weight: torch.Tensor
    ) -> tuple[QuantWeight | PackedInt4Weight | Int4Packed, str] | None:
        if self.fmt == "int8":  # a GGUF's own 8-bit (Q8_0) tensors as they are, else int8
            exact = self._gguf_q8_0(role, layer)
            return exact if exact is not None else (quantize_int8(weight), "int8")
        if self.gguf is not None:
            found = self._from_gguf(role, layer, weight)
            if found is not None or self.fmt == "gguf":
                return found
        n, k = weight.shape
        if not int4_supported(n, k, INT4_GROUP):
            log.warning("%s %dx%d: no int4 layout for this shape, kept dense", role, n, k)
            return None
        return quantize_int4(weight, INT4_GROUP), "int4 (quantized)"

    def _gguf_q8_0(
        self, role: str, layer: int | None
    ) -> tuple[QuantWeight | PackedInt4Weight | Int4Packed, str] | None:
        if self.gguf is None:
            return None
        if any(t != "Q8_0" for t in self.gguf.types(role, layer)[0]):
            return None
        packed = self.gguf.kernel_pack(self.int4_kernel, role, layer)
        if packed is not None:
            return packed, "Q8_0 from GGUF on 2 x int4"
        parts = self.gguf.parts(role, layer)
        weights = [p.weight for p in parts if p.weight is not None]  # Q8_0 always repacks
        return cat_int4_rows(weights), "Q8_0 from GGUF on 2 x int4"

    def _from_gguf(
        self, role: str, layer: int | None, weight: torch.Tensor
    ) -> tuple[QuantWeight | PackedInt4Weight | Int4Packed, str] | None:
        """The GGUF's own blocks; with `int4`, parts it cannot repack (or that do not fuse with
        the rest) are quantized from the float weight, with `gguf` the projection stays dense."""
        assert self.gguf is not None
        packed = self.gguf.kernel_pack(self.int4_kernel, role, layer)
        if packed is not None:
            types = "+".join(sorted(set(self.gguf.types(role, layer)[0])))
            return packed, f"int4 from GGUF {types}"
        parts = self.gguf.parts(role, layer)
        weights = [p.weight for p in parts]
        types = "+".join(sorted({p.type_name for p in parts}))
        repacked = [w for w in weights if w is not None]
        layouts = {(w.group, w.input_repeat) for w in repacked}
        if len(repacked) == len(weights) and len(layouts) == 1:
            fused = cat_int4_rows(repacked)
            if int4_supported(fused.q.shape[0], fused.q.shape[1], fused.group):
                return fused, f"int4 from GGUF {types}"
        if self.fmt != "int4":
            return None
        rows = torch.split(weight, [p.rows for p in parts])
        mixed = [
            w if isinstance(w, Int4Weight) and w.input_repeat == 1 else quantize_int4(r, INT4_GROUP)
            for w, r in zip(weights, rows, strict=True)
        ]
        return cat_int4_rows(mixed), f"int4 from GGUF {types} (part quantized)"
