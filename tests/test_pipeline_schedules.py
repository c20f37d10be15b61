"""Pipeline schedules as tables: ordering rules, bubble formulas, buffer sizes, errors.

The ordering checks here are written independently of `Schedule`'s own validation:
they read the finished table cell by cell.
"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqgpt
from eqgpt import nn
from eqgpt.data import Batch
from eqgpt.parallel import make_mesh
from eqgpt.parallel.pipeline import (
    Action,
    Schedule,
    StageCosts,
    balanced_layers,
    bubble_report,
    equal_layers,
    from_programs,
    from_stages,
    gpipe,
    interleaved,
    lower,
    make_pipeline_schedule,
    measure_costs,
    one_f_one_b,
    pipeline_grad_fn,
    stage_flops,
    stage_slots,
    to_stages,
    zero_bubble_h1,
)

GRID = [
    *[("gpipe", p, m, 1) for p, m in itertools.product((1, 2, 4), (1, 3, 4, 8, 16))],
    *[("1f1b", p, m, 1) for p, m in itertools.product((1, 2, 4), (1, 3, 4, 8, 16))],
    *[("interleaved", p, m, v) for p, m, v in itertools.product((2, 4), (4, 8, 16), (2, 3))],
]


def when(schedule):
    """(kind, microbatch, virtual stage) -> (tick, stage), read from the table."""
    out = {}
    p = schedule.num_stages
    for t, row in enumerate(schedule.ticks):
        for s, a in enumerate(row):
            if a is not None:
                key = (a.kind, a.microbatch, a.chunk * p + s)
                assert key not in out, f"{key} twice"
                out[key] = (t, s)
    return out


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_forward_before_backward_on_every_stage(name, p, m, v):
    sched = make_pipeline_schedule(name, p, m, v)
    w = when(sched)
    assert len(w) == 2 * m * p * v
    for i, g in itertools.product(range(m), range(p * v)):
        (tf, sf), (tb, sb) = w["F", i, g], w["B", i, g]
        assert sf == sb == g % p
        assert tf < tb


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_backward_follows_next_stages_backward(name, p, m, v):
    sched = make_pipeline_schedule(name, p, m, v)
    w = when(sched)
    G = p * v
    for i, g in itertools.product(range(m), range(G - 1)):
        assert w["B", i, g][0] > w["B", i, g + 1][0]
        assert w["F", i, g + 1][0] > w["F", i, g][0]


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_bubble_matches_formula(name, p, m, v):
    sched = make_pipeline_schedule(name, p, m, v)
    idle = sum(a is None for row in sched.ticks for a in row)
    measured = idle / (len(sched.ticks) * p)
    assert measured == pytest.approx(sched.bubble)
    assert measured == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 8), (4, 4), (4, 16)])
def test_live_microbatches_per_stage(p, m):
    """1F1B keeps at most p stage inputs per stage (and so do its buffers); GPipe keeps m."""
    f1b, gp = one_f_one_b(p, m), gpipe(p, m)
    assert max(f1b.in_flight(s) for s in range(p)) == min(p, m)
    assert all(gp.in_flight(s) == m for s in range(p))
    assert lower(f1b).act_slots == min(p, m)
    assert lower(gp).act_slots == m


def test_interleaved_puts_non_adjacent_chunks_on_a_stage():
    sched = interleaved(4, 8, 2)
    for s in range(4):
        chunks = {a.chunk * 4 + s for _, a in sched.program(s)}
        assert chunks == {s, s + 4}


def test_table_chart_lists_every_cell():
    sched = one_f_one_b(4, 4)
    chart = sched.table().splitlines()
    assert chart[0].startswith("1f1b: p=4 m=4") and "bubble=0.429" in chart[0]
    rows = chart[2:]
    assert len(rows) == 4
    for s, line in enumerate(rows):
        cells = line.split()[2:]
        assert len(cells) == sched.num_ticks
        assert cells == [a.label(1) if a else "." for a in (row[s] for row in sched.ticks)]
    assert "F0b" in interleaved(2, 2, 2).table()


def test_a_table_that_breaks_the_order_is_rejected():
    good = gpipe(2, 1).ticks  # F0 on 0, F0 on 1, B0 on 1, B0 on 0
    assert good == ((Action("F", 0), None), (None, Action("F", 0)), (None, Action("B", 0)),
                    (Action("B", 0), None))
    swapped = (good[0], good[2], good[1], good[3])  # stage 1 backward before its forward
    with pytest.raises(ValueError, match="does not follow"):
        Schedule("bad", 2, 1, 1, swapped)
    with pytest.raises(ValueError, match="never runs"):
        Schedule("short", 2, 1, 1, good[:3])
    # A hand-made valid table runs through the same checks.
    assert Schedule("mine", 2, 1, 1, good).bubble == 0.5


# ------------------------------------------------------------------ zero bubble (ZB-H1)

ZB = [(p, m) for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 5, 8, 16)) if m >= p]


@pytest.mark.parametrize("p, m", ZB)
def test_zero_bubble_h1_order_idle_ticks_and_memory(p, m):
    """Read from the table: every B after its F and the next stage's B, every W after its B on the
    same stage; `p (p - 1)` idle cells (1F1B: `2 p (p - 1)`); at most `p` stage inputs held per stage,
    an input held from its F until its W (1F1B's peak)."""
    zb, f1b = zero_bubble_h1(p, m), one_f_one_b(p, m)
    w = when(zb)
    assert len(w) == 3 * m * p
    for i, g in itertools.product(range(m), range(p)):
        (tf, sf), (tb, sb), (tw, sw) = w["F", i, g], w["B", i, g], w["W", i, g]
        assert sf == sb == sw == g and tf < tb < tw
        if g < p - 1:
            assert w["B", i, g + 1][0] < tb and w["F", i, g + 1][0] > tf
    idle = lambda sched: sum(a is None for row in sched.ticks for a in row)  # noqa: E731
    assert idle(zb) == p * (p - 1) == zb.expected_idle_ticks
    assert idle(f1b) == 2 * p * (p - 1) == f1b.expected_idle_ticks
    assert p == 1 or idle(zb) < idle(f1b)
    assert zb.num_ticks == 3 * m + p - 1
    assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1)) == zb.expected_bubble
    held = []
    for s in range(p):
        alive = peak = 0
        for row in zb.ticks:
            alive += {"F": 1, "W": -1}.get(getattr(row[s], "kind", None), 0)
            peak = max(peak, alive)
        held.append(peak)
    assert max(held) == zb.peak_in_flight == f1b.peak_in_flight == p
    assert lower(zb).act_slots == p


def test_zero_bubble_table_prints_idle_ticks_bubble_and_memory():
    chart = zero_bubble_h1(4, 8).table().splitlines()
    assert chart[0] == "zb1: p=4 m=8  ticks=27  idle=12  bubble=0.111  in-flight=4"
    assert chart[2].split()[2:12] == ["F0", "F1", "F2", "F3", ".", ".", ".", "B0", "W0", "F4"]
    assert one_f_one_b(4, 8).table().splitlines()[0] == "1f1b: p=4 m=8  ticks=22  idle=24  bubble=0.273  in-flight=4"


def test_split_tables_need_every_weight_gradient_after_its_input_gradient():
    good = zero_bubble_h1(2, 2).ticks
    cells = [(t, s) for t, row in enumerate(good) for s, a in enumerate(row) if a is not None]
    t, s = next((t, s) for t, s in cells if good[t][s].kind == "W")
    without_w = tuple(tuple(None if (u, r) == (t, s) else a for r, a in enumerate(row)) for u, row in enumerate(good))
    with pytest.raises(ValueError, match="never runs W"):
        Schedule("no-w", 2, 2, 1, without_w)
    # The same W moved to a tick of its own before the table: before its B.
    early = (tuple(good[t][r] if r == s else None for r in range(2)), *without_w)
    with pytest.raises(ValueError, match="does not follow B"):
        Schedule("early-w", 2, 2, 1, early)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: interleaved(4, 6, 2), "divisible by the 4 stages"),
        (lambda: interleaved(4, 8, 1), "num_chunks >= 2"),
        (lambda: make_pipeline_schedule("zigzag", 4, 8), "unknown pipeline schedule"),
        (lambda: one_f_one_b(4, 0), "positive integer"),
        (lambda: gpipe(0, 4), "positive integer"),
        (lambda: make_pipeline_schedule("zb1", 4, 2), r"zb1 needs at least as many microbatches .* --microbatches 4"),
    ],
)
def test_schedule_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _model(layers):
    cfg = eqgpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=layers, num_heads=4, embed_dim=32)
    # Abstract arrays are enough: the checks run before anything is traced or compiled.
    return eqx.filter_eval_shape(lambda k: nn.GPT(cfg, key=k), jax.random.key(0))


def _batch(b, **fields):
    z = np.zeros((b, 16), np.int32)
    return Batch(z, z, **fields)


def test_layers_not_divisible_by_stages_names_valid_choices():
    fn = pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "1f1b", 4)
    with pytest.raises(ValueError, match=r"num_layers=6 .* pipeline size in \[1, 2, 3, 6\]"):
        fn(_model(6), _batch(8))
    fn = pipeline_grad_fn(make_mesh("pipeline=2,data=4"), "interleaved", 4, virtual_stages=2)
    with pytest.raises(ValueError, match=r"4 virtual stages .* num_layers in \[4, 8"):
        fn(_model(6), _batch(16))


def test_batch_not_divisible_by_microbatches():
    fn = pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "gpipe", 4)
    with pytest.raises(ValueError, match="batch size 12 is not divisible by 2 data-parallel devices x 4"):
        fn(_model(4), _batch(12))


def test_mesh_and_schedule_must_agree():
    with pytest.raises(ValueError, match="has 2 stages but the mesh's pipeline axis has 4"):
        pipeline_grad_fn(make_mesh("pipeline=4,data=2"), one_f_one_b(2, 4))
    with pytest.raises(ValueError, match="needs microbatches"):
        pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "1f1b")
    with pytest.raises(ValueError, match=r"no context attention; pass context=Context"):
        pipeline_grad_fn(make_mesh("pipeline=4,context=2"), "1f1b", 4)
    with pytest.raises(ValueError, match="divisible by the 4 stages"):
        pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "interleaved", 6)


def test_pipeline_takes_a_batch_and_a_language_model():
    """Clear errors before tracing: the batch type, per-row positions, the model protocol."""
    fn = pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "1f1b", 4)
    with pytest.raises(ValueError, match="eqgpt.data.Batch"):
        fn(_model(4), {"tokens": np.zeros((8, 16), np.int32), "targets": np.zeros((8, 16), np.int32)})
    with pytest.raises(ValueError, match="positions"):
        fn(_model(4), _batch(8, positions=np.zeros((8, 16), np.int32)))

    class NoHead(eqx.Module):
        blocks: jax.Array

        def embed(self, tokens, positions):
            return tokens

    with pytest.raises(ValueError, match=r"NoHead is not an eqgpt.nn.LanguageModel.*'run_blocks'"):
        fn(NoHead(jnp.zeros((4, 2))), _batch(8))


# ------------------------------------------------------------------ layers per stage


def test_balanced_split_weighs_the_head_against_layers():
    """Each layer goes to the cheapest stage so far; no other split has a faster slowest stage."""
    head_heavy = StageCosts(embed=0.01, layer=1.0, head=4.45)  # GPT-2 small's head: about 4.4 layers
    assert balanced_layers(head_heavy, 12, 4) == (4, 4, 4, 0)
    assert balanced_layers(head_heavy, 12, 2) == (8, 4)
    assert balanced_layers(StageCosts(embed=0.0, layer=1.0, head=0.0), 12, 4) == equal_layers(12, 4)
    for costs in (head_heavy, StageCosts(embed=0.7, layer=1.0, head=1.6)):
        for L, G in ((6, 3), (7, 4)):
            split = balanced_layers(costs, L, G)
            slowest = lambda s, costs=costs: max(  # noqa: E731
                costs.stage(n, g == 0, g == len(s) - 1) for g, n in enumerate(s))
            every = [s for s in itertools.product(range(L + 1), repeat=G) if sum(s) == L]
            assert sum(split) == L and slowest(split) == min(map(slowest, every)), (costs, L, G, split)


def test_uneven_stages_hold_their_own_layers_and_padding_slots():
    layers = jnp.arange(8)
    staged = to_stages(layers, 4, 1, (3, 3, 2, 0))
    np.testing.assert_array_equal(staged[:, 0], [[0, 1, 2], [3, 4, 5], [6, 7, 0], [0, 0, 0]])
    np.testing.assert_array_equal(stage_slots(4, 1, (3, 3, 2, 0))[:, 0],
                                  [[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
    # Interleaved: virtual stage c * p + s sits on device s, chunk c.
    staged = to_stages(layers, 2, 2, (1, 3, 2, 2))
    np.testing.assert_array_equal(staged, [[[0, 0, 0], [4, 5, 0]], [[1, 2, 3], [6, 7, 0]]])
    for split, p, v in (((3, 3, 2, 0), 4, 1), ((1, 3, 2, 2), 2, 2), ((2, 2, 2, 2), 4, 1)):
        np.testing.assert_array_equal(from_stages(to_stages(layers, p, v, split), split), layers)


def test_auto_split_of_gpt2_small_on_four_stages_comes_from_measured_flops():
    """XLA's FLOP counts of GPT-2 small against the matmuls' `6 * params * tokens`: the head is
    `6 d V T`, a layer `6 (12 d^2) T` plus its attention (`blockwise` at 1024 tokens, `auto`'s choice
    on a CPU, whose loop body XLA counts once); the embedding is a gather, next to nothing."""
    config = eqgpt.config.preset("gpt2-small")
    model = eqx.filter_eval_shape(lambda k: nn.GPT(config, key=k), jax.random.key(0))
    costs = measure_costs(model, (1, 1024))
    d, vocab, tokens = config.embed_dim, config.vocab_size, 1024
    np.testing.assert_allclose(costs.head, 6 * d * vocab * tokens, rtol=0.01)
    assert 1.0 < costs.layer / (6 * 12 * d * d * tokens) < 1.12 and costs.embed < 0.01 * costs.layer
    fn = pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "1f1b", 4, layers_per_stage="auto")
    assert fn.split(model, (8, 1024)) == (4, 4, 4, 0)  # one row per device and microbatch


def test_stage_flops_add_up_from_the_pieces():
    """A whole stage compiled costs about its layers, embedding and head compiled apart."""
    model = eqx.filter_eval_shape(lambda k: nn.GPT(CFG_FLOPS, key=k), jax.random.key(0))
    costs, split = measure_costs(model, (2, 64)), (2, 1, 1, 0)
    expected = [costs.stage(n, g == 0, g == 3) for g, n in enumerate(split)]
    np.testing.assert_allclose(stage_flops(model, (2, 64), split), expected, rtol=0.1)


CFG_FLOPS = eqgpt.GPTConfig(vocab_size=512, seq_len=64, num_layers=4, num_heads=4, embed_dim=64)


@pytest.mark.parametrize("split, match", [
    ((2, 2, 2), r"layers_per_stage=\(2, 2, 2\) must give each of the 4 virtual stages"),
    ((3, 3, 3, -1), "a count >= 0"),
    ("half", "use 'equal', 'auto' or a count per virtual stage"),
])
def test_bad_layers_per_stage(split, match):
    with pytest.raises(ValueError, match=match):
        fn = pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "1f1b", 4, layers_per_stage=split)
        fn(_model(8), _batch(8))


def test_uneven_split_still_needs_layers_the_pipeline_divides():
    """The layer stack stays placed evenly over `pipeline`; only the stages' share of it varies."""
    fn = pipeline_grad_fn(make_mesh("pipeline=4,data=2"), "1f1b", 4, layers_per_stage=(3, 2, 1, 0))
    with pytest.raises(ValueError, match="num_layers=6 is not divisible by the pipeline size 4"):
        fn(_model(6), _batch(8))


# --- what mutation testing found unchecked (`python tests/mutation_run.py parallel/pipeline/schedules.py`) ---


def test_the_chart_reads_as_documented():
    """The exact chart of two small schedules: header, tick row, one row per stage, chunk letters."""
    assert gpipe(2, 2).table() == (
        "gpipe: p=2 m=2  ticks=6  idle=4  bubble=0.333  in-flight=2\n"
        "tick    0  1  2  3  4  5\n"
        "stage 0 F0 F1 .  .  B0 B1\n"
        "stage 1 .  F0 F1 B0 B1 .")
    assert interleaved(2, 2).table().splitlines()[:3] == [
        "interleaved: p=2 m=2 v=2  ticks=10  idle=4  bubble=0.200  in-flight=4",
        "tick    0   1   2   3   4   5   6   7   8   9",
        "stage 0 F0a F1a F0b F1b .   B0b .   B1b B0a B1a"]


def held(schedule: Schedule, stage: int) -> int:
    """The most stage inputs `stage` holds, read off the table: +1 at each F, -1 when its last
    backward piece runs (W in a split table, else B)."""
    last = "W" if any(a is not None and a.kind == "W" for row in schedule.ticks for a in row) else "B"
    alive = peak = 0
    for row in schedule.ticks:
        a = row[stage]
        alive += 0 if a is None else 1 if a.kind == "F" else -1 if a.kind == last else 0
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("name, p, m", [("gpipe", 3, 4), ("1f1b", 4, 8), ("interleaved", 2, 4), ("zb1", 4, 8)])
def test_in_flight_counts_until_the_last_backward_piece(name, p, m):
    sched = make_pipeline_schedule(name, p, m)
    assert [sched.in_flight(s) for s in range(p)] == [held(sched, s) for s in range(p)]
    assert sched.peak_in_flight == max(held(sched, s) for s in range(p))


def test_in_flight_of_a_table_whose_peak_comes_after_a_backward():
    """The built-in tables reach their peak before any backward; a table of one's own need not."""
    mine = Schedule("mine", 1, 3, 1, ((F(0),), (B(0),), (F(1),), (F(2),), (B(1),), (B(2),)))
    assert mine.in_flight(0) == held(mine, 0) == 2


def test_interleaved_warms_up_as_megatron_does():
    """Stage s warms up with 2 (p - s - 1) + (v - 1) p forwards (the docstring's count), then runs
    one more before its first backward: it holds that many inputs at its peak."""
    p, m, v = 4, 8, 2
    sched = interleaved(p, m, v)
    for s in range(p):
        warm = 2 * (p - s - 1) + (v - 1) * p
        first_backward = [a.kind for _, a in sched.program(s)].index("B")
        assert first_backward == min(warm + 1, m * v) and held(sched, s) == first_backward


def test_defaults_and_names():
    assert interleaved(2, 4).num_chunks == 2 and make_pipeline_schedule("interleaved", 2, 4).num_chunks == 2
    assert [make_pipeline_schedule(n, 2, 4).name for n in ("gpipe", "1f1b", "interleaved", "zb1")] == [
        "gpipe", "1f1b", "interleaved", "zb1"]


@pytest.mark.parametrize("args, message", [
    ((0, 4), "num_stages must be a positive integer, got 0"),
    ((2, 0), "num_microbatches must be a positive integer, got 0"),
    ((2, 4, 0), "num_chunks must be a positive integer, got 0"),
    ((4, 6), r"divisible by the 4 stages \(got m=6\); use m in \[4, 8, 12, 16\]\.\.\."),
])
def test_bad_sizes_name_the_size(args, message):
    with pytest.raises(ValueError, match=message):
        interleaved(*args)


def F(i, c=0):
    return Action("F", i, c)


def B(i, c=0):
    return Action("B", i, c)


def W(i, c=0):
    return Action("W", i, c)


@pytest.mark.parametrize("p, m, v, ticks, message", [
    (0, 1, 1, (), r"must be >= 1, got p=0, m=1, v=1"),
    (1, 0, 1, (), r"must be >= 1, got p=1, m=0, v=1"),
    (1, 1, 0, (), r"must be >= 1, got p=1, m=1, v=0"),
    (2, 1, 1, ((F(0),),), r"tick 0 has 1 cells for 2 stages"),
    (1, 1, 1, ((F(1),), (B(1),)), r"tick 0, stage 0: .* is outside m=1, v=1"),
    (1, 1, 1, ((Action("F", 0, 1),), (Action("B", 0, 1),)), r"tick 0, stage 0: .* is outside m=1, v=1"),
    (1, 1, 1, ((F(0),), (F(0),), (B(0),)), r"F0 of virtual stage 0 appears twice"),
    (2, 1, 1, ((F(0), F(0)), (None, B(0)), (B(0), None)), r"F0 on virtual stage 1 does not follow F0 on 0"),
    (2, 1, 1, ((F(0), None), (None, F(0)), (B(0), B(0))), r"B0 on virtual stage 0 does not follow its dependency"),
    (2, 1, 1, ((F(0), None), (None, F(0)), (B(0), None), (None, B(0))),
     r"B0 on virtual stage 0 does not follow its dependency"),
    (1, 1, 1, ((F(0),), (B(0),), (F(0),)), r"appears twice"),
    (1, 1, 1, ((F(0),), (F(0),)), r"appears twice"),
])
def test_a_table_that_breaks_a_rule_is_refused_naming_it(p, m, v, ticks, message):
    with pytest.raises(ValueError, match=message):
        Schedule("mine", p, m, v, ticks)


def test_programs_are_placed_on_the_earliest_ticks_after_a_stage_finishes():
    """Stage 0 finishes a tick before stage 1 (whose W's come last): stage 1's last W still runs."""
    programs = [[F(0), F(1), F(2), B(0), W(0), B(1), W(1), B(2), W(2)],
                [F(0), B(0), F(1), B(1), F(2), B(2), W(0), W(1), W(2)]]
    sched = from_programs("mine", 2, 3, 1, programs)
    assert sched.num_ticks == 10 and sched.ticks[8] == (W(2), W(1)) and sched.ticks[9] == (None, W(2))


def test_a_split_table_needs_each_w_after_its_b_and_programs_that_cannot_run_deadlock():
    with pytest.raises(ValueError, match="W0 on virtual stage 0 does not follow B0"):
        Schedule("mine", 1, 1, 1, ((F(0),), (W(0),), (B(0),)))
    # A stage's program listing a W before its B can never place it: refused, naming the schedule.
    with pytest.raises(ValueError, match="mine: the stage programs deadlock at tick 1"):
        from_programs("mine", 1, 1, 1, [[F(0), W(0), B(0)]])


def test_bubble_report_line():
    """1F1B, p=2, m=4: 2 (m + p - 1) = 10 ticks, p (p - 1) = 2 idle cells per stage, bubble
    (p - 1) / (m + p - 1) = 0.2, p = 2 inputs held by the first stage."""
    assert bubble_report(one_f_one_b(2, 4)) == ("1f1b: p=2 m=4 v=1 bubble 0.200 (idle 4 of 20 stage-ticks; "
                                                "formula 0.200); at most 2 stage inputs in flight")
