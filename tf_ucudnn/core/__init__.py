"""Plain data every layer shares: plans, geometry, convolution layers, sizes and errors."""
