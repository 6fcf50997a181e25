"""Planners for the callback's tests: one that halves every kernel, and one that leaves layers
waiting to be measured, as the profile database's planner does within a profiling budget."""

from tf_ucudnn.core.plan import KernelPlan, LayerPlan


def halving_planner(layer):
    half = layer.batch_size // 2
    halves = KernelPlan.of((half, 0), (layer.batch_size - half, 1))
    return LayerPlan(halves, halves, halves)


class PendingPlanner:
    """Leaves every layer waiting until `measure_pending`, then halves it; notes the budgets it
    was given."""

    def __init__(self):
        self.measured, self.pending, self.budgets = set(), set(), []

    def __call__(self, layer):
        if layer.name in self.measured:
            return halving_planner(layer)
        self.pending.add(layer.name)
        return "not measured yet: within the profiling budget"

    def measure_pending(self, seconds):
        self.budgets.append(seconds)
        count = len(self.pending)
        self.measured |= self.pending
        self.pending = set()
        return count
