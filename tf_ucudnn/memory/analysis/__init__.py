"""What a step keeps alive: the liveness analysis of TensorFlow's graph, and XLA's own buffer
assignment of a step it compiles."""
