"""Megatron sequence parallelism on top of tensor and fully sharded data parallelism.

    .venv/bin/python recipes/sp.py

`sp` is `tp` plus one activation rule, `seq -> tensor`: between the
tensor-parallel regions the residual stream, norms and residual adds are split
along the sequence. Each of TP's activation all-reduces becomes an all-gather
(entering a region) and a reduce-scatter (leaving it) of the same bytes, and the
stored activations shrink by the tensor size.
"""

from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt import parallel as par
from eqgpt.parallel import Strategy

mesh = par.make_mesh("fsdp=2,tensor=4")
rules = par.preset_rules("fsdp+sp")
print(rules.activations)  # batch -> (data, fsdp), seq -> tensor, heads/mlp/vocab -> tensor
train(Strategy(mesh, rules))
