"""The 70B plan: Llama-3.1-70B on 8 nodes x 8 GPUs through this runtime's FSDP2 path.

A calculator, not a benchmark: every figure follows from the model's config, the way this
runtime loads, steps, saves and logs (see docs/scale.md), and the options below. It imports
no torch, so the plan can be redone on any laptop when an assumption changes. Each printed
row says what it is computed from. Counts and bytes are exact; the memory of a step and of
the export, and every time, are estimates from the stated formulas and options. Memory is in
GiB (2**30 bytes), disk and bandwidth in GB (10**9).

    .venv/bin/python bench/scale_plan.py [--json] [--log RUN_DIR/events.jsonl] ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GIB, GB = 2**30, 10**9
F32, BF16 = 4, 2
DTYPE_BYTES = {"float32": F32, "bfloat16": BF16}


@dataclass(frozen=True)
class LlamaShape:
    """The config.json fields a Llama decoder's size depends on (names as transformers')."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False


# meta-llama/Llama-3.1-70B config.json; stored as bfloat16 in 30 safetensors shards on the hub
LLAMA_31_70B = LlamaShape(8192, 28672, 80, 64, 8, 128256, 128)
HUB_SHARDS = 30

# measured: `sft-runtime demo --run-dir /tmp/scale_demo/run` (150 steps, 2 DP ranks, telemetry
# on), then `bench/scale_plan.py --log /tmp/scale_demo/run/events.jsonl` (docs/scale.md)
DEMO_LOG = {"steps": 150, "total_bytes": 138978, "digests": 300, "digest_bytes": 10500}


def tensors(c: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter, by its checkpoint name, in state-dict order: the count, the row
    slices each rank reads and the export's shards all come from this one list."""
    h, i, q = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim  # GQA: k and v have fewer heads than q
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab_size, h))]
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        attn = [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)]
        for name, rows, cols in attn:
            out.append((f"{p}self_attn.{name}.weight", (rows, cols)))
            if c.attention_bias:
                out.append((f"{p}self_attn.{name}.bias", (rows,)))
        for name, rows, cols in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]:
            out.append((f"{p}mlp.{name}.weight", (rows, cols)))
            if c.mlp_bias:
                out.append((f"{p}mlp.{name}.bias", (rows,)))
        out += [(f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", (c.vocab_size, h)))
    return out


def parameter_count(c: LlamaShape) -> int:
    return sum(math.prod(s) for _, s in tensors(c))


def layer_parameters(c: LlamaShape) -> int:
    """One decoder layer: the unit FSDP2 all-gathers and reduce-scatters at a time."""
    return sum(math.prod(s) for n, s in tensors(c) if n.startswith("model.layers.0."))


def local_elements(c: LlamaShape, world: int) -> int:
    """Rank 0's share under Shard(0): ceil(rows / world) rows of every tensor (FSDP2 pads the
    other ranks' shards to this size, so it is every rank's allocation)."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) for _, s in tensors(c))


def shard_count(c: LlamaShape, dtype_bytes: int, max_bytes: float) -> int:
    """Files of the export: tensors in order, a new file when the next would pass the limit
    (the rule of `policy_files.weight_shards`)."""
    files, size = 1, 0
    for _, s in tensors(c):
        nbytes = math.prod(s) * dtype_bytes
        if size and size + nbytes > max_bytes:
            files, size = files + 1, 0
        size += nbytes
    return files


def activation_bytes_per_token_layer(c: LlamaShape) -> int:
    """What autograd keeps per token of one decoder layer in bf16 compute with flash/SDPA
    attention (no T x T scores: packed rows attend one sample at a time). Two RMSNorms, each
    its float32 upcast input (4h) and bf16 output (2h); q, k, v, the attention output and the
    o_proj input (3h + 2kv, bf16) plus the kernel's float32 logsumexp per head; the MLP's
    gate, up, silu(gate) and their product (4i, bf16). Estimate: no allocator slack."""
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * c.head_dim
    return 12 * h + BF16 * (3 * h + 2 * kv) + F32 * c.num_attention_heads + BF16 * 4 * i


@dataclass(frozen=True)
class LogSize:
    """An event log's bytes and its step records' sample digests (one per logical rank)."""

    steps: int
    total_bytes: int
    digests: int
    digest_bytes: int

    def per_step(self) -> float:
        """All records (checkpoints, run start and stop included) over the steps."""
        return self.total_bytes / self.steps

    def per_step_at(self, ranks: int) -> float:
        """A step's bytes with one digest per rank instead of the measured run's count."""
        return self.per_step() + (ranks - self.digests / self.steps) * (
            self.digest_bytes / self.digests
        )


def measure_log(path: Path) -> LogSize:
    """Mean bytes per step of a real ``events.jsonl``; each digest costs its JSON string
    and a comma, which is what a wider run adds to every step_committed line."""
    total = steps = digests = digest_bytes = 0
    for line in path.read_bytes().splitlines(keepends=True):
        total += len(line)
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("type") == "step_committed":
            steps += 1
            found = record.get("data", {}).get("sample_digests", [])
            digests += len(found)
            digest_bytes += sum(len(json.dumps(d)) + 1 for d in found)
    if not steps or not digests:
        raise ValueError(f"{path}: no step_committed record with sample digests")
    return LogSize(steps, total, digests, digest_bytes)


Row = dict[str, object]
IO = "node's bytes / --disk-gbps (total / --pfs-gbps if slower)"


def row(key: str, label: str, value: float, unit: str, source: str) -> Row:
    return {"key": key, "figure": label, "value": value, "unit": unit, "from": source}


@dataclass(frozen=True)
class Sizes:
    """The counts every section shares, for one model over one mesh."""

    c: LlamaShape
    world: int
    node: int  # ranks per node
    n: int  # parameters
    local: int  # elements of one rank's shard
    layer: int  # parameters of one decoder layer
    root: int  # embeddings, final norm and lm_head: the root's FSDP unit
    head: int  # lm_head: its gradient is the first of the backward pass


def sizes(c: LlamaShape, world: int, node: int) -> Sizes:
    n, layer = parameter_count(c), layer_parameters(c)
    root = n - layer * c.num_hidden_layers
    local = local_elements(c, world)
    return Sizes(c, world, node, n, local, layer, root, c.vocab_size * c.hidden_size)


def parameters(z: Sizes) -> list[Row]:
    c = z.c
    return [
        row("total", "parameters", z.n, "params", "embed + L x layer + norm + lm_head"),
        row("layer", "one decoder layer", z.layer, "params", "q,k,v,o (GQA) + 3 h x i + 2h"),
        row("root", "embed + final norm + lm_head", z.root, "params", "the root FSDP unit"),
        row("hub_gb", "checkpoint in bf16", z.n * BF16 / GB, "GB", "2 B x params"),
        row("hub_files", "its files at 5 GB (10^9)", shard_count(c, BF16, 5e9), "files",
            f"greedy in tensor order; hub has {HUB_SHARDS}"),
    ]  # fmt: skip


def load(z: Sizes, io_s: Callable[[float, float], float]) -> list[Row]:
    whole = z.n * F32
    largest = max(math.ceil(s[0] / z.world) * math.prod(s[1:]) for _, s in tensors(z.c))
    slice_ = largest * (BF16 + F32)  # the largest row slice: bf16 as read + its float32 cast
    sharded = z.local * F32 + slice_
    read = z.node * z.local * BF16
    return [
        row("whole_per_rank", "old: from_pretrained f32, rank", whole / GIB, "GiB", "4 B x params"),
        row("whole_per_node", "old: host per node", whole * z.node / GIB, "GiB", "x ranks/node"),
        row("share_per_rank", "sharded: own f32 shard", z.local * F32 / GIB, "GiB",
            f"ceil(rows/{z.world}) rows, every tensor"),
        row("slice_per_rank", "sharded: slice in flight", slice_ / GIB, "GiB",
            "largest row slice, bf16 + f32"),
        row("sharded_per_rank", "sharded: peak per rank", sharded / GIB, "GiB",
            "shard (on the GPU if any) + slice"),
        row("host_per_node", "sharded: host per node (GPU)", z.node * slice_ / GIB, "GiB",
            "slices only"),
        row("ratio", "old / sharded per rank", whole / sharded, "x", f"~ {z.world} ranks"),
        row("read_gb", "read per node", read / GB, "GB", "own bf16 row slices x ranks/node"),
        row("read_s", "read time", io_s(read, z.n * BF16), "s", IO),
    ]  # fmt: skip


def step(z: Sizes, tokens: list[int], reduce_bytes: int, device_gib: float) -> list[Row]:
    """Three moments of a step compete for the peak: the end of the forward pass (every
    stored activation, the logits, the last layer kept gathered for the backward pass), a
    decoder layer's backward, and the root's reduce-scatter of its 2 x vocab x h grads."""
    c, layer = z.c, z.layer
    state = 4 * z.local * F32  # float32 master weights, gradients, exp_avg, exp_avg_sq
    gathered = 2 * layer * BF16  # the layer running and the one prefetched
    layer_grad = layer * (BF16 + reduce_bytes)  # its bf16 grads + reduce-scatter input
    root = z.root * BF16
    act = activation_bytes_per_token_layer(c)
    rows = [
        row("state", "f32 params+grads+AdamW", state / GIB, "GiB", f"16 B x params / {z.world}"),
        row("layers", "2 layers gathered, bf16", gathered / GIB, "GiB", "running + prefetched"),
        row("root", "root unit gathered, bf16", root / GIB, "GiB", "kept all forward+backward"),
        row("layer_grad", "1 layer's grads in flight", layer_grad / GIB, "GiB",
            "bf16 + reduce-scatter input"),
        row("act_token_layer", "activations/token/layer", act, "B",
            "12h + 2(3h+2kv) + 4 heads + 8i"),
    ]  # fmt: skip
    for t in tokens:
        logits = 14 * t * c.vocab_size  # bf16 logits 2, f32 log-softmax 4, grads 4 + 4
        rows.append(row(f"logits_{t}", f"T={t}: logits working set", logits / GIB, "GiB",
                        "14 B x T x vocab (f32 loss)"))  # fmt: skip
        for ckpt in (False, True):
            stored = (2 * c.hidden_size if ckpt else act) * t * c.num_hidden_layers
            working = act * t * (2 if ckpt else 1)  # recomputed layer and/or its act grads
            fwd_end = state + root + layer * BF16 + stored + 6 * c.hidden_size * t + logits
            layer_bwd = state + root + z.head * BF16 + gathered + layer_grad + stored + working
            root_bwd = state + z.root * (2 * BF16 + reduce_bytes)
            moments = {"fwd end": fwd_end, "layer bwd": layer_bwd, "root bwd": root_bwd}
            where, peak = max(moments.items(), key=lambda kv: kv[1])
            tag = f"{t}_{'ckpt' if ckpt else 'full'}"
            how = "recompute" if ckpt else "no recompute"
            formula = "2h x T x L + 1 layer redone + grads" if ckpt else "act x T x L + grads"
            rows += [
                row(f"act_{tag}", f"T={t}, {how}: activations", (stored + working) / GIB,
                    "GiB", formula),
                row(f"peak_{tag}", f"T={t}, {how}: peak", peak / GIB, "GiB",
                    f"at {where}; fits {device_gib:g} GiB: {peak <= device_gib * GIB}"),
            ]  # fmt: skip
    return rows


def save(z: Sizes, io_s: Callable[[float, float], float], a: argparse.Namespace) -> list[Row]:
    per_rank = 3 * z.local * F32  # DCP: float32 weights + the two AdamW moments
    export = z.n * BF16
    limit = a.max_shard_gb * GB  # `sft-runtime export --max-shard-size`, 5GB by default
    # a shard's tensors are read in float32 and then cast: 2 + 1 times its bf16 bytes
    held = max(limit, max(math.prod(s) for _, s in tensors(z.c)) * BF16) * (F32 + BF16) / BF16
    return [
        row("ckpt_gb", "DCP checkpoint, total", per_rank * z.world / GB, "GB",
            "4 B weights + 8 B AdamW / param"),
        row("ckpt_rank_gb", "DCP checkpoint per rank", per_rank / GB, "GB", "12 B x own shard"),
        row("save_s", "save time", io_s(per_rank * z.node, per_rank * z.world), "s", IO),
        row("export_gb", "export, bf16 safetensors", export / GB, "GB", "2 B x params"),
        row("export_files", f"export files <= {a.max_shard_gb:g} GB",
            shard_count(z.c, BF16, limit), "files", "greedy in tensor order"),
        row("export_peak", "export host peak", held / GIB, "GiB",
            "a shard read in f32 + its bf16 cast"),
        row("export_s", "export time, one process", (z.n * F32 + export) / (a.disk_gbps * GB),
            "s", "read 4 B + write 2 B / param"),
    ]  # fmt: skip


def log(z: Sizes, measured: LogSize, source: str, steps: int) -> list[Row]:
    at = measured.per_step_at(z.world)
    return [
        row("measured", f"bytes/step, {measured.digests // measured.steps} ranks",
            measured.per_step(), "B", source),
        row("digest", "bytes per sample digest", measured.digest_bytes / measured.digests, "B",
            "measured: JSON string + comma"),
        row("per_step", f"bytes/step, {z.world} ranks", at, "B", "+ one digest per rank"),
        row("total_mb", f"log after {steps:,} steps", at * steps / 1e6, "MB", "bytes/step x steps"),
    ]  # fmt: skip


def controller(z: Sizes, a: argparse.Namespace) -> list[Row]:
    tokens = a.tokens[0] * a.rows_per_rank
    step_s = 8 * z.n * tokens / (a.peak_tflops * 1e12 * a.mfu)  # 6N train + 2N recompute
    return [
        row("calls", "actor calls per step", 2 * z.world, "calls", "start + finish per worker"),
        row("step_s", f"step, {tokens} tokens/rank", step_s, "s",
            f"8N x tokens / ({a.peak_tflops:g} TFLOP/s x {a.mfu:g})"),
        row("share", f"controller at {a.round_trip_ms:g} ms", a.round_trip_ms / 1e3 / step_s,
            "of step", "--round-trip-ms (assumed)"),
    ]  # fmt: skip


def plan(a: argparse.Namespace, c: LlamaShape = LLAMA_31_70B) -> dict[str, list[Row]]:
    z = sizes(c, a.ranks, a.ranks_per_node)

    def io_s(per_node: float, total: float) -> float:
        """A node's bytes at its bandwidth, or the storage's limit when that is slower."""
        t = per_node / (a.disk_gbps * GB)
        return max(t, total / (a.pfs_gbps * GB)) if a.pfs_gbps else t

    measured = measure_log(a.log) if a.log else LogSize(**DEMO_LOG)
    return {
        "parameters": parameters(z),
        "load": load(z, io_s),
        "step": step(z, a.tokens, DTYPE_BYTES[a.reduce_dtype], a.device_gib),
        "save": save(z, io_s, a),
        "log": log(z, measured, str(a.log or "demo run (embedded)"), a.steps),
        "controller": controller(z, a),
    }


def fmt(x: float) -> str:
    if x != 0 and abs(x) < 0.1:
        return f"{x:.4f}"
    return f"{x:,.0f}" if abs(x) >= 1000 or x == int(x) else f"{x:,.2f}"


def render(sections: dict[str, list[Row]]) -> str:
    head = ("figure", "value", "unit", "computed from")
    lines = []
    for name, rows in sections.items():
        cells = [head] + [
            (str(r["figure"]), fmt(float(r["value"])), str(r["unit"]), str(r["from"]))  # type: ignore[arg-type]
            for r in rows
        ]
        widths = [max(len(cell[k]) for cell in cells) for k in range(len(head))]
        lines.append(f"== {name}")
        for k, cell in enumerate(cells):
            lines.append(" | ".join(x.ljust(w) for x, w in zip(cell, widths, strict=True)).rstrip())
            if k == 0:
                lines.append("-+-".join("-" * w for w in widths))
        lines.append("")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The 70B plan, computed (see docs/scale.md).")
    p.add_argument("--json", action="store_true", help="the plan as JSON, keyed by section")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--device-gib", type=float, default=79.6, help="H100 80GB: 85.5e9 B")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192], help="per row")
    p.add_argument("--rows-per-rank", type=int, default=1, help="rows a rank trains a step")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPE_BYTES), default="float32")
    p.add_argument("--disk-gbps", type=float, default=2.0, help="GB/s a node's ranks share")
    p.add_argument("--pfs-gbps", type=float, default=None, help="aggregate GB/s of storage")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="export's --max-shard-size")
    p.add_argument("--log", type=Path, default=None, help="a run's events.jsonl to measure")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--round-trip-ms", type=float, default=100.0, help="controller, per step")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense, H100 SXM")
    p.add_argument("--mfu", type=float, default=0.4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sections = plan(args)
    if args.json:
        print(json.dumps({k: {r["key"]: r for r in v} for k, v in sections.items()}, indent=1))
    else:
        print(render(sections), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
