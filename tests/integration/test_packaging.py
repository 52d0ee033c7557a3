"""One import namespace: the wheel installs `sft_runtime` and nothing else at the top level,
and works in a fresh venv beside the unrelated PyPI package `traces`.

The fresh venv sees the project's dependencies (torch, ray, energon, and PyPI's `traces`
from the dev extra) through a ``.pth`` line naming this venv's site-packages; a ``.pth``
line is not a site directory, so this venv's editable install of sft-runtime stays
invisible there and every `sft_runtime` import must come from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"sft_runtime": "sft_runtime", "runtime": "sft_runtime.runtime"} | {
    name: f"sft_runtime.{name}" for name in ("states", "events", "traces")
}


def _declared_packages() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["tool"]["setuptools"]["packages"]


def test_every_package_folder_is_declared():
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert sorted(found) == sorted(_declared_packages())


def _source_copy(dest: Path) -> Path:
    """The tracked and new files of the checkout (what a clean clone has), no build litter."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for rel in listed:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


EMBED = textwrap.dedent(
    """
    import sys

    import traces  # the unrelated PyPI package of that name

    assert hasattr(traces, "TimeSeries"), traces.__file__
    import sft_runtime.events
    import sft_runtime.states

    assert "torch" not in sys.modules and "ray" not in sys.modules
    from sft_runtime.states import replay

    state = replay(sys.argv[1])
    from sft_runtime.sft_v2 import MasterConfig, SFTV2SaveState, setup_sft_v2

    import sft_runtime

    assert sft_runtime.MasterConfig is MasterConfig and callable(setup_sft_v2)
    assert isinstance(state, SFTV2SaveState)
    print("embedded:", sft_runtime.__file__, state.total_steps)
    """
)


def test_the_wheel_installs_one_namespace_beside_pypi_traces(tmp_path):
    src = _source_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--disable-pip-version-check", "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("sft_runtime-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"sft_runtime"}, tops

    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "_sft_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
        + ["--disable-pip-version-check", str(wheel)],
        check=True,
        capture_output=True,
    )

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTHON"))}
    env["RAY_AUTH_MODE"] = "disabled"
    work = tmp_path / "elsewhere"  # not the checkout: nothing importable by accident
    work.mkdir()
    run_dir = work / "demo"
    demo = subprocess.run(
        [
            str(venv / "bin" / "sft-runtime"),
            "demo",
            "--toy",
            "--steps",
            "3",
            "--run-dir",
            str(run_dir),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "completed: 3 steps" in demo.stdout

    (work / "embed.py").write_text(EMBED)
    embed = subprocess.run(
        [str(python), "embed.py", str(run_dir)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert embed.returncode == 0, embed.stdout + embed.stderr
    assert f"embedded: {site}/sft_runtime/__init__.py 3" in embed.stdout
