"""Custom sharding annotations: your own rule set, and per-module overrides.

    .venv/bin/python recipes/custom_rules.py

A rule set is two tables from logical names to mesh axes, one for weights and
one for activations. Here a hand-written one ("2-D weight sharding": `embed` over
`fsdp` and the MLP width over `tensor`, batch over `fsdp`), and overrides that
give the attention Megatron layout and the token table a vocabulary split.
Nothing in the model changes: the modules only name their dimensions.
"""

from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt import parallel as par
from eqgpt.parallel import Strategy

mesh = par.make_mesh("fsdp=4,tensor=2")
base = par.Rules(
    params={"embed": "fsdp", "mlp": "tensor"},
    activations={"batch": "fsdp", "mlp": "tensor"},
    name="2d-mlp",
)
overrides = {
    # Attention: heads over tensor (and FSDP on embed), activations split by heads.
    "blocks.attn": base.merge(par.preset_rules("tp")).update(activations={"vocab": None, "mlp": None}),
    # The token table (also the tied head): split over vocab on tensor, not over embed.
    "tok_embed": base.update(params={"vocab": "tensor", "embed": None}),
}
for path, rules in overrides.items():
    print(f"{path}: {rules}")
train(Strategy(mesh, base, overrides=overrides))
