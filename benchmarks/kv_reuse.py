"""A cross-node hit vs recompute, computed from a tier's measured read bandwidth:
for a named model geometry and prompt, the time to load the prompt's KV from the
tier against the time to compute it again (prefill). Shared by the benchmarks of
tiers another node fills (benchmarks/s3_tier.py, the Mooncake tier's).

Which figure is measured and which is assumed is part of each row: the tier's
bandwidth comes from the caller's run; a recompute time is either measured in
this repository (with its command) or a prefill rate derived from a cited
datasheet and a stated utilization. Load time here is bytes / bandwidth: it
leaves out the engine's copy into its KV memory and the Lookup before it
(docs/benchmarks.md has both measured for the connectors)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.common import md_table


@dataclass(frozen=True)
class Geometry:
    """A model's KV cache shape (K and V per layer, per token) and what its
    prefill computes."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    #: parameters and hidden size, for a prefill's FLOPs (0: not used)
    params: float = 0.0
    hidden: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, tokens: int) -> float:
        """2 x params per token (the matrix multiplies), plus causal attention's
        QK^T and AV: 2 x 2 x hidden x tokens^2 per layer, halved by the mask."""
        return 2.0 * self.params * tokens + 2.0 * self.layers * self.hidden * tokens**2


#: Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: 128 KiB a token; 8.03e9
#: parameters, hidden 4096 (meta-llama/Meta-Llama-3-8B's config.json)
LLAMA3_8B = Geometry("Llama-3-8B", 32, 8, 128, 2, params=8.03e9, hidden=4096)
#: the random Llama benchmarks/vllm_ttft.py builds: 8 layers, hidden 1024 over 16
#: attention heads (head_dim 64), 8 KV heads, bf16: 16 KiB a token
TTFT_LLAMA = Geometry("vllm_ttft's random Llama", 8, 8, 64, 2)


@dataclass(frozen=True)
class Recompute:
    """How long the prefill of ``tokens`` tokens of ``geometry`` takes, and where
    that figure comes from."""

    what: str
    geometry: Geometry
    tokens: int
    seconds: float
    measured: bool
    source: str


def gpu_prefill(
    geometry: Geometry,
    tokens: int,
    *,
    gpu: str = "H100 SXM",
    peak_flops: float = 989.4e12,
    utilization: float = 0.5,
    source: str = "NVIDIA H100 Tensor Core GPU datasheet: 989.4 TFLOPS dense BF16 (SXM)",
) -> Recompute:
    """An assumed prefill time: the model's prefill FLOPs at ``utilization`` of the
    GPU's datasheet peak."""
    seconds = geometry.prefill_flops(tokens) / (peak_flops * utilization)
    return Recompute(
        f"{gpu} prefill at {utilization:.0%} of peak",
        geometry,
        tokens,
        seconds,
        measured=False,
        source=f"assumed: {source}; {utilization:.0%} utilization assumed",
    )


def load_seconds(geometry: Geometry, tokens: int, read_bytes_per_s: float) -> float:
    return geometry.kv_bytes_per_token * tokens / read_bytes_per_s


def hit_vs_recompute(
    tier: str, read_bytes_per_s: float, how_measured: str, recomputes: Sequence[Recompute]
) -> str:
    """A markdown table: per recompute reference, the prompt's KV bytes, the load
    from ``tier`` at the measured ``read_bytes_per_s``, the recompute, and the
    ratio, and the read bandwidth at which loading takes as long as recomputing;
    then where each figure comes from."""
    rows = []
    for r in recomputes:
        nbytes = r.geometry.kv_bytes_per_token * r.tokens
        load = load_seconds(r.geometry, r.tokens, read_bytes_per_s)
        rows.append(
            (
                f"{r.geometry.name}, {r.tokens} tokens",
                f"{nbytes / (1 << 20):.0f} MiB ({r.geometry.kv_bytes_per_token >> 10} KiB/token)",
                f"{load:.3f}",
                f"{r.seconds:.3f} ({'measured' if r.measured else 'assumed'}: {r.what})",
                f"{r.seconds / load:.2f}x",
                f"{nbytes / r.seconds / 1e9:.2f}",
            )
        )
    table = md_table(
        (
            "prompt",
            "KV bytes",
            f"load from {tier} s",
            "recompute s",
            "recompute / load",
            "break-even GB/s",
        ),
        rows,
    )
    notes = [f"- load: KV bytes / {read_bytes_per_s / 1e9:.2f} GB/s, measured: {how_measured}"]
    notes += [f"- recompute ({r.geometry.name}): {r.source}" for r in recomputes]
    return table + "\n" + "\n".join(notes)


#: vllm_ttft's recompute of 4096 tokens on this host's 2 CPU cores: the median of 5
#: reps, docs/benchmarks.md's run L (.venv-vllm/bin/python -m benchmarks.vllm_ttft
#: --lengths 2048,4096 --reps 5)
TTFT_RECOMPUTE_S = 5.187
PROMPT_TOKENS = 4096


def cross_node(tier: str, read_bytes_per_s: float, how: str) -> str:
    """Node B loads a prompt's KV that node A computed and wrote behind to ``tier``,
    vs computing it again: at the caller's measured read bandwidth."""
    recomputes = [
        gpu_prefill(LLAMA3_8B, PROMPT_TOKENS),
        Recompute(
            "vLLM on this host's 2 CPU cores",
            TTFT_LLAMA,
            PROMPT_TOKENS,
            TTFT_RECOMPUTE_S,
            measured=True,
            source="measured by benchmarks/vllm_ttft.py, not in this run: docs/benchmarks.md, "
            "run L (TTFT without a connector, median of 5 reps)",
        ),
    ]
    return hit_vs_recompute(tier, read_bytes_per_s, how, recomputes)
