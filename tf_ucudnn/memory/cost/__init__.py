"""What a step costs: the device model and the simulator of a step's time and peak."""
