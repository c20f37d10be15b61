"""Attention work per device under context parallelism: contiguous versus zigzag order.

Counts, with the predicates the kernels use (`Mask.block_may_attend`), the ring
steps and the (128 x 128) tiles each device computes for a 16,384-token sequence
(`tests/test_context_attention.py` checks that the ring kernel evaluates exactly
these tiles). Run: `python benchmarks/context_balance.py`.
"""

from eqgpt.nn.mask import CausalMask, SlidingWindowMask
from eqgpt.parallel.context import balance_table

SEQ = 16384


def main():
    for n in (4, 8):
        print(f"causal mask, {SEQ} tokens, context={n}")
        print(balance_table(SEQ, n, CausalMask()))
        print()
    print(f"sliding window of 2048, {SEQ} tokens, context=8")
    print(balance_table(SEQ, 8, SlidingWindowMask(2048)))


if __name__ == "__main__":
    main()
