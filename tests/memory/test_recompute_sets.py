"""How a set of recomputations combines, worked out from the set with one tensor fewer (the way
the greedy search's options grow its round's set), against working it out from scratch."""

import numpy as np

from tf_ucudnn.memory.analysis.tensor_use import TensorUse
from tf_ucudnn.memory.search.greedy import Recomputing


def _random_recomputing(rng, count: int) -> Recomputing:
    """Tensors in a chain of ops, each recomputation reading a few earlier tensors (some
    through an alias), some sharing their producer and first backward reader (ties)."""
    tensors, producer = [], 0
    for i in range(count):
        producer += int(rng.random() < 0.5)
        first_backward = 3 * count - producer
        tensors.append(TensorUse(f"t{i}", int(rng.integers(1, 100)), producer,
                                 (producer + 1, first_backward), (first_backward,)))
    reads, direct = {}, {}
    for i, tensor in enumerate(tensors):
        earlier = [t.name for t in tensors[max(0, i - 4):i]]
        reads[tensor.name] = frozenset(rng.choice(earlier, int(rng.integers(0, 3)))) \
            if earlier else frozenset()
        direct[tensor.name] = frozenset(r for r in reads[tensor.name] if rng.random() < 0.9)
    return Recomputing({t.name: t for t in tensors},
                       {t.name: float(rng.uniform(0.01, 1.0)) for t in tensors}, reads, direct,
                       {t.name: int(rng.integers(0, 50)) for t in tensors})


def test_a_set_grown_by_one_combines_as_the_set_worked_out_from_scratch(monkeypatch):
    rng = np.random.default_rng(5)
    from_scratch = []
    monkeypatch.setattr(Recomputing, "_combine",
                        lambda self, chosen, combine=Recomputing._combine:
                        from_scratch.append(chosen) or combine(self, chosen))
    grown = valid = 0
    for _ in range(200):
        recomputing = _random_recomputing(rng, int(rng.integers(2, 30)))
        names = list(recomputing.by_name)
        rounds = list(rng.permutation(names)[:int(rng.integers(1, len(names)))])
        swapped = set(rng.choice(names, 3))
        for size in range(1, len(rounds)):
            before = rounds[:size]
            if recomputing.decisions(before, swapped) is None:
                break
            for added in rng.choice([n for n in names if n not in before], 2):
                option = [*before, str(added)]
                scratch_calls = len(from_scratch)
                found = recomputing.decisions(option, swapped)
                grown += len(from_scratch) == scratch_calls
                expected = _fresh(recomputing).decisions(option, swapped)
                assert found == expected
                valid += found is not None
    assert grown > 500 and valid > 500


def _fresh(recomputing: Recomputing) -> Recomputing:
    """The same recomputations, with nothing worked out yet."""
    return Recomputing(recomputing.by_name, recomputing.cost_ms, recomputing.reads,
                       recomputing.direct_reads, recomputing.transient_bytes)
