"""Megatron tensor parallelism, combined with data parallelism: tensor=4 x data=2.

    .venv/bin/python recipes/tp.py

Rules: attention heads, MLP width and vocabulary over `tensor`, for weights and
activations alike; the batch over `data`. Each layer's forward pass has two
all-reduces of the `[batch, seq, embed]` activations (after the attention output
projection and after the MLP down projection).
"""

from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt import parallel as par
from eqgpt.parallel import Strategy

mesh = par.make_mesh("data=2,tensor=4")  # nano has 4 heads: one per tensor rank
rules = par.preset_rules("dp+tp")
print(rules)
train(Strategy(mesh, rules))
