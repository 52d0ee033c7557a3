"""A SIGKILL at each of the 13 kill points, then the same command, is exact.

Each chain crashes one run directory at several points in turn (each launch sets one
point, the next launch resumes and crashes at the next), then finishes without a fault and
is compared with the uninterrupted reference: the loss and per-rank sample digests of every
step, the final weights bit for bit, and `sft-runtime verify` (every re-executed step
reproduced). Three of the stepping chain's points run again with read-ahead on
(``data_plane.max_partitions=2``) against the same reference, and the points where a sharded
(FSDP2) run is most exposed run against the sharded reference. Every point is shown to have
been hit by what the crashed attempt left in the log and on disk, and the attempt after it
shows where the lost steps were resumed from.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from sft_runtime.runtime.checkpoint.sharded import is_sharded
from sft_runtime.runtime.process.faults import POINTS
from tests.support.reliability import (
    FSDP,
    PREFETCH,
    STEPS,
    Runner,
    attempts_of,
    compare,
    summary_line,
    tagged_pids,
)


@dataclass(frozen=True)
class Kill:
    point: str
    step: int | None = None  # None: the first time the point is reached
    rank: int | None = None
    # what the crashed attempt left in the log (None: no attempt was started at all)
    resumed_from: int | None = None
    last_step: int | None = None
    checkpoints: tuple[int, ...] = ()
    aborted: int | None = None
    loaders_ready: bool = True
    new_attempt: bool = True
    disk: str = ""  # tmp_step_6 | tmp_step_6_complete (all but the info) | step_6_unrecorded

    @property
    def spec(self) -> str:
        return self.point if self.step is None else f"{self.point}@{self.step}"


# steps 1-7, checkpoints at 3, 6 and 7: a kill at step 5 loses step 4 (and 5)
STEPPING = (
    Kill("setup:after_loaders", 0, last_step=None, loaders_ready=False),
    Kill("stepping:after_loading", 5, last_step=4, checkpoints=(3,)),
    Kill("stepping:after_train", 5, resumed_from=3, last_step=4),
    Kill("stepping:after_commit", 5, resumed_from=3, last_step=4),
    Kill("stepping:after_record", 5, resumed_from=3, last_step=5),
    Kill("worker:train", 5, rank=1, resumed_from=3, last_step=4, aborted=5),
    Kill("worker:finish", 5, rank=0, resumed_from=3, last_step=4, aborted=5),
)
SAVING = (
    Kill("driver:after_setup", new_attempt=False),
    Kill("saving:after_weights", 6, last_step=6, checkpoints=(3,), disk="tmp_step_6"),
    Kill("saving:before_rename", 6, resumed_from=3, last_step=6, disk="tmp_step_6_complete"),
    Kill("saving:after_rename", 6, resumed_from=3, last_step=6, disk="step_6_unrecorded"),
    Kill("saving:after_record", 6, resumed_from=3, last_step=6, checkpoints=(6,)),
    Kill("closing:before_stop", 7, resumed_from=6, last_step=7, checkpoints=(7,)),
)
# sharded (FSDP2): a worker lost inside its forward/backward or before its optimizer step
# (every peer is inside a collective with it), and a kill in the middle of a sharded save
SHARDED = (
    Kill("worker:train", 5, rank=1, last_step=4, checkpoints=(3,), aborted=5),
    Kill("worker:finish", 5, rank=0, resumed_from=3, last_step=4, aborted=5),
    Kill("saving:after_weights", 6, resumed_from=3, last_step=6, disk="tmp_step_6"),
    Kill("saving:before_rename", 6, resumed_from=3, last_step=6, disk="tmp_step_6_complete"),
)
# With read-ahead on, a batch read ahead when the kill lands is never counted: the resume
# delivers it again. Every kill of the chain resumes from the checkpoint at 3, which the first
# launch saved with a batch read ahead, so three points show it: the controller before and
# after the loader's commit of step 5, and a worker lost while its loader reads ahead. The
# other stepping points differ only in what the controller had logged, which read-ahead does
# not change, and the chain without it kills there.
PREFETCH_POINTS = ("stepping:after_loading", "stepping:after_commit", "worker:train")
# chain, resume of the finish, config overrides
CHAINS = {
    "stepping": (STEPPING, 3, ()),
    "stepping_prefetch": (tuple(k for k in STEPPING if k.point in PREFETCH_POINTS), 3, PREFETCH),
    "saving": (SAVING, 7, ()),
    "fsdp": (SHARDED, 3, FSDP),
}


# points whose kill needs a run these chains do not make, and the test that kills there
ELSEWHERE = {
    "validating:after_pass": "tests/reliability/test_validation_kill.py",
    "export:after_shard": "tests/integration/policy/test_hf_fsdp.py",
}


def test_the_chains_cover_every_kill_point():
    covered = [
        kill.point for chain, _, overrides in CHAINS.values() if not overrides for kill in chain
    ]
    assert sorted(covered + list(ELSEWHERE)) == sorted(POINTS) and len(covered) >= 12
    root = Path(__file__).resolve().parents[2]
    assert all(point in (root / test).read_text() for point, test in ELSEWHERE.items())


def _check_crash(kill: Kill, launch, before: dict, run_dir: Path) -> None:
    """The launch died at the point: its exit status and what its attempt recorded."""
    why = f"{kill.spec}: exit {launch.rc}\n{launch.tail()}"
    if kill.point == "driver:after_setup":
        assert launch.rc in (-9, 137), why  # the driver itself was SIGKILLed
    else:
        assert launch.rc == 1, why  # the controller or a worker died: a run failure
    after = attempts_of(run_dir)
    if not kill.new_attempt:
        assert after.keys() == before.keys(), why
        return
    assert len(after) == len(before) + 1, why
    records = after[max(after)]
    types = [r.type for r in records]
    started = records[0]
    assert started.type == "run_started", why
    assert started.data["resumed_from_step"] == kill.resumed_from, why
    assert ("loaders_ready" in types) == kill.loaders_ready, why
    steps = [r.data["step"] for r in records if r.type == "step_committed"]
    last_step = steps[-1] if steps else None
    saved = tuple(r.data["step"] for r in records if r.type == "checkpoint_saved")
    assert saved == kill.checkpoints, why
    aborted = [r for r in records if r.type == "step_aborted"]
    stopped = [r for r in records if r.type == "run_stopped"]
    want_last, want_aborted = kill.last_step, kill.aborted
    lost = kill.aborted is not None and kill.point.startswith("worker:")
    # where the run stood when the kill came: this attempt's last commit, else its resume
    stood = last_step if last_step is not None else kill.resumed_from
    if lost and stood == kill.last_step - 1 and len(aborted) == 1:
        # The killed worker took the step before with it: that step's finish had run on
        # every rank, but the killed rank's reply had not left its process when the kill
        # came in the next step (a busy machine). The controller, hearing only of a
        # dead worker, aborted that step; the resume from the checkpoint is exact either way
        # (compared by the test), and the log shows which of the two happened. When that step
        # was the attempt's first, the attempt commits no step at all.
        want_last, want_aborted = last_step, kill.last_step
    assert last_step == want_last, why
    if kill.aborted is None:
        assert not aborted and not stopped, why  # SIGKILL: nothing more was written
    else:  # a worker died: the controller recorded the abort and the failure
        assert [a.data["step"] for a in aborted] == [want_aborted], why
        assert [s.data["reason"] for s in stopped] == ["failed"], why
        # the dead rank, or (when its peer's gloo error arrives first) the peer: see
        # test_worker_loss.py for the report on which error wins
        error = stopped[0].data["error"]
        assert f"rank {kill.rank}: worker died" in error or "Connection reset" in error, why
    ckpt = run_dir / "checkpoints"
    if kill.disk.startswith("tmp_step_6"):
        assert (ckpt / "tmp_step_6").is_dir() and not (ckpt / "step_6").exists(), why
        tmp = ckpt / "tmp_step_6"
        weights = tmp / "policy" / "weights"
        assert (weights / "model.safetensors").is_file() or is_sharded(weights), why
        # training_info.json is written by the commit, right before the rename
        assert not (tmp / "training_info.json").exists(), why
        complete = (tmp / "sft_v2_loaders.pt").is_file() and (tmp / "config.yaml").is_file()
        assert complete == kill.disk.endswith("complete"), why
    elif kill.disk == "step_6_unrecorded":
        assert (ckpt / "step_6").is_dir() and not (ckpt / "tmp_step_6").exists(), why


def _run_chain(runner, kills) -> None:
    for kill in kills:
        before = attempts_of(runner.run_dir)
        launch = runner.launch(kill.spec, kill.rank)
        _check_crash(kill, launch, before, runner.run_dir)
        left = list((runner.run_dir / "checkpoints").glob("tmp_step_*"))
        assert not left or kill.disk, f"{kill.spec} left a temporary checkpoint"
    runner.finish()


@pytest.fixture(scope="module")
def chains(demo_data, launch_env, tmp_path_factory):
    """Both chains, run side by side (each launch mostly waits for Ray to start)."""
    ray_tmp, tag = launch_env
    runners = {
        name: Runner(
            tmp_path_factory.mktemp(name),
            demo_data,
            ray_tmp,
            tag,
            f"chain_{name}",
            overrides=overrides,
        )
        for name, (_, _, overrides) in CHAINS.items()
    }
    with ThreadPoolExecutor(len(CHAINS)) as pool:
        futures = {n: pool.submit(_run_chain, runners[n], CHAINS[n][0]) for n in CHAINS}
        errors = {n: f.exception() for n, f in futures.items()}
    return {n: (runners[n], errors[n]) for n in CHAINS}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_kill_points_then_resume_is_exact(chain, chains, request):
    kills, finish_from, overrides = CHAINS[chain]
    reference = request.getfixturevalue("fsdp_reference" if FSDP == overrides else "reference")
    runner, error = chains[chain]
    for launch in runner.launches:
        print(
            f"\n  {chain}: {launch.fault or 'no fault'}: exit {launch.rc} in {launch.seconds:.1f}s,"
            f" orphans gone after {launch.orphan_seconds:.1f}s ({launch.orphans_killed} killed)",
            end="",
        )
    if error is not None:
        raise error
    attempts = attempts_of(runner.run_dir)
    last = attempts[max(attempts)]
    assert last[0].data["resumed_from_step"] == finish_from
    assert [r.data["reason"] for r in last if r.type == "run_stopped"] == ["completed"]
    assert not list((runner.run_dir / "checkpoints").glob("tmp_step_*"))  # cleaned up

    cmp = compare(runner.run_dir, reference)
    resumes = len(runner.launches) - 1
    print("\n" + summary_line(f"kill-points {chain}", len(kills), resumes, cmp))
    # Ray's workers live in sessions of their own; the harness ends by pid any that
    # outlive the grace period (reported above), so none is left behind
    assert not tagged_pids(runner.session_tag + ":" + runner.name)
    assert cmp.steps_compared == STEPS
    assert cmp.reexecuted > 0
    assert cmp.mismatches == []
