"""NeMo RL's optimizer and learning-rate schedule: torch classes named in the config.

``policy.optimizer`` names any `torch.optim.Optimizer` by its dotted path with its keyword
arguments; ``policy.scheduler`` names `torch.optim.lr_scheduler` classes, one (a mapping)
or a list chained by a ``milestones`` entry into a `SequentialLR`, as NeMo RL builds them.
No scheduler is a constant rate.

The rates are torch's own: `LrSchedule` drives the configured schedulers over a stand-in
optimizer, one ``step()`` per optimizer step as NeMo RL's loop calls it, and the replica
sets the rate of step N on its real optimizer before the update. So the schedule's whole
checkpointed state is the step count (saved next to the optimizer state), and a resumed run,
which drives the stand-in from step 0 to where it stands, uses bitwise the rates of an
uninterrupted one. A schedule acts on the learning rate only: a scheduler asked to cycle
momentum is refused by the config.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

SchedulerSpec = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


def torch_class(name: str, base: type, what: str) -> type:
    """The class a dotted name names, which must subclass ``base``; ValueError otherwise."""
    module, _, attr = name.rpartition(".")
    if not module:
        raise ValueError(f"{name!r} is not a dotted class name (e.g. torch.optim.AdamW)")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        raise ValueError(f"{name!r} names no class that can be imported") from None
    if not isinstance(found, type) or not issubclass(found, base):
        raise ValueError(f"{name!r} is not a {what}")
    return found


def build_optimizer(
    params: Iterable[torch.nn.Parameter], name: str, kwargs: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """The configured optimizer over ``params``."""
    return torch_class(name, torch.optim.Optimizer, "torch.optim.Optimizer")(params, **kwargs)


def _build_schedule(optimizer: torch.optim.Optimizer, spec: SchedulerSpec) -> Any:
    """NeMo RL's construction: a mapping is one scheduler; a list holds schedulers and one
    ``milestones`` entry, chained by `SequentialLR` (a list of one needs no milestones)."""
    base = torch.optim.lr_scheduler.LRScheduler
    kind = "torch.optim.lr_scheduler.LRScheduler"

    def one(entry: Mapping[str, Any]) -> Any:
        return torch_class(entry["name"], base, kind)(optimizer, **(entry.get("kwargs") or {}))

    if spec is None:
        return None
    if isinstance(spec, Mapping):
        return one(spec)
    schedulers = [one(entry) for entry in spec if "name" in entry]
    milestones = [list(entry["milestones"]) for entry in spec if "milestones" in entry]
    if len(schedulers) == 1 and not milestones:
        return schedulers[0]
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones[0])


class LrSchedule:
    """The rate each optimizer step uses, as the configured torch schedulers give it."""

    def __init__(self, base_lr: float, spec: SchedulerSpec) -> None:
        self._param = torch.nn.Parameter(torch.zeros(1))
        self._optimizer = torch.optim.SGD([self._param], lr=base_lr)
        with warnings.catch_warnings():
            # SequentialLR's and the schedulers' own notes about their first step
            warnings.simplefilter("ignore", UserWarning)
            self._scheduler = _build_schedule(self._optimizer, spec)
        self._rates = [self._rate()]

    def _rate(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def at(self, step: int) -> float:
        """The rate of optimizer step ``step`` (0-based): the rate after ``step`` scheduler
        steps, since NeMo RL steps the scheduler after each optimizer step."""
        while len(self._rates) <= step:
            if self._scheduler is not None:
                self._optimizer.step()  # no gradient: nothing moves; torch wants it first
                self._scheduler.step()
            self._rates.append(self._rate())
        return self._rates[step]


# torch's optimizers check their numbers before `Optimizer.__init__` and these flags after it
LATE_CHECKED_FLAGS = ("fused", "foreach", "capturable", "differentiable")
_NO_PARAMETERS = "optimizer got an empty parameter list"


def check_optimizer(name: str, kwargs: Mapping[str, Any]) -> None:
    """Build the optimizer: a bad name or argument is a ValueError now, before any worker
    starts.

    Built over no parameter at all, the optimizer checks its arguments and stops at the base
    class's refusal of an empty list. That keeps the driver from importing torch's compiler,
    which a parameter group pulls in (about 1 s on a 2-core machine, at every launch). Only
    a flag torch checks once the group is added, turned on, costs a build over a stand-in
    parameter: turned off (NeMo RL's ``foreach: false, fused: false``) it refuses nothing.
    """
    late = any(kwargs.get(flag) for flag in LATE_CHECKED_FLAGS)
    params = [torch.nn.Parameter(torch.zeros(1))] if late else []
    try:
        build_optimizer(params, name, kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        if not params and isinstance(exc, ValueError) and str(exc) == _NO_PARAMETERS:
            return
        raise ValueError(f"{name}({_shown(kwargs)}) cannot be built: {exc}") from None


def check_schedule(base_lr: float, spec: SchedulerSpec) -> None:
    """Build the schedule and take its first steps: a bad name, argument or milestone list
    is a ValueError now."""
    try:
        LrSchedule(base_lr, spec).at(2)
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as exc:
        raise ValueError(f"the schedule cannot be built: {exc}") from None


def _shown(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
