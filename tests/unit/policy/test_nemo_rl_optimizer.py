"""`policy.optimizer` and `policy.scheduler` in NeMo RL's shape: any torch optimizer by name
with its kwargs, torch's schedulers chained as NeMo RL chains them, NeMo RL's defaults, and
one line for every shape that is not NeMo RL's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sft_runtime.runtime.errors import UserInputError
from sft_runtime.runtime.policy.config import ModelConfig, PolicyConfig, parse_section
from sft_runtime.runtime.policy.schedule import LrSchedule, check_optimizer
from tests.support import sources
from tests.support.policy_steps import nemo_rl_optimizer, reference_losses

LIN = "torch.optim.lr_scheduler.LinearLR"
COS = "torch.optim.lr_scheduler.CosineAnnealingLR"
SCHEDULES = {
    "none": None,
    "warmup then cosine": [
        {"name": LIN, "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 5}},
        {"name": COS, "kwargs": {"T_max": 20, "eta_min": 1e-5}},
        {"milestones": [6]},
    ],
    "one mapping": {"name": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 3}},
    "three chained": [
        {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 0.5}},
        {"name": "torch.optim.lr_scheduler.ExponentialLR", "kwargs": {"gamma": 0.9}},
        {"name": LIN, "kwargs": {"start_factor": 1.0, "end_factor": 0.1, "total_iters": 8}},
        {"milestones": [4, 11]},
    ],
    "a list of one": [{"name": "torch.optim.lr_scheduler.PolynomialLR", "kwargs": {"power": 2}}],
}


def _policy(**policy) -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        dtensor_cfg={"enabled": False},
        model=ModelConfig(
            vocab_size=sources.VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=sources.SEQ_LEN
        ),
        train_global_batch_size=sources.ROWS_PER_RANK,
        train_micro_batch_size=2,
        **policy,
    )


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_rate_is_the_one_torchs_live_scheduler_gives(name):
    """The rates of a NeMo RL loop (the scheduler stepped after each optimizer step), and a
    schedule asked first at step k (a resume) gives the same rate as one that counted up."""
    policy = _policy(optimizer={"kwargs": {"lr": 2e-3}}, scheduler=SCHEDULES[name])
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer, live = nemo_rl_optimizer([param], policy)
    ours, expected = LrSchedule(policy.optimizer.lr, policy.scheduler), []
    for _ in range(30):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        live.step()
    assert [ours.at(step) for step in range(30)] == expected
    assert LrSchedule(policy.optimizer.lr, policy.scheduler).at(17) == expected[17]
    if name != "none":
        assert len(set(expected)) > 3  # the schedule moved the rate


def test_the_defaults_are_nemo_rls_sft_yaml():
    """NeMo RL's examples/configs/sft.yaml: AdamW, lr 5e-6, weight decay 0.1, betas
    [0.9, 0.98], eps 1e-5, foreach and fused off; no scheduler, a constant rate."""
    policy = PolicyConfig()
    assert policy.optimizer.name == "torch.optim.AdamW"
    assert policy.optimizer.kwargs == {
        "lr": 5e-6,
        "weight_decay": 0.1,
        "betas": [0.9, 0.98],
        "eps": 1e-5,
        "foreach": False,
        "fused": False,
    }
    assert policy.scheduler is None
    # a kwarg left out keeps NeMo RL's value; another optimizer gets only what is given
    given = PolicyConfig(optimizer={"kwargs": {"lr": 2e-5, "eps": 1e-8}}).optimizer.kwargs
    assert given == {**PolicyConfig().optimizer.kwargs, "lr": 2e-5, "eps": 1e-8}
    sgd = PolicyConfig(optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}})
    assert sgd.optimizer.kwargs == {"lr": 0.1}


def test_a_named_optimizer_and_schedule_train_as_nemo_rls_loop():
    """SGD with momentum and a StepLR, through the runtime's replica, against the plain loop
    built from the same config (a live optimizer and scheduler): the same losses and
    weights bit for bit; and AdamW's would differ, so the name was honoured."""
    from sft_runtime.runtime.policy.replica import Replica

    steps = 5
    policy = _policy(
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
        scheduler={"name": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 2}},
        max_grad_norm=1.0,
    )
    replica = Replica(policy, seed=0, device=torch.device("cpu"))
    assert type(replica.optimizer) is torch.optim.SGD
    assert replica.optimizer.param_groups[0]["momentum"] == 0.9
    losses, rates = [], []
    for i in range(steps):
        batch = sources.global_batch(
            sources.SEED,
            1,
            i,
            rows=sources.ROWS_PER_RANK,
            seq_len=sources.SEQ_LEN,
            vocab_size=sources.VOCAB,
        )
        replica.begin(None, lambda batch=batch: batch)
        replica.train(batch)
        out = replica.finish()
        losses.append(out.loss)
        rates.append(out.lr)
    expected, weights = reference_losses(policy, steps, world=1)
    assert losses == pytest.approx(expected, rel=1e-6, abs=0)
    assert rates == pytest.approx([0.5, 0.5, 0.05, 0.05, 0.005], rel=1e-12)
    mine = replica.files.weights()
    assert all(torch.allclose(mine[k], v, rtol=1e-5, atol=1e-7) for k, v in weights.items())
    adamw, _ = reference_losses(_policy(optimizer={"kwargs": {"lr": 0.5}}), steps, world=1)
    assert adamw[1:] != pytest.approx(expected[1:], rel=1e-3)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"optimizer": {"lr": 1e-3}}, "policy.optimizer.lr: NeMo RL's name is "),
        ({"optimizer": {"betas": [0.9, 0.9]}}, "policy.optimizer.kwargs.betas"),
        ({"optimizer": {"name": "torch.optim.Nope"}}, "names no class that can be imported"),
        ({"optimizer": {"name": "torch.nn.Linear"}}, "is not a torch.optim.Optimizer"),
        (
            {"optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.1, "betas": [0.9, 1]}}},
            "unexpected keyword argument 'betas'",
        ),
        ({"optimizer": {"kwargs": {"lr": -1.0}}}, "policy.optimizer.kwargs.lr: must be a positive"),
        ({"optimizer": {"name": "torch.optim.SGD", "kwargs": {}}}, "kwargs.lr: must be a posit"),
        ({"optimizer": {"kwargs": {"lr": float("nan")}}}, "kwargs.lr: Input should be a finite"),
        ({"scheduler": {"kind": "cosine"}}, "policy.scheduler.kind is not NeMo RL's shape"),
        (
            {"scheduler": [{"name": LIN}, {"name": COS, "kwargs": {"T_max": 5}}]},
            "chains 2 schedulers: add a {milestones: [...]} entry with 1 step(s)",
        ),
        (
            {"scheduler": [{"name": LIN}, {"milestones": [2]}, {"milestones": [3]}]},
            "one milestones entry, not several",
        ),
        ({"scheduler": [{"name": LIN, "warmup": 3}]}, "policy.scheduler[0] takes name and kwargs"),
        ({"scheduler": [{"name": COS, "kwargs": {"T_max": 5, "nope": 1}}]}, "cannot be built"),
        (
            {"scheduler": {"name": "torch.optim.lr_scheduler.OneCycleLR", "kwargs": {}}},
            "the schedule sets the learning rate only; set kwargs.cycle_momentum: false",
        ),
        ({"scheduler": {"name": "torch.optim.SGD"}}, "is not a torch.optim.lr_scheduler"),
    ],
)
def test_what_is_not_nemo_rls_shape_is_one_line_naming_the_key(policy, message):
    with pytest.raises(UserInputError) as info:
        parse_section(PolicyConfig, policy, "policy")
    assert message in str(info.value), str(info.value)


def test_a_good_optimizer_is_checked_without_torchs_compiler():
    # a parameter group imports torch._dynamo (about 1 s); the check of plain numbers does not
    # need one, and still refuses what the worker's build would refuse
    code = (
        "import sys\n"
        "from sft_runtime.runtime.policy.schedule import check_optimizer\n"
        "check_optimizer('torch.optim.AdamW', {'lr': 1e-3, 'betas': [0.9, 0.98]})\n"
        "check_optimizer('torch.optim.SGD', {'lr': 0.1, 'momentum': 0.9})\n"
        "from sft_runtime.runtime.policy.config import NEMO_RL_ADAMW\n"
        "check_optimizer('torch.optim.AdamW', NEMO_RL_ADAMW)  # foreach, fused: false\n"
        "print('torch._dynamo' in sys.modules)\n"
        "try:\n"
        "    check_optimizer('torch.optim.AdamW', {'lr': 1e-3, 'eps': -1.0})\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    dynamo, refusal = out.stdout.splitlines()
    assert dynamo == "False"
    assert refusal.startswith("torch.optim.AdamW(lr=0.001, eps=-1.0) cannot be built: Invalid eps")


def test_a_flag_torch_checks_late_is_still_refused_before_ray():
    with pytest.raises(ValueError, match="`fused` and `foreach` cannot be `True` together"):
        check_optimizer("torch.optim.AdamW", {"lr": 1e-3, "fused": True, "foreach": True})
    with pytest.raises(ValueError, match="`fused` and `foreach` cannot be `True` together"):
        check_optimizer("torch.optim.AdamW", {"lr": 1e-3, "fused": 1, "foreach": "yes"})
