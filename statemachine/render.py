"""Render the transition table as Markdown and as a Mermaid ``stateDiagram-v2``.

The docs site calls these at build time; nothing in the docs is hand-copied from the table.
"""

from __future__ import annotations

from .table import FUSIONS, TABLE, Fusion, Transition


def _label(row: Transition) -> str:
    return row.event + (f" [{row.guard_name}]" if row.guard_name else "")


def to_mermaid(table: tuple[Transition, ...] = TABLE) -> str:
    """A Mermaid state diagram: one edge per row, labelled ``event [guard]``."""
    lines = ["stateDiagram-v2", "    [*] --> Admitted"]
    for row in table:
        lines.append(f"    {row.source.__name__} --> {row.target.__name__}: {_label(row)}")
    lines.append("    Compacted --> [*]: retire (last request)")
    return "\n".join(lines) + "\n"


def to_markdown(table: tuple[Transition, ...] = TABLE) -> str:
    """The table as Markdown: source, event, guard, target, backend ops, the grammar steps, the static form (what
    the static and graphed executors run: the row's own, with its host step if it has one, or a fusion's), what it
    does."""
    out = [
        "| source | event | guard | target | backend ops | grammar | static form | what it does |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in table:
        ops = ", ".join(f"`{op}`" for op in row.ops) or "-"
        guard = f"`{row.guard_name}`" if row.guard_name else "-"
        masks = ", ".join(f"`{step}`" for step in row.grammar) or "-"
        static = [f"`{row.static.__name__}`"] if row.static is not None else []
        if row.host is not None:
            static = [f"{static[0]} (host step `{row.host.name}`)"]
        static += [f"fusion `{f.op}`" for f in FUSIONS if row in f.rows and f.static is not None]
        out.append(
            f"| `{row.source.__name__}` | `{row.event}` | {guard} | `{row.target.__name__}` | {ops} | {masks} | "
            f"{', '.join(static) or '-'} | {row.doc} |"
        )
    return "\n".join(out) + "\n"


def fusions_markdown(fusions: tuple[Fusion, ...] = FUSIONS) -> str:
    """The declared fusions as Markdown: the op, the rows whose work it does, the ops it takes over."""
    out = [
        "| fused op | rows it does the work of | their ops it takes over | where | what it covers |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in fusions:
        rows = ", ".join(f"`{r.event}` (`{r.run.__name__}`)" for r in f.rows)
        ops = ", ".join(f"`{op}`" for op in f.replaces_ops)
        out.append(f"| `{f.op}` | {rows} | {ops} | `{f.module}` | {f.doc} |")
    return "\n".join(out) + "\n"
