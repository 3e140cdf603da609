"""How an incident's :class:`edo_monitor.hindsight.staged.StagedPlan` is shown (``edo-monitor
explain`` and the dashboard's explain view, after the remedies): a table of the stages and a
line per suggested embedding dimension."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.text import Text

from edo_monitor.list_table import Col, ListTable
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from edo_monitor.hindsight.staged import StagedPlan

__all__ = ["staged_plan_renderables"]


def staged_plan_renderables(plan: StagedPlan | None) -> list[RenderableType]:
    """A heading, the stages (stage, action, target, saving, with the earlier stages, enough,
    where the number comes from) and the dimension suggestions; nothing for ``None``."""
    if plan is None or not plan.stages:
        return []
    out: list[RenderableType] = [
        Text(f"  staged plan for a shortfall of {format_bytes(plan.shortfall_bytes)}:")
    ]
    table = ListTable(  # the stage and its action name the row: never cut (ListTable)
        Col("stage", "right", key=True),
        Col("action", key=True),
        Col("target"),
        Col("saving", "right"),
        Col("with earlier", "right"),
        Col("enough"),
        Col("from"),
        show_edge=False,
    )
    for s in plan.stages:
        table.add_row(
            Text(str(s.stage)),
            Text(s.action),
            Text(s.target),
            Text(format_bytes(s.saving_bytes)),
            Text(format_bytes(s.cumulative_bytes)),
            Text("yes" if s.enough else "no", style="green" if s.enough else ""),
            Text(s.detail),
        )
    out.append(table)
    for d in plan.dimensions:
        saving = (
            f", saves {format_bytes(d.saving_bytes)} ({'enough' if d.enough else 'not enough'})"
            if d.saving_bytes is not None
            else ""
        )
        out.append(
            Text(
                f"  dimension: {d.table} {d.embedding_dim} -> {d.dimension} keeps "
                f"{d.energy_fraction:.0%} of the energy of {d.rows_sampled:,} sampled rows "
                f"(reconstruction error {d.relative_error:.1%}){saving}"
            )
        )
    return out
