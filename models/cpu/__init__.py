"""CPU-only tricks, measured on the CPU and used only there: XLA:CPU flags, convolutions computed by taps."""
