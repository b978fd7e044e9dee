"""``nsa serve`` under many viewers of a live run.  Run:
``python benchmarks/serve_load.py [--viewers 30] [--seconds 120] [--arrive 1] [--json FILE]``.

A run is being written while it is served: a subprocess records a small Tracker run (N = 30,
2×16 tanh net, spectrum with eigenvector images, a Hessian block) into a fresh store, one
recorded step every ``--pace`` seconds, for longer than the benchmark lasts.  ``nsa serve`` runs
in a second subprocess (``--refresh 2``, its default), and its output is kept.  Then, in this
process:

* baseline: one viewer opens the run's page, watches it, and reopens it every 5 s for
  ``--baseline-seconds``;
* load: ``--viewers`` viewers arrive one every ``--arrive`` seconds and all watch the page until
  ``--seconds`` after the first arrived; in the second half each reopens its page once (in
  arrival order, ``--arrive`` apart: page loads while every other viewer is watching; the old
  session is closed and the server destroys it).

A viewer makes the requests a browser makes for the page, without drawing (30 Chromium pages
drawing ~25 canvases each would take this 2-core machine's CPU from the server they measure): the
page's GET, its scripts (BokehJS, fetched at every open as if no browser cached them), then the
figures' JSON from ``run/data`` — the page load is the time from the GET to that answer — and
then, as the page's script does, ``run/data`` every ``--refresh`` seconds saying which state it
shows (an answer with new figures is a redraw).

Printed: page load max / p95 / median with 1 and with N viewers and their ratio; the server's
resident memory (VmRSS, sampled every second) when the load starts, when it ends, its maximum,
and the maxima of the first and second half (flat: about equal); the redraws (live updates)
each viewer received; the load average; and the count of ``Traceback`` and ``ERROR`` lines in the server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------- the live run's writer
def write(url: str, recorded: int, pace: float) -> None:
    """A user's GD loop recording into ``url`` through a Tracker: ``recorded`` recorded steps,
    one every ``pace`` seconds (the loop sleeps between them)."""
    import torch

    from nsa_dist import Tracker
    from nsa_dist.config import DataSpec, ModelSpec
    from nsa_dist.data import load_dataset
    from nsa_dist.models import build_model

    every = 2
    steps = recorded * every
    data = load_dataset(DataSpec(n=30), seed=0)
    model = build_model(ModelSpec(depth=2, width=16), seed=0)
    tr = Tracker(
        url,
        "live",
        model,
        data.X,
        data.y,
        steps=steps,
        record={"every": every},
        spectrum={"k": 8, "images": [1, 2], "image_size": 6, "fourier_size": 5},
        optimizer="gd",
        hessian={"probes": 4, "rayleigh_k": 0, "top_k": 1, "density": False},
        max_inflight=1,
    )
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    for t in range(steps):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).reshape(len(X), -1).sum(1).mean()
        if tr.due(t):
            tr.record(t, lr=0.25, loss=loss.item())
            print(f"recorded t = {t}", flush=True)
            time.sleep(pace)
        else:
            tr.log(t, loss.item())
        loss.backward()
        opt.step()
    tr.close()


def _steps_done(url: str) -> int:
    from nsa_dist.store import SpectrumStore, run_summaries

    if not (Path(url) / "runs" / "live" / "zarr.json").exists():
        return 0
    rows = run_summaries(SpectrumStore(url, mode="r"))
    return (rows[0].steps_done or 0) if rows else 0


# --------------------------------------------------------------------------- the server's memory
class Rss(threading.Thread):
    """The resident memory (VmRSS, MiB) of process ``pid``, sampled every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.period, self.samples, self.stop = pid, period, [], threading.Event()

    def now(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for process {self.pid}")

    def run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                self.samples.append((time.monotonic(), self.now()))
            except (OSError, RuntimeError):
                return


# --------------------------------------------------------------------------- a viewer: the page's requests
async def _page_view(
    page: str,
    opens: list[float],
    end: float,
    refresh: float,
    loads: list[float],
    patches: list[int],
    errors: list[str],
) -> None:
    """Open ``page`` as a browser does (GET the HTML, its scripts, then the figures' JSON from
    ``run/data``) at each time of ``opens`` (``time.monotonic()``), then poll ``run/data`` every
    ``refresh`` seconds as the page's script does (saying which state it shows; an answer with
    figures is a redraw) until the next open or ``end``."""
    from urllib.parse import urlencode, urljoin

    from tornado.httpclient import AsyncHTTPClient

    http = AsyncHTTPClient(force_instance=True, max_clients=2)
    rid = page.split("id=", 1)[1]
    n = 0

    async def data(have: str) -> dict:
        url = urljoin(page, "run/data?" + urlencode({"id": rid, "tab": "0", "c": "{}", "have": have}))
        return json.loads((await http.fetch(url, request_timeout=300)).body)

    for j, at in enumerate(opens):
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        until = opens[j + 1] if j + 1 < len(opens) else end
        t0 = time.perf_counter()
        try:
            body = (await http.fetch(page, request_timeout=300)).body.decode()
            scripts = re.findall(r'<script src="([^"]+)"', body)
            if not scripts or "run/data" not in body:
                raise RuntimeError(f"not a run page ({body[:200]!r})")
            for src in scripts:  # BokehJS (a browser may have it cached: this counts it every time)
                await http.fetch(urljoin(page, src), request_timeout=300)
            got = await data("")
            if not (got.get("page") or {}).get("items"):
                raise RuntimeError(f"no figures in the answer ({str(got)[:200]})")
            loads.append(time.perf_counter() - t0)
            have = got["page"]["seen"]
            while time.monotonic() + refresh < until:
                await asyncio.sleep(refresh)
                got = await data(have)
                if got["page"]["items"]:
                    n += 1
                    have = got["page"]["seen"]
        except Exception as exc:  # noqa: BLE001 — counted and reported
            errors.append(f"{type(exc).__name__}: {exc}")
    patches.append(n)
    http.close()


def viewers(
    page: str, schedule: list[list[float]], end: float, refresh: float
) -> tuple[list[float], list[int], list[str]]:
    """One viewer per entry of ``schedule`` (its open times, seconds from now), all watching
    until ``end`` seconds from now: (page load times, redraws received per viewer, errors)."""
    loads: list[float] = []
    patches: list[int] = []
    errors: list[str] = []

    async def main() -> None:
        t0 = time.monotonic()
        await asyncio.gather(
            *(
                _page_view(page, [t0 + t for t in opens], t0 + end, refresh, loads, patches, errors)
                for opens in schedule
            )
        )

    asyncio.run(main())
    return loads, patches, errors


# --------------------------------------------------------------------------- the benchmark
def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))] if s else float("nan")


def _summary(loads: list[float]) -> dict[str, float]:
    return {
        "n": len(loads),
        "max_s": max(loads) if loads else float("nan"),
        "p95_s": _pct(loads, 0.95),
        "median_s": statistics.median(loads) if loads else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--viewers", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--baseline-seconds", type=float, default=20.0)
    ap.add_argument("--arrive", type=float, default=1.0, help="seconds between two viewers' arrivals")
    ap.add_argument("--pace", type=float, default=3.0, help="seconds between the live run's recorded steps")
    ap.add_argument("--refresh", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--write", nargs=3, metavar=("URL", "RECORDED", "PACE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.write:
        write(a.write[0], int(a.write[1]), float(a.write[2]))
        return

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tmp = Path(tempfile.mkdtemp(prefix="serve_load_"))
    url = str(tmp / "live.zarr")
    total = a.baseline_seconds + a.seconds + 60
    recorded = int(total / a.pace) + 2
    writer = subprocess.Popen(
        [sys.executable, __file__, "--write", url, str(recorded), str(a.pace)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "writer.log", "w"),
        env=env,
    )
    log = open(tmp / "serve.log", "w+")
    server = None
    try:
        end = time.time() + 300
        while _steps_done(url) < 1:
            if writer.poll() is not None or time.time() > end:
                raise SystemExit(
                    f"the writer stopped before its first step: {(tmp / 'writer.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        server = subprocess.Popen(
            [sys.executable, "-m", "nsa_dist.cli", "serve", url, "--port", "0", "--refresh", str(a.refresh)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        line = server.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        if not m:
            raise SystemExit(f"nsa serve printed {line!r}")
        page = m.group(1) + "run?id=live"
        rss = Rss(server.pid)
        rss.start()
        steps0 = _steps_done(url)
        base_loads, base_patches, base_err = viewers(
            page, [list(range(0, int(a.baseline_seconds), 5))], a.baseline_seconds, a.refresh
        )
        t_load = time.monotonic()
        rss_start = rss.now()
        half = a.seconds / 2
        schedule = [[i * a.arrive, half + i * a.arrive] for i in range(a.viewers)]
        loads, patches, errors = viewers(page, schedule, a.seconds, a.refresh)
        t_end = time.monotonic()
        rss_end = rss.now()
        steps1 = _steps_done(url)
        time.sleep(3 * a.refresh + 2)  # the closed sessions' reads come back; the log says if that hurts
        rss.stop.set()
        t_stop = t_load + a.seconds  # the viewers' end (loads slower than that end later: t_end)
        during = [v for t, v in rss.samples if t_load <= t <= t_end]
        mid = t_load + a.seconds / 2
        first = [v for t, v in rss.samples if t_load <= t < mid]
        second = [v for t, v in rss.samples if mid <= t <= t_stop]
        at_stop = min(rss.samples, key=lambda tv: abs(tv[0] - t_stop))[1]
    finally:
        for proc in (server, writer):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:  # a saturated server: stop it
                    proc.kill()
                    proc.wait(timeout=30)
    log.seek(0)
    text = log.read()
    out = {
        "viewers": a.viewers,
        "seconds": a.seconds,
        "arrive_s": a.arrive,
        "refresh_s": a.refresh,
        "live_steps_during": [steps0, steps1],
        "one_viewer": _summary(base_loads),
        "n_viewers": _summary(loads),
        "ratio_max": (max(loads) / max(base_loads)) if loads and base_loads else None,
        "ratio_p95": (_pct(loads, 0.95) / _pct(base_loads, 0.95)) if loads and base_loads else None,
        "redraws_per_viewer": {"min": min(patches) if patches else None, "max": max(patches) if patches else None},
        "last_load_returned_after_s": round(t_end - t_load, 1),
        "rss_mib": {
            "start": round(rss_start, 1),
            "end": round(at_stop, 1),
            "after_last_load": round(rss_end, 1),
            "max": round(max(during), 1),
            "max_first_half": round(max(first), 1),
            "max_second_half": round(max(second), 1),
        },
        "errors": {"viewer": len(base_err) + len(errors), "first": (base_err + errors)[:3]},
        "server_log": {
            "Traceback": text.count("Traceback"),
            "ERROR": sum("ERROR" in ln for ln in text.splitlines()),
            "lines": len(text.splitlines()),
        },
    }
    uptime = os.getloadavg()
    out["load_average_at_end"] = [round(x, 2) for x in uptime]
    print(f"viewers as the page's requests; live run: steps done {steps0} → {steps1} during the benchmark")
    for name, s in (("1 viewer", out["one_viewer"]), (f"{a.viewers} viewers", out["n_viewers"])):
        print(
            f"page load, {name}: {s['n']} loads, max {s['max_s']:.2f} s, p95 {s['p95_s']:.2f} s, "
            f"median {s['median_s']:.2f} s"
        )
    print(f"ratio {a.viewers} viewers / 1 viewer: max {out['ratio_max']:.2f}×, p95 {out['ratio_p95']:.2f}×")
    r = out["rss_mib"]
    print(
        f"server RSS (MiB): start {r['start']}, end {r['end']} (after the last load, "
        f"{out['last_load_returned_after_s']} s in: {r['after_last_load']}), max {r['max']} "
        f"(max in the first half {r['max_first_half']}, in the second half {r['max_second_half']})"
    )
    print(f"redraws (answers with new figures) per viewer: {out['redraws_per_viewer']}")
    print(f"load average at the end (1, 5, 15 min): {out['load_average_at_end']}")
    print(f"viewer errors: {out['errors']['viewer']} {out['errors']['first']}")
    print(
        f"server log: {out['server_log']['Traceback']} Traceback, {out['server_log']['ERROR']} ERROR lines "
        f"of {out['server_log']['lines']}"
    )
    if out["server_log"]["Traceback"]:
        print(text[-3000:])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
