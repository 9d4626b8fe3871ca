"""Page-table structure from counts, its validator, and the plan, over the bindings."""

import numpy as np
import pytest

import sparsepage as sp


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_structure_matches_the_invariants(rng, page_size):
    lens = rng.integers(0, 50, size=9).astype(np.int32)
    lens[2] = 0  # an empty request
    offsets = rng.integers(0, page_size, size=9).astype(np.int32)
    t = sp.build_page_table_structure(lens, page_size, offsets)
    pages = [0 if n == 0 else -(-(int(f) + int(n)) // page_size) for n, f in zip(lens, offsets)]
    np.testing.assert_array_equal(t.indptr, np.concatenate([[0], np.cumsum(pages)]))
    np.testing.assert_array_equal(t.seq_lens, lens)
    np.testing.assert_array_equal(t.first_page_offset, offsets)
    for r, n in enumerate(lens):
        if n:
            assert t.last_page_len[r] == int(offsets[r]) + int(n) - (pages[r] - 1) * page_size
        else:
            assert t.last_page_len[r] == 0
    assert t.num_pages == sum(pages) and t.total_tokens == int(lens.sum())
    sp.check_page_table(t)
    indices = rng.integers(0, 100, size=t.num_pages).astype(np.int32)
    sp.check_page_table(t, indices, 100)


def test_counts_as_a_list():
    t = sp.build_page_table_structure([3, 0, 5], 2)
    assert list(t.indptr) == [0, 2, 2, 5]
    assert list(t.last_page_len) == [1, 0, 1]
    assert t.indptr.dtype == np.int32


def test_bad_counts_raise_the_librarys_message():
    with pytest.raises(sp.Error, match=r"^page table: seq_lens\[1\] = -1 is negative$"):
        sp.build_page_table_structure([3, -1], 2)
    with pytest.raises(sp.Error, match=r"^page table: page_size = 0 must be at least 1$"):
        sp.build_page_table_structure([3], 0)
    with pytest.raises(ValueError):  # sparsepage.Error is a ValueError
        sp.build_page_table_structure([1], 4, [4])


def test_validator_names_the_first_violation():
    t = sp.build_page_table_structure([4, 2], 2)
    bad = np.array([0, 1, 7], dtype=np.int32)
    with pytest.raises(sp.Error, match=r"^page table: indices\[2\] = 7 is outside the pool \[0, 5\)$"):
        sp.check_page_table(t, bad, 5)
    broken = sp.PageTableStructure(page_size=2, indptr=[0, 1, 2], last_page_len=[2, 2],
                                   first_page_offset=[0, 0], seq_lens=[4, 2])
    with pytest.raises(sp.Error, match=r"^page table: request 0 has 1 pages, expected ceil\(\(first_page_offset 0 "
                                       r"\+ seq_len 4\) / page_size 2\) = 2$"):
        sp.check_page_table(broken)


def test_plan_splits_and_sizes_its_workspace():
    shape = sp.PlanShape(group_size=2, head_dim_v=8, num_sms=4, fixed_chunk_tokens=64)
    plan = sp.make_decode_plan([200, 0, 30], shape)
    assert plan.num_requests == 3 and plan.needs_merge
    work = plan.work
    assert work.shape == (plan.num_work_items, 4)
    # Request 0 is covered by consecutive chunks, the empty request still has one item.
    r0 = work[work[:, 0] == 0]
    assert r0[0, 1] == 0 and r0[-1, 2] == 200 and all(r0[1:, 1] == r0[:-1, 2])
    assert (work[:, 0] == 1).sum() == 1
    assert plan.workspace_bytes > 0
    single = sp.make_decode_plan([30], sp.PlanShape(group_size=2, head_dim_v=8, num_sms=4))
    assert not single.needs_merge and single.work[0, 3] == -1
