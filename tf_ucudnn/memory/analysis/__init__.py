"""What a step keeps alive: liveness analysis."""
