"""Data parallelism on 8 devices: every device holds the whole model and a slice of the batch.

    .venv/bin/python recipes/dp.py

Rules: batch over `data`; no weight dimension is split. The compiler inserts one
all-reduce of the gradients (all parameter bytes) per step.
"""

from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt import parallel as par
from eqgpt.parallel import Strategy

mesh = par.make_mesh("data=8")  # or par.make_mesh(par.MeshConfig(data=-1))
rules = par.preset_rules("dp")      # = par.DP: {"batch": "data"} for activations
print(rules)
train(Strategy(mesh, rules))
