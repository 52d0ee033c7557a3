"""`diff_runs`: where two runs part ways, step by step, from their logs alone.

Each step's record holds its loss, grad norm and per-rank sample digests, so two runs can be
compared without their checkpoints or a GPU: did step N train on the same samples, and did it
reach the same loss? The first step where the samples differ says the data path changed (a
seed, the packing, the tokenizer); the first where only the loss differs says the model,
optimizer or numerics did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sft_runtime.events.lineage import LogLike, records_in_effect
from sft_runtime.events.schemas import as_float


def same(a: float | None, b: float | None) -> bool:
    """Equal as stored: two NaNs (a step that diverged the same way in both runs) agree."""
    return a == b or (a is not None and b is not None and a != a and b != b)


@dataclass(frozen=True, eq=False)
class StepFacts:
    loss: float
    grad_norm: float
    digests: tuple[str, ...]
    lr: float | None = None  # the rate the step's update used: a changed schedule shows here first

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepFacts):
            return NotImplemented
        return self.digests == other.digests and all(
            same(getattr(self, name), getattr(other, name)) for name in ("loss", "grad_norm", "lr")
        )

    __hash__ = None  # type: ignore[assignment]  # compared, never hashed


@dataclass(frozen=True)
class StepDiff:
    step: int
    a: StepFacts | None  # None: the step is not in run A (yet)
    b: StepFacts | None

    @property
    def samples_agree(self) -> bool | None:
        return None if self.a is None or self.b is None else self.a.digests == self.b.digests

    @property
    def loss_delta(self) -> float | None:
        if self.a is None or self.b is None:
            return None
        return 0.0 if same(self.a.loss, self.b.loss) else self.b.loss - self.a.loss

    @property
    def differing_ranks(self) -> tuple[int, ...]:
        """The logical ranks whose sample digests differ (both runs must have the step)."""
        if self.a is None or self.b is None:
            return ()
        a, b = self.a.digests, self.b.digests
        return tuple(i for i in range(max(len(a), len(b))) if a[i : i + 1] != b[i : i + 1])

    def differences(self) -> list[tuple[str, Any, Any]]:
        """(what, value in A, value in B) for each fact of the step that is not bitwise equal;
        a step one run lacks is the single difference ``("step", present?, present?)``."""
        if self.a is None or self.b is None:
            return [] if self.a == self.b else [("step", self.a is not None, self.b is not None)]
        out: list[tuple[str, Any, Any]] = []
        if self.differing_ranks:
            out.append(("samples", self.a.digests, self.b.digests))
        for name in ("loss", "grad_norm", "lr"):
            a, b = getattr(self.a, name), getattr(self.b, name)
            if not same(a, b):
                out.append((name, a, b))
        return out


@dataclass
class RunDiff:
    steps: list[StepDiff] = field(default_factory=list)

    @property
    def common(self) -> list[StepDiff]:
        return [s for s in self.steps if s.a is not None and s.b is not None]

    @property
    def first_sample_difference(self) -> StepDiff | None:
        return next((s for s in self.common if not s.samples_agree), None)

    @property
    def first_loss_difference(self) -> StepDiff | None:
        return next((s for s in self.common if s.loss_delta != 0.0), None)

    @property
    def first_difference(self) -> StepDiff | None:
        """The first step where anything differs (samples, loss, grad norm, lr, presence)."""
        return next((s for s in self.steps if s.a != s.b), None)

    @property
    def identical(self) -> bool:
        """The same steps, the same samples and bitwise the same losses, grad norms and lrs."""
        return all(s.a == s.b for s in self.steps)


def step_facts(log: LogLike) -> dict[int, StepFacts]:
    """The committed steps in effect (the last execution of a step that was re-run)."""
    return {
        r.data["step"]: StepFacts(
            as_float(r.data["loss"]),
            as_float(r.data["grad_norm"]),
            tuple(r.data["sample_digests"]),
            None if "lr" not in r.data else as_float(r.data["lr"]),
        )
        for r in records_in_effect(log)
        if r.type == "step_committed"
    }


def diff_runs(a: LogLike, b: LogLike, *, steps: Iterable[int] | None = None) -> RunDiff:
    """Every step either run committed, or only ``steps`` (a re-execution's range)."""
    facts_a, facts_b = step_facts(a), step_facts(b)
    chosen = sorted(set(facts_a) | set(facts_b) if steps is None else set(steps))
    return RunDiff([StepDiff(n, facts_a.get(n), facts_b.get(n)) for n in chosen])
