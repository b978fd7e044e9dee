"""The page at ``/``: every run of the store as a table, and links to each sweep's page.

:class:`RunTable` (no Bokeh) keeps the rows: the first listing reads each run's ``zarr.json`` and
lease only (:func:`~nsa_dist.store.run_summaries` with ``steps=False``), so that hundreds of runs
appear at once; the step columns (progress, loss, λ_max) follow from a second read, and later
refreshes re-read the steps only of runs that are running or whose status changed.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np

from nsa_dist.client import flatten_spec, varied_fields
from nsa_dist.store import RunSummary, run_summaries

if TYPE_CHECKING:
    from bokeh.document import Document

    from nsa_dist.serve._live import Shared
    from nsa_dist.store import SpectrumStore

__all__ = ["RunTable", "table_page"]

_LIVE = ("running", "pending")


class RunTable:
    """The rows of the run table, kept between refreshes.

    Args:
        store: the spectrum store (read only).
    """

    def __init__(self, store: SpectrumStore) -> None:
        self.store = store
        self._full: dict[str, RunSummary] = {}  # run → its last read with the step columns

    def quick(self) -> list[RunSummary]:
        """Every run from its ``zarr.json`` and lease (step columns from the last full read, if any)."""
        return [self._full.get(s.id, s) if self._same(s) else s for s in run_summaries(self.store, steps=False)]

    def _same(self, s: RunSummary) -> bool:
        old = self._full.get(s.id)
        return old is not None and (old.status, old.reason) == (s.status, s.reason) and s.status not in _LIVE

    def refresh(self) -> list[RunSummary]:
        """Every run, the step columns re-read for the runs that may have moved on."""
        rows = self.quick()
        stale = [s.id for s in rows if s.steps_done is None or s.status in _LIVE or not self._same(s)]
        for s in run_summaries(self.store, stale):
            self._full[s.id] = s
        return [self._full.get(s.id, s) for s in rows]

    def fields(self) -> list[str]:
        """The spec fields the store's sweeps vary (the table's extra columns)."""
        out: list[str] = []
        for name in sorted(self.store.sweeps()):
            out += varied_fields(self.store.sweep_spec(name))
        return list(dict.fromkeys(f for f in out if f != "seed")) + (["seed"] if "seed" in out else [])

    def columns(self, rows: list[RunSummary], fields: list[str]) -> dict[str, list[Any]]:
        """The table's columns (a Bokeh ``ColumnDataSource``'s data)."""
        names: dict[str, list[str]] = {}  # a run in two sweeps (one spec in two grids) names both, as runs() does
        for name, ids in sorted(self.store.sweeps().items()):
            for rid in dict.fromkeys(ids):
                names.setdefault(rid, []).append(name)
        member = {rid: ", ".join(ns) for rid, ns in names.items()}
        flat = [flatten_spec(s.spec) for s in rows]
        cols: dict[str, list[Any]] = {
            "id": [s.id for s in rows],
            "href": [f"run?id={quote(s.id, safe='')}" for s in rows],
            "sweep": [member.get(s.id, "") for s in rows],
            "status": [s.status or "" for s in rows],
            "progress": [f"{'…' if s.steps_done is None else s.steps_done}/{s.steps_total}" for s in rows],
            "last_step": [np.nan if s.last_step is None else s.last_step for s in rows],
            "loss": [s.loss for s in rows],
            "lambda_max": [s.lambda_max for s in rows],
            "reason": [s.reason or "" for s in rows],
        }
        for f in fields:
            cols[f] = [str(fl.get(f, "")) for fl in flat]
        return cols


def table_page(store: SpectrumStore, refresh_s: float, shared: Shared | None = None) -> Any:
    """The Bokeh app function of ``/``: one :class:`RunTable` for every session, its reads shared
    (``shared``: one listing per refresh interval, whatever the number of viewers)."""
    from nsa_dist.serve._live import Shared, prepared

    shared = shared if shared is not None else Shared()
    table = RunTable(store)

    def listing(full: bool) -> tuple[list[RunSummary], list[str], dict[str, list[Any]], str]:
        rows = table.refresh() if full else table.quick()
        fields = table.fields()
        return rows, fields, table.columns(rows, fields), _sweep_links(store.sweeps(), {s.id for s in rows})

    def build(args: dict[str, str]) -> Any:
        from bokeh.layouts import column
        from bokeh.models import (
            ColumnDataSource,
            DataTable,
            Div,
            HTMLTemplateFormatter,
            NumberFormatter,
            ScientificFormatter,
            TableColumn,
        )

        # the last full listing when there is one; else the quick one (metadata only: hundreds of
        # runs appear at once), the step columns following at the first refresh
        rows, fields, cols, links = shared.latest(("table",)) or shared.get(
            ("table-quick",), lambda: listing(False), refresh_s
        )
        source = ColumnDataSource(cols)
        link = HTMLTemplateFormatter(template='<a href="<%- href %>"><%- value %></a>')  # <%- %>: HTML-escaped
        num = ScientificFormatter(precision=4, nan_format="—")
        columns = [
            TableColumn(field="id", title="run", formatter=link, width=220),
            TableColumn(field="sweep", title="sweep", width=100),
            TableColumn(field="status", title="status", width=90),
            TableColumn(field="progress", title="steps done", width=80),
            TableColumn(
                field="last_step", title="last t", formatter=NumberFormatter(format="0", nan_format="—"), width=70
            ),
            TableColumn(field="loss", title="loss", formatter=num, width=100),
            TableColumn(field="lambda_max", title="λ_max", formatter=num, width=100),
        ]
        columns += [TableColumn(field=f, title=f, width=90) for f in fields]
        columns.append(TableColumn(field="reason", title="reason", width=400))
        grid = DataTable(
            source=source,
            columns=columns,
            width=1300,
            height=min(800, 60 + 28 * max(len(rows), 3)),
            index_position=None,
            css_classes=["nsa-runs"],
        )
        count = Div(text=_count_text(rows), css_classes=["nsa-count"])
        sweeps = Div(text=links)
        root = column(Div(text=f"<h2>nsa-dist store {html.escape(store.url)}</h2>"), count, sweeps, grid)

        def apply(got: Any) -> None:
            if isinstance(got, BaseException):
                count.text = f"<b>cannot read the store:</b> {html.escape(str(got))}"
                return
            new_rows, new_fields, new_cols, new_links = got
            # a field no sweep varies any more is left blank; a new one's column comes with a reload
            source.data = {**{f: [""] * len(new_rows) for f in fields if f not in new_fields}, **new_cols}
            count.text, sweeps.text = _count_text(new_rows), new_links

        def read() -> Any:
            try:
                return shared.get(("table",), lambda: listing(True), refresh_s)
            except Exception as exc:  # noqa: BLE001 — an outage of the store is shown, and retried next tick
                return exc

        def attach(doc: Document) -> None:
            from nsa_dist.serve._live import every

            doc.title = f"nsa serve — {store.url}"
            doc.add_root(root)
            every(doc, refresh_s, read, apply)

        return attach

    return prepared(build)


def _count_text(rows: list[RunSummary]) -> str:
    by: dict[str, int] = {}
    for s in rows:
        by[s.status or "?"] = by.get(s.status or "?", 0) + 1
    parts = ", ".join(f"{n} {html.escape(k)}" for k, n in sorted(by.items()))
    return f"{len(rows)} runs" + (f" ({parts})" if parts else "")


def _sweep_links(sweeps: dict[str, list[str]], listed: set[str] | None = None) -> str:
    """The sweeps' links, each with its number of runs — "k of n runs" while only k of the n runs
    the sweep names are in the table yet (a sweep names its runs before they start)."""
    if not sweeps:
        return ""

    def count(ids: list[str]) -> str:
        k = len(ids) if listed is None else len(set(ids) & listed)
        return f"{len(ids)} runs" if k == len(ids) else f"{k} of {len(ids)} runs"

    links = " · ".join(
        f'<a href="sweep?name={html.escape(quote(n, safe=""))}">{html.escape(n)}</a> ({count(ids)})'
        for n, ids in sorted(sweeps.items())
    )
    return f"sweeps: {links}"
