"""``nsa serve STORE``: a read-only web view of a spectrum store, live while writers add steps.

Pages: ``/`` every run as a table and ``/sweep?name=NAME`` every figure of ``nsa plot --sweep``
(Bokeh server sessions); ``/run?id=RUN`` one run's figures — every one ``nsa plot`` draws, a tab
per paper (NSA, Hessian), titled with the papers' figure numbers — as a static page whose script
embeds the open tab's figures, built once per state of the run and shared by its viewers
(``/run/data``, see :class:`~nsa_dist.serve.run_page.RunPages`).  It reads the store only — never the
actors — and never writes to it; every string read from the store is HTML-escaped before it
reaches a page.  Needs the ``serve`` extra (bokeh); bokeh is imported when a server is made.

Owns: the web pages, their panels and the server's access rules (loopback, token).
May import: :mod:`nsa_dist.store`, the readers (``client``, ``frames``, ``sweep_view``),
:mod:`nsa_dist.plots` (its public ``plots.axes`` and data helpers: ``residual_projections``,
``plots.sweep.fit_slope``; never a matplotlib figure), ``errors``, ``_extras``, bokeh, tornado
and NumPy — never the pipeline, the numerics' solvers, Ray or a writer.  The physics comes
computed from the readers; a page only arranges it.
"""

from nsa_dist.serve._server import TOKEN_ENV, ServeOptions, is_loopback, make_server, serve

__all__ = ["TOKEN_ENV", "ServeOptions", "is_loopback", "make_server", "serve"]
