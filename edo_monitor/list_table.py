"""The tables whose key columns are never cut (:class:`ListTable`, its columns :class:`Col`): the
CLI's lists and ``show``, and what ``explain`` and ``job`` print (also in the dashboard). Only Rich
is imported; beside the package's other formatting for humans (``units.py``), so ``hindsight``
and the surfaces both build them."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
from rich.style import StyleType
from rich.table import Table
from rich.text import Text

__all__ = ["Col", "ListTable"]


@dataclass(frozen=True)
class Col:
    """A column of a :class:`ListTable`: its header, its justification, and whether it is a
    key (what names the row and is typed back: a run id, a uuid prefix, a job id)."""

    header: str
    justify: JustifyMethod = "left"
    key: bool = False


#: the narrowest a column beside the keys is made (its words fold over lines below their
#: length): a narrower terminal shows each row as ``header: value`` lines
_MIN_COLUMN = 8


class ListTable:
    """A table of the CLI (a Rich renderable) whose key columns are never cut.

    Rich shrinks the widest columns of a table wider than the terminal and cuts what no longer
    fits with ``…``: at 80 columns ``runs`` showed ``a8…`` for a uuid prefix, at 120
    ``383ffa9…``, where the prefix is what the user types back. Here the widths are chosen
    before Rich draws (fixed column widths: Rich shrinks nothing), at the console's width:

    - the whole table at its full width when it fits;
    - else one table whose key columns keep their full width and whose other columns give way,
      the widest first, down to their longest word (their text wraps over lines);
    - else the table folds: several tables, each with the key columns and, in order, as many
      of the others as fit at their full width (a single column wider than the rest of the
      line wraps, its longest words folded when they do not fit);
    - where not even the keys and one narrow column fit, each row as ``header: value`` lines.

    No cell is ever cut (a long word folds, ``overflow="fold"``). A cell is a string or a
    :class:`rich.text.Text` (plain text whatever the console's markup setting, with its style).
    """

    def __init__(
        self,
        *columns: Col,
        title: str | None = None,
        show_header: bool = True,
        show_edge: bool = True,
        title_justify: JustifyMethod = "center",
    ) -> None:
        """A table of ``columns`` (:class:`Col`) with an optional ``title`` above it (justified
        by ``title_justify``); ``show_edge=False``: no outer border, as Rich's ``show_edge``."""
        self.columns = columns
        self.title = title
        self.show_header = show_header
        self.show_edge = show_edge
        self.title_justify = title_justify
        self.rows: list[tuple[str | Text, ...]] = []
        self.styles: list[StyleType | None] = []

    def add_row(self, *cells: str | Text, style: StyleType | None = None) -> None:
        """Add a row: one text per column, with an optional ``style`` for the whole row."""
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(cells)
        self.styles.append(style)

    def _span(self, widths: dict[int, int]) -> int:
        """The printed width of columns of ``widths``: each with its padding (2) and a bar,
        plus the outer bars (one more bar with the edge, one fewer without)."""
        return sum(w + 3 for w in widths.values()) + (1 if self.show_edge else -1)

    def _measure(self) -> tuple[list[int], list[int]]:
        """Each column's full width (its widest line, header included; 0 for a column with no
        text) and its least width (its longest word, at least 1), without padding."""
        from rich.cells import cell_len

        full, least = [], []
        for i, col in enumerate(self.columns):
            texts = [col.header] if self.show_header else []
            texts += [row[i].plain if isinstance(row[i], Text) else row[i] for row in self.rows]
            lines = [line for t in texts for line in t.splitlines()]
            full.append(max([0, *(cell_len(line) for line in lines)]))  # 0: empty, as Rich
            least.append(max([1, *(cell_len(word) for line in lines for word in line.split())]))
        return full, least

    def layout(self, width: int) -> list[dict[int, int]] | None:
        """The tables printed at ``width`` (class docstring): for each, its columns (indices, in
        order) and their widths without padding; ``None``: ``header: value`` lines."""
        full, least = self._measure()
        everything = range(len(self.columns))
        keys = [i for i in everything if self.columns[i].key]
        others = [i for i in everything if not self.columns[i].key]

        span = self._span
        if span({i: full[i] for i in everything}) <= width:
            return [{i: full[i] for i in everything}]
        if span({i: full[i] if i in keys else least[i] for i in everything}) <= width:
            return [self._fill(list(everything), width, full, least)]
        base = span({i: full[i] for i in keys})
        if not others or base + _MIN_COLUMN + 3 > width:
            return None
        parts: list[list[int]] = [[]]
        used = base
        for i in others:
            if parts[-1] and used + full[i] + 3 > width:
                parts.append([])
                used = base
            parts[-1].append(i)
            used += full[i] + 3
        return [self._fill(sorted(keys + part), width, full, least) for part in parts]

    def _fill(self, indices: list[int], width: int, full: list[int], least: list[int]) -> dict:
        """Widths of ``indices`` within ``width``: the keys at full width, the others from
        theirs down, the widest first, to their longest word, then (one column too wide for the
        line) to :data:`_MIN_COLUMN`."""
        widths = {i: full[i] for i in indices}
        excess = self._span(widths) - width
        for floor in (least, None):
            while excess > 0:
                shrinkable = [
                    i
                    for i in indices
                    if not self.columns[i].key
                    and widths[i] > (_MIN_COLUMN if floor is None else max(floor[i], 1))
                ]
                if not shrinkable:
                    break
                widest = max(shrinkable, key=widths.__getitem__)
                widths[widest] -= 1
                excess -= 1
        return widths

    def _table(self, widths: dict[int, int], title: str | None) -> Table:
        table = Table(
            title=title,
            show_header=self.show_header,
            show_edge=self.show_edge,
            title_justify=self.title_justify,
        )
        for i, width in widths.items():
            col = self.columns[i]
            table.add_column(
                col.header, justify=col.justify, width=width, no_wrap=col.key, overflow="fold"
            )
        for row, style in zip(self.rows, self.styles, strict=True):
            table.add_row(*(row[i] for i in widths), style=style)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The table at ``options.max_width`` (class docstring)."""
        tables = self.layout(options.max_width)
        if tables is not None:
            for n, widths in enumerate(tables):
                yield self._table(widths, self.title if n == 0 else None)
            return
        if self.title:
            yield Text(self.title, style="table.title")
        for n, (row, style) in enumerate(zip(self.rows, self.styles, strict=True)):
            if not self.show_header:  # a table of fields: each row is one
                yield Text("  ", style=style or "", overflow="fold").join(
                    c if isinstance(c, Text) else Text(c) for c in row
                )
                continue
            if n:
                yield Text("")
            for col, cell in zip(self.columns, row, strict=True):
                yield Text.assemble(f"{col.header}: ", cell, style=style or "", overflow="fold")
