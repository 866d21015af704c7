"""The model runner: packs a scheduled batch, runs the forward pass (CUDA graphs for decode),
samples on the device; and the tensor-parallel runtime that runs it over several ranks."""
