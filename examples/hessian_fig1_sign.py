"""E[Tr S] at initialisation for the three nonlinearities of the Hessian paper's Fig. 1, over many seeds.

E[Tr S] = E[(Y − Y*)ᵀ G] / N = E[Yᵀ G] / N (the target part has mean 0), estimated as the mean over
seeds of (1/N) fᵀG with G_i = Σ_p ∂²f(x_i)/∂θ_p² probed by ``output_hessian_traces``.  The same nets
and points as ``hessian_fig1.yaml`` (3 layers, width 128, NTK parametrisation, 32 points of the 2-D
image data); the README reports what it printed (76 s on 2 shared cores).

    PYTHONPATH=. python examples/hessian_fig1_sign.py [seeds]
"""

import sys
import time

import numpy as np
import torch

from nsa_dist.config import DataSpec, ModelSpec
from nsa_dist.data import load_dataset
from nsa_dist.hessian import output_hessian_traces
from nsa_dist.models import build_model

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 150
X = torch.tensor(load_dataset(DataSpec(n=32), seed=0).X, dtype=torch.float64)
t0 = time.time()
for act in ["softplus", "atan", "softplus_normalized"]:
    v = []
    for s in range(seeds):
        spec = ModelSpec(input_dim=2, depth=3, width=128, activation=act, init="ntk", bias_scale=0.1)
        m = build_model(spec, seed=1000 + s, dtype=torch.float64)
        G = output_hessian_traces(m, X, 8, seed=s).estimate[:, 0]
        with torch.no_grad():
            v.append(np.mean(m(X).numpy() * G))
    v = np.array(v)
    print(
        f"{act}: E[fᵀG]/N = {v.mean():+.4f} ± {v.std(ddof=1) / np.sqrt(len(v)):.4f} "
        f"(n={len(v)}, sd {v.std(ddof=1):.3f})  {time.time() - t0:.0f} s",
        flush=True,
    )
