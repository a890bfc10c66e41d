"""mmenc.bench.trace over grid rows with more than three columns (LLaVA-NeXT's [t, h, w, ...] rows):
`mmenc bench --e2e` on a LLaVA-NeXT checkpoint once failed unpacking them."""
from mmenc.bench.trace import patches_of


def test_patches_of_reads_the_first_three_columns():
    assert patches_of([[1, 24, 24], [2, 4, 6]]) == 24 * 24 + 2 * 4 * 6
    assert patches_of([[5, 24, 24, 672, 672], [3, 24, 24, 336, 672]]) == 5 * 576 + 3 * 576
    assert patches_of([]) == 0
