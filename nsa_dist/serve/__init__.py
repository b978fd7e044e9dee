"""``nsa serve STORE``: a read-only web view of a spectrum store, live while writers add steps.

Pages (Bokeh server): ``/`` every run as a table, ``/run?id=RUN`` one run's figures,
``/sweep?name=NAME`` a sweep's Fig. 7a–c.  It reads the store only — never the actors — and never
writes to it.  Needs the ``serve`` extra (bokeh); bokeh is imported when a server is made.

Owns: the web pages, their panels and the server's access rules (loopback, token).
May import: :mod:`nsa_dist.store`, the readers (``client``, ``frames``, ``sweep_view``),
:mod:`nsa_dist.plots` (its public ``plots.axes``), ``errors``, ``_extras``, bokeh, tornado and
NumPy — never the pipeline, the numerics' solvers, Ray or a writer.
"""

from nsa_dist.serve._server import TOKEN_ENV, ServeOptions, is_loopback, make_server, serve

__all__ = ["TOKEN_ENV", "ServeOptions", "is_loopback", "make_server", "serve"]
