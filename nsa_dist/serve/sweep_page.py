"""The page at ``/sweep?name=NAME``: a sweep's cross-run figures, every one ``nsa plot --sweep``
draws — NSA Fig. 7a–c (one line per grid point, mean over seeds, band ± one standard
deviation), the final E(y, 10) against the grid, and for a sweep with a ``hessian:`` block the
Hessian paper's Fig. 1 moments per grid point, the width convergence of I to its limit and the
NTK-vs-active regimes over width — with the grid's fields as selectors.

The curves come from :meth:`nsa_dist.client.Sweep.curves` and :meth:`~nsa_dist.client.Sweep.scalar`,
the same as ``nsa plot --sweep``; Fig. 7a's default k is :func:`nsa_dist.plots.axes.energy_k`.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.plots.axes import energy_k
from nsa_dist.plots.sweep import fit_slope
from nsa_dist.serve._curves import Curves, Plot, Series, color

if TYPE_CHECKING:
    from bokeh.document import Document

    from nsa_dist.client import Curve, Sweep
    from nsa_dist.serve._live import Shared
    from nsa_dist.store import SpectrumStore

__all__ = ["sweep_page", "SweepFigure", "ScalarFigure", "HessianMoments", "WidthConvergence", "Regimes", "sweep_panels"]

_WIDTH = "model.width"
# name, title, Sweep.curves quantity, x shift (log x of t + 1), log axes
_FIGURES = (
    ("7a", "NSA Fig. 7a — label energy E_t(y, k)", "energy_y", 0, False),
    ("7b", "NSA Fig. 7b — training loss L(θ_t)", "loss", 1, True),
    ("7c", "NSA Fig. 7c — test loss", "loss_test", 1, True),
)
_NAMES = {"7a": "fig7a_energy_y", "7b": "fig7b_train_loss", "7c": "fig7c_test_loss"}

Args = tuple["Sweep", int, dict[str, list[str]]]  # the sweep, Fig. 7a's k, the chosen value(s) of each field


def _keep(args: Args, key: dict[str, Any]) -> bool:
    """Whether the grid point ``key`` is among the chosen values of each field."""
    return all(str(key[f]) in args[2].get(f, [str(key[f])]) for f in key)


def _lines(curves: list[Curve], args: Args, shift: float = 0.0) -> list[Series]:
    """One series per chosen grid point: the mean over its seeds with a ± std band."""
    out = []
    for j, c in enumerate(x for x in curves if _keep(args, x.key)):
        band = (c.mean - c.std, c.mean + c.std) if c.n > 1 else None
        out.append(Series(c.t + shift, c.mean, c.label, color(j), markers=len(c.t) <= 40, band=band))
    return out


class SweepFigure(Curves):
    """One of NSA Fig. 7a–c: a line per selected grid point, with the seeds' ± std band."""

    def __init__(self, label: str, title: str, quantity: str, shift: int, log: bool) -> None:
        self.title, self.quantity, self.shift, self.figures = title, quantity, shift, (_NAMES[label],)
        y = title.split("—")[-1].strip()
        super().__init__(
            plots=(Plot("step t + 1" if shift else "step t", y, x_log=log, y_log=log, width=760, height=380),)
        )

    def series(self, args: Args) -> list[list[Series]]:
        sweep, k, _ = args
        curves = sweep.curves(self.quantity, k if self.quantity.startswith("energy_") else None)
        return [_lines(curves, args, float(self.shift))]

    def read(self, args: Args) -> dict[str, Any]:
        data = super().read(args)
        data["k"] = args[1]
        return data

    def show(self, data: dict[str, Any]) -> None:
        super().show(data)
        if self.quantity.startswith("energy_"):
            self.figs[0].yaxis.axis_label = f"E_t(y, {data['k']})"


def _by(df: Any, x: str, line: str | None, args: Args) -> list[Series]:
    """Mean ± std (over seeds) of ``df["value"]`` against field ``x``, one series per value of
    ``line`` and of every other field the sweep varies — a mean is over the seeds of one grid point
    only, never pooled over a field the figure does not draw (as ``nsa plot``'s scalar figure) —
    and NaN where one of its seeds has no value."""
    rows = df[[_keep(args, {f: r[f] for f in args[0].fields}) for r in df.to_dict("records")]] if len(df) else df
    by = ([line] if line else []) + [f for f in args[0].fields if f not in (x, line)]
    groups = [((), rows)] if not by else list(rows.groupby(by, sort=True, dropna=False))
    out = []
    for j, (lv, sub) in enumerate(groups):
        lv = lv if isinstance(lv, tuple) else (lv,)
        pts = [(xv, pt["value"].to_numpy(np.float64)) for xv, pt in sub.groupby(x, sort=True, dropna=False)]
        xs = np.asarray([xv for xv, _ in pts], np.float64)
        mean = np.asarray([v.mean() for _, v in pts])
        std = np.asarray([v.std() for _, v in pts])
        label = ", ".join(f"{f.split('.')[-1]}={v}" for f, v in zip(by, lv)) or "all"
        out.append(Series(xs, mean, label, color(j), err=std))
    return out


def _numeric(sweep: Sweep, field: str) -> bool:
    try:
        np.asarray(sweep.runs[field].to_numpy(), np.float64)
    except (TypeError, ValueError):
        return False
    return True


class ScalarFigure(Curves):
    """The final E(y, 10) against the first varied field, one line per value of the second (a
    summary of the sweep, no figure of the paper; ``nsa plot --sweep``'s ``scalar_energy_y_10``)."""

    title = "E(y, k = 10, at most K) at the last step across the sweep (a summary, no figure of the paper)"
    figures = ("scalar_energy_y_10",)

    def __init__(self, sweep: Sweep) -> None:
        self.x = sweep.fields[0]
        self.line = sweep.fields[1] if len(sweep.fields) > 1 else None
        super().__init__(plots=(Plot(self.x, "E(y, 10) at the last step", width=620),))

    def series(self, args: Args) -> list[list[Series]]:
        sweep = args[0]
        if not _numeric(sweep, self.x):
            raise ValueError(f"field {self.x!r} is not numeric: `nsa plot --sweep` draws this summary")
        self.k = min(10, sweep.smallest_k())
        return [_by(sweep.scalar("energy_y", self.k), self.x, self.line, args)]

    def read(self, args: Args) -> dict[str, Any]:
        data = super().read(args)
        data["k"] = self.k
        return data

    def show(self, data: dict[str, Any]) -> None:
        super().show(data)
        self.figs[0].yaxis.axis_label = f"E(y, {data['k']}) at the last step"


class HessianMoments(Curves):
    """Tr(A^k), k = 1..4, of A = H, I, S (chosen) per grid point along t, mean ± std over seeds
    (the Hessian paper's Fig. 1 across the sweep); with one analysed step, one point per grid
    point (x: the grid point's number, the legend names it)."""

    title = "Hessian paper Fig. 1 — moments Tr(A^k) per grid point"
    ncols = 2
    figures = ("hessian_moments_H", "hessian_moments_I", "hessian_moments_S")

    def __init__(self) -> None:
        from bokeh.models import Select

        self.part = Select(
            title="A",
            value="S",
            options=[("H", "H (loss Hessian)"), ("I", "I (Gauss-Newton)"), ("S", "S (residual part)")],
            width=200,
        )
        super().__init__(
            None, [self.part], tuple(Plot("step t", "", title=f"Tr(A^{k})", width=560, height=300) for k in range(1, 5))
        )

    def series(self, args: Args) -> list[list[Series]]:
        out = []
        for k in range(1, 5):
            curves = args[0].curves(f"hessian_{self.part.value}", k)
            if all(len(c.t) == 1 for c in curves):  # one analysed step: the grid points side by side
                kept = [c for c in curves if _keep(args, c.key)]
                out.append(
                    [Series(np.array([float(j)]), c.mean, c.label, color(j), err=c.std) for j, c in enumerate(kept)]
                )
            else:
                out.append(_lines(curves, args))
        return out


class WidthConvergence(Curves):
    """|Tr(I^k) − its Θ∞ limit| / limit over ``model.width`` at t = 0 (k = 1, 2), log-log, mean ±
    std over seeds, with the fitted slope (the NTK's fluctuations: slope ≈ −1/2)."""

    title = "Hessian paper — width convergence of I to its Θ∞ limit at t = 0"
    figures = ("hessian_width_convergence",)
    plots = (Plot("width w", "relative error", x_log=True, y_log=True, width=700),)

    def series(self, args: Args) -> list[list[Series]]:
        from nsa_dist.serve._live import Waiting

        out = []
        if len(args[0].groups()) and not any(np.isfinite(c.mean).any() for c in args[0].curves("hessian_I_limit", 1)):
            raise Waiting(
                "no Θ∞ limit of I in these runs (it applies to fully-connected init: ntk runs in the NTK "
                "regime, at their analysed steps)"
            )
        for j, k in enumerate((1, 2)):
            for s in _by(args[0].scalar("hessian_I_error", k, 0), _WIDTH, None, args):
                out.append(
                    Series(
                        s.x, s.y, f"|Tr(I^{k}) − limit| / limit: slope {fit_slope(s.x, s.y):+.2f}", color(j), err=s.err
                    )
                )
        if out and len(out[0].x):
            w = np.sort(np.asarray(out[0].x, np.float64))
            y0 = float(np.asarray(out[0].y)[np.argsort(out[0].x)][0])
            out.append(Series(w, y0 * np.sqrt(w[0] / w), "∝ w^(−1/2)", "#000000", "dotted", markers=False))
        return [out]


class Regimes(Curves):
    """Tr(S²)/Tr(I²), ‖S‖_op and ‖S‖_F over ``model.width`` at t = 0, one line per ``model.regime``
    when the sweep varies it (the consequences of Proposition 4)."""

    title = "Hessian paper, Proposition 4 — NTK vs active regime over width at t = 0"
    figures = ("hessian_regimes",)
    plots = tuple(
        Plot("width w", "", title=t, x_log=True, y_log=True, width=400, height=320)
        for t in ("Tr(S²) / Tr(I²)", "‖S‖_op (active: of w·H)", "‖S‖_F (active: of w·H)")
    )

    def series(self, args: Args) -> list[list[Series]]:
        sweep = args[0]
        line = "model.regime" if "model.regime" in sweep.fields else None
        out = []
        for name in ("hessian_S_ratio", "hessian_S_op", "hessian_S_fro"):
            df = sweep.scalar(name, None, 0)
            series = _by(df if name == "hessian_S_ratio" else sweep.as_the_paper_scales(df), _WIDTH, line, args)
            out.append(
                [Series(s.x, s.y, f"{s.label}: slope {fit_slope(s.x, s.y):+.2f}", s.color, err=s.err) for s in series]
            )
        return out


def sweep_panels(sweep: Sweep) -> list[Curves]:
    """The figures sweep ``sweep`` can draw, as ``nsa plot --sweep`` decides: Fig. 7c with test
    points, the summary with a varied field, the Hessian figures with a ``hessian:`` block (the
    width figures with a width axis)."""
    from nsa_dist.client import Run

    ids = list(sweep.runs["id"]) if len(sweep.runs) else []
    first = Run(sweep.store, ids[0]) if ids else None

    def has(name: str) -> bool:
        return first is not None and first.has(name)

    out: list[Curves] = [SweepFigure(*spec) for spec in _FIGURES if spec[2] != "loss_test" or has("loss_test")]
    if sweep.fields:
        out.append(ScalarFigure(sweep))
    if has("hessian_moments"):
        out.append(HessianMoments())
        if _WIDTH in sweep.fields:
            if has("hessian_I_limit_moments"):
                out.append(WidthConvergence())
            if has("hessian_S_op"):
                out.append(Regimes())
    return out


class _Snapshot:
    """A sweep as of one refresh, shared by every session showing it: the sweep and the header."""

    _made = 0

    def __init__(self, sweep: Sweep, name: str) -> None:
        _Snapshot._made += 1
        self.version, self.sweep = _Snapshot._made, sweep
        done = int((sweep.runs["steps_done"] > 0).sum()) if len(sweep.runs) else 0
        self.header = (
            f'<a href="./">all runs</a><h2>sweep {html.escape(name)}</h2><p>{len(sweep.runs)} runs, '
            f"{done} with a finished step; grid fields: {html.escape(', '.join(sweep.fields) or 'none')}"
            f"{'; mean ± std over seeds' if sweep.seeded else ''}</p>"
        )


def sweep_page(store: SpectrumStore, refresh_s: float, shared: Shared | None = None) -> Any:
    """The Bokeh app function of ``/sweep``: its reads go through ``shared`` — one read of the
    sweep per refresh interval, and one of each figure per state of the sweep and choice of the
    grid values and k, for every session showing it."""
    from nsa_dist.client import Client
    from nsa_dist.serve._live import Shared, off_loop, prepared

    shared = shared if shared is not None else Shared()
    client = Client.of(store)

    def snapshot(name: str) -> _Snapshot:
        return shared.get(("sweep", name), lambda: _Snapshot(client.sweep(name), name), refresh_s)

    def build(qargs: dict[str, str]) -> Any:
        from bokeh.layouts import column, row
        from bokeh.models import Div, MultiChoice, Spinner

        name = qargs.get("name") or ""
        try:
            snap = snapshot(name)
        except Exception as exc:  # noqa: BLE001
            div = Div(
                text=f'<a href="./">all runs</a><p class="nsa-damaged"><b>cannot open sweep '
                f"{html.escape(name)}:</b> {html.escape(str(exc))}</p>"
            )
            return lambda doc: doc.add_root(div)
        sweep = snap.sweep
        lock = threading.Lock()
        values = {f: sorted({str(v) for v in sweep.runs[f]}, key=_order) for f in sweep.fields}
        pickers = {
            f: MultiChoice(title=f, value=list(v), options=[(x, html.escape(x)) for x in v], width=260)
            for f, v in values.items()
        }  # MultiChoice draws its labels as HTML: escaped
        state: dict[str, Any] = {"snap": snap, "auto": True, "shown": None}
        k = Spinner(title="k of Fig. 7a", low=1, step=1, width=140, value=default_k(sweep) or 1)
        header = Div(text="")
        figures = sweep_panels(sweep)

        def args() -> Args:
            s = state["snap"].sweep
            return s, chosen_k(s, int(k.value), state["auto"]), {f: list(p.value) for f, p in pickers.items()}

        def data(f: Curves, a: Args) -> Any:
            chosen = (a[1], tuple(sorted((field, tuple(v)) for field, v in a[2].items())))
            return f.own(
                shared.get(
                    ("sweep-figure", name, state["snap"].version, f.state(), chosen), lambda: f.shareable(a), refresh_s
                )
            )

        def read_all() -> tuple[str, int, list[Any]]:
            state["snap"] = snapshot(name)
            a = args()
            return state["snap"].header, a[1], [data(f, a) for f in figures]

        def apply(got: tuple[str, int, list[Any]]) -> None:
            header.text = got[0]
            if k.value != got[1]:
                state["shown"] = got[1]
                k.value = got[1]
            for f, d in zip(figures, got[2]):
                f.update(d)

        def refreshed(got: Any) -> None:
            """A refresh's result on the page: the figures, or — the sweep or the store cannot be
            read any more (deleted, unreachable) — the error in the header, the figures hidden
            until a read succeeds again (never the last state's figures as if they were current)."""
            for f in figures:
                f.layout.visible = not isinstance(got, BaseException)
            if isinstance(got, BaseException):
                header.text = (
                    f'<a href="./">all runs</a><p class="nsa-damaged"><b>cannot read sweep {html.escape(name)} '
                    f"any more:</b> {html.escape(str(got))}; its figures come back when it can be read "
                    "again</p>"
                )
                return
            apply(got)

        apply(read_all())
        root = column(header, row(*pickers.values(), k), *(f.layout for f in figures))

        def attach(doc: Document) -> None:
            from nsa_dist.serve._live import every

            def redraw(attr: str, old: Any, new: Any) -> None:
                def read() -> list[Any]:
                    a = args()
                    return [data(f, a) for f in figures]

                off_loop(doc, read, lambda got: [f.update(d) for f, d in zip(figures, got)], lock)

            def k_changed(attr: str, old: Any, new: Any) -> None:
                if new == state["shown"]:  # set by apply, whose read drew the figures at this k already
                    return
                state["auto"] = False
                redraw(attr, old, new)

            for p in pickers.values():
                p.on_change("value", redraw)
            k.on_change("value", k_changed)
            for f in figures:
                for w in f.controls:
                    w.on_change("value", redraw)
            doc.title = f"nsa — sweep {name}"
            doc.add_root(root)
            every(doc, refresh_s, _guard(read_all), refreshed, lock)

        return attach

    return prepared(build)


def chosen_k(sweep: Sweep, value: int, auto: bool) -> int:
    """Fig. 7a's k on the sweep page: the default (:func:`default_k`) while the viewer has not chosen
    one, else the spinner's ``value`` capped to 1..K, the fewest eigenpairs a run keeps — the page
    shows the k drawn (``energy_k`` refuses a k outside: a spinner past K blanked the page, a review)."""
    if not len(sweep.groups()):
        return value
    top = sweep.smallest_k()
    return energy_k(sweep.smallest_n(), top, None if auto else min(max(int(value), 1), top))


def default_k(sweep: Sweep) -> int | None:
    """Fig. 7a's default k for ``sweep`` (:func:`~nsa_dist.plots.axes.energy_k` of its smallest N and
    K), or None before any run has a finished step."""
    return energy_k(sweep.smallest_n(), sweep.smallest_k()) if len(sweep.groups()) else None


def _order(value: str) -> tuple[int, float, str]:
    """Grid values in numeric order where they are numbers (8 before 12), else by name."""
    try:
        return 0, float(value), value
    except ValueError:
        return 1, 0.0, value


def _guard(read: Any) -> Any:
    def guarded() -> Any:
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 — retried next tick
            return exc

    return guarded
