"""How :func:`edo_monitor.hindsight.explain`'s answer is shown: by ``edo-monitor explain`` and in
the dashboard's explain view (one rendering, Rich renderables).

Every string from the history (messages, module names, targets) goes in as plain
:class:`rich.text.Text`, never parsed as markup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.text import Text

from edo_monitor.list_table import Col, ListTable
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from edo_monitor.hindsight.explain import Explanation

__all__ = ["explain_renderables"]


def explain_renderables(result: Explanation, *, top: int = 12) -> list[RenderableType]:
    """For each incident of ``result``: a heading (event, step, what happened, in-use of the
    budget, shortfall in bytes) and a table of its first ``top`` remedies (action, target, saving,
    enough, lossy, where the number comes from). A crossing with the same shortfall and remedies
    as the incident before it (one per step of an episode) is one line.

    Args:
        result: :func:`edo_monitor.hindsight.explain`'s answer.
        top: remedies shown per incident (>= 1).

    Returns:
        Rich renderables, in order; one line when there is no incident.
    """
    if not result.incidents:
        return [Text(_nothing_to_explain(result))]
    out: list[RenderableType] = []
    previous = None
    for inc in result.incidents:
        what = "out of memory" if inc.kind == "oom" else "free memory below the floor"
        if previous is not None and (inc.kind, inc.shortfall_bytes, inc.remedies) == (
            previous.kind,
            previous.shortfall_bytes,
            previous.remedies,
        ):  # a crossing in every step of an episode: said once
            out.append(
                Text(
                    f"event {inc.event_id}  step {inc.step}  {what}: the same shortfall and "
                    f"remedies as event {previous.event_id}"
                )
            )
            continue
        previous = inc
        said = inc.message if inc.kind == "oom" else f"{what}: {inc.message}"
        peak = (
            f", episode peak {format_bytes(inc.peak_in_use_bytes)}"
            if inc.kind == "below_floor"
            else ""
        )
        out.append(
            Text(
                f"event {inc.event_id}  step {inc.step}  {said}\n"
                f"  in use {format_bytes(inc.in_use_bytes)} of {format_bytes(inc.budget_bytes)}"
                f"{peak}; shortfall {format_bytes(inc.shortfall_bytes)} "
                f"({inc.shortfall_bytes:,} bytes)"
            )
        )
        table = ListTable(  # the remedy and its target name the row: never cut (ListTable)
            Col("remedy", key=True),
            Col("target", key=True),
            Col("saving", "right"),
            Col("enough"),
            Col("lossy"),
            Col("from"),
            show_edge=False,
        )
        for r in inc.remedies[:top]:
            table.add_row(
                Text(r.action),
                Text(r.target),
                Text(format_bytes(r.saving_bytes)),
                Text("yes" if r.enough else "no", style="green" if r.enough else ""),
                Text("yes" if r.lossy else "no"),
                Text(r.detail),
            )
        out.append(table)
        if len(inc.remedies) > top:
            out.append(Text(f"  … {len(inc.remedies) - top} more (--top, --json)"))
        for r in inc.refused_live:
            out.append(Text(f"  not a remedy: {r.action} on {r.target}, {r.detail}"))
        from edo_monitor.hindsight.snapshot import snapshot_renderables

        out.extend(snapshot_renderables(inc.snapshot))
        from edo_monitor.hindsight.staged_view import staged_plan_renderables

        out.extend(staged_plan_renderables(inc.staged_plan))
    return out


def _nothing_to_explain(result: Explanation) -> str:
    """Why a run has no incident, with what it did instead: a run without a policy has no floor,
    so no crossing was recorded, however low its free memory went; ``replay`` runs a policy over
    its samples."""
    budget, peak, low = result.budget_bytes, result.peak_in_use_bytes, result.min_free_fraction
    did = ""
    if budget and peak is not None:
        did = f"; peak in use {format_bytes(peak)} of its budget {format_bytes(budget)}"
        if low is not None:
            did += f" (min free {low:.1%})"
        if peak > budget:
            did += f", over the budget by {format_bytes(peak - budget)}"
    if result.floor_fraction is None and not budget:
        return (
            f"run {result.run_id}: no OOM, and no policy, so no floor: no pressure crossing was "
            "recorded; and no budget, so no free memory was measured for a policy to act on "
            "(watch(budget=...) or a GPU gives one)"
        )
    if result.floor_fraction is None:
        return (
            f"run {result.run_id}: no OOM, and no policy, so no floor: no pressure crossing was "
            f"recorded{did}. edo-monitor replay {result.run_id} shows what the default policy "
            "would have done on its samples"
        )
    above = (
        f" (free memory stayed above the floor {result.floor_fraction:.0%})"
        if low is None or low >= result.floor_fraction
        else ""
    )
    return f"run {result.run_id}: no OOM and no pressure crossing to explain{above}{did}"
