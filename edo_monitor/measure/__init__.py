"""What the readings mean: bytes by module and category, fragmentation, out-of-memory
messages, lookup frequencies. Takes in the model, the optimizer and raw readings; hands on
numbers."""
