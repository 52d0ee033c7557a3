"""`diff_runs`: where two runs part ways, step by step, from their logs alone.

Each step's record holds its loss, grad norm and per-rank sample digests, so two runs can be
compared without their checkpoints or a GPU: did step N train on the same samples, and did it
reach the same loss? The first step where the samples differ says the data path changed (a
seed, the packing, the tokenizer); the first where only the loss differs says the model,
optimizer or numerics did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sft_runtime.events.lineage import LogLike, records_in_effect


@dataclass(frozen=True)
class StepFacts:
    loss: float
    grad_norm: float
    digests: tuple[str, ...]


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
        return None if self.a is None or self.b is None else self.b.loss - self.a.loss


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
    def identical(self) -> bool:
        """The same steps, the same samples and bitwise the same losses and grad norms."""
        return all(s.a == s.b for s in self.steps)


def step_facts(log: LogLike) -> dict[int, StepFacts]:
    """The committed steps in effect (the last execution of a step that was re-run)."""
    return {
        r.data["step"]: StepFacts(
            float(r.data["loss"]), float(r.data["grad_norm"]), tuple(r.data["sample_digests"])
        )
        for r in records_in_effect(log)
        if r.type == "step_committed"
    }


def diff_runs(a: LogLike, b: LogLike) -> RunDiff:
    facts_a, facts_b = step_facts(a), step_facts(b)
    steps = sorted(set(facts_a) | set(facts_b))
    return RunDiff([StepDiff(n, facts_a.get(n), facts_b.get(n)) for n in steps])
