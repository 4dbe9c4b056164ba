"""What a cluster plan costs: named model presets, the device, and the FLOP and byte counts of a decoder
layer, for rrfp-run's layout search (exec/jobs/plan_search.py). Pure Python.

**Presets** (``rrfp-run --model llama3-70b``): the Llama 3 decoders' sizes from "The Llama 3 Herd of
Models" (Dubey et al., 2024, arXiv:2407.21783), Table 3 (layers, model dimension, FFN dimension, attention
heads, key/value heads); the vocabulary (128256) and the sequence length (8192) from the Meta-Llama-3-8B
and Meta-Llama-3-70B model cards' ``config.json`` (``vocab_size``, ``max_position_embeddings``). Explicit
sizes (``--layers --hidden --heads --vocab --seq-len``) describe rrfp-run's own GPT: multi-head attention
(kv heads = heads) and a 4 x hidden GELU MLP (two matrices).

**Counts** (per microbatch of ``b`` samples of ``s`` tokens; ``h`` hidden, ``a`` heads, ``t`` tp):

* FLOPs: a layer's forward is 2 x its parameters x tokens (every weight is one multiply-add per token)
  plus attention's two score matmuls, 4 b s^2 h (Narayanan et al., 2021, "Efficient Large-Scale Language
  Model Training on GPU Clusters", section 5.1); the output head adds 2 V h per token on the last stage;
  a backward is 2 x its forward, so a training step is 6 x params x tokens plus the attention term.
* Static bytes per parameter: 18 = bf16 weights 2 + fp32 gradients 4 + fp32 master weights 4 + Adam's
  two fp32 moments 4 + 4 (mixed-precision Adam as Megatron-LM keeps it without its distributed
  optimizer), every parameter split over tp.
* Activation bytes of one layer and microbatch: 34 s b h / t (Korthikanti et al., 2022, "Reducing
  Activation Recomputation in Large Transformer Models", eq. 4: tensor and sequence parallelism, so
  every activation is split over tp), less the 5 a s^2 b / t attention-score term, which FlashAttention
  recomputes instead of storing; the last stage also holds one microbatch's fp32 logits, 4 s b V / t,
  between its forward and its backward. Tensor parallelism's traffic is the same with sequence
  parallelism (an all-gather and a reduce-scatter in place of each all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

from rrfp.exec.config import ExecConfigError

BYTES_PER_PARAM = 18
"""bf16 weights 2 + fp32 gradients 4 + fp32 master 4 + Adam m 4 + v 4 (module docstring)."""
GRAD_BYTES_PER_PARAM = 4
"""fp32 gradients, all-reduced across data-parallel replicas at the flush."""
ACT_BYTES = 2
"""bf16 activations and pipeline messages."""

LLAMA3_SOURCE = (
    "Dubey et al., The Llama 3 Herd of Models, arXiv:2407.21783, Table 3; vocab and seq len from the "
    "Meta-Llama-3 model cards' config.json"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder-only transformer's sizes, as the planner costs it."""

    name: str
    """The preset's name, or ``gpt`` for explicit sizes."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    """Key/value heads (grouped-query attention); = heads for multi-head attention."""
    ffn: int
    """MLP inner width."""
    vocab: int
    seq_len: int
    """Tokens per sample."""
    gated: bool = False
    """SwiGLU MLP (three matrices: gate, up, down) rather than GELU (two)."""
    source: str = "rrfp-run's GPT, exec/models"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ExecConfigError(f"model {self.name}: {name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ExecConfigError(f"model {self.name}: heads must divide hidden, and kv heads the heads")

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: Q and O (h x h each), K and V (h x kv_heads x head dim each),
        the MLP's matrices and two norms' scales."""
        kv = self.kv_heads * (self.hidden // self.heads)
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        return attention + (3 if self.gated else 2) * self.hidden * self.ffn + 2 * self.hidden

    @property
    def params(self) -> int:
        """Every parameter: the layers, the input embedding and the (untied) output head, a final norm."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden

    def layer_flops(self, samples: int) -> float:
        """Forward FLOPs of one layer on ``samples`` sequences (module docstring)."""
        tokens = samples * self.seq_len
        return 2.0 * self.layer_params * tokens + 4.0 * samples * self.seq_len**2 * self.hidden

    def head_flops(self, samples: int) -> float:
        """Forward FLOPs of the output head on ``samples`` sequences."""
        return 2.0 * self.vocab * self.hidden * samples * self.seq_len

    def layer_activation_bytes(self, samples: int, tp: int) -> float:
        """Bytes one layer keeps for its backward, per microbatch, on one tp rank (module docstring)."""
        return 34.0 * self.seq_len * samples * self.hidden / tp

    def logits_bytes(self, samples: int, tp: int) -> float:
        """fp32 logits of one microbatch on one tp rank of the last stage."""
        return 4.0 * self.seq_len * samples * self.vocab / tp


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn, vocab=128256,
                     seq_len=8192, gated=True, source=LLAMA3_SOURCE)  # fmt: skip


PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
}
"""``--model`` names whose sizes the planner knows (their source: :data:`LLAMA3_SOURCE`)."""


def gpt_spec(layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> ModelSpec:
    """rrfp-run's own GPT at explicit sizes: multi-head attention, a 4 x hidden GELU MLP."""
    return ModelSpec(name="gpt", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
                     vocab=vocab, seq_len=seq_len)  # fmt: skip


DEFAULT_INTRA_NODE_GBS = 450.0
"""--intra-node-bw: GB/s one GPU sends within its node (H100 SXM NVLink 4: 900 GB/s both directions)."""
DEFAULT_INTER_NODE_GBS = 50.0
"""--inter-node-bw: GB/s one GPU sends to another node (one 400 Gb/s NDR InfiniBand NIC per GPU)."""
LINK_LATENCY_S = 10e-6
"""Seconds per message and per ring step, on either link (a NCCL send's order of magnitude)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One accelerator and its links, as the planner costs them."""

    tflops: float
    """Achievable dense bf16 TFLOP/s (--device-tflops)."""
    gpu_memory: int | None = None
    """Bytes per device (--gpu-memory); None: no limit."""
    intra_bw: float = DEFAULT_INTRA_NODE_GBS * 1e9
    """Bytes per second within a node (tensor parallelism, pipeline hops inside a node)."""
    inter_bw: float = DEFAULT_INTER_NODE_GBS * 1e9
    """Bytes per second between nodes (pipeline hops across nodes, the data-parallel ring)."""
    latency: float = LINK_LATENCY_S

    def __post_init__(self) -> None:
        for name in ("tflops", "intra_bw", "inter_bw"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ExecConfigError(f"device {name} must be a finite number > 0, got {value!r}")

    def seconds(self, flops: float, tp: int) -> float:
        """Seconds of ``flops`` split over ``tp`` devices."""
        return flops / (self.tflops * 1e12 * tp)

    def allreduce(self, nbytes: float, ranks: int, bandwidth: float) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``ranks``: 2(n-1)/n x bytes / bandwidth plus
        2(n-1) latency steps; 0 for one rank."""
        if ranks == 1:
            return 0.0
        return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * self.latency
