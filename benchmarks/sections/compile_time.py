"""Section `compile`: first-call time minus warm-call time of the first SDAR and LLaDA point, taken from
the rows of the run that timed that point."""

from __future__ import annotations

from .tables import markdown_table

SECTION = "compile"


def has_compile_source(rows: list[dict], section: str, match: dict) -> bool:
    """Whether `rows` hold a timed (first and warm call) `section` row at the point `match`."""
    return any(r.get("section") == section and "first_call_s" in r and all(r.get(k) == v for k, v in match.items())
               for r in rows)


def add_compile_row(rows: list[dict], section: str, match: dict, add) -> None:
    """Adds the compile-time row (first call - warm call) of the first `section` row at `match`,
    unless there is none or it was added already."""
    if any(r.get("section") == "compile" and r.get("model") == section for r in rows):
        return
    for r in rows:
        if r.get("section") == section and "first_call_s" in r and all(r.get(k) == v for k, v in match.items()):
            add(dict(section="compile", model=section, point={k: r[k] for k in match}, first_call_s=r["first_call_s"],
                     warm_s=r["warm_s"], compile_s=r["first_call_s"] - r["warm_s"]))
            return


COMPARED = (("model", "point"), "compile_s", "s", False)


def table(meta: dict, rows: list[dict]) -> list[str]:
    cells = [[r["model"], r["point"], f"{r['first_call_s']:.1f} s", f"{r['warm_s']:.1f} s", f"{r['compile_s']:.1f} s"]
             for r in rows]
    return ["", "## First-call compile time (first call - warm call)", "",
            *markdown_table(["model", "point", "first call", "warm", "compile"], cells)]


def headline(r: dict) -> str:
    return f"| compile {r['model']} {r['point']} | {r['compile_s']:.1f} s |"
