"""Graph passes that carry out a memory plan."""
