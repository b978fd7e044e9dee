"""The figures by name, what each needs from a run, and :func:`plot_run` which writes them as PNGs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nsa_dist.plots import (
    brackets,
    dynamics,
    eigenvalues,
    energy,
    hessian,
    images,
    inputs,
    projections,
    spectral_dynamics,
)
from nsa_dist.plots.axes import DPI, PlotOptions, readable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from nsa_dist.client import Run

_Needs = Callable[["Run"], bool]
_Draw = Callable[["Run", PlotOptions], "Figure"]


def _has(*arrays: str) -> _Needs:
    """The run stores every one of ``arrays`` (some exist only for some specs)."""
    return lambda run: all(run.has(a) for a in arrays)


def _energy(phi: str) -> _Draw:
    return lambda run, opts: energy.energy_figure(run, phi, opts)


def _plain(draw: Callable[[Run], Figure]) -> _Draw:
    """A figure with no user choices."""
    return lambda run, opts: draw(run)


def _is_2d_scalar(run: Run) -> bool:
    return run.has("eigvec_images") or (run.X.shape[1] == 2 and run.Ko == 1)


def _preservation_ready(run: Run) -> bool:
    return run.has("preservation") or len(run.eigenvector_steps) >= 2


def _projections_ready(run: Run) -> bool:
    return run.has("projections_residual") or run.has("eigenvectors")


def _at_eigenvector_steps(array: str) -> _Needs:
    """The run stores ``array`` (written at the eigenvector steps) and has finished one such step."""
    return lambda run: run.has(array) and len(run.eigenvector_steps) > 0


_EVALS = _has("eigenvalues", "lr")
_FIGURES: dict[str, tuple[_Draw, _Needs]] = {
    "fig1abc_target_output_points": (inputs.fig1abc, _is_2d_scalar),
    "fig1d_first_order": (_plain(dynamics.fig1d), _has("first_order_error", "first_order_cos")),
    "fig1e_lr_stability": (_plain(dynamics.fig1e), _EVALS),
    "fig2a_eigenvalues": (_plain(eigenvalues.fig2a), _has("eigenvalues")),
    "fig2b_eigenvalues_t": (eigenvalues.fig2b, _has("eigenvalues")),
    "fig2c_flow_speed": (_plain(eigenvalues.fig2c), _EVALS),
    "fig2d_lr_eigen": (eigenvalues.fig2d, _EVALS),
    "fig3a_energy_y": (_energy("y"), _has("energy_y")),
    "fig3b_energy_f": (_energy("f"), _has("energy_f")),
    "fig3c_energy_residual": (_energy("residual"), _has("energy_residual")),
    "fig3d_energy_df": (_energy("df_pred"), _has("energy_df_pred", "energy_df")),
    "fig3e_energy_f_test": (_energy("f_test"), _has("energy_f_test")),
    "energy_against_k": (brackets.energy_against_k, _has("energy_y")),
    "fig4a_residual_projections": (projections.fig4a, _projections_ready),
    "fig4bc_residual_fourier": (images.fig4bc, _has("residual_image", "residual_fourier")),
    "fig4d_reconstructions": (spectral_dynamics.fig4d, _at_eigenvector_steps("reconstructions")),
    "appF_gram_change": (_plain(spectral_dynamics.appF), _at_eigenvector_steps("gram_change")),
    "eqs45_constant_gram": (spectral_dynamics.eqs45, _has("constant_gram_residual", "constant_gram_energy")),
    "fig5_eigenvectors": (images.fig5, _has("eigvec_images", "eigvec_fourier", "image_indices")),
    "fig6_eigenvectors_early": (images.fig6, _has("eigvec_images", "eigvec_fourier", "image_indices")),
    "fig7d_preservation": (projections.fig7d, _preservation_ready),
    "loss": (_plain(dynamics.loss), _has("loss_trace", "loss")),
    "hessian_moments": (_plain(hessian.moments), _has("hessian_moments", "hessian_moments_I_exact")),
    "hessian_orthogonality": (_plain(hessian.orthogonality), _has("hessian_orthogonality")),
    "hessian_fig3_rayleigh": (_plain(hessian.rayleigh), _has("hessian_rayleigh")),
    "hessian_edge_of_stability": (_plain(hessian.edge_of_stability), _has("hessian_top")),
    "hessian_density": (_plain(hessian.density), _has("hessian_density")),
    "hessian_I_spectrum": (_plain(hessian.I_spectrum), _has("hessian_I_eigenvalues", "hessian_I_limit_eigenvalues")),
    "hessian_additivity": (_plain(hessian.additivity), _has("hessian_additivity", "hessian_moments")),
    "hessian_trace_S": (_plain(hessian.trace_S), _has("hessian_trace_S_G", "hessian_moments")),
    "hessian_S_norms": (_plain(hessian.S_norms), _has("hessian_S_op", "hessian_moments")),
}
FIGURES: tuple[str, ...] = tuple(_FIGURES)


def _check_names(figures: Iterable[str] | str | None) -> list[str]:
    if figures is None:
        return list(FIGURES)
    names = [figures] if isinstance(figures, str) else list(figures)
    bad = [n for n in names if n not in _FIGURES]
    if bad:
        raise ValueError(f"unknown figure(s) {', '.join(map(repr, bad))}; allowed: {', '.join(FIGURES)}")
    return list(dict.fromkeys(names))


def make_figure(run: Run, name: str, opts: PlotOptions | None = None) -> Figure | None:
    """Figure ``name`` (one of :data:`FIGURES`) of ``run``, or None when the run did not record its data.

    ``opts`` chooses the steps of the at-a-step figures, the pair of Fig. 7d and the k drawn.

    Raises:
        ValueError: unknown ``name``, a run with no finished recorded step, a chosen step
            that is not a finished recorded step, or a chosen k the run did not measure.
    """
    _check_names([name])
    _require_steps(run)
    opts = opts or PlotOptions()
    opts.check_steps(run)
    opts.check_ks(run)
    draw, needs = _FIGURES[name]
    return draw(run, opts) if needs(run) else None


def _require_steps(run: Run) -> None:
    if not len(run.steps):
        raise ValueError(
            f"run {run.id!r} has no finished recorded step yet (status {run.status!r}, "
            f"0/{len(run.schedule)} steps): nothing to plot; wait for a step, then run.refresh()"
        )


def plot_run(
    run: Run, out_dir: str | Path, *, figures: Iterable[str] | str | None = None, opts: PlotOptions | None = None
) -> list[Path]:
    """Write ``<out_dir>/<name>.png`` for each figure of the NSA paper the run has data for.

    Args:
        run: a :class:`nsa_dist.client.Run` (``Client(url).run(id)``).
        out_dir: folder for the PNGs, created if missing.
        figures: names from :data:`FIGURES` to draw (default all); figures whose arrays the run
            lacks (test points, eigenvectors, 2-D images) are skipped.
        opts: :class:`PlotOptions` — steps (Figs. 1a–c, 4a–d, 6, energy_against_k), the pair of Fig. 7d, the k list.

    Returns:
        The paths written, in the order of :data:`FIGURES` (or of ``figures``).

    Raises:
        ValueError: an unknown figure name (the message lists the allowed ones), a run with no
            finished recorded step, or a chosen step or k the run did not record (named).
        StoreError: a damaged array (the figures that do not read it are written first; the error
            says how many and names the damaged file) — the first error of a figure, whatever it is.
    """
    names = _check_names(figures)
    _require_steps(run)
    opts = opts or PlotOptions()
    opts.check_steps(run)
    opts.check_ks(run)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, skipped, failed = [], [], {}
    for name in names:
        try:
            fig = make_figure(run, name, opts)
        except Exception as exc:  # noqa: BLE001 - a damaged chunk: the figures that do not read it are still drawn
            failed[name] = exc
            continue
        if fig is None:
            skipped.append(name)
            continue
        path = out / f"{name}.png"
        readable(fig).savefig(path, dpi=DPI)
        written.append(path)
    if failed:  # one damaged chunk stopped the whole plot after the first figures (an audit): the first
        # error, its type kept, saying what was drawn and what was not
        first = next(iter(failed.values()))
        first.args = (
            f"{len(written)} figure(s) written to {out}; {len(failed)} not drawn ({', '.join(failed)}): {first}",
        )
        raise first
    if figures is not None and skipped:  # asked for by name: never a silent nothing
        what = f"run {run.id!r} has no data for {', '.join(skipped)} (its spec did not measure what they draw)"
        if not written:
            raise ValueError(f"no figure drawn: {what}")
        logging.getLogger("nsa_dist").warning("not drawn: %s", what)
    return written
