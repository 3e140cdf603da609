"""Stand-ins for the hardware boundary only (NVML, CUDA allocator readings)."""
