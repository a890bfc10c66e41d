"""The growing chunk schedule (mmenc.preprocess.schedule.ChunkSchedule) and the Preprocessor following
it: limits respected (first_patches, max_patches, an oversize image alone), growth, the cut a function
of the sizes only (any number of worker threads gives the same chunks), failures in order."""
import math

import numpy as np
import pytest
import torch

from mmenc.preprocess import get_processor
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.schedule import ChunkSchedule


def test_split_examples_from_the_docs():
    s = ChunkSchedule(max_patches=65536, first_patches=4096)
    assert s.split([5476] * 8) == [1, 2, 4, 1]  # 8 x 1036 px
    assert s.split([1024] * 32) == [4, 8, 16, 4]  # 32 x 448 px
    jump = ChunkSchedule(65536, 4096, growth=math.inf)  # the schedule before growth
    assert jump.split([5476] * 8) == [1, 7] and jump.split([1024] * 32) == [4, 28]
    assert ChunkSchedule(65536).split([1024] * 32) == [32]  # no smaller first chunk
    assert ChunkSchedule(8, 2, growth=1).split([2] * 5) == [1, 1, 1, 1, 1]  # growth 1: every call at first_patches


@pytest.mark.parametrize("seed", range(5))
def test_split_respects_the_limits_and_is_greedy(seed):
    rng = np.random.default_rng(seed)
    rows = [int(r) for r in rng.integers(1, 300, 200)]
    s = ChunkSchedule(max_patches=1000, first_patches=64, growth=2.0)
    counts = s.split(rows)
    assert sum(counts) == len(rows) and all(c >= 1 for c in counts)
    start, limit = 0, s.first_limit()
    for k, n in enumerate(counts):
        chunk = rows[start:start + n]
        assert sum(chunk) <= limit or n == 1, f"chunk {k}: {sum(chunk)} rows over its limit {limit}"
        if start + n < len(rows) and sum(chunk) < limit:  # not full: the next image did not fit
            assert sum(chunk) + rows[start + n] > limit, f"chunk {k} left room for the next image"
        assert limit <= 1000
        start, limit = start + n, s.next_limit(limit, sum(chunk))
    assert s.split(rows) == counts  # a function of the sizes


def test_schedule_errors_name_the_value():
    with pytest.raises(ValueError, match=r"ChunkSchedule.max_patches=0 must be an int >= 1"):
        ChunkSchedule(0)
    with pytest.raises(ValueError, match=r"ChunkSchedule.first_patches=2.5 must be an int >= 1"):
        ChunkSchedule(64, 2.5)
    with pytest.raises(ValueError, match=r"ChunkSchedule.growth=0.9 must be a number >= 1"):
        ChunkSchedule(64, 8, 0.9)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_preprocessor_follows_the_schedule_whatever_the_workers(workers):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (28 * int(h), 28 * int(w), 3), dtype=np.uint8)
              for h, w in rng.integers(1, 5, (17, 2))]
    images.insert(5, np.zeros((0, 4, 3), np.uint8))  # fails: reported in order, chunks go on
    proc = get_processor("qwen2_vl")
    schedule = ChunkSchedule(max_patches=96, first_patches=8, growth=2.0)
    with Preprocessor(proc, workers=workers) as pre:
        chunks = list(pre.iter_chunks(images, schedule=schedule, errors="skip"))
        whole, grid, failures = pre.run(images, errors="skip")
    rows = [int(r) for r in grid.prod(-1)]
    assert [len(c.indices) for c in chunks if c.indices] == schedule.split(rows)
    assert [i for c in chunks for i in c.indices] == [i for i in range(len(images)) if i != 5]
    assert [f.index for c in chunks for f in c.failures] == [5] == [f.index for f in failures]
    assert torch.equal(torch.cat([c.pixel_values for c in chunks if c.indices]), whole)
    assert pre.tally.snapshot()["chunks"] >= len(chunks) and pre.tally.snapshot()["stage_s"] > 0
