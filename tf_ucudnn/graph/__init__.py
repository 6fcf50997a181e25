"""Graph passes: finding the convolutions of a graph (and, later, rewriting them)."""
