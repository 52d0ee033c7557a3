"""A benchmark row and the table every benchmark prints (figure, reference, ratio, target)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Row:
    name: str
    value: float
    unit: str
    reference: float | None = None  # the same figure for the reference, measured in the same run
    ratio: float | None = None
    target: str = ""
    ok: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.3f}" if abs(x) < 100 else f"{x:,.0f}"


def render(rows: list[dict]) -> str:
    head = ("figure", "value", "unit", "reference", "ratio", "target", "ok")
    body = [
        (
            r["name"],
            _fmt(r["value"]),
            r["unit"],
            _fmt(r.get("reference")),
            _fmt(r.get("ratio")),
            r.get("target") or "",
            {True: "yes", False: "NO", None: "-"}[r.get("ok")],
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]
    lines = [
        " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False))
        for line in [head, *body]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
