"""Per-module memory rows: :class:`ModuleRows`.

One row per module holds every category (a table's parameter, gradient and optimizer-state
bytes, the activations its forward saved, a cached table's counters), so the latest row of a
module is its whole state. A new row goes to the history (``module_stats``) only when a number
changed. The sampler thread writes the accounting's and the row caches' numbers; the safe point
writes each activation profile's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from edo_monitor.measure.accounting import Accounting
from edo_monitor.measure.module_tree import MODEL_MODULE, module_label
from edo_monitor.store.schema import CACHE_FIELDS

if TYPE_CHECKING:
    from edo_monitor.probes.readings import Reading
    from edo_monitor.store.writer import Writer

__all__ = ["ModuleRows"]


class ModuleRows:
    """The latest row of every module of the watched model.

    Args:
        model: the watched model (``None``: rows are still kept, their kind is ``"module"``).
        step: returns the step count recorded with each row.

    Attributes:
        writer: the history writer (``None`` until the run is recorded).
        rows: module name -> its latest row (``module``, ``kind``, table shape, ``*_bytes``,
            cache counters).
    """

    def __init__(self, model: nn.Module | None, step: Callable[[], int]) -> None:
        self.model = model
        self._step = step
        self.writer: Writer | None = None
        self.rows: dict[str, dict[str, Any]] = {}

    def update(self, module: str, now: float, **fields: Any) -> None:
        """Merge ``fields`` into the module's latest row; queue a new row when it changed."""
        old = self.rows.get(module)
        if old is None:
            old = {
                "module": module,
                "kind": self._kind(module),
                "num_embeddings": None,
                "embedding_dim": None,
                "dtype": None,
                "device": None,
                "placement": None,
                "params_bytes": 0,
                "grads_bytes": 0,
                "optimizer_state_bytes": 0,
                "activations_bytes": 0,
            }
        row = {**old, **fields}
        if row == self.rows.get(module):
            return
        self.rows[module] = row
        if self.writer is not None:
            self.writer.put_module_stat({**row, "time_s": now, "step": self._step()})

    def _kind(self, module: str) -> str:
        if self.model is None:
            return "module"
        if module == MODEL_MODULE:
            return type(self.model).__name__
        try:
            return type(self.model.get_submodule(module)).__name__
        except (AttributeError, RuntimeError):  # no such module; a TorchScript module has no
            return "module"  # get_submodule

    def write_accounting(self, acc: Accounting, now: float) -> None:
        """Each table's and module's bytes from the accounting the sample's totals come from.

        The numbers are the accounting's as they are, no peak kept: the sampler passes the last
        step boundary's accounting (gradients alive), and the rows of one accounting add up to its
        totals (:class:`~edo_monitor.measure.accounting.Accounting`). A peak kept per module name
        outlived the tensors it measured: a table converted to a row cache kept reporting the
        full table's gradient.
        """
        for t in acc.tables + acc.modules:
            self.update(
                t.module,
                now,
                kind=t.kind,
                num_embeddings=t.num_embeddings or None,
                embedding_dim=t.embedding_dim or None,
                dtype=t.dtype,
                device=t.device,
                placement=t.placement,
                params_bytes=t.params_bytes,
                grads_bytes=t.grads_bytes,
                optimizer_state_bytes=t.optimizer_state_bytes,
            )

    def write_cache_totals(
        self, tables: Mapping[str, tuple[dict[str, int], dict[str, int]]], now: float
    ) -> None:
        """Each cached table's totals into its module row; ``None`` each once a table has no
        cache."""
        for name, (totals, _) in tables.items():
            self.update(name, now, **totals)
        for name, row in list(self.rows.items()):
            if name not in tables and row.get("cache_rows") is not None:
                self.update(name, now, **dict.fromkeys(CACHE_FIELDS))

    def write_activations(self, exclusive_bytes: Mapping[str, int], now: float) -> None:
        """An activation profile's bytes saved by each module's own forward (``""``: the model
        itself, recorded as ``<model>``: :func:`~edo_monitor.decide.plans.module_label`). The
        profile is the module's whole state: a module it does not list saved nothing in that step
        (frozen, run under ``no_grad``, checkpointed or not called), so a row that had
        activations goes to 0."""
        profiled = {module_label(module): nbytes for module, nbytes in exclusive_bytes.items()}
        gone = {name for name, row in self.rows.items() if row["activations_bytes"]}
        for module in sorted(profiled.keys() | gone):
            nbytes = profiled.get(module, 0)
            if nbytes > 0 or module in self.rows:
                self.update(module, now, activations_bytes=nbytes)

    def breakdown(self, latest: Reading | None) -> list[dict[str, Any]]:
        """What :meth:`Monitor.breakdown` returns (largest first, then ``other`` on CUDA)."""
        rows = []
        for row in list(self.rows.values()):
            total = (
                row["params_bytes"]
                + row["grads_bytes"]
                + row["optimizer_state_bytes"]
                + row["activations_bytes"]
            )
            rows.append({**row, "total_bytes": total})
        rows.sort(key=lambda r: r["total_bytes"], reverse=True)
        if latest is not None and latest.allocated_bytes is not None:
            known = sum(
                getattr(latest, k) or 0
                for k in (
                    "params_bytes",
                    "grads_bytes",
                    "optimizer_state_bytes",
                    "activations_bytes",
                )
            )
            rows.append(
                {"module": "other", "kind": "other", "total_bytes": latest.allocated_bytes - known}
            )
        return rows
