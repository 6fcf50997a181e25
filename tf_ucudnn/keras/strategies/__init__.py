"""The decisions `MicroBatchCallback` makes once for a training run, each an object of its own
module, chosen from the options and the model when training begins (`choice.choose_strategies`)
and undoing what it changed when training ends:

    convolutions  how each convolution layer is planned (convolutions.py, profiling_budget.py)
    batch_norm    which kernel batch normalization trains with (batch_norm.py)
    memory        how the step meets a memory budget: not at all (memory.py), the whole step in
                  micro-batches (accumulation.py), or swaps and recomputations (swaps.py)
    trial         whether the planned step is timed against Keras's before it is kept
                  (step_trial.py)
    input         whether batches are copied to the GPU ahead of their steps (prefetch.py)
"""
