"""Chain acceptance (``spec/verify.py``): greedy prefix matching, and rejection sampling
checked against its defining property (emitted tokens distributed as the target's)."""

import pytest
import torch
from sglang_m3.spec.verify import accept_greedy, accept_sampled, sample_from, target_probs

V = 7


def _logits_for(tokens: list[list[int]]) -> torch.Tensor:
    """Logits whose argmax per row is the given token."""
    out = torch.zeros(len(tokens), len(tokens[0]), V)
    for b, row in enumerate(tokens):
        for t, tok in enumerate(row):
            out[b, t, tok] = 5.0
    return out


def test_greedy_accepts_the_agreeing_prefix_and_one_bonus():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]]
    draft = torch.tensor([[1, 2, 3], [1, 6, 3], [0, 2, 3], [5, 5, 5]])
    tokens, accept_len = accept_greedy(draft, _logits_for(target))
    assert accept_len.tolist() == [4, 2, 1, 4]  # a later match after a miss does not count (row 1)
    assert tokens.tolist() == target


def test_greedy_with_one_draft_token():
    tokens, accept_len = accept_greedy(torch.tensor([[2], [3]]), _logits_for([[2, 6], [4, 6]]))
    assert accept_len.tolist() == [2, 1] and tokens[:, 0].tolist() == [2, 4]


def test_sampled_is_exact_for_one_hot_targets():
    # A deterministic target (one-hot rows) must behave exactly like greedy, whatever the coins.
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [6, 0, 0, 0]]
    probs = torch.nn.functional.one_hot(torch.tensor(target), V).float()
    draft = torch.tensor([[1, 2, 3], [1, 6, 3], [1, 2, 3]])
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(3, 4, generator=g)
        tokens, accept_len = accept_sampled(draft, probs, u[:, :3], u[:, 3])
        assert accept_len.tolist() == [4, 2, 1]
        for b, n in enumerate(accept_len.tolist()):
            assert tokens[b, :n].tolist() == target[b][:n]


def test_sampled_first_token_has_the_target_distribution():
    # Lossless speculation: the first committed token is distributed as p_0, whatever the draft.
    torch.manual_seed(0)
    p0 = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0])
    n = 40000
    probs = p0.expand(n, 2, V).clone()
    draft = torch.full((n, 1), 1)  # the draft always proposes token 1 (p = 0.2)
    u = torch.rand(n, 2)
    tokens, accept_len = accept_sampled(draft, probs, u[:, :1], u[:, 1])
    freq = torch.bincount(tokens[:, 0], minlength=V).float() / n
    assert torch.allclose(freq, p0, atol=0.01), freq  # 4 sigma at n = 40000 is ~0.01
    assert abs((accept_len == 2).float().mean().item() - 0.2) < 0.01  # accepted with probability p0(1)


def test_sample_from_inverse_cdf():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.5, 0.0, 0.5]])
    assert sample_from(probs, torch.tensor([0.3, 0.2, 0.7])).tolist() == [1, 0, 2]


@pytest.mark.parametrize(
    "top_k,top_p,min_p,kept",
    [(0, 1.0, 0.0, 7), (2, 1.0, 0.0, 2), (0, 0.6, 0.0, 2), (0, 1.0, 0.3, 3), (1, 1.0, 0.0, 1)],
)
def test_target_probs_masks(top_k, top_p, min_p, kept):
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]]))
    p = target_probs(logits, torch.tensor([1.0]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    assert int((p > 0).sum()) == kept
    assert torch.allclose(p.sum(), torch.tensor(1.0))
    assert p[0, 0] == p.max()  # the best token always survives, order is kept


def test_target_probs_unfiltered_is_the_tempered_softmax():
    """With top-k, top-p and min-p off, the unsorted path gives the filtered path's distribution."""
    torch.manual_seed(5)
    logits = torch.randn(6, 1000) * 4
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.0, 1.5, 2.0])
    off = dict(top_k=torch.full((6,), -1), top_p=torch.ones(6), min_p=torch.zeros(6))
    fast = target_probs(logits, temperature, **off, filtered=False)
    torch.testing.assert_close(fast, target_probs(logits, temperature, **off), atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(fast, torch.softmax(logits / temperature[:, None], dim=-1))
    # a filter that is on changes the distribution: the flag matters
    on = dict(off, top_p=torch.full((6,), 0.5))
    assert (target_probs(logits, temperature, **on) == 0).any()


def test_target_probs_keep_width_is_the_sorted_distribution():
    """Rows whose top-k is at most ``keep_width`` give the whole-row sort's distribution from ``torch.topk``'s
    prefix, with top-p and min-p on some rows; a width below a row's top-k would not (the bound matters)."""
    torch.manual_seed(6)
    n, vocab = 8, 5000
    logits = torch.randn(n, vocab) * 3
    temperature = torch.rand(n) + 0.5
    top_k = torch.tensor([1, 5, 20, 64, 64, 3, 40, 64])
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3, 1.0, 0.95, 0.99])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.05])
    want = target_probs(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(target_probs(logits, temperature, top_k, top_p, min_p, keep_width=64), want)
    assert ((want > 0).sum(-1) > 16).any()  # some row keeps more than a width of 16 would hold
    assert not torch.allclose(target_probs(logits, temperature, top_k, top_p, min_p, keep_width=16), want)


def test_top_k_bound_only_when_every_request_bounds_it():
    from types import SimpleNamespace

    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_m3.spec.worker import TOP_K_WIDTH_MAX, _top_k_bound

    def reqs(*params):
        return [SimpleNamespace(sampling_params=SamplingParams(**p)) for p in params]

    assert _top_k_bound(reqs({"top_k": 20}, {"temperature": 0.0}, {"top_k": 50, "top_p": 0.9})) == 50  # greedy: 1
    assert _top_k_bound(reqs({"top_k": 20}, {"temperature": 0.7})) is None  # one request samples the whole vocab
    assert _top_k_bound(reqs({"top_k": TOP_K_WIDTH_MAX + 1})) is None
    assert _top_k_bound([]) is None


def test_admission_refuses_only_custom_logit_processors():
    from sglang_m3.spec.admission import check_sampling_params

    shaped = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "logit_bias": {"5": 2.0}, "regex": "[0-9]+"}
    check_sampling_params({"temperature": 0.7, "top_p": 0.9, "min_new_tokens": 4, **shaped})
    check_sampling_params(None)
    check_sampling_params({"sampling_seed": 3}, deterministic=True)
    with pytest.raises(ValueError, match="sampling_params.sampling_seed=3 needs --enable-deterministic-inference"):
        check_sampling_params({"sampling_seed": 3})
    with pytest.raises(ValueError, match="custom_logit_processor='serialized'"):
        check_sampling_params({}, custom_logit_processor="serialized")
