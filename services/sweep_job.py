"""Ray Job entry point: run a sweep on the cluster this job was submitted to.

    python services/sweep_job.py SWEEP.yaml --store URL

It joins the cluster (``address="auto"``) and is exactly ``nsa sweep SWEEP.yaml --address auto``;
the store URL must be shared storage every node reaches (``s3://…``, ``gs://…``, NFS path).
"""

from __future__ import annotations

import sys

try:
    from nsa_dist.cli import main
except ModuleNotFoundError as exc:  # the job's `python` is not nsa-dist's environment: one line, no traceback
    sys.exit(
        f"nsa sweep job: {sys.executable} (Python {sys.version.split()[0]}) has no module {exc.name!r}: the job "
        "runs the `python` first on the Ray head's PATH, which is not the environment nsa-dist is installed "
        "in — start the head (`ray start --head`) with that environment activated, then submit again"
    )

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(["sweep", *args, "--address", "auto", "--plain"]))
