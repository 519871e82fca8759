"""Expert-load comparisons that are exact where routing is clear and tolerant only of near-ties."""

import pytest

from llmadapt.analysis.paritycheck import expert_load_parity
from llmadapt.testing import standard_workloads

torch = pytest.importorskip("torch")

from llmadapt.adapter.moe import ExpertLoadCounter, near_tie_count


def steps(loads, ties):
    return [{"type": "step", "step": i, "expert_load": load, "expert_near_ties": tie}
            for i, (load, tie) in enumerate(zip(loads, ties))]


def test_near_ties_are_counted_at_the_top_k_boundary_only():
    logits = torch.tensor([
        [3.0, 1.0, 1.0 + 1e-6, 0.0],  # top-2: the 2nd and 3rd are within noise -> a near-tie
        [3.0, 3.0, 1.0, 0.0],         # tie inside the top 2: the chosen set is the same either way
        [3.0, 2.0, 1.0, 0.0],         # clear
    ])
    assert near_tie_count(logits, 2) == 1
    assert near_tie_count(logits, 1) == 1  # for top-1 the second row is the tie
    assert near_tie_count(logits, 4) == 0  # every expert chosen: no boundary
    assert near_tie_count(logits.to(torch.bfloat16), 2) == 1


def test_a_near_tie_may_move_but_a_clear_token_may_not():
    # Layer 0: one token moved from expert 1 to expert 2.
    a = steps([[[5, 3, 2, 6]]], [[1]])
    b_tie = steps([[[5, 2, 3, 6]]], [[1]])
    b_clear = steps([[[5, 2, 3, 6]]], [[0]])
    assert expert_load_parity(a, b_tie).ok
    report = expert_load_parity(steps([[[5, 3, 2, 6]]], [[0]]), b_clear)
    assert not report.ok and report.first_mismatch == (0, 0) and report.moved == 1 and report.allowed == 0
    assert expert_load_parity(a, b_clear).ok  # the tie was seen by one run: that is enough
    two_moved = steps([[[5, 1, 4, 6]]], [[1]])
    assert not expert_load_parity(a, two_moved).ok  # one near-tie cannot explain two moved tokens


def _router_loads(model, tokens, counter):
    counter.start_step()
    counter.counting = True
    with torch.no_grad():
        model(input_ids=tokens)
    counter.counting = False
    load, ties = counter.counts.tolist(), counter.ties.tolist()
    return steps([load], [ties])


def test_a_wrong_router_fails_while_fp_noise_passes():
    """The canonical tiny Mixtral: fp32 noise in the router weights (what a different reduction order does)
    passes; a real routing bug (two experts' router rows swapped) fails."""
    from transformers import AutoModelForCausalLM

    from llmadapt.models import canonical_checkpoint

    w = standard_workloads()["moe"]
    model = AutoModelForCausalLM.from_pretrained(str(canonical_checkpoint(w.model, w.seed)), dtype=torch.float32)
    counter = ExpertLoadCounter(model, w.model.num_experts)
    tokens = torch.randint(0, w.model.vocab_size, (4, w.train.seq_len), generator=torch.Generator().manual_seed(0))
    reference = _router_loads(model, tokens, counter)

    gates = [m for n, m in model.named_modules() if n.endswith("gate") and hasattr(m, "weight")]
    assert gates, "no router found in the tiny Mixtral"
    with torch.no_grad():
        for gate in gates:  # relative noise of 1e-7: float32 rounding, not a different model
            gate.weight.mul_(1 + 1e-7 * torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(1)))
    noisy = _router_loads(model, tokens, counter)
    assert expert_load_parity(reference, noisy).ok

    with torch.no_grad():
        for gate in gates:
            gate.weight[[0, 1]] = gate.weight[[1, 0]].clone()
    wrong = _router_loads(model, tokens, counter)
    report = expert_load_parity(reference, wrong)
    assert not report.ok, report.describe()
    assert report.moved > report.allowed
