"""Overlap on the automatic path (`--overlap`) and the schedule report (`eqgpt.profile.schedule`).

Parity goes through the recipe's command line (fresh processes, as in `test_strategies`, whose
one-device run is the reference);
the prefetch and the report are read from compiled programs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.profile import collectives, schedule, schedule_summary, schedule_table
from eqgpt.profile.hlo import module_from_text
from eqgpt.profile.schedule import _Flops, _text
from eqgpt.train import Strategy
from parallel_cases import CONFIGS, sharded_run
from recipe_runs import subprocess_compile_cache
from test_benchmarks import load
from test_strategies import corpus, run, trained  # noqa: F401 (corpus is a fixture)

# No dp case: with no weights split over fsdp, overlap leaves the loss (so the program, on CPU) as it is
# (test_overlap_part_and_flags), and dp trains like one device (test_strategies).
MESHES = {"fsdp": ["--mesh", "fsdp=8", "--strategy", "fsdp"],
          "fsdp+tp": ["--mesh", "fsdp=4,tensor=2", "--strategy", "fsdp+tp"]}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_overlap_trains_like_one_device(mesh, corpus, tmp_path_factory):  # noqa: F811
    """Losses and gradient norms, 5 steps, against one device (that the same meshes without
    overlap train like one device, test_strategies and test_gradient_parity show)."""
    single = trained("single", corpus, tmp_path_factory)[0][:5]
    on = run(corpus, tmp_path_factory.mktemp(f"{mesh}-on"), "single", *MESHES[mesh], "--overlap", "--steps", "5",
             cache=subprocess_compile_cache(tmp_path_factory))
    np.testing.assert_allclose(on, single, rtol=1e-5)


# benchmarks/overlap.py's fsdp=8 case, 4 layers scanned (a loop of 3: with 2 layers XLA inlines the loop of 1).
BENCHMARK = ["--cases", "fsdp", "--layers", "4", "--embed", "32", "--seq", "32", "--batch", "8", "--steps", "1",
             "--scan"]


@pytest.fixture(scope="module")
def fsdp_steps():
    """The benchmark's fsdp step without and with overlap, compiled once for the tests that read them:
    `{overlap: (compiled, strategy, state, batch)}`."""
    bench = load("overlap")
    return {on: bench.compile_case("fsdp", on, bench.parse_args(BENCHMARK)) for on in (False, True)}


def _loop_gathers(compiled) -> tuple[dict[str, tuple[int, int]], str]:
    """Per phase, (all-gathers in its layer loop, how many feed none of that iteration's matmuls); and
    the entry computation's name (the module read once)."""
    module = module_from_text(_text(compiled))
    flops = _Flops(module)
    rows = [r for r in schedule(compiled)
            if r.collective.kind == "all-gather" and r.collective.computation != module.entry]
    counts = {}
    for phase in ("forward", "backward"):
        loop = [r for r in rows if r.collective.phase == phase]
        counts[phase] = len(loop), sum(r.independent_flops == flops.computation(r.collective.computation) for r in loop)
    return counts, module.entry


def test_fsdp_prefetch_is_carried_in_the_scan(fsdp_steps):
    """With overlap, every weight all-gather of the scanned forward loop is independent of that
    iteration's matmuls (it gathers the next layer, carried to the next iteration), and so is
    every one of the backward loop (the layer below); without, the gathers feed the iteration's
    own matmuls. Each layer's gradient is reduce-scattered inside the backward loop. Bytes per
    kind are those without overlap (the backward gathers again: FSDP's memory is kept)."""
    (on, strategy, *_), off = fsdp_steps[True], fsdp_steps[False][0]
    (loops_on, entry), (loops_off, _) = _loop_gathers(on), _loop_gathers(off)
    for phase in ("forward", "backward"):
        (gathers_on, ahead_on), (gathers_off, ahead_off) = loops_on[phase], loops_off[phase]
        assert gathers_on == ahead_on > 0, phase
        assert ahead_off < gathers_off / 2, phase
    rows_on, rows_off = collectives(on, strategy.mesh), collectives(off, strategy.mesh)
    # The backward loop runs layers 2 and 1 (layer 3 before it, layer 0 after it), a reduce-scatter in each.
    assert any(r.effective_kind == "reduce-scatter" and r.computation != entry and r.executions == 2 for r in rows_on)

    def total(rows, kind, phase=None):
        return sum(r.total_bytes for r in rows if r.effective_kind == kind and phase in (None, r.phase)
                   and r.shapes[0].startswith("f32") and not r.shapes[0].endswith("[]"))

    for kind, phase in (("all-gather", "forward"), ("all-gather", "backward"), ("reduce-scatter", None)):
        assert total(rows_on, kind, phase) == pytest.approx(total(rows_off, kind, phase), rel=0.01), (kind, phase)


def test_overlap_benchmark_prints_both_settings_with_the_same_bytes(fsdp_steps, monkeypatch, capsys):
    """benchmarks/overlap.py's table for fsdp, off and on: the same bytes (its steps are those the test
    above reads, compiled once)."""
    bench = load("overlap")
    cases = []
    monkeypatch.setattr(bench, "compile_case", lambda name, on, args: (cases.append((name, on, args.layers)),
                                                                         fsdp_steps[on])[1])
    assert bench.main(BENCHMARK) == 0
    assert cases == [("fsdp", False, 4), ("fsdp", True, 4)]
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| fsdp")]
    assert [r[1].strip() for r in rows] == ["off", "on"]
    kib = [float(r[4]) for r in rows]
    assert abs(kib[0] - kib[1]) <= 0.01 * kib[0]


def test_schedule_report_lists_every_collective_of_a_compiled_fsdp_tp_step():
    compiled, placement = sharded_run("gpt", "fsdp=4,tensor=2", "fsdp+tp")[2:4]
    inventory = collectives(compiled, placement.mesh)  # read from the module proto
    report = schedule(compiled, placement.mesh)  # read from the scheduled text

    def key(r):
        return r.name, r.kind, r.shapes, r.bytes, r.executions, r.axes

    assert Counter(key(r.collective) for r in report) == Counter(key(r) for r in inventory)
    assert schedule_summary(report).total == sum(r.total_bytes for r in inventory)
    text = schedule_table(compiled, mesh=placement.mesh)
    assert "all-gather" in text and "overlappable" in text


HLO = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[8,16], p1: f32[16,32], p2: f32[4,32]) -> (f32[8,32], f32[32,32]) {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  %p2 = f32[4,32]{1,0} parameter(2)
  %ag = (f32[4,32]{1,0}, f32[32,32]{1,0}) all-gather-start(%p2), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, \
dimensions={0}
  %dot.1 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %agd = f32[32,32]{1,0} all-gather-done(%ag)
  %ar = f32[8,32]{1,0} all-reduce(%dot.1), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %dot.2 = f32[32,32]{1,0} dot(%agd, %agd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (f32[8,32]{1,0}, f32[32,32]{1,0}) tuple(%ar, %dot.2)
}
"""


def test_schedule_overlap_arithmetic_on_a_hand_written_module():
    ag, ar = schedule(HLO)
    # The async all-gather ([4,32] -> [32,32] f32: 4096 bytes) has dot.1 (2*8*32*16 FLOPs)
    # scheduled between its start and done; dot.1 is also all that is independent of it.
    assert (ag.collective.kind, ag.is_async, ag.collective.bytes) == ("all-gather", True, 4096)
    assert (ag.overlap_flops, ag.independent_flops) == (8192, 8192)
    # The synchronous all-reduce (1024 bytes) overlaps nothing; dot.2 (2*32*32*32) neither feeds nor uses it.
    assert (ar.collective.kind, ar.is_async, ar.collective.bytes) == ("all-reduce", False, 1024)
    assert (ar.overlap_flops, ar.independent_flops) == (0, 65536)
    s = schedule_summary([ag, ar])
    assert (s.total, s.overlapped, s.exposed, s.overlappable, s.async_bytes) == (5120, 4096, 1024, 5120, 4096)
    # Hidden iff bytes / bandwidth <= FLOPs / peak: 4096 B at 1 GB/s is 4.096 us = 8192 FLOP at 2 GFLOP/s.
    assert ag.hidden(1e9, 2e9) and not ag.hidden(1e9, 2.1e9)
    s = schedule_summary([ag, ar], bandwidth=1e9, peak=1e11)
    assert (s.overlapped, s.exposed, s.overlappable) == (0, 5120, 0)


def test_overlap_part_and_flags():
    strategy = Strategy(par.make_mesh("fsdp=8"), "fsdp", parts=(par.Overlap(),))
    assert strategy.describe() == "fsdp | overlap"
    assert par.overlap.prefetch_axes(strategy) == ("fsdp",)
    dp = Strategy(par.make_mesh("data=8"), "dp", parts=(par.Overlap(),))
    assert par.overlap.prefetch_axes(dp) == ()
    loss = lambda model, batch: 0.0  # noqa: E731
    assert par.Overlap().loss_fn(dp, loss, chunk_size=0, z_loss=0.0, model_like=None) is loss  # dp: unchanged
    # The backend is running: the flags cannot take effect any more, and nothing changes.
    assert par.overlap.set_overlap_flags() == par.overlap.overlap_flags_set()
    # Before it starts they are set, and XLA's CPU backend starts with them (it stops at an unknown flag).
    code = ("from eqgpt.parallel.overlap import OVERLAP_FLAGS, set_overlap_flags\n"
            "import os, jax, jax.numpy as jnp\nassert set_overlap_flags()\n"
            "print(jax.jit(lambda x: x + 1)(jnp.ones(2)))\n"
            "assert all(f in os.environ['XLA_FLAGS'] for f in OVERLAP_FLAGS)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "[2. 2.]" in proc.stdout, proc.stderr[-2000:]
    model = par.overlap.install_prefetch(nn.GPT(CONFIGS["gpt"], key=jax.random.key(0)), strategy)
    stack = model.shard
    assert isinstance(stack, par.overlap.PrefetchStack)
    assert len(stack.gathered) == len(jax.tree.leaves(eqx.filter(model.blocks, eqx.is_array)))
    assert all("fsdp" not in str(s) for s in stack.gathered) and any("fsdp" in str(s) for s in stack.sharded)
    # A layer reading a float array from outside its weights would get no gradient for it: refused.
    weights = eqx.filter(model.blocks, eqx.is_array)
    with pytest.raises(ValueError, match="float array from outside"):
        jax.jit(lambda s: stack.run_stack(lambda h, p: (h * s, None), jnp.ones((2, 32, 32)), weights))(2.0)
