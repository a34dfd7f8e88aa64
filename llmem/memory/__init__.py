"""The memory floor: tensor-level models of one step. Activation recipes, bitsandbytes' quantised storage and its
transients, and the model of PyTorch's CUDA caching allocator that turns tensors into the two counters."""
