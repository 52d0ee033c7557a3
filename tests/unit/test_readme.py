"""The README's promises that can go stale: the two commands first, the machine diagram."""

from __future__ import annotations

from pathlib import Path

from sft_runtime.states.machine import mermaid

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_starts_with_the_two_commands():
    head = README.read_text().splitlines()[:8]
    assert any(line.startswith("make demo") for line in head)
    assert any(line.startswith("make test") for line in head)


def test_readme_shows_the_current_state_machine():
    assert mermaid() in README.read_text(), (
        "regenerate with: python -c 'from states.machine import mermaid; print(mermaid())'"
    )
