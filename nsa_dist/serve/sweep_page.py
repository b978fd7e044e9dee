"""The page at ``/sweep?name=NAME``: a sweep's cross-run figures (NSA Fig. 7a–c), one line per grid
point (mean over seeds, band ± one standard deviation), the grid's fields as selectors.

The curves come from :meth:`nsa_dist.client.Sweep.curves`, the same as ``nsa plot --sweep``.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.serve._live import PALETTE, Panel, new_figure, positive

if TYPE_CHECKING:
    from bokeh.document import Document

    from nsa_dist.store import SpectrumStore
    from nsa_dist.client import Curve, Sweep

__all__ = ["sweep_page", "SweepFigure"]

# name, title, Sweep.curves quantity, x shift (log x of t + 1), log axes
_FIGURES = (("7a", "NSA Fig. 7a — label energy E_t(y, k)", "energy_y", 0, False),
            ("7b", "NSA Fig. 7b — training loss L(θ_t)", "loss", 1, True),
            ("7c", "NSA Fig. 7c — test loss", "loss_test", 1, True))


class SweepFigure(Panel):
    """One of Fig. 7a–c: a line per selected grid point, with the seeds' ± std band."""

    def __init__(self, label: str, title: str, quantity: str, shift: int, log: bool) -> None:
        from bokeh.models import ColumnDataSource

        self.title, self.quantity, self.shift = title, quantity, shift
        self.lines = ColumnDataSource({"xs": [], "ys": [], "color": [], "label": []})
        self.bands = ColumnDataSource({"xs": [], "ys": [], "color": []})
        fig = new_figure("", "step t + 1" if shift else "step t", title.split("—")[-1].strip(), x_log=log, y_log=log,
                         width=620, height=380)
        fig.patches("xs", "ys", source=self.bands, fill_color="color", fill_alpha=0.2, line_alpha=0)
        fig.multi_line("xs", "ys", source=self.lines, line_color="color", line_width=1.6, legend_field="label")
        fig.legend.location = "top_right" if log else "bottom_right"
        super().__init__(fig)

    def read(self, args: tuple["Sweep", int | None, dict[str, list[str]]]) -> list["Curve"]:
        sweep, k, chosen = args
        curves = sweep.curves(self.quantity, k if self.quantity.startswith("energy_") else None)
        return [c for c in curves if all(str(c.key[f]) in chosen.get(f, [str(c.key[f])]) for f in c.key)]

    def show(self, curves: list["Curve"]) -> None:
        lines: dict[str, list[Any]] = {"xs": [], "ys": [], "color": [], "label": []}
        bands: dict[str, list[Any]] = {"xs": [], "ys": [], "color": []}
        log = self.shift > 0
        for j, c in enumerate(curves):
            color = PALETTE[j % len(PALETTE)]
            x = c.t + float(self.shift)
            lines["xs"].append(x)
            lines["ys"].append(positive(c.mean) if log else c.mean)
            lines["color"].append(color)
            lines["label"].append(c.label)
            if c.n > 1:
                lo, hi = c.mean - c.std, c.mean + c.std
                bands["xs"].append(np.concatenate([x, x[::-1]]))
                bands["ys"].append(np.concatenate([positive(lo) if log else lo, (positive(hi) if log else hi)[::-1]]))
                bands["color"].append(color)
        self.bands.data, self.lines.data = bands, lines


def sweep_page(store: "SpectrumStore", refresh_s: float) -> Any:
    """The Bokeh app function of ``/sweep``."""

    def app(doc: "Document") -> None:
        from bokeh.layouts import column, row
        from bokeh.models import Div, MultiChoice, Spinner

        from nsa_dist.client import Client
        from nsa_dist.serve._live import every, query_arg

        name = query_arg(doc, "name") or ""
        client = Client.of(store)
        try:
            sweep = client.sweep(name)
        except Exception as exc:  # noqa: BLE001
            doc.add_root(Div(text=f'<a href="./">all runs</a><p class="nsa-damaged"><b>cannot open sweep '
                                  f'{html.escape(name)}:</b> {html.escape(str(exc))}</p>'))
            return
        lock = threading.Lock()
        values = {f: sorted({str(v) for v in sweep.runs[f]}) for f in sweep.fields}
        pickers = {f: MultiChoice(title=f, value=list(v), options=list(v), width=260) for f, v in values.items()}
        k = Spinner(title="k of Fig. 7a", low=1, step=1, width=120,
                    value=min(400, sweep.smallest_k()) if len(sweep.groups()) else 400)  # the paper's k, ≤ every run's K
        header = Div(text="")
        figures = [SweepFigure(*spec) for spec in _FIGURES]
        state = {"sweep": sweep}

        def args() -> tuple["Sweep", int, dict[str, list[str]]]:
            s = state["sweep"]
            kk = int(k.value)
            if len(s.groups()):
                kk = min(kk, s.smallest_k())
            return s, kk, {f: list(p.value) for f, p in pickers.items()}

        def read_all() -> tuple[str, list[Any]]:
            state["sweep"] = client.sweep(name)
            s = state["sweep"]
            done = int((s.runs["steps_done"] > 0).sum()) if len(s.runs) else 0
            text = (f'<a href="./">all runs</a><h2>sweep {html.escape(name)}</h2><p>{len(s.runs)} runs, '
                    f'{done} with a finished step; grid fields: {html.escape(", ".join(s.fields) or "none")}'
                    f'{"; mean ± std over seeds" if s.seeded else ""}</p>')
            a = args()
            return text, [f.guarded(a) for f in figures]

        def apply(got: tuple[str, list[Any]]) -> None:
            header.text = got[0]
            for f, data in zip(figures, got[1]):
                f.update(data)

        def redraw(attr: str, old: Any, new: Any) -> None:
            with lock:
                a = args()
                for f in figures:
                    f.update(f.guarded(a))

        for p in [*pickers.values(), k]:
            p.on_change("value", redraw)
        with lock:
            apply(read_all())
        doc.title = f"nsa — sweep {name}"
        doc.add_root(column(header, row(*pickers.values(), k), *(f.layout for f in figures)))
        every(doc, refresh_s, _guard(read_all), lambda got: apply(got) if not isinstance(got, BaseException) else None,
              lock)

    return app


def _guard(read: Any) -> Any:
    def guarded() -> Any:
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 — retried next tick
            return exc

    return guarded
