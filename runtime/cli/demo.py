"""The demo: a synthetic chat data set, a small model, two DP workers, about a minute.

The config is `demo_config` (mirrored by examples/demo.yaml); completions before and after
training are greedy decodes of the same prompts from the initial and the final weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sft_runtime.runtime.config import MasterConfig, validate_config

DEMO_PROMPTS = ("What is 12 + 30?", "Echo: alpha beta gamma", "Multiply 7 by 6.")


# both demos: two CPU workers of one core each (NeMo RL's gpus_per_node would ask for GPUs)
DEMO_CLUSTER = {
    "gpus_per_node": 0,
    "workers_per_node": 2,
    "cpus_per_worker": 1.0,
    "num_threads_per_worker": 1,
}


def demo_config(run_dir: Path | str, data_dir: Path | str, steps: int = 150) -> MasterConfig:
    raw: dict[str, Any] = {
        "policy": {
            "model": {
                "vocab_size": 264,
                "d_model": 64,
                "n_layers": 2,
                "n_heads": 4,
                "max_seq_len": 128,
            },
            "train_global_batch_size": 16,
            "train_micro_batch_size": 8,
            "max_grad_norm": 1.0,
            "optimizer": {
                "kwargs": {"lr": 3e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
            },
            "scheduler": [  # a warmup over 5 steps, then constant
                {
                    "name": "torch.optim.lr_scheduler.LinearLR",
                    "kwargs": {"start_factor": 0.2, "end_factor": 1.0, "total_iters": 4},
                }
            ],
            "make_sequence_length_divisible_by": 8,
            "precision": "float32",  # a toy on CPU: whole replicas, full precision
            "dtensor_cfg": {"enabled": False},
        },
        "data": {
            "max_input_seq_length": 128,
            # the synthetic chats are long on purpose: train on what fits of each
            "overlong_samples": "truncate",
            "train": {"path": str(data_dir), "virtual_epoch_length": 64},
            "num_workers": 0,
            "add_bos": False,  # the byte layout opens every row with BOS already
            "add_generation_prompt": True,  # the assistant header is context
            "energon": {"shuffle_buffer_size": None},
        },
        "sft": {"max_num_steps": steps, "max_num_epochs": 10, "seed": 42},
        "logger": {"log_dir": str(run_dir), "monitor_gpus": False},
        "cluster": dict(DEMO_CLUSTER),
        "checkpointing": {"enabled": True, "save_period": 25, "metric_name": "train:loss"},
        "telemetry": {"enabled": True, "exporters": ["jaeger_file"]},
    }
    return validate_config(raw, source="demo config")


def greedy_completions(
    config: MasterConfig, weights_dir: Path | None, max_new: int = 24
) -> list[str]:
    """Decode `DEMO_PROMPTS` with the initial weights (None) or a checkpoint's weights."""
    import torch

    from sft_runtime.runtime.checkpoint import policy_files as ckpt
    from sft_runtime.runtime.data.tokenizer import build_tokenizer
    from sft_runtime.runtime.policy.model import build_model

    tok = build_tokenizer(config.policy.tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(config.sft.seed)
        model = build_model(config.policy.model)
    if weights_dir is not None:
        model.load_state_dict(ckpt.load_weights(str(weights_dir)))
    model.eval()
    outputs = []
    for prompt in DEMO_PROMPTS:
        ids = tok.encode_prompt([{"role": "user", "content": prompt}])
        start = len(ids)
        with torch.no_grad():
            for _ in range(max_new):
                x = torch.tensor([ids])
                pos = torch.arange(len(ids)).unsqueeze(0)
                logits = model(x, pos, torch.zeros_like(x))
                nxt = int(logits[0, -1].argmax())
                if nxt == tok.eos_id or len(ids) >= config.policy.model.max_seq_len:
                    break
                ids.append(nxt)
        outputs.append(tok.decode(ids[start:]))
    return outputs
