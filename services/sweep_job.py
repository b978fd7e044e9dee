"""Ray Job entry point: run a sweep on the cluster this job was submitted to.

    python services/sweep_job.py SWEEP.yaml --store URL

It joins the cluster (``address="auto"``) and is exactly ``nsa sweep SWEEP.yaml --address auto``;
the store URL must be shared storage every node reaches (``s3://…``, ``gs://…``, NFS path).
"""

from __future__ import annotations

import sys

from nsa_dist.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(["sweep", *args, "--address", "auto", "--plain"]))
