"""FSDP (ZeRO-3) on 8 devices: parameters, gradients and Adam moments split 8 ways.

    .venv/bin/python recipes/fsdp.py

Rules: every weight's `embed` dimension over `fsdp`; the batch over `(data, fsdp)`.
Each step all-gathers each weight before use (forward, and again in the backward
pass) and reduce-scatters its gradient. On the CPU backend the reduce-scatter
appears as "all-reduce+slice" (see docs/parallelism/fsdp.md).
"""

from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt import parallel as par
from eqgpt.parallel import Strategy

mesh = par.make_mesh("fsdp=8")
rules = par.preset_rules("fsdp")  # params {"embed": "fsdp"}, activations {"batch": ("data", "fsdp")}
print(rules)
train(Strategy(mesh, rules))
