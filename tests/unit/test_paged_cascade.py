"""Shared-prefix decode attention (services/rollout/engine_torch/paged/cascade.py): the groups found from block tables,
and the kernels (Triton's CPU interpreter) against attention over each row's gathered slots."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from services.rollout.engine_torch.paged.cascade import (MIN_SHARED_TOKENS, prefix_partitions, rows_per_group,
                                                        share_groups, worth_sharing)
from tests.interpreted import assert_printed_ok, run_interpreted
from tests.unit.test_paged_kv_attention import INTERPRETER_PROLOGUE


def layout(bs: int, groups: list, singles: list, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables and context lengths: each group (prefix blocks, member contexts) forks one prefix, then every row
    takes private blocks; singles share nothing. Entries past a row's context name no block (10**12)."""
    ctxs = [c for _, cs in groups for c in cs] + list(singles)
    width = max(-(-c // bs) for c in ctxs) + 1
    free = iter(torch.randperm(len(ctxs) * width + 64, generator=torch.Generator().manual_seed(seed)).tolist())
    rows = []
    for prefix, cs in groups:
        shared = [next(free) for _ in range(prefix)]
        rows += [shared[:-(-c // bs)] + [next(free) for _ in range(-(-c // bs) - prefix)] for c in cs]
    rows += [[next(free) for _ in range(-(-c // bs))] for c in singles]
    tables = torch.tensor([r + [10 ** 12] * (width - len(r)) for r in rows])
    return tables, torch.tensor(ctxs)


def members(groups: torch.Tensor) -> list[tuple[int, ...]]:
    """Each group's member rows, groups in row order (a group's place in the tensor follows its block ids)."""
    return sorted(tuple(sorted(x for x in g if x >= 0)) for g in groups.tolist() if g[0] >= 0)


def test_rows_forked_from_one_prefix_are_one_group_sharing_their_full_blocks():
    tables, ctx = layout(16, [(4, [70, 80, 65]), (2, [40, 33])], [5, 100])
    lo, groups = share_groups(tables, ctx - 1, 16, per_group=9, num_groups=4)
    assert lo.tolist() == [64, 64, 64, 32, 32, 0, 0]
    assert members(groups) == [(0, 1, 2), (3, 4)] and (groups[2:] == -1).all()


def test_a_group_is_cut_at_rows_per_group_and_a_lone_remainder_reads_alone():
    # Which rows go together follows the rows' order by their tables (their private blocks): sizes are fixed.
    tables, ctx = layout(16, [(3, [60] * 10)], [])
    lo, groups = share_groups(tables, ctx - 1, 16, per_group=4, num_groups=8)
    assert sorted(map(len, members(groups))) == [2, 4, 4] and sorted(sum(members(groups), ())) == list(range(10))
    assert (groups[3:] == -1).all() and lo.tolist() == [48] * 10
    lo, groups = share_groups(tables[:9], ctx[:9] - 1, 16, per_group=4, num_groups=8)
    assert sorted(lo.tolist()) == [0] + [48] * 8                # a piece of one row: no group of one
    assert sorted(map(len, members(groups))) == [4, 4] and int((lo == 0).nonzero()) not in sum(members(groups), ())
    # More groups than the step has room for: the rest read alone.
    lo, groups = share_groups(tables, ctx - 1, 16, per_group=2, num_groups=3)
    assert sorted(lo.tolist()) == [0] * 4 + [48] * 6 and sorted(map(len, members(groups))) == [2, 2, 2]
    assert sorted(sum(members(groups), ())) == sorted((lo > 0).nonzero().squeeze(1).tolist())


def test_a_prefix_stops_before_the_block_a_member_writes_next():
    # Row 1 (context 62: its next write at position 61, in block 3) still shares block 3, partly filled: the
    # group's prefix is the 3 blocks before it, for both rows.
    tables, ctx = layout(16, [(4, [70, 62])], [])
    lo, groups = share_groups(tables, ctx - 1, 16, per_group=9, num_groups=1)
    assert lo.tolist() == [48, 48] and members(groups) == [(0, 1)]


def test_nested_sharing_groups_rows_by_their_deepest_shared_block():
    # Two GRPO groups whose prompts start with one system prompt (blocks 100, 101): each group is its own, with
    # its whole prompt (5 blocks) as prefix; two rows sharing only the system prompt are a group of their own.
    tables = torch.tensor([[100, 101, 200, 201, 202, 300], [100, 101, 200, 201, 202, 301],
                           [100, 101, 210, 211, 212, 310], [100, 101, 210, 211, 212, 311],
                           [100, 101, 400, 401, 402, 403], [100, 101, 500, 501, 502, 503]])
    lo, groups = share_groups(tables, torch.full((6,), 89), 16, per_group=9, num_groups=3)
    assert lo.tolist() == [80, 80, 80, 80, 32, 32]
    assert members(groups) == [(0, 1), (2, 3), (4, 5)]


def test_no_two_rows_sharing_a_block_is_no_groups():
    tables, ctx = layout(16, [], [40, 50, 60])
    assert share_groups(tables, ctx - 1, 16, per_group=9, num_groups=1) is None


def test_group_sizes_and_prefix_partitions_follow_host_shapes():
    assert (rows_per_group(14, 2), rows_per_group(12, 2), rows_per_group(4, 4), rows_per_group(64, 1)) == (9, 10, 64, 1)
    # 512 rows (64 groups of 8) at 2 kv heads on 132 SMs, 1,280-token tables: 4 partitions of the prefix.
    assert prefix_partitions(512, 2, 1280, 132) == 4
    assert prefix_partitions(16, 2, 4096, 132) == 16 and prefix_partitions(512, 2, 200, 132) == 1


# (block size, head_dim, heads, kv heads, groups, singles, partitions, prefix partitions): P == 1 merges the
# group's partials in the row kernel, P > 1 in the combine kernel; a group cut in two (11 rows at G = 7); G = 1.
CASES = [
    (16, 64, 14, 2, [(4, [70, 80, 65]), (2, [40, 33])], [5, 100], 1, None),
    (16, 64, 14, 2, [(4, [70, 80, 65]), (2, [40, 33])], [5, 100], 2, 2),
    (16, 64, 14, 2, [(3, [60, 50, 70, 49, 64, 80, 55, 58, 61, 66, 99])], [], 1, 4),
    (32, 128, 12, 2, [(2, [70, 65, 90])], [1], 3, 1),
    (16, 64, 4, 4, [(5, [100, 90])], [20], None, 2),
    (16, 64, 14, 2, [(4, [70, 62])], [17], 1, 2),
    (16, 64, 14, 2, [], [40, 50, 60], 1, 2),
]
SCRIPT = INTERPRETER_PROLOGUE + """
from services.rollout.engine_torch.paged.cascade import (max_groups, paged_decode_attention_shared, rows_per_group,
                                                         share_groups)
from tests.unit.test_paged_cascade import layout

dtype = getattr(torch, sys.argv[1])
errors = []
for i, (bs, hd, H, KV, groups, singles, parts, pparts) in enumerate(json.loads(sys.argv[2])):
    g = torch.Generator().manual_seed(i)
    tables, ctx = layout(bs, groups, singles, seed=i)
    B = len(ctx)
    found = share_groups(tables, ctx - 1, bs, rows_per_group(H, KV), max_groups(B))
    lo, grp = found if found is not None else (torch.zeros(B, dtype=torch.long),
                                               torch.full((max_groups(B), rows_per_group(H, KV)), -1))
    assert (lo > 0).sum() == sum(len(c) for _, c in groups), (lo, groups)
    nslots = (int(tables[tables < 10 ** 12].max()) + 1) * bs
    kp, vp = (torch.randn(nslots, KV, hd, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, H, hd, generator=g).to(dtype)
    got = paged_decode_attention_shared(q, kp, vp, tables, ctx, lo, grp, bs, hd ** -0.5, partitions=parts,
                                        prefix_parts=pparts)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, kp, vp, tables, ctx, bs, hd ** -0.5)
    errors.append(((got.float() - want).abs() - torch.finfo(dtype).eps / 2 * want.abs()).max().item())
print(json.dumps(errors))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_shared_prefix_attention_equals_attention_over_each_rows_gathered_slots(dtype, tolerance):
    pytest.importorskip("triton")
    r = run_interpreted(SCRIPT, dtype, json.dumps(CASES))
    assert r.returncode == 0, r.stderr[-3000:]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(errors) == len(CASES)
    assert max(errors) < tolerance, list(zip(CASES, errors))


@pytest.mark.slow
def test_paged_windows_with_shared_prefixes_sample_what_they_sample_without_in_the_interpreter(tmp_path):
    """The graph path's static step (uncaptured) with the kernels, GRPO-like groups of 3 rows forked from prompts
    of 1-2 full blocks: the same tokens and log-probs with the groups' prefixes read once per group as without."""
    pytest.importorskip("triton")
    from services.rollout.testing import make_tiny_model
    model_dir = make_tiny_model(tmp_path / "m", max_position_embeddings=256)
    script = textwrap.dedent(f"""
        import asyncio
        from services.rollout.config import RolloutSettings
        from services.rollout.engine_torch.engine import TorchEngine
        from services.rollout.engine_torch.paged import cascade
        from services.rollout.engine_torch.paged.graphs import PagedGraphs
        from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
        cascade.MIN_SHARED_TOKENS = 16          # prefixes of one block take the group path here (the arithmetic)
        prompts = [list(range(3, 33)) + list(range(3, 13)), [7, 8] * 11, [9] * 7]
        def engine(shared):
            e = TorchEngine(RolloutSettings(model={{"path": {str(model_dir)!r}}},
                                            rollout=dict(kv_cache="paged", kv_block_size=16)))
            d = e._paged
            d.graphs = PagedGraphs(e.model, d.kv, width=256 // 16, scratch_block=d.pool.allocate(),
                                   max_batch_size=e.max_batch_size, use_graphs=False, kernel=True,
                                   shared_prefix=shared)
            return e
        def gen(e, **sp):
            b = GenerateBatch([PromptInput(id=str(i), prompt_ids=p) for i, p in enumerate(prompts)],
                              SamplingParams(**sp))
            return [s for r in asyncio.run(e.generate(b)) for s in r.samples]
        on, off = engine(True), engine(False)
        sp = dict(n=3, temperature=1.0, seed=5, max_tokens=10)
        a, b = gen(on, **sp), gen(off, **sp)
        assert [s.response_ids for s in a] == [s.response_ids for s in b], sp
        assert max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4
        assert on._paged.graphs.stats["shared_prefix_rows"] > 0, on._paged.graphs.stats
        assert off._paged.graphs.stats["shared_prefix_rows"] == 0
        print("ok")
    """)
    assert_printed_ok(run_interpreted(script, timeout=900))


def test_a_window_takes_the_group_path_only_where_a_shared_prefix_is_long_enough_to_pay_for_it():
    """Short shared prompts (a GRPO group's 32-token prompt) read per row cost less than the group kernel's fixed grid
    (cascade.MIN_SHARED_TOKENS): the plain path then."""
    bs = 16
    blocks = MIN_SHARED_TOKENS // bs
    prompt = torch.arange(blocks + 1)
    tables = torch.stack([torch.cat([prompt, torch.tensor([100 + r])]) for r in range(4)])
    long_lo, _ = share_groups(tables, torch.full((4,), (blocks + 1) * bs + 3), bs, per_group=4, num_groups=2)
    assert worth_sharing(long_lo) and int(long_lo.max()) == (blocks + 1) * bs
    short = torch.stack([torch.tensor([0, 1, 200 + r]) for r in range(4)])
    short_lo, _ = share_groups(short, torch.full((4,), 2 * bs + 3), bs, per_group=4, num_groups=2)
    assert int(short_lo.max()) == 2 * bs and not worth_sharing(short_lo)
    assert not worth_sharing(torch.zeros(0, dtype=torch.long))
