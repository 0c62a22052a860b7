"""The fused LM-head log-prob path, fused/foreach AdamW selection, the one-sync grad norm, per-block compile
and the host syncs of a TrainActor step: each against the plain code it replaces (fp32, CPU)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.modeling import load_causal_lm, response_logprobs
from services.common.tensors.weights import named_weights
from services.common.tensors import fused
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model.optim import adamw_impl, build_adamw, clip_grad_norm
from services.trainer.types import ActorLoss
from services.common.tensors.compile import apply_compile, transformer_blocks
from services.trainer.testing import make_tiny_model, random_samples
from tests.interpreted import assert_printed_ok, run_interpreted



@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab_size=48)


def engine(model_path: str, **actor) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path},
                                                            "actor": {"lr": 1e-3, **actor}}))


def plain_head(hidden, weight, targets, temperature):
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, -1)
    return logp_all.gather(1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_matches_the_plain_log_softmax_in_values_and_gradients(monkeypatch, temperature):
    # A chunk of 5 rows (the budget is bytes of fp32 [rows, vocab]): 23 rows take five chunks, one partial.
    monkeypatch.setattr(fused, "CHUNK_BYTES", 5 * 4 * 50)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=g)
    gl, ge = torch.randn(23, generator=g), torch.randn(23, generator=g)
    results = []
    for fn in (plain_head, fused.head_logprobs):
        logp, ent = fn(hidden, weight, targets, temperature)
        dh, dw = torch.autograd.grad((logp * gl).sum() + (ent * ge).sum(), (hidden, weight))
        results.append((logp, ent, dh, dw))
    for want, got in zip(*results):
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_fused_response_logprobs_match_the_plain_path_on_a_model_with_ragged_rows(model_path):
    model = load_causal_lm(model_path, trainable=True)
    samples = random_samples(5, vocab_size=48, seed=4)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    adv = torch.randn(5, max(len(r) for r in responses), generator=torch.Generator().manual_seed(1))
    out = []
    for path in ("plain", "fused"):
        model.zero_grad(set_to_none=True)
        if path == "plain":
            logp, mask, ent = response_logprobs(model, prompts, responses, pad_id=0, temperature=0.9,
                                                with_entropy=True)
        else:
            fused.enable_fused_head(model)
            logp, mask, ent = fused.fused_response_logprobs(model, prompts, responses, pad_id=0,
                                                            device=torch.device("cpu"), temperature=0.9)
        ((logp * adv).sum() + 0.1 * ent.sum()).backward()
        out.append((logp.detach(), mask, ent.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (lp, mp, ep, gp), (lf, mf, ef, gf) = out
    assert torch.equal(mp, mf)
    assert (lf - lp).abs().max() < 5e-6 and (ef - ep).abs().max() < 5e-6          # a few fp32 ulps of ~4
    assert (lf[~mf] == 0).all() and (ef[~mf] == 0).all()
    for k in gp:
        assert torch.allclose(gf[k], gp[k], atol=1e-5, rtol=0), k
    # The plain forward stays what callers without logprob_index get.
    ids = torch.tensor([prompts[0] + responses[0]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 48)


def test_a_fused_training_step_equals_the_plain_one(model_path):
    plain, fast = engine(model_path, fused_logprobs=False), engine(model_path, fused_logprobs=True)
    assert (plain.rank.fused_logprobs, fast.rank.fused_logprobs) == (False, True)
    loss = ActorLoss(mini_batch_size=4, kl_coef=0.05, entropy_coef=0.01)
    for seed in (1, 2):
        samples = random_samples(8, vocab_size=48, seed=seed)
        lps = plain.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        for s, lp in zip(samples, lps):
            s.old_logprobs, s.ref_logprobs = lp, [x - 0.05 for x in lp]
        mp, mf = plain.train_actor(samples, loss), fast.train_actor(samples, loss)
        for key in ("pg_loss", "kl_loss", "entropy", "approx_kl", "clip_frac", "grad_norm", "loss"):
            assert mf[key] == pytest.approx(mp[key], abs=1e-5, rel=1e-5), key
    wp, wf = named_weights(plain.rank.actor.module), named_weights(fast.rank.actor.module)
    assert max((wp[k] - wf[k]).abs().max().item() for k in wp) < 1e-5


def test_the_fused_head_is_refused_for_heads_it_cannot_fuse(model_path):
    model = load_causal_lm(model_path)
    model.lm_head = torch.nn.Linear(64, 48, bias=True)
    assert "bias" in fused.supports_fused_head(model)
    with pytest.raises(ValueError, match="actor.fused_logprobs: lm_head has a bias"):
        fused.enable_fused_head(model)


def test_triton_kernels_match_the_torch_row_math_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    # TRITON_INTERPRET is read when the kernels are decorated: a fresh interpreter runs them on CPU tensors.
    script = textwrap.dedent("""
        import torch
        from services.common.tensors import fused
        g = torch.Generator().manual_seed(0)
        V = 5000                                     # more than one 4096-wide block per row
        logits = (3 * torch.randn(6, V, generator=g)).to(torch.bfloat16)
        targets = torch.randint(0, V, (6,), generator=g)
        gl, ge = torch.randn(6, generator=g), torch.randn(6, generator=g)
        for T in (1.0, 0.6):
            lp, ent, lse = fused.triton_rows_fwd(logits, targets, T)
            lp0, ent0, lse0 = fused.rows_fwd(logits, targets, T)
            assert (lp - lp0).abs().max() < 1e-4 and (ent - ent0).abs().max() < 1e-4, (lp - lp0, ent - ent0)
            want = fused.rows_grad(logits, targets, lse0, ent0, gl, ge, T)
            got = fused.triton_rows_bwd_(logits.clone(), targets, lse, ent, gl, ge, T).float()
            assert (got - want).abs().max() <= 1e-2 * want.abs().max(), (got - want).abs().max()
        print("ok")
    """)
    assert_printed_ok(run_interpreted(script))


def test_adamw_is_foreach_on_cpu_and_a_per_parameter_loop_for_mixed_meshes():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import torch.distributed as dist
    from services.trainer.parallel.mesh import init_distributed

    init_distributed("cpu")
    assert dist.is_initialized()
    plain = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    assert adamw_impl(plain) == "foreach"
    assert build_adamw(plain, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0).defaults["foreach"] is True
    mesh = init_device_mesh("cpu", (1,))
    dtensor = torch.nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate()]))
    assert adamw_impl([dtensor]) == "foreach"
    assert adamw_impl([dtensor, plain[0]]) == "for-loop"


def test_the_one_sync_grad_norm_equals_torchs_and_clips_the_same():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((5, 3), (7,), (2, 2, 2))]
    grads = [torch.randn(p.shape, generator=g) * 3 for p in params]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, c, gr in zip(params, copies, grads):
        p.grad, c.grad = gr.clone(), gr.clone()
    want = torch.nn.utils.clip_grad_norm_(copies, 1.5)
    got = clip_grad_norm(params, 1.5)
    assert got == pytest.approx(float(want), rel=1e-6)
    for p, c in zip(params, copies):
        assert torch.allclose(p.grad, c.grad, atol=1e-6)
    # max_norm 0 reports the norm and leaves the gradients alone; `skip` (a pipeline stage's second copy
    # of a tied weight, counted on the other stage) is left out of the norm.
    before = [p.grad.clone() for p in params]
    rest = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params[1:]]))
    assert clip_grad_norm(params, 0.0, skip=params[0]) == pytest.approx(float(rest), rel=1e-6)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_a_non_finite_gradient_norm_skips_the_step_and_keeps_the_weights(model_path):
    e = engine(model_path)
    before = {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}
    samples = random_samples(4, vocab_size=48, seed=3)
    samples[0].advantages[0] = 1e38                       # finite input, an inf gradient
    m = e.train_actor(samples, ActorLoss())
    assert m["num_skipped_steps"] == 1 and m["num_optimizer_steps"] == 0
    after = named_weights(e.rank.actor.module)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _count_host_reads(monkeypatch, optimizer) -> dict[str, int]:
    """Counts tensor-to-host reads outside optimizer.step (AdamW reads its CPU step counters there)."""
    counts = {"item": 0, "tolist": 0, "float": 0}
    paused = [False]
    for name, attr in (("item", "item"), ("tolist", "tolist"), ("float", "__float__")):
        original = getattr(torch.Tensor, attr)

        def wrapped(self, *a, _o=original, _n=name, **kw):
            counts[_n] += not paused[0]
            return _o(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, attr, wrapped)
    step = optimizer.step

    def quiet_step(*a, **kw):
        paused[0] = True
        try:
            return step(*a, **kw)
        finally:
            paused[0] = False

    monkeypatch.setattr(optimizer, "step", quiet_step)
    return counts


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("fused_logprobs", [False, True])
def test_a_train_step_reads_the_device_once_per_optimizer_step_however_many_micro_batches(
        model_path, monkeypatch, fused_logprobs):
    samples = random_samples(8, vocab_size=48, seed=5)
    reads = {}
    for budget in (100_000, 12):                          # one micro-batch per mini-batch, then about one a sample
        e = engine(model_path, micro_batch_token_budget=budget, fused_logprobs=fused_logprobs)
        with monkeypatch.context() as m:
            counts = _count_host_reads(m, e.rank.actor.optimizer)
            e.train_actor(samples, ActorLoss(mini_batch_size=4, kl_coef=0.0))
        reads[budget] = dict(counts)
    assert reads[12] == reads[100_000]
    assert reads[12]["item"] == 0
    assert reads[12]["float"] == 2                        # the grad norm of each of the 2 optimizer steps


def test_compile_wraps_every_block_in_place_and_keeps_names_and_results(model_path):
    e = engine(model_path, compile=True)
    assert all(b._compiled_call_impl is not None for b in transformer_blocks(e.rank.actor.module))
    plain = load_causal_lm(model_path, trainable=True)
    assert set(named_weights(e.rank.actor.module)) == set(named_weights(plain))
    # The wiring on the eager backend (the graphs dynamo captures, run without inductor's codegen).
    compiled = load_causal_lm(model_path, trainable=True)
    apply_compile(compiled, True, backend="eager")
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    a, b = plain(input_ids=ids).logits, compiled(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-6)
    a.sum().backward()
    b.sum().backward()
    ga, gb = dict(plain.named_parameters()), dict(compiled.named_parameters())
    assert set(ga) == set(gb)
    for k in ga:
        assert torch.allclose(ga[k].grad, gb[k].grad, atol=1e-5), k


def test_compile_default_off_on_cpu_fused_logprobs_default_on_and_packing_default_off(model_path):
    e = engine(model_path)
    assert e.rank.fused_logprobs is True and e.rank.layout.packed is False
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in transformer_blocks(e.rank.actor.module))
